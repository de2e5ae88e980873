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

The backend's contract with vLLM 0.32 (its own weight-transfer tests check their backends' update infos alike): the
worker engines run in threads behind `InProcessServer`, vLLM's RL routes with its worker's bookkeeping of an update,
the model's reload stood in for.
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
        buffers = {"float32": 8} if rank == 1 else {"float32": 2**62}  # rank 2 cannot allocate its buffer
        engine.receive_weights(LoraMergeUpdateInfo(entries=[], buffers=buffers, round=3))

    workers = in_threads(worker, [1, 2])
    group, store = connect("127.0.0.1", port, 0, 3, "gloo", 30, "init", pending_call=Future())
    work = wire.broadcast(group, torch.ones(8))
    # control: the broadcast does not complete without rank 2, and nothing else ends the wait
    control = in_threads(lambda _: wire.wait(work, "update", transport="gloo", pending_call=Future()), [0])
    time.sleep(1.0)
    assert 0 not in control
    start = time.monotonic()
    with pytest.raises(
        WeightTransferError, match="worker of rank 2 failed: lora_merge update: RuntimeError.*4611686018427387904"
    ):  # the store of update 3: rank 2's failure
        wire.wait(work, "update", transport="gloo", pending_call=Future(), store=wire.round_store(store, 3))
    assert time.monotonic() - start < 5
    workers["join"](10)
    assert workers[1] is None  # over gloo worker 1 receives from the trainer alone (over NCCL: rank 2's failure)
    assert "4611686018427387904" in str(workers[2])
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


# ----------------------------------------------------------------------------- the backend's contract with vLLM
SHAPE = [4, 6]  # the one declared target, "w": its base is all ones


def update_info(**changes) -> dict:
    """A valid update of "w" (B: 4 x 2 at offset 0, A: 2 x 6 at offset 8 of one float32 buffer), with ``changes``."""
    entry = {"target": "w", "kind": "lora", "scale": 1.0, "transpose": False}
    entry.update(b=["float32", 0, [4, 2]], a=["float32", 8, [2, 6]])
    info = {"entries": [entry], "buffers": {"float32": 20}, "round": 1}
    for key, value in changes.items():
        (entry if key in entry else info)[key] = value
    return info


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"buffers": {"float99": 20}}, "buffer dtype 'float99' is not the name of a torch floating-point dtype"),
        ({"buffers": {"int8": 20}}, "buffer dtype 'int8'"),
        ({"buffers": {"float32": -1}}, "the float32 buffer's size -1 is not a non-negative integer"),
        (
            {"a": ["float32", 10, [2, 6]]},
            r"w: slot a=\['float32', 10, \[2, 6\]\] ends at 22, past the float32 buffer's 20",
        ),
        ({"b": ["bfloat16", 0, [4, 2]]}, r"w: slot b=\['bfloat16', 0, \[4, 2\]\] is not \[dtype of a buffer"),
        ({"b": ["float32", 0, [4, 3]]}, r"w: factors of shapes b=\[4, 3\], a=\[2, 6\] do not make B @ A"),
        ({"kind": "delta"}, "w: kind 'delta' is not one of"),
        ({"round": -2}, "update round=-2"),
    ],
)
def test_an_update_is_checked_before_anything_is_received_naming_the_bad_value(changes, named):
    from merge.lora_merge import LoraMergeUpdateInfo

    LoraMergeUpdateInfo(**update_info())  # the control: valid
    with pytest.raises(ValueError, match=named):
        LoraMergeUpdateInfo(**update_info(**changes))


class RecordingGroup:
    """A group that records the collectives issued on it (each completes at once)."""

    def __init__(self) -> None:
        self.issued: list[str] = []

    def broadcast(self, tensors, options=None) -> Enqueued:
        self.issued.append("broadcast")
        return Enqueued()


def worker_engine(rank: int = 1, workers: int = 1, quantization: str | None = None, **parallel):
    """The lora_merge worker engine over a stand-in vLLM config (``parallel``: ParallelConfig's fields)."""
    from types import SimpleNamespace

    from merge.lora_merge import LoraMergeWeightTransferEngine

    parallel_config = SimpleNamespace(data_parallel_index=0, world_size=workers, rank=rank - 1, **parallel)
    model_config = SimpleNamespace(dtype=torch.float32, quantization=quantization)
    config = SimpleNamespace(parallel_config=parallel_config, model_config=model_config)
    return LoraMergeWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Module())


def test_an_update_of_tensors_not_declared_at_init_is_refused_before_any_transfer():
    """Refused with a ValueError naming them, and posted for the trainer waiting in the broadcast; before, the
    worker received the update and served the base under the new version. Control: the declared target is received."""
    store = torch.distributed.PrefixStore(
        "lora_merge", torch.distributed.TCPStore("127.0.0.1", free_port(), 2, True, wait_for_workers=False)
    )
    engine = worker_engine()
    engine.group, engine.trainer_store, engine.targets = RecordingGroup(), store, {"w": SHAPE}
    undeclared = update_info(target="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="not declared at init_weight_transfer_engine: model.layers.0.mlp.up_proj"):
        engine.update_weights(undeclared)
    assert engine.group.issued == [] and engine.pending is None
    posted = wire._store_failure(wire.round_store(store, 1))
    assert "worker of rank 1 failed: lora_merge update: ValueError" in posted and "up_proj" in posted
    with pytest.raises(ValueError, match=r"w: the update makes it \[6, 4\], declared at init as \[4, 6\]"):
        engine.update_weights(update_info(transpose=True, round=2))  # a declared target in another shape
    engine.update_weights(update_info(round=3))  # the control
    assert engine.group.issued == ["broadcast"] and engine.pending is not None
    engine.buffers = {"float32": 20}  # declared at init: each update's buffers, dtype and size
    wider = update_info(buffers={"float32": 24}, round=4)  # every slot within its buffer, the buffer not the declared
    with pytest.raises(ValueError, match=r"buffers \{'float32': 24\} .* not those declared at init.*'float32': 20"):
        engine.update_weights(wider)
    assert engine.group.issued == ["broadcast"] and "float32': 24" in wire._store_failure(wire.round_store(store, 4))
    engine.update_weights(update_info(round=5))  # the control: the declared buffers
    assert engine.group.issued == ["broadcast", "broadcast"]


def test_a_failure_posted_in_one_update_ends_that_updates_waits_and_no_later_ones():
    """Before, the first failure a worker posted stayed in the connection's store: every later update on the same
    connection failed at once with that old message."""
    store = torch.distributed.PrefixStore(
        "lora_merge", torch.distributed.TCPStore("127.0.0.1", free_port(), 2, True, wait_for_workers=False)
    )
    wire.post_failure(wire.round_store(store, 1), 2, "lora_merge update: torch.OutOfMemoryError: CUDA out of memory")
    with pytest.raises(WeightTransferError, match="rank 2 failed: lora_merge update: torch.OutOfMemoryError"):
        wire.wait(NeverCompletes(), "update", transport="nccl", group=NcclAbort(), store=wire.round_store(store, 1))
    later = Enqueued()  # the next update's collective, completing after the store was looked at several times
    deadline = time.monotonic() + 3 * wire.PROBE_S
    later.is_completed = lambda: time.monotonic() > deadline
    wire.wait(later, "update", transport="nccl", group=NcclAbort(), store=wire.round_store(store, 2))


def test_the_backend_takes_no_draft_model_updates():
    """vLLM's worker retargets an engine whose class says so at a speculative draft model, which neither the pristine
    base nor the shards describe; vLLM's base class says it does (the control)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from merge.lora_merge import LoraMergeWeightTransferEngine

    assert WeightTransferEngine.supports_draft_weight_update is True
    assert LoraMergeWeightTransferEngine.supports_draft_weight_update is False


class InProcessServer:
    """vLLM 0.32's RL routes over lora_merge worker engines in this process (`worker_engine`): each call runs on every
    worker at once, as ``collective_rpc`` does, and fails with the first worker's error once all have ended. With
    vLLM's bookkeeping of an update (gpu_worker.py): ``start_weight_update`` refused while one is active, a failed
    ``update_weights`` ends it, a failed ``finish_weight_update`` leaves it active; and its label, set once finish
    returned on every worker (``RLOfflineMixin.finish_weight_update``). ``served``: what each worker's last reload
    loaded."""

    def __init__(self, monkeypatch, workers: int = 2, fail_reload: set | None = None, **parallel) -> None:
        from merge.lora_merge import LoraMergeWeightTransferEngine
        from merge.lora_merge import worker as lora_merge_worker

        self.engines = {rank: worker_engine(rank, workers, **parallel) for rank in range(1, workers + 1)}
        self.active = dict.fromkeys(self.engines, False)
        self.version, self.served, self.fail_reload = "0", {}, fail_reload if fail_reload is not None else set()
        self.calls: list[dict] = []  # every call's worker threads (`idle`)

        def reload(engine, weights):
            weights = dict(weights)  # the merge runs for real; the model's own reload is what is stood in for
            if engine.rank in self.fail_reload:
                self.fail_reload.discard(engine.rank)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            self.served[engine.rank] = weights

        monkeypatch.setattr(lora_merge_worker, "_reload", reload)
        base = lambda engine, targets, device: {name: torch.ones(shape) for name, shape in targets.items()}  # noqa
        monkeypatch.setattr(LoraMergeWeightTransferEngine, "_own_base", base)

    def _on_every_worker(self, call) -> None:
        results = in_threads(call, list(self.engines))
        self.calls.append(results)
        results["join"](30)
        errors = [results[rank] for rank in self.engines if isinstance(results.get(rank), Exception)]
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from merge.lora_merge import LoraMergeInitInfo

        self._on_every_worker(lambda rank: self.engines[rank].init_transfer_engine(LoraMergeInitInfo(**init_info)))

    def start_weight_update(self) -> None:
        def start(rank):
            if self.active[rank]:
                raise RuntimeError("start_weight_update called while a weight update is already active")
            self.engines[rank].start_weight_update()
            self.active[rank] = True

        self._on_every_worker(start)

    def update_weights(self, update_info: dict) -> None:
        def update(rank):
            try:
                self.engines[rank].update_weights(update_info)
            except BaseException:
                self.active[rank] = False
                raise

        self._on_every_worker(update)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        def finish(rank):
            if not self.active[rank]:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update")
            self.engines[rank].finish_weight_update()
            self.active[rank] = False

        self._on_every_worker(finish)
        if weight_version is not None:
            self.version = weight_version

    def idle(self, timeout: float = 30) -> None:
        """Wait for the workers of every call, a trainer that gave up on one included."""
        for results in self.calls:
            results["join"](timeout)

    def close(self) -> None:
        self.idle()
        for engine in self.engines.values():
            engine.shutdown()


def lora(seed: int, **changes):
    """An update of "w" (rank 2), as `lora_update` makes it from a peft model."""
    from merge.lora_merge import LoraUpdate

    generator = torch.Generator().manual_seed(seed)
    b, a = torch.randn(SHAPE[0], 2, generator=generator), torch.randn(2, SHAPE[1], generator=generator)
    update = LoraUpdate()
    update.add({"target": "w", "kind": "lora", "scale": 0.5, "transpose": False, **changes}, [b, a], SHAPE)
    return update, torch.ones(SHAPE) + 0.5 * b @ a


@pytest.fixture
def trainer_of(monkeypatch):
    """A lora_merge trainer driving an `InProcessServer`; ``send_weights`` takes a `LoraUpdate` in place of a model."""
    from merge.lora_merge import LoraMergeTrainer, LoraMergeTrainerInitInfo
    from merge.lora_merge import trainer as lora_merge_trainer

    monkeypatch.setattr(lora_merge_trainer, "lora_update", lambda update: update)
    made = []

    def make(server: InProcessServer) -> LoraMergeTrainer:
        info = LoraMergeTrainerInitInfo(rank=0, num_workers=len(server.engines), timeout_s=30, precision_stats=False)
        made.append((LoraMergeTrainer(client=server, init_info=info), server))
        return made[-1][0]

    yield make
    for trainer, server in made:
        trainer.shutdown()
        server.close()


def served(server: InProcessServer) -> dict:
    return {rank: weights["w"] for rank, weights in server.served.items()}


def test_a_retry_after_a_worker_failure_and_after_a_refused_update_succeeds(trainer_of, monkeypatch):
    """A worker that cannot allocate the update's buffer posts its failure; an update naming a tensor not declared at
    init is refused by every worker before the transfer. Each time the trainer stops naming it, gives up its group,
    and the next sync connects anew and lands, its label naming what is served. Before, the trainer kept a group with
    a broadcast still in flight and the failure stayed posted: the next sync failed at once with the old message."""
    from merge.lora_merge import LoraMergeWeightTransferEngine, WeightTransferError

    class OutOfMemoryOnce(LoraMergeWeightTransferEngine):
        fail = False

        @property
        def wire_device(self):
            if self.fail:
                self.fail = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().wire_device

    server = InProcessServer(monkeypatch)
    server.engines[2].__class__ = OutOfMemoryOnce
    trainer = trainer_of(server)
    update, first = lora(1)
    trainer.send_weights(update, weight_version="1")  # the control
    assert server.version == "1" and all(torch.allclose(w, first) for w in served(server).values())

    server.engines[2].fail = True
    with pytest.raises(WeightTransferError, match="worker of rank 2 failed: lora_merge update: OutOfMemoryError"):
        trainer.send_weights(lora(2)[0], weight_version="2")
    assert trainer.group is None and server.version == "1"
    assert all(torch.allclose(w, first) for w in served(server).values())
    start = time.monotonic()
    update, third = lora(3)
    trainer.send_weights(update, weight_version="3")  # the retry
    assert time.monotonic() - start < 10
    assert server.version == "3" and all(torch.allclose(w, third) for w in served(server).values())

    refused, _ = lora(4, target="model.layers.0.mlp.up_proj.weight")
    refused.shapes = {"w": SHAPE}  # what the trainer checks itself: the tensors the worker refuses come through
    with pytest.raises(WeightTransferError, match="ValueError: lora_merge: the update names 1 tensor.*up_proj"):
        trainer.send_weights(refused, weight_version="4")
    assert trainer.group is None and server.version == "3"
    update, fifth = lora(5)
    trainer.send_weights(update, weight_version="5")  # the retry
    assert server.version == "5" and all(torch.allclose(w, fifth) for w in served(server).values())


def test_an_update_not_as_declared_is_refused_by_the_trainer_naming_it_and_the_connection_stays(
    trainer_of, monkeypatch
):
    """The trainer checks each update against what its connect declared, before anything is sent: a tensor it did
    not declare, named; factors of another rank (the same targets, other buffers). Before, the first was refused
    without naming it, and the second was sent. Controls: the declared update lands, on the same connection after."""
    from merge.lora_merge import WeightTransferError

    server = InProcessServer(monkeypatch)
    trainer = trainer_of(server)
    trainer.send_weights(lora(1)[0], weight_version="1")  # the control
    group, calls = trainer.group, len(server.calls)
    wider, _ = lora(2)
    wider.add(
        {"target": "model.layers.0.mlp.up_proj.weight", "kind": "lora", "scale": 1.0, "transpose": False},
        [torch.ones(8, 2), torch.ones(2, 4)],
        [8, 4],
    )
    with pytest.raises(
        WeightTransferError, match=r"1 tensor\(s\) not declared at connect: model\.layers\.0\.mlp\.up_proj"
    ):
        trainer.send_weights(wider, weight_version="2")
    generator = torch.Generator().manual_seed(3)
    rank_3, _ = lora(3)
    rank_3.tensors = [torch.randn(SHAPE[0], 3, generator=generator), torch.randn(3, SHAPE[1], generator=generator)]
    with pytest.raises(WeightTransferError, match=r"buffers \{'float32': 30\} .* not those declared at connect"):
        trainer.send_weights(rank_3, weight_version="3")
    assert len(server.calls) == calls and trainer.group is group and server.version == "1"  # nothing was sent
    update, fourth = lora(4)
    trainer.send_weights(update, weight_version="4")  # the control, on the same connection
    assert trainer.group is group and server.version == "4"
    assert all(torch.allclose(w, fourth) for w in served(server).values())


def test_the_restore_after_a_failed_reload_runs_with_the_failed_reloads_tensors_freed(trainer_of, monkeypatch):
    """A reload that fails (out of memory on a GPU) leaves its merged tensors in its frames, and the update's
    buffers in the merge's: a restore run while the exception is being handled (its traceback holds those frames)
    would need that memory on top of its own. The worker restores after leaving the handler, the frames cleared:
    each failed reload's tensor and the update's buffers are freed when the restore's reload starts. Before, all
    were alive. Control: they were alive in the failed reload; the retry lands."""
    import weakref

    from merge.lora_merge import LoraMergeWeightTransferEngine, WeightTransferError
    from merge.lora_merge import worker as lora_merge_worker

    server = InProcessServer(monkeypatch, workers=1)
    trainer = trainer_of(server)
    trainer.send_weights(lora(1)[0], weight_version="1")
    stand_in, merged = lora_merge_worker._reload, LoraMergeWeightTransferEngine._merged
    held, alive_at_restore = [], []

    def merged_watched(engine, entries, buffers, stats):
        if not held:  # the failing update's buffers
            held.extend(weakref.ref(buffer) for buffer in buffers.values())
        return merged(engine, entries, buffers, stats)

    def reload(engine, weights):
        if len(held) == 1:  # the update's reload: its merged tensors in this frame, then out of memory
            weights = dict(weights)
            held.append(weakref.ref(weights["w"]))
            assert all(ref() is not None for ref in held)  # the control: alive while it runs
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if len(held) == 2:  # the restore's
            alive_at_restore.append([ref() is not None for ref in held])
        return stand_in(engine, weights)

    monkeypatch.setattr(lora_merge_worker, "_reload", reload)
    monkeypatch.setattr(LoraMergeWeightTransferEngine, "_merged", merged_watched)
    with pytest.raises(WeightTransferError, match="OutOfMemoryError.*serves the previous version again"):
        trainer.send_weights(lora(2)[0], weight_version="2")
    assert alive_at_restore == [[False, False]]  # the update's buffer and the failed reload's tensor: freed
    held.append(None)  # the retry's reload runs as the stand-in's
    update, third = lora(3)
    trainer.send_weights(update, weight_version="3")
    assert server.version == "3" and torch.allclose(served(server)[1], third)


def test_a_worker_count_other_than_the_servers_is_refused_by_the_workers_before_joining(trainer_of, monkeypatch):
    """A trainer whose client cannot ask the server its worker count (vLLM's own clients, a Ray actor's) and
    declares 3 to a server of 2: every worker refuses before joining, in the trainer's store, naming both counts,
    and the trainer stops at once. Before, the trainer waited for a third worker until the connect's timeout. The
    control: 2 declared connect."""
    from merge.lora_merge import LoraMergeTrainer, LoraMergeTrainerInitInfo, WeightTransferError

    monkeypatch.setattr(wire, "STORE_CONNECT_S", 2.0, raising=False)  # a worker joining when the trainer gives up
    server = InProcessServer(monkeypatch)
    assert not hasattr(server, "server_workers")
    info = LoraMergeTrainerInitInfo(rank=0, num_workers=3, timeout_s=30, connect_timeout_s=8, precision_stats=False)
    wrong = LoraMergeTrainer(client=server, init_info=info)
    with pytest.raises(
        WeightTransferError, match=r"rank \d failed: lora_merge init: the trainer declared 3 workers, the server has 2"
    ):
        wrong.send_weights(lora(1)[0], weight_version="1")
    server.idle()
    assert server.version == "0" and all(engine.group is None for engine in server.engines.values())
    trainer_of(server).send_weights(lora(1)[0], weight_version="1")  # the control: 2 declared
    assert server.version == "1"


def test_a_finish_that_fails_on_one_worker_leaves_every_worker_on_the_labelled_version(trainer_of, monkeypatch):
    """Worker 2's reload fails (out of memory) while worker 1's succeeds: vLLM keeps the previous label, so worker 1
    serves the previous version again and the retry rebuilds from it. Before, worker 1 kept serving the failed
    update's weights under the previous label, beside worker 2's previous ones."""
    from merge.lora_merge import WeightTransferError

    server = InProcessServer(monkeypatch)
    trainer = trainer_of(server)
    update, first = lora(1)
    trainer.send_weights(update, weight_version="1")
    server.fail_reload.add(2)
    with pytest.raises(WeightTransferError, match="worker of rank 2 failed: OutOfMemoryError: CUDA out of memory"):
        trainer.send_weights(lora(2)[0], weight_version="2")
    assert server.version == "1"
    assert all(torch.allclose(w, first) for w in served(server).values())  # worker 1 too: it restored version 1
    assert all(
        engine.applied is not None and engine.applied[0][0]["target"] == "w" for engine in server.engines.values()
    )
    update, third = lora(3)
    trainer.send_weights(update, weight_version="3")  # the control: every worker's finish succeeds
    assert server.version == "3" and all(torch.allclose(w, third) for w in served(server).values())


def test_sync_bytes_are_counted_as_the_broadcasts_send_them(trainer_of, monkeypatch):
    from merge.lora_merge import WeightTransferError
    from merge.lora_merge import trainer as lora_merge_trainer

    sent, send = [], lora_merge_trainer.broadcast

    def counting(group, tensor, root=0):
        sent.append(tensor.numel() * tensor.element_size())
        return send(group, tensor, root)

    monkeypatch.setattr(lora_merge_trainer, "broadcast", counting)
    trainer = trainer_of(InProcessServer(monkeypatch))
    update, _ = lora(1)
    trainer.send_weights(update, weight_version="1")
    first = sum(sent)
    assert first and trainer.last_sync["sync_bytes"] == first == update.nbytes
    refused, _ = lora(2, target="model.layers.0.mlp.up_proj.weight")
    refused.shapes = {"w": SHAPE}  # past the trainer's own check: the workers refuse it
    with pytest.raises(WeightTransferError, match="up_proj"):
        trainer.send_weights(refused, weight_version="2")
    assert trainer.last_sync["sync_bytes"] == first  # a failed update is no sync: the figure stays the last one's
    trainer.send_weights(lora(3)[0], weight_version="3")
    assert trainer.last_sync["sync_bytes"] == sent[-1] == first  # the next one's, counted alike


def test_a_server_with_expert_load_balancing_is_refused_at_connect_naming_the_flag(trainer_of, monkeypatch):
    """``--enable-eplb`` (and its redundant experts) moves experts between workers at runtime; each worker's shard of
    the base is fixed at connect. Control: the same server without it connects."""
    from types import SimpleNamespace

    from merge.lora_merge import WeightTransferError

    eplb = SimpleNamespace(num_redundant_experts=2)
    refused = trainer_of(InProcessServer(monkeypatch, enable_eplb=True, eplb_config=eplb))
    with pytest.raises(WeightTransferError, match=r"rank 1 failed: the server runs with --enable-eplb \(2 redundant"):
        refused.send_weights(lora(1)[0], weight_version="1")
    server = InProcessServer(monkeypatch, enable_eplb=False, eplb_config=SimpleNamespace())
    trainer_of(server).send_weights(lora(1)[0], weight_version="1")
    assert server.version == "1"


def test_a_quantizing_server_is_refused_at_connect_naming_the_flag(trainer_of, monkeypatch):
    """An online ``--quantization fp8`` of an unquantized checkpoint would quantize every merged update again.
    Control: the same server unquantized connects."""
    from merge.lora_merge import WeightTransferError

    refused = trainer_of(InProcessServer(monkeypatch, quantization="fp8"))
    with pytest.raises(WeightTransferError, match=r"rank 1 failed: the server quantizes its weights \(--quantization"):
        refused.send_weights(lora(1)[0], weight_version="1")
    server = InProcessServer(monkeypatch, quantization=None)
    trainer_of(server).send_weights(lora(1)[0], weight_version="1")
    assert server.version == "1"


@pytest.mark.parametrize("connect_timeout_s", [30.0, 1.0])
def test_joining_waits_for_the_base_read_under_its_own_timeout(monkeypatch, connect_timeout_s):
    """Every worker reads its base after joining, while the trainer waits for its reply: under ``connect_timeout_s``
    (a 32B base from network storage takes minutes), then each update under ``timeout_s``. A base read of 2.5 s with
    a 1 s update timeout: connects with the connect timeout; the control, a connect timeout of 1 s, times out."""
    from datetime import timedelta

    from merge.lora_merge import LoraMergeTrainer, LoraMergeTrainerInitInfo, LoraMergeWeightTransferEngine
    from merge.lora_merge import trainer as lora_merge_trainer

    monkeypatch.setattr(lora_merge_trainer, "lora_update", lambda update: update)
    server = InProcessServer(monkeypatch)
    read_base = LoraMergeWeightTransferEngine._own_base

    def slow_base(engine, targets, device):
        time.sleep(2.5)
        return read_base(engine, targets, device)

    monkeypatch.setattr(LoraMergeWeightTransferEngine, "_own_base", slow_base)
    info = LoraMergeTrainerInitInfo(
        rank=0, num_workers=2, timeout_s=1.0, connect_timeout_s=connect_timeout_s, precision_stats=False
    )
    trainer = LoraMergeTrainer(client=server, init_info=info)
    try:
        if connect_timeout_s < 2.5:
            with pytest.raises((WeightTransferError, RuntimeError), match="(?i)timed? ?out"):
                trainer.send_weights(lora(1)[0], weight_version="1")
            return
        trainer.send_weights(lora(1)[0], weight_version="1")
        assert server.version == "1"
        groups = [trainer.group] + [engine.group for engine in server.engines.values()]
        assert all(group.options._timeout == timedelta(seconds=1) for group in groups)  # updates: the short one
    finally:
        trainer.shutdown()
        server.close()


def test_a_trainer_declaring_another_worker_count_is_refused_before_joining_and_a_weight_source_is_not_ignored(
    trainer_of, monkeypatch
):
    """A trainer that declares 3 workers to a server of 2 would wait in the join for a rank that never comes, until
    the connect's timeout: it asks the server first (vLLM's ``/get_world_size``) and refuses, naming both counts,
    before any call. ``trainer_init`` refuses a weight source (vLLM's factory passes one; the backend sends the
    model's factors). Controls: the right count connects; no source builds the trainer."""
    from merge.lora_merge import LoraMergeTrainer, LoraMergeTrainerInitInfo, WeightTransferError

    server = InProcessServer(monkeypatch)
    server.server_workers = lambda: len(server.engines)  # what vLLM's /get_world_size answers
    info = LoraMergeTrainerInitInfo(rank=0, num_workers=3, timeout_s=30, precision_stats=False)
    wrong = LoraMergeTrainer.trainer_init(info, client=server)
    with pytest.raises(WeightTransferError, match=r"declared num_workers=3, the server has 2 workers"):
        wrong.send_weights(lora(1)[0], weight_version="1")
    assert server.version == "0" and all(engine.group is None for engine in server.engines.values())
    trainer_of(server).send_weights(lora(1)[0], weight_version="1")  # the control: 2 declared
    assert server.version == "1"
    with pytest.raises(ValueError, match="a weight source \\(object\\) is not taken"):
        LoraMergeTrainer.trainer_init(info, client=server, source=object())
