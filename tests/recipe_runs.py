"""Launching the GRPO recipe as a user does (`accelerate launch`, 2 processes, FSDP2 on gloo) on a small run."""

import atexit
import json
import os
import subprocess
import sys
import tempfile
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


def launch_command(
    output_dir: Path,
    model: str,
    *overrides: str,
    config: str = "tiny_cpu.yaml",
    accelerate_config: Path = CPU_ACCELERATE_CONFIG,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config),
        str(ROOT / "recipes" / "grpo_qwen3_4b.py"),
        "--config",
        str(ROOT / "recipes" / "configs" / config),
        f"model.name_or_path={model}",
        "model.build_tiny=null",
        f"output_dir={output_dir}",
        "run_name=run",
        *SMALL_RUN,
        *overrides,
    ]


def launch_env() -> dict[str, str]:
    """Offline, with this checkout's packages first and tests/ importable (for tests/faulty_rewards.py)."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


_forks: dict[str, subprocess.Popen] = {}


def forked_run(argv: list[str], timeout: int, launch_config: Path | None = None) -> subprocess.CompletedProcess:
    """The recipe with ``argv`` in forks of tests/recipe_forks.py's process for its kind of run (one per pytest run,
    which holds the recipe's imports): one process, or with ``launch_config`` the processes of ``accelerate launch
    --config_file launch_config``."""
    kind = [] if launch_config is None else ["--launch", str(launch_config)]
    forks = _forks.get(str(launch_config))
    if forks is None or forks.poll() is not None:
        env = launch_env()
        env["PYTHONPATH"] = f"{ROOT / 'recipes'}{os.pathsep}{env['PYTHONPATH']}"
        command = [sys.executable, str(ROOT / "tests" / "recipe_forks.py"), *kind]
        forks = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _forks[str(launch_config)] = forks
        atexit.register(forks.kill)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        forks.stdin.write(json.dumps(dict(argv=argv, stdout=str(out), stderr=str(err), timeout=timeout)) + "\n")
        forks.stdin.flush()
        answer = forks.stdout.readline()
        assert answer, "tests/recipe_forks.py ended"
        return subprocess.CompletedProcess(["grpo_qwen3_4b.py", *argv], int(answer), out.read_text(), err.read_text())


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
):
    """Run the recipe to the end under ``accelerate launch --config_file accelerate_config``; returns (the finished
    process, the metrics of its rollout steps). With the CPU config the ranks are forks (`forked_run`) with the
    launcher's environment; the tests of the launcher itself and of signals to it use `launch_command`."""
    command = launch_command(output_dir, model, *overrides, config=config, accelerate_config=accelerate_config)
    if accelerate_config == CPU_ACCELERATE_CONFIG:
        proc = forked_run(command[command.index("--config") :], timeout=900, launch_config=accelerate_config)
    else:
        proc = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    return proc, read_metrics(output_dir)
