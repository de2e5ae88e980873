"""Recipe configuration: YAML file + dotted command-line overrides -> typed, validated dataclasses.

Top-level GRPO fields carry TRL's ``GRPOConfig`` names (a test checks every one of them exists there);
``lora:`` carries peft's ``LoraConfig`` names plus ``merge``. Unknown keys and ill-typed values fail
before any work starts, with a message naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from grpo.loss import check_supported as check_supported_loss


class ConfigError(ValueError):
    """A recipe config or override is invalid; the message names the key and what is allowed."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
# vllm.max_logprob_diff when unset, per model.dtype. Measured (2 processes, merge on and off; results/README.md): a
# working sync's mean |vLLM - trainer| log-prob is ~3e-7 in fp32, 1.2-2.1e-4 in fp16 and 0.4-2e-3 in bf16 on the
# embedded default, ~9e-3 in bf16 on the 2-layer Qwen3-4B slice (random weights, a 151,936-way softmax); a skipped
# sync reaches 2.3e-2 within 3 rollout steps at lr 1e-3 in bf16 on the embedded default. The guard also allows 10x
# the first step's own figure (grpo/faults.py), so a model whose kernels differ more is not stopped by these floors.
MAX_LOGPROB_DIFF = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
ALIASES = {"resume_from": "resume_from_checkpoint"}  # short names accepted in overrides


@dataclass
class ModelSettings:
    name_or_path: str = "Qwen/Qwen3-4B"
    # trainer compute and vLLM dtype: float32 | bfloat16 | float16 (fp16: dynamic loss scaling, grpo/loss_scaling.py);
    # the LoRA weights and the optimizer stay fp32 in every case
    dtype: str = "bfloat16"
    # packed_sdpa (padding/packed_attention.py): each packed sample attends within itself; sdpa/eager spend T^2 on a
    # block-diagonal mask instead (the update phase takes 1.6x as long on the embedded default: results/attention.json)
    attn_implementation: str = "packed_sdpa"
    build_tiny: str | None = None  # "tiny" | "small": build the embedded default into name_or_path if absent
    build_seed: int = 0


@dataclass
class DataSettings:
    name: str = "openai/gsm8k"  # hub id or local path, or "generated" for the embedded GSM8K-style problems
    config_name: str | None = "main"
    split: str = "train"
    num_generated: int = 4096  # problems made when name == "generated"
    prompt_template: str = "{question}"
    system_prompt: str | None = None
    use_chat_template: bool = True
    max_prompt_length: int = 256  # tokens; longer prompts are dropped with a counted warning
    eval_split: str | None = "test"  # held-out split for eval_steps ("generated": other problems than training's)
    num_eval: int = 256  # held-out problems per evaluation (at most)


@dataclass
class LoraSettings:
    """peft ``LoraConfig`` names, plus ``merge`` (True: vLLM serves merged weights; False: a LoRARequest)."""

    merge: bool = True
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    init_lora_weights: bool = True
    target_parameters: list[str] | None = None  # LoRA on parameters, e.g. fused MoE experts [mlp.experts.gate_up_proj]


@dataclass
class VLLMSettings:
    """The vLLM engine (TRL's ``vllm_*`` names, without the prefix, where TRL has them)."""

    # colocate: one in-process engine per training rank; server: a separate `vllm serve` at server_url that the
    # trainer syncs with LoRA-sized transfers (docs/server.md). The settings below that size an engine are colocate's
    mode: str = "colocate"
    server_url: str = "http://127.0.0.1:8000"  # vllm.mode=server: the server's address
    kv_cache_gb: float = 2.0  # explicit KV-cache size (vLLM's own sizing fails on small CPU machines)
    gpu_memory_utilization: float = 0.3  # GPU only: vLLM needs this share of the GPU free at start (TRL's default)
    enable_sleep_mode: bool = False  # GPU only: release weights and KV cache while the trainer updates (as TRL)
    enforce_eager: bool = True
    # sequences one engine batches at once; null: what a rollout or an evaluation gives one rank (as TRL sizes it)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 4096  # tokens per engine step (TRL's value; at least max_model_len)
    max_lora_rank: int | None = None  # merge=false: defaults to lora.r
    # stop when the mean |vLLM - trainer| old log-prob exceeds this (a broken sync); null: the model.dtype's default
    max_logprob_diff: float | None = None
    verify_sync: bool = False  # hash the trainer's weights around every sync (metric sync_changed_trainer)
    # merge=true below fp32: how much of the LoRA update survives the cast of the merged weights (sync_delta_* metrics)
    sync_precision_stats: bool = True
    sync: bool = True  # false only to prove that a skipped sync is detected


@dataclass
class PaddingSettings:
    legacy_slice: bool = False  # reproduce the seed's bug (current log-probs sliced [:, -R-1:-1]); plots only
    # LM-head rows per chunk when computing log-probs (padding.packed_log_probs): only the response positions are
    # projected, chunk by chunk, recomputed in the backward; null: every position's full-vocabulary logits at once
    logprob_chunk_size: int | None = 512


@dataclass
class RecipeConfig:
    # --- TRL GRPOConfig names ---
    output_dir: str = "results"
    run_name: str = "grpo"
    seed: int = 42
    max_steps: int = 100
    learning_rate: float = 1e-5
    lr_scheduler_type: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = True  # recompute each decoder layer's activations in the backward (TRL's default)
    per_device_train_batch_size: int = 8  # completions per rank per optimizer step (one mini-batch)
    steps_per_generation: int = 4  # mini-batches (optimizer steps) per rollout, per iteration
    num_iterations: int = 1  # passes over each rollout
    num_generations: int = 8  # completions per prompt (the group)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # --- the loss (grpo/loss.py: TRL 1.16's GRPOTrainer._compute_loss, same names, defaults, meaning) ---
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None  # two-sided clipping: the unclipped ratio is capped at delta (> 1 + epsilon_high)
    beta: float = 0.0  # k3 KL to the reference (the base, adapter disabled); 0 = no reference forward
    use_bias_correction_kl: bool = True  # the KL term times the policy ratio (TRL's default)
    top_entropy_quantile: float = 1.0  # < 1: only this top fraction of tokens by entropy gets a policy gradient
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # trainer-over-vLLM probability of the sampled tokens weighs the loss (corrects the engine/trainer mismatch)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"  # {token,sequence}_{truncate,mask}
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    scale_rewards: str = "group"  # group | batch | none
    mask_truncated_completions: bool = False
    save_steps: int = 50  # checkpoint when global_step passes a multiple of this (and at the end)
    eval_steps: int | None = None  # evaluate on held-out problems before training, every N optimizer steps, at the end
    report_to: list[str] = field(default_factory=lambda: ["none"])  # trackers: none | all | tensorboard | wandb | ...
    save_total_limit: int | None = 2  # keep the newest N checkpoints (None: all)
    resume_from_checkpoint: str | None = None  # a checkpoint-<N> folder, or "last" (alias: resume_from)
    # GRPOTrainer's reward_funcs, as 'module:function' (TRL signature: f(completions, **columns) -> list[float])
    reward_funcs: list[str] = field(default_factory=lambda: ["grpo.tiny_gsm8k:gsm8k_exact_answer_reward"])
    # --- sections ---
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    padding: PaddingSettings = field(default_factory=PaddingSettings)

    @property
    def prompts_per_rank(self) -> int:
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations

    def max_logprob_diff(self) -> float:
        """vllm.max_logprob_diff, or its default for model.dtype."""
        if self.vllm.max_logprob_diff is not None:
            return self.vllm.max_logprob_diff
        return MAX_LOGPROB_DIFF[self.model.dtype]

    def validate(self) -> None:
        """Every field's range (`RANGES`, `CHOICES`), then the rules that tie fields together."""
        for key, (check, allowed) in RANGES.items():
            value = _get(self, key)
            if value is not None and not check(value):
                raise ConfigError(f"{key}={value!r} is out of range: it must be {allowed}")
        for key, allowed in CHOICES.items():
            if _get(self, key) not in allowed:
                raise ConfigError(f"{key}={_get(self, key)!r} is not allowed; choose one of {list(allowed)}")
        rollout = self.per_device_train_batch_size * self.steps_per_generation
        if rollout % self.num_generations:
            raise ConfigError(
                f"per_device_train_batch_size * steps_per_generation = {rollout} completions per rank must be a "
                f"multiple of num_generations={self.num_generations} (whole groups per rank)"
            )
        try:
            check_supported_loss(self)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.lora.use_dora:
            raise ConfigError("lora.use_dora=True is not supported: merge/ (lora.merge=true) and vLLM's LoRA "
                              "(lora.merge=false) both serve plain LoRA only")
        if not self.lora.merge:
            limit = self.vllm.max_lora_rank or self.lora.r
            if self.lora.r > limit or self.lora.r > VLLM_LORA_RANKS[-1]:
                raise ConfigError(f"lora.merge=false: lora.r={self.lora.r} exceeds vllm.max_lora_rank={limit} "
                                  f"(vLLM allows ranks up to {VLLM_LORA_RANKS[-1]}: {list(VLLM_LORA_RANKS)})")
            if self.lora.target_parameters:
                raise ConfigError(f"lora.merge=false: vLLM's LoRA cannot serve lora.target_parameters="
                                  f"{self.lora.target_parameters} (LoRA on parameters, e.g. fused MoE experts); use "
                                  "lora.merge=true (merged weights include them)")
            if self.lora.modules_to_save:
                raise ConfigError(f"lora.merge=false: vLLM's LoRA cannot serve lora.modules_to_save="
                                  f"{self.lora.modules_to_save}; use lora.merge=true (merged weights include them)")


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _at_least(low):
    return lambda v: v >= low


def _above(low):
    return lambda v: v > low


def _between(low, high):  # low <= v <= high
    return lambda v: low <= v <= high


# The range of every numeric or free-form field (None passes where the type allows it); bools and lists of names
# are checked by type, the fields with a fixed set of values by CHOICES, the loss's by grpo_loss.check_supported.
RANGES = {
    "output_dir": (bool, "a non-empty path"),
    "run_name": (lambda v: bool(v) and "/" not in v, "a non-empty name without '/'"),
    "seed": (_at_least(0), ">= 0"),
    "max_steps": (_at_least(1), ">= 1"),
    "learning_rate": (_above(0), "> 0"),
    "warmup_steps": (_at_least(0), ">= 0"),
    "weight_decay": (_at_least(0), ">= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_grad_norm": (_above(0), "> 0"),
    "per_device_train_batch_size": (_at_least(1), ">= 1"),
    "steps_per_generation": (_at_least(1), ">= 1"),
    "num_iterations": (_at_least(1), ">= 1"),
    "num_generations": (_at_least(2), ">= 2 (GRPO normalizes within a group)"),
    "max_completion_length": (_at_least(1), ">= 1"),
    "temperature": (_above(0), "> 0 (log-probs are of the tempered policy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (_at_least(0), ">= 0 (0: off)"),
    "epsilon": (lambda v: 0 < v < 1, "in (0, 1)"),
    "epsilon_high": (_above(0), "> 0"),
    "delta": (_above(0), "> 0"),
    "beta": (_at_least(0), ">= 0"),
    "top_entropy_quantile": (_between(0, 1), "in [0, 1]"),
    "sapo_temperature_pos": (_above(0), "> 0"),
    "sapo_temperature_neg": (_above(0), "> 0"),
    "vllm_importance_sampling_clip_max": (_above(0), "> 0"),
    "vllm_importance_sampling_clip_min": (_at_least(0), ">= 0"),
    "save_steps": (_at_least(1), ">= 1"),
    "save_total_limit": (_at_least(1), ">= 1 or null (keep all)"),
    "eval_steps": (_at_least(1), ">= 1 or null (no evaluation)"),
    "resume_from_checkpoint": (bool, "a checkpoint folder or 'last'"),
    "reward_funcs": (lambda v: bool(v) and all(":" in f for f in v), "a non-empty list of 'module:function'"),
    "report_to": (bool, "a non-empty list (['none'] for no tracker)"),
    "model.name_or_path": (bool, "a hub id or a local path"),
    "model.build_seed": (_at_least(0), ">= 0"),
    "data.name": (bool, "a hub id, a local path or 'generated'"),
    "data.config_name": (bool, "a dataset config name or null"),
    "data.split": (bool, "a split name"),
    "data.num_generated": (_at_least(1), ">= 1"),
    "data.prompt_template": (bool, "a non-empty format string, e.g. '{question}'"),
    "data.system_prompt": (bool, "a non-empty text or null"),
    "data.max_prompt_length": (_at_least(1), ">= 1"),
    "data.eval_split": (bool, "a split name or null"),
    "data.num_eval": (_at_least(1), ">= 1"),
    "lora.r": (_at_least(1), ">= 1"),
    "lora.lora_alpha": (_above(0), "> 0"),
    "lora.lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora.target_modules": (bool, "a non-empty list of module names"),
    "lora.modules_to_save": (bool, "a non-empty list of module names or null"),
    "lora.target_parameters": (bool, "a non-empty list of parameter names or null"),
    "vllm.kv_cache_gb": (_above(0), "> 0"),
    "vllm.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "vllm.max_num_seqs": (_at_least(1), ">= 1"),
    "vllm.max_num_batched_tokens": (_at_least(1), ">= 1"),
    "padding.logprob_chunk_size": (_at_least(1), ">= 1 (or null: full logits)"),
    "vllm.max_lora_rank": (lambda v: v in VLLM_LORA_RANKS, f"one of vLLM's {list(VLLM_LORA_RANKS)}"),
    "vllm.max_logprob_diff": (_above(0), "> 0"),
    "vllm.server_url": (lambda v: v.startswith(("http://", "https://")), "an http(s):// URL (http://127.0.0.1:8000)"),
}
CHOICES = {
    "lr_scheduler_type": ("constant", "linear", "cosine"),
    "scale_rewards": ("group", "batch", "none"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": ("packed_sdpa", "sdpa", "eager", "flash_attention_2"),
    "model.build_tiny": (None, "tiny", "small", "tiny-moe"),
    "lora.bias": ("none",),
    "vllm.mode": ("colocate", "server"),
}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value, tp, key: str):
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats. Returns the value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {tp}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list of {_type_name(item_tp)}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads "1e-5" (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} must be of type {_type_name(tp)}, got {type(value).__name__}")
    return value


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {prefix + key!r}{hint} Allowed keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def _set_dotted(data: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[leaf] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """Load a recipe YAML and apply ``key=value`` / ``section.key=value`` overrides (values parsed as YAML)."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. lora.merge=false)")
        key = ALIASES.get(key.strip(), key.strip())
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:  # e.g. "Q: {question}": not YAML, but a fine string
            value = raw
        _set_dotted(data, key, value)
    config = _build(RecipeConfig, data)
    config.validate()
    return config


def config_to_dict(config: RecipeConfig) -> dict:
    return dataclasses.asdict(config)
