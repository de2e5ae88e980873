"""The GRPO loss's settings (TRL ``GRPOConfig`` names and defaults) and the check that refuses, by name, what
grpo/loss.py does not implement. Standard library only: the recipe's config check uses it before torch is imported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_VALUES = {
    "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"),
    "importance_sampling_level": ("token", "sequence"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
}
# TRL options this module does not implement, with the one value it honours (TRL's default: the option is off).
UNIMPLEMENTED_OPTIONS = {
    "off_policy_mask_threshold": None,  # DeepSeek-V3.2 off-policy sequence mask
    "entropy_coef": 0.0,  # entropy bonus
    "use_adaptive_entropy": False,  # adaptive entropy bonus
}


@dataclass(frozen=True)
class LossSettings:
    """The fields of TRL's ``GRPOConfig`` that ``_compute_loss`` reads, with TRL's defaults.

    ``gradient_accumulation_steps``, ``steps_per_generation`` and ``num_processes`` only set the normaliser (see
    :func:`grpo_loss`); TRL's ``steps_per_generation=None`` resolves to ``gradient_accumulation_steps`` (1).
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"  # "sequence": GSPO
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon. cispo: the cap on the ratio (epsilon_max)
    delta: float | None = None  # two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta
    beta: float = 0.0  # weight of the k3 KL to the reference
    use_bias_correction_kl: bool = True  # multiply the KL by the policy ratio (DeepSeek-V3.2)
    top_entropy_quantile: float = 1.0  # < 1: only this top fraction of tokens by entropy enters the policy loss
    max_completion_length: int | None = 512  # dr_grpo's constant length
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_processes: int = 1

    def __post_init__(self):
        check_supported(self)

    @property
    def upper_epsilon(self) -> float:
        """``epsilon_high``, or ``epsilon`` when unset (TRL's ``self.epsilon_high``)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_config(cls, config, **overrides) -> LossSettings:
        """Settings from any config with TRL's field names (TRL's ``GRPOConfig``, the recipe's), after
        :func:`check_supported`. Fields the config lacks keep their defaults; ``overrides`` win (e.g.
        ``num_processes=world_size``). As in TRL, ``use_vllm=False`` turns the vLLM correction off."""
        check_supported(config)
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)}
        if getattr(config, "use_vllm", True) is False:
            values["vllm_importance_sampling_correction"] = False
        return cls(**{**values, **overrides})


def check_supported(config) -> None:
    """Raise ``ValueError`` naming the field and value of any setting this module cannot honour.

    ``config`` is any object with TRL ``GRPOConfig`` field names; fields it lacks are not checked.
    """
    for name, allowed in SUPPORTED_VALUES.items():
        value = getattr(config, name, allowed[0])
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported; supported: {', '.join(allowed)}")
    for name, honoured in UNIMPLEMENTED_OPTIONS.items():
        value = getattr(config, name, honoured)
        if value != honoured:
            raise ValueError(f"{name}={value!r} is not supported: only {name}={honoured!r} (TRL's default)")
    quantile = getattr(config, "top_entropy_quantile", 1.0)
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={quantile!r} must be in [0, 1]")
    if getattr(config, "vllm_importance_sampling_correction", False):
        clip_min = getattr(config, "vllm_importance_sampling_clip_min", None)
        clip_max = getattr(config, "vllm_importance_sampling_clip_max", None)
        mode = getattr(config, "vllm_importance_sampling_mode", "sequence_mask")
        if mode.endswith("_truncate") and clip_min is None and clip_max is None:
            raise ValueError(
                f"vllm_importance_sampling_mode={mode!r} needs vllm_importance_sampling_clip_min "
                "or vllm_importance_sampling_clip_max"
            )
        if clip_min is not None and clip_max is not None and clip_min >= clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={clip_min!r} must be less than "
                f"vllm_importance_sampling_clip_max={clip_max!r}"
            )
