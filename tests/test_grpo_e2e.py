"""End to end: a few GRPO steps with 2 processes (FSDP2 on gloo), colocated vLLM, merge on and off.

Each run is `accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py`
on a quickly warmed-up tiny model; the assertions read the run's own metrics.jsonl.
"""

import re

import pytest
import torch
from peft import PeftModel
from recipe_runs import launch, read_evals, run_recipe
from transformers import AutoModelForCausalLM

from grpo.config import MAX_LOGPROB_DIFF

METRIC_NAMES = {
    "rollout_step",
    "global_step",
    "merge",
    "reward_mean",
    "reward_std",
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "ratio_onpolicy_mean",
    "ratio_onpolicy_maxdev",
    "clip_frac",
    "is_ratio_mean",
    "rollout_logprob_diff_mean",
    "rollout_logprob_diff_max",
    "rollout_tokens",
    "rollout_s",
    "rollout_tokens_per_s",
    "sync_s",
    "update_s",
    "step_s",
    "peak_mem_gb",
}


def test_rollouts_follow_the_trainer_merge_on_with_eval_tensorboard_top_p(reference_run, tiny_model):
    """vLLM's log-probs are those of its truncated (top-p here, top-k below) distribution; the trainer's follow the
    same truncation, so in fp32 they agree to 1e-6 and the on-policy ratio is 1, merge on and off. Merge on: the
    shared reference run (tests/recipe_runs.py's REFERENCE_RUN, held-out evaluations and TensorBoard on)."""
    out, proc, metrics = reference_run
    check_rollouts_follow(out, proc, metrics, tiny_model, merge=True, rollout_steps=4)
    check_eval_and_tensorboard(out, metrics)


def test_rollouts_follow_the_trainer_merge_off_with_reference_kl_top_k_lm_head_chunks(tmp_path, tiny_model):
    extra = ["beta=0.04", "top_k=20", "padding.logprob_chunk_size=16"]
    proc, metrics = launch(tmp_path, tiny_model, "lora.merge=false", *extra)
    check_rollouts_follow(tmp_path, proc, metrics, tiny_model, merge=False, rollout_steps=3)


def check_rollouts_follow(out, proc, metrics, tiny_model, merge: bool, rollout_steps: int):
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert len(metrics) == rollout_steps  # 2 optimizer steps (mini-batches) per rollout
    for m in metrics:
        assert METRIC_NAMES <= set(m), METRIC_NAMES - set(m)
        assert m["merge"] is merge
        assert m["ratio_onpolicy_maxdev"] <= 1e-5, m  # the first mini-batch: trainer weights = rollout weights
        assert m["rollout_logprob_diff_mean"] <= 1e-6, m  # vLLM served the trainer's weights and distribution
        assert m["sync_changed_trainer"] == 0, m  # the sync left the trainer's weights bit-for-bit alone
        assert m["rollout_tokens"] > 0 and m["rollout_tokens_per_s"] > 0
    assert metrics[-1]["ratio_min"] < 1 < metrics[-1]["ratio_max"]  # later mini-batches were genuinely off-policy
    adapter = out / "run" / "adapter"
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(adapter))
    lora_b = [p for n, p in trained.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # peft loads it, and it holds the trained weights
    log = (out / "run" / "train.log").read_text()
    last = f"rollout {rollout_steps}/{rollout_steps} (optimizer step {2 * rollout_steps}) reward"
    assert last in log  # the log outlives vLLM's logging setup
    assert "Failed to load weights" not in proc.stderr  # the strict push keeps the benign reload warnings quiet
    config = (out / "run" / "config.yaml").read_text()
    assert f"merge: {str(merge).lower()}" in config


def check_eval_and_tensorboard(out, metrics):
    """Held-out evaluation before training, after optimizer step 4 and at the end; TensorBoard holds the scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evals = read_evals(out)
    assert [e["global_step"] for e in evals] == [0, 4, 8], evals
    for e in evals:
        assert 0 <= e["eval_reward_greedy"] <= 1 and 0 <= e["eval_reward_sampled"] <= 1 and e["eval_problems"] > 0
    events = EventAccumulator(str(next((out / "run" / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    rewards = events.Scalars("reward_mean")
    assert [e.step for e in rewards] == [m["global_step"] for m in metrics]
    assert [e.value for e in rewards] == pytest.approx([m["reward_mean"] for m in metrics], rel=1e-6)
    assert [e.step for e in events.Scalars("eval_reward_greedy")] == [0, 4, 8]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_skipped_sync_is_caught_by_the_default_guard(tmp_path, tiny_model, dtype):
    """With the sync disabled, vLLM keeps serving stale weights: the log-prob guard, at its default for the dtype,
    stops the run within a few rollout steps at a learning rate the embedded default trains with. Run at the loosest
    default (bf16, 2e-2): the same stale weights exceed every tighter one (fp16's 2e-3, fp32's 1e-4), whose synced
    runs' figures stay under a quarter of them (every fp32 run here is held to 1e-6;
    test_half_precision_trains_fp32_adapters_with_the_guard_armed for fp16)."""
    proc, metrics = launch(
        tmp_path, tiny_model, "vllm.sync=false", "learning_rate=1e-3", f"model.dtype={dtype}", "max_steps=12"
    )
    assert proc.returncode != 0
    assert "broken or skipped weight sync" in proc.stderr
    assert len(metrics) <= 3, [m["rollout_logprob_diff_mean"] for m in metrics]
    stopped = re.search(r"rollout step (\d+): rollout_logprob_diff_mean=(\S+) exceeds", proc.stderr)
    assert stopped and int(stopped[1]) == len(metrics) + 1, proc.stderr[-3000:]  # before its update and metrics line
    default = MAX_LOGPROB_DIFF[dtype]
    baseline = metrics[0]["rollout_logprob_diff_mean"]  # rollout step 1: nothing trained yet
    assert baseline <= default / 4
    assert float(stopped[2]) > max(default, 10 * baseline)  # the calibrated limit


@pytest.mark.parametrize(
    "dtype, merge",
    [("bfloat16", True), ("float16", False)],
    ids=["bf16_merge_on", "fp16_merge_off"],
)
def test_half_precision_trains_fp32_adapters_with_the_guard_armed(tmp_path, tiny_model, dtype, merge):
    """bf16 or fp16 base and compute, fp32 LoRA: the run completes under the dtype's default guard and saves an fp32
    adapter; fp16 reports its loss scale, and the merged push its precision figures, every rollout step. Each dtype
    once and each merge mode once (fp16 merged pushes also run in tests/test_reliability.py and
    tests/test_bench_precision.py)."""
    from safetensors.torch import load_file

    proc, metrics = launch(
        tmp_path, tiny_model, f"model.dtype={dtype}", f"lora.merge={str(merge).lower()}", "learning_rate=1e-3"
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert len(metrics) == 3
    for m in metrics:
        assert m["rollout_logprob_diff_mean"] <= MAX_LOGPROB_DIFF[dtype] / 4, m  # well inside the default guard
        assert m["ratio_onpolicy_maxdev"] <= 1e-5, m
        assert m["sync_changed_trainer"] == 0, m
        assert ("loss_scale" in m) == (dtype == "float16"), m
    if dtype == "float16":
        assert metrics[-1]["loss_scale"] > 0 and metrics[-1]["skipped_steps"] >= 0
    if merge:  # none while LoRA B = 0: at the first sync, and after steps whose groups all tied (no update)
        measured = [m for m in metrics if "sync_delta_kept" in m]
        assert measured and all(0 < m["sync_delta_kept"] <= 1.01 for m in measured), metrics
        first_update = next(i for i, m in enumerate(metrics) if m["loss"] != 0)
        assert all("sync_delta_kept" in m for m in metrics[first_update + 1 :]), metrics
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(t.dtype == torch.float32 for t in adapter.values())


def test_moe_experts_merged_and_served(tmp_path, tiny_moe_model):
    """LoRA on the fused expert weights and on attention, merged layer by layer and served by vLLM: the same
    fidelity as the dense model (|vLLM - trainer| <= 1e-6 in fp32, on-policy ratio 1). The model is untrained and
    the reward a digest of each completion's text (tests/stand_in_rewards.py): every group's completions differ in
    reward, so every step updates the experts' LoRA that the next sync merges."""
    from safetensors.torch import load_file

    proc, metrics = launch(
        tmp_path, tiny_moe_model, "reward_funcs=[stand_in_rewards:text_digest_reward]", config="tiny_moe_cpu.yaml"
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert len(metrics) == 3
    for m in metrics:
        assert m["rollout_logprob_diff_mean"] <= 1e-6, m  # as the dense model's runs
        assert m["ratio_onpolicy_maxdev"] <= 1e-5, m
        assert m["sync_changed_trainer"] == 0, m
        assert m["loss"] != 0, m  # an update at every step: the syncs after it merge a non-zero delta
    saved = (tmp_path / "run" / "adapter" / "adapter_config.json").read_text()
    assert "mlp.experts.gate_up_proj" in saved  # the adapter holds the experts' LoRA
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    experts_b = [t for name, t in adapter.items() if "experts" in name and "lora_B" in name]
    assert experts_b and all(t.abs().sum() > 0 for t in experts_b)  # trained: the merged delta was not zero
    for targets in ("[mlp.experts.gate_up_proj]", "null"):  # LoRA on the experts; on attention of an MoE model
        refused = run_recipe(
            tmp_path / "refused",
            "model.build_tiny=null",
            f"model.name_or_path={tiny_moe_model}",
            "lora.merge=false",
            f"lora.target_parameters={targets}",
            config="tiny_moe_cpu.yaml",
        )
        assert refused.returncode == 2 and "lora.merge=false: vLLM" in refused.stderr, refused.stderr[-3000:]
        assert "cannot serve" in refused.stderr and "lora.merge=true" in refused.stderr


def test_legacy_padding_blows_up_the_ratio(legacy_slice_nan_reward_run):
    """The legacy slice in a run that a NaN reward stops at rollout step 2 (tests/test_reliability.py checks that
    part): step 1's ratio is read at the wrong positions, and the run went on until the reward stopped it."""
    _, proc, metrics = legacy_slice_nan_reward_run
    assert "non-finite reward" in proc.stderr and "exceeds" not in proc.stderr, proc.stderr[-5000:]
    assert metrics and all(m["ratio_max"] > 10 for m in metrics), metrics  # tokens read at the wrong position


def test_tool_episodes_follow_the_trainer_on_every_turn(tmp_path, tiny_tool_model):
    """Multi-turn episodes on the tool task (recipes/configs/tiny_cpu_tools.yaml), token in / token out: the engine's
    log-probs equal the trainer's on the model tokens of each turn, the on-policy ratio is 1, and re-tokenizing the
    sampled conversations would have changed some of them."""
    proc, metrics = launch(
        tmp_path, tiny_tool_model, "max_completion_length=48", "data.max_prompt_length=64", config="tiny_cpu_tools.yaml"
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert len(metrics) == 3
    for m in metrics:
        # the episodes went on after a tool (the shipped model was warmed up on 40% tool conversations)
        assert m["tools/call_frequency"] > 0.2 and m["model_tokens_turn2"] > 0, m
        assert m["ratio_onpolicy_maxdev"] <= 1e-5, m
        assert m["rollout_logprob_diff_turn1"] <= 1e-6 and m["rollout_logprob_diff_turn2"] <= 1e-6, m
        assert m["sync_changed_trainer"] == 0, m
        assert 0 <= m["retokenization_drift"] <= 1 and 0 <= m["tools/failure_frequency"] <= 1
    assert sum(m["retokenization_drift"] for m in metrics) > 0
