"""Data for the GRPO recipe: prompts in, rewards and advantages, and the padded training batch out.

- `load_problems` / `tokenize_prompts`: a dataset (hub id, local file or folder, or the generated problems) to
  rows with `prompt` and `prompt_ids`; empty and over-long prompts are dropped with a counted warning.
- `load_reward_funcs` / `score`: reward functions with TRL's signature ``f(prompts, completions,
  completion_ids, **columns) -> list[float | None]``, summed (None means "not applicable", as in TRL).
- `group_advantages`: GRPO's group-normalized advantages; `turn_returns`, `turn_advantages`, `turn_anchors`,
  `state_advantages`, `token_advantages`: the per-turn ones (advantage=turn and state).
- `make_batch` / `select`: left-padded prompts + right-padded responses, the layout `padding/` documents.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from pathlib import Path

import torch

from grpo.config import ConfigError, RecipeConfig

log = logging.getLogger("grpo")

# Arguments TRL passes to reward functions itself; every other required parameter names a dataset column.
_TRL_REWARD_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
_TRL_REWARD_ARGS |= {"environments"}  # with environment_factory: each completion's environment instance


USER_TEXT = "_user_text"  # a tokenized row's user message (`tokenize_prompts`), before the chat template


def load_reward_funcs(names: list[str]) -> list:
    """'module:function' -> callable with TRL's signature ``f(completions, **columns) -> list[float]``."""
    funcs = []
    for name in names:
        module_name, sep, attr = name.partition(":")
        if not sep:
            raise ConfigError(f"reward_funcs entry {name!r} must look like 'module:function'")
        try:
            funcs.append(getattr(importlib.import_module(module_name), attr))
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"reward_funcs entry {name!r} cannot be imported: {err}") from err
    return funcs


def reward_columns(func) -> list[str]:
    """Dataset columns a TRL-style reward function asks for by name (beyond prompts/completions)."""
    params = inspect.signature(func).parameters.values()
    return [
        p.name
        for p in params
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in _TRL_REWARD_ARGS and p.default is p.empty
    ]


def check_reward_columns(cfg: RecipeConfig, reward_funcs: list, problems: list[dict]) -> None:
    needed = {c for f in reward_funcs for c in reward_columns(f)}
    missing = sorted(needed - set(problems[0]))
    if missing:
        raise ConfigError(
            f"data.name={cfg.data.name!r} lacks column(s) {missing} that reward_funcs "
            f"{cfg.reward_funcs} need; it has {sorted(problems[0])}"
        )


def load_problems(cfg: RecipeConfig, split: str | None = None) -> list[dict]:
    """The rows of data.split (or ``split``) as dicts: the generated problems, a local file/folder, or a hub dataset."""
    split = split or cfg.data.split
    seed = cfg.seed if split == cfg.data.split else cfg.seed + 1
    if cfg.data.name in ("generated", "generated-tools"):
        from grpo.tasks.tiny_gsm8k import make_problems
        from grpo.tasks.tiny_tools import make_tool_problems

        make = make_problems if cfg.data.name == "generated" else make_tool_problems
        return make(cfg.data.num_generated, seed=seed)
    if cfg.data.name == "generated-key-chain":
        from grpo.tasks.key_chain import make_key_chain_problems

        return make_key_chain_problems(cfg.data.num_generated, hops=cfg.data.key_chain_hops, seed=seed)
    if cfg.data.name == "generated-guess":
        from grpo.tasks.guess_number import make_guess_problems

        return make_guess_problems(cfg.data.num_generated, seed=seed)
    from datasets import load_dataset

    local = Path(cfg.data.name)
    try:
        if local.exists():
            suffix = local.suffix.lstrip(".")
            if local.is_file() and suffix in ("json", "jsonl", "csv", "parquet"):
                data = load_dataset("json" if suffix == "jsonl" else suffix, data_files=str(local), split=split)
            else:
                data = load_dataset(str(local), cfg.data.config_name, split=split)
        else:
            data = load_dataset(cfg.data.name, cfg.data.config_name, split=split)
    except Exception as err:  # datasets raises many types; name the bad value either way
        raise ConfigError(f"data.name={cfg.data.name!r} (split {split!r}) cannot be loaded: {err}") from err
    return [dict(row) for row in data]


def held_out_problems(cfg: RecipeConfig, tokenizer, train: list[dict], tools: list | None = None) -> list[dict]:
    """Up to data.num_eval tokenized rows of data.eval_split that are not training prompts (for eval_steps)."""
    if cfg.eval_steps is None:
        return []
    if cfg.data.eval_split is None:
        raise ConfigError("eval_steps is set but data.eval_split is null: name a held-out split")
    seen = {row["prompt"] for row in train}
    held_out = load_problems(cfg, split=cfg.data.eval_split)
    rows = tokenize_prompts(cfg, tokenizer, held_out, what="held-out prompt", tools=tools)
    held_out = [row for row in rows if row["prompt"] not in seen][: cfg.data.num_eval]
    if not held_out:
        raise ConfigError(f"data.eval_split={cfg.data.eval_split!r} has no prompt that is not also a training prompt")
    return held_out


def tokenize_prompts(
    cfg: RecipeConfig, tokenizer, problems: list[dict], what: str = "prompt", tools: list | None = None
) -> list[dict]:
    """Add `prompt` (text) and `prompt_ids`; drop empty or over-long prompts with a counted warning. With
    ``tools`` (functions), the chat template describes them to the model."""
    kept, empty, too_long = [], 0, 0
    for row in problems:
        user = user_text(cfg, row)
        text, ids = render_prompt(cfg, tokenizer, user, tools)
        if not text.strip() or not ids:
            empty += 1
        elif len(ids) > cfg.data.max_prompt_length:
            too_long += 1
        else:
            # the user message kept (private: no reward function gets it) for an environment's observation to follow
            kept.append({**row, "prompt": text, "prompt_ids": ids, USER_TEXT: user})
    if empty or too_long:
        log.warning(
            "dropped %d empty and %d %ss longer than data.max_prompt_length=%d tokens (of %d)",
            empty,
            too_long,
            what,
            cfg.data.max_prompt_length,
            len(problems),
        )
    if not kept:
        raise ConfigError(f"no usable prompt in data.name={cfg.data.name!r} (all empty or too long)")
    return kept


def user_text(cfg: RecipeConfig, row: dict) -> str:
    """The user message of a row: data.prompt_template filled from its columns."""
    try:
        return cfg.data.prompt_template.format(**row)
    except KeyError as err:
        raise ConfigError(
            f"data.prompt_template={cfg.data.prompt_template!r} names column {err} that "
            f"data.name={cfg.data.name!r} lacks; it has {sorted(row)}"
        ) from None


def render_prompt(cfg: RecipeConfig, tokenizer, text: str, tools: list | None = None) -> tuple[str, list[int]]:
    """A user message as the prompt (text, ids): through the chat template, with ``tools`` described to the model
    (data.use_chat_template), else as it is."""
    if cfg.data.use_chat_template and tokenizer.chat_template:
        messages = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=True,
            **cfg.data.chat_template_kwargs,
        )
        return text, tokenizer(text, add_special_tokens=False).input_ids
    return text, tokenizer(text).input_ids


def score(reward_funcs: dict, rows: list[dict], samples) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call each reward function as TRL does; returns (summed rewards [N], {name: the non-None values}). A sample
    carrying its own reward (an agent's, `Sample.reward`) gets that reward instead of the sum."""
    sample_rows = [rows[s.prompt_index] for s in samples]
    columns = {k: [row[k] for row in sample_rows] for k in rows[0] if k not in ("prompt", "prompt_ids", USER_TEXT)}
    if samples and samples[0].turn_rewards is not None:  # environment_factory: TRL's `environments=`
        columns["environments"] = [s.environment for s in samples]
    table, returned = [], {}
    for name, func in reward_funcs.items():
        values = func(
            prompts=[row["prompt"] for row in sample_rows],
            completions=[s.text for s in samples],
            completion_ids=[s.completion_ids for s in samples],
            **columns,
        )
        table.append([math.nan if v is None else v for v in values])
        returned[f"reward from {name}"] = torch.tensor([v for v in values if v is not None], dtype=torch.float64)
    rewards = torch.tensor(table, dtype=torch.float32).nansum(dim=0)
    for i, sample in enumerate(samples):
        if getattr(sample, "reward", None) is not None:  # an agent's own reward (grpo.episodes.agent) replaces them
            rewards[i] = sample.reward
    return rewards, returned


def group_advantages(
    rewards: torch.Tensor, group: int, scale: str, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group (or batch) std unless scale='none'.

    ``excluded`` [N] (bool): completions left out of the mean and the std (`baseline_excludes_truncated`), as TRL
    1.16 leaves out an unscorable one (NaN, then ``nanmean``/``nanstd``); their advantage is 0. A group with fewer
    than two others has std 0 (its one kept completion's advantage is 0 either way)."""
    if excluded is None or not bool(excluded.any()):
        grouped = rewards.view(-1, group)
        centered = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
        if scale == "group":
            return centered / (grouped.std(dim=1).repeat_interleave(group) + 1e-4)
        if scale == "batch":
            return centered / (rewards.std() + 1e-4)
        return centered
    kept = (~excluded).to(rewards.dtype)
    grouped, weights = (rewards * kept).view(-1, group), kept.view(-1, group)
    count = weights.sum(dim=1, keepdim=True)
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = ((rewards.view(-1, group) - mean) * weights).flatten()
    if scale == "group":
        variance = (((rewards.view(-1, group) - mean) * weights) ** 2).sum(dim=1) / (count.squeeze(1) - 1).clamp(min=1)
        return centered / (variance.sqrt().repeat_interleave(group) + 1e-4)
    if scale == "batch":
        others = rewards[~excluded]
        return centered / ((others.std() if others.numel() > 1 else torch.zeros(())) + 1e-4)
    return centered


def turn_returns(turn_rewards: list[float], outcome: float, gamma: float) -> list[float]:
    """Each model turn's discounted return: its step reward, plus ``gamma`` times the next turn's return; the
    episode's outcome (what the reward functions give it) is its last turn's reward, added to that turn's step
    reward."""
    rewards = list(turn_rewards)
    if not rewards:
        return []
    rewards[-1] += outcome
    returns, later = [], 0.0
    for reward in reversed(rewards):
        later = reward + gamma * later
        returns.append(later)
    return returns[::-1]


def turn_advantages(
    returns: list[list[float]], group: int, scale: str, excluded: torch.Tensor | None = None
) -> list[list[float]]:
    """advantage=turn: each turn's return minus the mean of the returns of its group's turns of the same number
    (the episodes that reached it), divided by their std (scale='group'), by the std of every turn's return in the
    batch ('batch') or by nothing ('none'). Excluded episodes are in no baseline and get 0 on every turn. Where every
    episode has one turn this is `group_advantages`."""
    kept = _kept(returns, excluded)
    table = [torch.tensor(r, dtype=torch.float32) for r in returns]
    batch_std = _batch_return_std(table, kept)
    advantages = [torch.zeros(len(r)) for r in returns]
    for start in range(0, len(returns), group):
        members = [i for i in range(start, start + group) if kept[i]]
        for turn in range(max((len(returns[i]) for i in members), default=0)):
            reached = [(i, turn) for i in members if len(returns[i]) > turn]
            _normalize_among(reached, table, advantages, scale, batch_std)
    return [a.tolist() for a in advantages]


def turn_anchors(sample) -> list[tuple[int, ...] | None]:
    """advantage=state: each model turn's anchor state, the observation it answered, token for token: turn 1's the
    prompt ids (they hold an environment's reset observation), turn t >= 2's the tool tokens just before its first
    token. A turn with no token, or with no tool token before it, has None (it is in no step group)."""
    turn_of = sample.turn_of_token or []
    first: dict[int, int] = {}
    for position, turn in enumerate(turn_of):
        first.setdefault(turn, position)
    anchors = [tuple(sample.prompt_ids)] if turn_of and max(turn_of) >= 1 else []
    for turn in range(2, max(turn_of, default=0) + 1):
        start = first.get(turn)
        end = start
        while end and turn_of[end - 1] == 0:  # back over the tool tokens the turn followed
            end -= 1
        anchors.append(tuple(sample.completion_ids[end:start]) if start is not None and end < start else None)
    return anchors


def state_advantages(
    returns: list[list[float]],
    anchors: list[list[tuple[int, ...] | None]],
    group: int,
    scale: str,
    excluded: torch.Tensor | None = None,
) -> list[list[float]]:
    """advantage=state's step-level term (GiGPO's): each turn's return minus the mean of the returns of its step
    group, the turns of its group's episodes, at any turn number, with the identical anchor state (`turn_anchors`),
    divided by their std (scale='group'), by the std of every turn's return in the batch ('batch') or by nothing
    ('none'). A turn alone in its step group, or without an anchor, gets 0; excluded episodes are in no step group
    and get 0 on every turn."""
    kept = _kept(returns, excluded)
    table = [torch.tensor(r, dtype=torch.float32) for r in returns]
    batch_std = _batch_return_std(table, kept)
    advantages = [torch.zeros(len(r)) for r in returns]
    for start in range(0, len(returns), group):
        step_groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i in range(start, start + group):
            for turn, anchor in enumerate(anchors[i][: len(returns[i])] if kept[i] else []):
                if anchor is not None:
                    step_groups.setdefault(anchor, []).append((i, turn))
        for members in step_groups.values():
            if len(members) > 1:
                _normalize_among(members, table, advantages, scale, batch_std)
    return [a.tolist() for a in advantages]


def _kept(returns: list, excluded: torch.Tensor | None) -> list[bool]:
    return [not bool(excluded[i]) if excluded is not None else True for i in range(len(returns))]


def _batch_return_std(table: list[torch.Tensor], kept: list[bool]) -> torch.Tensor:
    """The std of every turn's return of the kept episodes (scale_rewards='batch')."""
    every = [t for t, keep in zip(table, kept) if keep and t.numel()]
    return torch.cat(every).std() if every and sum(t.numel() for t in every) > 1 else torch.zeros(())


def _normalize_among(members, table, advantages, scale: str, batch_std: torch.Tensor) -> None:
    """Each (episode, turn) of ``members`` its return minus their mean, scaled as ``scale`` says."""
    values = torch.stack([table[i][turn] for i, turn in members])
    centered = values - values.mean()
    if scale == "group":
        centered = centered / ((values.std() if len(members) > 1 else torch.zeros(())) + 1e-4)
    elif scale == "batch":
        centered = centered / (batch_std + 1e-4)
    for (i, turn), value in zip(members, centered):
        advantages[i][turn] = value


def token_advantages(per_turn: list[list[float]], turn_of_token: torch.Tensor) -> torch.Tensor:
    """[N, R]: each model token the advantage of the turn that sampled it (``turn_of_token``: 1, 2, ...), each tool
    token (turn 0) 0."""
    table = torch.zeros((len(per_turn), 1 + max((len(a) for a in per_turn), default=0)))
    for i, advantages in enumerate(per_turn):
        table[i, 1 : 1 + len(advantages)] = torch.tensor(advantages, dtype=table.dtype)
    return table.to(turn_of_token.device).gather(1, turn_of_token)


def make_batch(samples, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses -> input_ids/attention_mask [N, P+R], response_mask, the
    engine's log-probs and (server) the policy version of each token [N, R], truncated [N].

    Multi-turn episodes (`grpo.episodes`): the response holds every token after the prompt, and response_mask is 0 on
    the tool tokens inside it (TRL's tool_mask), so the log-probs, the loss and the KL skip them; `turn_of_token`
    [N, R] says which model turn sampled each token."""
    width_p = max(len(s.prompt_ids) for s in samples)
    width_r = max(1, max(len(s.completion_ids) for s in samples))
    n = len(samples)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    vllm_logprobs = torch.zeros((n, width_r))
    versions = torch.zeros((n, width_r), dtype=torch.long) if samples[0].versions is not None else None
    multi_turn = samples[0].tool_mask is not None
    tool_mask = torch.zeros((n, width_r), dtype=torch.long)
    turn_of_token = torch.zeros((n, width_r), dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, width_p - p : width_p] = torch.tensor(s.prompt_ids)
        input_ids[i, width_p : width_p + r] = torch.tensor(s.completion_ids, dtype=torch.long)
        attention_mask[i, width_p - p : width_p + r] = 1
        vllm_logprobs[i, :r] = torch.tensor(s.logprobs)
        if versions is not None:
            versions[i, :r] = torch.tensor(s.versions, dtype=torch.long)
        if multi_turn:
            tool_mask[i, :r] = torch.tensor(s.tool_mask, dtype=torch.long)
            turn_of_token[i, :r] = torch.tensor(s.turn_of_token, dtype=torch.long)
    response_mask = attention_mask[:, width_p:].clone()
    if multi_turn:
        response_mask *= tool_mask
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        vllm_logprobs=vllm_logprobs,
        truncated=torch.tensor([s.truncated for s in samples]),
    )
    if versions is not None:  # the policy version that sampled each token (a server's rollouts)
        batch["versions"] = versions
    if multi_turn:
        batch["turn_of_token"] = turn_of_token
    return {k: v.to(device) for k, v in batch.items()}


def select(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """Rows of a batch, with the columns trimmed to the longest prompt and response among them."""
    sub = {k: v[rows] for k, v in batch.items()}
    width_r = batch["response_mask"].shape[1]
    width_p = batch["attention_mask"].shape[1] - width_r
    prompt_used = sub["attention_mask"][:, :width_p].sum(1).max().item()
    response_used = max(1, sub["attention_mask"][:, width_p:].sum(1).max().item())  # tool tokens included
    cols = slice(width_p - prompt_used, width_p + response_used)
    for key in ("input_ids", "attention_mask"):
        sub[key] = sub[key][:, cols]
    for key, value in sub.items():
        if key not in ("input_ids", "attention_mask") and value.dim() == 2:  # [N, R] per-token tensors
            sub[key] = value[:, :response_used]
    return sub
