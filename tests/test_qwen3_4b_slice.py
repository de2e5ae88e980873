"""Qwen3-4B's exact architecture, two of its 36 decoder layers (grpo/qwen3_4b_shape.py), through the recipe on CPU.

One process, one rollout step with a tiny batch: the memory plan, the merged push at the real layer and vocabulary
sizes, and the fidelity checks. In fp32: CPUs without native bf16 arithmetic (AVX2) take over 5 minutes for this
step in bf16, and the bf16 path itself (bf16 base and compute, fp32 LoRA, the bf16 guard) is run end to end on
the embedded default by tests/test_grpo_e2e.py.
"""

import json

import pytest
from recipe_runs import ROOT, run_recipe
from safetensors.torch import load_file
from transformers import AutoConfig

from grpo.config import load_config
from grpo.memory_plan import memory_plan
from grpo.qwen3_4b_shape import QWEN3_4B, build_qwen3_4b_shape


@pytest.fixture(scope="module")
def slice_model(tmp_path_factory):
    return build_qwen3_4b_shape(tmp_path_factory.mktemp("model") / "qwen3-4b-2layers", num_layers=2)


def test_the_slice_has_qwen3_4b_layers_and_vocabulary(slice_model):
    config = AutoConfig.from_pretrained(slice_model)
    assert config.num_hidden_layers == 2
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(config, key) == QWEN3_4B[key], key
    plan = memory_plan(config, load_config(ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"), world=1)
    assert 5.8e8 <= plan["parameters"]["total"] <= 6.0e8  # the 389M-row embedding and two 101M-parameter layers


def test_one_rollout_step_at_real_layer_size(tmp_path, slice_model):
    proc = run_recipe(
        tmp_path,
        f"model.name_or_path={slice_model}",
        "model.build_tiny=null",
        "data.name=generated",
        "data.num_generated=64",
        "data.use_chat_template=false",
        "data.prompt_template=Q: {question} A:",
        "data.max_prompt_length=64",
        "vllm.enable_sleep_mode=false",
        "vllm.enforce_eager=true",  # vLLM's torch.compile warm-up (40 s on CPU) is not what this checks
        "vllm.kv_cache_gb=0.1",
        "per_device_train_batch_size=4",
        "steps_per_generation=1",
        "num_generations=4",
        "max_completion_length=8",
        "max_steps=1",
        "eval_steps=null",
        "vllm.verify_sync=true",
        "model.dtype=float32",
        config="qwen3_4b_gsm8k.yaml",
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "memory plan per device" in proc.stderr
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["rollout_logprob_diff_mean"] <= 1e-4, metrics  # the fp32 guard's default
    assert metrics["ratio_onpolicy_maxdev"] <= 1e-5 and metrics["sync_changed_trainer"] == 0, metrics
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2 and all(
        t.dtype.is_floating_point and t.element_size() == 4 for t in adapter.values()
    )  # fp32 LoRA
