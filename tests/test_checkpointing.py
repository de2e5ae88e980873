"""Checkpoints: atomic writes (a failed save loses nothing), exact restore, rotation, refusals before any work."""

import errno
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from peft import PeftModel
from qwen3_lora import tiny_lora, tiny_qwen3
from recipe_runs import run_recipe

from grpo import checkpointing
from grpo.checkpointing import list_checkpoints, load_checkpoint, resolve_checkpoint, save_checkpoint
from grpo.config import ConfigError, load_config
from grpo.engines.colocated import check_vllm_lora_targets
from grpo.parallel import fsdp_settings

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"learning_rate": 1e-3, "lora": {"r": 8}, "max_steps": 10}


def trained(seed: int = 0):
    """A LoRA model, its AdamW and scheduler after one update (non-trivial optimizer state)."""
    model = tiny_lora(seed=seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (update + 1))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return model, optimizer, scheduler


def lora_params(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def save(run_dir, model, optimizer, scheduler, step, limit=None):
    state = dict(step=step, global_step=4 * step)
    return save_checkpoint(run_dir, model, optimizer, scheduler, state, CONFIG, rank=0, save_total_limit=limit)


def test_restores_adapter_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = trained()
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    path = save(tmp_path, model, optimizer, scheduler, step=1)
    expected = torch.rand(3), np.random.randint(2**31, size=3), random.random()  # vLLM's V2 runner draws numpy seeds
    assert path.name == "checkpoint-4"
    fresh, fresh_optimizer, fresh_scheduler = trained(seed=1)  # other weights, other optimizer state
    state = load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler, CONFIG, rank=0)
    assert state["step"] == 1 and state["global_step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(lora_params(model), lora_params(fresh)))
    for param, fresh_param in zip(optimizer.param_groups[0]["params"], fresh_optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state[param].items():
            assert torch.equal(value, fresh_optimizer.state[fresh_param][key]), key
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    np.random.seed(0)
    random.seed(0)  # moved on since the save
    load_checkpoint(path, fresh, fresh_optimizer, fresh_scheduler, CONFIG, rank=0)
    assert torch.equal(torch.rand(3), expected[0])  # every RNG continues where it was saved
    assert np.array_equal(np.random.randint(2**31, size=3), expected[1]) and random.random() == expected[2]
    # the checkpoint's adapter is a peft adapter
    loaded = PeftModel.from_pretrained(tiny_qwen3(), str(path))
    assert torch.equal(
        dict(loaded.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"],
        dict(model.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"],
    )


@pytest.mark.parametrize("fail_in", ["save_file", "save"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    model, optimizer, scheduler = trained()
    good = save(tmp_path, model, optimizer, scheduler, step=1)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    model2, optimizer2, scheduler2 = trained(seed=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = checkpointing if fail_in == "save_file" else checkpointing.torch
    monkeypatch.setattr(target, fail_in, disk_full)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, model2, optimizer2, scheduler2, step=2, limit=1)  # limit=1: rotation would delete `good`
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, model2, optimizer2, scheduler2, step=1)  # overwriting the same step fails too
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]  # no half-written folder
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    fresh, fresh_optimizer, fresh_scheduler = trained(seed=2)
    load_checkpoint(good, fresh, fresh_optimizer, fresh_scheduler, CONFIG, rank=0)
    assert all(torch.equal(a, b) for a, b in zip(lora_params(model), lora_params(fresh)))


def test_save_total_limit_keeps_the_newest(tmp_path):
    model, optimizer, scheduler = trained()
    for step in (1, 2, 3, 10):
        save(tmp_path, model, optimizer, scheduler, step=step, limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-12", "checkpoint-40"]
    assert resolve_checkpoint("last", tmp_path).name == "checkpoint-40"


def test_resume_refuses_another_config_and_incomplete_checkpoints(tmp_path):
    model, optimizer, scheduler = trained()
    path = save(tmp_path, model, optimizer, scheduler, step=1)
    changed = {**CONFIG, "learning_rate": 5e-3, "max_steps": 20, "lora": {"r": 16}}
    with pytest.raises(ValueError, match=r"learning_rate: 0.001 -> 0.005; lora.r: 8 -> 16"):
        load_checkpoint(path, *trained(seed=1), changed, rank=0)
    load_checkpoint(path, *trained(seed=1), {**CONFIG, "max_steps": 20}, rank=0)  # a longer run may resume
    (path / "optimizer.pt").unlink()
    with pytest.raises(ConfigError, match=r"not a complete checkpoint \(missing \['optimizer.pt'\]\)"):
        resolve_checkpoint(str(path), tmp_path)
    with pytest.raises(ConfigError, match="holds no checkpoint-<N>"):
        resolve_checkpoint("last", tmp_path / "empty")


def test_a_new_run_beside_earlier_checkpoints_goes_to_the_next_free_folder(tmp_path, tiny_model):
    """run/ and run-2/ hold checkpoints: a new run writes to run-3/ and says so (it stops later, at the reward)."""
    (tmp_path / "run" / "checkpoint-8").mkdir(parents=True)
    (tmp_path / "run-2" / "checkpoint-4").mkdir(parents=True)
    proc = run_recipe(
        tmp_path, f"model.name_or_path={tiny_model}", "model.build_tiny=null", "reward_funcs=[no_such_module:reward]"
    )
    assert proc.returncode == 2 and "reward_funcs entry 'no_such_module:reward' cannot be imported" in proc.stderr
    assert (
        f"{tmp_path / 'run'} already holds a run (checkpoint-8), so this one writes to {tmp_path / 'run-3'}; "
        "to continue that run instead, add resume_from_checkpoint=last"
    ) in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "run-3" / "train.log").is_file()
    assert yaml.safe_load((tmp_path / "run-3" / "config.yaml").read_text())["run_name"] == "run-3"
    proc = run_recipe(tmp_path, "model.build_tiny=null", "resume_from=/no/such/checkpoint")
    assert proc.returncode != 0 and "resume_from_checkpoint='/no/such/checkpoint'" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-8").is_dir()


def test_missing_model_path_is_named(tmp_path):
    proc = run_recipe(tmp_path, "model.build_tiny=null", "model.name_or_path=/no/such/model", offline=False)
    assert proc.returncode != 0
    assert "model.name_or_path='/no/such/model' does not exist locally" in proc.stderr, proc.stderr[-3000:]


def test_fsdp_version_1_accelerate_config_is_refused():
    with pytest.raises(ConfigError, match="fsdp_version='1' is not supported: this recipe shards with FSDP2 only"):
        fsdp_settings({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})


def test_vllm_lora_targets_are_checked():
    check_vllm_lora_targets(tiny_qwen3(), ["q_proj", "down_proj"])
    with pytest.raises(ConfigError, match=r"cannot serve LoRA on lora.target_modules \['lm_head'\]"):
        check_vllm_lora_targets(tiny_qwen3(), ["q_proj", "lm_head"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.use_dora=true"], "lora.use_dora=True is not supported"),
        (["lora.merge=false", "lora.r=64", "vllm.max_lora_rank=32"], "lora.r=64 exceeds vllm.max_lora_rank=32"),
        (["lora.merge=false", "lora.r=1024"], "vLLM allows ranks up to 512"),
        (["lora.merge=false", "lora.modules_to_save=[lm_head]"], "vLLM's LoRA cannot serve lora.modules_to_save"),
        (["save_total_limit=0"], "save_total_limit=0 is out of range: it must be >= 1 or null"),
    ],
)
def test_adapters_vllm_or_merge_cannot_serve_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_resume_from_alias():
    assert load_config(None, ["resume_from=last"]).resume_from_checkpoint == "last"


def test_dataset_without_the_reward_columns_is_refused(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "What is 2+2?", "solution": "4"}\n')
    tiny_qwen3().config.save_pretrained(tmp_path / "model")  # a model config (its weights are never read)
    proc = run_recipe(
        tmp_path, "model.build_tiny=null", f"model.name_or_path={tmp_path / 'model'}", f"data.name={data}"
    )
    assert proc.returncode != 0
    assert re.search(
        r"lacks column\(s\) \['answer'\] that reward_funcs .* it has \['question', 'solution'\]", proc.stderr
    ), proc.stderr[-3000:]
