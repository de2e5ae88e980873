"""Run by tests/test_server_mode.py under torchrun (2 processes, gloo): `ServerEngine.sync_policy` with the lora_merge
trainer replaced by a stand-in. A sync that succeeds gives every rank rank 0's figures; in the next, rank 0's side
raises a plain RuntimeError (as a TCPStore that cannot bind, or an out-of-memory while packing the factors, would).
Each rank writes what it raised, and how long it took, to OUT_DIR/rank<r>.json. Then a first sync of a fresh engine
in which rank 1 cannot ask the server its world size: whether any rank went on to the factors' gather
(`send_weights`, FSDP2's all-gathers) goes to OUT_DIR/first_sync_rank<r>.json.

    torchrun --standalone --nproc_per_node 2 tests/server_sync_worker.py OUT_DIR
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun import finish_worker

from grpo.engines.server import ServerEngine, ServerError
from grpo.parallel import COLLECTIVE_TIMEOUT, init_distributed

WAIT_FOR_RANK_1_S = 30  # rank 0 stays up this long: torchrun would end rank 1 once rank 0 exits


class Transfer:
    """`LoraMergeTrainer` as `ServerEngine._sync_merged` drives it; rank 0 fails once ``fail`` is set."""

    def __init__(self, rank: int) -> None:
        self.rank, self.fail, self.gathered = rank, False, False
        self.last_sync = {"sync_bytes": 8.0}

    def send_weights(self, model, weight_version=None) -> dict:
        self.gathered = True  # where every rank enters FSDP2's all-gathers of the factors
        if self.rank == 0 and self.fail:
            raise RuntimeError("injected: the TCPStore could not bind\n(address already in use)")
        return {"sync_delta_kept": 1.0} if self.rank == 0 else {}


def main(out: Path) -> None:
    rank, world, _ = init_distributed()
    assert world == 2 and dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout == COLLECTIVE_TIMEOUT
    engine = object.__new__(ServerEngine)  # the sync's client side only: no server behind it
    engine.merge, engine.rank, engine.url, engine.version = True, rank, "http://127.0.0.1:1", None
    engine.transfer = Transfer(rank)
    engine._answers = lambda: True  # the server is up and answers: the failure is rank 0's own, not the server gone
    assert engine.sync_policy(None, None, version=1, rank=rank) == {"sync_delta_kept": 1.0, "sync_bytes": 8.0}

    engine.transfer.fail = True
    start = time.monotonic()
    try:
        engine.sync_policy(None, None, version=2, rank=rank)
        raised = None
    except Exception as error:  # noqa: BLE001 - the test reads it
        raised = error
    seconds = time.monotonic() - start
    figures = {"type": type(raised).__name__, "bases": [c.__name__ for c in type(raised).__mro__], "seconds": seconds}
    figures.update(message=str(raised), version=engine.version)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    if rank == 0:  # rank 1 must end on its own, not because this process exits
        deadline = time.monotonic() + WAIT_FOR_RANK_1_S
        while not (out / "rank1.json").exists():
            assert time.monotonic() < deadline, f"rank 1 still waits {WAIT_FOR_RANK_1_S} s after rank 0's failure"
            time.sleep(0.1)
    first_sync(rank, out)
    print(f"rank {rank}: sync failure OK", flush=True)
    finish_worker()


def first_sync(rank: int, out: Path) -> None:
    """A fresh engine's first sync: rank 1's /get_world_size fails (the server refused it), rank 0's answers."""
    from merge.lora_merge import LoraMergeTrainer

    transfers = []

    def connect(cls, url, **settings):
        transfers.append(Transfer(settings["rank"]))
        return transfers[-1]

    LoraMergeTrainer.connect = classmethod(connect)
    engine = object.__new__(ServerEngine)
    engine.merge, engine.rank, engine.url, engine.version = True, rank, "http://127.0.0.1:1", None
    engine.timeout, engine.wire_dtype, engine.precision_stats, engine.base_on_device = 60.0, None, False, False
    engine.pause_mode, engine.transfer = "wait", None
    engine._answers = lambda: True

    def get(path):
        if rank == 1:
            raise ServerError(f"GET {engine.url}{path} -> 503: injected")
        return {"world_size": 1}

    engine._get = get
    start = time.monotonic()
    try:
        engine.sync_policy(None, None, version=1, rank=rank)
        raised = None
    except Exception as error:  # noqa: BLE001 - the test reads it
        raised = error
    figures = dict(
        type=type(raised).__name__,
        message=str(raised),
        seconds=time.monotonic() - start,
        gathered=any(t.gathered for t in transfers),
        version=engine.version,
    )
    (out / f"first_sync_rank{rank}.json").write_text(json.dumps(figures))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
