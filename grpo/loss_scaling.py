"""Dynamic loss scaling for fp16 training (model.dtype: float16), on FSDP2 shards.

fp16 keeps 10 mantissa bits but only 5 exponent bits: a gradient below 6e-8 flushes to zero in the fp16 backward
before it reaches the fp32 LoRA weights. The loss is multiplied by ``scale`` before ``backward()`` so that small
gradients stay representable, and the fp32 gradients are divided back before clipping and the optimizer step.
The rule is ``torch.amp.GradScaler``'s (start at 2**16, halve on an inf/NaN gradient and skip that step, double
after ``growth_interval`` clean steps), written out because FSDP2's gradients are sharded DTensors: an overflow
may land in one rank's shard only, so the finite check is a collective and every rank skips the same steps.
bf16 and fp32 share fp32's exponent range and need none of this: the scaler is then disabled (scale 1, no check).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from grpo.parallel import reduce_across_ranks


class DynamicLossScale:
    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0  # since the last change of scale
        self.skipped_steps = 0  # over the whole run

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on."""
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide the gradients of ``params`` by the scale; True if every rank's gradients are finite (collective).

        On False the gradients hold an overflow: `step` then skips the optimizer step and backs off.
        """
        if not self.enabled:
            return True
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / self.scale)
        local_overflow = any(not bool(torch.isfinite(g).all()) for g in grads)
        return not reduce_across_ranks(maxs={"overflow": float(local_overflow)})["overflow"]

    def step(self, optimizer: torch.optim.Optimizer, finite: bool) -> None:
        """The optimizer step if the gradients are finite (skipped on an overflow), then `update`."""
        if finite:
            optimizer.step()
        self.update(finite)

    def update(self, finite: bool) -> None:
        """After each optimizer step (or skipped step): back off on an overflow, grow after a clean stretch."""
        if not self.enabled:
            return
        if finite:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0
        else:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1

    def stats(self) -> dict[str, torch.Tensor]:
        """The mini-batch statistics (grpo.loss.reduce_op names): the scale now, the steps skipped so far."""
        if not self.enabled:
            return {}
        return dict(
            loss_scale_min=torch.tensor(self.scale, dtype=torch.float64),
            skipped_steps_max=torch.tensor(float(self.skipped_steps), dtype=torch.float64),
        )

    def state_dict(self) -> dict:
        return dict(scale=self.scale, clean_steps=self.clean_steps, skipped_steps=self.skipped_steps)

    def load_state_dict(self, state: dict | None) -> None:
        if self.enabled and state:
            self.scale, self.clean_steps = state["scale"], state["clean_steps"]
            self.skipped_steps = state["skipped_steps"]
