"""A sandboxed Python tool: ``grpo.tasks.python_tool:python`` in a config's `tools`.

    python("print(37 * 48)")  ->  "1776\n"

The model's code is untrusted. It runs in a child process (``python -I``: no user site, no PYTHON* variables, the
working directory not on sys.path) in a temporary directory of its own, removed afterwards, with the kernel's limits
set before it starts (`LIMITS`) by a small launcher interpreter that then executes it (not by a ``preexec_fn``
in the trainer's own fork: that runs in a copy of the trainer's address space, gigabytes with vLLM loaded, where
any allocation after the memory limit fails, and Python warns it can deadlock in a process with threads):
- CPU time (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later;
- memory (RLIMIT_AS, its address space): an allocation past it fails (MemoryError);
- output (RLIMIT_FSIZE): stdout and stderr go to one file in its directory, and a write past the limit fails
  (EFBIG: Python ignores SIGXFSZ), so the output never grows past it; every file it writes is bounded the same
  way; no core file (RLIMIT_CORE 0);
- wall time: past it the process group is killed (a sleep uses no CPU time);
- no network where the OS allows: a user namespace with a network namespace of its own (unshare(2) with
  CLONE_NEWUSER | CLONE_NEWNET, no root needed where unprivileged user namespaces are enabled), whose only interface,
  lo, is down. Where unshare is refused, the code runs with the host's network and `NETWORK_ISOLATED` says so (a
  warning is logged once).
Every failure (an exception in the code, a limit reached, a timeout) raises ValueError with what happened and the
end of the output, which the rollout gives the model as the call's error result (`grpo.episodes.tools`); the run
goes on. The timeouts are below tool_calling.timeout_s's default (10 s), so the sandbox's own limit ends a call
first and its process is killed rather than abandoned.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000  # linux/sched.h


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 3  # CPU seconds
    memory_mb: int = 1024  # address space (the interpreter itself takes ~30 MB of it)
    output_bytes: int = 16_000  # stdout and stderr together, and any one file it writes
    wall_s: float = 5.0  # seconds, whatever the process does


LIMITS = SandboxLimits()


# Run by a fresh `python -I -c`: the limits (argv: CPU s, memory bytes, output bytes), the namespaces where asked
# (argv: 1), the memory limit last (it bounds this small interpreter too), then the program in its place.
LAUNCHER = f"""
import ctypes, os, resource, sys
cpu, memory, output, isolate = (int(value) for value in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if isolate and ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWUSER | CLONE_NEWNET}) != 0:
    sys.exit("unshare(CLONE_NEWUSER | CLONE_NEWNET) refused: errno " + str(ctypes.get_errno()))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[5:]])
"""


def _launch_command(limits: SandboxLimits, isolate: bool, *program: str) -> list[str]:
    memory = limits.memory_mb * 2**20
    numbers = (limits.cpu_s, memory, limits.output_bytes, int(isolate))
    return [sys.executable, "-I", "-c", LAUNCHER, *map(str, numbers), *program]


def _network_isolation_works() -> bool:
    """Whether this machine lets an unprivileged process take a network namespace of its own (tried once)."""
    probe = "import socket; print(len(socket.if_nameindex()))"
    try:
        done = subprocess.run(_launch_command(LIMITS, True, "-c", probe), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == "1"  # lo alone


NETWORK_ISOLATED = _network_isolation_works()
if not NETWORK_ISOLATED:
    log.warning("python tool: this OS refuses unshare(CLONE_NEWUSER | CLONE_NEWNET); its code has the host's network")


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout and stderr).

    Args:
        code: the program, e.g. "print(37 * 48)"
    """
    return run_python(code, LIMITS)


def run_python(code: str, limits: SandboxLimits) -> str:
    """``code`` in a sandboxed child process under ``limits``; its output, or ValueError naming what went wrong."""
    if not isinstance(code, str):
        raise ValueError(f"python: code must be a string, not {type(code).__name__}")
    workdir = tempfile.mkdtemp(prefix="python-tool-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as program:
            program.write(code)
        with open(os.path.join(workdir, ".output"), "w+b") as output:
            returncode = _run(workdir, output, limits)
            output.seek(0)
            raw = output.read(limits.output_bytes + 1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = raw.decode("utf-8", errors="replace")
    problem = _problem(returncode, limits)
    if len(raw) >= limits.output_bytes:  # Python ignores SIGXFSZ: its write past the limit failed (EFBIG) instead
        problem = f"its output reached the limit of {limits.output_bytes} bytes"
    if problem is not None:
        tail = text[-500:].strip()
        raise ValueError(f"python: {problem}" + (f"; its output ends: {tail}" if tail else ""))
    return text


def _run(workdir: str, output, limits: SandboxLimits) -> int | None:
    """The child's exit status (negative: the signal that ended it), None when the wall-time limit killed it."""

    env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    process = subprocess.Popen(
        _launch_command(limits, NETWORK_ISOLATED, "main.py"),
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a timeout kills whatever it started too
        close_fds=True,
    )
    try:
        return process.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def _problem(returncode: int | None, limits: SandboxLimits) -> str | None:
    """What ended the child, in words; None for a clean exit."""
    if returncode is None:
        return f"killed after {limits.wall_s:g} s of wall time"
    if returncode == 0:
        return None
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"killed at its CPU-time limit of {limits.cpu_s} s"
    if returncode == -signal.SIGXFSZ:
        return f"killed at its output limit of {limits.output_bytes} bytes"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"
