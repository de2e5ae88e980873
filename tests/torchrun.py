"""A test's worker script under torchrun: 2 processes (gloo on CPU), this checkout first on the path, offline."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "recipes", ROOT / "bench")),
}


def torchrun(
    worker: str,
    *args: str,
    ok_marker: str | None = None,
    timeout: int = 600,
    base_env: dict | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node 2 tests/<worker> <args>``; given ``ok_marker``, asserts that it
    succeeded and that both ranks printed it (each worker prints it after its own assertions passed). The environment
    is ``base_env`` (default: this process's), plus WORKER_ENV, plus ``env``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests" / worker),
        *args,
    ]
    environment = {**(os.environ if base_env is None else base_env), **WORKER_ENV, **env}
    proc = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-4000:])
    if ok_marker is not None:
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert proc.stdout.count(ok_marker) == 2, proc.stdout[-4000:]
    return proc


# tests/distributed_checks.py's checks, run in one torchrun (conftest.py's `two_process_checks`): those that measure
# memory first, in fresh processes; the vLLM engine's last (its shutdown may take the default process group with it)
TWO_PROCESS_CHECKS = [
    "fsdp2_merge_worker:checks",
    "gradient_checkpointing",
    "test_padding_memory:checks",
    "fsdp2_precision_worker:checks",
    "fsdp2_moe_merge_worker:checks",
    "bf16_adapters",
    "same_weights",
    "shared_output_dir",
    "sampling_streams",
]


def passed(run: subprocess.CompletedProcess, check: str) -> None:
    """``check`` of `TWO_PROCESS_CHECKS` printed its OK on both ranks (else: its traceback, or the one that ended
    the processes before it)."""
    ok = run.stdout.count(f"{check} OK")
    assert ok == 2, f"{check}: OK on {ok} of 2 ranks\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}"


def vllm_workers(workers: list[str], out_dir: Path, timeout: int = 600) -> dict[str, dict | str]:
    """``python tests/vllm_workers.py`` running each of ``workers`` (scripts with ``main(out)``, an in-process vLLM
    engine each) one after another in one process: the engines are built afresh, the ~10 s of imports paid once.
    Returns worker -> the JSON figures it wrote, or the reason it has none (its traceback, or not run: an earlier
    worker failed and took the process with it)."""
    outs = {worker: out_dir / f"{Path(worker).stem}.json" for worker in workers}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_workers.py"), *(f"{w}:{out}" for w, out in outs.items())],
        env={**os.environ, **WORKER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(proc.stdout[-4000:])
    return {
        worker: json.loads(out.read_text())
        if out.exists()
        else f"{worker}: no figures (exit code {proc.returncode})\n{proc.stderr[-6000:]}"
        for worker, out in outs.items()
    }


def figures_of(runs: dict[str, dict | str], worker: str) -> dict:
    """``worker``'s figures from `vllm_workers`; a worker that wrote none fails the test with its reason."""
    figures = runs[worker]
    assert isinstance(figures, dict), figures
    print(figures)
    return figures


def finish_worker() -> None:
    """The end of a worker whose checks all passed: leave the process group, flush, and exit without the
    interpreter's teardown. Workers on this CPU stack now and then abort in that teardown, after every check
    passed ("terminate called without an active exception", SIGABRT: 2 of ~30 worker runs in three fresh-clone
    suite runs), which would fail a test that has nothing wrong."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
