"""Recipe config: TRL/peft names, typed loading, clear errors naming the bad key or value."""

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import trl
from peft import LoraConfig
from recipe_runs import launch_command, launch_env, run_recipe

from grpo.config import ConfigError, LoraSettings, RecipeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_fields_are_trl_grpo_config_names():
    """TRL's GRPOConfig names, and AsyncGRPOConfig's for the asynchronous rollouts (max_staleness)."""
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

    trl_names = {f.name for f in dataclasses.fields(trl.GRPOConfig)} | {"max_staleness"}
    assert "max_staleness" in {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    sections = {"model", "data", "lora", "vllm", "padding", "tool_calling"}
    trainer_arguments = {"reward_funcs", "tools", "environment_factory"}  # GRPOTrainer's arguments
    own = {"agent"}  # an agent on an OpenAI endpoint: TRL's nearest, rollout_func, returns the ids itself
    own |= {"advantage", "gamma", "state_advantage_weight"}  # turn-level credit: TRL gives one per episode
    ours = {f.name for f in dataclasses.fields(RecipeConfig)} - sections - trainer_arguments - own
    assert ours <= trl_names, ours - trl_names


def test_lora_fields_are_peft_lora_config_names():
    peft_names = {f.name for f in dataclasses.fields(LoraConfig)}
    ours = {f.name for f in dataclasses.fields(LoraSettings)} - {"merge"}
    assert ours <= peft_names, ours - peft_names


RECIPE_CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if not p.name.startswith("trl_"))


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.prompts_per_rank >= 1


def test_an_override_yaml_cannot_parse_is_a_string():
    assert load_config(None, ["data.prompt_template=Q: {question} A:"]).data.prompt_template == "Q: {question} A:"


def test_overrides_are_typed():
    config = load_config(
        None,
        [
            "lora.merge=false",
            "learning_rate=1e-5",
            "lora.target_modules=[q_proj]",
            "epsilon_high=0.28",
            "model.build_tiny=null",
        ],
    )
    assert config.lora.merge is False and config.learning_rate == 1e-5 and isinstance(config.learning_rate, float)
    assert config.lora.target_modules == ["q_proj"] and config.epsilon_high == 0.28 and config.model.build_tiny is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.merg=false", "unknown config key 'lora.merg'; did you mean 'lora.merge'?"),
        ("learnin_rate=1e-5", "did you mean 'learning_rate'?"),
        ("learning_rate=fast", "learning_rate='fast' must be of type float"),
        ("lora.r=true", "lora.r=True must be of type int"),
        ("lora.merge=maybe", "lora.merge='maybe' must be of type bool"),
        ("lora.target_modules=q_proj", "lora.target_modules='q_proj' must be a list of str"),
        ("loss_type=ppo", "loss_type='ppo' is not allowed; choose one of ['grpo', 'bnpo'"),
        ("model.dtype=float64", "model.dtype='float64' is not allowed"),
        ("num_generations=3", "must be a multiple of num_generations=3"),
        ("num_generations=1", "num_generations=1 is out of range: it must be >= 2"),
        ("temperature=0", "temperature=0.0 is out of range: it must be > 0"),
        ("vllm=3", "vllm must be a mapping"),
        ("nokey", "override 'nokey' must look like key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[").replace("?", r"\?")):
        load_config(None, [override])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does-not-exist.yaml"):
        load_config(tmp_path / "does-not-exist.yaml")


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lora:\n  rank: 8\n")
    with pytest.raises(ConfigError, match="unknown config key 'lora.rank'"):
        load_config(path)


# One out-of-range (or ill-typed) value for every field of the config, the sections' fields included.
BAD_VALUES = {
    "output_dir": '""',
    "run_name": "a/b",
    "seed": "-1",
    "max_steps": "0",
    "learning_rate": "0",
    "lr_scheduler_type": "exponential",
    "warmup_steps": "-1",
    "weight_decay": "-0.1",
    "adam_beta1": "1.0",
    "adam_beta2": "-0.5",
    "max_grad_norm": "0",
    "gradient_checkpointing": "maybe",
    "per_device_train_batch_size": "0",
    "steps_per_generation": "0",
    "num_iterations": "0",
    "max_staleness": "-1",
    "num_generations": "1",
    "max_completion_length": "0",
    "temperature": "0",
    "top_p": "1.5",
    "top_k": "-1",
    "loss_type": "ppo",
    "importance_sampling_level": "batch",
    "epsilon": "-0.1",
    "epsilon_high": "-0.2",
    "delta": "0",
    "beta": "-0.1",
    "use_bias_correction_kl": "maybe",
    "top_entropy_quantile": "1.5",
    "sapo_temperature_pos": "0",
    "sapo_temperature_neg": "-1",
    "vllm_importance_sampling_correction": "maybe",
    "vllm_importance_sampling_mode": "token",
    "vllm_importance_sampling_clip_max": "0",
    "vllm_importance_sampling_clip_min": "-1",
    "scale_rewards": "global",
    "mask_truncated_completions": "maybe",
    "save_steps": "0",
    "eval_steps": "0",
    "report_to": "[]",
    "save_total_limit": "0",
    "resume_from_checkpoint": '""',
    "reward_funcs": "[no_colon]",
    "tools": "[no_colon]",
    "agent": "no_colon",
    "environment_factory": "no_colon",
    "advantage": "step",
    "gamma": "1.5",
    "state_advantage_weight": "-0.5",
    "max_tool_calling_iterations": "0",
    "model.name_or_path": '""',
    "model.dtype": "float64",
    "model.attn_implementation": "flash",
    "model.build_tiny": "huge",
    "model.build_seed": "-1",
    "data.name": '""',
    "data.config_name": '""',
    "data.split": '""',
    "data.num_generated": "0",
    "data.prompt_template": '""',
    "data.system_prompt": '""',
    "data.use_chat_template": "maybe",
    "data.chat_template_kwargs": "[enable_thinking]",
    "data.max_prompt_length": "0",
    "data.eval_split": '""',
    "data.num_eval": "0",
    "lora.merge": "maybe",
    "lora.r": "0",
    "lora.lora_alpha": "0",
    "lora.lora_dropout": "2",
    "lora.target_modules": "[]",
    "lora.bias": "all",
    "lora.use_rslora": "maybe",
    "lora.use_dora": "true",
    "lora.modules_to_save": "[]",
    "lora.init_lora_weights": "maybe",
    "lora.target_parameters": "[]",
    "vllm.kv_cache_gb": "0",
    "vllm.gpu_memory_utilization": "1.5",
    "vllm.enable_sleep_mode": "maybe",
    "vllm.enforce_eager": "maybe",
    "vllm.max_num_seqs": "0",
    "vllm.max_num_batched_tokens": "0",
    "vllm.max_lora_rank": "24",
    "vllm.mode": "remote",
    "vllm.server_url": "127.0.0.1:8000",
    "vllm.server_base_on_device": "maybe",
    "vllm.server_tensor_parallel_size": "0",
    "vllm.server_timeout": "0",
    "vllm.max_logprob_diff": "0",
    "vllm.verify_sync": "maybe",
    "vllm.sync_precision_stats": "maybe",
    "vllm.sync": "maybe",
    "padding.legacy_slice": "maybe",
    "padding.logprob_chunk_size": "0",
    "tool_calling.timeout_s": "0",
    "tool_calling.max_consecutive_failures": "0",
    "tool_calling.agent_timeout_s": "0",
    "tool_calling.max_output_chars": "0",
    "tool_calling.retokenize": "maybe",
    "tool_calling.schedule": "per_batch",
    "tool_calling.max_concurrent": "0",
    "tool_calling.parser": "hermes2",
    "data.key_chain_hops": "101",
    "tool_calling.min_turn_tokens": "0",
    "tool_calling.truncated_turn": "continue",
    "tool_calling.overflow_reward": "low",
    "tool_calling.baseline_excludes_truncated": "maybe",
}


def dotted_fields(cls, prefix: str = "") -> set[str]:
    names = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or f.name in ("model", "data", "lora", "vllm", "padding", "tool_calling"):
            names |= dotted_fields(typing.get_type_hints(cls)[f.name], f"{prefix}{f.name}.")
        else:
            names.add(prefix + f.name)
    return names


def test_every_field_is_declared_with_its_help():
    sections = [
        RecipeConfig,
        *(typing.get_type_hints(RecipeConfig)[name] for name in ("model", "data", "lora", "vllm", "padding")),
    ]
    missing = [
        f"{cls.__name__}.{f.name}" for cls in sections for f in dataclasses.fields(cls) if not f.metadata.get("help")
    ]
    assert not missing, missing


def test_the_bad_value_table_covers_every_field():
    assert dotted_fields(RecipeConfig) == set(BAD_VALUES), dotted_fields(RecipeConfig) ^ set(BAD_VALUES)


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_every_field_refuses_a_bad_value_by_name(key):
    """Checked when the config is loaded, before any work: the message names the key and its value."""
    with pytest.raises(ConfigError, match=rf"\b{key.split('.')[-1]}\b"):
        load_config(None, [f"{key}={BAD_VALUES[key]}"])


def test_a_config_error_is_one_line_from_one_process_with_exit_code_2(tmp_path):
    proc = run_recipe(tmp_path, "epsilon=-0.1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: epsilon=-0.1 is out of range: it must be in (0, 1)", proc.stderr[-3000:]
    launched = subprocess.run(
        launch_command(tmp_path, "unused", "top_p=1.5"),
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode != 0
    line = "error: top_p=1.5 is out of range: it must be in (0, 1]"
    ours = [text for text in launched.stderr.splitlines() if text.startswith("error:")]
    assert ours == [line], launched.stderr[-3000:]  # rank 0 only
    assert "[rank" not in launched.stderr  # no traceback from the recipe's processes (the launcher adds its summary)
    assert f"traceback : {line}" in launched.stderr  # the launcher's summary names the line (torchelastic's error file)
    # within a second: the config check imports none of the slow libraries
    probe = "import sys, grpo.config, grpo.exits; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert imported.stdout.strip() == "[]", imported.stdout + imported.stderr[-3000:]


def test_a_lora_target_that_matches_nothing_is_refused_before_the_model_loads(tmp_path, tiny_model):
    proc = run_recipe(
        tmp_path, f"model.name_or_path={tiny_model}", "model.build_tiny=null", "lora.target_modules=[q_proj, nope_proj]"
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: lora.target_modules=['q_proj', 'nope_proj'] names ['nope_proj'], which match nothing in {tiny_model}; "
        "its decoder layers hold ['act_fn', 'down_proj', 'gate_proj', 'input_layernorm', 'k_norm', 'k_proj', 'mlp', "
        "'o_proj', 'post_attention_layernorm', 'q_norm', 'q_proj', 'self_attn', 'up_proj', 'v_proj']"
    ], proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run folder, the data and the model


def test_the_bare_command_without_a_model_says_how_to_run_the_embedded_default(tmp_path, monkeypatch):
    from grpo.run import hub_reachable_or_cached

    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "grpo_qwen3_4b.py")],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: model.name_or_path='Qwen/Qwen3-4B' does not exist locally and HF_HUB_OFFLINE=1")
    assert line.endswith("recipes/grpo_qwen3_4b.py --config recipes/configs/tiny_cpu.yaml"), line
    assert not (tmp_path / "runs").exists()
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://hub.invalid")  # a name that never resolves
    assert not hub_reachable_or_cached("Qwen/Qwen3-4B")


def test_fp16_under_accelerates_bf16_mixed_precision_is_refused(monkeypatch):
    """mixed_precision='bf16' would compute in bf16 on fp16 weights, without loss scaling: refused before any work."""
    from grpo.run import setup

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    cfg = load_config(
        str(Path(__file__).resolve().parents[1] / "recipes/configs/tiny_cpu.yaml"), ["model.dtype=float16"]
    )
    with pytest.raises(ConfigError, match=r"model\.dtype=float16 with accelerate's mixed_precision='bf16'"):
        setup(cfg)


def test_a_config_file_that_is_not_yaml_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  r: [8\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: .*line 3") as caught:
        load_config(bad)
    assert str(bad) in str(caught.value) and "\n" not in str(caught.value)


def test_output_dir_and_the_embedded_models_place_are_checked_before_any_work(tmp_path, monkeypatch):
    from grpo.run import check_paths

    monkeypatch.chdir(tmp_path)  # the embedded default's cache/ is the working folder's
    tiny = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for overrides, error in (
        ([f"output_dir={a_file}"], "is a file, not a folder"),
        ([f"output_dir={a_file}/runs"], "cannot be created: Not a directory"),
        (["model.name_or_path=/nonexistent/model"], r"builds the embedded default under .*cache only"),
    ):
        with pytest.raises(ConfigError, match=error):
            check_paths(load_config(tiny, overrides), rank=0)
    check_paths(load_config(tiny, [f"output_dir={tmp_path}/new/runs"]), rank=0)  # the control: it can be made
    assert not (tmp_path / "new").exists() and not Path("/nonexistent").exists()  # nothing left behind
    proc = run_recipe(tmp_path, "model.build_tiny=null", f"output_dir={a_file}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: output_dir={str(a_file)!r} is a file, not a folder"]
    # under the launcher every rank refuses with rank 0's finding: no rank is left waiting for rank 0 in a collective
    launched = subprocess.run(
        launch_command(Path(a_file), "unused"),
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert [line for line in launched.stderr.splitlines() if line.startswith("error:")] == [
        f"error: output_dir={str(a_file)!r} is a file, not a folder"
    ], launched.stderr[-3000:]
    assert "[rank" not in launched.stderr, launched.stderr[-3000:]
