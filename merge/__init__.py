"""Merged LoRA weights for the rollout engine, one decoder layer at a time, without touching the trainer.

The public names, re-exported from the modules that hold them (docs/layout.md).
"""

from merge.layers import (
    UnsupportedAdapterError,
    check_supported,
    checkpoint_converted_names,
    decoder_layers,
    in_checkpoint_format,
    normalize_peft_param_name,
)
from merge.merged_params import merged_lora_params
from merge.precision import MergePrecisionStats
from merge.vllm_compat import has_fused_experts, in_process_model, reload_vllm_weights, vllm_unservable_lora_targets

__all__ = [
    "merged_lora_params",
    "MergePrecisionStats",
    "UnsupportedAdapterError",
    "check_supported",
    "decoder_layers",
    "normalize_peft_param_name",
    "checkpoint_converted_names",
    "in_checkpoint_format",
    "reload_vllm_weights",
    "in_process_model",
    "has_fused_experts",
    "vllm_unservable_lora_targets",
]
