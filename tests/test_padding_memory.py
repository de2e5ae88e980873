"""packed_log_probs without [T, V] logits: memory, time, and FSDP2 x 2 processes.

Single process: at Qwen3's vocabulary (V = 151,936) on a narrow model, the largest tensor of a forward + backward
and the peak RSS, the full-logits path (``chunk_size=None``) against the response-only chunked head.
Two processes (this file is also the torchrun worker): under FSDP2 (``fully_shard`` per decoder layer, then the
root, as grpo/parallel.py's apply_fsdp), the chunked head gives the full-logits path's log-probs, entropies and LoRA
gradients.
"""

import time

import torch
from test_padding import full_logits_log_probs, layout
from torch.utils._python_dispatch import TorchDispatchMode

from padding import packed_log_probs

QWEN3_VOCAB = 151_936


class LargestTensor(TorchDispatchMode):
    """Bytes of the largest tensor any op returns (forward and backward) while active."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() * tensor.element_size() > self.largest:
                self.largest, self.shape = tensor.numel() * tensor.element_size(), tuple(tensor.shape)
        return out


def wide_vocab_lora(vocab=QWEN3_VOCAB):
    from bench_common import with_random_lora
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return with_random_lora(Qwen3ForCausalLM(config), rank=8, lora_b_std=0.1)


def step(model, batch, **kwargs):
    log_probs = packed_log_probs(model, *batch, 0.7, **kwargs)
    (-(log_probs * batch[2]).sum() / batch[2].sum()).backward()
    model.zero_grad(set_to_none=True)


def test_no_full_vocabulary_logits_and_a_lower_peak():
    """4 samples of 48-64 prompt + 16 response tokens (T = 293, N = 64) at V = 151,936, fp32, forward + backward.

    Measured here (2 shared CPU cores): largest tensor 170 MiB ([293, V] fp32 logits) -> 37 MiB ([64, V]); peak
    RSS 679 -> 148 MiB; time 1024 -> 397 ms (2.6x faster: the head and log-softmax skip the 78% prompt rows).
    """
    from bench_common import rss_peak_during

    model = wide_vocab_lora()
    prompts = [64, 48, 60, 57]
    batch = layout(prompts, [16] * 4, seed=0)
    total, scored = int(batch[1].sum()), int(batch[2].sum())
    results = {}
    for name, chunk_size in (("full logits", None), ("response head", 512)):
        step(model, batch, chunk_size=chunk_size)  # warm-up
        with LargestTensor() as mode:
            step(model, batch, chunk_size=chunk_size)
        peaks, times = [], []
        for _ in range(3):
            start = time.perf_counter()
            peaks.append(rss_peak_during(lambda: step(model, batch, chunk_size=chunk_size))[1])
            times.append(time.perf_counter() - start)
        results[name] = dict(largest=mode.largest, shape=mode.shape, peak=sorted(peaks)[1], time=min(times))
    old, new = results["full logits"], results["response head"]
    print(
        f"T={total} N={scored} V={QWEN3_VOCAB}: largest tensor {old['largest'] / 2**20:.0f} MiB {old['shape']} -> "
        f"{new['largest'] / 2**20:.0f} MiB {new['shape']}; peak RSS {old['peak'] / 2**20:.0f} -> "
        f"{new['peak'] / 2**20:.0f} MiB; time {old['time'] * 1e3:.0f} -> {new['time'] * 1e3:.0f} ms "
        f"({old['time'] / new['time']:.2f}x)"
    )
    assert old["largest"] == total * QWEN3_VOCAB * 4  # full logits: the [T, V] fp32 logits
    assert new["largest"] == scored * QWEN3_VOCAB * 4  # the one chunk of N = 64 response positions
    assert new["peak"] < 0.5 * old["peak"], (new["peak"], old["peak"])


# ----------------------------------------------------------------------------------------------------------
# FSDP2 x 2 processes
# ----------------------------------------------------------------------------------------------------------


def test_fsdp2_two_processes_give_the_full_logits_values_and_gradients(two_process_checks):
    """2 processes on gloo: `checks` below, on each rank."""
    from torchrun import passed

    passed(two_process_checks, "test_padding_memory:checks")


def fsdp2_case(name: str, rank: int) -> None:
    from qwen3_lora import tiny_lora
    from qwen3_moe_lora import tiny_moe_lora
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from merge import decoder_layers
    from padding.packed_attention import PACKED_SDPA  # importing it registers packed_sdpa

    bf16 = "bf16" in name
    model = {
        "dense, packed_sdpa, activation checkpointing": lambda: tiny_lora(layers=3),
        "dense, LoRA on an untied lm_head": lambda: tiny_lora(targets=["q_proj", "v_proj", "lm_head"], tie=False),
        "moe": lambda: tiny_moe_lora(),
        "dense, bf16 base and compute, fp32 LoRA": lambda: tiny_lora(dtype=torch.bfloat16),
    }[name]()
    if "packed_sdpa" in name:
        model.get_base_model().config._attn_implementation = PACKED_SDPA
    if "checkpointing" in name:
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16_compute = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mp_policy=bf16_compute) if bf16 else {}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.train()
    batch = layout([5, 1, 7, 3], [4, 6, 1, 5], seed=rank)  # a different batch on each rank
    for legacy_slice in (False, True):
        runs = {}
        for path, fn, extra in (("full", full_logits_log_probs, {}), ("chunked", packed_log_probs, {"chunk_size": 3})):
            log_probs, entropies = fn(model, *batch, 0.7, legacy_slice, True, **extra)
            (-(log_probs * batch[2]).sum() / batch[2].sum()).backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            runs[path] = log_probs.detach(), entropies, grads
        (got, got_entropy, grads), (want, want_entropy, want_grads) = runs["chunked"], runs["full"]
        tolerance = dict(atol=1e-5, rtol=1e-3) if bf16 else dict(atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, want, **tolerance)
        torch.testing.assert_close(got_entropy, want_entropy, **tolerance)
        assert grads and grads.keys() == want_grads.keys() and all("lora_" in n for n in grads), list(grads)
        worst = max((grads[n] - want_grads[n]).abs().max().item() for n in grads)
        for n in grads:
            torch.testing.assert_close(grads[n], want_grads[n], **tolerance, msg=f"{name}: {n}")
        print(
            f"rank {rank}: {name}, legacy_slice={legacy_slice}: max |log-prob diff| "
            f"{(got - want).abs().max().item():.1e}, max |LoRA grad diff| {worst:.1e} ({len(grads)} tensors)"
        )


def checks(rank: int) -> None:
    """The FSDP2 cases, on each of 2 ranks (tests/distributed_checks.py runs this)."""
    for case in (
        "dense, packed_sdpa, activation checkpointing",
        "dense, LoRA on an untied lm_head",
        "moe",
        "dense, bf16 base and compute, fp32 LoRA",
    ):
        fsdp2_case(case, rank)
