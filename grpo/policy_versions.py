"""The fidelity check of asynchronous rollouts (max_staleness >= 1): vLLM's log-probs against the trainer's, on the
weights that sampled each token.

Synchronous rollouts are scored by the version that sampled them, so |vLLM - trainer| on the old log-probs proves
the sync. Asynchronous ones are mostly sampled by earlier versions. The check covers the completions sampled wholly
by one version v (one an update landed in was prefilled again on the new weights, so each of its segments is its
version's, docs/async.md; the check leaves those out): v = the trainer's own (the old log-probs, free), and v
earlier for the first mini-batch, scored in a no-grad forward with version v's LoRA factors swapped in.
`PolicyVersions` keeps those factors: this rank's shards of the last max_staleness versions, adapter-sized copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from grpo.data import select


class PolicyVersions:
    """This rank's LoRA factors (the trainable parameters) at each of the last ``keep`` policy versions."""

    def __init__(self, model: torch.nn.Module, keep: int):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.keep = keep
        self.saved: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def remember(self, version: int) -> None:
        """Keep the factors the trainer holds now as ``version`` (each sync), forgetting versions past ``keep``."""
        self.saved[version] = [p.detach().clone() for p in self.params]
        for old in [v for v in self.saved if v < version - self.keep]:
            del self.saved[old]

    @contextlib.contextmanager
    @torch.no_grad()
    def serving(self, version: int):
        """The model holds ``version``'s factors inside the block (copied into the shards FSDP2 gathers from)."""
        now = [p.detach().clone() for p in self.params]
        try:
            for p, saved in zip(self.params, self.saved[version]):
                p.copy_(saved)
            yield
        finally:
            for p, current in zip(self.params, now):
                p.copy_(current)


def completion_versions(versions: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] the one version that sampled each completion's every token; -1 where it changed midway."""
    mask = response_mask.bool()
    high = torch.where(mask, versions, torch.full_like(versions, -(2**31))).max(dim=1).values
    low = torch.where(mask, versions, torch.full_like(versions, 2**31)).min(dim=1).values
    return torch.where(high == low, high, torch.full_like(high, -1))


def sampler_log_probs(
    batch: dict,
    rows: slice,
    policies: PolicyVersions,
    rollout_step: int,
    max_staleness: int,
    score: Callable[[dict], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the tokens under the version that sampled them, and where they are known ([N, R]
    each): completions of one version, the trainer's own everywhere, earlier ones in ``rows`` (``score(sub)`` is the
    recipe's no-grad forward of a mini-batch). Every rank runs one forward per earlier version (FSDP2 collectives)."""
    one_version = completion_versions(batch["versions"], batch["response_mask"])
    logps = batch["old_logprobs"].clone()
    known = one_version == rollout_step
    sub = select(batch, rows)
    width = sub["response_mask"].shape[1]
    for version in range(rollout_step - max_staleness, rollout_step):
        if version not in policies.saved:  # before the run's (or the resume's) first version
            continue
        with policies.serving(version):
            stale = score(sub)
        hit = one_version[rows] == version
        logps[rows][hit, :width] = stale[hit]  # a view of logps: written in place
        known[rows] |= hit
    return logps, batch["response_mask"].bool() & known[:, None]
