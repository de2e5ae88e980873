"""The wire of the ``lora_merge`` backend: a torch.distributed group of its own, and the waits on it.

The trainer's rank 0 sends to the server's workers over a torch.distributed group of its own (gloo on CPU, NCCL on
GPU; rank 0 = trainer, ranks 1.. = workers) on a TCPStore that the trainer hosts, what is sent packed into one flat
buffer per dtype (`merge.lora_merge.update`), the broadcasts driven through vLLM's RL routes
(`merge.lora_merge.trainer`).

Joining (`connect`): every rank builds the group and issues a one-element all-reduce at once, as vLLM's own NCCL
weight transfer does after ``ncclCommInitRank`` (``PyNcclCommunicator``): the communicators exist before the first
reply or broadcast. Building them blocks the host until every rank has joined (gloo's constructor, NCCL's
communicator init), so it runs on a thread of its own under the same `wait` as every collective: a side that never
joins fails the other at once instead of leaving it blocked there. NCCL groups are built with torch's error handling
set to abort, never to end the process (`GROUP_ENV`), and without the NCCL variables vLLM pins for its own
communicators (``VLLM_BATCH_INVARIANT=1``), as vLLM builds its groups shared with a trainer.

Waiting (`wait`): a worker waiting for a dead trainer's factors fails at once: over gloo its receive sees the
connection close; over NCCL, whose waits do not block the host, it polls the collective and watches the store the
trainer hosts, and aborts the group when the store closes. The trainer stops waiting as soon as the server's call
that makes the server's side of the collective fails. A worker that fails where the others wait on it in a
collective posts its failure to the store (`post_failure`); every wait, on every rank, ends on it with that message.
Each update posts and watches in a store of its own (`round_store`): a failure ends its own update's waits, never a
later update's on the same connection.

Replies (`exchange`): at the end of init and of finish every worker reports, over the group: the trainer gets
the first failing worker's message, naming its rank, else the first worker's reply (the merge-precision telemetry of
`merge.MergePrecisionStats`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch

BACKEND = "lora_merge"
TRANSPORTS = ("gloo", "nccl")
FAILED = "worker_failed"  # the store key of the first failure a worker posted (`post_failure`)
ARRIVED = "workers_arrived"  # the store key the workers count themselves on before joining (`connect`)
PROBE_S = 0.1  # how often a wait looks at the store
STORE_CONNECT_S = 30.0  # how long a worker tries to reach the trainer's store, listening before the server is called

# torch's ProcessGroupNCCL reads these once, in its constructor (ProcessGroupNCCL.hpp). TORCH_NCCL_ASYNC_ERROR_HANDLING
# defaults to 3 (SkipCleanUp: a collective past its timeout tears the process down, which on a worker is the vLLM
# server); 2 (CleanUpOnly) aborts the communicators and the wait raises. The heartbeat monitor ends a process whose
# watchdog is stuck (in ncclCommAbort, say); `wait` is this group's liveness check instead.
GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}


class WeightTransferError(RuntimeError):
    """The server refused or failed a ``lora_merge`` update (the message is the worker's)."""


def _process_group_nccl():
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    return ProcessGroupNCCL


def _unpinned_nccl_env():
    """vLLM's own context for communicators shared with other processes: the NCCL variables it pinned for its own
    (``VLLM_BATCH_INVARIANT=1``: NCCL_ALGO, NCCL_PROTO, channels...) back to their launch values, which NCCL re-reads
    per communicator (NCCL_NO_CACHE). A trainer that does not set them would hang in the first collective."""
    from vllm.utils.nccl import unpinned_nccl_env

    return unpinned_nccl_env()


class _GroupEnv:
    """`GROUP_ENV` set and vLLM's NCCL pins lifted while this process builds an NCCL group (construction and
    communicator init, where torch and NCCL read them); restored after. Counted: groups built at once in one process
    swap the environment once and restore it once."""

    def __init__(self) -> None:
        self.lock, self.count = threading.Lock(), 0
        self.saved: dict[str, str | None] = {}
        self.unpinned = contextlib.nullcontext()

    @contextlib.contextmanager
    def __call__(self):
        with self.lock:
            if self.count == 0:
                self.unpinned = _unpinned_nccl_env()
                self.unpinned.__enter__()
                self.saved = {name: os.environ.get(name) for name in GROUP_ENV}
                os.environ.update(GROUP_ENV)
            self.count += 1
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1
                if self.count == 0:
                    for name, value in self.saved.items():
                        if value is None:
                            os.environ.pop(name, None)
                        else:
                            os.environ[name] = value
                    self.unpinned.__exit__(None, None, None)


_group_env = _GroupEnv()


def _new_group(store, rank: int, world_size: int, transport: str, timeout: timedelta):
    if transport == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)
    process_group_nccl = _process_group_nccl()
    options = process_group_nccl.Options()
    options._timeout = timeout
    return process_group_nccl(store, rank, world_size, options)


def _warm_up(group, device: torch.device):
    """The first collective, which creates the communicators (NCCL: ``ncclCommInitRank``, blocking the host until
    every rank has issued it); one element, as ``PyNcclCommunicator`` warms up."""
    return group.allreduce([torch.zeros(1, device=device)])


class _Joining:
    """The group being built and warmed up on a thread of its own, seen as one collective by `wait`: polled with
    ``is_completed``, ended with ``abort``."""

    def __init__(self, build) -> None:
        self.group = self.work = self.error = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(build,), daemon=True).start()

    def _run(self, build) -> None:
        try:
            build(self)
        except BaseException as error:  # noqa: BLE001 - raised in the waiting thread (`wait`)
            self.error = error
        finally:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set() and (self.error is not None or self.work.is_completed())

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.work.wait()

    def abort(self) -> None:
        if self.group is not None:
            self.group.abort()


def connect(
    host: str, port: int, rank: int, world_size: int, transport: str, timeout_s: float, what: str, *, pending_call=None
):
    """Join the group on a TCPStore that rank 0 (the trainer) hosts and create its communicators now (`_warm_up`),
    under `wait`: the trainer stops when the server's call fails (``pending_call``) or a worker posts a failure, a
    worker when the trainer dies or another worker posts one. A worker whose own joining fails posts it. Returns the
    group and the store (every later wait watches it)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"{BACKEND}: transport={transport!r} is not one of 'gloo' (CPU), 'nccl' (GPU)")
    timeout = timedelta(seconds=timeout_s)
    store = torch.distributed.PrefixStore(BACKEND, _store(host, port, rank, world_size, timeout, what))

    device = wire_device(transport)  # the caller's: a new thread's current CUDA device is the first one
    if transport == "nccl":
        _refuse_a_shared_device(store, rank, device_id(device), what)
    if rank > 0:
        store.add(ARRIVED, 1)
    elif transport == "gloo":  # NCCL's constructor returns at once: its communicators are created under `wait`
        _wait_for_arrivals(store, world_size - 1, what, pending_call, timeout_s)

    def build(joining: _Joining) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        joining.group = _new_group(store, rank, world_size, transport, timeout)
        joining.work = _warm_up(joining.group, device)

    # the environment is this call's, not the joining thread's: one left blocked in a communicator's init (which an
    # abort cannot reach) must not keep the process's own settings away
    with _group_env() if transport == "nccl" else contextlib.nullcontext():
        joining = _Joining(build)
        try:
            wait(joining, what, transport=transport, group=joining, pending_call=pending_call, store=store)
        except BaseException as error:
            own = joining.error is not None and joining.error in (error, error.__cause__)
            if rank > 0 and own:  # this worker's own failure, not a peer's
                post_failure(store, rank, f"{what}: {type(joining.error).__name__}: {joining.error}")
            close_group(joining.group, transport)
            raise
    return joining.group, store


def _store(host: str, port: int, rank: int, world_size: int | None, timeout: timedelta, what: str):
    """The group's TCPStore: rank 0 (the trainer) hosts it, before it calls the server (its side answers at once: it
    is watched for failures while the workers join); a worker reaches it within `STORE_CONNECT_S`, not the
    connect's timeout: a worker's connect holds its engine's busy loop, the whole server, and a store that is not
    there within seconds (an address the server cannot reach, a trainer that died first) will not come."""
    if rank == 0:
        return torch.distributed.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False)
    try:
        store = torch.distributed.TCPStore(
            host, port, world_size, False, timeout=timedelta(seconds=STORE_CONNECT_S), wait_for_workers=False
        )
    except torch.distributed.DistError as error:
        raise WeightTransferError(
            f"{what}: the server cannot reach the trainer's store at {host}:{port} within {STORE_CONNECT_S:g} s "
            f"({type(error).__name__}): the trainer is gone, or the server cannot reach {host} (a firewall, another "
            "network): connect with a master_address of the trainer's that the server can reach"
        ) from None
    store.set_timeout(timeout)
    return store


def refuse_before_joining(host: str, port: int, rank: int, what: str, message: str) -> None:
    """A worker that cannot join (the group the trainer declared is not the server's) says why in the trainer's
    store, where the trainer waits for the workers to arrive, and raises; it never joins."""
    store = torch.distributed.PrefixStore(
        BACKEND, _store(host, port, rank, None, timedelta(seconds=STORE_CONNECT_S), what)
    )
    post_failure(store, rank, f"{what}: {message}")
    raise WeightTransferError(worker_failure(rank, f"{what}: {message}"))


def _wait_for_arrivals(store, workers: int, what: str, pending_call, timeout_s: float) -> None:
    """The trainer builds its side of the group only once every worker has reached the store: gloo's constructor
    holds the interpreter while it waits for the other ranks, so a worker whose call failed before it joined would
    be seen only at the group's timeout."""
    probe, deadline = [0.0], time.monotonic() + timeout_s
    while store.add(ARRIVED, 0) < workers:
        failure = _other_side_failed(pending_call, store, probe)
        if failure is not None:
            raise WeightTransferError(f"{what}: {failure}")
        if time.monotonic() > deadline:
            arrived = store.add(ARRIVED, 0)
            raise WeightTransferError(
                f"{what}: {arrived} of the server's {workers} workers joined within {timeout_s:g} s"
            )
        time.sleep(0.01)


def set_timeout(group, timeout_s: float) -> None:
    """The timeout of the group's later collectives (gloo's and NCCL's own, torch's ``Backend.set_timeout``): joining
    waits longer (`connect`'s), while the workers read their base."""
    group.set_timeout(timedelta(seconds=timeout_s))


def device_id(device: torch.device) -> str | None:
    """The GPU's UUID (None off CUDA): what tells whether two processes use the same GPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def _refuse_a_shared_device(store, rank: int, mine: str | None, what: str) -> None:
    """NCCL refuses two ranks of one communicator on one GPU, at the communicator's init (a trainer and a server
    started on the same GPU): the trainer says which GPU it uses, and a worker on the same one refuses, naming it,
    before any communicator is made."""
    if rank == 0:
        store.set("trainer_device", mine or "")
        return
    if mine is None:
        return
    try:  # the trainer names it before it calls the server: a short wait, which a dead trainer's closed store ends
        store.wait(["trainer_device"], timedelta(seconds=STORE_CONNECT_S))
    except torch.distributed.DistError as error:
        raise WeightTransferError(
            f"{what}: the trainer did not name its GPU in its store within {STORE_CONNECT_S:g} s "
            f"({type(error).__name__}): it is gone"
        ) from None
    if store.get("trainer_device").decode() == mine:
        message = (
            f"{what}: it runs on the trainer's GPU ({mine}), and NCCL cannot join two ranks on one GPU: give the "
            "server GPUs of its own (CUDA_VISIBLE_DEVICES), or train with vllm.mode=colocate"
        )
        post_failure(store, rank, message)
        raise WeightTransferError(worker_failure(rank, message))


def close_group(group, transport: str) -> None:
    """NCCL: abort the group's communicators (never waits on a peer that may be gone); gloo closes with its last
    reference."""
    if group is not None and transport == "nccl":
        group.abort()


def broadcast(group, tensor: torch.Tensor, root: int = 0):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = root
    return group.broadcast([tensor], options)


def wire_device(transport: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")


def worker_failure(rank: int, message: str) -> str:
    return f"the server's worker of rank {rank} failed: {message}"


def post_failure(store, rank: int, message: str) -> None:
    """A worker failed where the others wait on it: every wait watching the store ends with this message (the first
    posted stays). Best effort: a trainer already gone takes no message."""
    try:
        store.compare_set(FAILED, "", worker_failure(rank, message))
    except torch.distributed.DistError:
        pass


def round_store(store, number: int):
    """The group's store as update ``number`` posts to it and watches it: the first failure posted stays for the rest
    of that update's waits (`post_failure`), and the next update, on the same connection, starts clean. The trainer
    numbers its updates (`LoraMergeUpdateInfo.round`); joining and its reply use the connection's own store."""
    return torch.distributed.PrefixStore(f"round{number}", store)


def _store_failure(store) -> str | None:
    """What the store says about the other side: a worker's posted failure, the trainer gone (it hosts the store:
    once it dies, any call on it fails at once), or nothing."""
    try:
        if store.check([FAILED]):
            return store.get(FAILED).decode()
    except torch.distributed.DistError:
        return "the trainer is gone (its store closed); the update is discarded"
    return None


def _other_side_failed(pending_call, store, probe: list[float]) -> str | None:
    call_failed = pending_call is not None and pending_call.done() and pending_call.exception() is not None
    if store is not None and (call_failed or time.monotonic() >= probe[0]):
        probe[0] = time.monotonic() + PROBE_S
        failure = _store_failure(store)
        if failure is not None:  # a worker's own words, rather than the server's bare 500
            return failure
    if call_failed:
        return f"the server's call failed: {pending_call.exception()}"
    return None


def call_result(call, what: str, store=None):
    """The result of the server's call that made its side of a collective; when it failed, the failure a worker
    posted (naming it), if any, in its place."""
    try:
        return call.result()
    except Exception as error:
        failure = _store_failure(store) if store is not None else None
        if failure is None:
            raise
        raise WeightTransferError(f"{what}: {failure}") from error


def wait(work, what: str, *, transport: str, group=None, pending_call=None, store=None) -> None:
    """Wait for ``work``, failing fast when the other side can no longer take part: the HTTP call that makes the
    server's side of the collective failed (``pending_call``, the trainer), a worker posted its failure or the
    trainer died (``store``, the group's store, every rank).

    gloo: ``wait()`` blocks and fails as soon as a peer's connection closes (a dead trainer). Its ``is_completed``
    only moves inside ``wait``, so with something to watch the wait runs on a daemon thread, left behind in that case
    until the group's timeout. That thread holds ``group`` until then: destroying a gloo group waits for its
    collectives in flight (its ``abort`` as well), so a caller that gives up the group goes on at once.
    NCCL: ``wait()`` does not block the host: it orders the current CUDA stream after the collective. A stream
    ordered after a collective that never completes holds back every later kernel on it (a worker's generation),
    until the group's timeout aborts it. So the host polls ``is_completed()`` first, aborts the group when the other
    side is gone, and orders the stream only after a completed collective."""
    probe = [0.0]
    if transport == "nccl":
        while not work.is_completed():
            failure = _other_side_failed(pending_call, store, probe)
            if failure is not None:
                group.abort()
                raise WeightTransferError(f"{what}: {failure}")
            time.sleep(0.001)
        try:
            work.wait()
        except WeightTransferError:
            raise
        except Exception as error:  # past the group's timeout: its communicators aborted (`GROUP_ENV`), not the process
            raise WeightTransferError(f"{what}: {type(error).__name__}: {error}") from error
        return
    if pending_call is None and store is None:
        work.wait()
        return
    done, errors = threading.Event(), []

    def run(held=group):  # noqa: ARG001 - the group lives as long as its collective may (see above)
        try:
            work.wait()
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.wait(0.01):
        failure = _other_side_failed(pending_call, store, probe)
        if failure is not None:
            raise WeightTransferError(f"{what}: {failure}")
    if errors:
        raise errors[0]


def exchange(group, transport: str, rank: int, world_size: int, reply: dict | None, what: str, **watch):
    """Every rank's outcome of a phase, at once, over collectives only (no point-to-point communicator to create on
    the way): an all-reduce of each worker's reply size and failure flag, then the reply that matters, the
    lowest-ranked failing worker's, else the first worker's, broadcast from its rank. The trainer passes no
    ``reply``. Returns (that worker's rank, its reply); ``watch``: what `wait` watches."""
    device = wire_device(transport)
    data = json.dumps(reply).encode() if reply is not None else b""
    status = torch.zeros(2 * world_size, dtype=torch.int64)
    status[rank] = len(data)
    status[world_size + rank] = int(reply is not None and not reply.get("ok", True))
    status = status.to(device)
    wait(group.allreduce([status]), what, transport=transport, group=group, **watch)
    sizes, failed = status.cpu().tolist()[:world_size], status.cpu().tolist()[world_size:]
    source = next((r for r in range(1, world_size) if failed[r]), 1)
    if rank == source:
        message = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        message = torch.empty(sizes[source], dtype=torch.uint8, device=device)
    wait(broadcast(group, message, root=source), what, transport=transport, group=group, **watch)
    return source, json.loads(bytes(message.cpu().tolist()).decode())


def recv_reply(group, transport: str, world_size: int, what: str, **watch) -> dict:
    """Trainer: the workers' outcome of a phase (`exchange`); a failure on any of them raises its message, naming
    its rank."""
    source, reply = exchange(group, transport, 0, world_size, None, what, **watch)
    if not reply["ok"]:
        raise WeightTransferError(worker_failure(source, reply["error"]))
    return reply


def local_address_towards(host: str | None) -> str:
    """This machine's address on the route to ``host``: where the server's workers reach the trainer's rank 0 (the
    loopback for a server on this machine, the interface towards it for one on another node). A UDP ``connect``
    only picks the route; nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host or "127.0.0.1", 9))
        except OSError:
            return "127.0.0.1"
        return s.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
