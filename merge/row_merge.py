"""Each rank merges its own rows of an FSDP2 decoder layer, then the merged rows are all-gathered.

FSDP2 shards every parameter by rows (``Shard(0)``): a rank holds rows ``[k*c, (k+1)*c)`` of a LoRA Linear's
``W`` (out × in) and of ``B`` (out × r). Those rows of the merged weight, ``W[k] + scaling * B[k] @ A``, need only
the whole of ``A`` (r × in, small). So each rank computes its own share of the products, and what is all-gathered
is the merged weight itself, in the engine's dtype: each rank writes its merged rows into its own slot of the tensor
handed to the engine, and the all-gather fills in the other ranks' slots around them (in place). ``unshard()`` would
gather ``W``, ``A`` and ``B`` into FSDP2's buffer and copy them out into the parameters, and every rank would then
compute every product of the layer and write the merged tensor once more.

A row of ``B @ A`` is a dot product over the rank r alone, the same whichever rows are computed together, as long as
there are enough of them: on CPU a product of 1 to 3 rows takes another kernel whose rows differ in the last bit, so
a layer where a rank would hold fewer than ``MIN_ROWS`` rows of a LoRA weight is unshard()-ed whole (on a GPU,
``bench/gpu_check.py`` checks the property on the device, at ``MIN_ROWS`` rows too). So the merged tensors are bit for
bit those of ``unshard()`` then merge (``tests/fsdp2_merge_worker.py`` checks them against peft's
``merge_and_unload()``, ``tests/fsdp2_precision_worker.py`` against the ``unshard()`` walk under mixed precision with
uneven rows).

Used for the decoder layers whose LoRA layers are all plain peft ``Linear`` (no ``fan_in_fan_out``, LoRA bias or
DoRA) in one FSDP2 group on a 1-D mesh without CPU offload; any other layer is ``unshard()``-ed whole
(`merged_params._gathered`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import Shard

__all__ = ["MIN_ROWS", "LayerRows", "Packed", "RowGather", "gather_factors", "gather_rows", "layer_rows"]

MIN_ROWS = 16  # the fewest rows of a LoRA weight a rank merges (fewer: the layer is unshard()-ed whole)

# torch 2.13's name for it (``all_gather_into_tensor`` now warns); torch before 2.13, e.g. a CUDA image's, has only that
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FACTOR_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class LoraRows:
    """One plain LoRA Linear of a layer and the FSDP2 parameters its merge reads."""

    lora: LoraLinear
    weight: object  # FSDPParam of the base weight W
    lora_a: object  # FSDPParam of A
    lora_b: object  # FSDPParam of B


@dataclass
class LayerRows:
    """What a decoder layer's row merge reads: its FSDP2 parameters, split into LoRA weights and the rest."""

    loras: list[LoraRows]
    # FSDPParams yielded as they are: 1-D ones (norms, biases) gathered packed in one, the others each in place
    small: list[object]
    large: list[object]
    process_group: dist.ProcessGroup
    world: int
    rank: int
    device: torch.device


class Packed:
    """Small tensors of a layer (the ``A`` factors, the norms' weights) gathered in one all-gather: each rank's
    padded shards copied into one buffer, and the whole tensors copied out of the gathered one by `wait`. (An
    all-gather has a fixed cost besides its bytes, ~0.5 ms on gloo: a dozen for the small tensors of a layer cost more
    than the layer's large ones.)"""

    def __init__(self, rows: LayerRows, params: list, shards: list[torch.Tensor]) -> None:
        self.params, self.sizes = params, [s.numel() for s in shards]
        local = torch.cat(shards)
        self.gathered = torch.empty(rows.world * local.numel(), dtype=local.dtype, device=local.device)
        self.work = _all_gather_single(self.gathered, local, group=rows.process_group, async_op=True)

    def wait(self) -> dict[int, torch.Tensor]:
        """``{id(sharded parameter): whole tensor}``, once gathered."""
        self.work.wait()
        per_rank = self.gathered.view(-1, sum(self.sizes))  # [world, the shards of one rank]
        full, offset = {}, 0
        for p, size in zip(self.params, self.sizes):
            padded = per_rank[:, offset : offset + size].reshape(-1, *p.padded_sharded_param_size[1:])  # a copy
            full[id(p.sharded_param)] = padded[: p._orig_size[0]]
            offset += size
        return full


def _packed(rows: LayerRows, params: list, cast: Callable[[object], torch.Tensor]) -> list[Packed]:
    """`Packed` gathers of ``params`` (FSDPParams), one per dtype of ``cast(param)`` (its padded shard, flat)."""
    by_dtype = {}
    for p in params:
        shard = cast(p)
        by_dtype.setdefault(shard.dtype, ([], []))
        by_dtype[shard.dtype][0].append(p)
        by_dtype[shard.dtype][1].append(shard)
    return [Packed(rows, ps, shards) for ps, shards in by_dtype.values()]


def gather_factors(rows: LayerRows) -> list[Packed]:
    """Start gathering every ``A`` of the layer whole, in its own dtype (they are small); the walk starts it one layer
    ahead, so that it is there when the layer merges."""
    return _packed(rows, [r.lora_a for r in rows.loras], lambda p: p._sharded_param_data)


@dataclass
class RowGather:
    """A layer's tensors being gathered: ``full[id(sharded parameter)]`` (merged for LoRA weights, cast), complete once
    `wait` returns."""

    full: dict[int, torch.Tensor] = field(default_factory=dict)
    works: list = field(default_factory=list)
    packed: list[Packed] = field(default_factory=list)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        for packed in self.packed:
            self.full.update(packed.wait())
        self.packed.clear()


def layer_rows(layer: torch.nn.Module, adapter: str) -> LayerRows | None:
    """The row merge's reading of ``layer``, or None where it must be ``unshard()``-ed whole: not its own FSDP2 group,
    groups nested in it, a group not sharded now (e.g. kept unsharded after a forward), HSDP, CPU offload, a shard
    dimension other than 0, or a LoRA layer other than a plain ``Linear``."""
    if not isinstance(layer, FSDPModule) or any(isinstance(m, FSDPModule) for m in layer.modules() if m is not layer):
        return None
    groups = layer._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1:
        return None
    group = groups[0]
    if not group.is_sharded or isinstance(group.offload_policy, CPUOffloadPolicy):
        return None
    group.lazy_init()  # what unshard() does first (idempotent): the mixed-precision dtypes are set there
    mesh_info = group.mesh_info
    if mesh_info.mesh.ndim != 1:
        return None
    if any(type(p.fsdp_placement) is not Shard or p.fsdp_placement.dim != 0 for p in group.fsdp_params):
        return None
    by_param = {id(p.sharded_param): p for p in group.fsdp_params}
    loras, factor_ids = [], set()
    for module in layer.modules():
        if not isinstance(module, LoraLayer):
            continue
        for container in _FACTOR_CONTAINERS:  # never yielded: the merge reads them
            if (factors := getattr(module, container, None)) is not None:
                factor_ids.update(id(p) for p in factors.parameters())
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        if (
            type(module) is not LoraLinear
            or module.fan_in_fan_out
            or module.lora_bias.get(adapter, False)
            or module.use_dora.get(adapter, False)
        ):
            return None
        weight, a, b = module.get_base_layer().weight, module.lora_A[adapter].weight, module.lora_B[adapter].weight
        if not all(id(t) in by_param for t in (weight, a, b)) or weight.shape[0] != b.shape[0]:
            return None
        if _fewest_rows(weight.shape[0], mesh_info.shard_mesh_size) < MIN_ROWS:
            return None
        loras.append(LoraRows(module, by_param[id(weight)], by_param[id(a)], by_param[id(b)]))
    merged_ids = {id(r.weight.sharded_param) for r in loras} | factor_ids
    plain = [p for p in group.fsdp_params if id(p.sharded_param) not in merged_ids]
    small, large = [p for p in plain if len(p._orig_size) < 2], [p for p in plain if len(p._orig_size) >= 2]
    device = group.fsdp_params[0].sharded_param.device
    pg = mesh_info.shard_process_group
    return LayerRows(loras, small, large, pg, mesh_info.shard_mesh_size, mesh_info.shard_mesh_rank, device)


def _fewest_rows(rows: int, world: int) -> int:
    """The fewest rows any rank holds of a tensor of ``rows`` rows (FSDP2's chunks: ceil(rows / world) each, the last
    ones short or empty), counting only ranks that hold some."""
    chunk = -(-rows // world)
    return min(min(chunk, rows - k * chunk) for k in range(world) if rows > k * chunk)


def _local_rows(fsdp_param) -> torch.Tensor:
    """This rank's rows of the parameter, unpadded (a view of FSDP2's shard)."""
    return fsdp_param.sharded_param.to_local()


def _in_param_dtype(fsdp_param, tensor: torch.Tensor) -> torch.Tensor:
    """As FSDP2's all-gather casts it under a ``MixedPrecisionPolicy`` (``param_dtype``)."""
    return tensor if fsdp_param.param_dtype is None else tensor.to(fsdp_param.param_dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _whole(rows: LayerRows, fsdp_param, dtype: torch.dtype, out: RowGather) -> torch.Tensor:
    """A fresh tensor for the whole of ``fsdp_param`` (``out.full``), padded as FSDP2 pads: this rank's slot is
    ``[rank * c, (rank + 1) * c)`` of its rows."""
    chunk = fsdp_param.padded_sharded_param_size
    device = fsdp_param.sharded_param.device
    padded = torch.empty(rows.world * chunk[0], *chunk[1:], dtype=dtype, device=device)
    out.full[id(fsdp_param.sharded_param)] = padded[: fsdp_param._orig_size[0]]
    return padded


def _start(rows: LayerRows, padded: torch.Tensor, out: RowGather) -> None:
    """Start the all-gather of this rank's slot of ``padded`` into the rest of it (in place)."""
    chunk = padded.shape[0] // rows.world
    slot = padded[rows.rank * chunk : (rows.rank + 1) * chunk]
    out.works.append(_all_gather_single(padded, slot, group=rows.process_group, async_op=True))


MergeRows = Callable[[LoraLinear, torch.Tensor, tuple[torch.Tensor, torch.Tensor], int, torch.Tensor], None]


def gather_rows(rows: LayerRows, factors: list[Packed], merge_rows: MergeRows, dtype: torch.dtype | None) -> RowGather:
    """Merge this rank's rows of every LoRA weight of the layer and start gathering the layer; `RowGather.wait`.
    ``factors``: the layer's `gather_factors`. The LoRA weights and other tensors of two or more dimensions are gathered
    each in place into its whole tensor, the rest (norms, biases) packed in one (`Packed`).

    ``merge_rows(lora, weight_rows, factors, first_row, out)``: writes into ``out`` the merged rows (cast to ``out``'s
    dtype) of the rows of ``W`` (in ``param_dtype``) and ``factors`` (``(A, B)``: ``A`` whole and this rank's rows
    of ``B``, in their own dtype); ``first_row``: the rows' place in ``W``. ``dtype``:
    the engine's (None: each tensor's own, the merged one's being ``W``'s in ``param_dtype``).
    """
    out = RowGather()
    full_a = {}
    for packed in factors:
        full_a.update(packed.wait())
    for r in rows.loras:
        weight_rows = _in_param_dtype(r.weight, _local_rows(r.weight))
        a_and_b_rows = (full_a[id(r.lora_a.sharded_param)], _local_rows(r.lora_b))
        padded = _whole(rows, r.weight, dtype or weight_rows.dtype, out)
        first_row = rows.rank * r.weight.padded_sharded_param_size[0]
        merge_rows(r.lora, weight_rows, a_and_b_rows, first_row, padded[first_row : first_row + weight_rows.shape[0]])
        _start(rows, padded, out)
    out.packed = _packed(rows, rows.small, lambda p: _cast(_in_param_dtype(p, p._sharded_param_data), dtype))
    for p in rows.large:
        local = _in_param_dtype(p, _local_rows(p))
        padded = _whole(rows, p, dtype or local.dtype, out)
        first_row = rows.rank * p.padded_sharded_param_size[0]
        padded[first_row : first_row + local.shape[0]].copy_(local)
        _start(rows, padded, out)
    return out
