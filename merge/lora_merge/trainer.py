"""The trainer's side of the ``lora_merge`` backend (`LoraMergeTrainer`, every trainer rank calls ``send_weights``)::

    trainer = LoraMergeTrainer.connect("http://127.0.0.1:8000", rank=rank)
    stats = trainer.send_weights(peft_model, weight_version="3")   # a collective under FSDP2

Every rank gathers the update (`merge.lora_merge.update`: the factors, from FSDP2 shards one parameter at a time);
rank 0 sends it to the server's workers over the group of `merge.lora_merge.wire`, driven through vLLM's RL routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), on a
server at a URL (only ``/finish_weight_update`` between ``/pause`` and ``/resume``) or an in-process ``LLM``.

``wire_dtype`` casts what is sent: the recipe sends the factors in its bf16/fp16 ``model.dtype``, the dtype its own
forward reads them in (FSDP2's ``param_dtype``, autocast in one process), which halves the bytes; the server still
merges in fp32. ``precision_stats=False`` skips the workers' `MergePrecisionStats` (the recipe measures them below
fp32 only, where a cast can lose part of the update). ``update="full"`` sends the whole merged model instead
(`merge.merged_lora_params`, every tensor, the server keeps no base), over the same group and through the same
layer-wise reload: a comparison (bench/bench_server.py) standing in for vLLM's own full-weight transfer (NCCL/IPC,
GPU only).
"""

from __future__ import annotations

import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from merge import MergePrecisionStats
from merge.lora_merge.update import full_update, lora_update
from merge.lora_merge.wire import (
    BACKEND,
    TRANSPORTS,
    WeightTransferError,
    broadcast,
    call_result,
    close_group,
    connect,
    free_port,
    local_address_towards,
    recv_reply,
    round_store,
    set_timeout,
    wait,
    wire_device,
)
from merge.lora_merge.worker import LoraMergeInitInfo, LoraMergeUpdateInfo


class HTTPPausingWeightSyncClient:
    """vLLM's HTTP weight-sync control plane (`HTTPVLLMWeightSyncClient`), with the one call that changes the served
    model, ``/finish_weight_update``, between ``/pause`` and ``/resume``. ``pause_mode`` is vLLM's: "wait" (requests
    in flight finish on the previous weights first) or "keep" (requests in flight are frozen between two decode
    steps and continue on the new weights: asynchronous rollouts). Either way the pause clears the caches
    (``clear_cache=true``, said explicitly: vLLM 0.32 calls the flag deprecated): the prefix cache holds KV the
    previous weights computed, and in "keep" mode vLLM preempts the requests in flight and prefills them again on
    the new weights when they resume (``Scheduler.reset_prefix_cache(reset_running_requests=True)``). So every token
    is sampled from one version given a prefix that same version computed: the log-prob vLLM returns is that
    version's, token by token, which a trainer forward with its weights reproduces. Only the merge is paused: a
    trainer that dies while it gathers or sends the factors leaves the server serving its last complete version, not
    paused; one that dies during the merge's pause (or, with ``pause_whole_update``, during the update) leaves it
    paused on its last complete version, and the next run's start-up resumes it (`merge.server_health
    .resume_if_paused`).

    ``pause_whole_update``: pause before ``/start_weight_update`` instead, so that the whole update runs paused. A
    mixture-of-experts server with data parallelism steps its engines in lockstep (vLLM's ``DPEngineCoreProc``: a
    collective every step, dummy steps on an engine without requests), and each engine takes the update's calls
    between its steps: one engine's workers waiting in the factors' broadcast while another engine waits in a step's
    collective would wait for each other for good. A server that is generating during the update (``pause_mode``
    "keep", with data parallelism) needs it; vLLM's pause stops every engine's stepping first, together."""

    def __init__(
        self, base_url: str, timeout: float = 600.0, pause_mode: str = "wait", pause_whole_update: bool = False
    ) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        if pause_mode not in ("wait", "keep"):
            raise ValueError(f"{BACKEND}: pause_mode={pause_mode!r} is not one of 'wait', 'keep'")
        self.pause_mode, self.pause_whole_update = pause_mode, pause_whole_update
        self.http = HTTPVLLMWeightSyncClient(base_url, timeout=timeout)
        self.update_weights = self.http.update_weights

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """vLLM's call, answered once every worker has read its base: waited for ``connect_timeout_s``."""
        timeout = max(self.http.timeout, init_info.get("connect_timeout_s", 0))
        self._post("/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout)

    def _post(self, path: str, timeout: float | None = None, **kwargs) -> None:
        import requests

        timeout = timeout or self.http.timeout
        requests.post(f"{self.http.base_url}{path}", timeout=timeout, **kwargs).raise_for_status()

    def server_workers(self) -> int:
        """The server's workers (vLLM's ``/get_world_size``: tensor x pipeline x data parallel)."""
        import requests

        response = requests.get(f"{self.http.base_url}/get_world_size", timeout=self.http.timeout)
        response.raise_for_status()
        return int(response.json()["world_size"])

    def _pause(self) -> None:
        self._post("/pause", params={"mode": self.pause_mode, "clear_cache": "true"})

    def start_weight_update(self) -> None:
        if self.pause_whole_update:
            self._pause()
        self.http.start_weight_update()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.pause_whole_update:
            self._pause()
        self.http.finish_weight_update(weight_version)  # failed: the server stays paused (the workers' reply says
        self._post("/resume")  # whether they serve the previous version again); the next sync or start-up resumes it


class LLMWeightSyncClient:
    """vLLM's weight-sync control plane (`VLLMWeightSyncClient`) on an in-process ``vllm.LLM``."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def server_workers(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp

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
    timeout_s: float = 600.0  # each update's collectives and HTTP calls
    connect_timeout_s: float = 1800.0  # the first sync's connect: every worker reads its shard of the base meanwhile
    update: str = "lora"  # "lora": the factors; "full": the whole merged model (a comparison, see the module doc)
    wire_dtype: str | None = None  # cast the sent tensors to this dtype (None: as they are, fp32 factors usually)
    precision_stats: bool = True  # the workers measure the merge's precision (sync_delta_*; worth it below fp32)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"{BACKEND}: transport={self.transport!r} is not one of 'gloo' (CPU), 'nccl' (GPU)")
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
        self.group = self.store = None
        self.targets: dict[str, list[int]] | None = None  # what the connect declared: name -> shape
        self.buffers: dict[str, int] | None = None  # and each update's buffers: dtype name -> elements
        self.rounds = 0  # updates sent: each one's number (`wire.round_store`)
        self.last_sync: dict[str, float] = {}  # bytes and seconds of the last send_weights (rank 0)

    @classmethod
    def trainer_init(cls, init_info: LoraMergeTrainerInitInfo, *, client, source=None) -> LoraMergeTrainer:
        """vLLM's factory entry. The backend sends what `send_weights` is given (the peft model's factors), so a
        weight source is refused rather than ignored, as vLLM's backends refuse one they cannot use."""
        if source is not None:
            raise ValueError(
                f"{BACKEND}: a weight source ({type(source).__name__}) is not taken: the backend sends the LoRA "
                "factors of the peft model given to send_weights"
            )
        return cls(client=client, init_info=init_info)

    @classmethod
    def connect(
        cls,
        url_or_llm,
        *,
        rank: int,
        timeout: float = 600.0,
        pause_mode: str = "wait",
        pause_whole_update: bool = False,
        **settings,
    ) -> LoraMergeTrainer:
        """A trainer engine driving the server at a URL through vLLM's HTTP RL routes (`HTTPPausingWeightSyncClient`,
        which pauses in ``pause_mode``, around the whole update with ``pause_whole_update``), or an in-process ``LLM``
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) through the same calls on it. The server's workers reach rank 0 at
        this machine's address on the route to the server (``master_address`` overrides)."""
        if isinstance(url_or_llm, str):
            client = HTTPPausingWeightSyncClient(
                url_or_llm, timeout=timeout, pause_mode=pause_mode, pause_whole_update=pause_whole_update
            )
            settings.setdefault("master_address", local_address_towards(urllib.parse.urlparse(url_or_llm).hostname))
        else:
            client = LLMWeightSyncClient(url_or_llm)
        return cls(client=client, init_info=LoraMergeTrainerInitInfo(rank=rank, timeout_s=timeout, **settings))

    def _connect(self, targets: dict[str, list[int]], buffers: dict[str, int], factor_bytes: int) -> None:
        info = self.init_info
        workers = self.client.server_workers() if hasattr(self.client, "server_workers") else info.num_workers
        if workers != info.num_workers:  # the group would wait for ranks that never come, until its timeout
            raise WeightTransferError(
                f"{BACKEND} init: the trainer declared num_workers={info.num_workers}, the server has {workers} "
                f"workers (tensor x pipeline x data parallel): connect with num_workers={workers}"
            )
        port = info.master_port or free_port(info.master_address)
        worker_info = asdict(
            LoraMergeInitInfo(
                master_address=info.master_address,
                master_port=port,
                world_size=1 + info.num_workers,
                targets=targets,
                factor_bytes=factor_bytes,
                buffers=buffers,
                transport=info.transport,
                base_on_device=info.base_on_device,
                timeout_s=info.timeout_s,
                connect_timeout_s=info.connect_timeout_s,
                update=info.update,
                precision_stats=info.precision_stats,
            )
        )
        world_size = 1 + info.num_workers
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            call = pool.submit(self.client.init_weight_transfer_engine, worker_info)
            what = f"{BACKEND} init"
            connect_timeout_s = max(info.connect_timeout_s, info.timeout_s)
            self.group, self.store = connect(
                info.master_address, port, 0, world_size, info.transport, connect_timeout_s, what, pending_call=call
            )
            recv_reply(self.group, info.transport, world_size, what, pending_call=call, store=self.store)
            call_result(call, what, self.store)
            set_timeout(self.group, info.timeout_s)
        except BaseException:
            self.shutdown()  # the next sync connects anew
            raise
        finally:
            pool.shutdown(wait=False)  # never wait on a call stuck behind a failed transfer
        self.targets, self.buffers = targets, buffers

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
        ``precision_stats=False``). An update that fails gives up the group: the next one connects anew."""
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
        entries, buffers = update.packed()
        sizes = {dtype: b.numel() for dtype, b in buffers.items()}
        if self.group is None:  # the first sync, or the first after a failed one
            self._connect(update.shapes, sizes, sum(b.numel() * b.element_size() for b in buffers.values()))
        else:
            self._refuse_undeclared(update.shapes, sizes)
        self.rounds += 1
        info = LoraMergeUpdateInfo(entries=entries, buffers=sizes, round=self.rounds)
        try:
            reply, sent = self._update(info, buffers, weight_version)
        except BaseException:
            # the group may hold a collective of this update still in flight (a broadcast that a worker refused or
            # failed before joining), which the next update's would meet instead of its own: give it up, and let
            # the next sync connect anew (the workers discard what this one left) rather than wait in it
            self.shutdown()
            raise
        self.last_sync = {"sync_bytes": float(sent), "sync_seconds": time.perf_counter() - start}
        if "dot" not in reply:  # precision_stats=False
            return {}
        stats = MergePrecisionStats()
        stats.sums = torch.tensor([reply[k] for k in MergePrecisionStats.FIELDS], dtype=torch.float64)
        stats.entries, stats.tensors = reply["entries"], reply["tensors"]
        return stats.metrics()

    def _refuse_undeclared(self, shapes: dict[str, list[int]], sizes: dict[str, int]) -> None:
        """The trainer's own check of an update against what its connect declared (the workers check it too, as
        vLLM's engines refuse names not declared at init, before any transfer): refused naming the first difference,
        before anything is sent; the connection stays for the next update."""
        changed = "the adapter changed since the first sync: shutdown() and send again to connect with it"
        undeclared = [name for name in shapes if name not in self.targets]
        if undeclared:
            named = ", ".join(undeclared[:5]) + (", ..." if len(undeclared) > 5 else "")
            raise WeightTransferError(
                f"{BACKEND}: the update names {len(undeclared)} tensor(s) not declared at connect: {named}; {changed}"
            )
        for name, shape in self.targets.items():
            if shapes.get(name) != shape:
                made = f"makes it {shapes[name]}" if name in shapes else "leaves it out"
                raise WeightTransferError(
                    f"{BACKEND}: {name}: the update {made}, declared at connect as {shape}; {changed}"
                )
        if sizes != self.buffers:
            raise WeightTransferError(
                f"{BACKEND}: the update's buffers {sizes} (dtype: elements) are not those declared at connect, "
                f"{self.buffers}; {changed}"
            )

    def _update(self, info: LoraMergeUpdateInfo, buffers: dict[str, torch.Tensor], weight_version) -> tuple[dict, int]:
        """One update on the group: ``/start_weight_update``, the buffers broadcast while ``/update_weights`` makes
        the workers receive them, then ``/finish_weight_update``; the waits watch this update's store. Returns the
        workers' reply to finish and the bytes the broadcasts sent."""
        transport, store = self.init_info.transport, round_store(self.store, info.round)
        device = wire_device(transport)
        self._start()
        pool, sent = ThreadPoolExecutor(max_workers=1), 0
        try:
            call = pool.submit(self.client.update_weights, asdict(info))
            for buffer in buffers.values():
                on_wire = buffer.to(device)
                work = broadcast(self.group, on_wire)
                watch = {"pending_call": call, "store": store}
                wait(work, f"{BACKEND} update", transport=transport, group=self.group, **watch)
                sent += on_wire.numel() * on_wire.element_size()
            call_result(call, f"{BACKEND} update", store)
            call = pool.submit(self.client.finish_weight_update, weight_version)
            world_size, what = 1 + self.init_info.num_workers, f"{BACKEND} finish"
            reply = recv_reply(self.group, transport, world_size, what, pending_call=call, store=store)
            call_result(call, what, store)
        finally:
            pool.shutdown(wait=False)
        return reply, sent

    def shutdown(self) -> None:
        close_group(self.group, self.init_info.transport)
        self.group = self.store = self.targets = self.buffers = None
