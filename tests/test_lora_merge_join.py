"""Joining the lora_merge group and reporting over it, on CPU: the trainer (rank 0) and the server's workers as threads.

NCCL is modelled by a stand-in for torch's ``ProcessGroupNCCL`` (patched in where `wire.connect` builds its groups),
with the behaviour these tests rely on, read off torch 2.13's ProcessGroupNCCL.hpp/.cpp and vLLM 0.32:
- the constructor reads the ``TORCH_NCCL_*`` variables (``asyncErrorHandling_ = getCvarInt(
  TORCH_NCCL_ASYNC_ERROR_HANDLING, 3 /*SkipCleanUp*/)``; the heartbeat monitor's TORCH_NCCL_ENABLE_MONITORING);
- communicators are created lazily by the first collective (``initNCCLComm`` from ``getNCCLComm``), which blocks the
  calling thread until every rank has issued one (``ncclCommInitRank``, blocking mode: torch's default, see
  ``useNonblocking``); ``abort`` cannot reach a communicator still in init; NCCL reads the ``NCCL_*`` variables
  there (vLLM's ``pin_nccl_env`` lists its pins in NCCL_NO_CACHE so that they are re-read per communicator, and
  lifts them with ``unpinned_nccl_env`` around the communicators it shares with a trainer, nccl_common.py);
- later collectives are enqueued, polled with ``is_completed`` (`wait`).
gloo runs as itself.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
from bench_common import free_port

from merge.lora_merge import wire
from merge.lora_merge.wire import WeightTransferError, connect, exchange, recv_reply

WATCHED = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING", "NCCL_PROTO", "NCCL_ALGO")


class Enqueued:
    """A collective issued on a created communicator: complete once every rank issued it (here: at once)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class StandInProcessGroupNCCL:
    """torch's ProcessGroupNCCL, as far as joining goes (see the module doc)."""

    class Options:
        def __init__(self) -> None:
            self._timeout = timedelta(minutes=10)

    groups: list[StandInProcessGroupNCCL] = []
    released = threading.Event()  # the test's end: a communicator init still blocked gives up (no thread outlives it)
    fail_rank: int | None = None  # a worker whose group cannot be built (a CUDA error, say)

    def __init__(self, store, rank: int, size: int, options) -> None:
        if rank == self.fail_rank:
            raise RuntimeError("CUDA error: out of memory")
        self.store, self.rank, self.size, self.timeout = store, rank, size, options._timeout
        self.env = {"construction": {name: os.environ.get(name) for name in WATCHED}}
        self.ops: list[str] = []
        self.aborted = False
        self.groups.append(self)

    def _collective(self, name: str) -> Enqueued:
        if not self.ops:  # the communicator's init: blocks this thread until every rank joined; abort cannot end it
            self.env["communicator init"] = {n: os.environ.get(n) for n in WATCHED}
            self.store.add("stand_in_joined", 1)
            deadline = time.monotonic() + self.timeout.total_seconds()
            while self.store.add("stand_in_joined", 0) < self.size:
                if time.monotonic() > deadline or self.released.is_set():
                    raise RuntimeError("ncclCommInitRank: timed out")
                time.sleep(0.01)
        self.ops.append(name)
        return Enqueued()

    def allreduce(self, tensors, options=None) -> Enqueued:
        return self._collective("allreduce")

    def broadcast(self, tensors, options=None) -> Enqueued:
        return self._collective("broadcast")

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def nccl(monkeypatch):
    """The stand-in where `wire.connect` gets ProcessGroupNCCL; the wire's tensors on the CPU."""
    monkeypatch.setattr(StandInProcessGroupNCCL, "groups", [])
    monkeypatch.setattr(StandInProcessGroupNCCL, "fail_rank", None)
    monkeypatch.setattr(wire, "_process_group_nccl", lambda: StandInProcessGroupNCCL)
    monkeypatch.setattr(wire, "wire_device", lambda transport: torch.device("cpu"))
    monkeypatch.setattr(StandInProcessGroupNCCL, "released", threading.Event())
    yield StandInProcessGroupNCCL
    StandInProcessGroupNCCL.released.set()
    time.sleep(0.05)  # the blocked inits see it


def in_threads(target, ranks) -> dict:
    """``target(rank)`` for each rank on a thread; returns {rank: result or exception} once all have ended."""
    results: dict = {}

    def run(rank):
        try:
            results[rank] = target(rank)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            results[rank] = error.with_traceback(None)  # not its frames: its group closes with the thread

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    results["join"] = lambda timeout: [thread.join(timeout) for thread in threads]
    return results


def test_nccl_communicators_are_created_at_connect_under_the_wait(nccl):
    port = free_port()
    workers = in_threads(lambda rank: connect("127.0.0.1", port, rank, 3, "nccl", 10, "init"), [1, 2])
    group, _ = connect("127.0.0.1", port, 0, 3, "nccl", 10, "init", pending_call=Future())
    workers["join"](10)
    assert [g.ops for g in nccl.groups] == [["allreduce"]] * 3  # the warm-up, before any reply or broadcast
    assert all(not isinstance(workers[rank], Exception) for rank in (1, 2))

    # so a worker that fails once the communicators exist cannot hold the trainer in their init: the next
    # collective is enqueued and the wait sees the server's call fail
    call = Future()
    call.set_exception(RuntimeError("500 Internal Server Error for /update_weights"))
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="update: the server's call failed: 500"):
        wire.wait(NeverCompletes(), "update", transport="nccl", group=group, pending_call=call)
    assert time.monotonic() - start < 2 and group.aborted


class NeverCompletes:
    def is_completed(self) -> bool:
        return False


@pytest.mark.parametrize("failure", ["builds no group", "never reaches the store"])
def test_a_worker_that_never_joins_fails_the_trainer_fast_naming_it(nccl, failure):
    port, call = free_port(), Future()
    if failure == "builds no group":  # it reaches the store, then fails: it posts there
        nccl.fail_rank = 2
        workers = in_threads(lambda rank: connect("127.0.0.1", port, rank, 3, "nccl", 10, "init"), [1, 2])
        expected = "init: the server's worker of rank 2 failed: init: RuntimeError: CUDA error: out of memory"
    else:  # its init failed before: the server's call fails (rank 1 still joins and waits)
        workers = in_threads(lambda rank: connect("127.0.0.1", port, rank, 3, "nccl", 10, "init"), [1])
        threading.Timer(0.5, call.set_exception, (RuntimeError("500 Internal Server Error"),)).start()
        expected = "init: the server's call failed: 500"
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match=expected):
        connect("127.0.0.1", port, 0, 3, "nccl", 10, "init", pending_call=call)
    assert time.monotonic() - start < 5  # not the group's timeout (30 s here, 600 s by default)
    if failure == "builds no group":  # worker 1, waiting in its warm-up, ends on the same message
        workers["join"](5)
        assert isinstance(workers[1], WeightTransferError) and "rank 2 failed" in str(workers[1])


def test_control_without_the_warm_up_the_trainer_blocks_in_communicator_init(nccl, monkeypatch):
    monkeypatch.setattr(wire, "_warm_up", lambda group, device: Enqueued())  # lazy, as before
    port, call = free_port(), Future()
    group, store = connect("127.0.0.1", port, 0, 2, "nccl", 3, "init", pending_call=call)  # returns: nothing joined
    assert nccl.groups[0].ops == []  # no communicator yet: the first reply will create it
    call.set_exception(RuntimeError("500 Internal Server Error"))  # the worker failed before joining
    trainer = in_threads(lambda _: recv_reply(group, "nccl", 2, "init", pending_call=call, store=store), [0])
    time.sleep(1.5)
    assert 0 not in trainer  # blocked in the communicator's init, out of the wait's reach, though the call failed
    trainer["join"](10)  # the stand-in's init gives up at the group's timeout (3 s)
    assert "timed out" in str(trainer[0])


@pytest.fixture
def batch_invariant_pins(monkeypatch):
    """vLLM's ``VLLM_BATCH_INVARIANT=1`` on a worker: NCCL pins for its own communicators (a few of
    ``override_envs_for_invariance``'s), with an NCCL that re-reads them per communicator (>= 2.29.7)."""
    import vllm.utils.nccl as vllm_nccl

    monkeypatch.setattr(vllm_nccl, "_unpinned_env", None)
    monkeypatch.setattr(vllm_nccl, "_nccl_has_no_cache", lambda: True)
    for name in ("NCCL_PROTO", "NCCL_ALGO", "NCCL_NO_CACHE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # inherited by the server: kill on timeout
    vllm_nccl.pin_nccl_env({"NCCL_PROTO": "Simple", "NCCL_ALGO": "ring,tree;allreduce:tree"})


def test_nccl_groups_abort_instead_of_killing_and_join_without_vllms_pins(nccl, batch_invariant_pins, monkeypatch):
    def join_all():
        port = free_port()
        workers = in_threads(lambda rank: connect("127.0.0.1", port, rank, 2, "nccl", 10, "init"), [1])
        connect("127.0.0.1", port, 0, 2, "nccl", 10, "init", pending_call=Future())
        workers["join"](10)
        return nccl.groups[-2:]

    for group in join_all():
        assert group.env["construction"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort, raise
        assert group.env["construction"]["TORCH_NCCL_ENABLE_MONITORING"] == "0"
        assert group.env["communicator init"]["NCCL_PROTO"] is None  # the launch values, as the trainer's
        assert group.env["communicator init"]["NCCL_ALGO"] is None
    # the process's own settings are back
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_ENABLE_MONITORING" not in os.environ
    assert os.environ["NCCL_PROTO"] == "Simple" and "NCCL_PROTO" in os.environ["NCCL_NO_CACHE"]

    # controls: a group built as before (no environment of its own) would tear the server down on a timeout, and
    # communicators created with the pins in place differ from the trainer's (a hang in the first collective)
    before = StandInProcessGroupNCCL(None, 5, 2, StandInProcessGroupNCCL.Options())
    assert before.env["construction"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.setattr(wire, "_unpinned_nccl_env", contextlib.nullcontext)
    assert all(group.env["communicator init"]["NCCL_PROTO"] == "Simple" for group in join_all())


def test_a_failure_on_any_worker_reaches_the_trainer_as_its_message_over_gloo():
    port = free_port()
    replies = {  # each round: every worker's reply; the trainer gets the one that matters
        1: [{"ok": True, "base_tensors": 4}, {"ok": False, "error": "first"}, {"ok": True, "dot": 1.0}],
        2: [{"ok": False, "error": "CUDA out of memory"}, {"ok": False, "error": "second"}, {"ok": True, "dot": 2.0}],
    }

    def worker(rank):
        group, store = connect("127.0.0.1", port, rank, 3, "gloo", 30, "init")
        return [exchange(group, "gloo", rank, 3, reply, "reply", store=store) for reply in replies[rank]]

    workers = in_threads(worker, [1, 2])
    group, store = connect("127.0.0.1", port, 0, 3, "gloo", 30, "init", pending_call=Future())
    with pytest.raises(WeightTransferError, match="the server's worker of rank 2 failed: CUDA out of memory"):
        recv_reply(group, "gloo", 3, "init", store=store)  # the failure of a worker that is not the first
    with pytest.raises(WeightTransferError, match="the server's worker of rank 1 failed: first"):
        recv_reply(group, "gloo", 3, "finish", store=store)  # two failures: the lowest rank's
    assert recv_reply(group, "gloo", 3, "finish", store=store) == {"ok": True, "dot": 1.0}  # none: the first worker's
    workers["join"](10)
    assert [source for source, _ in workers[2]] == [2, 1, 1]  # every worker saw the same outcome


def test_a_worker_that_cannot_take_part_in_an_update_fails_every_rank_naming_it_over_gloo():
    from merge.lora_merge import LoraMergeUpdateInfo, LoraMergeWeightTransferEngine

    port, engines = free_port(), {}  # the server keeps its engines (and their groups) past a failed call

    def worker(rank):
        engine = engines[rank] = object.__new__(LoraMergeWeightTransferEngine)  # the wire only: no vLLM model
        engine.transport, engine.rank, engine.world_size = "gloo", rank, 3
        engine.group, engine.trainer_store = connect("127.0.0.1", port, rank, 3, "gloo", 30, "init")
        buffers = {"float32": 8} if rank == 1 else {"float99": 8}  # rank 2 cannot allocate its buffer
        engine.receive_weights(LoraMergeUpdateInfo(entries=[], buffers=buffers))

    workers = in_threads(worker, [1, 2])
    group, store = connect("127.0.0.1", port, 0, 3, "gloo", 30, "init", pending_call=Future())
    work = wire.broadcast(group, torch.ones(8))
    # control: the broadcast does not complete without rank 2, and nothing else ends the wait
    control = in_threads(lambda _: wire.wait(work, "update", transport="gloo", pending_call=Future()), [0])
    time.sleep(1.0)
    assert 0 not in control
    start = time.monotonic()
    with pytest.raises(
        WeightTransferError, match="worker of rank 2 failed: lora_merge update: AttributeError.*float99"
    ):
        wire.wait(work, "update", transport="gloo", pending_call=Future(), store=store)  # the store: rank 2's failure
    assert time.monotonic() - start < 5
    workers["join"](10)
    assert workers[1] is None  # over gloo worker 1 receives from the trainer alone (over NCCL: rank 2's failure)
    assert "float99" in str(workers[2])
    engines.clear()  # rank 2's group closes: the broadcast left waiting fails, no thread outlives the test
    control["join"](10)
    assert 0 in control


def test_the_servers_failed_call_gives_way_to_the_failure_a_worker_posted():
    store = torch.distributed.PrefixStore(
        "lora_merge", torch.distributed.TCPStore("127.0.0.1", free_port(), 3, True, wait_for_workers=False)
    )
    call = Future()
    call.set_exception(RuntimeError("500 Internal Server Error for /update_weights"))
    with pytest.raises(RuntimeError, match="500 Internal Server Error"):  # control: nothing posted, the call's error
        wire.call_result(call, "lora_merge update", store)
    wire.post_failure(store, 2, "lora_merge update: torch.OutOfMemoryError: CUDA out of memory")
    wire.post_failure(store, 1, "lora_merge update: a later failure")  # the first posted stays
    expected = "lora_merge update: the server's worker of rank 2 failed: lora_merge update: torch.OutOfMemoryError"
    with pytest.raises(WeightTransferError, match=expected):
        wire.call_result(call, "lora_merge update", store)
    with pytest.raises(WeightTransferError, match=expected):  # and a wait that sees both prefers the worker's words
        wire.wait(
            NeverCompletes(), "lora_merge update", transport="nccl", group=NcclAbort(), pending_call=call, store=store
        )


class NcclAbort:
    def abort(self) -> None:
        pass


class TimedOut:
    """A collective past the group's timeout under CleanUpOnly: the watchdog aborted the communicators and set the
    work's exception (``isCompleted`` true, ``wait`` raises it) instead of ending the process."""

    def is_completed(self) -> bool:
        return True

    def wait(self):
        raise torch.distributed.DistBackendError(
            "Watchdog caught collective operation timeout: WorkNCCL(OpType=BROADCAST)"
        )


def test_a_collective_past_its_timeout_ends_as_a_weight_transfer_error_naming_it():
    wire.wait(Enqueued(), "lora_merge update", transport="nccl", group=NcclAbort())  # control: completed, no error
    with pytest.raises(WeightTransferError, match="lora_merge update: DistBackendError: Watchdog caught collective"):
        wire.wait(TimedOut(), "lora_merge update", transport="nccl", group=NcclAbort())


def test_a_worker_on_the_trainers_gpu_refuses_before_any_communicator_naming_it(nccl, monkeypatch):
    """NCCL refuses two ranks of one communicator on one GPU at its init; the worker refuses first, naming the GPU,
    and the trainer stops with its line. Control: each rank on a GPU of its own joins."""
    for ids, shared in (("own", False), ("shared", True)):
        monkeypatch.setattr(StandInProcessGroupNCCL, "groups", [])
        gpu = (lambda device: "GPU-0") if shared else (lambda device: f"GPU-{threading.current_thread().name}")
        monkeypatch.setattr(wire, "device_id", gpu)
        port = free_port()
        workers = in_threads(lambda rank: connect("127.0.0.1", port, rank, 2, "nccl", 10, "init"), [1])
        if not shared:
            connect("127.0.0.1", port, 0, 2, "nccl", 10, "init", pending_call=Future())
            workers["join"](5)
            assert len(nccl.groups) == 2, ids  # the control: both joined
            continue
        start = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"worker of rank 1 failed: init: it runs on the trainer's GPU"):
            connect("127.0.0.1", port, 0, 2, "nccl", 10, "init", pending_call=Future())
        assert time.monotonic() - start < 5
        assert all(g.rank == 0 and not g.ops for g in nccl.groups)  # the worker made none; no communicator exists
        workers["join"](5)
        assert isinstance(workers[1], WeightTransferError) and "GPU-0" in str(workers[1])
