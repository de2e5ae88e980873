"""padding/sampling.py against vLLM 0.32's own top-k / top-p (bitwise, ties included), and end to end: the trainer's
log-probs of tokens a vLLM-CPU engine sampled with top-k / top-p equal the engine's processed log-probs."""

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from padding import selective_log_softmax
from padding.sampling import (
    truncated_log_softmax,
    truncated_selective_log_softmax,
    vllm_truncated_logits,
    vllm_truncation_mask,
)

VOCAB = 257


def vllm_masked(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """vLLM's apply_top_k_top_p as its sampler calls it: int32 k and fp32 p per row, None when off for all rows."""
    rows, vocab = logits.shape
    k = None if top_k is None or not 0 < top_k < vocab else torch.full((rows,), top_k, dtype=torch.int32)
    p = None if top_p is None or top_p >= 1 else torch.full((rows,), top_p, dtype=torch.float32)
    return apply_top_k_top_p(logits.clone(), k, p)  # it writes into its argument


def test_vllm_uses_the_pytorch_path_here():
    from vllm.v1.sample.ops import topk_topp_sampler

    assert not topk_topp_sampler.HAS_TRITON  # vLLM-CPU: apply_top_k_top_p_pytorch (see padding/sampling.py)


def logit_rows(seed: int = 0) -> torch.Tensor:
    """Rows of several shapes of distribution, many with exact ties (at the top-k and the top-p boundaries too)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(16, VOCAB, generator=g) * 3
    coarse = torch.round(torch.randn(16, VOCAB, generator=g) * 4) / 2  # values on a 0.5 grid: ties everywhere
    bf16 = (torch.randn(16, VOCAB, generator=g) * 8).bfloat16().float()  # bf16 logits upcast, as vLLM sees them
    peaked = torch.randn(8, VOCAB, generator=g)
    peaked[:, 3] += 30  # one token holds ~all the mass
    uniform = torch.zeros(4, VOCAB)  # all tied
    two_level = torch.zeros(4, VOCAB)
    two_level[:, ::3] = 1.0  # ties on both sides of the boundary
    return torch.cat([normal, coarse, bf16, peaked, uniform, two_level]) / 0.7


TOP_K = [None, -1, 0, 1, 2, 20, VOCAB - 1, VOCAB, VOCAB + 5]
TOP_P = [None, 1.0, 0.9, 0.5, 0.999999, 1e-6, 1 / 3]


@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("top_p", TOP_P)
def test_bitwise_equal_to_vllm_apply_top_k_top_p(top_k, top_p):
    logits = logit_rows()
    expected = vllm_masked(logits, top_k, top_p)
    got = vllm_truncated_logits(logits, top_k, top_p)
    assert torch.equal(got, expected)
    assert torch.equal(torch.log_softmax(got, -1), expected.log_softmax(dim=-1, dtype=torch.float32))
    kept = torch.isfinite(got).sum(-1)
    if top_k is not None and 0 < top_k < VOCAB and top_p is None:
        assert (kept >= top_k).all() and (kept > top_k).any()  # ties at the k-th value: all kept (PyTorch path)


def test_ties_straddling_the_top_p_boundary():
    """All tokens tied: top-p keeps a prefix of the sorted order, the same tokens as vLLM."""
    logits = torch.zeros(3, 10)
    for p, kept in ((0.05, 1), (0.35, 4), (0.5, 5), (0.95, 10)):
        got, expected = vllm_truncated_logits(logits, None, p), vllm_masked(logits, None, p)
        assert torch.equal(got, expected)
        assert (torch.isfinite(got).sum(-1) == kept).all()


def test_chunks_equal_the_whole_and_no_truncation_is_the_plain_log_softmax():
    torch.manual_seed(0)
    raw = torch.randn(37, VOCAB) * 4
    targets = torch.randint(0, VOCAB, (37,))
    whole = truncated_selective_log_softmax(raw, targets, 0.7, 20, 0.9, chunk_size=1024)
    chunked = truncated_selective_log_softmax(raw, targets, 0.7, 20, 0.9, chunk_size=5)
    assert torch.equal(whole, chunked)
    full = truncated_log_softmax(raw, 0.7, 20, 0.9, keep=targets)
    assert torch.equal(whole, full.gather(-1, targets[:, None]).squeeze(-1))
    plain = truncated_selective_log_softmax(raw, targets, 0.7, top_k=0, top_p=1.0)
    torch.testing.assert_close(plain, selective_log_softmax(raw / 0.7, targets), rtol=1e-6, atol=0)  # last bit


def test_targets_are_always_kept():
    logits = torch.tensor([[5.0, 4.0, 0.0, -3.0]])
    assert vllm_truncation_mask(logits, top_k=1).tolist() == [[False, True, True, True]]
    lp = truncated_selective_log_softmax(logits, torch.tensor([3]), top_k=1)
    assert torch.isfinite(lp).all() and lp.item() == pytest.approx(torch.log_softmax(logits[0, [0, 3]], 0)[1].item())


def test_gradient_flows_through_the_kept_set_only():
    torch.manual_seed(1)
    raw = (torch.randn(6, VOCAB) * 3).requires_grad_()
    targets = torch.randint(0, VOCAB, (6,))
    log_probs = truncated_selective_log_softmax(raw, targets, 0.7, 20, 0.9)
    (grad,) = torch.autograd.grad(log_probs.sum(), raw)
    kept = torch.isfinite(truncated_log_softmax(raw.detach(), 0.7, 20, 0.9, keep=targets))
    assert torch.isfinite(grad).all() and (grad[~kept] == 0).all()
    # d log p_t / d z = (onehot_t - softmax over the kept set) / T
    probs = truncated_log_softmax(raw.detach(), 0.7, 20, 0.9, keep=targets).exp()
    expected = (torch.nn.functional.one_hot(targets, VOCAB) - probs) / 0.7
    assert (grad - expected).abs().max() <= 1e-6


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A vLLM-CPU engine in this process, fp32, returning processed log-probs (as the recipe's ColocatedEngine)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(
        model=tiny_model,
        dtype="float32",
        seed=0,
        max_model_len=128,
        enforce_eager=True,
        kv_cache_memory_bytes=int(0.05 * 2**30),
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_trainer_log_probs_equal_vllm_processed_log_probs(engine, tiny_model):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = engine.get_tokenizer()
    prompts = [
        tokenizer(f"Q: Ava has {a} cards and gets {b} more. How many now?\nA:").input_ids
        for a, b in ((3, 4), (12, 9), (7, 30))
    ]
    gaps = {}
    for top_k, top_p in ((-1, 0.9), (20, 1.0), (20, 0.9)):
        sampling = SamplingParams(n=4, temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=24, logprobs=0, seed=1)
        truncated, plain = [], []
        for prompt, out in zip(
            prompts, engine.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        ):
            for comp in out.outputs:
                ids = torch.tensor(prompt + list(comp.token_ids))
                vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)])
                with torch.no_grad():
                    logits = model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1]
                targets = ids[len(prompt) :]
                ours = truncated_selective_log_softmax(logits, targets, 1.0, top_k, top_p)
                truncated.append((ours - vllm_lp).abs())
                plain.append((selective_log_softmax(logits, targets) - vllm_lp).abs())
        gaps[top_k, top_p] = (
            torch.cat(truncated).mean().item(),
            torch.cat(plain).mean().item(),
            torch.cat(truncated).max().item(),
        )
    print(
        {
            f"top_k={k} top_p={p}": f"mean |vLLM - trainer| {t:.2e} (max {m:.2e}); without truncation {u:.2e}"
            for (k, p), (t, u, m) in gaps.items()
        }
    )
    for truncated_gap, plain_gap, _ in gaps.values():
        assert truncated_gap <= 1e-6
        assert plain_gap > 1e-4  # the truncation matters here: the check is not trivial
