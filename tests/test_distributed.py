"""Checks with two processes (torchrun, gloo on CPU); what each rank asserts is in tests/distributed_checks.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(check: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env,
           "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "recipes"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "distributed_checks.py"), check, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(f"{check} OK") == 2, proc.stdout[-4000:]
    return proc


def test_gradient_checkpointing_keeps_loss_and_gradients_and_lowers_memory(tmp_path):
    torchrun("gradient_checkpointing", tmp_path, MALLOC_MMAP_THRESHOLD_="65536")  # RSS follows the live tensors


def test_fp32_adapters_on_a_bf16_base_learn_at_small_learning_rates(tmp_path):
    torchrun("bf16_adapters", tmp_path)


def test_a_per_node_output_dir_is_refused(tmp_path):
    torchrun("shared_output_dir", tmp_path)


@pytest.mark.usefixtures("tiny_model")
def test_every_rank_and_every_prompt_draws_its_own_samples(tmp_path, tiny_model):
    (tmp_path / "model").symlink_to(tiny_model)
    torchrun("sampling_streams", tmp_path)
