"""The run's folder, <output_dir>/<run_name>/: which one (a new run never writes over an earlier run's checkpoints, a
resumed run continues in its own), whether output_dir can hold it, and what it holds from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path

import yaml

from grpo.checkpointing import check_resumable, list_checkpoints, resolve_checkpoint
from grpo.config import RecipeConfig, config_to_dict
from grpo.provenance import record_provenance


def free_run_name(output_dir: str, run_name: str) -> str:
    """``run_name``, or else the first of ``run_name-2``, ``run_name-3``, ... whose folder holds no checkpoint.

    Every rank finds the same name: no rank writes a checkpoint before all of them have passed start-up.
    """
    name, number = run_name, 1
    while list_checkpoints(Path(output_dir) / name):
        number += 1
        name = f"{run_name}-{number}"
    return name


def run_folder(cfg: RecipeConfig) -> Path:
    """<output_dir>/<run_name>/ as an absolute path, taken at start-up: every file the run writes is under it, so a
    tool or library that changes the working directory mid-run changes nothing of where they go."""
    return Path(os.path.abspath(Path(cfg.output_dir) / cfg.run_name))


def resume_or_new_run(cfg: RecipeConfig) -> tuple[RecipeConfig, Path | None, dict]:
    """(config, checkpoint, its trainer state): the checkpoint that resume_from_checkpoint names, or for a new run
    none and the config with a run_name whose folder holds no earlier run's checkpoints."""
    named_dir = Path(cfg.output_dir) / cfg.run_name
    resume = resolve_checkpoint(cfg.resume_from_checkpoint, named_dir) if cfg.resume_from_checkpoint else None
    resume = Path(os.path.abspath(resume)) if resume else None  # compared with the run's absolute checkpoint paths
    if resume is None:  # a new run never writes over an earlier run's checkpoints
        cfg = dataclasses.replace(cfg, run_name=free_run_name(cfg.output_dir, cfg.run_name))
    if resume:
        check_resumable(resume, config_to_dict(cfg))
    resumed_state = json.loads((resume / "trainer_state.json").read_text()) if resume else {}
    return cfg, resume, resumed_state


def start_run_dir(cfg: RecipeConfig, rank: int, resume: Path | None, resumed_rollout_step: int) -> Path:
    """Create <output_dir>/<run_name>/ (rank 0), route the log into its train.log; on resume, trim metrics.jsonl
    and timeline.jsonl."""
    run_dir = run_folder(cfg)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
    )
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (run_dir / "train.log").write_text("")
        # mode "a": importing vLLM closes existing handlers (logging.config.dictConfig); "a" reopens, "w" would not
        logging.getLogger().addHandler(logging.FileHandler(run_dir / "train.log", mode="a"))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        record_provenance(run_dir / "provenance.json", resumed=bool(resume))
        # a resumed run keeps the rollout steps up to its checkpoint and redoes the rest (evaluations from the
        # checkpoint's weights on, too: they come again after the first sync)
        for lines_file in (run_dir / "metrics.jsonl", run_dir / "timeline.jsonl"):
            earlier = lines_file.read_text().splitlines() if resume and lines_file.exists() else []
            kept = [line for line in earlier if keep_on_resume(json.loads(line), resumed_rollout_step)]
            if kept or lines_file.name == "metrics.jsonl":
                lines_file.write_text("".join(line + "\n" for line in kept))
            else:
                lines_file.unlink(missing_ok=True)
    return run_dir


def keep_on_resume(line: dict, resumed_rollout_step: int) -> bool:
    """Whether a metrics.jsonl / timeline.jsonl line stays on resume: an evaluation at the checkpoint's own step is
    done again, on the weights the first sync hands the engine."""
    if any(key.startswith("eval_") for key in line):
        return line["rollout_step"] < resumed_rollout_step
    return line["rollout_step"] <= resumed_rollout_step


def output_dir_problem(path: str) -> str | None:
    """What keeps this process from writing runs into ``path``, or None."""
    output_dir = Path(path)
    if output_dir.exists() and not output_dir.is_dir():
        return f"output_dir={path!r} is a file, not a folder"
    made = [folder for folder in (output_dir, *output_dir.parents) if not folder.exists()]  # deepest first
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        writable = os.access(output_dir, os.W_OK | os.X_OK)
    except OSError as error:
        return f"output_dir={path!r} cannot be created: {error.strerror or error}"
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None if writable else f"output_dir={path!r} is not writable by this process"
