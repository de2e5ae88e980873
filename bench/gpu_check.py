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

It prints one table and writes everything into --out (JSON). Nothing on its path imports vLLM. Each section is a
module of bench/gpu_kit/ (update.py, sync.py, attention.py, fp16.py), on the policy of bench/gpu_kit/policy.py.
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
from transformers import Qwen3Config

from bench.gpu_kit.attention import check_attention
from bench.gpu_kit.fp16 import check_fp16
from bench.gpu_kit.policy import CONFIG, ROOT, build_policy, join_group_of_one
from bench.gpu_kit.sync import check_sync
from bench.gpu_kit.update import check_update
from grpo.config import load_config
from grpo.memory_plan import GIB
from grpo.parallel import check_cuda_usable, nvidia_driver_versions
from grpo.provenance import provenance
from grpo.qwen3_4b_shape import QWEN3_4B, qwen3_4b_config

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
