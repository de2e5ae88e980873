"""What every section trains: the recipe's policy (FSDP2, the config's LoRA) on random weights, in a process group
of one, its mini-batches in the recipe's layout, and its update step."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from grpo.config import config_to_dict
from grpo.loss import LossSettings, grpo_loss
from grpo.loss_scaling import DynamicLossScale
from grpo.parallel import FSDPSettings, apply_activation_checkpointing, apply_fsdp
from padding import packed_log_probs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"


def join_group_of_one(device: torch.device, store_dir: str) -> None:
    """A process group of one (NCCL on the GPU, gloo on the CPU): FSDP2 then runs its collectives as on 8 GPUs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{store_dir}/store",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


def build_policy(cfg, model_config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random weights of ``model_config`` on ``device``, the config's LoRA (lora_B random too: every gradient is
    non-zero), activation checkpointing, FSDP2 with ``dtype`` compute and fp32 gradient reduction."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation="packed_sdpa")
    apply_activation_checkpointing(model)
    lora = {k: v for k, v in config_to_dict(cfg)["lora"].items() if k != "merge"}
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))  # fp32 adapter (peft's default)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3)
    apply_fsdp(model, dtype, FSDPSettings())
    return model


def mini_batch(cfg, vocab: int, device: torch.device, full_length: bool, seed: int) -> dict:
    """A mini-batch in the recipe's layout (prompts left-padded into P columns, responses right-padded into R):
    every sample at full length (the plan's worst case), or of unequal lengths (a packed row of unequal samples)."""
    generator = torch.Generator().manual_seed(seed)
    size, width_p, width_r = cfg.per_device_train_batch_size, cfg.data.max_prompt_length, cfg.max_completion_length
    if full_length:
        prompts, responses = [width_p] * size, [width_r] * size
    else:
        prompts = torch.randint(max(1, width_p // 4), width_p + 1, (size,), generator=generator).tolist()
        responses = torch.randint(max(1, width_r // 8), width_r + 1, (size,), generator=generator).tolist()
    ids = torch.randint(0, vocab, (size, width_p + width_r), generator=generator)
    attention_mask = torch.zeros(size, width_p + width_r, dtype=torch.long)
    response_mask = torch.zeros(size, width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention_mask[i, width_p - p : width_p + r] = 1
        response_mask[i, :r] = 1
    ids = ids * attention_mask
    advantages = torch.randn(size, generator=generator)
    return {
        k: v.to(device)
        for k, v in dict(
            input_ids=ids, attention_mask=attention_mask, response_mask=response_mask, advantages=advantages
        ).items()
    }


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


class Trainer:
    """The recipe's update step (grpo_qwen3_4b.update) on one mini-batch, with its loss and AdamW."""

    def __init__(self, cfg, model, batch: dict, loss_scale: DynamicLossScale):
        self.cfg, self.model, self.batch, self.loss_scale = cfg, model, batch, loss_scale
        self.settings = LossSettings.from_config(cfg, num_processes=1, vllm_importance_sampling_correction=False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.learning_rate)
        self.options = dict(temperature=cfg.temperature, chunk_size=cfg.padding.logprob_chunk_size)
        with torch.no_grad():
            model.eval()
            self.old = packed_log_probs(
                model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], **self.options
            )
        model.train()

    def step(self) -> dict:
        b = self.batch
        logps = packed_log_probs(self.model, b["input_ids"], b["attention_mask"], b["response_mask"], **self.options)
        loss, _ = grpo_loss(
            logps,
            self.old,
            b["advantages"],
            b["response_mask"],
            self.settings,
            num_items_in_batch=b["response_mask"].sum(),
        )
        self.loss_scale.scaled(loss).backward()
        finite = self.loss_scale.unscale_(self.trainable)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.max_grad_norm) if finite else None
        self.loss_scale.step(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        return dict(
            loss=loss.item(),
            finite=finite,
            grad_norm=None if grad_norm is None else grad_norm.item(),
            loss_scale=self.loss_scale.scale,
        )
