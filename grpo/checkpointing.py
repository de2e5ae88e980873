"""Checkpoints of a LoRA GRPO run: written atomically, resumed exactly, in Hugging Face Trainer's layout.

    <run_dir>/checkpoint-<global_step>/
        adapter_config.json, adapter_model.safetensors  peft `save_pretrained` layout (peft and vLLM load it)
        optimizer.pt        the optimizer's full (unsharded) state, keyed by parameter name
        scheduler.pt        the LR scheduler's state
        rng_state.pth       Python, numpy and torch RNG states, one entry per rank
        trainer_state.json  rollout_step, global_step (optimizer steps), data position, world size
        config.yaml         the run's resolved config (a resume must not quietly change it)

Every file is written by rank 0 into ``checkpoint-<N>.tmp`` and the folder is renamed into place only when
complete, so a crash or a full disk while saving leaves the previous checkpoints as they were. The state is
gathered to full tensors first (LoRA states are small), so a checkpoint does not depend on the world size.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from grpo.config import ConfigError

CHECKPOINT_PREFIX = "checkpoint-"
# Keys a resume may change: where things go, how long to run, how the rollout engine is set up.
RESUMABLE_CHANGES = {
    "output_dir",
    "run_name",
    "max_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "model.build_tiny",
    "eval_steps",
    "report_to",
    "vllm",
}


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success it replaces ``final``, on error it is removed.

    The previous ``final`` (if any) stays on disk until the new one is complete.
    """
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def full_adapter_state(model) -> dict[str, torch.Tensor]:
    """The LoRA tensors in peft's saved names, gathered to full size on every rank (a collective under FSDP2)."""
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            state[name] = tensor.detach().to("cpu", copy=True)
    return get_peft_model_state_dict(model, state_dict=state)


def adapter_param_names(model) -> dict[str, str]:
    """peft's saved adapter names -> the model's parameter names (peft drops the adapter name when saving)."""
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    saved = get_peft_model_state_dict(model, state_dict={name: torch.tensor(i) for i, name in enumerate(trainable)})
    return {key: trainable[int(index)] for key, index in saved.items()}


def write_adapter(model, state: dict[str, torch.Tensor], folder: Path) -> None:
    """peft `save_pretrained` layout from an already gathered state."""
    model.peft_config["default"].save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))


def save_adapter(model, out_dir: Path, rank: int) -> None:
    """Save the adapter in peft's layout (collective; rank 0 writes, atomically)."""
    state = full_adapter_state(model)
    _on_rank0(rank, lambda: _write_atomically(out_dir, lambda tmp: write_adapter(model, state, tmp)))


def _write_atomically(final: Path, write) -> None:
    with atomic_dir(final) as tmp:
        write(tmp)


def _on_rank0(rank: int, action) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed (no rank is left waiting in a collective)."""
    error = None
    if rank == 0:
        try:
            action()
        except Exception as err:  # re-raised below, on every rank
            error = err
    failed = torch.tensor([float(error is not None)])
    if dist.is_initialized():
        failed = failed.cuda() if dist.get_backend() == "nccl" else failed  # NCCL reduces GPU tensors only
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError("rank 0 failed to write a checkpoint (its log says why)")


def rng_state() -> dict:
    """This process's RNG states: Python's, numpy's and torch's (CPU, and CUDA when present). The engine samples
    from them: vLLM 0.32's GPU model runner (V2) draws each request's sampling seed from numpy's global RNG."""
    state = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints written before numpy's state was saved
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_path(run_dir: Path, global_step: int) -> Path:
    return run_dir / f"{CHECKPOINT_PREFIX}{global_step}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first (``.tmp`` leftovers of a failed save are not listed)."""
    found = [
        p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def save_checkpoint(
    run_dir: Path,
    model,
    optimizer,
    scheduler,
    trainer_state: dict,
    config: dict,
    rank: int,
    save_total_limit: int | None,
) -> Path:
    """Write ``checkpoint-<global_step>`` (collective); then keep only the newest ``save_total_limit``."""
    adapter = full_adapter_state(model)
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rng = rng_state()
    rngs = [None] * dist.get_world_size() if dist.is_initialized() else [rng]
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    final = checkpoint_path(run_dir, trainer_state["global_step"])

    def write(tmp: Path) -> None:
        write_adapter(model, adapter, tmp)
        torch.save(optim, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rngs, tmp / "rng_state.pth")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def write_and_rotate() -> None:
        _write_atomically(final, write)
        if save_total_limit:
            for stale in list_checkpoints(run_dir)[:-save_total_limit]:
                shutil.rmtree(stale)

    _on_rank0(rank, write_and_rotate)
    return final


def resolve_checkpoint(value: str, run_dir: Path) -> Path:
    """``resume_from_checkpoint``: a checkpoint folder, or ``last`` for the newest one in the run's folder."""
    if value == "last":
        found = list_checkpoints(run_dir)
        if not found:
            raise ConfigError(f"resume_from_checkpoint=last, but {run_dir} holds no {CHECKPOINT_PREFIX}<N> folder")
        return found[-1]
    path = Path(value)
    missing = [
        f for f in ("trainer_state.json", "optimizer.pt", "adapter_model.safetensors") if not (path / f).is_file()
    ]
    if missing:
        raise ConfigError(f"resume_from_checkpoint={value!r} is not a complete checkpoint (missing {missing})")
    return path


def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs, less those a resume may change."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        dotted = prefix + key
        if dotted in RESUMABLE_CHANGES:
            continue
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, dotted + ".")
        elif old != new:
            changes.append(f"{dotted}: {old!r} -> {new!r}")
    return changes


def check_resumable(path: Path, config: dict) -> None:
    """Refuse a resume whose config differs from the checkpoint's beyond what a resume may change."""
    changes = config_changes(yaml.safe_load((path / "config.yaml").read_text()), config)
    if changes:
        raise ConfigError(
            f"resume_from_checkpoint={str(path)!r} was made with another config: {'; '.join(changes)}. "
            "Resume with the same settings (only output/run names, max_steps, save_*, eval_steps, "
            "report_to and vllm.* may change)"
        )


def load_checkpoint(path: Path, model, optimizer, scheduler, config: dict, rank: int) -> dict:
    """Restore adapter, optimizer, scheduler and this rank's RNG states; return the saved trainer state."""
    check_resumable(path, config)
    saved = load_file(str(path / "adapter_model.safetensors"))
    names = adapter_param_names(model)
    if set(saved) != set(names):
        raise ConfigError(
            f"{path}: the saved adapter does not fit this model (differing tensors: "
            f"{sorted(set(saved) ^ set(names))[:3]})"
        )
    adapter = {names[key]: tensor for key, tensor in saved.items()}
    set_model_state_dict(model, adapter, options=StateDictOptions(full_state_dict=True, strict=False))
    optim = torch.load(path / "optimizer.pt", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim, options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    state = json.loads((path / "trainer_state.json").read_text())
    rngs = torch.load(path / "rng_state.pth", weights_only=False)
    if rank < len(rngs):
        set_rng_state(rngs[rank])
    return state
