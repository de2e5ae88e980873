"""grpo/tasks/python_tool.py: the sandboxed python(code) tool. Each limit with its control (the same kind of code
within the limit runs), the working directory of its own, the network, and a failure as the model's error result."""

import json
import os
import socket
import time

import pytest

from grpo.episodes.tools import ToolCaller
from grpo.tasks import python_tool
from grpo.tasks.python_tool import SandboxLimits, python, run_python

TIGHT = SandboxLimits(cpu_s=1, memory_mb=200, output_bytes=1000, wall_s=30.0)


def test_it_prints_what_the_code_prints():
    assert python("print(37 * 48)") == "1776\n"


def test_cpu_time_past_the_limit_kills_it():
    spin = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\nprint('done')"
    assert run_python(spin.format(s=0.2), TIGHT) == "done\n"  # the control: within the limit
    with pytest.raises(ValueError, match="killed at its CPU-time limit of 1 s"):
        run_python(spin.format(s=30), TIGHT)


def test_memory_past_the_limit_fails_the_allocation():
    assert run_python("b = bytearray(20 * 2**20); print(len(b))", TIGHT) == f"{20 * 2**20}\n"  # the control
    with pytest.raises(ValueError, match="(?s)exited with status 1; its output ends: .*MemoryError"):
        run_python("b = bytearray(400 * 2**20)", TIGHT)


def test_output_past_the_limit_is_cut_there_and_fails():
    assert run_python("print('x' * 500)", TIGHT) == "x" * 500 + "\n"  # the control
    with pytest.raises(ValueError, match="its output reached the limit of 1000 bytes") as failed:
        run_python("print('x' * 10**7)", TIGHT)
    assert len(str(failed.value)) < 700  # the error carries the output's end only
    with pytest.raises(ValueError, match="OSError: .*File too large"):  # any file it writes, the same limit
        run_python("open('big', 'w').write('y' * 10**6)", TIGHT)


def test_wall_time_past_the_limit_kills_it_and_what_it_started():
    limits = SandboxLimits(wall_s=1.0)
    assert run_python("import time; time.sleep(0.1); print('up')", limits) == "up\n"  # the control
    start = time.monotonic()
    code = "import subprocess, sys, time\n"
    code += "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    with pytest.raises(ValueError, match="killed after 1 s of wall time; its output ends: started") as killed:
        run_python(code + "print('started', child.pid, flush=True)\ntime.sleep(60)", limits)
    assert time.monotonic() - start < 10
    child = int(str(killed.value).split()[-1])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") and "Z" not in stat(child):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or "Z" in stat(child)  # gone (or a zombie awaiting its reaper)


def stat(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def test_it_runs_in_a_directory_of_its_own_removed_afterwards():
    code = "import os\nopen('note', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    first, second = run_python(code, TIGHT).splitlines(), run_python(code, TIGHT).splitlines()
    assert first[0] != second[0] and first[0] != os.getcwd()  # each call its own
    assert first[1] == "['.output', 'main.py', 'note']"
    assert not os.path.exists(first[0]) and not os.path.exists("note")


def test_no_network_where_the_os_allows_it():
    """A socket connection to a server listening on this machine: refused inside the sandbox, whose own loopback
    is down. The control: the same connection from this process. (On the machine the suite was written on, an
    unprivileged user namespace is allowed: NETWORK_ISOLATED is true there.)"""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', {port})))"
    try:
        assert socket.create_connection(("127.0.0.1", port), timeout=2)  # the control
        reached = run_python(code, TIGHT).strip() == "0"
    finally:
        server.close()
    # where the OS refuses the namespaces (NETWORK_ISOLATED false, a warning logged) the code reaches the host
    assert reached is not python_tool.NETWORK_ISOLATED


def test_a_failure_is_the_models_error_result():
    caller = ToolCaller({"python": python}, timeout_s=10.0, max_output_chars=2000)
    call = {"name": "python", "arguments": {"code": "print(1 / 0)"}}
    [(name, text, failed)] = caller.run([call])
    assert name == "python" and failed and "ZeroDivisionError" in json.loads(text)["error"]
    [(_, text, failed)] = caller.run([{"name": "python", "arguments": {"code": "print(6 * 7)"}}])
    assert (text, failed) == ("42\n", False)
