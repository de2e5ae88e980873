"""The fp16 section: a few optimizer steps with model.dtype=float16 and dynamic loss scaling
(grpo/loss_scaling.py): losses finite, steps skipped, the scale."""

from __future__ import annotations

import torch

from bench.gpu_kit.policy import Trainer, build_policy, mini_batch
from grpo.loss_scaling import DynamicLossScale


def check_fp16(cfg, model_config, device: torch.device, steps: int) -> dict:
    """``steps`` optimizer steps in fp16 with dynamic loss scaling, as the recipe with model.dtype=float16."""
    model = build_policy(cfg, model_config, torch.float16, device, seed=3)
    trainer = Trainer(
        cfg,
        model,
        mini_batch(cfg, model_config.vocab_size, device, full_length=False, seed=3),
        DynamicLossScale(enabled=True),
    )
    records = [trainer.step() for _ in range(steps)]
    return dict(
        steps=records,
        skipped_steps=trainer.loss_scale.skipped_steps,
        all_losses_finite=all(torch.isfinite(torch.tensor(r["loss"])) for r in records),
    )
