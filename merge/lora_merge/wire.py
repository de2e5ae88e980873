"""The wire of the ``lora_merge`` backend: a torch.distributed group of its own, and the waits on it.

The trainer's rank 0 sends to the server's workers over a torch.distributed group of its own (gloo on CPU, NCCL on
GPU; rank 0 = trainer, ranks 1.. = workers) on a TCPStore that the trainer hosts, what is sent packed into one flat
buffer per dtype (`merge.lora_merge.update`), the broadcasts driven through vLLM's RL routes
(`merge.lora_merge.trainer`).

A worker waiting for a dead trainer's factors fails at once: over gloo its receive sees the connection close; over
NCCL, whose waits do not block the host, it polls the collective and watches the store the trainer hosts, and aborts
the group when the store closes (`wait`). The trainer stops waiting as soon as the server's call that makes the
server's side of the collective fails. Replies (errors, the merge-precision telemetry of `merge.MergePrecisionStats`)
come back to the trainer over the same group, from the first worker (`recv_reply`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import torch

BACKEND = "lora_merge"
REPLY_TAG = 7


class WeightTransferError(RuntimeError):
    """The server refused or failed a ``lora_merge`` update (the message is the worker's)."""


def open_group(host: str, port: int, rank: int, world_size: int, transport: str, timeout_s: float):
    """A torch.distributed group of its own (no global state), on a TCPStore that rank 0 (the trainer) hosts.
    Returns the group and the store: a worker watches the store to tell a dead trainer over NCCL (`wait`)."""
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


def close_group(group, transport: str) -> None:
    """NCCL: abort the group's communicators (never waits on a peer that may be gone); gloo closes with its last
    reference."""
    if group is not None and transport == "nccl":
        group.abort()


def broadcast(group, tensor: torch.Tensor):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def wire_device(transport: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")


def _trainer_alive(store) -> bool:
    """The trainer's rank 0 hosts the group's store: once it dies, any call on the store fails at once."""
    try:
        store.check(["alive"])
    except torch.distributed.DistError:
        return False
    return True


def wait(work, what: str, *, transport: str, group=None, pending_call=None, trainer_store=None) -> None:
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


def recv_reply(group, transport: str, pending_call, what: str) -> dict:
    """Trainer <- first worker: a JSON reply (length, then bytes)."""
    device = wire_device(transport)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    wait(group.recv([size], 1, REPLY_TAG), what, transport=transport, group=group, pending_call=pending_call)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait(group.recv([data], 1, REPLY_TAG), what, transport=transport, group=group, pending_call=pending_call)
    return json.loads(bytes(data.cpu().tolist()).decode())


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
