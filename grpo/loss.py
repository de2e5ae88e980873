"""GRPO loss as pure functions: TRL 1.16 ``GRPOTrainer._compute_loss`` without the trainer.

Tensors in, ``(loss, stats)`` out. ``stats`` hold sums, counts, minima and maxima, never means, so a caller can add
them up over mini-batches and all-reduce them over ranks by name (:func:`reduce_op`), then divide. Settings carry
TRL ``GRPOConfig`` names and defaults (grpo/loss_settings.py: it refuses, by name, what this module does not
implement).
tests/test_grpo_loss.py compares loss, gradients and metrics with TRL's own code.

Shapes: ``B`` completions, ``T`` completion columns (right-padded); ``mask`` ``[B, T]`` marks the tokens that count.
``mask_truncated_completions`` is the caller's job: zero the rows of truncated completions in ``mask``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from grpo.loss_settings import SUPPORTED_VALUES, LossSettings

PPO_CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the losses with TRL's clip_ratio/* metrics


def reduce_op(stat_name: str) -> str:
    """How to combine a stat over mini-batches and ranks: ``"min"`` for ``*_min``, ``"max"`` for ``*_max``,
    else ``"sum"``."""
    return stat_name.rsplit("_", 1)[-1] if stat_name.endswith(("_min", "_max")) else "sum"


def accumulate_stats(total: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``total`` combined with ``stats`` name by name (:func:`reduce_op`); names in only one of them are kept."""
    combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
    return {
        **total,
        **{
            name: combine[reduce_op(name)](total[name], value) if name in total else value
            for name, value in stats.items()
        },
    }


def _entries(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The entries TRL's metrics average: the masked tokens of ``[B, T]`` values, every row of ``[B, 1]`` values
    (per-sequence values, fully masked rows included, as TRL counts them)."""
    if values.shape[-1] == 1 and mask.shape[-1] != 1:
        return values.reshape(-1)
    return values.expand(mask.shape)[mask.bool()]


def _sum_min_max_count(prefix: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sum, min, max and count of 1-D ``values`` as float64; an empty min/max is the identity (+inf / -inf)."""
    values = values.detach().double()
    empty = values.numel() == 0
    return {
        f"{prefix}_sum": values.sum(),
        f"{prefix}_min": values.new_tensor(math.inf) if empty else values.min(),
        f"{prefix}_max": values.new_tensor(-math.inf) if empty else values.max(),
        f"{prefix}_count": values.new_tensor(float(values.numel())),
    }


def _sequence_fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence fraction of flagged entries: ``[B, 1]`` flags are already per sequence; ``[B, T]`` rows
    without tokens are dropped (TRL: 0/0 = NaN, then ignored by nanmin/nanmax)."""
    if flags.shape[-1] == 1 and mask.shape[-1] != 1:
        return flags.reshape(-1).double()
    tokens = mask.sum(-1)
    return ((flags * mask).sum(-1) / tokens)[tokens > 0].double()


@torch.no_grad()
def vllm_importance_sampling_ratio(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's ``importance_sampling_ratio``: trainer-over-vLLM probability of the sampled tokens, truncated or masked.

    In: ``[B, T]`` log-probs of the sampled tokens under the trainer (old) and under vLLM (NaN where vLLM gave
    none: ratio 1 there), ``mask`` ``[B, T]``. ``token_*`` modes give ``[B, T]`` weights, ``sequence_*`` modes
    ``[B, 1]`` (exp of the summed log difference). ``*_truncate`` clamps to ``[clip_min, clip_max]``, ``*_mask``
    sets weights outside it to 0 (``None``: unbounded on that side).

    Stats: ``vllm_ratio_sum/_min/_max/_count`` over the weights (every row in sequence modes, masked tokens in
    token modes) and ``vllm_logp_diff_sum/_max/_count`` of ``|old - sampling|`` over masked non-NaN tokens. TRL's
    ``sampling/*`` metrics are their per-rank means averaged over ranks; ``sum / count`` here is the global mean.
    """
    if mode not in SUPPORTED_VALUES["vllm_importance_sampling_mode"]:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not supported")
    logps_diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    sequence_level = mode.startswith("sequence_")
    if sequence_level:
        logps_diff = logps_diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(logps_diff)
    if mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    real = mask.bool()
    logp_diff = torch.abs(old_per_token_logps - sampling_per_token_logps)
    logp_diff = logp_diff[real & ~torch.isnan(logp_diff)].double()
    stats = _sum_min_max_count("vllm_ratio", ratio.reshape(-1) if sequence_level else ratio[real])
    stats.update(
        vllm_logp_diff_sum=logp_diff.sum(),
        vllm_logp_diff_count=logp_diff.new_tensor(logp_diff.numel()),
        vllm_logp_diff_max=logp_diff.max() if logp_diff.numel() else logp_diff.new_tensor(-math.inf),
    )
    return ratio, stats


@torch.no_grad()
def high_entropy_mask(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    top_entropy_quantile: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """TRL's ``get_high_entropy_mask``: bool ``[B, T]``, True at masked tokens whose entropy is at least the
    ``1 - top_entropy_quantile`` quantile of the pooled entropies of masked tokens.

    TRL pools over all processes. ``gather=None`` pools this rank's tokens only (the recipe's per-rank rollout):
    the threshold then differs from TRL's with more than one process. To pool like TRL, pass ``gather``: it takes
    this rank's 1-D fp32 entropies and returns every rank's, concatenated (lengths may differ across ranks).
    """
    pooled = entropies[mask.bool()].float()
    if gather is not None:
        pooled = gather(pooled)
    if pooled.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    threshold = torch.quantile(pooled, 1 - top_entropy_quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


def _policy_loss(ratio, per_token_logps, advantages, settings):
    """Per-token policy loss (before masks and weights), and the ratio the clip metrics read."""
    if settings.loss_type == "cispo":
        capped = torch.clamp(ratio, max=settings.upper_epsilon).detach()
        return -capped * advantages * per_token_logps, ratio
    if settings.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        return -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages, ratio
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.upper_epsilon)
    if settings.delta is not None:
        ratio = torch.clamp(ratio, max=settings.delta)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def _normalise(per_token_loss, mask, settings, num_items_in_batch):
    """TRL's training-mode reduction of the per-token loss to one scalar."""
    loss_type = settings.loss_type
    if loss_type in ("dapo", "cispo"):  # every token of the generation batch weighs the same
        tokens_per_process = torch.as_tensor(num_items_in_batch, device=mask.device).clamp(min=1.0)
        tokens_per_process = tokens_per_process / settings.num_processes
        normaliser = tokens_per_process * settings.gradient_accumulation_steps / settings.steps_per_generation
        return (per_token_loss * mask).sum() / normaliser
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * settings.max_completion_length)
    else:  # luspo: sequences weigh by their length
        loss = (per_token_loss * mask).sum(-1).mean()
    return loss / settings.gradient_accumulation_steps


@torch.no_grad()
def _loss_stats(ratio, clip_ratio, advantages, mask, settings, per_token_kl, entropy_mask):
    """Sums, counts, minima and maxima of one mini-batch (see :func:`grpo_loss`)."""
    real = mask.bool()
    entry_shape = torch.broadcast_shapes(ratio.shape, advantages.shape)  # TRL's clip flags have this shape
    stats = {"tokens": real.sum().double(), **_sum_min_max_count("ratio", _entries(ratio.expand(entry_shape), mask))}
    if per_token_kl is not None:
        stats["kl_sum"] = (per_token_kl * mask).sum().double()
    if entropy_mask is not None:
        stats["entropy_mask_tokens"] = (entropy_mask & real).sum().double()
    if settings.loss_type == "cispo":
        cispo_clipped = (clip_ratio > settings.upper_epsilon) & (advantages > 0)
        stats["cispo_clip"] = _entries(cispo_clipped, mask).sum().double()
    elif settings.loss_type in PPO_CLIP_LOSSES:
        low = ((clip_ratio < 1 - settings.epsilon) & (advantages < 0)).double()
        high = ((clip_ratio > 1 + settings.upper_epsilon) & (advantages > 0)).double()
        low_fraction, high_fraction = _sequence_fraction(low, mask), _sequence_fraction(high, mask)
        stats.update(
            clip_low=_entries(low, mask).sum(),
            clip_high=_entries(high, mask).sum(),
            clip_region=_entries(torch.maximum(low, high), mask).sum(),
            clip_low_seq_fraction_min=low_fraction.min() if low_fraction.numel() else low.new_tensor(math.inf),
            clip_high_seq_fraction_max=high_fraction.max() if high_fraction.numel() else high.new_tensor(-math.inf),
        )
    return stats


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    ref_per_token_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL 1.16 ``GRPOTrainer._compute_loss`` (training mode) on given log-probs: ``(loss, stats)``.

    In: ``per_token_logps`` ``[B, T]`` (the graph to differentiate), ``old_per_token_logps`` ``[B, T]`` (detached,
    from before this rollout's updates), ``advantages`` ``[B]`` or ``[B, T]``, ``mask`` ``[B, T]``. Needed when the
    settings use them, refused otherwise: ``ref_per_token_logps`` ``[B, T]`` (``beta != 0``),
    ``importance_sampling_ratio`` from :func:`vllm_importance_sampling_ratio` (vLLM correction), bool
    ``entropy_mask`` ``[B, T]`` from :func:`high_entropy_mask` (``top_entropy_quantile < 1``), and
    ``num_items_in_batch`` (dapo, cispo): the masked-token count of the whole generation batch (all
    ``steps_per_generation`` mini-batches), summed over all ranks by the caller.

    Normalisation, as TRL: grpo/sapo average per-sequence token means, bnpo averages tokens, dr_grpo divides by
    ``B * max_completion_length``, luspo averages per-sequence sums; each then divides by
    ``gradient_accumulation_steps``. dapo/cispo divide the token sum by ``num_items_in_batch / num_processes *
    gradient_accumulation_steps / steps_per_generation``. With one optimizer step per mini-batch
    (``gradient_accumulation_steps=1``) and gradients averaged over ranks (FSDP2/DDP), every token of the
    generation batch then weighs the same, as in TRL.

    ``stats`` (float64 scalars; combine with :func:`accumulate_stats` / :func:`reduce_op`): counts ``tokens``
    (masked tokens) and ``ratio_count``; sums ``ratio_sum`` and, when present, ``kl_sum`` (over tokens),
    ``entropy_mask_tokens`` (tokens kept by the entropy mask), ``clip_low``, ``clip_high``, ``clip_region``
    (grpo/bnpo/dr_grpo/dapo/luspo) or ``cispo_clip`` (counts of clipped ratio entries); minima ``ratio_min``,
    ``clip_low_seq_fraction_min``; maxima ``ratio_max``, ``clip_high_seq_fraction_max``. Ratio entries are
    TRL's: masked tokens at the token level, every sequence at the sequence level. TRL's metrics are then
    ``kl = kl_sum / tokens``, ``clip_ratio/*_mean = clip_* / ratio_count``, ``cispo_clip_ratio = cispo_clip /
    ratio_count``, ``clip_ratio/low_min`` and ``/high_max`` the two fraction stats.
    """
    _check_inputs(settings, ref_per_token_logps, importance_sampling_ratio, entropy_mask, num_items_in_batch)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if settings.importance_sampling_level == "sequence":  # GSPO: one length-normalised ratio per sequence
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)

    per_token_loss, clip_ratio = _policy_loss(ratio, per_token_logps, advantages, settings)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    per_token_kl = None
    if settings.beta != 0.0:  # k3 estimator of KL(policy || reference)
        ref_log_ratio = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_loss + settings.beta * per_token_kl

    loss = _normalise(per_token_loss, mask, settings, num_items_in_batch)
    return loss, _loss_stats(ratio, clip_ratio, advantages, mask, settings, per_token_kl, entropy_mask)


def _check_inputs(settings, ref_per_token_logps, importance_sampling_ratio, entropy_mask, num_items_in_batch):
    """Refuse a missing input the settings need, or a given one they would ignore."""
    expected = {
        "ref_per_token_logps": (ref_per_token_logps, settings.beta != 0.0, "beta != 0"),
        "importance_sampling_ratio": (
            importance_sampling_ratio,
            settings.vllm_importance_sampling_correction,
            "vllm_importance_sampling_correction=True",
        ),
        "entropy_mask": (entropy_mask, settings.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
        "num_items_in_batch": (num_items_in_batch, settings.loss_type in ("dapo", "cispo"), "loss_type dapo or cispo"),
    }
    for name, (value, needed, condition) in expected.items():
        if needed and value is None:
            raise ValueError(f"{name} is required with {condition}")
        if not needed and value is not None:
            raise ValueError(f"{name} was given but is only used with {condition}")
