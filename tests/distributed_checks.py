"""Checks that need several processes: `torchrun --standalone --nproc_per_node 2 THIS CHECK[,CHECK...] [TMP]`.

A CHECK is a function of this module, ``check(rank, tmp)``, or ``module:function`` of another test module (the FSDP2
workers of tests/test_merge.py, test_merge_moe.py and test_padding_memory.py: ``checks(rank)``). All of them run in
one pair of processes (each launch costs ~10 s of imports; conftest.py's `two_process_checks`): each asserts on every
rank, in a folder of its own (TMP/<check>), and prints "<CHECK> OK" at the end; the first that fails prints its
traceback and ends both processes (a rank that skipped a collective would leave the other waiting in it), so the
checks after it are not run.
"""

import importlib
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from bench_common import rss_peak_during, with_random_lora
from qwen3_lora import tiny_qwen3
from torchrun import finish_worker

from grpo.checkpointing import full_adapter_state
from grpo.parallel import apply_activation_checkpointing, apply_fsdp, check_same_weights, check_shared_output_dir
from merge import merged_lora_params
from padding import packed_log_probs


def packed_batch(rank: int, rows: int, length: int, vocab: int = 128):
    """A left-padded-prompt / right-padded-response batch, different on each rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, : length // 4] = 0  # one left-padded prompt
    response_mask = torch.ones(rows, length // 2, dtype=torch.long)
    response_mask[1, -length // 8 :] = 0  # one short response
    mask[1, -length // 8 :] = 0
    return ids, mask, response_mask


def loss_and_lora_grads(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    logps = packed_log_probs(model, *batch)
    loss = -(logps * batch[2]).sum() / batch[2].sum()
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def gradient_checkpointing(rank: int, tmp: Path) -> None:
    """Same loss and LoRA gradients with and without checkpointing each decoder layer; lower peak memory with it."""
    results = {}
    for checkpointing in (False, True):
        model = with_random_lora(tiny_qwen3(layers=4, hidden=256), rank=8, lora_b_std=0.1)
        if checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, torch.float32)
        model.train()
        batch = packed_batch(rank, rows=4, length=256)
        loss_and_lora_grads(model, batch)  # warm-up: lazy FSDP state, first-touch pages
        peaks = [rss_peak_during(lambda: loss_and_lora_grads(model, batch)) for _ in range(3)]
        results[checkpointing] = dict(result=peaks[0][0], peak=statistics.median(p for _, p in peaks))
    (loss_plain, grads_plain), (loss_ckpt, grads_ckpt) = results[False]["result"], results[True]["result"]
    assert grads_plain and set(grads_plain) == set(grads_ckpt)
    assert abs(loss_plain - loss_ckpt) <= 1e-6, (loss_plain, loss_ckpt)
    worst = max((grads_plain[n] - grads_ckpt[n]).abs().max().item() for n in grads_plain)
    assert worst <= 1e-6, f"LoRA gradients differ by {worst} with gradient checkpointing"
    peak_plain, peak_ckpt = results[False]["peak"], results[True]["peak"]
    print(
        f"rank {rank}: loss {loss_plain:.6f}, max |grad diff| {worst:.1e}; peak extra RSS of forward+backward "
        f"{peak_plain / 2**20:.1f} MiB without checkpointing, {peak_ckpt / 2**20:.1f} MiB with"
    )
    assert peak_ckpt < 0.8 * peak_plain, (peak_ckpt, peak_plain)


def train_steps(model, rank: int, steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        batch = packed_batch(rank + 10 * step, rows=2, length=32)
        logps = packed_log_probs(model, *batch)
        (-(logps * batch[2]).sum() / batch[2].sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def bf16_adapters(rank: int, tmp: Path) -> None:
    """bf16 base + fp32 LoRA (FSDP2 bf16 compute, fp32 reduce): small-lr steps land and track an fp32 run."""
    from peft import LoraConfig, get_peft_model

    def build(base_dtype, adapter_dtype_follows_base: bool):
        torch.manual_seed(0)
        return get_peft_model(
            tiny_qwen3(dtype=base_dtype, hidden=128),
            LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            autocast_adapter_dtype=not adapter_dtype_follows_base,
        )

    def lora_a(model) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().float().clone() for n, p in model.named_parameters() if "lora_A" in n}

    def changed_fraction(after, before) -> float:
        return sum(int((after[n] != before[n]).sum()) for n in after) / sum(t.numel() for t in after.values())

    runs = {}
    for name, base, follows, compute in (
        ("fp32", torch.float32, False, torch.float32),
        ("bf16 base, fp32 LoRA", torch.bfloat16, False, torch.bfloat16),
        ("bf16 base, bf16 LoRA", torch.bfloat16, True, torch.bfloat16),
    ):
        model = build(base, follows)
        apply_fsdp(model, compute)
        before = lora_a(model)
        train_steps(model, rank, steps=4, lr=1e-5)
        after = lora_a(model)
        runs[name] = dict(model=model, moved=changed_fraction(after, before), lora_a=after, before=before)
    reference, mixed, pure = runs["fp32"], runs["bf16 base, fp32 LoRA"], runs["bf16 base, bf16 LoRA"]

    def update(run) -> torch.Tensor:
        return torch.cat([(run["lora_a"][n] - run["before"][n]).flatten() for n in sorted(run["lora_a"])])

    ours, wanted = update(mixed), update(reference)
    relative = ((ours - wanted).norm() / wanted.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(ours, wanted, dim=0).item()
    print(
        f"rank {rank}: lora_A entries changed: {reference['moved']:.1%} (fp32), {mixed['moved']:.1%} (bf16 base, "
        f"fp32 LoRA), {pure['moved']:.1%} (bf16 LoRA); bf16-compute update vs fp32's: relative L2 difference "
        f"{relative:.3f}, cosine {cosine:.4f}"
    )
    assert pure["moved"] < 0.2, "pure-bf16 LoRA: most lr 1e-5 steps should be lost to rounding (the defect)"
    assert mixed["moved"] > 0.95 and reference["moved"] > 0.95
    assert relative < 0.35 and cosine > 0.95, (relative, cosine)  # the same updates, up to bf16 compute
    saved = full_adapter_state(mixed["model"])
    assert saved and all(t.dtype == torch.float32 for t in saved.values())  # the saved adapter is fp32
    pushed = dict(merged_lora_params(mixed["model"], dtype=torch.bfloat16))
    assert pushed and all(t.dtype == torch.bfloat16 for t in pushed.values())  # the engine gets its own dtype


def shared_output_dir(rank: int, tmp: Path) -> None:
    """One folder for all ranks passes; a folder per rank (nodes that each write to their own disk) is refused."""
    check_shared_output_dir(tmp / "shared", rank, dist.get_world_size())
    try:
        check_shared_output_dir(tmp / f"node{rank}", rank, dist.get_world_size())
    except ValueError as err:
        assert "rank 1 on" in str(err) and "is not shared by all processes" in str(err), err
        assert "rank 0 on" not in str(err)
    else:
        raise AssertionError("a per-rank output_dir was not refused")


def sampling_streams(rank: int, tmp: Path) -> None:
    """Each rank's engine draws its own samples; the same prompt twice in one rollout gets different completions."""
    from vllm import SamplingParams

    from grpo.engines.colocated import ColocatedEngine

    engine = ColocatedEngine.for_model(
        str(tmp / "model"), dtype="float32", seed=rank, max_model_len=64, kv_cache_gb=0.05, distributed=True
    )
    prompt = engine.tokenizer("Q: Ava has 3 cards.").input_ids
    samples = engine.generate([prompt, prompt], SamplingParams(n=4, temperature=1.0, max_tokens=12))
    completions = [tuple(s.completion_ids) for s in samples]
    first, second = completions[:4], completions[4:]
    assert first != second, "the same prompt twice in one rollout drew the same completions"
    assert len(set(completions)) > 4, completions
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, completions)
    assert everyone[0] != everyone[1], "two ranks drew the same completions for the same prompts"
    (tmp / f"completions{rank}.json").write_text(json.dumps(completions))
    engine.close()


def same_weights(rank: int, tmp: Path) -> None:
    """Ranks that load the same checkpoint pass the start-up check; accelerate's default
    fsdp_cpu_ram_efficient_loading (zeros on every process but local rank 0) and a perturbed rank are named."""
    from transformers import AutoModelForCausalLM

    if rank == 0:
        tiny_qwen3().save_pretrained(tmp / "model")
    dist.barrier()
    plain = AutoModelForCausalLM.from_pretrained(tmp / "model")
    digest = check_same_weights(plain, rank, 2)
    assert digest == check_same_weights(plain, 0, 1)  # the digest of what every rank holds

    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")  # as accelerate exports
    zeroed = AutoModelForCausalLM.from_pretrained(tmp / "model")
    del os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"]
    weight = zeroed.model.layers[0].self_attn.q_proj.weight
    assert (weight.abs().sum() == 0) == (rank == 1), "transformers no longer zeroes local rank 1: revisit the check"
    expect_refusal(lambda: check_same_weights(zeroed, rank, 2), "rank(s) [1]", "model.embed_tokens.weight")

    with torch.no_grad():
        plain.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6 * rank
    expect_refusal(lambda: check_same_weights(plain, rank, 2), "rank(s) [1]", "model.layers.1.mlp.down_proj.weight")


def expect_refusal(check, *fragments: str) -> None:
    try:
        check()
    except RuntimeError as err:
        assert all(f in str(err) for f in fragments), err
    else:
        raise AssertionError(f"not refused: {fragments}")


if __name__ == "__main__":
    checks, tmp = sys.argv[1].split(","), Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for check in checks:
        folder = tmp / check.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            if ":" in check:
                module, function = check.split(":")
                getattr(importlib.import_module(module), function)(rank)
            else:
                globals()[check](rank, folder)
        except BaseException:
            traceback.print_exc()
            print(f"rank {rank}: {check} FAILED", flush=True)
            sys.stderr.flush()
            os._exit(1)
        print(f"rank {rank}: {check} OK", flush=True)
    finish_worker()  # (a vLLM engine's shutdown may already have taken the default group with it)
