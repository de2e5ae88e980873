"""The metrics of a rollout step: statistics reduced across ranks by name, one line of metrics.jsonl, the trackers.

`reduce_statistics` reduces each named statistic with its own operation (sums, `*_min`, `*_max`; phase times are
the slowest rank's), `step_metrics` turns the totals into the line the plots read, `write_metrics` appends it to
the run folder's metrics.jsonl (rank 0) and hands it to the trackers (`report_to`), `log_rollout_step` logs its
progress line; `Timeline` writes when each side was busy (server mode).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import resource
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from grpo.loss import reduce_op
from grpo.parallel import reduce_across_ranks

log = logging.getLogger("grpo")


def reduce_statistics(rewards, batch, phases: dict, update_stats: dict, device: torch.device) -> dict:
    """This rank's statistics of a rollout step, reduced across ranks by name (a collective)."""
    # asynchronous rollouts: on the tokens whose sampling weights the trainer scored (`grpo.policy_versions`)
    mask = batch.get("fidelity_mask", batch["response_mask"].bool())
    diff = (batch["vllm_logprobs"] - batch.get("fidelity_logprobs", batch["old_logprobs"])).abs()[mask]
    local = dict(
        reward_sum=rewards.nansum().item(),
        reward_sq_sum=(rewards.nan_to_num() ** 2).sum().item(),
        samples=int((~rewards.isnan()).sum()),  # scored ones: a failed environment episode's reward is NaN
        logprob_diff_sum=diff.sum().item(),
        logprob_diff_count=diff.numel(),
        logprob_diff_max=diff.max().item() if diff.numel() else 0.0,
        **phases,
        **update_stats,
    )
    if "turn_of_token" in batch:  # multi-turn episodes: the same figures on the model tokens of each turn
        local.update(per_turn_statistics(batch, mask))
    kinds = {"sums": {}, "mins": {}, "maxs": {}}
    for name, value in local.items():
        # phase times: the slowest rank's; the sync's figures (precision, bytes) are the same on every rank
        op = (
            "max"
            if name.endswith(("_s", "_max")) or name.startswith("sync_delta_") or name == "sync_bytes"
            else reduce_op(name)
        )
        kinds[op + "s"][name] = value
    kinds["maxs"]["peak_mem_gb"] = peak_mem_gb(device)
    return reduce_across_ranks(**kinds)


def fidelity_totals(batch: dict) -> dict:
    """Collective: what the log-prob guard judges before the update (`grpo.faults.LogprobGuard.check`): the sum,
    count and largest |vLLM - trainer| log-prob over every rank's scored tokens, and the same on the model tokens of
    each turn group of multi-turn episodes (``logprob_diff_turn1_sum``, ...)."""
    mask = batch.get("fidelity_mask", batch["response_mask"].bool())
    diff = (batch["vllm_logprobs"] - batch.get("fidelity_logprobs", batch["old_logprobs"])).abs()[mask]
    local = dict(
        logprob_diff_sum=diff.sum().item(),
        logprob_diff_count=float(diff.numel()),
        logprob_diff_max=diff.max().item() if diff.numel() else 0.0,
    )
    if "turn_of_token" in batch:
        local.update({k: v for k, v in per_turn_statistics(batch, mask).items() if k.startswith("logprob_diff_")})
    return reduce_across_ranks(
        sums={k: v for k, v in local.items() if not k.endswith("_max")},
        maxs={k: v for k, v in local.items() if k.endswith("_max")},
    )


def per_turn_statistics(batch: dict, mask: torch.Tensor) -> dict:
    """|vLLM - trainer| and the trainer-over-vLLM probability ratio on the model tokens of each turn bucket (turn 1,
    2, 3-4, 5-8, 9-16, 17+: `grpo.episodes.metrics.TURN_GROUPS`)."""
    from grpo.episodes.metrics import turn_masks

    gap = batch["vllm_logprobs"] - batch.get("fidelity_logprobs", batch["old_logprobs"])
    stats = {}
    for name, turn_mask in turn_masks(batch, mask).items():
        diff, ratio = gap.abs()[turn_mask], torch.exp(-gap[turn_mask].double())
        stats.update(
            {
                f"logprob_diff_{name}_sum": diff.sum().item(),
                f"logprob_diff_{name}_count": float(diff.numel()),
                f"logprob_diff_{name}_max": diff.max().item() if diff.numel() else 0.0,
                f"is_ratio_{name}_sum": ratio.sum().item(),
                f"is_ratio_{name}_min": ratio.min().item() if ratio.numel() else 1.0,
                f"is_ratio_{name}_max": ratio.max().item() if ratio.numel() else 1.0,
            }
        )
    return stats


def tool_metrics(total: dict) -> dict:
    """Multi-turn episodes' metrics (TRL's `tools/*` names where TRL has them), from the rank-summed statistics."""
    episodes, calls = max(1.0, total["tool_episodes"]), total["tool_calls"]
    metrics = {
        "tools/call_frequency": calls / episodes,  # TRL's: tool calls per episode
        "tools/failure_frequency": total["tool_failures"] / calls if calls else 0.0,  # TRL's: failed / calls
        "tools/success_frequency": (calls - total["tool_failures"]) / calls if calls else 0.0,
        "tools/malformed_frequency": total.get("tool_malformed", 0.0) / calls if calls else 0.0,  # unreadable / calls
        "tools/calling_episodes": total["tool_episodes_calling"] / episodes,
        "tools/succeeding_episodes": total["tool_episodes_succeeding"] / episodes,
        "tools/turns_per_episode": total["tool_turns"] / episodes,
        "retokenization_drift": total["tool_drifted"] / episodes,
    }
    if "agent_errors" in total:  # agents that own their loop (grpo.episodes.agent): episodes ended by the agent's
        # own fault, and requests refused for a rewritten history, per episode
        metrics["agent/error_frequency"] = total["agent_errors"] / episodes
        metrics["agent/refusals_per_episode"] = total["agent_refusals"] / episodes
    if "env_failures" in total:  # environment_factory: episodes whose environment failed (reset or a step)
        metrics["env/failure_frequency"] = total["env_failures"] / episodes
        metrics["env/step_reward_per_episode"] = total["env_step_reward"] / episodes
    from grpo.episodes.metrics import TURN_GROUPS

    for name in TURN_GROUPS:
        count = total.get(f"logprob_diff_{name}_count", 0.0)
        if count:
            metrics.update(
                {
                    f"rollout_logprob_diff_{name}": total[f"logprob_diff_{name}_sum"] / count,
                    f"rollout_logprob_diff_{name}_max": total[f"logprob_diff_{name}_max"],
                    f"is_ratio_{name}": total[f"is_ratio_{name}_sum"] / count,
                    f"is_ratio_{name}_min": total[f"is_ratio_{name}_min"],
                    f"is_ratio_{name}_max": total[f"is_ratio_{name}_max"],
                    f"model_tokens_{name}": int(count),
                }
            )
    return metrics


def step_metrics(
    total: dict, *, rollout_step: int, global_step: int, merge: bool, legacy_slice: bool, lr: float
) -> dict:
    """The metrics.jsonl line of a rollout step, from its statistics summed (min-ed, max-ed) over ranks."""
    n, ratios = max(1.0, total["samples"]), max(1.0, total["ratio_count"])
    reward_mean = total["reward_sum"] / n
    metrics = dict(
        rollout_step=rollout_step,
        global_step=global_step,
        merge=merge,
        legacy_slice=legacy_slice,
        reward_mean=reward_mean,
        reward_std=math.sqrt(max(0.0, total["reward_sq_sum"] / n - reward_mean**2)),
        ratio_mean=total["ratio_sum"] / ratios,
        ratio_min=total["ratio_min"],
        ratio_max=total["ratio_max"],
        ratio_onpolicy_mean=total["onpolicy_ratio_sum"] / max(1.0, total["onpolicy_ratio_count"]),
        ratio_onpolicy_maxdev=max(abs(total["onpolicy_ratio_max"] - 1), abs(1 - total["onpolicy_ratio_min"])),
        rollout_logprob_diff_mean=total["logprob_diff_sum"] / max(1, total["logprob_diff_count"]),
        rollout_logprob_diff_max=total["logprob_diff_max"],
        rollout_tokens=int(total["rollout_tokens"]),
        rollout_s=total["rollout_s"],
        rollout_tokens_per_s=total["rollout_tokens"] / total["rollout_s"],
        sync_s=total["sync_s"],
        update_s=total["update_s"],
        peak_mem_gb=total["peak_mem_gb"],
        loss=total["loss_sum"] / total["mini_batches"],
        lr=lr,
    )
    if "clip_region" in total:
        metrics.update(
            clip_frac=total["clip_region"] / ratios,
            clip_low_frac=total["clip_low"] / ratios,
            clip_high_frac=total["clip_high"] / ratios,
        )
    if "kl_sum" in total:
        metrics["kl"] = total["kl_sum"] / max(1.0, total["tokens"])
    if "vllm_ratio_sum" in total:
        metrics.update(
            is_ratio_mean=total["vllm_ratio_sum"] / max(1.0, total["vllm_ratio_count"]),
            is_ratio_min=total["vllm_ratio_min"],
            is_ratio_max=total["vllm_ratio_max"],
        )
    metrics.update({k: v for k, v in total.items() if k.startswith("sync_delta_")})
    if "sync_bytes" in total:  # vllm.mode=server, merge=true: what crossed the wire to the server
        metrics["sync_bytes"] = int(total["sync_bytes"])
    if "loss_scale_min" in total:  # fp16: the lowest loss scale of this step's updates; steps skipped so far
        metrics.update(loss_scale=total["loss_scale_min"], skipped_steps=int(total["skipped_steps_max"]))
    if "staleness_count" in total:  # max_staleness >= 1: versions behind, per sampled token; the check's coverage
        metrics.update(
            staleness_mean=total["staleness_sum"] / max(1.0, total["staleness_count"]),
            staleness_max=int(total["staleness_max"]),
            stale_completions=int(total["stale_completions"]),
            updated_in_flight=int(total["updated_in_flight"]),
            fidelity_tokens=int(total["logprob_diff_count"]),
        )
    if "rollout_wait_s" in total:  # server mode: each side's wait for the other (the slowest rank's)
        metrics.update(rollout_wait_s=total["rollout_wait_s"], server_idle_s=total["server_idle_s"])
    if "sync_changed_trainer" in total:
        metrics["sync_changed_trainer"] = int(total["sync_changed_trainer"])
    if "tool_episodes" in total:
        metrics.update(tool_metrics(total))
    return metrics


def write_metrics(metrics: dict, run_dir: Path, trackers, rank: int) -> None:
    """Append one line to run_dir/metrics.jsonl (the plots' source of truth) and hand it to the trackers (rank 0)."""
    if rank == 0:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        trackers.log(metrics, step=metrics["global_step"])


def log_rollout_step(metrics: dict, num_rollout_steps: int) -> None:
    """The rollout step's progress line in the log: reward, PPO ratios, the |vLLM - trainer| gap, speed, sync."""
    log.info(
        "rollout %d/%d (optimizer step %d) reward %.3f ratio %.6f [%.4g, %.4g] on-policy |ratio-1| %.1e "
        "|vllm-trainer| %.2e tok/s %.0f sync %.2fs",
        metrics["rollout_step"],
        num_rollout_steps,
        metrics["global_step"],
        metrics["reward_mean"],
        metrics["ratio_mean"],
        metrics["ratio_min"],
        metrics["ratio_max"],
        metrics["ratio_onpolicy_maxdev"],
        metrics["rollout_logprob_diff_mean"],
        metrics["rollout_tokens_per_s"],
        metrics["sync_s"],
    )


def params_digest(model) -> str:
    """SHA-1 of this rank's parameter bytes: proves a sync left the trainer's weights bit-for-bit alone."""
    digest = hashlib.sha1()
    for _, param in sorted(model.named_parameters()):
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Timeline:
    """When the trainer was busy with what, and when the server had this process's requests (epoch seconds), one
    line per rollout step in <run_dir>/timeline.jsonl (rank 0; vllm.mode=server): `recipes/plot_timeline.py` draws
    it."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path, self.enabled = run_dir / "timeline.jsonl", enabled
        self.spans: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def span(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.spans[name] = [start, time.time()]

    def write(self, rollout_step: int, server: list[tuple[float, float]], rank: int) -> None:
        if self.enabled and rank == 0:
            line = dict(rollout_step=rollout_step, trainer=self.spans, server=[list(i) for i in server])
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        self.spans = {}


def busy_fractions(lines: list[dict], every: list[dict] | None = None) -> dict:
    """Over timeline lines (`Timeline`, consecutive rollout steps; from the first one's sync to the last one's update):
    the seconds, the rollout steps per minute, and the share of the time the trainer synced or updated and the share
    the server had requests: the requests of ``every`` line (the whole timeline) that ran in that window, those sent
    ahead for later rollout steps included."""
    from grpo.engines.rollout_queue import union_seconds

    start, end = lines[0]["trainer"]["sync"][0], lines[-1]["trainer"]["update"][1]
    trainer = sum(hi - lo for t in lines for name, (lo, hi) in t["trainer"].items() if name != "rollout")
    server = union_seconds([tuple(i) for t in (every or lines) for i in t["server"]], start, end)
    return dict(
        seconds=end - start,
        rollout_steps_per_min=60 * len(lines) / (end - start),
        trainer_busy=trainer / (end - start),
        server_busy=server / (end - start),
    )
