"""CPU twins of the GPU accelerate configs: each shipped YAML with only its device and process layout changed.

A twin keeps every `fsdp_*` key and `mixed_precision` of its GPU config and runs 2 processes on gloo, so
`accelerate launch` exports for it what it exports for the GPU config (checked), and the recipe's start-up and
four rollout steps run under exactly that environment. Twins that come out identical run once. Adding a YAML to
accelerate_configs/ adds its twin.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from bench_common import free_port
from recipe_runs import CPU_ACCELERATE_CONFIG, REFERENCE_RUN, ROOT, launch, launch_command, launch_env
from transformers import AutoModelForCausalLM

from grpo.parallel import check_same_weights, fsdp_settings

GPU_CONFIGS = sorted(p for p in (ROOT / "accelerate_configs").glob("*.yaml") if p != CPU_ACCELERATE_CONFIG)
LAYOUT_KEYS = (
    "num_machines",
    "num_processes",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "gpu_ids",
    "use_cpu",
)
TIMINGS = re.compile(r"(_s|_per_s|peak_mem_gb)$")


def cpu_twin(config: Path) -> dict:
    """``config`` on 2 CPU processes of one machine; everything else (fsdp_config, mixed_precision) as written."""
    twin = {k: v for k, v in yaml.safe_load(config.read_text()).items() if k not in LAYOUT_KEYS}
    return {**twin, "use_cpu": True, "num_machines": 1, "num_processes": 2, "machine_rank": 0}


def twins() -> dict[str, list[str]]:
    """Distinct twins (as YAML text) -> the GPU configs they stand for."""
    groups: dict[str, list[str]] = {}
    for config in GPU_CONFIGS:
        groups.setdefault(yaml.safe_dump(cpu_twin(config), sort_keys=True), []).append(config.stem)
    return groups


def exported_fsdp_envs(configs: list[Path], tmp_path: Path) -> list[dict]:
    """The FSDP_*/ACCELERATE_* environment `accelerate launch` gives a process (one process) for each of ``configs``;
    the launchers run side by side (each is ~3.5 s of imports on one core), each with a port of its own."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, json; print('ENV=' + json.dumps({k: v for k, v in os.environ.items() "
        "if k.startswith(('FSDP_', 'ACCELERATE_MIXED', 'ACCELERATE_USE_FSDP'))}))"
    )
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    launch += ["--machine_rank", "0"]
    launchers = [
        subprocess.Popen(
            [*launch, "--main_process_port", str(free_port()), "--config_file", str(config), str(probe)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        for config in configs
    ]
    envs = []
    for config, launcher in zip(configs, launchers):
        stdout, stderr = launcher.communicate(timeout=120)
        line = next((line for line in stdout.splitlines() if line.startswith("ENV=")), None)
        assert line, (config.name, stderr[-3000:])
        envs.append(json.loads(line[4:]))
    return envs


@pytest.fixture(scope="module")
def launch_envs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """GPU config name -> (what accelerate exports for it, what it exports for its CPU twin)."""
    tmp = tmp_path_factory.mktemp("twins")
    twin_files = []
    for config in GPU_CONFIGS:
        twin_files.append(tmp / f"{config.stem}-twin.yaml")
        twin_files[-1].write_text(yaml.safe_dump(cpu_twin(config)))
    envs = exported_fsdp_envs([*GPU_CONFIGS, *twin_files], tmp)
    return {config.name: (envs[i], envs[len(GPU_CONFIGS) + i]) for i, config in enumerate(GPU_CONFIGS)}


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=[c.stem for c in GPU_CONFIGS])
def test_a_twin_gets_the_launch_environment_of_its_gpu_config(config, launch_envs):
    env, twin_env = launch_envs[config.name]
    assert env == twin_env
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false", "accelerate would zero the weights of ranks != 0"
    settings = fsdp_settings(env)  # accepted as accelerate exports it
    assert settings.reshard_after_forward and not settings.offload_params, config.name


@pytest.mark.parametrize("twin_yaml", list(twins()), ids=["+".join(names) for names in twins().values()])
def test_the_recipe_under_each_twin_loads_the_real_weights_and_trains_as_the_cpu_config(
    twin_yaml, reference_run, tmp_path, tiny_model
):
    """The reference every twin must reproduce is the CPU config's run of the same settings (conftest.py's
    reference_run: its guard's floor is below this model's own fp32 kernel difference, so the first step's
    baseline sets the limit, and the run goes on)."""
    config = tmp_path / "twin.yaml"
    config.write_text(twin_yaml)
    proc, metrics = launch(tmp_path, tiny_model, *REFERENCE_RUN, accelerate_config=config)
    assert proc.returncode == 0, proc.stderr[-5000:]
    log = (tmp_path / "run" / "train.log").read_text()
    plain = check_same_weights(AutoModelForCausalLM.from_pretrained(tiny_model), rank=0, world=1)
    assert f"base weights identical on all 2 process(es) before sharding (sha1 {plain})" in log
    reference_dir, _, reference = reference_run
    baseline = reference[0]["rollout_logprob_diff_mean"]
    assert (
        baseline > 1e-9
        and f"the run stops above {10 * baseline:.3g}" in (reference_dir / "run" / "train.log").read_text()
    )
    assert len(metrics) == len(reference) == 4
    for twin_line, cpu_line in zip(metrics, reference):
        deterministic = {k for k in cpu_line if not TIMINGS.search(k)}
        assert {k: twin_line[k] for k in deterministic} == {k: cpu_line[k] for k in deterministic}


def test_a_config_that_leaves_out_fsdp_cpu_ram_efficient_loading_is_refused_by_name(tmp_path):
    """accelerate then exports it as true, and transformers would load zeros on every process but local rank 0."""
    data = yaml.safe_load(CPU_ACCELERATE_CONFIG.read_text())
    del data["fsdp_config"]["fsdp_cpu_ram_efficient_loading"]
    config = tmp_path / "without_the_key.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        launch_command(tmp_path, "unused", accelerate_config=config),
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours == [
        "error: accelerate config fsdp_cpu_ram_efficient_loading='true' is not supported (accelerate "
        "sets it true when the config does not name it): with it, transformers loads all-zero weights "
        "on every process but local rank 0. Set `fsdp_cpu_ram_efficient_loading: false` in the "
        "accelerate config's fsdp_config (every process reads the checkpoint)"
    ], proc.stderr[-3000:]
