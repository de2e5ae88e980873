"""The GRPO policy loss as a pure function: tensors in, the loss and named statistics out."""

from __future__ import annotations

import torch


def grpo_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type, epsilon_low, epsilon_high,
              beta=0.0, ref_per_token_logps=None, max_completion_length=None, tokens_per_mini_batch=None):
    m = mask.float()
    ratio = torch.exp((per_token_logps - old_per_token_logps) * m)
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    if beta > 0:
        delta = ref_per_token_logps - per_token_logps
        per_token = per_token + beta * (torch.exp(delta) - delta - 1)
    if loss_type == "grpo":
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (m.shape[0] * max_completion_length)
    else:
        loss = (per_token * m).sum() / tokens_per_mini_batch
    with torch.no_grad():
        real = ratio.detach()[mask.bool()]
        clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
        stats = dict(ratio_sum=real.sum(), ratio_min=real.min() if real.numel() else torch.tensor(float("inf")),
                     ratio_max=real.max() if real.numel() else torch.tensor(float("-inf")),
                     clipped=(clipped & mask.bool()).sum(), tokens=torch.tensor(float(real.numel())))
    return loss, ratio, stats
