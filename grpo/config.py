"""Recipe configuration: YAML file + dotted command-line overrides -> typed, validated dataclasses.

Top-level GRPO fields carry TRL's ``GRPOConfig`` names (a test checks every one of them exists there);
``lora:`` carries peft's ``LoraConfig`` names plus ``merge``. Each field is declared once, TRL-style, with its
help and its rule in ``field(metadata=...)``: ``range`` (``">= 1"``, ``"in (0, 1]"``, ...; for a text or a list,
what it must hold: any non-empty value, or what ``check`` accepts) or ``choices``. Unknown keys and ill-typed or
out-of-range values fail before any work starts, with a message naming the key, the value and what is allowed.

The fields and the rules that tie them together are here; reading the YAML, the overrides, the type checks and
`ConfigError` (importable from this module as well) are in grpo/config_parsing.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from grpo.config_parsing import (
    ConfigError,
    apply_overrides,
    build_dataclass,
    check_rule,
    field_leaves,
    read_config_file,
    section,
    setting,
)
from grpo.loss_settings import SUPPORTED_VALUES
from grpo.loss_settings import check_supported as check_supported_loss

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
# vllm.max_logprob_diff when unset, per model.dtype. Measured (results/README.md): a working sync's mean |vLLM -
# trainer| log-prob is ~3e-7 in fp32, 1.2-2.0e-4 in fp16, 0.4-2e-3 in bf16 on the embedded default and ~9e-3 in bf16
# on the 2-layer Qwen3-4B slice; a skipped sync reaches 2.3e-2 within 3 rollout steps at lr 1e-3 in bf16. The guard
# also allows 10x the first step's own figure (grpo/faults.py): kernels that differ more are not stopped by these.
MAX_LOGPROB_DIFF = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
ALIASES = {"resume_from": "resume_from_checkpoint"}  # short names accepted in overrides


@dataclass
class ModelSettings:
    name_or_path: str = setting(
        "Qwen/Qwen3-4B", "hub id or local path of the base model", range="a hub id or a local path"
    )
    dtype: str = setting(
        "bfloat16",
        "trainer compute and vLLM dtype (float16: dynamic loss scaling, "
        "grpo/loss_scaling.py); the LoRA weights and the optimizer stay fp32 in every case",
        choices=("float32", "bfloat16", "float16"),
    )
    attn_implementation: str = setting(
        "packed_sdpa",
        "packed_sdpa (padding/packed_attention.py): each packed sample attends within itself; "
        "sdpa/eager spend T^2 on a block-diagonal mask instead (the update phase takes 1.6x as long on the embedded "
        "default: results/attention.json)",
        choices=("packed_sdpa", "sdpa", "eager", "flash_attention_2"),
    )
    build_tiny: str | None = setting(
        None,
        "build the embedded default of this size into name_or_path if absent (tiny-tools: the tool-use task's "
        "model, grpo/tasks/tiny_tools.py; tiny-key-chain: the key-chain task's, grpo/tasks/tiny_key_chain.py; "
        "tiny-guess: guess-the-number's, grpo/tasks/tiny_guess.py)",
        choices=("tiny", "small", "tiny-moe", "tiny-tools", "tiny-key-chain", "tiny-guess"),
    )
    build_seed: int = setting(0, "seed of the embedded default's build", range=">= 0")


@dataclass
class DataSettings:
    name: str = setting(
        "openai/gsm8k",
        "hub id or local path, or 'generated' for the embedded GSM8K-style problems ('generated-tools': the tool "
        "task's products, 'generated-key-chain': grpo/tasks/key_chain.py's chains, 'generated-guess': "
        "grpo/tasks/guess_number.py's games)",
        range="a hub id, a local path or 'generated'",
    )
    config_name: str | None = setting("main", "the dataset's config name", range="a dataset config name or null")
    split: str = setting("train", "the training split", range="a split name")
    num_generated: int = setting(4096, "problems made when name == 'generated'", range=">= 1")
    key_chain_hops: int = setting(
        8,
        "name == 'generated-key-chain': lookups per problem (grpo/tasks/key_chain.py; k hops are k + 1 model turns)",
        range="in [2, 100]",
    )
    prompt_template: str = setting(
        "{question}",
        "the prompt, formatted from the row's columns",
        range="a non-empty format string, e.g. '{question}'",
    )
    system_prompt: str | None = setting(
        None, "a system message before the prompt (chat template only)", range="a non-empty text or null"
    )
    use_chat_template: bool = setting(True, "format prompts with the tokenizer's chat template")
    chat_template_kwargs: dict = setting(
        {"enable_thinking": False},
        "keyword arguments of the chat template (TRL's name), the same for the prompt and every tool response "
        "(e.g. enable_thinking: true for a thinking template; a template ignores the ones it does not read)",
    )
    max_prompt_length: int = setting(256, "tokens; longer prompts are dropped with a counted warning", range=">= 1")
    eval_split: str | None = setting(
        "test",
        "held-out split for eval_steps ('generated': other problems than training's)",
        range="a split name or null",
    )
    num_eval: int = setting(256, "held-out problems per evaluation (at most)", range=">= 1")


@dataclass
class LoraSettings:
    """peft ``LoraConfig`` names, plus ``merge`` (True: vLLM serves merged weights; False: a LoRARequest)."""

    merge: bool = setting(True, "vLLM serves the merged weights (false: the adapter, as a LoRARequest)")
    r: int = setting(16, "LoRA rank", range=">= 1")
    lora_alpha: int = setting(32, "LoRA scaling numerator (scaling = lora_alpha / r)", range="> 0")
    lora_dropout: float = setting(0.0, "dropout on the LoRA input", range="in [0, 1)")
    target_modules: list[str] = setting(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "modules that get LoRA",
        range="a non-empty list of module names",
    )
    bias: str = setting("none", "LoRA biases (merge/ merges none)", choices=("none",))
    use_rslora: bool = setting(False, "rank-stabilized scaling lora_alpha / sqrt(r)")
    use_dora: bool = setting(False, "DoRA; refused: merge/ and vLLM's LoRA serve plain LoRA only")
    modules_to_save: list[str] | None = setting(
        None, "modules trained in full beside the adapter", range="a non-empty list of module names or null"
    )
    init_lora_weights: bool = setting(True, "peft's initialisation (B = 0)")
    target_parameters: list[str] | None = setting(
        None,
        "LoRA on parameters, e.g. fused MoE experts [mlp.experts.gate_up_proj]",
        range="a non-empty list of parameter names or null",
    )


@dataclass
class VLLMSettings:
    """The vLLM engine: TRL's ``vllm_*`` names without the prefix where TRL has them, grouped by mode as TRL's."""

    # -- both modes ----------------------------------------------------------------------------------------------
    mode: str = setting(
        "colocate",
        "colocate: one in-process engine per training rank; server: a separate `vllm serve` "
        "at server_url, synced with LoRA-sized transfers (docs/server.md)",
        choices=("colocate", "server"),
    )
    max_logprob_diff: float | None = setting(
        None,
        "stop when the mean |vLLM - trainer| old log-prob exceeds this "
        "(a broken sync); null: the model.dtype's default",
        range="> 0",
    )
    verify_sync: bool = setting(False, "hash the trainer's weights around every sync (metric sync_changed_trainer)")
    sync_precision_stats: bool = setting(
        True,
        "merge=true below fp32: how much of the LoRA update survives the merged cast (sync_delta_* metrics, measured "
        "on every 32nd row of each merged tensor)",
    )
    sync: bool = setting(True, "false only to prove that a skipped sync is detected")

    # -- the engine's size: colocate's engine (a server is sized by its flags: the memory plan counts it with these)
    kv_cache_gb: float = setting(2.0, "explicit KV-cache size (vLLM's sizing fails on small CPU machines)", range="> 0")
    gpu_memory_utilization: float = setting(
        0.3, "colocate, GPU only: vLLM needs this share of the GPU free at start (TRL's default)", range="in (0, 1]"
    )
    enable_sleep_mode: bool = setting(False, "colocate, GPU only: free weights and KV cache while the trainer updates")
    enforce_eager: bool = setting(True, "no CUDA graphs / compilation")
    max_num_seqs: int | None = setting(
        None,
        "sequences one engine batches at once; null: what a rollout or an evaluation gives one rank (as TRL sizes it)",
        range=">= 1",
    )
    max_num_batched_tokens: int = setting(4096, "tokens per engine step (TRL's; >= max_model_len)", range=">= 1")
    max_lora_rank: int | None = setting(None, "colocate, merge=false: defaults to lora.r", choices=VLLM_LORA_RANKS)

    # -- only used when mode is server ---------------------------------------------------------------------------
    server_url: str = setting(
        "http://127.0.0.1:8000",
        "server: the server's address",
        range="an http(s):// URL (http://127.0.0.1:8000)",
        check=lambda v: v.startswith(("http://", "https://")),
    )
    server_base_on_device: bool = setting(
        False,
        "server, merge=true: the server keeps its pristine copy of the targeted base weights on its "
        "own devices (no host-to-device copy per sync, as much more device memory) rather than in host memory",
    )
    server_tensor_parallel_size: int = setting(
        1,
        "server: the server's --tensor-parallel-size; each of its workers keeps and merges 1/this of the targeted "
        "base weights (the memory plan's per-worker figures)",
        range=">= 1",
    )
    server_timeout: float = setting(
        60.0,
        "server: seconds of failed health checks (/health) while the trainer waits on the server, then the run stops",
        range="> 0",
    )


@dataclass
class PaddingSettings:
    legacy_slice: bool = setting(
        False,
        "the wrong rule: current log-probs sliced [:, -R-1:-1] "
        "(padding.legacy_slice_response); for the before/after plots only",
    )
    logprob_chunk_size: int | None = setting(
        512,
        "LM-head rows per chunk when computing log-probs (padding.packed_log_probs): only the response "
        "positions are projected, chunk by chunk, recomputed in the backward; null: every position's "
        "full-vocabulary logits at once",
        range=">= 1 (or null: full logits)",
    )


# vLLM 0.32's registered tool parsers that read a finished turn offline (its `openai` one is a stub: gpt-oss calls
# go through its Harmony parser); grpo/episodes/parsers.py maps TRL's template families onto them
VLLM_TOOL_PARSERS = ("hermes", "qwen3_json", "qwen3_xml", "qwen3_coder", "llama3_json", "glm45", "glm47", "lfm2")
VLLM_TOOL_PARSERS += ("gemma4", "deepseek_v3")


@dataclass
class ToolCallingSettings:
    """How the recipe runs the tools of a multi-turn episode (`tools`; grpo/episodes/)."""

    timeout_s: float = setting(10.0, "seconds a tool call may take; then the model gets an error result", range="> 0")
    max_output_chars: int = setting(
        2000, "a tool result longer than this is replaced by an error result (the context is finite)", range=">= 1"
    )
    retokenize: bool = setting(
        False,
        "the wrong rule: train on the conversation re-rendered by the chat template and tokenized again instead "
        "of the sampled ids (the engine's log-probs kept by position); for the comparison plots only",
    )
    schedule: str = setting(
        "per_episode",
        "per_episode: each episode sends its next turn as soon as its own tools return (vllm.mode=server; the "
        "colocated engine, whose offline batch call has no requests in flight, runs per turn either way); per_turn: "
        "each turn waits for every episode of the rollout, then is sent as one batch",
        choices=("per_episode", "per_turn"),
    )
    max_concurrent: int = setting(
        16,
        "episodes of one process whose tools may run at once (per_episode; a call's own tools run together); with "
        "`agent`, agents of one process running at once",
        range=">= 1",
    )
    agent_timeout_s: float = setting(
        300.0,
        "seconds an agent (`agent`) may take for its whole episode; then its session is closed and the episode "
        "scores 0.0 as a failed one",
        range="> 0",
    )
    parser: str = setting(
        "auto",
        "what reads a model turn's tool calls: auto (TRL's response template where TRL knows the chat template, "
        "else the family's vLLM parser, else regex for <tool_call>{json}</tool_call> templates); trl; regex (the "
        "hand parser); or a vLLM tool parser by name",
        choices=("auto", "trl", "regex", *VLLM_TOOL_PARSERS),
    )
    # -- the budget's end: what happens when an episode reaches max_completion_length or max_model_len ------------
    min_turn_tokens: int = setting(
        1,
        "a later turn is sent only with at least this many tokens left to sample (of max_completion_length and of "
        "max_model_len after the history it sends); with fewer the episode ends there, truncated",
        range=">= 1",
    )
    truncated_turn: str = setting(
        "run_calls",
        "a model turn cut by max_tokens (no end-of-turn token): run_calls runs its finished calls and counts them "
        "(TRL's rule; their results are dropped when they do not fit), end_episode ends the episode there: none of "
        "its calls runs. Either way no token is sampled after it",
        choices=("run_calls", "end_episode"),
    )
    overflow_reward: float | None = setting(
        None,
        "the reward of a truncated episode (the budget ended it: a turn cut by max_tokens, a tool result with no "
        "room, no room left for a turn); null: what the reward functions give it",
    )
    baseline_excludes_truncated: bool = setting(
        False,
        "a group's mean and std reward leave its truncated episodes out (as TRL leaves out an unscorable "
        "completion: NaN, then nanmean and nanstd); their advantage is 0",
    )
    max_consecutive_failures: int = setting(
        32,
        "environment_factory: episodes of one process whose environment failed in a row (its reset or a step raised "
        "or hung) before the run stops, in one line, before the update (its checkpoints as they were)",
        range=">= 1",
    )


@dataclass
class RecipeConfig:
    # --- TRL GRPOConfig names ---
    output_dir: str = setting("runs", "the run writes into <output_dir>/<run_name>/", range="a non-empty path")
    run_name: str = setting(
        "grpo",
        "the run's folder; a new run beside an earlier run's checkpoints goes to <run_name>-2, -3, ...",
        range="a non-empty name without '/'",
        check=lambda v: "/" not in v,
    )
    seed: int = setting(42, "seeds the adapter, the sampling and the data order", range=">= 0")
    max_steps: int = setting(100, "optimizer steps, as in TRL", range=">= 1")
    learning_rate: float = setting(1e-5, "AdamW learning rate", range="> 0")
    lr_scheduler_type: str = setting("constant", "the learning-rate schedule", choices=("constant", "linear", "cosine"))
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up", range=">= 0")
    weight_decay: float = setting(0.0, "AdamW weight decay", range=">= 0")
    adam_beta1: float = setting(0.9, "AdamW beta1", range="in [0, 1)")
    adam_beta2: float = setting(0.999, "AdamW beta2", range="in [0, 1)")
    max_grad_norm: float = setting(1.0, "gradient clipping norm", range="> 0")
    gradient_checkpointing: bool = setting(
        True, "recompute each decoder layer's activations in the backward (TRL's default)"
    )
    per_device_train_batch_size: int = setting(
        8, "completions per rank per optimizer step (one mini-batch)", range=">= 1"
    )
    steps_per_generation: int = setting(4, "mini-batches (optimizer steps) per rollout, per iteration", range=">= 1")
    num_iterations: int = setting(1, "passes over each rollout", range=">= 1")
    max_staleness: int = setting(
        0,
        "policy versions a sampled token may lag the trainer when it is trained on (TRL AsyncGRPO's name): 0 = "
        "synchronous; >= 1: the server generates the next rollout steps while the trainer updates, the updates land "
        "between decode steps (vllm.mode=server, lora.merge=true; docs/async.md)",
        range=">= 0",
    )
    num_generations: int = setting(
        8, "completions per prompt (the group)", range=">= 2 (GRPO normalizes within a group)"
    )
    max_completion_length: int = setting(256, "tokens per completion", range=">= 1")
    temperature: float = setting(1.0, "sampling temperature", range="> 0 (log-probs are of the tempered policy)")
    top_p: float = setting(
        1.0, "nucleus sampling (the trainer's log-probs follow vLLM's truncated distribution)", range="in (0, 1]"
    )
    top_k: int = setting(0, "top-k sampling (0: off)", range=">= 0 (0: off)")
    # --- the loss (grpo/loss.py: TRL 1.16's GRPOTrainer._compute_loss, same names, defaults, meaning) ---
    loss_type: str = setting("dapo", "the loss's normalisation and form (TRL's)", choices=SUPPORTED_VALUES["loss_type"])
    importance_sampling_level: str = setting(
        "token", "token, or sequence (GSPO)", choices=SUPPORTED_VALUES["importance_sampling_level"]
    )
    epsilon: float = setting(0.2, "PPO clip range", range="in (0, 1)")
    epsilon_high: float | None = setting(None, "upper clip range; null: epsilon", range="> 0")
    delta: float | None = setting(
        None, "two-sided clipping: the unclipped ratio is capped at delta (> 1 + epsilon_high)", range="> 0"
    )
    beta: float = setting(
        0.0, "k3 KL to the reference (the base, adapter disabled); 0 = no reference forward", range=">= 0"
    )
    use_bias_correction_kl: bool = setting(True, "the KL term times the policy ratio (TRL's default)")
    top_entropy_quantile: float = setting(
        1.0, "< 1: only this top fraction of tokens by entropy gets a policy gradient", range="in [0, 1]"
    )
    sapo_temperature_pos: float = setting(1.0, "SAPO's temperature for positive advantages", range="> 0")
    sapo_temperature_neg: float = setting(1.05, "SAPO's temperature for negative advantages", range="> 0")
    vllm_importance_sampling_correction: bool = setting(
        True,
        "trainer-over-vLLM probability of the sampled tokens weighs the loss (corrects the engine/trainer mismatch)",
    )
    vllm_importance_sampling_mode: str = setting(
        "sequence_mask", "{token,sequence}_{truncate,mask}", choices=SUPPORTED_VALUES["vllm_importance_sampling_mode"]
    )
    vllm_importance_sampling_clip_max: float | None = setting(3.0, "upper bound of that ratio", range="> 0")
    vllm_importance_sampling_clip_min: float | None = setting(None, "lower bound of that ratio", range=">= 0")
    scale_rewards: str = setting(
        "group", "divide advantages by the group's (or batch's) reward std", choices=("group", "batch", "none")
    )
    mask_truncated_completions: bool = setting(
        False,
        "truncated completions get no loss (DAPO's overlong filtering): those cut by max_completion_length, and tool "
        "episodes the budget ended (docs/tools.md)",
    )
    save_steps: int = setting(
        50, "checkpoint when global_step passes a multiple of this (and at the end)", range=">= 1"
    )
    eval_steps: int | None = setting(
        None,
        "evaluate on held-out problems before training, every N optimizer steps, at the end",
        range=">= 1 or null (no evaluation)",
    )
    report_to: list[str] = setting(
        ["none"], "trackers: none | all | tensorboard | wandb | ...", range="a non-empty list (['none'] for no tracker)"
    )
    save_total_limit: int | None = setting(
        2, "keep the newest N checkpoints (null: all)", range=">= 1 or null (keep all)"
    )
    resume_from_checkpoint: str | None = setting(
        None, "a checkpoint-<N> folder, or 'last' (alias: resume_from)", range="a checkpoint folder or 'last'"
    )
    reward_funcs: list[str] = setting(
        ["grpo.tasks.rewards:gsm8k_exact_answer_reward"],
        "GRPOTrainer's reward_funcs, as 'module:function' (TRL signature: "
        "f(completions, **columns) -> list[float]); see grpo/tasks/rewards.py",
        range="a non-empty list of 'module:function'",
        check=lambda v: all(":" in f for f in v),
    )
    tools: list[str] | None = setting(
        None,
        "GRPOTrainer's tools, as 'module:function' (a JSON schema from each one's type hints and docstring): "
        "multi-turn episodes, token in / token out (grpo/episodes/, docs/tools.md)",
        range="a non-empty list of 'module:function' or null",
        check=lambda v: all(":" in f for f in v),
    )
    agent: str | None = setting(
        None,
        "an agent that owns its loop, as 'module:function' f(client, row) -> float | None: given an openai.OpenAI "
        "client on the rollout's OpenAI-compatible endpoint (its session set) and the dataset row, it runs its own "
        "loop and returns a reward (None: reward_funcs score the final text); each session is one episode, token in "
        "/ token out (grpo/episodes/agent.py, docs/agents.md)",
        range="'module:function' or null",
        check=lambda v: ":" in v,
    )
    environment_factory: str | None = setting(
        None,
        "GRPOTrainer's environment_factory, as 'module:Class': one instance per episode, reset(**row, seed=<the "
        "group's seed>) gives an optional observation appended to the prompt, its public methods are the episode's "
        "tools, reward functions get environments= (grpo/episodes/environments.py, docs/environments.md)",
        range="'module:Class' or null",
        check=lambda v: ":" in v,
    )
    advantage: str = setting(
        "episode",
        "episode: one advantage per episode (its group-normalized reward, step rewards added); turn: each model turn "
        "its own, the discounted return from that turn on (gamma) normalized among its group's same-numbered turns; "
        "state (GiGPO-style): the episode's advantage plus state_advantage_weight times a step-level one, each turn's "
        "return normalized among its group's turns, at any turn number, that answered the identical observation "
        "(multi-turn episodes: tools or environment_factory; docs/environments.md)",
        choices=("episode", "turn", "state"),
    )
    gamma: float = setting(
        1.0, "the discount of the per-turn returns of advantage=turn and advantage=state", range="in [0, 1]"
    )
    state_advantage_weight: float = setting(
        1.0,
        "advantage=state: the weight of the step-level advantage added to the episode's (GiGPO's omega)",
        range=">= 0",
    )
    max_tool_calling_iterations: int | None = setting(
        None,
        "tool-calling rounds per episode; null: until a turn calls no tool or max_completion_length is reached",
        range=">= 1 or null (no limit)",
    )
    # --- sections ---
    model: ModelSettings = section(ModelSettings, "the base model")
    data: DataSettings = section(DataSettings, "the prompts")
    lora: LoraSettings = section(LoraSettings, "the adapter (peft LoraConfig names) and the merge mode")
    vllm: VLLMSettings = section(VLLMSettings, "the rollout engine: colocated, or a separate server")
    padding: PaddingSettings = section(PaddingSettings, "the packed log-probs")
    tool_calling: ToolCallingSettings = section(ToolCallingSettings, "how tools run (with `tools`)")

    @property
    def max_model_len(self) -> int:
        """The context every rollout request fits in: a colocated engine's max_model_len, the least a server's may
        be (`grpo.engines.server.check_server_settings`)."""
        return self.data.max_prompt_length + self.max_completion_length

    @property
    def prompts_per_rank(self) -> int:
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations

    def vllm_max_num_seqs(self, world: int) -> int:
        """vllm.max_num_seqs, or the most sequences one rank's engine is given at once: a rollout's completions or
        an evaluation's prompts.

        TRL sizes its colocated engine the same way (per_device_train_batch_size x steps_per_generation) rather than
        with vLLM's default (256 on CPU, 1024 on an H100), which sizes the sampler's buffers and CUDA graphs for
        sequences that never come.
        """
        if self.vllm.max_num_seqs is not None:
            return self.vllm.max_num_seqs
        rollout = self.per_device_train_batch_size * self.steps_per_generation
        evaluation = -(-self.data.num_eval // world) if self.eval_steps is not None else 0
        return max(rollout, evaluation)

    def max_logprob_diff(self) -> float:
        """vllm.max_logprob_diff, or its default for model.dtype."""
        if self.vllm.max_logprob_diff is not None:
            return self.vllm.max_logprob_diff
        return MAX_LOGPROB_DIFF[self.model.dtype]

    def validate(self) -> None:
        """Every field's rule (its ``range`` or ``choices``), then the rules that tie fields together."""
        for key, value, meta in field_leaves(self):
            check_rule(key, value, meta)
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
        check_attn_implementation(self.model.attn_implementation)
        if self.lora.use_dora:
            raise ConfigError(
                "lora.use_dora=True is not supported: merge/ (lora.merge=true) and vLLM's LoRA "
                "(lora.merge=false) both serve plain LoRA only"
            )
        if self.max_staleness > 0:
            self.check_asynchronous()
        if self.agent:
            self.check_agent()
        if self.environment_factory:
            self.check_environment()
        elif self.advantage in ("turn", "state") and not self.tools:
            raise ConfigError(
                f"advantage={self.advantage!r} gives each model turn of a multi-turn episode its own advantage: set "
                "tools or environment_factory as well"
            )
        if self.tools or self.environment_factory:
            self.check_tools()
        elif self.tool_calling.retokenize:
            raise ConfigError("tool_calling.retokenize=True compares multi-turn tool episodes: set tools as well")
        elif self.tool_calling.overflow_reward is not None:
            raise ConfigError(
                f"tool_calling.overflow_reward={self.tool_calling.overflow_reward} rewards truncated tool episodes: "
                "set tools as well"
            )
        elif self.tool_calling.baseline_excludes_truncated:
            raise ConfigError(
                "tool_calling.baseline_excludes_truncated=True leaves truncated tool episodes out of the baseline: "
                "set tools as well"
            )
        if not self.lora.merge:
            limit = self.vllm.max_lora_rank or self.lora.r
            if self.lora.r > limit or self.lora.r > VLLM_LORA_RANKS[-1]:
                raise ConfigError(
                    f"lora.merge=false: lora.r={self.lora.r} exceeds vllm.max_lora_rank={limit} "
                    f"(vLLM allows ranks up to {VLLM_LORA_RANKS[-1]}: {list(VLLM_LORA_RANKS)})"
                )
            if self.lora.target_parameters:
                raise ConfigError(
                    f"lora.merge=false: vLLM's LoRA cannot serve lora.target_parameters="
                    f"{self.lora.target_parameters} (LoRA on parameters, e.g. fused MoE experts); use "
                    "lora.merge=true (merged weights include them)"
                )
            if self.lora.modules_to_save:
                raise ConfigError(
                    f"lora.merge=false: vLLM's LoRA cannot serve lora.modules_to_save="
                    f"{self.lora.modules_to_save}; use lora.merge=true (merged weights include them)"
                )

    def check_asynchronous(self) -> None:
        """max_staleness >= 1 needs what lets generation overlap the update, and the correction for stale tokens."""
        why = f"max_staleness={self.max_staleness} (asynchronous rollouts)"
        if self.vllm.mode != "server":
            raise ConfigError(
                f"{why} needs vllm.mode=server: a colocated engine shares the trainer's devices, so it cannot generate "
                "while the trainer updates; use max_staleness=0"
            )
        if not self.lora.merge:
            raise ConfigError(
                f"{why} needs lora.merge=true: updates land between decode steps as LoRA factors merged in the "
                "server; an adapter loaded with /v1/load_lora_adapter cannot replace the one requests in flight use"
            )
        if not self.vllm_importance_sampling_correction:
            raise ConfigError(
                f"{why} needs vllm_importance_sampling_correction=true: stale tokens are weighed by trainer-over-"
                "vLLM probability (decoupled PPO); without it the update would treat them as on-policy"
            )

    def check_agent(self) -> None:
        """An agent brings its own tools, and its messages are rendered by the chat template."""
        if self.tools:
            raise ConfigError(
                f"agent={self.agent!r} and tools={self.tools} together: an agent runs its own tools (it sends their "
                "schemas with its requests); set one of them"
            )
        if not self.data.use_chat_template:
            raise ConfigError(
                f"agent={self.agent!r} needs data.use_chat_template=true: the chat template renders its messages"
            )

    def check_environment(self) -> None:
        """An environment's methods are its tools, described by the chat template; an agent runs its own loop."""
        if self.agent:
            raise ConfigError(
                f"agent={self.agent!r} and environment_factory={self.environment_factory!r} together: an agent runs "
                "its own loop and tools; set one of them"
            )
        if not self.data.use_chat_template:
            raise ConfigError(
                f"environment_factory={self.environment_factory!r} needs data.use_chat_template=true: the chat "
                "template describes the environment's methods to the model and renders their results"
            )

    def check_tools(self) -> None:
        """Tools are described to the model by the chat template; a truncated episode's reward is a number."""
        reward = self.tool_calling.overflow_reward
        if reward is not None and not math.isfinite(reward):
            raise ConfigError(f"tool_calling.overflow_reward={reward} must be a finite number or null")
        if not self.data.use_chat_template:
            raise ConfigError(
                f"tools={self.tools} needs data.use_chat_template=true: the chat template describes the tools to the "
                "model and renders their results"
            )


def check_attn_implementation(name: str) -> None:
    """flash_attention_2 needs the flash-attn package: without it transformers fails only in from_pretrained, after
    the data and the memory plan."""
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation='flash_attention_2' needs the flash-attn package, which is not "
            "installed (it is not in requirements-gpu.txt); use packed_sdpa (the default: on CUDA one "
            "variable-length FlashAttention call per layer, from torch itself)"
        )


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RecipeConfig:
    """Load a recipe YAML and apply ``key=value`` / ``section.key=value`` overrides (values parsed as YAML)."""
    data = read_config_file(path) if path is not None else {}
    apply_overrides(data, overrides, ALIASES)
    config = build_dataclass(RecipeConfig, data)
    config.validate()
    return config


def config_to_dict(config: RecipeConfig) -> dict:
    return dataclasses.asdict(config)
