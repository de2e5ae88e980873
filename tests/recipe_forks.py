"""The recipe's runs of the tests, each in forks of one process that has done the recipe's imports.

`tests/recipe_runs.py` starts one such process per kind of run, once per pytest run, and sends it each run: one JSON
line on stdin, {"argv": [...], "stdout": path, "stderr": path, "timeout": s, "cwd": path, "env": {...}} (the last
two optional: the run's working directory, variables added to its environment). For each, this process forks a
launcher, which leads a session of its own (as a launcher started with ``start_new_session``) and forks the ranks;
they run the recipe as its command line would (`load_config_or_exit`, then `run_and_exit`) with their output in
those files. Two lines come back: the launcher's pid (to signal the session: ``os.killpg``), then its exit code.

- ``python tests/recipe_forks.py``: one rank, as ``python recipes/grpo_qwen3_4b.py`` runs; its own exit code.
- ``python tests/recipe_forks.py --launch CONFIG``: the processes ``accelerate launch --config_file CONFIG`` starts,
  each with the environment the launcher gives its rank (read from a real launch of this script with
  ``--environment``, before any import), their rendezvous on a free port hosted by rank 0 rather than the launcher.
  As torchrun's agent: SIGTERM, SIGINT or SIGHUP to the launcher goes on to the ranks; when one rank fails the others
  get SIGTERM; ranks still running 30 s after a SIGTERM get SIGKILL; the exit code is 0 when every rank succeeded,
  else 1.

The imports (torch, transformers, peft, vLLM: ~12 s a process on 2 CPU cores) are paid once; this process itself
never computes, so it starts no threads for a child to inherit. Runs that need the environment at import time to
differ (HF_HUB_OFFLINE unset) are not sent here.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

RANK_KEYS = ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE")
STOP_GRACE_S = 30  # torchrun's wait between the SIGTERM that stops the ranks and SIGKILL


def launcher_environments(config: str) -> list[dict[str, str]]:
    """Each rank's environment under ``accelerate launch --config_file config``, as the launcher sets it."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        subprocess.run([*command, __file__, "--environment", tmp], check=True, capture_output=True, timeout=120)
        files = sorted(os.listdir(tmp), key=int)
        return [json.loads(open(os.path.join(tmp, name)).read()) for name in files]


def run_rank(recipe, request: dict, environment: dict) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(request.get("cwd") or os.getcwd())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests stay this process's
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
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


def run_launcher(recipe, request: dict, rank_environments: list[dict], port: int) -> None:
    """The launcher of one run (a session of its own): forks the ranks, their rendezvous on ``port``, passes signals
    on, exits as torchrun."""
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    os.dup2(0, 1)  # this process's answers are the forking process's alone
    codes, kill_at = {}, None
    deadline = time.monotonic() + request["timeout"]
    errors = tempfile.mkdtemp()
    children = []
    for rank, environment in enumerate(rank_environments):
        environment = {**environment, **request.get("env", {})}
        if len(rank_environments) > 1:
            environment.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
            environment["TORCHELASTIC_ERROR_FILE"] = os.path.join(errors, f"{rank}.json")
        if (child := os.fork()) == 0:
            run_rank(recipe, request, environment)
        children.append(child)

    def stop(signum=signal.SIGTERM, frame=None):
        nonlocal kill_at
        kill_at = kill_at or time.monotonic() + STOP_GRACE_S
        for pid in children:
            if pid not in codes:
                os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    while len(codes) < len(children):
        for pid in children:
            if pid not in codes and (status := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(status[1])
        if kill_at is None and any(codes.values()):
            stop()
        timed_out = time.monotonic() > deadline
        if timed_out or (kill_at is not None and time.monotonic() > kill_at):
            for pid in children:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    shutil.rmtree(errors, ignore_errors=True)
    if timed_out:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(codes[children[0]] if len(children) == 1 else int(any(codes.values())))


def main() -> None:
    rank_environments = [dict(os.environ)]
    if "--launch" in sys.argv:
        rank_environments = launcher_environments(sys.argv[sys.argv.index("--launch") + 1])
        os.environ.clear()
        os.environ.update({k: v for k, v in rank_environments[0].items() if k not in RANK_KEYS})
    sys.argv = ["grpo_qwen3_4b.py"]
    import grpo_qwen3_4b as recipe  # the recipe's slow imports, before any fork
    import vllm  # noqa: F401 - imported by the recipe when its engine starts

    from bench.bench_common import free_port

    for line in sys.stdin:
        request = json.loads(line)
        if (launcher := os.fork()) == 0:
            run_launcher(recipe, request, rank_environments, free_port())
        print(launcher, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(launcher, 0)[1]), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--environment"]:  # under the launcher: this rank's environment, nothing imported
        with open(os.path.join(sys.argv[2], os.environ["RANK"]), "w") as f:
            json.dump(dict(os.environ), f)
    else:
        main()
