"""The colocated engine (grpo/engines/colocated.py): one push for the recipe and both benchmarks, checked strictly."""

import ast
import logging
from pathlib import Path

import bench_rollout
import bench_sync
import pytest
import torch
from bench_common import with_random_lora
from transformers import AutoModelForCausalLM
from vllm import SamplingParams

from grpo.engines.colocated import ColocatedEngine
from merge import merged_lora_params
from merge.vllm_compat import WeightPushError
from padding import packed_log_probs

ROOT = Path(__file__).resolve().parents[1]


def calls_in(path: Path) -> set[str]:
    """Names of the attributes called in a file (``x.y(...)`` -> "y"), and the string arguments of those calls."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls.add(node.func.attr)
            calls.update(f"{node.func.attr}:{a.value}" for a in node.args if isinstance(a, ast.Constant))
    return calls


def test_the_benchmarks_time_the_recipes_own_sync():
    assert bench_sync.SYNC_OF_THE_RECIPE is ColocatedEngine.sync_merged
    assert bench_sync.ColocatedEngine is ColocatedEngine and bench_rollout.ColocatedEngine is ColocatedEngine
    assert "sync_policy" in calls_in(ROOT / "recipes" / "grpo_qwen3_4b.py")  # -> sync_merged when merge=true
    assert "sync_merged" in calls_in(ROOT / "bench" / "bench_rollout.py")
    # the push itself is written once: no other file calls vLLM's reload or builds an engine
    for path in sorted(
        [*(ROOT / "recipes").glob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "grpo").rglob("*.py")]
    ):
        if path != ROOT / "grpo" / "engines" / "colocated.py":
            calls = calls_in(path)
            assert "collective_rpc:reload_weights" not in calls and "LLM" not in calls, path.name


@pytest.fixture(scope="module")
def engine_and_policy(tiny_model):
    engine = ColocatedEngine.for_model(tiny_model, dtype="float32", max_model_len=128, kv_cache_gb=0.05)
    policy = with_random_lora(AutoModelForCausalLM.from_pretrained(tiny_model), rank=8, lora_b_std=0.05)
    yield engine, policy
    engine.close()


def test_merged_push_serves_the_trainers_log_probs(engine_and_policy, caplog):
    engine, policy = engine_and_policy
    with caplog.at_level(logging.DEBUG):
        engine.sync_merged(policy)
    assert "Failed to load weights" not in caplog.text  # the benign ones (rotary, tied head) are kept quiet
    prompt = engine.tokenizer("Q: Ava has 3 cards and gets 4 more. How many now?\nA:").input_ids
    sample = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, logprobs=0))[0]
    ids = torch.tensor([prompt + sample.completion_ids])
    response = torch.zeros(1, len(sample.completion_ids), dtype=torch.long) + 1
    served = torch.tensor(sample.logprobs)
    with torch.no_grad():
        trainer = packed_log_probs(policy, ids, torch.ones_like(ids), response)[0]
        with policy.disable_adapter():  # control: the base weights, i.e. a push that left the LoRA out
            base = packed_log_probs(policy, ids, torch.ones_like(ids), response)[0]
    error, lora_effect = (trainer - served).abs().max().item(), (base - served).abs().max().item()
    assert error <= 1e-4, error
    assert lora_effect > 100 * 1e-4, lora_effect  # the LoRA moves log-probs far beyond the bound (~0.2)


@pytest.mark.parametrize(
    "dropped, named",
    [
        ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),  # a whole layer
        ("model.layers.1.self_attn.k_proj.weight", "QKVParallelLinear"),  # part of a fused q/k/v layer
        ("model.norm.weight", "model.norm.weight"),
    ],
)
def test_a_dropped_tensor_fails_the_push_by_name(engine_and_policy, dropped, named):
    engine, policy = engine_and_policy
    with pytest.raises(WeightPushError, match=named.replace(".", r"\.")):
        engine.push_weights((name, t) for name, t in merged_lora_params(policy) if name != dropped)
    engine.sync_merged(policy)  # a complete push afterwards passes


def test_on_the_cpu_the_sampled_tokens_ranks_are_counted_eagerly_as_vllm_counts_them(engine_and_policy):
    """The engine's first request compiles nothing: vLLM's sampler counts the ranks with the eager function, which
    is vLLM's own (its source function, uncompiled) on ties, above and below, whatever the batch."""
    import vllm.v1.sample.ops.logprobs as logprobs_ops
    import vllm.v1.sample.sampler as sampler

    from grpo.engines.colocated import count_greater_than

    assert sampler.batched_count_greater_than is count_greater_than
    vllms = logprobs_ops.batched_count_greater_than._torchdynamo_orig_callable  # what torch.compile wraps
    for rows in (1, 5):
        x = torch.randn(rows, 50).round(decimals=1)  # ties
        values = x[:, 7:8].clone()
        assert torch.equal(count_greater_than(x, values), vllms(x, values))
        assert count_greater_than(x, values).dtype == vllms(x, values).dtype
