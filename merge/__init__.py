"""Merged LoRA weights for the rollout engine, one decoder layer at a time, without touching the trainer.

``merged_lora_params(model)`` walks a peft LoRA model (plain, or FSDP2-sharded with ``fully_shard`` on
every decoder layer and on the root) and yields ``(name, tensor)`` pairs in the base model's own
``state_dict()`` names, with every LoRA delta folded in: ``W + scaling * (B @ A)``. Each decoder layer is
``unshard()``-ed, merged *out of place* and ``reshard()``-ed before the next one, so the extra memory is
about one layer, and the trainer's parameters never change (no merge/unmerge drift, which in bf16 is
not zero: peft's in-place merge then unmerge does not give back the same bits).

This is the opposite of TRL 1.16's sync (``merge_adapter()`` on the whole model, ``full_tensor()`` per
parameter, ``unmerge_adapter()``), which writes into the trainer's weights twice per rollout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer, LoraModel
from peft.utils import ModulesToSaveWrapper
from torch.distributed.fsdp import FSDPModule

__all__ = ["merged_lora_params", "normalize_peft_param_name", "decoder_layers", "UnsupportedAdapterError"]

_PEFT_PREFIX = "base_model.model."
_LORA_ONLY_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


class UnsupportedAdapterError(ValueError):
    """The adapter cannot be merged by :func:`merged_lora_params` (the message says what and why)."""


def normalize_peft_param_name(name: str) -> str | None:
    """Map a peft parameter name to the base model's ``state_dict()`` name, or None if it has none.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``; ``...modules_to_save.default.weight`` -> ``...weight``.
    LoRA factors (``lora_A``/``lora_B``/...) and the frozen ``original_module`` copy kept beside a
    ``modules_to_save`` module return None: they are not base-model tensors.
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


def _check_supported(model: torch.nn.Module) -> str:
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
    for field in ("use_dora", "use_rslora_variant", "use_bdlora", "use_alora"):
        if getattr(config, field, False):
            raise UnsupportedAdapterError(f"adapter {adapter!r} sets {field}=True; only plain LoRA is supported")
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
            if not hasattr(module, "get_delta_weight") or not isinstance(
                module.get_base_layer(), (torch.nn.Linear, torch.nn.Embedding)
            ):
                raise UnsupportedAdapterError(
                    f"{name}: LoRA on {type(module.get_base_layer()).__name__} is unsupported "
                    "(only Linear and Embedding)"
                )
    return adapter


@contextlib.contextmanager
def _unsharded(modules: list[torch.nn.Module]):
    """Unshard the FSDP2 modules among ``modules`` for the block (a collective: every rank enters)."""
    sharded = [m for m in modules if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield bool(sharded)
    finally:
        for module in sharded:
            module.reshard()


def _owned(tensor: torch.Tensor, dtype: torch.dtype | None, unsharded: bool) -> torch.Tensor:
    """Detach (and cast); copy tensors whose storage FSDP frees at ``reshard()``.

    vLLM's layer-wise reload keeps the tensors it is given until a fused weight (qkv, gate_up) is
    complete, so a view of the all-gather buffer must not be handed out.
    """
    out = tensor.detach()
    if dtype is not None and out.dtype != dtype:
        return out.to(dtype)
    return out.clone() if unsharded else out


def _module_tensors(
    module: torch.nn.Module,
    prefix: str,
    adapter: str,
    dtype: torch.dtype | None,
    unsharded: bool,
    seen: set[int],
    skip: torch.nn.Module | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merged ``state_dict()``-named tensors of ``module``'s subtree (``prefix``: its base-model name), less ``skip``."""
    dot = f"{prefix}." if prefix else ""
    if isinstance(module, LoraLayer):
        base_layer = module.get_base_layer()
        weight = base_layer.weight
        if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}):
            # Out of place, with peft's own delta (its dtype rules), added as peft's merge adds it.
            merged = (weight + module.get_delta_weight(adapter)).to(weight.dtype)
            yield f"{dot}weight", merged if dtype is None else merged.to(dtype)
            if module.lora_bias.get(adapter, False):
                bias = base_layer.bias + module.lora_B[adapter].bias * module.scaling[adapter]
                yield f"{dot}bias", bias.to(base_layer.bias.dtype if dtype is None else dtype)
            elif getattr(base_layer, "bias", None) is not None:
                yield f"{dot}bias", _owned(base_layer.bias, dtype, unsharded)
        else:
            yield from _module_tensors(base_layer, prefix, adapter, dtype, unsharded, seen)
        return
    if isinstance(module, ModulesToSaveWrapper):
        active = module.modules_to_save[adapter] if adapter in module.modules_to_save else module.original_module
        yield from _module_tensors(active, prefix, adapter, dtype, unsharded, seen)
        return
    for name, param in module.named_parameters(recurse=False):
        if id(param) not in seen:  # tied weights (lm_head = embed_tokens) once, as vLLM expects
            seen.add(id(param))
            yield f"{dot}{name}", _owned(param, dtype, unsharded)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield f"{dot}{name}", _owned(buffer, dtype, unsharded)
    for name, child in module.named_children():
        if child is not skip:
            yield from _module_tensors(child, f"{dot}{name}", adapter, dtype, unsharded, seen, skip)


@torch.no_grad()
def merged_lora_params(model: PeftModel, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)``: the base model's full weights with the active LoRA adapter merged in.

    Args:
        model: a peft ``PeftModel`` with one active plain-LoRA adapter, either unsharded or FSDP2-sharded
            (``fully_shard`` on each decoder layer and on the root; other ``fully_shard`` groups outside
            the decoder layers are unsharded together with the root).
        dtype: cast every yielded tensor to this dtype (e.g. the rollout engine's); default: keep each
            tensor's own dtype.

    Order: decoder layer 0, 1, ..., then the tensors outside the decoder layers (embeddings, final
    norm, lm_head; a tied lm_head is yielded once, under the embedding's name). Names are the base
    model's ``state_dict()`` names (``model.layers.0.self_attn.q_proj.weight``), which vLLM loads.

    Under FSDP2 this is a collective: every rank must iterate to the end, in step. At most one decoder
    layer is unsharded at a time. The merge is out of place: ``(W + delta).to(W.dtype)`` with peft's
    ``get_delta_weight`` (computed in the LoRA weights' dtype, as ``merge_and_unload()`` does); the
    trainer's parameters are never written.

    Lifetime: consume each tensor before advancing the iterator past its layer. Tensors of an unsharded
    layer are copies (FSDP frees the all-gather buffer at ``reshard()``, and vLLM's layer-wise reload keeps
    references until a fused weight is complete; handing out views of that buffer is verl's bug #7014).
    Without FSDP, weights the adapter does not touch are yielded as detached views of the trainer's
    parameters: load them before the next optimizer step.
    """
    adapter = _check_supported(model)
    base = model.get_base_model()
    layers = decoder_layers(model)
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        with _unsharded([layer]) as unsharded:
            yield from _module_tensors(layer, f"model.layers.{i}", adapter, dtype, unsharded, seen)

    layer_ids = {id(m) for layer in layers for m in layer.modules()}
    outside = [m for m in model.modules() if id(m) not in layer_ids]
    with _unsharded(outside) as unsharded:
        yield from _module_tensors(base, "", adapter, dtype, unsharded, seen, skip=layers)
