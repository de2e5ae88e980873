"""Which modules carry LoRA, and the names a checkpoint of the base model gives their tensors.

``check_supported`` refuses what :func:`merge.merged_lora_params` cannot merge (naming it), ``decoder_layers``
finds the decoder layers (the FSDP2 groups the merge walks one at a time), ``normalize_peft_param_name`` maps a
peft parameter name to the base model's, and ``checkpoint_converted_names`` / ``in_checkpoint_format`` put
tensors held fused in memory back into the checkpoint's layout with transformers' ``revert_weight_conversion``
(the function ``save_pretrained`` uses).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer, LoraModel, ParamWrapper
from transformers.core_model_loading import revert_weight_conversion

__all__ = [
    "UnsupportedAdapterError",
    "normalize_peft_param_name",
    "decoder_layers",
    "check_supported",
    "checkpoint_converted_names",
    "in_checkpoint_format",
]

_PEFT_PREFIX = "base_model.model."
_LORA_ONLY_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


class UnsupportedAdapterError(ValueError):
    """The adapter cannot be merged by :func:`merge.merged_lora_params` (the message says what and why)."""


def normalize_peft_param_name(name: str) -> str | None:
    """Map a peft parameter name to the base model's ``state_dict()`` name, or None if it has none.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``; ``...modules_to_save.default.weight`` -> ``...weight``;
    ``...mlp.experts.base_layer.base_layer.gate_up_proj`` (nested ``target_parameters`` wrappers) ->
    ``...mlp.experts.gate_up_proj``. LoRA factors (``lora_A``/``lora_B``/...) and the frozen
    ``original_module`` copy kept beside a ``modules_to_save`` module return None: they are not base-model
    tensors.
    """
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    parts = name.split(".")
    if any(marker in parts for marker in _LORA_ONLY_MARKERS) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        del parts[i : i + 2]  # "modules_to_save.<adapter>"
    return ".".join(p for p in parts if p != "base_layer")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a (peft-wrapped) Hugging Face causal LM: ``<base>.model.layers``."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(base).__name__} has no `.model.layers` ModuleList of decoder layers")
    return layers


def check_supported(model: torch.nn.Module) -> str:
    """Return the single active LoRA adapter's name, or raise naming what is unsupported."""
    if not isinstance(model, PeftModel):
        raise UnsupportedAdapterError(f"expected a peft PeftModel with a LoRA adapter, got {type(model).__name__}")
    if not isinstance(model.base_model, LoraModel):
        raise UnsupportedAdapterError(
            f"only LoRA adapters can be merged, got tuner {type(model.base_model).__name__} "
            f"(peft_type={model.peft_config[model.active_adapter].peft_type})"
        )
    active = model.base_model.active_adapters
    if len(active) != 1:
        raise UnsupportedAdapterError(f"exactly one active adapter is supported, got {len(active)}: {active}")
    adapter = active[0]
    config = model.peft_config[adapter]
    for field_name in ("use_dora", "use_rslora_variant", "use_bdlora", "use_alora"):
        if getattr(config, field_name, False):
            raise UnsupportedAdapterError(f"adapter {adapter!r} sets {field_name}=True; only plain LoRA is supported")
    tied = getattr(model.get_base_model().config, "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if adapter in module.lora_variant:
                variant = type(module.lora_variant[adapter]).__name__
                raise UnsupportedAdapterError(f"{name} uses the LoRA variant {variant} (e.g. DoRA); unsupported")
            if isinstance(module.get_base_layer(), torch.nn.Embedding) and tied:
                raise UnsupportedAdapterError(
                    f"{name}: LoRA on an embedding tied to lm_head (tie_word_embeddings=True) is unsupported: "
                    "the merged embedding would also change lm_head, which the trainer's forward leaves as is"
                )
            if not isinstance(module, ParamWrapper) and not isinstance(
                module.get_base_layer(), (torch.nn.Linear, torch.nn.Embedding)
            ):
                raise UnsupportedAdapterError(
                    f"{name}: LoRA on {type(module.get_base_layer()).__name__} is unsupported "
                    "(only Linear, Embedding and target_parameters)"
                )
    return adapter


def checkpoint_converted_names(model: PeftModel) -> set[str]:
    """The in-memory names whose checkpoint form differs (renamed, split, fused or transposed on save).

    Found by running transformers' ``revert_weight_conversion`` (what ``save_pretrained`` applies) on
    meta tensors of every base-model tensor: a name it passes through untouched comes back as the very
    same tensor object.
    """
    probe = {}
    for name, tensor in model.state_dict().items():
        base_name = normalize_peft_param_name(name)
        if base_name is not None:
            probe[base_name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    reverted = revert_weight_conversion(model.get_base_model(), dict(probe))
    return {name for name, tensor in probe.items() if reverted.get(name) is not tensor}


def in_checkpoint_format(
    tensors: Iterator[tuple[str, torch.Tensor]], base: torch.nn.Module, converted: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, except those the checkpoint holds in another form: those are converted together
    (one group's worth, e.g. a layer's fused experts) by transformers' ``revert_weight_conversion``."""
    pending = {}
    for name, tensor in tensors:
        if name in converted:
            pending[name] = tensor
        else:
            yield name, tensor
    if pending:
        yield from revert_weight_conversion(base, pending).items()
