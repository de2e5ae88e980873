"""grpo/episodes/environments.py: TRL's environment_factory on the scripted engines of test_tools.py (no model, no
vLLM): one instance per episode, reset with its row and its group's seed, its methods the tools, the observation in
the prompt; faults of the environment against the model's; every instance released; the recipe's baseline, loss
and stop for failed episodes; step rewards and the three advantage modes, each turn's advantage on its own tokens."""

import time
from types import SimpleNamespace

import pytest
import torch
import toy_environments
from recipe_runs import launch
from test_tools import Sampling, ScriptedEngine, tokenizer  # noqa: F401 - the fixture

from grpo.config import ConfigError, ToolCallingSettings, load_config
from grpo.data import (
    USER_TEXT,
    group_advantages,
    score,
    state_advantages,
    token_advantages,
    turn_advantages,
    turn_anchors,
    turn_returns,
)
from grpo.engines.interface import Sample
from grpo.episodes import environments
from grpo.episodes.environments import EnvironmentEngine, EnvironmentFailing, check_reset_arguments, load_environment
from grpo.episodes.metrics import tool_stats
from grpo.faults import stop_if_environment_failing
from grpo.loss import LossSettings, grpo_loss
from grpo.metrics import tool_metrics


def guess(number, name="guess", argument="number"):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"{argument}": {number}}}}}\n</tool_call>'


@pytest.fixture(autouse=True)
def fresh_instances():
    toy_environments.BUILT.clear()
    toy_environments.CloseHangs.release.clear()
    yield
    toy_environments.CloseHangs.release.set()  # a hung close() left on its thread returns


def env_engine(tokenizer, env_class, turns=(), engine=None, **settings):  # noqa: F811
    environment = load_environment(f"toy_environments:{env_class}")
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(
            **settings.pop("tool_calling", {}), schedule=settings.pop("schedule", "per_episode")
        ),
        max_tool_calling_iterations=settings.pop("max_tool_calling_iterations", None),
        max_completion_length=settings.pop("max_completion_length", 96),
        data=SimpleNamespace(max_prompt_length=settings.pop("max_prompt_length", 256)),
    )

    def render(row, observation):
        messages = [{"role": "user", "content": row[USER_TEXT] + observation}]
        text = tokenizer.apply_chat_template(
            messages, tools=environment.described, add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False).input_ids

    engine = engine or ScriptedEngine(tokenizer, list(turns))
    return EnvironmentEngine(engine, tokenizer, environment, cfg, render)


def make_rows(engine, questions):
    return [
        {"question": q, "prompt": q, USER_TEXT: q, "prompt_ids": engine.render({USER_TEXT: q}, "")} for q in questions
    ]


class ScriptedServer(ScriptedEngine):
    """`ScriptedEngine` as a server engine (`send` / `receive`): each episode runs on a thread of its own."""

    def send(self, prompt_ids, sampling, seeds=None, routes=None):
        return self.generate(prompt_ids, sampling)

    def receive(self, pending):
        return pending

    def close(self):
        self.closed = True


def test_each_episode_has_its_own_instance_reset_with_its_row_its_methods_the_tools(tokenizer):  # noqa: F811
    engine = env_engine(tokenizer, "SecretNumber", [guess(50), "#### done"])
    rows = make_rows(engine, ["find it", "find it again"])
    samples = engine.generate(rows, Sampling(n=3, max_tokens=96))
    assert len(samples) == 6 and [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    instances = [s.environment for s in samples]
    assert len({id(e) for e in instances}) == 6 and instances == toy_environments.BUILT[1:]  # [0]: the probe
    for sample, env in zip(samples, instances):
        row = rows[sample.prompt_index]
        assert env.reset_kwargs["question"] == row["question"] and "prompt_ids" not in env.reset_kwargs
        assert env.guesses == [50]  # the episode's call went to its own instance
        # the observation follows the user message, rendered by the chat template
        assert sample.prompt_ids == engine.render(row, f" (secret drawn: {env.secret})")
        answer = "right" if env.secret == 50 else ("higher" if env.secret > 50 else "lower")
        assert f"<tool_response>\n{answer}\n</tool_response>" in tokenizer.decode(sample.completion_ids)
        assert sample.turn_rewards == [1.0 if env.secret == 50 else 0.0, 0.0]
        assert (sample.tool_calls, sample.tool_failures, sample.env_failure) == (1, 0, None)
        assert env.closed == 0
    # reward functions get environments=, one per completion (TRL's keyword)
    rewards, _ = score(
        {"found": lambda environments, **kw: [float(e.secret > 50) for e in environments]}, rows, samples
    )
    assert rewards.tolist() == [float(e.secret > 50) for e in instances]
    engine.release(samples)
    engine.release(samples)
    assert [e.closed for e in instances] == [1] * 6 and not engine.open  # each closed once


def test_the_group_seed_gives_a_prompts_episodes_one_initial_state(tokenizer, monkeypatch):  # noqa: F811
    """reset gets one seed per prompt: the four episodes of a prompt draw the same secret, and the same seeds come
    again from the same RNG state. The control: reset without the seed (each instance draws its own) gives the
    episodes of a prompt different secrets."""
    engine = env_engine(tokenizer, "SecretNumber", ["#### 50"])
    rows = make_rows(engine, ["a", "b", "c"])

    def secrets():
        torch.manual_seed(7)
        samples = engine.generate(rows, Sampling(n=4, max_tokens=16))
        return [[s.environment.secret for s in samples[i : i + 4]] for i in range(0, 12, 4)]

    grouped = secrets()
    assert all(len(set(group)) == 1 for group in grouped) and len({g[0] for g in grouped}) > 1
    assert secrets() == grouped  # reproducible from the process's RNG (a resumed run draws them again)
    seeds = {s.reset_kwargs["seed"] for s in toy_environments.BUILT[1:13]}
    assert len(seeds) == 3

    unseeded = environments.reset_arguments
    monkeypatch.setattr(environments, "reset_arguments", lambda row, seed: {**unseeded(row, seed), "seed": None})
    assert not all(len(set(group)) == 1 for group in secrets())


def test_the_models_faults_are_error_results_the_environments_fail_the_episode(tokenizer):  # noqa: F811
    """An unknown method, arguments the method does not take and a ValueError it raises (TRL's way to refuse a
    move) are the model's: error results, the episode goes on (the control). A reset that raises, a step that raises
    an OSError, a step that hangs and a non-finite step reward are the environment's: the episode ends there,
    failed, its instance kept for release."""
    calls = guess(1, name="peek") + guess(1, argument="numbr") + guess(150)
    model_faults = env_engine(tokenizer, "SecretNumber", [calls, "#### done"], max_completion_length=400)
    sample = model_faults.generate(make_rows(model_faults, ["q"]), Sampling(n=2, max_tokens=400))[0]
    assert (sample.tool_calls, sample.tool_failures, sample.env_failure) == (3, 3, None)
    text = tokenizer.decode(sample.completion_ids)
    assert "'peek' not found" in text and "ValueError: 150 is not from 0 to 99" in text
    assert max(sample.turn_of_token) == 2

    cases = {
        "ResetRaises": "reset raised ConnectionError: sandbox preempted",
        "GuessRaises": "step guess raised ConnectionError: sandbox preempted",
        "GuessHangs": "step 'guess' ran past tool_calling.timeout_s=0.3",
        "BadReward": "step 'guess' returned the reward nan, not a finite number",
    }
    for env_class, failure in cases.items():
        engine = env_engine(tokenizer, env_class, [guess(5), "#### done"], tool_calling={"timeout_s": 0.3})
        start = time.perf_counter()
        samples = engine.generate(make_rows(engine, ["q"]), Sampling(n=2))
        assert time.perf_counter() - start < 5
        for sample in samples:
            assert sample.env_failure == failure, env_class
            assert max(sample.turn_of_token, default=0) == (0 if env_class == "ResetRaises" else 1)
            assert sample.environment is not None
        if env_class == "ResetRaises":  # nothing sampled: one masked token, so the group keeps its size
            assert samples[0].completion_ids == [tokenizer.eos_token_id] and samples[0].tool_mask == [0]
        assert engine.failure_streak() == (2, failure)
        engine.release(samples)
        assert all(s.environment.closed == 1 for s in samples)


class FailsOnTurn(ScriptedEngine):
    """A scripted engine that raises on the request of turn ``turn`` (the server gone, a bug in the trainer)."""

    def __init__(self, tokenizer, turns, turn):  # noqa: F811
        super().__init__(tokenizer, turns)
        self.turn = turn

    def generate(self, prompt_ids, sampling, use_tqdm=False):
        if len(self.requests) + 1 == self.turn:
            raise RuntimeError("the engine failed")
        return super().generate(prompt_ids, sampling, use_tqdm)


def test_every_instance_is_released_however_its_episode_ends(tokenizer):  # noqa: F811
    """Released after scoring (normally, after a model's error result, a hung step, the budget's end), at once when
    the rollout raises, and by the engine's close for episodes still running (the stop signal's path). A close()
    that hangs is left on its thread and counted; the control, a close that returns, is not counted."""
    ends = {
        "normal": env_engine(tokenizer, "SecretNumber", [guess(5), "#### done"]),
        "error result": env_engine(tokenizer, "SecretNumber", [guess(5, name="peek"), "#### done"]),
        "hung step": env_engine(tokenizer, "GuessHangs", [guess(5)], tool_calling={"timeout_s": 0.2}),
        "budget": env_engine(tokenizer, "SecretNumber", [guess(5), "#### done"], max_completion_length=40),
    }
    for why, engine in ends.items():
        samples = engine.generate(make_rows(engine, ["q"]), Sampling(n=2, max_tokens=40))
        assert all(s.environment.closed == 0 for s in samples), why
        if why == "budget":
            assert all(s.truncated for s in samples)
        engine.release(samples)
        assert all(s.environment.closed == 1 for s in samples) and not engine.open, why

    toy_environments.BUILT.clear()
    failing = env_engine(tokenizer, "SecretNumber", engine=FailsOnTurn(tokenizer, [guess(5), "#### done"], turn=2))
    with pytest.raises(RuntimeError, match="the engine failed"):
        failing.generate(make_rows(failing, ["q", "r"]), Sampling(n=2))
    assert [e.closed for e in toy_environments.BUILT] == [1] * 5 and not failing.open  # the probe and four

    # a server rollout still running (a step hanging) when the engine closes, as a stop signal's path closes it
    toy_environments.BUILT.clear()
    hanging = ScriptedServer(tokenizer, [guess(5)])
    server = env_engine(tokenizer, "GuessHangs", engine=hanging, tool_calling={"timeout_s": 5})
    pending = server.send(make_rows(server, ["q"]), Sampling(n=2, max_tokens=96))
    deadline = time.monotonic() + 5
    while len(server.open) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.open) == 2 and not pending.episodes.done()
    server.close()
    assert [e.closed for e in toy_environments.BUILT[1:]] == [1, 1] and not server.open

    for env_class, counted in (("CloseHangs", 1), ("SecretNumber", 0)):
        engine = env_engine(tokenizer, env_class, ["#### done"], tool_calling={"timeout_s": 0.3})
        samples = engine.generate(make_rows(engine, ["q"]), Sampling(n=1))
        start = time.perf_counter()
        engine.release(samples)
        assert time.perf_counter() - start < 3 and engine.close_failures == counted and not engine.open


def recipe_run(*overrides, reward=None):
    cfg = load_config(None, ["environment_factory=toy_environments:SecretNumber", "num_generations=4", *overrides])
    reward = reward or (lambda completions, **columns: [1.0, 0.0, 1.0, 0.0][: len(completions)])
    return SimpleNamespace(cfg=cfg, reward_funcs={"reward": reward}, last_checkpoint=None, pad_id=0, device="cpu")


def episode(turns, failure=None, steps=None):
    """A sample of ``turns`` model turns of two tokens each, one tool token between two turns."""
    ids, turn_of = [], []
    for turn in range(1, turns + 1):
        turn_of += [turn, turn] + ([0] if turn < turns else [])
    ids = [5] * len(turn_of)
    sample = Sample([1, 2], ids, "", [-0.5] * len(ids), False, 0)
    sample.tool_mask, sample.turn_of_token = [int(t > 0) for t in turn_of], turn_of
    sample.turn_rewards = steps if steps is not None else [0.0] * turns
    sample.env_failure = failure
    return sample


def test_a_failed_episode_is_left_out_of_the_baseline_and_the_loss_and_counted():
    """One group of four, the last one's environment failed: it is never scored (the reward function sees three
    completions), its reward is NaN, the baseline is the other three's and its loss mask is 0. The control, the
    same episode not failed: scored 0.0 and in the baseline (mean 1/2), which moves the others' advantages."""
    import grpo_qwen3_4b as recipe

    rows = [{"prompt": "p", "prompt_ids": [1, 2]}]
    seen = []
    run = recipe_run(
        reward=lambda completions, **kw: seen.append(len(completions)) or [1.0, 0.0, 1.0, 0.0][: len(completions)]
    )
    failed = [episode(2) for _ in range(3)] + [episode(2, failure="reset raised ConnectionError: preempted")]
    rewards, advantages = recipe.rewards_and_advantages(run, rows, failed, 1)
    kept = torch.tensor([1.0, 0.0, 1.0])
    assert seen == [3] and rewards[:3].tolist() == [1, 0, 1] and rewards[3].isnan()
    assert advantages[3] == 0 and torch.allclose(advantages[:3], (kept - 2 / 3) / (kept.std() + 1e-4))
    batch = recipe.training_batch(run, failed, advantages)
    assert batch["response_mask"][3].sum() == 0 and batch["response_mask"][0].sum() == 4
    metrics = tool_metrics({**tool_stats(failed), "tool_drifted": 0.0})
    assert metrics["env/failure_frequency"] == 0.25

    control = [episode(2) for _ in range(4)]
    rewards, advantages = recipe.rewards_and_advantages(run, rows, control, 1)
    assert rewards.tolist() == [1, 0, 1, 0] and advantages[1] == pytest.approx(-0.5 / rewards.std().item(), rel=1e-3)
    assert not torch.allclose(advantages[:3], (kept - 2 / 3) / (kept.std() + 1e-4))


def test_the_run_stops_past_max_consecutive_failures(tokenizer):  # noqa: F811
    """Four failed resets in a row: at a limit of 4 (the control) nothing stops; over a limit of 3 the stop is one
    line naming the count, the limit and the last failure. A succeeding episode ends a run of failures."""
    engine = env_engine(tokenizer, "ResetRaises", ["#### done"])
    engine.generate(make_rows(engine, ["q"]), Sampling(n=4))
    stop_if_environment_failing(engine, 4, None)
    with pytest.raises(EnvironmentFailing) as stopped:
        engine.generate(make_rows(engine, ["q"]), Sampling(n=1))
        stop_if_environment_failing(engine, 4, None)  # the run goes on: five in a row
    assert "\n" not in str(stopped.value)
    assert str(stopped.value).startswith(
        "5 environment episodes in a row failed, more than tool_calling.max_consecutive_failures=4 (the last on this "
        "process: reset raised ConnectionError: sandbox preempted)"
    )
    counting = env_engine(tokenizer, "SecretNumber", ["#### done"])
    counting._count_failures([episode(1, "x"), episode(1), episode(1, "x"), episode(1, "x"), episode(1)])
    assert counting.failure_streak() == (2, "x") and counting.streak == 0
    assert counting.failure_streak() == (0, "x")


def loss_and_grad(batch):
    """The GRPO loss of a batch at fixed log-probs, its gradient and its statistics."""
    logps = torch.full(batch["response_mask"].shape, -0.4, requires_grad=True)
    mask, settings = batch["response_mask"], LossSettings(vllm_importance_sampling_correction=False)
    loss, stats = grpo_loss(
        logps, logps.detach() + 0.01, batch["advantages"], mask, settings, num_items_in_batch=mask.sum().item()
    )
    loss.backward()
    return loss, logps.grad, stats


def test_advantage_episode_is_the_old_path_loss_gradients_and_statistics_bit_for_bit():
    """advantage=episode (the default): the advantages are `group_advantages` of the scored rewards as before, and
    the loss, its gradient and its statistics equal the old path's bit for bit, on tool episodes (no environment)
    and on environment episodes without step rewards. The control: advantage=turn with gamma 0.5 gives another
    loss on the same episodes."""
    import grpo_qwen3_4b as recipe

    rows = [{"prompt": "p", "prompt_ids": [1, 2]}]
    for environment in (False, True):
        samples = [episode(t) for t in (1, 2, 3, 2)]
        if not environment:
            for s in samples:
                s.turn_rewards = None
        run = recipe_run("tools=[grpo.tasks.tool_functions:calculator]")
        rewards, advantages = recipe.rewards_and_advantages(run, rows, samples, 1)
        old_rewards = score(run.reward_funcs, rows, samples)[0]
        old = group_advantages(old_rewards, 4, "group")
        assert torch.equal(rewards, old_rewards) and torch.equal(advantages, old)
        batch = recipe.training_batch(run, samples, advantages)
        old_batch = recipe.training_batch(run, samples, old)
        loss, grad, stats = loss_and_grad(batch)
        old_loss, old_grad, old_stats = loss_and_grad(old_batch)
        assert torch.equal(loss, old_loss) and torch.equal(grad, old_grad)
        assert all(torch.equal(stats[k], old_stats[k]) for k in stats)

    turn = recipe_run("advantage=turn", "gamma=0.5")
    rewards, per_turn = recipe.rewards_and_advantages(turn, rows, samples, 1)
    turn_loss, _, _ = loss_and_grad(recipe.training_batch(turn, samples, per_turn))
    assert not torch.equal(turn_loss, loss)


def test_turn_returns_and_their_group_baselines():
    """Discounted returns from each turn (the outcome on the last turn); with one turn per episode the turn
    advantages are `group_advantages`; a turn's baseline is its group's turns of the same number."""
    assert turn_returns([0.0, 1.0, 0.0], 2.0, 0.5) == [0.5 * 1.0 + 0.25 * 2.0, 1.0 + 0.5 * 2.0, 2.0]
    assert turn_returns([], 1.0, 0.9) == []
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.0])
    single = turn_advantages([[r] for r in rewards.tolist()], 4, "group")
    assert torch.allclose(torch.tensor(single).flatten(), group_advantages(rewards, 4, "group"))
    per_turn = turn_advantages([[1.0, 1.0], [0.0], [0.0, 3.0], [1.0]], 4, "none")
    assert per_turn == [[0.5, -1.0], [-0.5], [-0.5, 1.0], [0.5]]  # turn 2: the mean of 1.0 and 3.0
    excluded = turn_advantages([[1.0, 1.0], [0.0], [0.0, 3.0], [1.0]], 4, "none", torch.tensor([0, 0, 1, 0]).bool())
    assert excluded[2] == [0.0, 0.0] and excluded[0][1] == 0.0


def test_each_turns_advantage_lands_on_that_turns_tokens_only():
    """Three turns of two tokens with a tool token between them, advantages 1, 2, 3: every model token carries its
    own turn's, the tool tokens 0, and the gradient of the loss is the turn's advantage on its tokens (times the
    token weight). The control, the assignment off by one turn (each token given the turn before's, the bug class
    where the wrong step's advantage trains a turn), fails the same check."""
    sample = episode(3)
    turn_of = torch.tensor([sample.turn_of_token])
    expected = torch.tensor([[1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 3.0, 3.0]])
    assert torch.equal(token_advantages([[1.0, 2.0, 3.0]], turn_of), expected)
    misaligned = token_advantages([[1.0, 2.0, 3.0]], (turn_of - 1).clamp(min=0))
    assert not torch.equal(misaligned, expected)

    import grpo_qwen3_4b as recipe

    run = recipe_run("advantage=turn")
    batch = recipe.training_batch(run, [sample], [[1.0, 2.0, 3.0]])
    assert torch.equal(batch["advantages"], expected)
    logps = torch.full(batch["response_mask"].shape, -0.4, requires_grad=True)
    settings, mask = LossSettings(vllm_importance_sampling_correction=False), batch["response_mask"]
    loss, _ = grpo_loss(
        logps, logps.detach(), batch["advantages"], mask, settings, num_items_in_batch=mask.sum().item()
    )
    loss.backward()
    grad = -logps.grad[0] / logps.grad[0, 0].neg()  # per-token gradient, in units of turn 1's
    assert torch.allclose(grad, expected[0])


def observed_episode(observations, steps, prompt=(1, 2), failure=None):
    """A sample of one model turn more than ``observations``, two tokens each, the tool tokens ``observations[t]``
    (the observation turn t + 2 answers) between turns t + 1 and t + 2; ``steps`` the turns' step rewards."""
    ids, turn_of = [7, 7], [1, 1]
    for turn, observation in enumerate(observations, start=2):
        ids += [*observation, 7, 7]
        turn_of += [0] * len(observation) + [turn, turn]
    sample = Sample(list(prompt), ids, "", [-0.5] * len(ids), False, 0)
    sample.tool_mask, sample.turn_of_token = [int(t > 0) for t in turn_of], turn_of
    sample.turn_rewards, sample.env_failure = list(steps), failure
    return sample


X, Y, Z = (60, 61), (62, 63), (59, 60, 61)  # Z ends with X: a state of its own all the same


def state_group(failure=None):
    """One group of four: A sees X then Y; B sees Y at its turn 2 (A's turn 3); C sees X; D sees Z, alone. With the
    reward function's outcomes 1, 0, 1, 0 and gamma 0.5 the turn returns are A [0.5, 1.0, 1.0], B [0, 0],
    C [1.125, 1.25], D [0, 0]; the episode rewards (outcome plus step rewards) 1.5, 0, 1.75, 0."""
    return [
        observed_episode([X, Y], [0.0, 0.5, 0.0]),
        observed_episode([Y], [0.0, 0.0]),
        observed_episode([X], [0.5, 0.25], failure=failure),
        observed_episode([Z], [0.0, 0.0]),
    ]


STATE_RETURNS = [[0.5, 1.0, 1.0], [0.0, 0.0], [1.125, 1.25], [0.0, 0.0]]
# step groups: the prompt {A1, B1, C1, D1} (mean 0.40625), X {A2, C2} (mean 1.125), Y {A3, B2} (mean 0.5), Z {D2}
STATE_STEP = [[0.09375, -0.125, 0.5], [-0.40625, -0.5], [0.71875, 0.125], [-0.40625, 0.0]]


def test_state_step_groups_are_the_turns_that_answered_the_same_observation():
    """advantage=state's anchors: turn 1 the prompt ids, turn t >= 2 the tool tokens just before it, whole; the step
    groups are a group's turns with identical anchors at any turn number (B's turn 2 with A's turn 3), a turn alone
    in its step group gets 0 (D's turn 2: Z only ends with X). The controls: the same returns grouped by turn number
    (advantage=turn) give other advantages, and episodes whose anchors all differ (their own prompts and
    observations) get no step-level term."""
    samples = state_group()
    assert turn_anchors(samples[0]) == [(1, 2), X, Y] and turn_anchors(samples[3]) == [(1, 2), Z]
    anchors = [turn_anchors(s) for s in samples]
    assert state_advantages(STATE_RETURNS, anchors, 4, "none") == STATE_STEP
    assert turn_advantages(STATE_RETURNS, 4, "none") != STATE_STEP
    scaled = state_advantages(STATE_RETURNS, anchors, 4, "group")
    assert scaled[0][1] == pytest.approx(-0.125 / (torch.tensor([1.0, 1.25]).std().item() + 1e-4))
    assert scaled[3][1] == 0.0
    batch_std = torch.tensor([r for turns in STATE_RETURNS for r in turns]).std().item()
    assert state_advantages(STATE_RETURNS, anchors, 4, "batch")[1][1] == pytest.approx(-0.5 / (batch_std + 1e-4))

    apart = [observed_episode([(80 + i, 81)], [0.0, 0.0], prompt=(1, 2, 3 + i)) for i in range(3)] + [
        observed_episode([(90,), (91,)], [0.0, 0.0, 0.0], prompt=(1, 2, 9))
    ]
    returns = [[0.5, 1.0], [0.0, 2.0], [1.0, 1.0], [0.0, 3.0, 1.0]]
    assert state_advantages(returns, [turn_anchors(s) for s in apart], 4, "group") == [[0.0] * len(r) for r in returns]


def test_state_advantages_against_a_hand_computation_each_on_its_turns_tokens():
    """Through the recipe (scale_rewards none, gamma 0.5, state_advantage_weight 0.5): each turn's advantage is the
    episode's (its reward 1.5, 0, 1.75, 0 minus their mean 0.8125) plus half its step-level one, computed by hand,
    and it lands on that turn's model tokens only, the tool tokens 0."""
    import grpo_qwen3_4b as recipe

    rows = [{"prompt": "p", "prompt_ids": [1, 2]}]
    run = recipe_run("advantage=state", "gamma=0.5", "state_advantage_weight=0.5", "scale_rewards=none")
    samples = state_group()
    rewards, advantages = recipe.rewards_and_advantages(run, rows, samples, 1)
    assert rewards.tolist() == [1.5, 0.0, 1.75, 0.0]
    episode_advantages = [0.6875, -0.8125, 0.9375, -0.8125]
    expected = [[e + 0.5 * a for a in step] for e, step in zip(episode_advantages, STATE_STEP)]
    assert advantages == expected
    assert expected[0] == [0.734375, 0.625, 0.9375]

    batch = recipe.training_batch(run, samples, advantages)
    a1, a2, a3 = expected[0]
    assert batch["advantages"][0].tolist() == [a1, a1, 0, 0, a2, a2, 0, 0, a3, a3]
    b1, b2 = expected[1]
    assert batch["advantages"][1].tolist() == [b1, b1, 0, 0, b2, b2] + [0] * 4


def test_state_advantage_weight_0_is_advantage_episode_bit_for_bit():
    """state_advantage_weight 0: the per-token advantages on model tokens, the loss, its gradient and its statistics
    equal advantage=episode's bit for bit (environment episodes with step rewards). The control: weight 0.5 gives
    another loss."""
    import grpo_qwen3_4b as recipe

    rows = [{"prompt": "p", "prompt_ids": [1, 2]}]
    samples = state_group()
    runs = {
        name: recipe_run(*overrides, "gamma=0.5")
        for name, overrides in (
            ("episode", ["advantage=episode"]),
            ("weight 0", ["advantage=state", "state_advantage_weight=0"]),
            ("weight 0.5", ["advantage=state", "state_advantage_weight=0.5"]),
        )
    }
    batches = {
        name: recipe.training_batch(run, samples, recipe.rewards_and_advantages(run, rows, samples, 1)[1])
        for name, run in runs.items()
    }
    mask = batches["episode"]["response_mask"]
    assert torch.equal(batches["weight 0"]["advantages"] * mask, batches["episode"]["advantages"][:, None] * mask)
    loss, grad, stats = loss_and_grad(batches["weight 0"])
    old_loss, old_grad, old_stats = loss_and_grad(batches["episode"])
    assert torch.equal(loss, old_loss) and torch.equal(grad, old_grad)
    assert all(torch.equal(stats[k], old_stats[k]) for k in stats)
    assert not torch.equal(loss_and_grad(batches["weight 0.5"])[0], loss)


def test_an_excluded_episode_is_in_no_state_step_group():
    """C's environment failed: C gets 0 on every turn and is in no step group, so A's turn 2 is alone with X (0)
    and the prompt's step group is A, B and D (mean 1/6); in the recipe its episode advantage is 0 as well. The
    control is the first step-group test: with C kept, A's turn 2 gets -0.125."""
    samples = state_group()
    anchors = [turn_anchors(s) for s in samples]
    excluded = torch.tensor([False, False, True, False])
    step = state_advantages(STATE_RETURNS, anchors, 4, "none", excluded)
    assert step[2] == [0.0, 0.0] and step[0][1] == 0.0
    assert step[0][0] == pytest.approx(0.5 - 0.5 / 3) and step[1] == pytest.approx([-0.5 / 3, -0.5])

    import grpo_qwen3_4b as recipe

    run = recipe_run("advantage=state", "gamma=0.5", "scale_rewards=none")
    failed = state_group(failure="reset raised ConnectionError: preempted")
    _, advantages = recipe.rewards_and_advantages(run, [{"prompt": "p", "prompt_ids": [1, 2]}], failed, 1)
    assert advantages[2] == [0.0, 0.0]


def test_a_bad_environment_is_refused_in_one_line_naming_it(tokenizer):  # noqa: F811
    with pytest.raises(ConfigError, match="toy_environments:NoSeed.*takes no 'seed'"):
        load_environment("toy_environments:NoSeed")
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_environment("toy_environments:Missing")
    environment = load_environment("toy_environments:SecretNumber")
    check_reset_arguments(environment, {"question": "q", "prompt_ids": [1]})
    with pytest.raises(ConfigError, match="agent=.*and environment_factory=.*together"):
        load_config(None, ["environment_factory=toy_environments:SecretNumber", "agent=a:b"])
    for mode in ("turn", "state"):
        with pytest.raises(ConfigError, match=f"advantage='{mode}' .*set tools or environment_factory"):
            load_config(None, [f"advantage={mode}"])


@pytest.mark.parametrize("schedule", ["per_episode", "per_turn"])
def test_on_a_server_the_episodes_are_the_colocated_ones(tokenizer, schedule):  # noqa: F811
    """A server engine (`send` / `receive`, as the asynchronous queue calls it), episode by episode or turn by turn:
    the same episodes, tools and step rewards as the colocated loop, the group seeds drawn first from the same RNG
    state; a failed start still carries a version."""
    turns = [guess(50), "#### done"]

    def run(engine):
        torch.manual_seed(3)
        samples = engine.receive(engine.send(make_rows(engine, ["q", "r"]), Sampling(n=2)))
        return [(s.prompt_ids, s.completion_ids, s.turn_rewards, s.environment.secret) for s in samples]

    colocated = env_engine(tokenizer, "SecretNumber", turns)
    torch.manual_seed(3)
    expected = colocated.generate(make_rows(colocated, ["q", "r"]), Sampling(n=2))
    expected = [(s.prompt_ids, s.completion_ids, s.turn_rewards, s.environment.secret) for s in expected]
    server = env_engine(tokenizer, "SecretNumber", engine=ScriptedServer(tokenizer, turns), schedule=schedule)
    assert run(server) == expected
    failing = env_engine(tokenizer, "ResetRaises", engine=ScriptedServer(tokenizer, turns), schedule=schedule)
    samples = failing.receive(failing.send(make_rows(failing, ["q"]), Sampling(n=2)))
    assert [s.versions for s in samples] == [[0], [0]] and all(s.env_failure for s in samples)


def test_a_run_with_an_environment_trains_then_stops_in_one_line_when_it_keeps_failing(tmp_path, tiny_tool_model):
    """The tool task with its calculator as an environment (grpo.tasks.environments:Calculator, as README's command
    runs it; here its sandbox preempted after 16 episodes a process: tests/toy_environments.py) and advantage=turn,
    2 processes: rollout step 1 trains, every turn on-policy and equal to the engine (fp32), no episode failed;
    then every reset of each process raises, 16 in a row on each, past tool_calling.max_consecutive_failures=8: the
    run stops before step 2's update, in one line, with step 1's checkpoint."""
    overrides = [
        "tools=null",
        "environment_factory=toy_environments:PreemptedCalculator",
        "advantage=turn",
        "gamma=0.9",
        "tool_calling.max_consecutive_failures=8",
        "save_steps=2",
        "max_completion_length=48",
        "data.max_prompt_length=64",
    ]
    proc, metrics = launch(tmp_path, tiny_tool_model, *overrides, config="tiny_cpu_tools.yaml")
    assert proc.returncode != 0
    [step] = metrics
    assert step["env/failure_frequency"] == 0 and step["tools/call_frequency"] > 0.3, step
    assert step["ratio_onpolicy_maxdev"] <= 1e-5 and step["rollout_logprob_diff_turn1"] <= 1e-6, step
    assert step.get("rollout_logprob_diff_turn2", 0.0) <= 1e-6, step
    line = (
        "error: 16 environment episodes in a row failed, more than tool_calling.max_consecutive_failures=8 (the last "
        "on this process: reset raised ConnectionError: sandbox preempted); stopped before the update, the last "
        f"checkpoint is {tmp_path / 'run' / 'checkpoint-2'}"
    )
    assert line in proc.stderr, proc.stderr[-5000:]  # rank 0's line (the launcher's summary repeats it)
    assert [c.name for c in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]
