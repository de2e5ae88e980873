"""The GPU kit: the recipe's GPU-only parts, measured on one CUDA GPU without vLLM or a network (<= 20 minutes).

    PYTHONPATH=. python bench/gpu_check.py --out results/gpu_check.json  # one CUDA GPU: Qwen3-4B's shape
    PYTHONPATH=. python bench/gpu_check.py --smoke --out /tmp/check.json # CPU, gloo, tiny (the suite runs it)

One process joins a process group of one (NCCL on the GPU, gloo with --smoke) and shards, as the recipe does on
several GPUs, a randomly initialised model of Qwen3-4B's architecture (grpo/qwen3_4b_shape.py; no weights to
download) with the LoRA of recipes/configs/qwen3_4b_gsm8k.yaml under FSDP2 in bf16. It then measures:

  update      two optimizer steps of the GRPO loss on a full-length mini-batch (per_device_train_batch_size x
              (max_prompt_length + max_completion_length) tokens); the peak GPU memory against the memory plan's
              update phase for the same run (grpo/memory_plan.py, sharded, without vLLM)
  sync        merged_lora_params over the whole model (one decoder layer at a time, W + scale * B @ A) against a
              plain walk of the base weights (unshard / copy / reshard, no LoRA); and whether each row of B @ A on
              this device is the same whichever rows are computed together (what the row merge of several ranks
              relies on, merge/row_merge.py), for the first layer's LoRA Linears at 2, 4 and 8 ranks and in pieces of
              16 rows
  attention   packed log-probs and LoRA gradients on a packed mini-batch of unequal samples, forward + backward:
              packed_sdpa's per-sample loop, its varlen FlashAttention call (CUDA only), and transformers' sdpa
              (the T x T block-diagonal mask); time and max |delta| against the per-sample loop
  fp16        a few optimizer steps with model.dtype=float16 and dynamic loss scaling (grpo/loss_scaling.py)

It prints one table and writes everything into --out (JSON). Nothing on its path imports vLLM.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3Config

import padding.packed_attention as packed_attention
from grpo.config import config_to_dict, load_config
from grpo.loss import LossSettings, grpo_loss
from grpo.loss_scaling import DynamicLossScale
from grpo.memory_plan import GIB, memory_plan
from grpo.parallel import (
    FSDPSettings,
    apply_activation_checkpointing,
    apply_fsdp,
    check_cuda_usable,
    nvidia_driver_versions,
)
from grpo.provenance import provenance
from grpo.qwen3_4b_shape import QWEN3_4B, qwen3_4b_config
from merge import decoder_layers, merged_lora_params
from padding import packed_log_probs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"
# --smoke: the same code on a shape that runs in seconds on a CPU
SMOKE_OVERRIDES = [
    "per_device_train_batch_size=4",
    "data.max_prompt_length=12",
    "max_completion_length=20",
    "lora.r=8",
    "lora.lora_alpha=16",
    "padding.logprob_chunk_size=16",
]
SMOKE_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 1) -> tuple[float, object]:
    """(seconds per call, the last result): ``fn`` run ``repeats`` times after one warm-up call."""
    result = fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    sync(device)
    return (time.perf_counter() - start) / repeats, result


def environment(device: torch.device) -> dict:
    versions = {}
    for package in ("torch", "transformers", "peft", "accelerate", "vllm"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    info = dict(
        device=str(device), packages=versions, torch_cuda=torch.version.cuda, nvidia_drivers=nvidia_driver_versions()
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 2),
            capability=list(torch.cuda.get_device_capability(device)),
        )
    return info


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
    sync(device)
    start = time.perf_counter()
    steps = [trainer.step() for _ in range(2)]
    sync(device)
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


def plain_walk(model):
    """The base weights, copied group by group as merged_lora_params unshards them (no LoRA arithmetic)."""
    layers = decoder_layers(model)
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    for layer in layers:
        layer.unshard()
        yield from ((n, p.detach().clone()) for n, p in layer.named_parameters() if "lora_" not in n)
        layer.reshard()
    model.unshard()  # the root group: embedding (tied lm_head), final norm
    yield from (
        (n, p.detach().clone()) for n, p in model.named_parameters() if id(p) not in layer_params and "lora_" not in n
    )
    model.reshard()


def consume(weights) -> int:
    """Walk ``weights`` as a push would, dropping each tensor; returns the bytes seen."""
    total = 0
    for _, tensor in weights:
        total += tensor.numel() * tensor.element_size()
    return total


def row_products_equal(model, worlds=(2, 4, 8)) -> dict[str, bool]:
    """For each world size w: whether every rank's rows of ``B @ A`` (``B[k*c:(k+1)*c] @ A``, c = ceil(out / w)), for
    every LoRA Linear of the first decoder layer, equal those rows of the whole product bit for bit, in the factors'
    dtype and in bf16; and the same for pieces of ``MIN_ROWS`` rows, the fewest the row merge lets a rank merge (a piece
    with fewer rows is left out: the row merge unshard()s such a layer whole)."""
    from peft.tuners.lora import Linear as LoraLinear

    from merge.row_merge import MIN_ROWS

    def whole(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    pairs = []
    for module in decoder_layers(model)[0].modules():
        if isinstance(module, LoraLinear):
            a, b = (whole(f[module.active_adapters[0]].weight).detach() for f in (module.lora_A, module.lora_B))
            pairs += [(a, b), (a.bfloat16(), b.bfloat16())]
    chunks = {str(world): (lambda rows, world=world: -(-rows // world)) for world in worlds}
    chunks[f"{MIN_ROWS} rows"] = lambda rows: MIN_ROWS
    equal = {}
    for label, chunk_of in chunks.items():
        same = True
        for a, b in pairs:
            product, chunk = b @ a, chunk_of(b.shape[0])
            pieces = [k for k in range(0, b.shape[0], chunk) if min(chunk, b.shape[0] - k) >= MIN_ROWS]
            same &= all(torch.equal(b[k : k + chunk] @ a, product[k : k + chunk]) for k in pieces)
        equal[label] = same
    return equal


def check_sync(model, dtype: torch.dtype, device: torch.device) -> dict:
    merged_s, merged_bytes = timed(lambda: consume(merged_lora_params(model, dtype=dtype)), device)
    plain_s, plain_bytes = timed(lambda: consume(plain_walk(model)), device)
    return dict(
        merged_lora_params_s=merged_s,
        plain_walk_s=plain_s,
        merged_over_plain=merged_s / plain_s,
        merged_gib=merged_bytes / GIB,
        plain_gib=plain_bytes / GIB,
        row_products_equal=row_products_equal(model),
    )


def check_attention(cfg, model_config, model, device: torch.device) -> dict:
    """Packed log-probs and LoRA gradients (forward + backward) under each attention, against the per-sample loop."""
    batch = mini_batch(cfg, model_config.vocab_size, device, full_length=False, seed=2)
    base = model.get_base_model()
    modes = {"per_sample": ("packed_sdpa", False), "sdpa_mask": ("sdpa", True)}
    if device.type == "cuda":
        modes["varlen"] = ("packed_sdpa", True)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logps = packed_log_probs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["response_mask"],
            chunk_size=cfg.padding.logprob_chunk_size,
        )
        (-(logps * batch["response_mask"]).sum() / batch["response_mask"].sum()).backward()
        return logps.detach().float()

    results = {}
    try:
        for mode, (implementation, varlen) in modes.items():
            base.config._attn_implementation = implementation
            packed_attention.VARLEN_ON_CUDA = varlen
            seconds, logps = timed(forward_backward, device, repeats=2)
            results[mode] = dict(seconds=seconds, logps=logps, grads=lora_grads(model))
    finally:
        base.config._attn_implementation = "packed_sdpa"
        packed_attention.VARLEN_ON_CUDA = True
        model.zero_grad(set_to_none=True)
    reference = results["per_sample"]
    lengths = (batch["attention_mask"].sum(dim=1)).tolist()
    out = dict(samples=len(lengths), packed_tokens=int(sum(lengths)), longest=int(max(lengths)))
    for mode, result in results.items():
        out[mode] = dict(
            seconds=result["seconds"],
            speedup_over_per_sample=reference["seconds"] / result["seconds"],
            max_abs_delta_logps=(result["logps"] - reference["logps"]).abs().max().item(),
            max_abs_delta_lora_grad=max(
                (g - reference["grads"][n]).abs().max().item() for n, g in result["grads"].items()
            ),
            max_abs_lora_grad=max(g.abs().max().item() for g in result["grads"].values()),
        )
    return out


def check_fp16(cfg, model_config, device: torch.device, steps: int) -> dict:
    """``steps`` optimizer steps in fp16 with dynamic loss scaling, as the recipe with model.dtype=float16."""
    model = build_policy(cfg, model_config, torch.float16, device, seed=3)
    trainer = Trainer(
        cfg,
        model,
        mini_batch(cfg, model_config.vocab_size, device, full_length=False, seed=3),
        DynamicLossScale(enabled=True),
    )
    records = [trainer.step() for _ in range(steps)]
    return dict(
        steps=records,
        skipped_steps=trainer.loss_scale.skipped_steps,
        all_losses_finite=all(torch.isfinite(torch.tensor(r["loss"])) for r in records),
    )


SECTIONS = ("update", "sync", "attention", "fp16")


def failed_sections(report: dict) -> list[str]:
    return [name for name in SECTIONS if "error" in report[name]]


def table(report: dict) -> str:
    failed = failed_sections(report)
    if failed:
        return "\n".join(f"{name}: FAILED {report[name]['error']}" for name in failed)
    u, s, a, f = report["update"], report["sync"], report["attention"], report["fp16"]
    rows = [
        ("update: seconds per optimizer step", f"{u['seconds_per_step']:.2f} ({u['tokens']} tokens)"),
        (
            "update: peak allocated / plan",
            (f"{u['peak_allocated_gib']:.2f}" if "peak_allocated_gib" in u else "n/a (CPU)")
            + f" / {u['plan_update_gib']:.2f} GiB",
        ),
        (
            "sync: merged_lora_params / plain walk",
            f"{s['merged_lora_params_s']:.3f} / {s['plain_walk_s']:.3f} s (x{s['merged_over_plain']:.2f})",
        ),
        (
            "sync: rows of B @ A as in the whole, at 2/4/8 ranks/16 rows",
            "/".join(map(str, s["row_products_equal"].values())),
        ),
    ]
    for mode in ("per_sample", "varlen", "sdpa_mask"):
        if mode in a:
            m = a[mode]
            rows.append(
                (
                    f"attention {mode}: fwd+bwd s, max|d| logp, grad",
                    f"{m['seconds']:.3f} s (x{m['speedup_over_per_sample']:.2f}), {m['max_abs_delta_logps']:.2e}, "
                    f"{m['max_abs_delta_lora_grad']:.2e}",
                )
            )
        else:
            rows.append((f"attention {mode}", "not run (CUDA only)"))
    rows.append(
        (
            "fp16: losses finite, skipped, last scale",
            f"{f['all_losses_finite']}, {f['skipped_steps']}, {f['steps'][-1]['loss_scale']:g}",
        )
    )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="CPU (gloo) on a tiny shape: seconds, not minutes")
    parser.add_argument("--fp16-steps", type=int, default=4)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        device, overrides = torch.device("cpu"), SMOKE_OVERRIDES
        model_config = Qwen3Config(**{**QWEN3_4B, **SMOKE_SHAPE, "max_window_layers": 2})
    else:
        check_cuda_usable()
        if not torch.cuda.is_available():
            sys.exit("error: bench/gpu_check.py needs a CUDA GPU (--smoke runs its tiny CPU version)")
        device, overrides = torch.device("cuda", 0), []
        torch.cuda.set_device(device)
        model_config = qwen3_4b_config()
    cfg = load_config(CONFIG, overrides)
    report = dict(
        command=" ".join(["python", "bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        environment=environment(device),
        provenance=provenance(ROOT),
        config=str(CONFIG.relative_to(ROOT)),
        overrides=overrides,
        vllm_imported=sys.modules.get("vllm") is not None,
    )

    def section(name: str, measure) -> None:
        """One section: its figures, or its error (the other sections still run); the JSON is rewritten after each,
        so a run cut short keeps what it measured."""
        try:
            report[name] = measure()
        except Exception as error:  # a GPU's first run: one failing section must not cost the others
            traceback.print_exc()
            report[name] = dict(error=f"{type(error).__name__}: {error}")
        report["total_s"] = time.perf_counter() - started
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as store_dir:
        join_group_of_one(device, store_dir)
        try:
            model = build_policy(cfg, model_config, torch.bfloat16, device)
            report["parameters"] = sum(p.numel() for p in model.parameters())
            section("update", lambda model=model: check_update(cfg, overrides, model_config, model, device))
            section("sync", lambda model=model: check_sync(model, torch.bfloat16, device))
            section("attention", lambda model=model: check_attention(cfg, model_config, model, device))
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            section("fp16", lambda: check_fp16(cfg, model_config, device, args.fp16_steps))
        finally:
            dist.destroy_process_group()
    section("vllm_imported", lambda: sys.modules.get("vllm") is not None)
    print(table(report))
    print(f"total {report['total_s']:.0f} s; vLLM imported: {report['vllm_imported']}")
    failed = failed_sections(report)
    if failed:
        sys.exit(f"error: the section(s) {', '.join(failed)} failed (their errors are in the JSON and above)")
    return report


if __name__ == "__main__":
    main()
