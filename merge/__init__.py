"""Merged LoRA weights for the rollout engine, one decoder layer at a time, without touching the trainer.

``merged_lora_params(model)`` walks a peft LoRA model (plain, or FSDP2-sharded with ``fully_shard`` on
every decoder layer and on the root) and yields ``(name, tensor)`` pairs under the names a checkpoint of
the base model has (what ``save_pretrained`` writes, what vLLM loads), with every LoRA delta folded in:
``W + scaling * (B @ A)``. Each decoder layer is ``unshard()``-ed, merged *out of place* and ``reshard()``-ed
before the next one, so the extra memory is about one layer, and the trainer's parameters never change (no
merge/unmerge drift, which in bf16 is not zero: peft's in-place merge then unmerge does not give back the
same bits).

Targets: LoRA on Linear and Embedding modules, and peft's LoRA on parameters (``target_parameters``, e.g.
the fused MoE expert weights ``mlp.experts.gate_up_proj``). Tensors held fused in memory are split back
into the checkpoint's layout (per-expert ``mlp.experts.{e}.gate_proj.weight``, ...) by transformers' own
``revert_weight_conversion``, the function ``save_pretrained`` uses. Under FSDP2 mixed precision
(``param_dtype`` below the adapter's dtype, e.g. bf16 base with fp32 adapters), the LoRA factors are
gathered in their own dtype, so the merge is peft's ``merge_and_unload()`` of an unsharded copy, bit for bit.

This is the opposite of TRL 1.16's sync (``merge_adapter()`` on the whole model, ``full_tensor()`` per
parameter, ``unmerge_adapter()``), which writes into the trainer's weights twice per rollout.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer, LoraModel, ParamWrapper
from peft.utils import ModulesToSaveWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

__all__ = [
    "merged_lora_params",
    "MergePrecisionStats",
    "normalize_peft_param_name",
    "decoder_layers",
    "UnsupportedAdapterError",
    "check_supported",
]

_PEFT_PREFIX = "base_model.model."
_LORA_ONLY_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_LORA_FACTORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


class UnsupportedAdapterError(ValueError):
    """The adapter cannot be merged by :func:`merged_lora_params` (the message says what and why)."""


class MergePrecisionStats:
    """How much of the LoRA update survives the cast of the merged weights to the engine's dtype (opt-in telemetry).

    Pass one to :func:`merged_lora_params` (``precision_stats=``); it accumulates, over every merged tensor (the
    weights the adapter changes: LoRA Linear/Embedding weights, a LoRA bias, ``target_parameters`` such as fused
    MoE experts), with every quantity in fp32:

    - ``Δ = scaling · B @ A`` (peft's delta; recomputed from fp32 factors where peft's is below fp32),
    - ``d = cast(W + Δ) − cast(W)``: what the engine's weights actually move by (``cast``: to the yielded dtype;
      ``W``: the base weight as the merge reads it, e.g. bf16, so ``cast(W) = W`` when both are bf16).

    :meth:`metrics` gives ``sync_delta_kept = Σ⟨d, Δ⟩ / Σ‖Δ‖²`` (the share of the update that survives; 1 when
    nothing is lost), ``sync_delta_rel_err = sqrt(Σ‖d − Δ‖² / Σ‖Δ‖²)``, and ``sync_delta_zeroed``: the fraction of
    the entries with ``Δ ≠ 0`` whose ``d`` is 0 (updates rounded away entirely). NaN where undefined (``Δ = 0``
    everywhere, e.g. peft's initial ``B = 0``).

    Meant for a target dtype below fp32 (bf16/fp16 engines), though it measures whatever dtype is yielded (with
    fp32 it only sees fp32 rounding). The sums are kept on the tensors' device as float64 (per tensor reduced in
    fp32 by ``torch.dot``, accumulated in float64) so that the merge never waits on the device; :meth:`metrics` reads them (one
    sync). Under FSDP2 every rank merges the unsharded (full) layer, so every rank accumulates the same sums and
    no reduction is needed. Accumulates across calls until :meth:`reset`.
    """

    FIELDS = ("dot", "delta_sq", "err_sq", "nonzero", "zeroed")  # Σ⟨d,Δ⟩, Σ‖Δ‖², Σ‖d−Δ‖², #(Δ≠0), #(Δ≠0, d=0)

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # float64 [len(FIELDS)], on the device of the first merged tensor
        self.entries = 0  # entries of the merged tensors measured
        self.tensors = 0  # merged tensors measured

    def reset(self) -> None:
        self.__init__()

    @torch.no_grad()
    def add(self, base: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor) -> None:
        """Account one merged tensor: ``base`` = cast(W) (the weight without the update, in the yielded dtype),
        ``delta`` = Δ, ``merged`` = cast(W + Δ) (what is yielded)."""
        delta = delta.detach().reshape(-1).float()
        moved = merged.detach().reshape(-1).to(torch.float32, copy=True)  # one fresh fp32 buffer: d, then d − Δ
        moved.sub_(base.detach().reshape(-1))  # in fp32 (a bf16 base is upcast exactly)
        dot, delta_sq = torch.dot(moved, delta), torch.dot(delta, delta)
        # Δ = 0 leaves an entry as it was (cast(W + 0) = cast(W)), so {d ≠ 0} ⊂ {Δ ≠ 0} and the entries that
        # Δ ≠ 0 leaves unmoved number count(Δ ≠ 0) − count(d ≠ 0)
        nonzero = torch.count_nonzero(delta)
        counts = torch.stack([nonzero, nonzero - torch.count_nonzero(moved)])
        err = moved.sub_(delta)
        sums = torch.stack([dot, delta_sq, torch.dot(err, err)])
        row = torch.cat([sums.to(torch.float64), counts.to(torch.float64)])
        if self.sums is None:
            self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=row.device)
        self.sums += row.to(self.sums.device)
        self.entries += delta.numel()
        self.tensors += 1

    def totals(self) -> dict[str, float]:
        """The raw float64 sums (``FIELDS``; zeros before any merged tensor), with ``entries`` and ``tensors``."""
        values = [0.0] * len(self.FIELDS) if self.sums is None else self.sums.tolist()
        return {**dict(zip(self.FIELDS, values)), "entries": self.entries, "tensors": self.tensors}

    def metrics(self) -> dict[str, float]:
        """``sync_delta_kept``, ``sync_delta_rel_err``, ``sync_delta_zeroed`` (see the class docstring)."""
        t = self.totals()
        nan = float("nan")
        return {
            "sync_delta_kept": t["dot"] / t["delta_sq"] if t["delta_sq"] > 0 else nan,
            "sync_delta_rel_err": (t["err_sq"] / t["delta_sq"]) ** 0.5 if t["delta_sq"] > 0 else nan,
            "sync_delta_zeroed": t["zeroed"] / t["nonzero"] if t["nonzero"] > 0 else nan,
        }


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


check_supported = _check_supported  # public name for the lora_merge backend (merge.weight_transfer)


@dataclass
class _MergeState:
    """What the walk over one FSDP2 group needs besides the module tree."""

    adapter: str
    dtype: torch.dtype | None  # cast every yielded tensor to this dtype (None: keep each tensor's own)
    seen: set[int]  # ids of parameters already yielded: tied weights (lm_head = embed_tokens) once, as vLLM expects
    unsharded: bool = False  # the group was all-gathered: hand out copies, never views of FSDP's buffer
    # id(LoRA layer) -> a view of it whose factors are full precision, for layers whose factors the all-gather rounded
    full_precision_loras: dict[int, torch.nn.Module] = field(default_factory=dict)
    stats: MergePrecisionStats | None = None  # opt-in precision telemetry of every merged tensor


def _factor_params(lora: LoraLayer, adapter: str) -> Iterator[tuple[torch.nn.Module, str]]:
    """``(owner, name)`` of every parameter of ``lora``'s factors for ``adapter`` (weights and biases)."""
    for container_name in _LORA_FACTORS:
        container = getattr(lora, container_name, None)
        if container is None or adapter not in container:
            continue
        if isinstance(container, torch.nn.ParameterDict):  # embedding LoRA: the factor is the parameter itself
            yield container, adapter
        else:
            owner = container[adapter]
            yield from ((owner, name) for name, _ in owner.named_parameters(recurse=False))


def _with_factors(lora: LoraLayer, adapter: str, factors: dict[int, torch.Tensor]) -> torch.nn.Module:
    """A shallow copy of ``lora`` whose ``adapter`` factors are ``factors[id(param)]`` where given.

    peft's own ``get_delta_weight`` then runs on it unchanged; the copy only reads the trainer's module (its
    base layer, scaling, ...), and its factor containers are plain dicts, so nothing of the trainer is rebound.
    """
    view = copy.copy(lora)
    for container_name in _LORA_FACTORS:
        container = getattr(lora, container_name, None)
        if container is None or adapter not in container:
            continue
        entry = container[adapter]
        if isinstance(container, torch.nn.ParameterDict):
            replacement = factors.get(id(entry), entry)
        else:  # an nn.Linear: peft reads .weight (and .bias with lora_bias)
            params = {name: factors.get(id(p), p) for name, p in entry.named_parameters(recurse=False)}
            replacement = SimpleNamespace(bias=None, **params)
        view.__dict__[container_name] = {adapter: replacement}  # shadows the ModuleDict in view._modules
    return view


def _sharded_factors(loras: list[LoraLayer], adapter: str) -> dict[tuple[int, str], DTensor]:
    """The FSDP2-sharded parameters of the LoRA factors, keyed by ``(id(owner module), name)``."""
    sharded = {}
    for lora in loras:
        for owner, name in _factor_params(lora, adapter):
            param = owner.get_parameter(name)
            if isinstance(param, DTensor):
                sharded[id(owner), name] = param
    return sharded


def _full_precision_loras(
    loras: list[LoraLayer], sharded: dict[tuple[int, str], DTensor], adapter: str
) -> dict[int, torch.nn.Module]:
    """For each LoRA layer whose factors the all-gather rounded, a view of it with the factors at full precision.

    Call while unsharded: a rounded factor is one whose unsharded parameter has another dtype than its shard.
    ``full_tensor()`` is a collective: every rank calls it for the same factors, in the same (module) order.
    """
    views = {}
    for lora in loras:
        factors = {}
        for owner, name in _factor_params(lora, adapter):
            shard, unsharded = sharded.get((id(owner), name)), owner.get_parameter(name)
            if shard is not None and unsharded.dtype != shard.dtype:
                factors[id(unsharded)] = shard.full_tensor()
        if factors:
            views[id(lora)] = _with_factors(lora, adapter, factors)
    return views


@contextlib.contextmanager
def _gathered(modules: list[torch.nn.Module], state: _MergeState):
    """Unshard the FSDP2 groups among ``modules`` for the block (a collective: every rank enters, in step).

    Under FSDP2 mixed precision the all-gather casts every parameter to ``param_dtype``, the LoRA factors
    included, while peft's merge of an unsharded model computes the delta from the factors in their own dtype
    (fp32 adapters on a bf16 base). So the factors the all-gather rounded are gathered once more in their own
    dtype (they are small), and the merge uses those (``state.full_precision_loras``).
    """
    groups = [m for m in modules if isinstance(m, FSDPModule)]
    loras = [m for m in modules if isinstance(m, LoraLayer)]
    sharded = _sharded_factors(loras, state.adapter)  # before unshard(), which swaps the shards out of the modules
    for group in groups:
        group.unshard()
    try:
        state.unsharded = bool(groups)
        state.full_precision_loras = _full_precision_loras(loras, sharded, state.adapter)
        yield
    finally:
        state.unsharded = False
        state.full_precision_loras = {}
        for group in groups:
            group.reshard()


def _owned(tensor: torch.Tensor, state: _MergeState) -> torch.Tensor:
    """Detach (and cast); copy tensors whose storage FSDP frees at ``reshard()``.

    vLLM's layer-wise reload keeps the tensors it is given until a fused weight (qkv, gate_up) is
    complete, so a view of the all-gather buffer must not be handed out.
    """
    out = tensor.detach()
    if state.dtype is not None and out.dtype != state.dtype:
        return out.to(state.dtype)
    return out.clone() if state.unsharded else out


def _cast(tensor: torch.Tensor, state: _MergeState) -> torch.Tensor:
    return tensor if state.dtype is None else tensor.to(state.dtype)


def _delta_fp32(lora: torch.nn.Module, adapter: str, delta: torch.Tensor) -> torch.Tensor:
    """Δ in fp32, for the telemetry: peft's ``delta`` if it is fp32, else peft's delta recomputed from the factors
    upcast to fp32 (peft computes a bf16 factors' product in fp32, then rounds it to bf16; LoRA on parameters
    also rounds it to the parameter's dtype). ``lora``: the LoRA layer or its full-precision view."""
    if delta.dtype == torch.float32:
        return delta
    view = copy.copy(lora)
    for container_name in _LORA_FACTORS:
        container = getattr(lora, container_name, None)
        if container is None or adapter not in container:
            continue
        entry = container[adapter]  # a tensor (embedding LoRA), or an nn.Linear / its stand-in with .weight
        factor = entry.float() if isinstance(entry, torch.Tensor) else SimpleNamespace(weight=entry.weight.float())
        view.__dict__[container_name] = {adapter: factor}
    if isinstance(lora, ParamWrapper):  # its get_delta_weight casts to get_param()'s dtype: make that fp32
        probe = torch.empty(0, device=delta.device)
        view.__dict__["get_param"] = lambda: probe
    return view.get_delta_weight(adapter).float()


def _merged(param: torch.Tensor, lora: LoraLayer, state: _MergeState) -> torch.Tensor:
    """``param + delta`` out of place, with peft's own delta (its dtype rules), added as peft's merge adds it, then
    cast to ``state.dtype``; accounted in ``state.stats`` if given."""
    lora = state.full_precision_loras.get(id(lora), lora)
    delta = lora.get_delta_weight(state.adapter)
    merged = _cast((param + delta).to(param.dtype), state)
    if state.stats is not None:
        state.stats.add(_cast(param, state), _delta_fp32(lora, state.adapter, delta), merged)
    return merged


def _lora_layer_tensors(module: LoraLayer, prefix: str, state: _MergeState) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA-wrapped Linear or Embedding: its weight merged, its bias (plus a LoRA bias) as peft merges them."""
    base_layer = module.get_base_layer()
    if state.adapter not in module.lora_A and state.adapter not in getattr(module, "lora_embedding_A", {}):
        yield from _module_tensors(base_layer, prefix, state)
        return
    yield f"{prefix}.weight", _merged(base_layer.weight, module, state)
    if module.lora_bias.get(state.adapter, False):
        lora_b = state.full_precision_loras.get(id(module), module).lora_B[state.adapter]
        bias_delta = lora_b.bias * module.scaling[state.adapter]
        bias = (base_layer.bias + bias_delta).to(base_layer.bias.dtype if state.dtype is None else state.dtype)
        if state.stats is not None:
            state.stats.add(base_layer.bias.to(bias.dtype), bias_delta, bias)
        yield f"{prefix}.bias", bias
    elif getattr(base_layer, "bias", None) is not None:
        yield f"{prefix}.bias", _owned(base_layer.bias, state)


def _parameter_lora_tensors(
    wrapper: ParamWrapper, prefix: str, state: _MergeState
) -> Iterator[tuple[str, torch.Tensor]]:
    """LoRA on parameters (``target_parameters``): the wrapped module's tensors, each targeted one merged.

    peft nests one ``ParamWrapper`` per targeted parameter of a module (``experts`` -> ``down_proj`` wrapper
    -> ``gate_up_proj`` wrapper -> the experts module), so the chain is walked down to the module.
    """
    merged = {}
    module = wrapper
    while isinstance(module, ParamWrapper):
        if state.adapter in module.lora_A:
            merged[module.parameter_name] = _merged(module.get_param(), module, state)
        module = module.base_layer
    yield from _module_tensors(module, prefix, state, merged=merged)


def _module_tensors(
    module: torch.nn.Module,
    prefix: str,
    state: _MergeState,
    skip: torch.nn.Module | None = None,
    merged: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merged ``state_dict()``-named tensors of ``module``'s subtree (``prefix``: its base-model name), less ``skip``.

    ``merged``: tensors that replace ``module``'s own parameters of those names (LoRA on parameters).
    """
    if isinstance(module, ParamWrapper):
        yield from _parameter_lora_tensors(module, prefix, state)
        return
    if isinstance(module, LoraLayer):
        yield from _lora_layer_tensors(module, prefix, state)
        return
    if isinstance(module, ModulesToSaveWrapper):
        saved = module.modules_to_save
        active = saved[state.adapter] if state.adapter in saved else module.original_module
        yield from _module_tensors(active, prefix, state)
        return
    dot = f"{prefix}." if prefix else ""
    merged = merged or {}
    for name, param in module.named_parameters(recurse=False):
        if id(param) not in state.seen:
            state.seen.add(id(param))
            yield f"{dot}{name}", merged[name] if name in merged else _owned(param, state)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield f"{dot}{name}", _owned(buffer, state)
    for name, child in module.named_children():
        if child is not skip:
            yield from _module_tensors(child, f"{dot}{name}", state, skip)


def _converted_names(model: PeftModel) -> set[str]:
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


def _in_checkpoint_format(
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


@torch.no_grad()
def merged_lora_params(
    model: PeftModel, dtype: torch.dtype | None = None, precision_stats: MergePrecisionStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)``: the base model's full weights with the active LoRA adapter merged in.

    Args:
        model: a peft ``PeftModel`` with one active plain-LoRA adapter (on Linear or Embedding modules, or
            on parameters via ``target_parameters``), either unsharded or FSDP2-sharded (``fully_shard`` on
            each decoder layer and on the root; other ``fully_shard`` groups outside the decoder layers are
            unsharded together with the root), with or without a ``MixedPrecisionPolicy``.
        dtype: cast every yielded tensor to this dtype (e.g. the rollout engine's); default: keep each
            tensor's own dtype.
        precision_stats: a :class:`MergePrecisionStats` to accumulate, over the merged tensors, how much of the
            LoRA update survives the cast (pass one when ``dtype`` is below fp32, then read ``.metrics()`` after
            the iteration). None (default): nothing is measured, and the yielded tensors are the same either way.

    Order: decoder layer 0, 1, ..., then the tensors outside the decoder layers (embeddings, final
    norm, lm_head; a tied lm_head is yielded once, under the embedding's name). Names and layouts are the
    checkpoint's, as ``save_pretrained`` writes them and vLLM loads them: ``model.layers.0.self_attn.q_proj.weight``,
    and for experts fused in memory (``mlp.experts.gate_up_proj``) one tensor per expert and projection
    (``mlp.experts.0.gate_proj.weight``), split by transformers' own ``revert_weight_conversion``.

    Under FSDP2 this is a collective: every rank must iterate to the end, in step. At most one decoder
    layer is unsharded at a time. The merge is out of place: ``(W + delta).to(W.dtype)`` with peft's
    ``get_delta_weight`` computed from the LoRA factors in their own dtype (under mixed precision they
    are gathered again at full precision, see ``_gathered``), as ``merge_and_unload()`` does on an unsharded
    copy; the trainer's parameters are never written.

    Lifetime: consume each tensor before advancing the iterator past its layer. Tensors of an unsharded
    layer are copies (FSDP frees the all-gather buffer at ``reshard()``, and vLLM's layer-wise reload keeps
    references until a fused weight is complete; handing out views of that buffer is verl's bug #7014).
    Without FSDP, weights the adapter does not touch are yielded as detached views of the trainer's
    parameters: load them before the next optimizer step.
    """
    adapter = _check_supported(model)
    base = model.get_base_model()
    layers = decoder_layers(model)
    converted = _converted_names(model)
    state = _MergeState(adapter=adapter, dtype=dtype, seen=set(), stats=precision_stats)
    for i, layer in enumerate(layers):
        with _gathered(list(layer.modules()), state):
            yield from _in_checkpoint_format(_module_tensors(layer, f"model.layers.{i}", state), base, converted)

    layer_ids = {id(m) for layer in layers for m in layer.modules()}
    outside = [m for m in model.modules() if id(m) not in layer_ids]
    with _gathered(outside, state):
        yield from _in_checkpoint_format(_module_tensors(base, "", state, skip=layers), base, converted)
