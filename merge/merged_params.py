"""Merged LoRA weights for the rollout engine, one decoder layer at a time, without touching the trainer.

``merged_lora_params(model)`` walks a peft LoRA model (plain, or FSDP2-sharded with ``fully_shard`` on
every decoder layer and on the root) and yields ``(name, tensor)`` pairs under the names a checkpoint of
the base model has (what ``save_pretrained`` writes, what vLLM loads), with every LoRA delta folded in:
``W + scaling * (B @ A)``, *out of place*, so the trainer's parameters never change (no merge/unmerge drift, which in
bf16 is not zero: peft's in-place merge then unmerge does not give back the same bits). Under FSDP2 each rank merges
its own rows of a decoder layer and the merged rows are all-gathered (`merge.row_merge`); a layer with other LoRA
kinds is ``unshard()``-ed whole, merged and ``reshard()``-ed. Either way the next layer's all-gather runs while this
one is handed out, so the extra memory is about two layers.

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
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer, LoraModel, ParamWrapper
from peft.utils import ModulesToSaveWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from merge.layers import check_supported, checkpoint_converted_names, decoder_layers, in_checkpoint_format
from merge.precision import MergePrecisionStats
from merge.row_merge import RowGather, gather_factors, gather_rows, layer_rows

__all__ = ["merged_lora_params"]

_LORA_FACTORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@dataclass
class _MergeState:
    """What the walk over one FSDP2 group needs besides the module tree."""

    adapter: str
    dtype: torch.dtype | None  # cast every yielded tensor to this dtype (None: keep each tensor's own)
    seen: set[int]  # ids of parameters already yielded: tied weights (lm_head = embed_tokens) once, as vLLM expects
    unsharded: bool = False  # the group was all-gathered: hand out copies, never views of FSDP's buffer
    # id(LoRA layer) -> a view of it whose factors are full precision, for layers whose factors the all-gather rounded
    full_precision_loras: dict[int, torch.nn.Module] = field(default_factory=dict)
    stats: MergePrecisionStats | None = None  # opt-in precision telemetry of the merged tensors (a sample of rows)
    row_stats: MergePrecisionStats | None = None  # the telemetry of this rank's rows (row merge), summed over ranks
    # id(sharded parameter) -> its whole tensor, gathered by the row merge (merged for LoRA weights, cast)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)


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
    """Unshard the FSDP2 groups among ``modules`` for the block (a collective: every rank enters, in step); an
    ``unshard(async_op=True)`` the walk started before (its prefetch) is waited for by ``unshard()``.

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


@contextlib.contextmanager
def _rows_gathered(gather: RowGather, state: _MergeState):
    """The row merge's whole tensors of a layer (`merge.row_merge`) for the block; anything else of the layer (a
    persistent buffer) is handed out as a copy, as for an unsharded layer."""
    state.gathered, state.unsharded = gather.full, True
    try:
        yield
    finally:
        state.gathered, state.unsharded = {}, False


def _release(prefetched: RowGather | list | None) -> None:
    """A walk that ends early: wait for the next step's all-gathers it started, and reshard what they unshard."""
    if isinstance(prefetched, RowGather):
        prefetched.wait()
    for group, handle in prefetched if isinstance(prefetched, list) else ():
        if handle is not None:
            handle.wait()
        group.reshard()


def _owned(tensor: torch.Tensor, state: _MergeState) -> torch.Tensor:
    """Detach (and cast); copy tensors whose storage FSDP frees at ``reshard()``.

    vLLM's layer-wise reload keeps the tensors it is given until a fused weight (qkv, gate_up) is
    complete, so a view of the all-gather buffer must not be handed out.
    """
    if (whole := state.gathered.get(id(tensor))) is not None:  # the row merge's: already cast, and its own buffer
        return whole
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


def _linear_product(
    lora: torch.nn.Module, param: torch.Tensor, adapter: str, out: torch.Tensor | None = None, factors=None
) -> torch.Tensor | None:
    """``B @ A`` (into ``out`` if it has ``param``'s dtype, else a fresh tensor) for a plain peft LoRA ``Linear`` whose
    factors and weight share the dtype peft computes its delta in (not fan_in_fan_out; not bf16/fp16 factors on CPU,
    which peft upcasts); None otherwise. ``lora``: the LoRA layer or its full-precision view; ``factors``: ``(A, B)``
    in place of its own."""
    if type(lora) is not LoraLinear or lora.fan_in_fan_out:
        return None
    a, b = factors or (lora.lora_A[adapter].weight, lora.lora_B[adapter].weight)
    if not a.dtype == b.dtype == param.dtype or (a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)):
        return None
    return torch.matmul(b, a, out=out if out is not None and out.dtype == param.dtype else None)


def _add_scaled(weight: torch.Tensor, product: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + product * scaling`` into ``product``'s own buffer, bit for bit peft's ``W + (B @ A) * scaling``: a
    power-of-two scaling multiplies exactly, so one fused pass rounds once as peft's two do; any other scales, then
    adds (``Δ + W`` is ``W + Δ``)."""
    if math.frexp(scaling)[0] == 0.5:
        return torch.add(weight, product, alpha=scaling, out=product)
    return product.mul_(scaling).add_(weight)


def _merged(
    param: torch.Tensor,
    lora: torch.nn.Module,
    state: _MergeState,
    stats: MergePrecisionStats | None,
    first_row: int = 0,
    out: torch.Tensor | None = None,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``param + delta`` out of place, with peft's own delta (its dtype rules), added as peft's merge adds it, then
    cast to ``state.dtype``; accounted in ``stats`` if given. A plain ``Linear``'s delta is computed here as peft
    computes it, its product's buffer becoming the merged tensor (`_linear_product`): one allocation, not three.
    The row merge's: ``first_row`` (where ``param``'s rows start in the weight), ``out`` (the merged rows' place),
    ``factors`` (``(A, B)`` in place of the layer's: ``A`` whole, ``B``'s rows)."""
    lora = state.full_precision_loras.get(id(lora), lora)
    product = _linear_product(lora, param, state.adapter, out, factors)
    if product is not None and (stats is None or product.dtype == torch.float32):
        scaling = lora.scaling[state.adapter]
        delta_rows = stats.sampled_rows(product, first_row).mul(scaling) if stats is not None else None  # before add
        merged = _cast(_add_scaled(param, product, scaling), state)
        if stats is not None:
            stats.add_sampled(stats.sampled_rows(param, first_row), delta_rows, stats.sampled_rows(merged, first_row))
    else:
        if factors is not None:  # peft's delta of the rows: its LoRA layer with these factors
            own = (lora.lora_A[state.adapter].weight, lora.lora_B[state.adapter].weight)
            lora = _with_factors(lora, state.adapter, {id(p): f for p, f in zip(own, factors)})
        delta = lora.get_delta_weight(state.adapter)
        merged = _cast((param + delta).to(param.dtype), state)
        if stats is not None:
            stats.add(param, _delta_fp32(lora, state.adapter, delta), merged, first_row)
    return merged if out is None or merged is out else out.copy_(merged)


def _merged_rows(
    lora: LoraLinear,
    weight_rows: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor],
    first_row: int,
    out: torch.Tensor,
    state: _MergeState,
) -> None:
    """The row merge's `_merged`: rows of ``W`` with ``factors`` (``A`` whole, rows of ``B``) into ``out``, measured in
    ``state.row_stats``."""
    _merged(weight_rows, lora, state, state.row_stats, first_row, out, factors)


def _lora_layer_tensors(module: LoraLayer, prefix: str, state: _MergeState) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA-wrapped Linear or Embedding: its weight merged, its bias (plus a LoRA bias) as peft merges them."""
    base_layer = module.get_base_layer()
    if state.adapter not in module.lora_A and state.adapter not in getattr(module, "lora_embedding_A", {}):
        yield from _module_tensors(base_layer, prefix, state)
        return
    merged = state.gathered.get(id(base_layer.weight))  # the row merge's, or merged here
    yield f"{prefix}.weight", merged if merged is not None else _merged(base_layer.weight, module, state, state.stats)
    if module.lora_bias.get(state.adapter, False):
        lora_b = state.full_precision_loras.get(id(module), module).lora_B[state.adapter]
        bias_delta = lora_b.bias * module.scaling[state.adapter]
        bias = (base_layer.bias + bias_delta).to(base_layer.bias.dtype if state.dtype is None else state.dtype)
        if state.stats is not None:
            state.stats.add(base_layer.bias, bias_delta, bias)
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
            merged[module.parameter_name] = _merged(module.get_param(), module, state, state.stats)
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


def _modules_outside(module: torch.nn.Module, layers: torch.nn.ModuleList) -> Iterator[torch.nn.Module]:
    """``module`` and its submodules, less the decoder layers' subtrees (the root's FSDP2 group and its tensors)."""
    yield module
    for child in module.children():
        if child is not layers:
            yield from _modules_outside(child, layers)


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (adapters, adapter, converted names)


def _checked(model: PeftModel) -> tuple[str, set[str]]:
    """`check_supported`'s adapter and `checkpoint_converted_names`, worked out once per model and set of adapters:
    both visit every module (a few ms a sync on a small model), and neither changes while the adapters do not."""
    key = None
    if isinstance(model, PeftModel) and isinstance(model.base_model, LoraModel):
        key = (tuple(model.base_model.active_adapters), tuple(model.peft_config))
        if (cached := _CHECKED.get(model)) is not None and cached[0] == key:
            return cached[1], cached[2]
    adapter, converted = check_supported(model), checkpoint_converted_names(model)
    _CHECKED[model] = (key, adapter, converted)
    return adapter, converted


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

    Under FSDP2 this is a collective: every rank must iterate to the end, in step. A decoder layer whose LoRA layers
    are all plain ``Linear`` is row-merged: each rank merges its own rows of each weight (``W``'s rows and ``B``'s, with
    ``A`` gathered whole), and the merged rows are all-gathered in the yielded dtype (`merge.row_merge`); any other
    layer, and the root's group, is ``unshard()``-ed whole, then merged. At most two layers are gathered at a time:
    the one yielded and the next, whose all-gather is started before this one's tensors are yielded. The merge is out
    of place: ``(W + delta).to(W.dtype)`` with peft's ``get_delta_weight`` computed from the LoRA factors in their own
    dtype (under mixed precision ``W`` is cast to ``param_dtype`` as FSDP2's all-gather casts it, and the factors are
    gathered at full precision, see ``_gathered``), as ``merge_and_unload()`` does on an unsharded copy, bit for bit;
    the trainer's parameters are never written.

    Lifetime: consume each tensor before advancing the iterator past its layer. Tensors of a gathered layer are the
    walk's own: fresh (row merge) or copies (FSDP frees the all-gather buffer at ``reshard()``, and vLLM's layer-wise
    reload keeps references until a fused weight is complete; handing out views of that buffer is verl's bug #7014).
    Without FSDP, weights the adapter does not touch are yielded as detached views of the trainer's
    parameters: load them before the next optimizer step.
    """
    adapter, converted = _checked(model)
    base = model.get_base_model()
    layers = decoder_layers(model)
    state = _MergeState(adapter=adapter, dtype=dtype, seen=set(), stats=precision_stats)
    steps = [list(layer.modules()) for layer in layers] + [list(_modules_outside(model, layers))]
    rows = [layer_rows(layer, adapter) for layer in layers] + [None]  # None: the step is unshard()-ed whole
    row_merged = [r for r in rows if r is not None]
    if precision_stats is not None and row_merged:
        state.row_stats = MergePrecisionStats(precision_stats.row_stride)

    factors = {}  # step -> its `gather_factors`, started one step ahead

    def start(i: int) -> RowGather | list:
        """Step ``i``'s all-gathers, started: its row merge's, or its groups' ``unshard(async_op=True)``."""
        if rows[i] is None:
            return [(m, m.unshard(async_op=True)) for m in steps[i] if isinstance(m, FSDPModule)]
        layer_factors = factors.pop(i, None) or gather_factors(rows[i])
        if rows[i + 1] is not None:
            factors[i + 1] = gather_factors(rows[i + 1])
        return gather_rows(rows[i], layer_factors, lambda *args: _merged_rows(*args, state), state.dtype)

    prefetched = None
    try:
        for i, step in enumerate(steps):
            current, prefetched = prefetched, None
            if rows[i] is not None:
                current = current or start(i)
                current.wait()
            with _rows_gathered(current, state) if rows[i] is not None else _gathered(step, state):
                if i + 1 < len(steps):  # the next step's all-gather overlaps this one's push
                    prefetched = start(i + 1)
                if i == len(layers) and state.row_stats is not None:  # every row merged: sum the ranks' figures,
                    # before the last step yields (a consumer may stop after the last tensor)
                    precision_stats.add_across_ranks(state.row_stats, row_merged[0].process_group, row_merged[0].device)
                module, prefix, skip = (layers[i], f"model.layers.{i}", None) if i < len(layers) else (base, "", layers)
                yield from in_checkpoint_format(_module_tensors(module, prefix, state, skip), base, converted)
    finally:
        _release(prefetched)
        for pending in factors.values():  # a walk that ends early
            _release(RowGather(packed=pending))
