"""Each worker's own part of the pristine base, the chunked merge into it, and the room both need.

vLLM's loaders receive full checkpoint tensors and narrow them to the worker's tensor-parallel rank (and skip the
experts another expert-parallel rank holds). A ``lora_merge`` worker keeps only what its loaders read (`Shard`,
derived from the vLLM layer each checkpoint tensor loads into, read against vLLM 0.32's ``weight_loader``s):

- ``QKVParallelLinear`` (q/k/v): rows; q by ``tp_rank``, k/v by ``tp_rank // num_kv_head_replicas`` (KV heads
  replicated when there are fewer than ``tp_size``);
- ``MergedColumnParallelLinear`` (gate/up) and ``ColumnParallelLinear``: rows ``tp_rank * n / tp_size``;
- ``RowParallelLinear`` (o/down): columns ``tp_rank * n / tp_size``;
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: rows ``[org_vocab_start_index, org_vocab_end_index)``;
- ``FusedMoE``: an expert mapped to no local slot is not kept at all; a local one's gate/up rows and down columns
  ``tp_rank * n / tp_size`` of the layer's MoE tensor parallelism (1 under expert parallelism);
- a layer of another pipeline-parallel stage (``is_pp_missing_parameter``): nothing;
- anything else (a replicated layer, one that is not found, a bias): the whole tensor, which is always correct.

At merge time the worker computes only its slice of ``W_base + scale * B @ A`` (rows of B for a row slice, columns
of A for a column slice), in fp32 chunks of at most `CHUNK_ELEMENTS`, and hands vLLM's reload a full-shaped tensor
in the engine's dtype of which only that slice is filled (the loader reads nothing else); an expert held elsewhere,
or a layer of another pipeline stage, gets a zero-strided view, which costs nothing. The reload buffers a layer's
tensors until the layer is complete, so the merge's peak is one vLLM layer's full-shaped tensors plus the layer vLLM
rebuilds plus the fp32 chunks (`merge_peak_bytes`), never the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from merge.lora_merge.wire import BACKEND, WeightTransferError

CHUNK_ELEMENTS = 2**22  # fp32 elements of one merge chunk (16 MiB): the merge's working set is a few of these
GIB = 2**30


@dataclass(frozen=True)
class Shard:
    """This worker's part of one checkpoint tensor of full ``shape``: ``[start, start + size)`` along ``dim``
    (None: the whole tensor), or nothing at all (``local=False``: an expert another expert-parallel rank holds)."""

    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    size: int = 0
    local: bool = True

    @property
    def kept_shape(self) -> tuple[int, ...]:
        if not self.local:
            return (0,)
        if self.dim is None:
            return self.shape
        return tuple(self.size if d == self.dim else n for d, n in enumerate(self.shape))

    def numel(self) -> int:
        return int(torch.Size(self.kept_shape).numel())

    def read(self, checkpoint, name: str) -> torch.Tensor:
        """The kept part of ``name`` from an open safetensors file (only those bytes are read)."""
        if not self.local:
            return torch.empty(0)
        if self.dim is None:
            return checkpoint.get_tensor(name)
        index = (slice(None),) * self.dim + (slice(self.start, self.start + self.size),)
        return checkpoint.get_slice(name)[index]

    def allocate(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(what vLLM's loader receives: full-shaped, zeros but for the kept part; the kept part, to write into)."""
        if self.dim is None:
            out = torch.empty(self.shape, dtype=dtype, device=device)
            return out, out
        out = torch.zeros(self.shape, dtype=dtype, device=device)
        return out, out.narrow(self.dim, self.start, self.size)

    def full(self, kept: torch.Tensor) -> torch.Tensor:
        """What vLLM's loader receives: ``kept`` in place, the rest zeros (never read by the loader)."""
        if not self.local:
            return torch.zeros((), dtype=kept.dtype, device=kept.device).expand(self.shape)
        if self.dim is None:
            return kept
        out = torch.zeros(self.shape, dtype=kept.dtype, device=kept.device)
        out.narrow(self.dim, self.start, self.size).copy_(kept)
        return out


def _slice(shape, dim: int, start: int, size: int, layer) -> Shard:
    if start < 0 or size <= 0 or start + size > shape[dim]:
        raise WeightTransferError(
            f"{BACKEND}: {type(layer).__name__} reads [{start}, {start + size}) of dimension {dim} of a checkpoint "
            f"tensor of shape {list(shape)}: the server's model does not match its checkpoint"
        )
    if size == shape[dim]:
        return Shard(tuple(shape))
    return Shard(tuple(shape), dim, start, size)


def _layer_for(model, name: str):
    """(vLLM layer, shard id) that the checkpoint tensor ``name`` loads into: the module of the same name, or the
    packed module (``packed_modules_mapping``: q/k/v -> qkv_proj, gate/up -> gate_up_proj) with its index."""
    module_name, _, _ = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    candidates = [(module_name, None)]
    for packed, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts:
            candidates.append((f"{parent}.{packed}" if parent else packed, parts.index(leaf)))
    for candidate, index in candidates:
        try:
            layer = model.get_submodule(candidate)
        except AttributeError:
            continue
        return getattr(layer, "base_layer", layer), index  # a LoRA-wrapped layer loads into its base layer
    return None, None


def worker_shard(model, name: str, shape) -> Shard:
    """The part of checkpoint tensor ``name`` (of full ``shape``) that this worker's vLLM loaders read."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.utils import is_pp_missing_parameter

    shape = tuple(shape)
    if is_pp_missing_parameter(name, model):  # a layer of another pipeline stage: its loader skips the tensor
        return Shard(shape, local=False)
    expert = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
    if expert is not None:
        return _expert_shard(model, expert.group(1), int(expert.group(2)), expert.group(3), shape)
    if not name.endswith(".weight") or len(shape) != 2:
        return Shard(shape)
    layer, index = _layer_for(model, name)
    tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if isinstance(layer, VocabParallelEmbedding):
        indices = layer.shard_indices
        start = indices.org_vocab_start_index
        return _slice(shape, 0, start, indices.org_vocab_end_index - start, layer)
    if tp_size == 1:
        return Shard(shape)
    if isinstance(layer, QKVParallelLinear) and index is not None:
        if index == 0:
            size, rank = layer.num_heads * layer.head_size, tp_rank
        else:
            head_size = layer.head_size if index == 1 else layer.v_head_size
            size, rank = layer.num_kv_heads * head_size, tp_rank // layer.num_kv_head_replicas
        return _slice(shape, 0, rank * size, size, layer)
    if isinstance(layer, MergedColumnParallelLinear) and index is not None:
        size = layer.output_sizes[index] // tp_size
        return _slice(shape, 0, tp_rank * size, size, layer)
    if type(layer) is ColumnParallelLinear:  # subclasses narrow in their own ways: kept whole
        size = layer.output_size_per_partition
        return _slice(shape, 0, tp_rank * size, size, layer)
    if type(layer) is RowParallelLinear:
        size = layer.input_size_per_partition
        return _slice(shape, 1, tp_rank * size, size, layer)
    return Shard(shape)


def _expert_shard(model, experts: str, expert: int, projection: str, shape) -> Shard:
    """An expert's tensor: nothing when no local slot holds it (expert parallelism), else its MoE-TP slice
    (``_load_w13``: gate/up rows, ``_load_w2``: down columns, ``shape[dim] // tp_size`` from ``tp_rank``)."""
    try:
        layer = model.get_submodule(experts)
    except AttributeError:
        return Shard(shape)
    if not hasattr(layer, "_map_global_expert_id_to_local_expert_id") or projection not in (
        "gate_proj",
        "up_proj",
        "down_proj",
        "w1",
        "w2",
        "w3",
    ):
        return Shard(shape)
    if layer._map_global_expert_id_to_local_expert_id(expert) == -1:
        return Shard(shape, local=False)
    moe = layer.moe_config
    tp_size, tp_rank = moe.moe_parallel_config.tp_size, moe.tp_rank
    if tp_size == 1:
        return Shard(shape)
    dim = 1 if projection in ("down_proj", "w2") else 0
    size = shape[dim] // tp_size
    return _slice(shape, dim, tp_rank * size, size, layer)


def merge_into(out, base, b, a, scale: float, transpose: bool, shard: Shard, stats) -> None:
    """``out`` (the kept part, engine dtype) = cast(``base`` + scale * (B @ A)[the kept part]), in fp32 chunks of
    rows of at most `CHUNK_ELEMENTS`; ``transpose``: the checkpoint holds (B @ A).T (fan_in_fan_out)."""
    rows, cols = (shard.shape[0], shard.shape[1])
    r0, c0 = 0, 0
    if shard.dim == 0:
        r0, rows = shard.start, shard.size
    elif shard.dim == 1:
        c0, cols = shard.start, shard.size
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    tensors = stats.tensors if stats is not None else 0
    for i in range(0, rows, step):
        r, c = slice(r0 + i, r0 + min(i + step, rows)), slice(c0, c0 + cols)
        delta = (b[c] @ a[:, r]).mul_(scale).T if transpose else (b[r] @ a[:, c]).mul_(scale)
        chunk = base[i : i + step].to(out.device)
        merged = (chunk.float() + delta).to(out.dtype)
        if stats is not None:
            stats.add(chunk, delta, merged, first_row=i)
        out[i : i + step].copy_(merged)
    if stats is not None:
        stats.tensors = tensors + 1  # one tensor, however many chunks


def merge_peak_bytes(shards: dict[str, Shard], groups: list[list[str]], element_bytes: int) -> int:
    """The merge's peak on the engine's device: the largest reloaded layer's full-shaped tensors (vLLM's reload
    buffers them until the layer is complete), the layer vLLM rebuilds from them (its kept part), and the fp32
    working set of one chunk (base, delta, the cast, the precision statistics' copy)."""
    largest, widest = 0, 0
    for group in groups:
        local = [shards[name] for name in group if shards[name].local]
        full = sum(int(torch.Size(s.shape).numel()) for s in local)
        largest = max(largest, (full + sum(s.numel() for s in local)) * element_bytes)
        widest = max([widest] + [s.numel() for s in local])
    return largest + 4 * 4 * min(CHUNK_ELEMENTS, widest)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def free_bytes(device: torch.device) -> int:
    """What is free on ``device`` now (after vLLM's KV cache): CUDA's free memory, or the host's available memory
    within the room this process's memory cgroup leaves (`cgroup_room`), the smaller."""
    if device.type == "cuda":  # plus what this process's caching allocator holds unused: ours to allocate
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + idle)
    import psutil

    available = int(psutil.virtual_memory().available)
    room = cgroup_room()
    return available if room is None else min(available, room)


CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup file systems are mounted (v1: one folder per controller)
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroups, one line per hierarchy: "id:controllers:path"
# cgroup v2's files, then v1's: the limit, the memory charged, and in memory.stat the file cache not recently used,
# which the kernel reclaims before it kills (what Kubernetes' working set leaves out)
CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}
NO_LIMIT = 2**60  # v1 writes "no limit" as 2**63 rounded down to a page; v2 writes "max"


def _read_count(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return next((int(value) for name, _, value in (line.partition(" ") for line in lines) if name == key), 0)


def cgroup_room() -> int | None:
    """What this process's memory cgroups (Kubernetes' and Slurm's limits) still let it allocate: for each cgroup of
    the memory controller it is in, and each of their parents (a parent's limit binds too), the limit less the memory
    charged that the kernel cannot reclaim; the smallest. None where no limit is set (psutil's host-wide figure
    ignores them: a worker under a limit would pass the check and be OOM-killed). cgroup v2 (unified) and v1 alike.
    In a container the mount shows its own cgroup as the root, while /proc names the path on the host: that path
    missing, the mount's root is read."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    room = None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            mount, (limit_file, usage_file, reclaimable) = CGROUP_ROOT, CGROUP_FILES["v2"]
        elif "memory" in controllers.split(","):
            mount, (limit_file, usage_file, reclaimable) = CGROUP_ROOT / "memory", CGROUP_FILES["v1"]
        else:
            continue
        folder = mount / path.strip().lstrip("/")
        if not folder.is_dir():
            folder = mount
        while True:
            limit, usage = _read_count(folder / limit_file), _read_count(folder / usage_file)
            if limit is not None and usage is not None and limit < NO_LIMIT:
                left = max(0, limit - max(0, usage - _stat(folder / "memory.stat", reclaimable)))
                room = left if room is None else min(room, left)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return room


def check_room(
    base_bytes: int,
    peak_bytes: int,
    base_device,
    merge_device,
    factor_bytes: int = 0,
    wire_device="cpu",
    host_workers: int = 1,
) -> None:
    """Refuse, naming the numbers and what to change, when this worker cannot hold, in what is free now
    (`free_bytes`: on a GPU, what vLLM's KV cache and weights left; on CPU, the host's available memory): its shard of
    the base where it lives, the merge's peak on the engine's device, and the factor buffers of two updates on the
    wire's device (``factor_bytes``, both: the update served, kept to rebuild it at a restore, and the next one,
    received beside it). The ``host_workers`` workers of the server on this host check at once, each before any has
    read its base: the host must hold all of their shares."""
    merge_device = torch.device(merge_device)
    parts: dict[torch.device, dict[str, int]] = {}
    for device, what, amount in (
        (base_device, "its shard of the pristine base", base_bytes),
        (merge_device, "the merge's peak", peak_bytes),
        (wire_device, "two updates' factors", factor_bytes),
    ):
        parts.setdefault(torch.device(device), {})[what] = amount
    for device, items in parts.items():
        sharing = host_workers if device.type == "cpu" else 1
        need, available = sum(items.values()), free_bytes(device)
        if need * sharing <= available:
            continue
        if device.type == "cpu" and merge_device.type == "cpu":
            advice = "free host memory, or restart the server with a smaller KV cache (--kv-cache-memory-bytes)"
        elif device.type == "cpu":
            advice = "free host memory, or connect with base_on_device=true (vllm.server_base_on_device=true)"
        elif device == torch.device(base_device) and base_bytes:
            advice = (
                "connect with base_on_device=false (vllm.server_base_on_device=false: the base in pinned host "
                "memory), or restart the server with a lower --gpu-memory-utilization"
            )
        else:
            advice = "restart the server with a lower --gpu-memory-utilization"
        listed = " + ".join(f"{what} {_size(amount)}" for what, amount in items.items())
        together = f", and each of its host's {sharing} workers as much at once," if sharing > 1 else ""
        raise WeightTransferError(
            f"{BACKEND}: this worker needs {_size(need)} on {device} ({listed}){together} and {_size(available)} is "
            f"free beside vLLM's KV cache: {advice}"
        )
