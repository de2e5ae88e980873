"""GRPO with LoRA under FSDP2; every rollout comes from a colocated vLLM engine serving *merged* weights.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py \
        --config recipes/configs/tiny_cpu.yaml [lora.merge=false learning_rate=2e-5 ...]

Words: a *rollout step* is one pass of the loop below (one line of metrics.jsonl, `rollout_step`); an
*optimizer step* is one update of the weights (`global_step`, TRL's meaning: `max_steps`, `save_steps` count
these). Each rollout step makes `steps_per_generation x num_iterations` optimizer steps.

One rollout step, top to bottom (`main`):
  1. sync     the engine, awake for this generation phase, serves the current policy in its merge mode:
              merge=on : stream merged_lora_params(model) (one decoder layer unsharded at a time) into vLLM
              merge=off: save the adapter, serve it with a fresh LoRARequest
              (then, every eval_steps optimizer steps, the held-out evaluation on those weights)
  2. rollout  vLLM samples num_generations completions per prompt, with the sampled tokens' log-probs
              (of the distribution it samples from: top-k / top-p truncated, as the trainer's log-probs are);
              max_staleness >= 1 (server): they were sent up to max_staleness syncs ago and sampled while the
              trainer updated, the syncs landing between decode steps (grpo/engines/rollout_queue.py)
  3. reward   TRL-style reward functions -> group-normalized advantages
  4. old      one no-grad packed forward per mini-batch -> old (and reference) log-probs, via `padding`
  5. update   num_iterations x steps_per_generation mini-batches of the GRPO loss (later ones off-policy)
  6. log      one JSON line per rollout step in <output_dir>/<run_name>/metrics.jsonl
  7. save     checkpoint-<global_step>/ every `save_steps` optimizer steps, at the end, and on SIGINT/SIGTERM

Faults stop the run with a message instead of training on bad numbers: a NaN/inf reward, loss, ratio, gradient
norm or fp16 overflow (in a forward, in the merged weights) stops the step before the optimizer update; fp16's loss
scaling skips a step whose gradients overflowed; the |vLLM - trainer| log-prob guard catches a broken weight sync.
`resume_from_checkpoint=<dir>|last` continues at the next rollout step with the results of an uninterrupted run.

The parts live in the `grpo` package (docs/layout.md says what each module holds).
"""

from __future__ import annotations

import argparse
import os

from grpo.config import ConfigError, RecipeConfig, config_to_dict, load_config
from grpo.exits import exit_finished, exit_refused, exit_with_line


def load_config_or_exit(argv: list[str] | None = None) -> RecipeConfig:
    """The config from the command line; a bad one is one line from one process and exit code 2, within a second
    (grpo.config imports neither torch, transformers nor vLLM: tests/test_config.py checks it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (see recipes/configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. lora.merge=false learning_rate=2e-5")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as err:
        exit_refused(err)


if __name__ == "__main__":
    CONFIG = load_config_or_exit()

# the slow imports (torch, transformers, vLLM through grpo.run) come after the config check
import logging
import shutil
import signal
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tqdm.auto import tqdm

from grpo.checkpointing import checkpoint_path, rng_state, save_adapter, save_checkpoint, set_rng_state
from grpo.data import (
    group_advantages,
    make_batch,
    score,
    select,
    state_advantages,
    token_advantages,
    turn_advantages,
    turn_anchors,
    turn_returns,
)
from grpo.engines.interface import RolloutAbandoned, rollout_in_progress
from grpo.engines.server import ServerError
from grpo.episodes.environments import EnvironmentFailing
from grpo.episodes.metrics import tool_stats
from grpo.episodes.tool_watch import ToolUseWatch
from grpo.faults import StopRequest, stop_if_environment_failing, stop_if_nonfinite
from grpo.loss import accumulate_stats, grpo_loss, high_entropy_mask, vllm_importance_sampling_ratio
from grpo.metrics import (
    fidelity_totals,
    log_rollout_step,
    params_digest,
    reduce_statistics,
    step_metrics,
    write_metrics,
)
from grpo.parallel import gather_across_ranks, reduce_across_ranks
from grpo.policy_versions import sampler_log_probs
from grpo.run import Run, setup
from padding import packed_log_probs

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------- the phases of a rollout step
def generation_phase(run: Run, rollout_step: int):
    """1-2. With the engine awake (one wake-up, one sleep): sync, the evaluation when due, the rollout.

    The evaluation scores the weights after the previous rollout step, which the sync has just handed to the
    engine. Returns (rows, samples, metrics).
    """
    with run.engine.awake():
        with run.timeline.span("sync"):
            phases = sync_weights(run, rollout_step)
        if run.eval_due(rollout_step - 1):
            evaluate(run, rollout_step - 1)
        with run.timeline.span("rollout"):
            rows, samples, rollout_metrics = rollout(run, rollout_step)
    return rows, samples, {**phases, **rollout_metrics}


def sync_weights(run: Run, rollout_step: int) -> dict:
    """1. Make the engine serve the current policy, merged or as an adapter (the engine's merge mode)."""
    t0 = time.perf_counter()
    digest_before = params_digest(run.model) if run.cfg.vllm.verify_sync else None
    precision = {}
    if run.cfg.vllm.sync:  # false (debugging only): vLLM keeps serving stale weights, which the guard must catch
        precision = run.engine.sync_policy(run.model, run.run_dir / "_rollout_adapter", rollout_step, run.rank)
    metrics = dict(sync_s=time.perf_counter() - t0, **precision)
    if run.policies is not None:  # asynchronous: the factors of this version, for the fidelity check later
        run.policies.remember(rollout_step)
    if digest_before is not None:
        metrics["sync_changed_trainer"] = float(digest_before != params_digest(run.model))
    return metrics


def rollout(run: Run, rollout_step: int):
    """2. num_generations completions of each of this rank's prompts, from the rollout queue: sampled now, or (max
    staleness >= 1) sent up to max_staleness syncs ago. Returns (rows, samples, metrics)."""
    t0 = time.perf_counter()
    with rollout_in_progress():  # a stop signal while it waits on tools or the server abandons it
        samples, queue_metrics = run.rollouts.take(rollout_step, use_tqdm=run.rank == 0)
    tokens = sum(len(s.completion_ids) if s.tool_mask is None else sum(s.tool_mask) for s in samples)  # sampled ones
    episodes = tool_stats(samples, agent=bool(run.cfg.agent))
    metrics = dict(rollout_s=time.perf_counter() - t0, rollout_tokens=tokens, **queue_metrics, **episodes)
    return run.prompts_for(rollout_step), samples, metrics


def rewards_and_advantages(run: Run, rows, samples, rollout_step: int):
    """3. Score the completions (a NaN/inf reward stops the run) -> (rewards [N], advantages: [N], or with
    advantage=turn or state each episode's list of per-turn advantages). Environment episodes: an episode's reward
    includes its step rewards; a failed one's is NaN (never scored) and it is in no baseline."""
    cfg = run.cfg
    failed = torch.tensor([s.env_failure is not None for s in samples])
    rewards, returned = score_episodes(run, rows, samples, failed)
    stop_if_nonfinite(f"rollout step {rollout_step}, rewards", returned, run.last_checkpoint)
    truncated = torch.tensor([s.truncated for s in samples])
    if cfg.tool_calling.overflow_reward is not None:  # the episodes the budget ended (set only with tools)
        rewards[truncated] = cfg.tool_calling.overflow_reward
    excluded = truncated if cfg.tool_calling.baseline_excludes_truncated else None
    if bool(failed.any()):  # the environment failed, not the policy: in no baseline, advantage 0, no loss
        excluded = failed if excluded is None else excluded | failed
    outcomes = torch.where(failed, 0.0, rewards) if bool(failed.any()) else rewards  # NaN only where one failed
    if cfg.advantage in ("turn", "state"):
        steps = [s.turn_rewards or [0.0] * max(s.turn_of_token, default=0) for s in samples]
        returns = [turn_returns(step, float(outcome), cfg.gamma) for step, outcome in zip(steps, outcomes)]
    if cfg.advantage == "turn":
        advantages = turn_advantages(returns, cfg.num_generations, cfg.scale_rewards, excluded)
    if samples and samples[0].turn_rewards is not None:  # an environment's step rewards: the episode's too
        rewards = rewards + torch.tensor([sum(s.turn_rewards) for s in samples])
    if cfg.advantage in ("episode", "state"):
        scored = torch.where(failed, 0.0, rewards) if bool(failed.any()) else rewards
        advantages = group_advantages(scored, cfg.num_generations, cfg.scale_rewards, excluded)
    if cfg.advantage == "state":  # GiGPO: the episode's advantage plus the weighted step-level one of each turn
        anchors = [turn_anchors(s) for s in samples]
        step = state_advantages(returns, anchors, cfg.num_generations, cfg.scale_rewards, excluded)
        weight = cfg.state_advantage_weight
        advantages = [[e + weight * a for a in turns] for e, turns in zip(advantages.tolist(), step)]
    return rewards, advantages


def score_episodes(run: Run, rows, samples, failed: torch.Tensor):
    """`score` of the samples whose environment did not fail (every sample without environments); NaN for the
    others."""
    if not bool(failed.any()):
        return score(run.reward_funcs, rows, samples)
    live = [s for s, bad in zip(samples, failed) if not bad]
    rewards, returned = torch.full((len(samples),), torch.nan), {}
    if live:
        rewards[~failed], returned = score(run.reward_funcs, rows, live)
    return rewards, returned


def training_batch(run: Run, samples, advantages) -> dict:
    """The padded batch of this rank's completions with their advantages ([N], or [N, R] per token with
    advantage=turn or state: each model token its turn's); truncated ones masked out if asked, failed environment
    episodes always."""
    batch = make_batch(samples, run.pad_id, run.device)
    if isinstance(advantages, torch.Tensor):
        batch["advantages"] = advantages.to(run.device)
    else:
        batch["advantages"] = token_advantages(advantages, batch["turn_of_token"])
    if run.cfg.mask_truncated_completions:
        batch["response_mask"] = batch["response_mask"] * (~batch["truncated"])[:, None]
    failed = torch.tensor([s.env_failure is not None for s in samples], device=run.device)
    if bool(failed.any()):
        batch["response_mask"] = batch["response_mask"] * (~failed)[:, None]
    return batch


def mini_batches(run: Run, batch: dict) -> list[slice]:
    size, count = run.cfg.per_device_train_batch_size, batch["input_ids"].shape[0]
    return [slice(i, i + size) for i in range(0, count, size)]


@torch.no_grad()
def old_log_probs(run: Run, batch: dict, rollout_step: int) -> None:
    """4. Add `old_logprobs` (and `ref_logprobs`, adapter disabled, if beta > 0) [N, R] to ``batch``; max_staleness
    >= 1: the fidelity check's log-probs, under the weights that sampled each token (`grpo.policy_versions`)."""
    cfg, model = run.cfg, run.model
    old, ref = torch.zeros_like(batch["vllm_logprobs"]), torch.zeros_like(batch["vllm_logprobs"])
    model.eval()

    def score(sub: dict) -> torch.Tensor:
        with run.autocast():
            args = (sub["input_ids"], sub["attention_mask"], sub["response_mask"], cfg.temperature)
            return packed_log_probs(model, *args, **run.logprob_options)

    for rows in mini_batches(run, batch):
        sub = select(batch, rows)
        width = sub["response_mask"].shape[1]
        old[rows, :width] = score(sub)
        if cfg.beta > 0:
            with model.disable_adapter():
                ref[rows, :width] = score(sub)
    # an fp16 overflow in the forward shows here first (inf/NaN log-probs), before it reaches a ratio
    stop_if_nonfinite(
        f"rollout step {rollout_step}, old log-probs forward ({cfg.model.dtype})",
        dict(old_logprobs=old, ref_logprobs=ref),
        run.last_checkpoint,
    )
    batch["old_logprobs"], batch["ref_logprobs"] = old, ref
    if run.policies is not None:
        first = mini_batches(run, batch)[0]
        batch["fidelity_logprobs"], batch["fidelity_mask"] = sampler_log_probs(
            batch, first, run.policies, rollout_step, cfg.max_staleness, score
        )


def importance_sampling(run: Run, batch: dict) -> dict:
    """TRL's vLLM importance-sampling weights ([N, R], or [N, 1] per sequence) into ``batch``; returns their stats."""
    cfg = run.cfg
    if not run.loss_settings.vllm_importance_sampling_correction:
        return {}
    ratio, stats = vllm_importance_sampling_ratio(
        batch["old_logprobs"],
        batch["vllm_logprobs"],
        batch["response_mask"],
        cfg.vllm_importance_sampling_mode,
        cfg.vllm_importance_sampling_clip_min,
        cfg.vllm_importance_sampling_clip_max,
    )
    batch["importance_sampling_ratio"] = ratio
    return {k: v for k, v in stats.items() if k.startswith("vllm_ratio")}


def mini_batch_loss(run: Run, sub: dict, num_items_in_batch: float):
    """The GRPO loss of one mini-batch (forward included) -> (loss, stats of grpo_loss)."""
    cfg, settings = run.cfg, run.loss_settings
    entropy_mask, args = None, (sub["input_ids"], sub["attention_mask"], sub["response_mask"], cfg.temperature)
    with run.autocast():
        if settings.top_entropy_quantile < 1.0:
            logps, entropies = packed_log_probs(
                run.model, *args, cfg.padding.legacy_slice, return_entropy=True, **run.logprob_options
            )
            entropy_mask = high_entropy_mask(
                entropies, sub["response_mask"], settings.top_entropy_quantile, gather=gather_across_ranks
            )
        else:
            logps = packed_log_probs(run.model, *args, legacy_slice=cfg.padding.legacy_slice, **run.logprob_options)
    return grpo_loss(
        logps,
        sub["old_logprobs"],
        sub["advantages"],
        sub["response_mask"],
        settings,
        ref_per_token_logps=sub["ref_logprobs"] if settings.beta != 0.0 else None,
        importance_sampling_ratio=sub.get("importance_sampling_ratio"),
        entropy_mask=entropy_mask,
        num_items_in_batch=num_items_in_batch if settings.loss_type in ("dapo", "cispo") else None,
    )


def update(run: Run, batch: dict, rollout_step: int) -> dict:
    """5. num_iterations passes of steps_per_generation optimizer steps over the rollout's mini-batches.

    Returns the statistics of all mini-batches, by name (sums, counts, `*_min`, `*_max`: `grpo_loss.reduce_op`),
    with `onpolicy_*` for the first mini-batch of the first pass: the only one whose weights are the rollout's.
    """
    cfg, model = run.cfg, run.model
    chunks = mini_batches(run, batch)
    # dapo/cispo weigh every completion token of the rollout (all ranks) the same, as TRL's num_items_in_batch
    num_items_in_batch = reduce_across_ranks(sums={"tokens": batch["response_mask"].sum().item()})["tokens"]
    totals = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in importance_sampling(run, batch).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    bar = tqdm(total=run.updates_per_rollout, desc=f"update {rollout_step}", disable=run.rank != 0, leave=False)
    for iteration in range(cfg.num_iterations):
        for k, rows in enumerate(chunks):
            loss, stats = mini_batch_loss(run, select(batch, rows), num_items_in_batch)
            run.loss_scale.scaled(loss).backward()
            finite = run.loss_scale.unscale_(trainable)  # fp16: an overflowing gradient skips the step
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm) if finite else torch.zeros(())
            stop_if_nonfinite(
                f"rollout step {rollout_step}, iteration {iteration + 1}, mini-batch {k + 1}",
                dict(loss=loss, ratio=stats["ratio_sum"], grad_norm=grad_norm),
                run.last_checkpoint,
            )
            run.loss_scale.step(run.optimizer, finite)
            run.scheduler.step()  # a skipped step still counts as an optimizer step (global_step), as in TRL
            run.optimizer.zero_grad(set_to_none=True)
            stats = {
                **stats,
                **run.loss_scale.stats(),
                "loss_sum": loss.detach().double(),
                "mini_batches": torch.tensor(1.0, dtype=torch.float64),
            }
            if iteration == 0 and k == 0:
                stats.update(
                    onpolicy_ratio_sum=stats["ratio_sum"],
                    onpolicy_ratio_count=stats["ratio_count"],
                    onpolicy_ratio_min=stats["ratio_min"],
                    onpolicy_ratio_max=stats["ratio_max"],
                )
            totals = accumulate_stats(totals, stats)
            bar.update(1)
    bar.close()
    return {name: value.item() for name, value in totals.items()}


def update_phase(run: Run, rows: list[dict], samples: list, rollout_step: int) -> tuple:
    """3-5. Rewards, the training batch and its old log-probs; the log-prob guard judges them (a collective) before
    the update may change the weights. Returns (rewards, batch, update statistics, the phase's seconds)."""
    try:
        rewards, advantages = rewards_and_advantages(run, rows, samples, rollout_step)
    finally:  # environment episodes end once scored (or when scoring fails): every instance released
        release_environments(run, samples)
    stop_if_environment_failing(run.engine, run.cfg.tool_calling.max_consecutive_failures, run.last_checkpoint)
    t0 = time.perf_counter()
    batch = training_batch(run, samples, advantages)
    old_log_probs(run, batch, rollout_step)
    if not run.cfg.tool_calling.retokenize:  # that comparison trains on ids the engine never scored
        run.guard.check(rollout_step, fidelity_totals(batch))
    update_stats = update(run, batch, rollout_step)
    return rewards, batch, update_stats, time.perf_counter() - t0


def release_environments(run: Run, samples) -> None:
    if hasattr(run.engine, "release"):
        run.engine.release(samples)


def log_metrics(run: Run, rollout_step: int, rewards, batch, phases: dict, update_stats: dict, t_step: float) -> dict:
    """6. Reduce this rollout step's statistics across ranks by name, append them to metrics.jsonl (rank 0)."""
    total = reduce_statistics(rewards, batch, phases, update_stats, run.device)
    metrics = step_metrics(
        total,
        rollout_step=rollout_step,
        global_step=run.global_step(rollout_step),
        merge=run.cfg.lora.merge,
        legacy_slice=run.cfg.padding.legacy_slice,
        lr=run.scheduler.get_last_lr()[0],
    )
    metrics["step_s"] = time.perf_counter() - t_step
    write_metrics(metrics, run.run_dir, run.trackers, run.rank)
    if run.rank == 0:
        log_rollout_step(metrics, run.num_rollout_steps)
    return metrics


def evaluate(run: Run, rollout_steps_done: int) -> dict:
    """Mean held-out reward (the accuracy, for a 0/1 reward), greedy and at the training temperature.

    The engine generates on the weights it serves now; each rank scores its share of the held-out problems.
    """
    from vllm import SamplingParams

    cfg = run.cfg
    rows = run.eval_problems[run.rank :: run.world]
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length),
        "sampled": SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1,
            max_tokens=cfg.max_completion_length,
        ),
    }
    sums = {"problems": len(rows)}
    takes_rows = getattr(run.engine, "takes_rows", False)  # an environment's episodes: reset gets the row
    for mode, sampling in modes.items():
        prompts = rows if takes_rows else [r["prompt_ids"] for r in rows]
        samples = run.engine.generate(prompts, sampling) if rows else []
        failed = torch.tensor([s.env_failure is not None for s in samples], dtype=torch.bool)
        try:  # a failed environment episode counts as unsolved (NaN, summed as 0)
            rewards = score_episodes(run, rows, samples, failed)[0] if rows else torch.zeros(0)
        finally:
            release_environments(run, samples)
        sums[f"{mode}_reward_sum"] = rewards.nansum().item()
        sums[f"{mode}_tokens"] = sum(len(s.completion_ids) for s in samples)
        if run.cfg.tools:  # episodes that called a tool, and that got at least one result back
            sums[f"{mode}_calling"] = sum(s.tool_calls > 0 for s in samples)
            sums[f"{mode}_succeeding"] = sum(s.tool_calls > s.tool_failures for s in samples)
    total = reduce_across_ranks(sums=sums)
    n = max(1.0, total["problems"])
    metrics = dict(
        rollout_step=rollout_steps_done,
        global_step=run.global_step(rollout_steps_done),
        eval_problems=int(total["problems"]),
        eval_reward_greedy=total["greedy_reward_sum"] / n,
        eval_reward_sampled=total["sampled_reward_sum"] / n,
        eval_completion_tokens_greedy=total["greedy_tokens"] / n,
    )
    if cfg.tools:
        for mode in modes:
            metrics[f"eval_tool_calling_{mode}"] = total[f"{mode}_calling"] / n
            metrics[f"eval_tool_success_{mode}"] = total[f"{mode}_succeeding"] / n
    write_metrics(metrics, run.run_dir, run.trackers, run.rank)
    log.info(
        "eval after rollout step %d (optimizer step %d): held-out reward greedy %.3f, sampled %.3f (%d problems)",
        rollout_steps_done,
        metrics["global_step"],
        metrics["eval_reward_greedy"],
        metrics["eval_reward_sampled"],
        metrics["eval_problems"],
    )
    return metrics


def final_evaluation(run: Run, rollout_steps_done: int) -> dict:
    """The evaluation of the final weights: a generation phase of its own (sync, then evaluate)."""
    with run.engine.awake():
        sync_weights(run, rollout_steps_done + 1)
        return evaluate(run, rollout_steps_done)


def save(run: Run, rollout_step: int) -> Path:
    """7. Checkpoint the state after ``rollout_step`` (collective); a no-op if that checkpoint was just written."""
    global_step = run.global_step(rollout_step)
    if run.last_checkpoint == checkpoint_path(run.run_dir, global_step):
        return run.last_checkpoint
    state = dict(
        rollout_step=rollout_step,
        global_step=global_step,
        data_position=rollout_step * run.world * run.cfg.prompts_per_rank,
        world_size=run.world,
        seed=run.cfg.seed,
        logprob_diff_baseline=run.guard.baseline,
        loss_scale=run.loss_scale.state_dict(),
    )
    run.last_checkpoint = save_checkpoint(
        run.run_dir,
        run.model,
        run.optimizer,
        run.scheduler,
        state,
        config_to_dict(run.cfg),
        run.rank,
        run.cfg.save_total_limit,
    )
    return run.last_checkpoint


def finish(run: Run, rollout_step: int, signum: int) -> None:
    """Write the final adapter (or say how to resume after a signal) and take the processes down."""
    if run.rank == 0:
        shutil.rmtree(run.run_dir / "_rollout_adapter", ignore_errors=True)
    if signum:
        log.error(
            "stopped by %s after rollout step %d of %d; checkpoint: %s. To continue, run the same command with "
            "resume_from_checkpoint=%s",
            signal.Signals(signum).name,
            rollout_step,
            run.num_rollout_steps,
            run.last_checkpoint,
            run.last_checkpoint,
        )
    else:
        save_adapter(run.model, run.run_dir / "adapter", run.rank)
        log.info("done: adapter in %s, metrics in %s", run.run_dir / "adapter", run.run_dir / "metrics.jsonl")
    run.trackers.finish()
    run.engine.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- main
def main(cfg: RecipeConfig) -> None:
    try:
        run = setup(cfg)
    except (ConfigError, ServerError) as err:  # a bad input found at start-up: one line, no traceback
        exit_refused(err)
    stop = StopRequest()  # after vLLM is built, so that these handlers are the ones in force

    signum, rollout_step = 0, run.resumed_rollout_step
    tool_watch = ToolUseWatch() if run.cfg.tools else None  # reward rising while the tool calls die out
    for rollout_step in range(run.resumed_rollout_step + 1, run.num_rollout_steps + 1):
        t_step, rng_at_start = time.perf_counter(), rng_state()  # the engine samples from the process's RNG
        try:
            rows, samples, phases = generation_phase(run, rollout_step)
        except RolloutAbandoned:  # a stop signal while the rollout waited (its flag is set): given up below
            pass
        signum = stop.agreed()
        if signum:  # abandon this step: nothing was updated yet, so the state is the one after the previous one
            rollout_step -= 1
            set_rng_state(rng_at_start)  # the resumed run samples this step as it would have
            save(run, rollout_step)
            break

        with run.timeline.span("update"):
            try:
                rewards, batch, update_stats, phases["update_s"] = update_phase(run, rows, samples, rollout_step)
            except EnvironmentFailing as err:  # one line; the checkpoints are the last good steps'
                run.engine.close()
                exit_with_line(err, 1)

        metrics = log_metrics(run, rollout_step, rewards, batch, phases, update_stats, t_step)
        run.timeline.write(rollout_step, run.rollouts.answered, run.rank)
        if tool_watch is not None:
            warning = tool_watch.check(rollout_step, metrics["reward_mean"], metrics["tools/call_frequency"])
            if warning and run.rank == 0:
                log.warning(warning)
        signum = stop.agreed()
        if signum or run.save_due(rollout_step):
            save(run, rollout_step)
        if signum:
            break
    if not signum and run.eval_due(rollout_step) and rollout_step > run.resumed_rollout_step:
        final_evaluation(run, rollout_step)
    finish(run, rollout_step, signum)
    if signum:  # without the interpreter's slow teardown: a launcher kills what outlasts its grace period
        exit_finished(128 + signum)


def run_and_exit(cfg: RecipeConfig) -> None:
    """`main`, then the process's end: its exit code and last line (tests/recipe_forks.py calls it in a fork)."""
    try:
        main(cfg)
    except ServerError as err:  # the server went away mid-run: one line from each rank that waited on it
        exit_with_line(err, 1, every_rank=True)
    exit_finished()


if __name__ == "__main__":
    run_and_exit(CONFIG)
