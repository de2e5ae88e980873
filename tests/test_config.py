"""Recipe config: TRL/peft names, typed loading, clear errors naming the bad key or value."""

import dataclasses
from pathlib import Path

import pytest
import trl
from peft import LoraConfig

from grpo_config import ConfigError, LoraSettings, RecipeConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_fields_are_trl_grpo_config_names():
    trl_names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    sections = {"model", "data", "lora", "vllm", "padding"}
    ours = {f.name for f in dataclasses.fields(RecipeConfig)} - sections - {"reward_funcs"}  # GRPOTrainer's argument
    assert ours <= trl_names, ours - trl_names


def test_lora_fields_are_peft_lora_config_names():
    peft_names = {f.name for f in dataclasses.fields(LoraConfig)}
    ours = {f.name for f in dataclasses.fields(LoraSettings)} - {"merge"}
    assert ours <= peft_names, ours - peft_names


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.prompts_per_rank >= 1


def test_overrides_are_typed():
    config = load_config(None, ["lora.merge=false", "learning_rate=1e-5", "lora.target_modules=[q_proj]",
                                "epsilon_high=0.28", "model.build_tiny=null"])
    assert config.lora.merge is False and config.learning_rate == 1e-5 and isinstance(config.learning_rate, float)
    assert config.lora.target_modules == ["q_proj"] and config.epsilon_high == 0.28 and config.model.build_tiny is None


@pytest.mark.parametrize("override, message", [
    ("lora.merg=false", "unknown config key 'lora.merg'; did you mean 'lora.merge'?"),
    ("learnin_rate=1e-5", "did you mean 'learning_rate'?"),
    ("learning_rate=fast", "learning_rate='fast' must be a number"),
    ("lora.r=true", "lora.r=True must be of type int"),
    ("lora.merge=maybe", "lora.merge='maybe' must be of type bool"),
    ("lora.target_modules=q_proj", "lora.target_modules='q_proj' must be a list of str"),
    ("loss_type=ppo", "loss_type='ppo' is not allowed; choose one of"),
    ("model.dtype=float16", "model.dtype='float16' is not allowed"),
    ("num_generations=3", "must be a multiple of num_generations=3"),
    ("num_generations=1", "num_generations=1 must be >= 2"),
    ("temperature=0", "temperature=0.0 must be > 0"),
    ("vllm=3", "vllm must be a mapping"),
    ("nokey", "override 'nokey' must look like key=value"),
])
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
