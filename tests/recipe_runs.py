"""Launching the GRPO recipe as a user does (`accelerate launch`, 2 processes, FSDP2 on gloo) on a small run: its
ranks forked from one process that holds the imports (tests/recipe_forks.py), or the launcher itself where a test is
about the launcher."""

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = [
    "max_steps=6",
    "per_device_train_batch_size=8",
    "steps_per_generation=2",
    "num_generations=4",
    "max_completion_length=24",
    "data.num_generated=256",
    "vllm.verify_sync=true",
    "learning_rate=5e-5",
    "eval_steps=null",
]

# The embedded model's fp32 run that several tests read instead of each launching its own (conftest.py's
# `reference_run`): 4 rollout steps, merged pushes, held-out evaluations before training, after optimizer step 4 and
# at the end, TensorBoard, top-p sampling, and the log-prob guard's floor below this model's own fp32 kernel
# difference (the first step's baseline sets the limit, and the run goes on).
REFERENCE_RUN = (
    "max_steps=8",
    "eval_steps=4",
    "report_to=[tensorboard]",
    "top_p=0.9",
    "vllm.max_logprob_diff=1e-9",
)

CPU_ACCELERATE_CONFIG = ROOT / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"


def recipe_argv(output_dir: Path, model: str, *overrides: str, config: str = "tiny_cpu.yaml") -> list[str]:
    """The recipe's arguments for a small run of ``model`` on ``config``."""
    return [
        "--config",
        str(ROOT / "recipes" / "configs" / config),
        f"model.name_or_path={model}",
        "model.build_tiny=null",
        f"output_dir={output_dir}",
        "run_name=run",
        *SMALL_RUN,
        *overrides,
    ]


def launch_command(
    output_dir: Path,
    model: str,
    *overrides: str,
    config: str = "tiny_cpu.yaml",
    accelerate_config: Path = CPU_ACCELERATE_CONFIG,
) -> list[str]:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config)]
    return [
        *launcher,
        str(ROOT / "recipes" / "grpo_qwen3_4b.py"),
        *recipe_argv(output_dir, model, *overrides, config=config),
    ]


def launch_env() -> dict[str, str]:
    """Offline, with this checkout's packages first and tests/ importable (for tests/faulty_rewards.py)."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


class Forks:
    """tests/recipe_forks.py's process for one kind of run, started once per pytest run: it holds the recipe's
    imports and runs each run sent to it in forks."""

    def __init__(self, launch_config: Path | None):
        env = launch_env()
        env["PYTHONPATH"] = f"{ROOT / 'recipes'}{os.pathsep}{env['PYTHONPATH']}"
        command = [sys.executable, str(ROOT / "tests" / "recipe_forks.py")]
        command += [] if launch_config is None else ["--launch", str(launch_config)]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        atexit.register(self.proc.kill)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def line(self, timeout: float | None) -> str | None:
        """Its next answer, or None if none comes within ``timeout`` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, "tests/recipe_forks.py ended"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()


_forks: dict[str, Forks] = {}


class ForkedRun:
    """A run sent to tests/recipe_forks.py, used as a ``Popen`` of its launcher: ``pid`` leads a session that holds
    the ranks (``os.killpg`` signals them all, as a scheduler would), ``poll()`` and ``wait()`` give its exit code."""

    def __init__(self, argv: list[str], out: Path, err: Path, timeout: int, launch_config, cwd=None, env=None):
        self.args, self.returncode = ["grpo_qwen3_4b.py", *argv], None
        self.forks = _forks.get(str(launch_config))
        if self.forks is None or self.forks.proc.poll() is not None:
            self.forks = _forks[str(launch_config)] = Forks(launch_config)
        request = dict(argv=argv, stdout=str(out), stderr=str(err), timeout=timeout, cwd=str(cwd or ROOT))
        self.forks.send(dict(request, env=env or {}))
        self.pid = int(self.forks.line(None))

    def poll(self) -> int | None:
        if self.returncode is None and (line := self.forks.line(0)) is not None:
            self.returncode = int(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self.forks.line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
        return self.returncode


def forked_run(argv: list[str], timeout: int, launch_config: Path | None = None, **run) -> subprocess.CompletedProcess:
    """The recipe with ``argv`` to its end (`ForkedRun`: one process, or with ``launch_config`` the processes of
    ``accelerate launch --config_file launch_config``); ``run``: its ``cwd`` and ``env`` (variables added)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = ForkedRun(argv, out, err, timeout, launch_config, **run).wait()
        return subprocess.CompletedProcess(["grpo_qwen3_4b.py", *argv], code, out.read_text(), err.read_text())


def forked_launch(log: Path, output_dir: Path, model: str, *overrides: str, config="tiny_cpu.yaml", **run):
    """The recipe under the CPU config's launcher, started (`ForkedRun`), its ranks' output into ``log``."""
    argv = recipe_argv(output_dir, model, *overrides, config=config)
    return ForkedRun(argv, log, log, 900, CPU_ACCELERATE_CONFIG, **run)


def run_recipe(output_dir: Path, *overrides: str, offline: bool = True, config: str = "tiny_cpu.yaml"):
    """The recipe as one plain process (no launcher), on the embedded default's config: for refusals, and for runs
    of one process. Each is a fork (`forked_run`: the imports take ~8 s a process otherwise); ``offline=False``
    (HF_HUB_OFFLINE unset: read at import time) is a process of its own."""
    argv = ["--config", str(ROOT / "recipes" / "configs" / config), f"output_dir={output_dir}", "run_name=run"]
    argv += overrides
    if offline:
        return forked_run(argv, timeout=300)
    env = launch_env()
    env.pop("HF_HUB_OFFLINE")
    command = [sys.executable, str(ROOT / "recipes" / "grpo_qwen3_4b.py"), *argv]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def read_lines(output_dir: Path) -> list[dict]:
    metrics_file = output_dir / "run" / "metrics.jsonl"
    return [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []


def read_metrics(output_dir: Path) -> list[dict]:
    """The lines of the run's rollout steps (the evaluation lines left out)."""
    return [line for line in read_lines(output_dir) if "reward_mean" in line]


def read_evals(output_dir: Path) -> list[dict]:
    return [line for line in read_lines(output_dir) if "eval_reward_greedy" in line]


def launch(
    output_dir: Path,
    model: str,
    *overrides: str,
    config: str = "tiny_cpu.yaml",
    accelerate_config: Path = CPU_ACCELERATE_CONFIG,
    env: dict | None = None,
):
    """Run the recipe to the end under ``accelerate launch --config_file accelerate_config``, ``env`` added to its
    environment; returns (the finished process, the metrics of its rollout steps). With the CPU config the ranks are
    forks (`forked_run`) with the launcher's environment; the tests of the launcher itself use `launch_command`."""
    if accelerate_config == CPU_ACCELERATE_CONFIG:
        argv = recipe_argv(output_dir, model, *overrides, config=config)
        proc = forked_run(argv, timeout=900, launch_config=accelerate_config, env=env)
    else:
        command = launch_command(output_dir, model, *overrides, config=config, accelerate_config=accelerate_config)
        environment = {**launch_env(), **(env or {})}
        proc = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900)
    return proc, read_metrics(output_dir)
