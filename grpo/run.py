"""One run of the recipe: its state (`Run`) and its start-up (`setup`), before the first rollout step.

`setup` does the work in the order that lets a bad input fail before anything slow: the accelerate settings and
the engine's arguments, earlier checkpoints, the model path (built first for the embedded default) and its config,
the LoRA targets against the model's modules (on the meta device), then the run folder, the data and reward
columns, the memory plan; then the policy (every rank's weights checked equal before FSDP2 shards them), the
optimizer and the vLLM engine, and a checkpoint to resume from.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpo.checkpointing import list_checkpoints, load_checkpoint
from grpo.config import ConfigError, RecipeConfig, config_to_dict
from grpo.data import (
    USER_TEXT,
    check_reward_columns,
    held_out_problems,
    load_problems,
    load_reward_funcs,
    render_prompt,
    tokenize_prompts,
)
from grpo.engines.build import prepare_engine
from grpo.engines.colocated import check_vllm_lora_targets
from grpo.engines.interface import Engine
from grpo.engines.rollout_queue import RolloutQueue
from grpo.episodes.agent import AgentEngine, load_agent
from grpo.episodes.environments import EnvironmentEngine, check_reset_arguments, load_environment
from grpo.episodes.loop import ToolEngine
from grpo.episodes.parsers import resolve_parser
from grpo.episodes.templates import use_prefix_preserving_template
from grpo.episodes.tools import load_tools
from grpo.faults import LogprobGuard
from grpo.loss import LossSettings
from grpo.loss_scaling import DynamicLossScale
from grpo.memory_plan import check_fits, check_server_fits, device_memory_bytes, format_plan, memory_plan
from grpo.metrics import Timeline
from grpo.parallel import (
    FSDPSettings,
    apply_activation_checkpointing,
    apply_fsdp,
    check_same_weights,
    check_shared_output_dir,
    fsdp_settings,
    init_distributed,
)
from grpo.policy_versions import PolicyVersions
from grpo.run_folder import output_dir_problem, resume_or_new_run, run_folder, start_run_dir
from grpo.trackers import Trackers, check_report_to
from merge.vllm_compat import vllm_unservable_lora_targets
from padding.packed_attention import PACKED_SDPA  # noqa: F401  (registers attn_implementation="packed_sdpa")

log = logging.getLogger("grpo")
EMBEDDED_DEFAULT_HINT = (
    "The embedded default runs offline: accelerate launch --config_file "
    "accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py --config "
    "recipes/configs/tiny_cpu.yaml"
)


def rollout_rows(problems: list[dict], prompts_per_rank: int, rank: int, world: int, rollout_step: int) -> list[dict]:
    """This rank's prompts (rows) of a rollout step: the data in order, each rank its own consecutive share."""
    start = ((rollout_step - 1) * world + rank) * prompts_per_rank
    return [problems[(start + i) % len(problems)] for i in range(prompts_per_rank)]


def crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]: optimizer steps ``before`` -> ``after``."""
    return after // every > before // every


@dataclass
class Run:
    """What every phase of a rollout step works with; built once by `setup`."""

    cfg: RecipeConfig
    rank: int
    world: int
    device: torch.device
    run_dir: Path
    problems: list[dict]
    reward_funcs: dict  # config name -> function
    pad_id: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine  # ColocatedEngine (vllm.mode=colocate) or ServerEngine (vllm.mode=server): prepare_engine
    trackers: Trackers
    eval_problems: list[dict]
    loss_settings: LossSettings
    compute_dtype: torch.dtype  # of the forward passes; the LoRA weights and the optimizer stay fp32
    num_rollout_steps: int
    resumed_rollout_step: int  # 0 for a fresh run
    guard: LogprobGuard
    rollouts: RolloutQueue  # the rollout steps' requests, sent up to max_staleness syncs ahead
    timeline: Timeline  # when each side was busy (server mode: timeline.jsonl)
    policies: PolicyVersions | None = None  # max_staleness >= 1: the factors of recent versions (fidelity check)
    last_checkpoint: Path | None = None
    # fp16 only: dynamic loss scaling (disabled, scale 1, in fp32 and bf16)
    loss_scale: DynamicLossScale = field(default_factory=lambda: DynamicLossScale(enabled=False))

    @property
    def updates_per_rollout(self) -> int:
        return self.cfg.steps_per_generation * self.cfg.num_iterations

    def global_step(self, rollout_step: int) -> int:
        """Optimizer steps made once ``rollout_step`` rollout steps are done (TRL's global_step)."""
        return rollout_step * self.updates_per_rollout

    def eval_due(self, rollout_steps_done: int) -> bool:
        """Evaluate before training, when eval_steps optimizer steps have passed, and at the end (if eval_steps)."""
        if self.cfg.eval_steps is None:
            return False
        return rollout_steps_done in (0, self.num_rollout_steps) or crossed(
            self.cfg.eval_steps, self.global_step(rollout_steps_done - 1), self.global_step(rollout_steps_done)
        )

    def save_due(self, rollout_step: int) -> bool:
        """Whether this rollout step crossed a multiple of save_steps (optimizer steps), or is the last one."""
        return rollout_step == self.num_rollout_steps or crossed(
            self.cfg.save_steps, self.global_step(rollout_step - 1), self.global_step(rollout_step)
        )

    def prompts_for(self, rollout_step: int) -> list[dict]:
        return rollout_rows(self.problems, self.cfg.prompts_per_rank, self.rank, self.world, rollout_step)

    @property
    def logprob_options(self) -> dict:
        """How `packed_log_probs` scores tokens: vLLM's sampling truncation (top-k/top-p), LM-head chunks."""
        return dict(top_k=self.cfg.top_k, top_p=self.cfg.top_p, chunk_size=self.cfg.padding.logprob_chunk_size)

    def autocast(self):
        """One process has no FSDP mixed precision to cast for it: autocast does (bf16 compute, fp32 LoRA)."""
        enabled = self.world == 1 and self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)


def check_compute_dtype(cfg: RecipeConfig, fsdp: FSDPSettings) -> None:
    """fp16 weights need fp16 compute (with its loss scaling): accelerate's bf16 mixed precision is refused."""
    if fsdp.mixed_precision == "bf16" and cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16 with accelerate's mixed_precision='bf16' would compute in bf16 on fp16 "
            "weights: use mixed_precision: 'no' in the accelerate config (model.dtype decides)"
        )


def check_paths(cfg: RecipeConfig, rank: int) -> None:
    """Before any work: output_dir is a folder rank 0 can create and write into (folders made to find out are
    removed again; every rank refuses with rank 0's finding), and the embedded default is built only under cache/
    (a mistyped model.name_or_path would otherwise get a model built there)."""
    cache = Path("cache").resolve()
    if cfg.model.build_tiny and not Path(cfg.model.name_or_path).resolve().is_relative_to(cache):
        raise ConfigError(
            f"model.build_tiny={cfg.model.build_tiny!r} builds the embedded default under {cache} only, not at "
            f"model.name_or_path={cfg.model.name_or_path!r}; for a model of your own, set model.build_tiny=null"
        )
    problem = output_dir_problem(cfg.output_dir) if rank == 0 else None
    if torch.distributed.is_initialized():  # the other ranks would otherwise wait for rank 0 in a collective
        shared = [problem]
        torch.distributed.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem is not None:
        raise ConfigError(problem)


def prepare_model_path(cfg: RecipeConfig, rank: int) -> None:
    """Build the embedded default model if asked (rank 0; the others wait); refuse a model path that is absent."""
    if cfg.model.build_tiny:
        from grpo.tasks.tiny_gsm8k import build_tiny_model
        from grpo.tasks.tiny_guess import build_guess_model
        from grpo.tasks.tiny_key_chain import build_key_chain_model
        from grpo.tasks.tiny_tools import build_tool_model

        # rank 0 builds; the others wait for its files rather than in a collective, whose timeout (30 min on gloo) a
        # build on a loaded machine can outlast (should rank 0 fail, the launcher ends them)
        if cfg.model.build_tiny == "tiny-tools":
            build_tool_model(cfg.model.name_or_path, seed=cfg.model.build_seed, build=rank == 0)
        elif cfg.model.build_tiny == "tiny-key-chain":
            build_key_chain_model(cfg.model.name_or_path, seed=cfg.model.build_seed, build=rank == 0)
        elif cfg.model.build_tiny == "tiny-guess":
            build_guess_model(cfg.model.name_or_path, seed=cfg.model.build_seed, build=rank == 0)
        else:
            size = cfg.model.build_tiny
            build_tiny_model(cfg.model.name_or_path, size=size, seed=cfg.model.build_seed, build=rank == 0)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    name = cfg.model.name_or_path
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if not Path(name).exists() and (offline or name.startswith(("/", ".", "~")) or name.count("/") != 1):
        raise ConfigError(
            f"model.name_or_path={name!r} does not exist locally"
            + (" and HF_HUB_OFFLINE=1" if offline else "")
            + f". {EMBEDDED_DEFAULT_HINT}"
        )
    if not Path(name).exists() and not hub_reachable_or_cached(name):
        raise ConfigError(
            f"model.name_or_path={name!r} is not in the local Hugging Face cache and the hub cannot be "
            f"reached. {EMBEDDED_DEFAULT_HINT}"
        )


def hub_reachable_or_cached(repo_id: str) -> bool:
    """Whether ``repo_id``'s config is cached, or the hub's host resolves: without a network, huggingface_hub
    would retry for half a minute before failing."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return True
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return False
    return True


def model_config_of(cfg: RecipeConfig):
    """The model's config (no weights); a path without one is a config error naming it."""
    try:
        return AutoConfig.from_pretrained(cfg.model.name_or_path)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.name_or_path={cfg.model.name_or_path!r} holds no model config ({first_line}). "
            f"{EMBEDDED_DEFAULT_HINT}"
        ) from None


def check_lora_targets(cfg: RecipeConfig, model_config) -> None:
    """Every lora.target_modules / target_parameters entry names something in the model (peft's suffix rule),
    checked on the meta device before any weight is loaded."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    modules = [name for name, _ in model.named_modules()]
    params = [name for name, _ in model.named_parameters()]
    targets = cfg.lora.target_modules if isinstance(cfg.lora.target_modules, list) else []
    for key, names, entries in (
        ("lora.target_modules", modules, targets),
        ("lora.target_parameters", params, cfg.lora.target_parameters or []),
    ):
        missing = [t for t in entries if t != "all-linear" and not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if ".layers.0." in n})
            raise ConfigError(
                f"{key}={entries} names {missing}, which match nothing in {cfg.model.name_or_path}; "
                f"its decoder layers hold {leaves}"
            )


def check_memory(cfg: RecipeConfig, model_config, world: int, device: torch.device, fsdp: FSDPSettings) -> None:
    """Log the memory plan per device; stop before loading anything if its largest phase cannot fit."""
    plan = memory_plan(
        model_config,
        cfg,
        world,
        checkpointing=cfg.gradient_checkpointing or fsdp.activation_checkpointing,
        compute_dtype="bfloat16" if fsdp.mixed_precision == "bf16" else cfg.model.dtype,
    )
    available = device_memory_bytes(device)
    log.info("memory plan per device (grpo/memory_plan.py):\n%s", format_plan(plan, available))
    problem = check_fits(plan, available, cfg)
    if problem:
        raise ConfigError(problem)
    server_problem = check_server_fits(plan, available, cfg)
    if server_problem:  # the server's devices may not be these: its own check at connect decides
        log.warning("on a server with devices like this one, %s", server_problem)


def build_policy(cfg: RecipeConfig, device: torch.device, rank: int, world: int, fsdp: FSDPSettings):
    """The base model with a fresh fp32 LoRA adapter, sharded with FSDP2 when there is more than one process.

    Returns (model, compute dtype). The base weights keep model.dtype; the adapter is fp32 whatever the base (peft's
    and TRL's default: in bf16, AdamW steps of lr 1e-5 are below half an ulp of lora_A and would never land), and
    the forward computes in bf16 when model.dtype or accelerate's mixed_precision asks for it.
    """
    dtype = getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.name_or_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation
    )
    digest = check_same_weights(model, rank, world)  # FSDP2 shards whatever each rank loaded, without a check
    log.info("base weights identical on all %d process(es) before sharding (sha1 %s)", world, digest)
    model = model.to(device)
    if not cfg.lora.merge:
        check_vllm_lora_targets(model, cfg.lora.target_modules)
    if cfg.gradient_checkpointing or fsdp.activation_checkpointing:
        apply_activation_checkpointing(model)
    lora = {k: v for k, v in config_to_dict(cfg)["lora"].items() if k != "merge"}
    torch.manual_seed(cfg.seed)  # the same initial adapter on every rank
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    unservable = [] if cfg.lora.merge else vllm_unservable_lora_targets(model, device.type)
    if unservable:
        raise ConfigError(
            f"lora.merge=false: vLLM 0.32 cannot serve these LoRA targets unmerged on {device.type}: "
            f"{unservable[:4]}{' ...' if len(unservable) > 4 else ''} (merge/vllm_compat.py says why); "
            "use lora.merge=true (merged weights serve every target)"
        )
    compute_dtype = torch.bfloat16 if fsdp.mixed_precision == "bf16" else dtype
    if world > 1:
        apply_fsdp(model, compute_dtype, fsdp)
    return model, compute_dtype


def lr_lambda(cfg: RecipeConfig, total_updates: int):
    def schedule(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / (cfg.warmup_steps + 1)
        progress = (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return schedule


def build_optimizer(cfg: RecipeConfig, model: torch.nn.Module, total_updates: int):
    """AdamW over the trainable (adapter) weights, and its learning-rate schedule over ``total_updates`` steps."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))


def setup(cfg: RecipeConfig) -> Run:
    """Processes, run folder, data, policy, optimizer, rollout engine; resumed from a checkpoint if asked."""
    # imports made later (lazy ones, vLLM's plugins) find the same modules should a tool change the working directory
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]
    fsdp = fsdp_settings()
    check_compute_dtype(cfg, fsdp)
    rank, world, device = init_distributed()
    check_paths(cfg, rank)
    tools = load_tools(cfg.tools)  # a tool that cannot be imported or described: refused before any work
    agent = load_agent(cfg.agent)  # likewise an agent
    environment = load_environment(cfg.environment_factory)  # likewise an environment (one instance probed)
    if environment is not None:  # its methods are the episode's tools, as TRL makes them
        tools = environment.described
    # refuses what the engine cannot do here (or a server that is not there), before any work
    start_engine = prepare_engine(cfg, rank=rank, world=world, device_type=device.type)
    named_dir = run_folder(cfg)
    cfg, resume, resumed_state = resume_or_new_run(cfg)
    resumed = resumed_state.get("rollout_step", 0)
    trackers = check_report_to(cfg.report_to)
    prepare_model_path(cfg, rank)
    model_config = model_config_of(cfg)
    check_lora_targets(cfg, model_config)
    run_dir = start_run_dir(cfg, rank, resume, resumed)
    if run_dir != named_dir:
        log.info(
            "%s already holds a run (%s), so this one writes to %s; to continue that run instead, add "
            "resume_from_checkpoint=last",
            named_dir,
            list_checkpoints(named_dir)[-1].name,
            run_dir,
        )
    check_shared_output_dir(run_dir, rank, world)
    log.info("run %s: %d process(es) on %s, merge=%s", run_dir, world, device.type, cfg.lora.merge)
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    reward_funcs = dict(zip(cfg.reward_funcs, load_reward_funcs(cfg.reward_funcs)))
    if environment is not None and environment.get_reward is not None:  # TRL's: the environment owns a reward
        reward_funcs[environment.described_class.__name__] = environment.get_reward
    problems = load_problems(cfg)
    check_reward_columns(cfg, list(reward_funcs.values()), problems)
    check_memory(cfg, model_config, world, device, fsdp)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    if (
        tools or agent
    ):  # refused before the model loads: a template the loop cannot append to, a parser that cannot read it
        use_prefix_preserving_template(tokenizer, tools, cfg.data.chat_template_kwargs, cfg.model.name_or_path)
        resolve_parser(cfg.tool_calling.parser, tokenizer)  # after: it reads the template that is used
    problems = tokenize_prompts(cfg, tokenizer, problems, tools=tools)
    if environment is not None:  # a reset that cannot take a row's columns (its prompt among them) and the seed
        check_reset_arguments(environment, problems[0])
    random.Random(cfg.seed).shuffle(problems)
    eval_problems = held_out_problems(cfg, tokenizer, problems, tools)

    model, compute_dtype = build_policy(cfg, device, rank, world, fsdp)
    updates_per_rollout = cfg.steps_per_generation * cfg.num_iterations
    num_rollout_steps = math.ceil(cfg.max_steps / updates_per_rollout)  # max_steps counts optimizer steps, as in TRL
    optimizer, scheduler = build_optimizer(cfg, model, total_updates=num_rollout_steps * updates_per_rollout)
    if environment is not None:  # one instance per episode, its methods the tools (grpo/episodes/environments.py)
        engine = EnvironmentEngine(
            start_engine(),
            tokenizer,
            environment,
            cfg,
            lambda row, observation: render_prompt(cfg, tokenizer, row[USER_TEXT] + observation, tools)[1],
            cfg.data.chat_template_kwargs,
        )
    elif tools:  # multi-turn episodes, every tool response rendered with the prompt's template arguments
        engine = ToolEngine(start_engine(), tokenizer, tools, cfg, cfg.data.chat_template_kwargs)
    elif agent:  # an agent's sessions through the OpenAI endpoint, one episode each
        engine = AgentEngine(
            start_engine(), tokenizer, agent, cfg, problems + eval_problems, cfg.data.chat_template_kwargs
        )
    else:
        engine = start_engine()
    if resume:  # after the engine: its start reseeds the RNG, whose saved state the sampling continues from
        load_checkpoint(resume, model, optimizer, scheduler, config_to_dict(cfg), rank)
        log.info("resumed from %s: continuing at rollout step %d of %d", resume, resumed + 1, num_rollout_steps)
    loss_scale = DynamicLossScale(enabled=compute_dtype == torch.float16)
    loss_scale.load_state_dict(resumed_state.get("loss_scale"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        run_dir=run_dir,
        problems=problems,
        reward_funcs=reward_funcs,
        pad_id=pad_id,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        engine=engine,
        eval_problems=eval_problems,
        trackers=Trackers(trackers, cfg.run_name, run_dir / "runs", config_to_dict(cfg), rank),
        loss_settings=LossSettings.from_config(cfg, num_processes=world),
        compute_dtype=compute_dtype,
        num_rollout_steps=num_rollout_steps,
        resumed_rollout_step=resumed,
        last_checkpoint=resume,
        guard=LogprobGuard(cfg, resumed_state.get("logprob_diff_baseline")),
        # a resumed run starts with nothing queued: its first rollout steps are sampled by the checkpoint's policy
        rollouts=rollout_queue(cfg, engine, problems, rank, world, num_rollout_steps),
        timeline=Timeline(run_dir, enabled=cfg.vllm.mode == "server"),
        policies=PolicyVersions(model, keep=cfg.max_staleness) if cfg.max_staleness > 0 else None,
        loss_scale=loss_scale,
    )


def rollout_queue(
    cfg: RecipeConfig, engine: Engine, problems: list[dict], rank: int, world: int, num_rollout_steps: int
) -> RolloutQueue:
    """The queue of this rank's rollout requests (`grpo.engines.rollout_queue`), max_staleness steps ahead."""
    return RolloutQueue(
        engine,
        # an environment's engine takes the rows themselves: each reset gets its row
        lambda step: [
            row if getattr(engine, "takes_rows", False) else row["prompt_ids"]
            for row in rollout_rows(problems, cfg.prompts_per_rank, rank, world, step)
        ],
        rollout_sampling(cfg),
        cfg.max_staleness,
        num_rollout_steps,
    )


def rollout_sampling(cfg: RecipeConfig):
    """vLLM's sampling of a rollout: num_generations completions per prompt, each token's log-prob (of the
    distribution it samples from: top-k / top-p truncated, as the trainer's log-probs are). No per-request seed
    here: each rank's engine has its own stream (the server engine seeds each request from the process's RNG)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=cfg.num_generations,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k if cfg.top_k > 0 else -1,
        max_tokens=cfg.max_completion_length,
        logprobs=0,
    )
