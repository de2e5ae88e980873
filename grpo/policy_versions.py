"""The fidelity check of asynchronous rollouts (max_staleness >= 1): vLLM's log-probs against the trainer's, on the
weights that sampled each token.

Synchronous rollouts are scored by the version that sampled them, so |vLLM - trainer| on the old log-probs proves
the sync. Asynchronous ones are mostly sampled by earlier versions, and a completion can hold tokens of several (an
update that landed in flight was prefilled again on the new weights; a tool episode's turns are requests of their
own): every token is its version's sample given its whole prefix (docs/async.md). The check covers tokens by the
version v that sampled each: v = the trainer's own on every completion (the old log-probs, free), and v earlier on
the first mini-batch, scored in a no-grad forward with version v's LoRA factors swapped in.
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


def sampler_log_probs(
    batch: dict,
    rows: slice,
    policies: PolicyVersions,
    rollout_step: int,
    max_staleness: int,
    score: Callable[[dict], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the tokens under the version that sampled them, and where they are known ([N, R]
    each), token by token: the trainer's own version's tokens everywhere (the old log-probs), earlier versions'
    tokens in ``rows`` (``score(sub)`` is the recipe's no-grad forward of a mini-batch), whatever else sampled the
    rest of their completion (an update that landed mid-request, a sync between two turns of a tool episode: each
    token is its version's sample given its whole prefix, docs/async.md). Every rank runs one forward per earlier
    version (FSDP2 collectives)."""
    versions, sampled = batch["versions"], batch["response_mask"].bool()
    logps = batch["old_logprobs"].clone()
    known = sampled & (versions == rollout_step)
    sub = select(batch, rows)
    width = sub["response_mask"].shape[1]
    for version in range(rollout_step - max_staleness, rollout_step):
        if version not in policies.saved:  # before the run's (or the resume's) first version
            continue
        with policies.serving(version):
            stale = score(sub)
        hit = sampled[rows, :width] & (versions[rows, :width] == version)
        logps[rows, :width][hit] = stale[hit]  # a view of logps: written in place
        known[rows, :width] |= hit
    return logps, known
