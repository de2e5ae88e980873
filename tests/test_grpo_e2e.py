"""End to end: a few GRPO steps with 2 processes (FSDP2 on gloo), colocated vLLM, merge on and off.

Each run is `accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py`
on a quickly warmed-up tiny model; the assertions read the run's own metrics.jsonl.
"""

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

from recipe_runs import launch

METRIC_NAMES = {"rollout_step", "global_step", "merge", "reward_mean", "reward_std", "ratio_mean", "ratio_min", "ratio_max",
                "ratio_onpolicy_mean", "ratio_onpolicy_maxdev", "clip_frac", "is_ratio_mean",
                "rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_tokens", "rollout_s",
                "rollout_tokens_per_s", "sync_s", "update_s", "step_s", "peak_mem_gb"}


@pytest.mark.parametrize("merge, extra", [(True, []), (False, ["beta=0.04"])],
                         ids=["merge_on", "merge_off_with_reference_kl"])
def test_rollouts_follow_the_trainer(tmp_path, tiny_model, merge, extra):
    proc, metrics = launch(tmp_path, tiny_model, f"lora.merge={str(merge).lower()}", *extra)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert len(metrics) == 3  # 6 optimizer steps / 2 mini-batches per rollout
    for m in metrics:
        assert METRIC_NAMES <= set(m), METRIC_NAMES - set(m)
        assert m["merge"] is merge
        assert m["ratio_onpolicy_maxdev"] <= 1e-5, m  # the first mini-batch: trainer weights = rollout weights
        assert m["rollout_logprob_diff_mean"] <= 1e-4, m  # vLLM served exactly the trainer's current weights
        assert m["sync_changed_trainer"] == 0, m  # the sync left the trainer's weights bit-for-bit alone
        assert m["rollout_tokens"] > 0 and m["rollout_tokens_per_s"] > 0
    assert metrics[-1]["ratio_min"] < 1 < metrics[-1]["ratio_max"]  # later mini-batches were genuinely off-policy
    adapter = tmp_path / "run" / "adapter"
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(adapter))
    lora_b = [p for n, p in trained.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # peft loads it, and it holds the trained weights
    assert "rollout 3/3 (optimizer step 6) reward" in (tmp_path / "run" / "train.log").read_text()  # the log outlives vLLM's logging setup
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert f"merge: {str(merge).lower()}" in config


def test_skipped_sync_is_caught(tmp_path, tiny_model):
    """With the sync disabled, vLLM keeps serving stale weights: the log-prob check must stop the run."""
    proc, metrics = launch(tmp_path, tiny_model, "vllm.sync=false", "learning_rate=5e-3", "vllm.max_logprob_diff=1e-3")
    assert proc.returncode != 0
    assert "broken or skipped weight sync" in proc.stderr
    assert metrics[0]["rollout_logprob_diff_mean"] <= 1e-4  # step 1: nothing trained yet, weights still equal
    assert metrics[-1]["rollout_logprob_diff_mean"] > 1e-3


def test_legacy_padding_blows_up_the_ratio(tmp_path, tiny_model):
    proc, metrics = launch(tmp_path, tiny_model, "padding.legacy_slice=true", "max_steps=2")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert all(m["ratio_max"] > 10 for m in metrics), metrics  # tokens read at the wrong position
