"""Processes and FSDP2 for the recipes, torchtitan-style: join the group, shard, reduce metrics by name.

`accelerate launch` (or torchrun) only starts the processes. `init_distributed` joins them (gloo on CPU, NCCL
on GPU) and `apply_fsdp` calls `fully_shard` on each decoder layer and then on the root, and checks that every
parameter ended up a DTensor: with an FSDP config on CPU, accelerate's own path starts processes that shard
nothing, without an error. What the accelerate config asks of FSDP reaches this module through the environment
`accelerate launch` exports (`FSDP_*`, `ACCELERATE_MIXED_PRECISION`): `fsdp_settings` honours
reshard_after_forward, offload_params, activation_checkpointing and mixed_precision, and refuses by name any
other setting the recipe would not carry out.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from grpo.config import ConfigError
from merge import decoder_layers


@dataclass(frozen=True)
class FSDPSettings:
    """The accelerate config's FSDP choices that the recipe carries out."""

    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    mixed_precision: str = "no"  # accelerate's mixed_precision: "no" or "bf16"


# accelerate's FSDP environment -> (the fsdp_config key the user wrote, values the recipe does as asked; None: unset)
_FIXED_BEHAVIOUR = {
    "FSDP_VERSION": ("fsdp_version", {None, "2"}),
    "FSDP_SHARDING_STRATEGY": ("fsdp_sharding_strategy", {None, "FULL_SHARD", "1"}),
    "FSDP_AUTO_WRAP_POLICY": ("fsdp_auto_wrap_policy", {None, "TRANSFORMER_BASED_WRAP"}),
    "FSDP_BACKWARD_PREFETCH": ("fsdp_backward_prefetch", {None, "BACKWARD_PRE"}),
    "FSDP_FORWARD_PREFETCH": ("fsdp_forward_prefetch", {None, "false"}),
    "FSDP_USE_ORIG_PARAMS": ("fsdp_use_orig_params", {None, "true"}),
    "FSDP_STATE_DICT_TYPE": ("fsdp_state_dict_type", {None, "FULL_STATE_DICT"}),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": ("fsdp_activation_checkpointing_offload", {None, "false"}),
    "FSDP_IGNORED_MODULES": ("fsdp_ignored_modules", {None}),
}
_WHY = {
    "fsdp_version": "this recipe shards with FSDP2 only: set `fsdp_version: 2`",
    "fsdp_sharding_strategy": "FSDP2 shards fully; for SHARD_GRAD_OP's behaviour set fsdp_reshard_after_forward: false",
    "fsdp_auto_wrap_policy": "the recipe shards each decoder layer, then the root (TRANSFORMER_BASED_WRAP)",
    "fsdp_backward_prefetch": "FSDP2 prefetches the next layer in the backward itself (BACKWARD_PRE)",
    "fsdp_forward_prefetch": "FSDP2's implicit forward prefetch is used",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_state_dict_type": "checkpoints hold the full LoRA adapter and optimizer state (small; world-size free)",
    "fsdp_activation_checkpointing_offload": "checkpointed activations stay on the device",
    "fsdp_ignored_modules": "every module is sharded",
}


def _flag(env, name: str, default: str) -> bool:
    return env.get(name, default).lower() == "true"


def fsdp_settings(env=os.environ) -> FSDPSettings:
    """What `accelerate launch` exported from the config's fsdp_config and mixed_precision (defaults without it).

    Refuses, naming the key and value, every FSDP setting the recipe would not carry out as written.
    """
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision not in ("no", "bf16"):
        raise ConfigError(
            f"accelerate config mixed_precision={precision!r} is not supported: use 'bf16' (bf16 compute, "
            "fp32 LoRA weights and gradient reduction) or 'no' (model.dtype decides; for fp16, 'no' with "
            "model.dtype=float16, which adds loss scaling)"
        )
    if env.get("ACCELERATE_USE_FSDP", "false") != "true":
        return FSDPSettings(mixed_precision=precision)
    ram_efficient = env.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    if ram_efficient is not None and ram_efficient.lower() in ("true", "1", "yes", "on"):
        # accelerate exports it as true when the YAML does not say; transformers then fills every weight with zeros
        # on each process whose LOCAL_RANK is not 0, for a broadcast that fully_shard never makes
        raise ConfigError(
            f"accelerate config fsdp_cpu_ram_efficient_loading={ram_efficient!r} is not supported "
            "(accelerate sets it true when the config does not name it): with it, transformers loads "
            "all-zero weights on every process but local rank 0. Set `fsdp_cpu_ram_efficient_loading: "
            "false` in the accelerate config's fsdp_config (every process reads the checkpoint)"
        )
    for variable, (key, accepted) in _FIXED_BEHAVIOUR.items():
        value = env.get(variable)
        if value not in accepted:
            raise ConfigError(f"accelerate config {key}={value!r} is not supported: {_WHY[key]}")
    return FSDPSettings(
        reshard_after_forward=_flag(env, "FSDP_RESHARD_AFTER_FORWARD", "true"),
        offload_params=_flag(env, "FSDP_OFFLOAD_PARAMS", "false"),
        activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING", "false"),
        mixed_precision=precision,
    )


# How long a rank waits for the others in a collective before the group gives up (torch's defaults: 10 min for NCCL,
# 30 for gloo). The longest legitimate wait is server mode's first sync: ranks 1..N wait for rank 0 in the sync's
# collective while the server's workers read their pristine base from the checkpoint (the connect, waited for up to
# `LoraMergeTrainerInitInfo.connect_timeout_s`, 30 min), then the factors travel and the server merges them (each
# HTTP call up to the sync's 600 s timeout): 50 minutes leave room for those and the gathers around them. A rank that
# fails in a sync tells the others at once (`ServerEngine.sync_policy`), so only a rank that hangs is waited for
# this long.
COLLECTIVE_TIMEOUT = timedelta(minutes=50)

# The oldest NVIDIA driver (Linux) that runs a CUDA build of each major version: NVIDIA's CUDA Toolkit release notes,
# "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility". torch 2.13.0 and vLLM
# 0.32.0 from PyPI are CUDA 13 builds.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def nvidia_driver_versions() -> list[str]:
    """The driver version `nvidia-smi` reports for each NVIDIA GPU of this machine; [] without nvidia-smi or GPUs."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def check_cuda_usable(env=os.environ) -> None:
    """Stop when this machine has NVIDIA GPUs that the installed CUDA build of torch cannot use.

    Without this, every rank of such a machine (typically: a driver older than the build's CUDA needs) would go on
    with gloo on the CPU, each loading the whole model. A CPU build of torch, a machine without NVIDIA GPUs, and GPUs
    hidden on purpose (CUDA_VISIBLE_DEVICES='' or accelerate's use_cpu) run on the CPU as before.
    """
    if torch.cuda.is_available() or torch.version.cuda is None:
        return
    hidden = env.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    if hidden or env.get("ACCELERATE_USE_CPU", "").lower() == "true":
        return
    drivers = nvidia_driver_versions()
    if not drivers:
        return
    cuda, found = torch.version.cuda, drivers[0]
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need and _version(found) < _version(need):
        why = f"NVIDIA driver {found} is older than CUDA {cuda} needs (>= {need})"
    else:
        why = (
            f"torch.cuda.is_available() is false with NVIDIA driver {found} (check CUDA_VISIBLE_DEVICES and the "
            "container's GPU access)"
        )
    raise ConfigError(
        f"this machine has {len(drivers)} NVIDIA GPU(s) that torch {torch.__version__} "
        f"(torch.version.cuda={cuda}) cannot use: {why}. Check with `nvidia-smi` (the driver version, "
        "and top right the newest CUDA it runs); update the driver, or install torch and vLLM builds "
        "for that CUDA. To run on the CPU instead, set CUDA_VISIBLE_DEVICES=''"
    )


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the processes the launcher started; returns (rank, world size, this rank's device).

    GPU when torch can use one; stops (`check_cuda_usable`) when NVIDIA GPUs are there but torch cannot use them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_cuda_usable()
    cuda = torch.cuda.is_available()
    if world > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo", device_id=device if cuda else None, timeout=COLLECTIVE_TIMEOUT
        )
        return dist.get_rank(), world, device
    return 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu")


def check_same_weights(model: torch.nn.Module, rank: int, world: int) -> str:
    """Stop unless every rank holds the same weights before sharding (a collective); returns their digest.

    One SHA-1 per parameter, gathered: ``fully_shard`` keeps each rank's own slice of whatever it was given, so a
    rank that loaded other weights (zeros under an unexpected launcher setting, another checkpoint) would train on
    them without an error. The first parameter that differs is named, with the ranks that differ.
    """
    digests = []
    for _, param in model.named_parameters():
        local = param.detach().cpu().contiguous()
        digests.append(hashlib.sha1(local.view(torch.uint8).numpy()).hexdigest())
    everyone = [digests] * world
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, digests)
    names = [name for name, _ in model.named_parameters()]
    for i, name in enumerate(names):
        differ = [r for r in range(world) if everyone[r][i] != everyone[0][i]]
        if differ:
            raise RuntimeError(
                f"rank(s) {differ} hold other weights than rank 0 for {name!r} before sharding "
                f"(first of the parameters that differ): FSDP2 would train on each rank's own copy. "
                "Every process must load the same checkpoint (is fsdp_cpu_ram_efficient_loading set?)"
            )
    return hashlib.sha1("".join(digests).encode()).hexdigest()


def fully_shard_kwargs(settings: FSDPSettings, param_dtype: torch.dtype) -> dict:
    """The arguments every `fully_shard` call gets: compute in ``param_dtype``, reduce gradients in fp32."""
    kwargs = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        reshard_after_forward=settings.reshard_after_forward,
    )
    if settings.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (before `apply_fsdp`, like torchtitan's apply_ac).

    transformers' own per-layer checkpointing, which keeps the parameter names (a checkpoint_wrapper would add
    `_checkpoint_wrapped_module.` to them); non-reentrant, so the recompute re-runs FSDP2's unshard hooks.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: torch.nn.Module, param_dtype: torch.dtype, settings: FSDPSettings = FSDPSettings()) -> None:
    """``fully_shard`` each decoder layer (the unit `merged_lora_params` unshards), then the root."""
    kwargs = fully_shard_kwargs(settings, param_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if unsharded:
        raise RuntimeError(f"{len(unsharded)} parameters are not sharded under FSDP2, e.g. {unsharded[:3]}")


def check_shared_output_dir(run_dir: Path, rank: int, world: int) -> None:
    """Every rank must see the files rank 0 writes into ``run_dir`` (a collective).

    Rank 0 alone writes the rollout adapter (lora.merge=false) and the checkpoints; on several nodes, output_dir
    must therefore be on a filesystem every node mounts. Rank 0 writes a token, every rank reads it back.
    """
    if world == 1:
        return
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token)
    marker = run_dir / ".shared_output_dir_check"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    dist.barrier()
    seen = marker.is_file() and marker.read_text() == token[0]
    views = [None] * world
    dist.all_gather_object(views, (seen, socket.gethostname()))
    dist.barrier()
    if rank == 0:
        marker.unlink()
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise ConfigError(
            f"output_dir: {run_dir} is not shared by all processes: {', '.join(blind)} cannot see the "
            f"files rank 0 (on {views[0][1]}) writes there. Rank 0 writes the checkpoints and the "
            "rollout adapter for every rank: put output_dir on a filesystem every node mounts"
        )


def _all_reduce(values: list[float], op) -> list[float]:
    if not dist.is_initialized() or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def reduce_across_ranks(
    sums: dict[str, float] | None = None, mins: dict[str, float] | None = None, maxs: dict[str, float] | None = None
) -> dict[str, float]:
    """Sum, min or max each named value over all ranks (one collective per kind); returns one dict of results."""
    out = {}
    for values, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN), (maxs, dist.ReduceOp.MAX)):
        if values:
            out.update(zip(values, _all_reduce([float(v) for v in values.values()], op)))
    return out


def gather_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D ``values``, concatenated (lengths may differ); the entropy quantile pools them, as TRL."""
    if not torch.distributed.is_initialized():
        return values
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, values.cpu())
    return torch.cat(everyone).to(values.device)
