"""The update section: two optimizer steps on a full-length mini-batch (per_device_train_batch_size x
(max_prompt_length + max_completion_length) tokens), and the peak GPU memory against the memory plan's update phase
for the same run (grpo/memory_plan.py, sharded, without vLLM)."""

from __future__ import annotations

import time

import torch

from bench.gpu_kit.policy import CONFIG, Trainer, mini_batch
from bench.gpu_kit.timing import synchronize
from grpo.config import load_config
from grpo.loss_scaling import DynamicLossScale
from grpo.memory_plan import GIB, memory_plan


def check_update(cfg, overrides: list[str], model_config, model, device: torch.device) -> dict:
    """Two optimizer steps on a full-length mini-batch: seconds per step, the peak memory against the plan."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(
        cfg,
        model,
        mini_batch(cfg, model_config.vocab_size, device, full_length=True, seed=1),
        DynamicLossScale(enabled=False),
    )
    synchronize(device)
    start = time.perf_counter()
    steps = [trainer.step() for _ in range(2)]
    synchronize(device)
    seconds = (time.perf_counter() - start) / len(steps)
    del trainer
    # the plan for this run: sharded by FSDP2 as on several GPUs, no vLLM (asleep, without CUDA graphs)
    no_engine = load_config(CONFIG, [*overrides, "vllm.enable_sleep_mode=true", "vllm.enforce_eager=true"])
    plan = memory_plan(model_config, no_engine, world=1, checkpointing=True, compute_dtype="bfloat16", sharded=True)
    out = dict(
        seconds_per_step=seconds,
        steps=steps,
        plan_update_gib=plan["phases"]["update"] / GIB,
        plan_terms_gib={k: v / GIB for k, v in plan["terms"].items()},
        tokens=cfg.per_device_train_batch_size * (cfg.data.max_prompt_length + cfg.max_completion_length),
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        out.update(
            peak_allocated_gib=peak / GIB,
            peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
            peak_over_plan=peak / plan["phases"]["update"],
        )
    return out
