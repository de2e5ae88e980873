"""The recipe's single-process runs of the tests, each in a fork of one process that has done the recipe's imports.

`tests/recipe_runs.py`'s `run_recipe` starts this once per pytest run and sends it each run: one JSON line on stdin,
{"argv": [...], "stdout": path, "stderr": path, "timeout": seconds}; this process forks, the child runs the recipe
as its command line would (`load_config_or_exit`, then `run_and_exit`) with its output in those files, and the exit
code comes back as one line. The imports (torch, transformers, peft: ~8 s a process on 2 CPU cores) are paid once;
this process itself never computes, so it starts no threads for a child to inherit. Runs that need the environment
at import time to differ (HF_HUB_OFFLINE unset) are not sent here.
"""

import json
import os
import signal
import sys
import time
import traceback

sys.argv = ["grpo_qwen3_4b.py"]
import grpo_qwen3_4b as recipe  # noqa: E402 - the recipe's slow imports, before any fork


def run_in_child(request: dict) -> None:
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    code = 1
    try:
        recipe.run_and_exit(recipe.load_config_or_exit(request["argv"]))
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else int(err.code is not None)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            run_in_child(request)
        deadline = time.monotonic() + request["timeout"]
        while (status := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if status[0] == 0:  # past its timeout
            os.kill(child, signal.SIGKILL)
            status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status[1]), flush=True)
