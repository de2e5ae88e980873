"""What stops a run instead of letting it train on bad numbers: NaN/inf, a signal, an engine that left the trainer.

- `stop_if_nonfinite`: a NaN/inf reward, loss, ratio or gradient norm on any rank stops every rank before the
  optimizer update (collective), naming the step and the quantity and the last good checkpoint.
- `StopRequest`: SIGINT/SIGTERM set a flag that the loop reads between phases (save, then exit 128 + signal); one
  that comes while the rollout waits on tools or on the server abandons that rollout step at once.
- `LogprobGuard`: the mean |vLLM - trainer| log-prob of the sampled tokens (over the step, and over each turn group
  of multi-turn episodes), above a limit calibrated at the first rollout step, means vLLM serves other weights than
  the trainer's (a broken or skipped sync); judged before the step's update, which it stops.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from grpo.config import MAX_LOGPROB_DIFF, RecipeConfig
from grpo.engines.interface import RolloutAbandoned, stop_requested
from grpo.parallel import reduce_across_ranks

log = logging.getLogger("grpo")


class NonFiniteError(RuntimeError):
    """A NaN or inf in a training quantity; the step was stopped before it could change the weights."""


def stop_if_nonfinite(where: str, quantities: dict[str, torch.Tensor], last_checkpoint: Path | None) -> None:
    """Collective: every rank raises if any rank found a NaN/inf in one of ``quantities``."""
    local = [v.full_tensor() if isinstance(v, DTensor) else v for v in quantities.values()]
    bad = reduce_across_ranks(
        maxs={name: float(not bool(torch.isfinite(v.detach()).all())) for name, v in zip(quantities, local)}
    )
    names = [name for name, flag in bad.items() if flag]
    if names:
        resume = (
            f"the last good checkpoint is {last_checkpoint}: resume with resume_from_checkpoint={last_checkpoint} "
            "(e.g. with a lower learning_rate)"
            if last_checkpoint
            else "no checkpoint was written yet"
        )
        raise NonFiniteError(
            f"{where}: non-finite {', '.join(names)} (NaN or inf); stopped before the optimizer "
            f"update, no checkpoint written after it; {resume}"
        )


def stop_if_environment_failing(engine, limit: int, last_checkpoint: Path | None) -> None:
    """Collective (with environment_factory): every rank raises `EnvironmentFailing` if on any rank more than
    ``limit`` episodes in a row failed (their environment's reset or a step raised or hung), before the update."""
    if not hasattr(engine, "failure_streak"):
        return
    from grpo.episodes.environments import EnvironmentFailing

    longest, last = engine.failure_streak()
    worst = int(reduce_across_ranks(maxs={"env_failure_streak": longest})["env_failure_streak"])
    if worst > limit:
        checkpoint = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
        raise EnvironmentFailing(
            f"{worst} environment episodes in a row failed, more than tool_calling.max_consecutive_failures={limit} "
            f"(the last on this process: {last}); stopped before the update, {checkpoint}"
        )


class StopRequest:
    """SIGINT/SIGTERM set a flag: the loop checks it between phases, saves a checkpoint and exits. One that comes
    while the rollout waits on tools or on the server (a hung tool waits up to tool_calling.timeout_s, a server
    request as long as it generates) also ends that wait with `RolloutAbandoned`: the step in progress is given up
    and the checkpoint is the previous step's, within seconds, well inside a launcher's grace period."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        # A repeated signal changes nothing: after the first, every later wait of the rollout gives itself up on
        # entry. It often comes at once (a scheduler signals every process of the job, and the launcher passes its
        # own on), and Python may run it inside this handler: raising there would cut the first one's line short.
        if self.signum:
            return
        self.signum = signum
        abandon = stop_requested()
        log.warning(
            "%s received: %s",
            signal.Signals(signum).name,
            "abandoning the rollout step in progress, then a checkpoint of the last finished step"
            if abandon
            else "stopping at the next step boundary, after a checkpoint",
        )
        if abandon:
            raise RolloutAbandoned(f"{signal.Signals(signum).name} during the rollout")

    def agreed(self) -> int:
        """The signal any rank received (a collective, so that all ranks stop at the same point), or 0."""
        return int(reduce_across_ranks(maxs={"signal": self.signum})["signal"])


class LogprobGuard:
    """Stops the run when vLLM stops serving the trainer's weights, judged by the mean |vLLM - trainer| log-prob.

    The first rollout step of a run (LoRA B = 0: engine and trainer differ by their kernels alone) calibrates the
    guard: the limit is the larger of vllm.max_logprob_diff (or the dtype's default) and ``BASELINE_MULTIPLE``
    times that baseline, so other kernels (vLLM's GPU attention and CUDA graphs against SDPA) do not stop a
    healthy run. A baseline far above any kernel difference (``BASELINE_CEILING`` x the dtype's default) means
    the very first sync is broken. The baseline is kept in checkpoints (``baseline``), so a resumed run keeps it.
    """

    BASELINE_MULTIPLE = 10
    BASELINE_CEILING = 50

    def __init__(self, cfg: RecipeConfig, baseline: float | None = None):
        self.floor = cfg.max_logprob_diff()
        self.ceiling = self.BASELINE_CEILING * MAX_LOGPROB_DIFF[cfg.model.dtype]
        self.dtype = cfg.model.dtype
        self.baseline = baseline

    @property
    def limit(self) -> float:
        return max(self.floor, self.BASELINE_MULTIPLE * self.baseline)

    def check(self, rollout_step: int, totals: dict) -> None:
        """Raise if this rollout step's |vLLM - trainer| log-probs (``totals``, from `grpo.metrics.fidelity_totals`:
        sums, counts and largest values, over the step and per turn group) say the engine left the trainer.

        The step is judged by its mean. A turn group is judged by its mean with its largest token left out: a broken
        sync moves every token, while one token of a sparse group can differ by far more than the mean between two
        healthy kernels (a single bf16 token's |delta log p| reached 0.16 between two bf16 attentions,
        docs/gpu_check.md) and, alone in a group of a few tokens, would carry its mean over the limit. So a group of n
        tokens stops the run when their sum exceeds limit * (n - 1) plus its largest token; one of a single token is
        judged within the step's mean only."""
        diff = totals["logprob_diff_sum"] / max(1.0, totals["logprob_diff_count"])
        if self.baseline is None:
            if diff > self.ceiling:
                raise RuntimeError(
                    f"rollout step {rollout_step}: rollout_logprob_diff_mean={diff:.3g} before any update exceeds "
                    f"{self.ceiling:g} ({self.BASELINE_CEILING}x the {self.dtype} default): vLLM does not serve the "
                    "trainer's weights even at the start (a broken weight sync or a different checkpoint)"
                )
            self.baseline = diff
            log.info(
                "log-prob guard: baseline |vLLM - trainer| %.3g at rollout step %d; the run stops above %.3g",
                diff,
                rollout_step,
                self.limit,
            )
        judged = [("rollout_logprob_diff_mean", diff)]
        turn_counts = [key for key in totals if key.endswith("_count") and key != "logprob_diff_count"]
        for group in [key.removeprefix("logprob_diff_").removesuffix("_count") for key in turn_counts]:
            count = totals[f"logprob_diff_{group}_count"]
            if count > 1:
                rest = totals[f"logprob_diff_{group}_sum"] - totals[f"logprob_diff_{group}_max"]
                judged.append((f"rollout_logprob_diff_{group} (its largest token left out)", rest / (count - 1)))
        name, diff = max(judged, key=lambda item: item[1])
        if diff > self.limit:
            raise RuntimeError(
                f"rollout step {rollout_step}: {name}={diff:.3g} exceeds the guard's limit "
                f"{self.limit:.3g} (the larger of vllm.max_logprob_diff={self.floor:g} and {self.BASELINE_MULTIPLE}x "
                f"the first step's baseline {self.baseline:.3g}): vLLM is not serving the trainer's weights (a broken "
                "or skipped weight sync); stopped before this step's update instead of training on stale rollouts. "
                "(If the sync works and your kernels just differ more, raise vllm.max_logprob_diff.)"
            )
