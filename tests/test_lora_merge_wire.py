"""The lora_merge wire over NCCL, on CPU: a model of the contract of torch's ``ProcessGroupNCCL`` work, and the real
TCPStore that the trainer's rank 0 hosts.

``ProcessGroupNCCL``'s ``Work.wait()`` does not block the host: it makes the current CUDA stream wait for the
collective's end event (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ``WorkNCCL::synchronizeStream``), and
``is_completed()`` queries that event without blocking. A worker whose stream waits on a broadcast from a dead
trainer holds back every later kernel (its generation) until the NCCL watchdog ends the process. The server-mode
tests run the same code over gloo, whose ``wait()`` blocks and fails at once when the trainer's connection closes.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import psutil
import pytest
import torch
from bench_common import free_port


class NcclWork:
    """``WorkNCCL``'s contract: ``wait()`` returns at once (it orders the stream), ``is_completed()`` polls."""

    def __init__(self, complete_after_s: float | None = None):
        self.completed, self.stream_ordered = False, False
        if complete_after_s is not None:
            threading.Timer(complete_after_s, setattr, (self, "completed", True)).start()

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> bool:
        self.stream_ordered = True
        return True


class NcclGroup:
    def __init__(self):
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def trainer_store():
    """A worker's client of the store that a trainer process hosts, and a function that SIGKILLs that trainer."""
    port = free_port()
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import datetime, time, torch; store = torch.distributed.TCPStore('127.0.0.1', {port}, 2, True, "
            "timeout=datetime.timedelta(seconds=60)); time.sleep(120)",
        ]
    )
    client = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    yield torch.distributed.PrefixStore("lora_merge", client), lambda: (trainer.kill(), trainer.wait())
    trainer.kill()
    trainer.wait()


def test_a_worker_waiting_for_a_dead_trainer_over_nccl_aborts_without_ordering_its_stream(trainer_store):
    from merge.lora_merge.wire import WeightTransferError, wait

    store, kill_trainer = trainer_store
    group, finished = NcclGroup(), NcclWork(complete_after_s=0.2)
    wait(finished, "update", transport="nccl", group=group, store=store)  # a live trainer: it completes
    assert finished.stream_ordered and not group.aborted

    kill_trainer()
    hung = NcclWork()  # the broadcast of the dead trainer's factors never completes
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="the trainer is gone"):
        wait(hung, "lora_merge update", transport="nccl", group=group, store=store)
    assert time.monotonic() - start < 10  # not the group's timeout (600 s)
    assert group.aborted  # the NCCL kernel is cancelled, the communicator released
    assert not hung.stream_ordered  # generation on the worker's stream is not held behind it


def test_a_worker_keeps_no_update_of_a_trainer_that_died_mid_broadcast(trainer_store, monkeypatch):
    from merge.lora_merge import LoraMergeUpdateInfo, LoraMergeWeightTransferEngine, WeightTransferError
    from merge.lora_merge import worker as lora_merge_worker

    store, kill_trainer = trainer_store
    worker = object.__new__(LoraMergeWeightTransferEngine)  # the wire only: no vLLM model behind it
    worker.transport, worker.device, worker.trainer_store = "nccl", torch.device("cpu"), store
    worker.group = NcclGroup()
    works = [NcclWork(complete_after_s=0.0), NcclWork()]  # the fp32 buffer arrives, the bf16 one never does
    monkeypatch.setattr(lora_merge_worker, "broadcast", lambda group, tensor: works.pop(0))
    kill_trainer()
    with pytest.raises(WeightTransferError, match="the trainer is gone"):
        worker.receive_weights(LoraMergeUpdateInfo(entries=[], buffers={"float32": 8, "bfloat16": 8}))
    assert worker.pending is None  # finish_weight_update changes nothing: the server keeps its last version
    assert worker.group.aborted


def test_the_trainer_stops_waiting_when_the_servers_call_fails_over_nccl():
    from merge.lora_merge.wire import WeightTransferError, wait

    call = Future()
    call.set_exception(RuntimeError("500 Internal Server Error for /update_weights"))
    group, hung = NcclGroup(), NcclWork()
    with pytest.raises(WeightTransferError, match="lora_merge update: the server's call failed: 500"):
        wait(hung, "lora_merge update", transport="nccl", group=group, pending_call=call)
    assert group.aborted and not hung.stream_ordered


class RoutedUdpSocket:
    """A UDP socket on a machine with three interfaces, as the kernel's contract has it: ``connect`` sends nothing
    and binds the socket to the source address of the route towards the peer (the longest matching prefix, else the
    default route); ``getsockname`` gives it. A name resolves as getaddrinfo would (``localhost``, one server's name);
    a peer with no route raises as ``connect`` does (ENETUNREACH)."""

    ROUTES = [  # (destination network, this machine's address on the interface that reaches it)
        (ipaddress.ip_network("127.0.0.0/8"), "127.0.0.1"),
        (ipaddress.ip_network("10.1.0.0/16"), "10.1.4.7"),  # the cluster's fabric
        (ipaddress.ip_network("192.168.50.0/24"), "192.168.50.20"),  # a management network
        (ipaddress.ip_network("0.0.0.0/0"), "172.31.9.3"),  # the default route
    ]
    NAMES = {"localhost": "127.0.0.1", "rollout-node": "10.1.9.9"}

    def __init__(self, family, kind):
        assert (family, kind) == (socket.AF_INET, socket.SOCK_DGRAM)
        self.source = "0.0.0.0"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def connect(self, peer):
        host = ipaddress.ip_address(self.NAMES.get(peer[0], peer[0]))
        if host.is_multicast:  # stands for any peer without a route
            raise OSError(101, "Network is unreachable")
        network, self.source = max((r for r in self.ROUTES if host in r[0]), key=lambda r: r[0].prefixlen)

    def getsockname(self):
        return (self.source, 40000)


def reaches_the_trainer_on_each_route(address_towards) -> None:
    """The address the server's workers are given, for a server on each route of ``RoutedUdpSocket``'s machine."""
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    assert address_towards(None) == "127.0.0.1"  # no server host given: this machine
    assert address_towards("rollout-node") == "10.1.4.7"
    assert address_towards("10.1.200.1") == "10.1.4.7"
    assert address_towards("192.168.50.3") == "192.168.50.20"
    assert address_towards("203.0.113.8") == "172.31.9.3"
    assert address_towards("224.0.0.1") == "127.0.0.1"  # no route: the loopback, as documented


def test_the_workers_reach_the_trainer_at_its_address_on_the_route_to_the_server(monkeypatch):
    """On a machine with three interfaces (a stand-in for the kernel's route choice), the address towards each
    server is the one of the interface on its route. Control: an implementation that answers with one fixed
    interface (the first non-loopback address, right on a one-interface machine) fails the same checks."""
    import merge.lora_merge.wire as wire

    monkeypatch.setattr(wire.socket, "socket", RoutedUdpSocket)
    reaches_the_trainer_on_each_route(wire.local_address_towards)

    def first_interface(host):
        return "127.0.0.1" if host in (None, "localhost") or host.startswith("127.") else RoutedUdpSocket.ROUTES[1][1]

    with pytest.raises(AssertionError):
        reaches_the_trainer_on_each_route(first_interface)


def test_the_address_towards_a_server_is_one_of_this_machines_own():
    """The real route choice on this machine: towards each of its own addresses, that address (found with psutil,
    not the function under test)."""
    from merge.lora_merge.wire import local_address_towards

    own = [
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET and not address.address.startswith("127.")
    ]
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert all(local_address_towards(address) == address for address in own), own


def in_a_thread(target) -> tuple[threading.Thread, list]:
    """``target()`` on a daemon thread; the list gets what it raised or returned."""
    outcome: list = []

    def run():
        try:
            outcome.append(target())
        except BaseException as error:  # noqa: BLE001 - what the test looks at
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_worker_that_cannot_reach_the_trainers_store_stops_within_seconds_naming_the_address(monkeypatch):
    """A worker's connect holds its engine's busy loop, the whole server: the trainer's store listens before the
    server is called, so one that is not there within a few seconds (an address the server cannot reach, a trainer
    that died first) is given up, naming the address, not waited for under the connect's 30 minutes (here 60 s).
    Control: a store that listens is joined."""
    from merge.lora_merge import WeightTransferError, wire

    monkeypatch.setattr(wire, "STORE_CONNECT_S", 1.0, raising=False)
    port = free_port()  # nothing listens there
    thread, outcome = in_a_thread(lambda: wire.connect("127.0.0.1", port, 1, 2, "gloo", 60, "lora_merge init"))
    thread.join(20)
    assert not thread.is_alive()
    assert isinstance(outcome[0], WeightTransferError)
    assert f"cannot reach the trainer's store at 127.0.0.1:{port} within 1 s" in str(outcome[0])

    listening = torch.distributed.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)  # the control
    store = wire._store("127.0.0.1", port, 1, 2, timedelta(seconds=60), "lora_merge init")
    store.set("joined", "1")
    assert listening.get("joined") == b"1"


def test_a_worker_on_nccl_waits_for_the_trainers_gpu_name_for_seconds_only(monkeypatch):
    """Over NCCL a worker reads which GPU the trainer uses from its store (`_refuse_a_shared_device`); a trainer
    that never names it (gone before it did) is given up within seconds, not at the store's timeout (here 60 s).
    Control: a trainer that named another GPU lets the worker go on."""
    from merge.lora_merge import WeightTransferError, wire

    monkeypatch.setattr(wire, "STORE_CONNECT_S", 1.0, raising=False)
    port = free_port()
    trainer = torch.distributed.TCPStore(
        "127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    worker = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    thread, outcome = in_a_thread(lambda: wire._refuse_a_shared_device(worker, 1, "GPU-1", "lora_merge init"))
    thread.join(20)
    assert not thread.is_alive()
    assert isinstance(outcome[0], WeightTransferError) and "did not name its GPU" in str(outcome[0])
    trainer.set("trainer_device", "GPU-0")  # the control
    assert wire._refuse_a_shared_device(worker, 1, "GPU-1", "lora_merge init") is None
