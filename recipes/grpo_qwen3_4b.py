"""GRPO with LoRA under FSDP2; every rollout comes from a colocated vLLM engine serving *merged* weights.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py \
        --config recipes/configs/tiny_cpu.yaml [lora.merge=false learning_rate=2e-5 ...]

Words: a *rollout step* is one pass of the loop below (one line of metrics.jsonl, `rollout_step`); an
*optimizer step* is one update of the weights (`global_step`, TRL's meaning: `max_steps`, `save_steps` count
these). Each rollout step makes `steps_per_generation x num_iterations` optimizer steps.

One rollout step, top to bottom (`main`):
  1. sync     merge=on : stream merged_lora_params(model) (one decoder layer unsharded at a time) into vLLM
              merge=off: save the adapter, serve it with a fresh LoRARequest
  2. rollout  vLLM samples num_generations completions per prompt, with the sampled tokens' log-probs
  3. reward   TRL-style reward functions -> group-normalized advantages
  4. old      one no-grad packed forward per mini-batch -> old (and reference) log-probs, via `padding`
  5. update   num_iterations x steps_per_generation mini-batches of the GRPO loss (later ones off-policy)
  6. log      one JSON line per rollout step in results/<run_name>/metrics.jsonl
  7. save     checkpoint-<global_step>/ every `save_steps` optimizer steps, at the end, and on SIGINT/SIGTERM

Faults stop the run with a message instead of training on bad numbers: a NaN/inf reward, loss, ratio or
gradient norm stops the step before the optimizer update (the last checkpoint stays the last good one), and
a broken weight sync is caught by the |vLLM - trainer| log-prob check. `resume_from_checkpoint=<dir>|last`
continues at the next rollout step with the same results as an uninterrupted run.

Sibling modules: `grpo_config` (the YAML config), `grpo_data` (prompts, rewards, batches), `grpo_loss` (the
loss), `rollout_engine` (vLLM), `parallel` (processes, FSDP2), `checkpointing`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import yaml
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from checkpointing import (check_resumable, checkpoint_path, list_checkpoints, load_checkpoint, resolve_checkpoint,
                           rng_state, save_adapter, save_checkpoint, set_rng_state)
from grpo_config import MAX_LOGPROB_DIFF, ConfigError, RecipeConfig, config_to_dict, load_config
from grpo_data import (check_reward_columns, group_advantages, held_out_problems, load_problems, load_reward_funcs,
                       make_batch, score, select, tokenize_prompts)
from grpo_loss import (LossSettings, accumulate_stats, grpo_loss, high_entropy_mask, reduce_op,
                       vllm_importance_sampling_ratio)
from memory_plan import check_fits, device_memory_bytes, format_plan, memory_plan
from merge.vllm_compat import vllm_unservable_lora_targets
from padding import packed_log_probs
from padding.packed_attention import PACKED_SDPA  # noqa: F401  (registers attn_implementation="packed_sdpa")
from parallel import (FSDPSettings, apply_activation_checkpointing, apply_fsdp, check_same_weights, check_shared_output_dir,
                      fsdp_settings, init_distributed, reduce_across_ranks)
from rollout_engine import RolloutEngine, check_vllm_lora_targets, engine_kwargs, recipe_engine_args
from trackers import Trackers, check_report_to

log = logging.getLogger("grpo")
GUARD_BASELINE_MULTIPLE = 10  # the guard's limit is at least this many times the first step's |vLLM - trainer|
GUARD_BASELINE_CEILING = 50  # x the dtype's default: a first step this far off is a broken sync, not kernels


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
    engine: RolloutEngine
    trackers: Trackers
    eval_problems: list[dict]
    loss_settings: LossSettings
    compute_dtype: torch.dtype  # of the forward passes; the LoRA weights and the optimizer stay fp32
    num_rollout_steps: int
    resumed_rollout_step: int  # 0 for a fresh run
    last_checkpoint: Path | None = None
    logprob_diff_baseline: float | None = None  # mean |vLLM - trainer| at the first rollout step (LoRA B = 0)

    @property
    def updates_per_rollout(self) -> int:
        return self.cfg.steps_per_generation * self.cfg.num_iterations

    def autocast(self):
        """One process has no FSDP mixed precision to cast for it: autocast does (bf16 compute, fp32 LoRA)."""
        enabled = self.world == 1 and self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)


# ----------------------------------------------------------------------------- setup
def start_run_dir(cfg: RecipeConfig, rank: int, resume: Path | None, resumed_rollout_step: int) -> Path:
    """Create results/<run_name>/ (rank 0), route the log into its train.log, trim metrics.jsonl on resume."""
    run_dir = Path(cfg.output_dir) / cfg.run_name
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s", datefmt="%H:%M:%S")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (run_dir / "train.log").write_text("")
        # mode "a": importing vLLM closes existing handlers (logging.config.dictConfig); "a" reopens, "w" would not
        logging.getLogger().addHandler(logging.FileHandler(run_dir / "train.log", mode="a"))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        metrics_file = run_dir / "metrics.jsonl"
        earlier = metrics_file.read_text().splitlines() if resume and metrics_file.exists() else []
        # a resumed run keeps the rollout steps up to its checkpoint and redoes the rest (evaluations from the
        # checkpoint's weights on, too: they come again after the first sync)
        metrics_file.write_text("".join(line + "\n" for line in earlier if keep_on_resume(json.loads(line),
                                                                                        resumed_rollout_step)))
    return run_dir


def keep_on_resume(line: dict, resumed_rollout_step: int) -> bool:
    if any(key.startswith("eval_") for key in line):
        return line["rollout_step"] < resumed_rollout_step
    return line["rollout_step"] <= resumed_rollout_step


def prepare_model_path(cfg: RecipeConfig, rank: int) -> None:
    """Build the embedded default model if asked (rank 0; the others wait); refuse a model path that is absent."""
    if cfg.model.build_tiny:
        if rank == 0:
            from tiny_gsm8k import build_tiny_model

            build_tiny_model(cfg.model.name_or_path, size=cfg.model.build_tiny, seed=cfg.model.build_seed)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    name = cfg.model.name_or_path
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if not Path(name).exists() and (offline or name.startswith(("/", ".", "~")) or name.count("/") != 1):
        raise ConfigError(f"model.name_or_path={name!r} does not exist locally" + (" and HF_HUB_OFFLINE=1" if offline else ""))


def check_memory(cfg: RecipeConfig, world: int, device: torch.device, fsdp: FSDPSettings) -> None:
    """Log the memory plan per device; stop before loading anything if its largest phase cannot fit."""
    try:
        model_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r} holds no model config: {err}") from None
    plan = memory_plan(model_config, cfg, world,
                       checkpointing=cfg.gradient_checkpointing or fsdp.activation_checkpointing,
                       compute_dtype="bfloat16" if fsdp.mixed_precision == "bf16" else cfg.model.dtype)
    available = device_memory_bytes(device)
    log.info("memory plan per device (recipes/memory_plan.py):\n%s", format_plan(plan, available))
    problem = check_fits(plan, available, cfg)
    if problem:
        raise ConfigError(problem)


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
        raise ConfigError(f"lora.merge=false: vLLM 0.32 cannot serve these LoRA targets unmerged on {device.type}: "
                          f"{unservable[:4]}{' ...' if len(unservable) > 4 else ''} (merge/vllm_compat.py says why); "
                          "use lora.merge=true (merged weights serve every target)")
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


def setup(cfg: RecipeConfig) -> Run:
    """Processes, run folder, data, policy, optimizer, rollout engine; resumed from a checkpoint if asked."""
    fsdp = fsdp_settings()
    rank, world, device = init_distributed()
    # refuses what vLLM cannot do here, before any work
    engine_kwargs(cfg.model.name_or_path, **recipe_engine_args(cfg, rank=rank, world=world, device_type=device.type))
    run_dir = Path(cfg.output_dir) / cfg.run_name
    resume = resolve_checkpoint(cfg.resume_from_checkpoint, run_dir) if cfg.resume_from_checkpoint else None
    earlier_checkpoints = list_checkpoints(run_dir)
    if resume is None and earlier_checkpoints:
        raise ConfigError(f"{run_dir} already holds {earlier_checkpoints[-1].name} from an earlier run: continue "
                          "it with resume_from_checkpoint=last, or choose another run_name or output_dir")
    if resume:
        check_resumable(resume, config_to_dict(cfg))
    resumed_state = json.loads((resume / "trainer_state.json").read_text()) if resume else {}
    resumed = resumed_state.get("rollout_step", 0)
    trackers = check_report_to(cfg.report_to)
    run_dir = start_run_dir(cfg, rank, resume, resumed)
    check_shared_output_dir(run_dir, rank, world)
    log.info("run %s: %d process(es) on %s, merge=%s", run_dir, world, device.type, cfg.lora.merge)
    prepare_model_path(cfg, rank)
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    reward_funcs = dict(zip(cfg.reward_funcs, load_reward_funcs(cfg.reward_funcs)))
    problems = load_problems(cfg)
    check_reward_columns(cfg, list(reward_funcs.values()), problems)
    check_memory(cfg, world, device, fsdp)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    problems = tokenize_prompts(cfg, tokenizer, problems)
    random.Random(cfg.seed).shuffle(problems)
    eval_problems = held_out_problems(cfg, tokenizer, problems)

    model, compute_dtype = build_policy(cfg, device, rank, world, fsdp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    updates_per_rollout = cfg.steps_per_generation * cfg.num_iterations
    num_rollout_steps = math.ceil(cfg.max_steps / updates_per_rollout)  # max_steps counts optimizer steps, as in TRL
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, num_rollout_steps * updates_per_rollout))
    engine = RolloutEngine.from_config(cfg, rank=rank, world=world, device_type=device.type)
    if resume:  # after the engine: its start reseeds the RNG, whose saved state the sampling continues from
        load_checkpoint(resume, model, optimizer, scheduler, config_to_dict(cfg), rank)
        log.info("resumed from %s: continuing at rollout step %d of %d", resume, resumed + 1, num_rollout_steps)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Run(cfg=cfg, rank=rank, world=world, device=device, run_dir=run_dir, problems=problems,
               reward_funcs=reward_funcs, pad_id=pad_id, model=model, optimizer=optimizer, scheduler=scheduler,
               engine=engine, eval_problems=eval_problems,
               trackers=Trackers(trackers, cfg.run_name, run_dir / "runs", config_to_dict(cfg), rank), loss_settings=LossSettings.from_config(cfg, num_processes=world),
               compute_dtype=compute_dtype, num_rollout_steps=num_rollout_steps, resumed_rollout_step=resumed,
               last_checkpoint=resume, logprob_diff_baseline=resumed_state.get("logprob_diff_baseline"))


# ----------------------------------------------------------------------------- faults
class NonFiniteError(RuntimeError):
    """A NaN or inf in a training quantity; the step was stopped before it could change the weights."""


def stop_if_nonfinite(where: str, quantities: dict[str, torch.Tensor], last_checkpoint: Path | None) -> None:
    """Collective: every rank raises if any rank found a NaN/inf in one of ``quantities``."""
    local = [v.full_tensor() if isinstance(v, DTensor) else v for v in quantities.values()]
    bad = reduce_across_ranks(maxs={name: float(not bool(torch.isfinite(v.detach()).all()))
                                    for name, v in zip(quantities, local)})
    names = [name for name, flag in bad.items() if flag]
    if names:
        resume = (f"the last good checkpoint is {last_checkpoint}: resume with resume_from_checkpoint={last_checkpoint} "
                  "(e.g. with a lower learning_rate)" if last_checkpoint else "no checkpoint was written yet")
        raise NonFiniteError(f"{where}: non-finite {', '.join(names)} (NaN or inf); stopped before the optimizer "
                             f"update, no checkpoint written after it; {resume}")


class StopRequest:
    """SIGINT/SIGTERM only set a flag: the loop checks it between phases, saves a checkpoint and exits."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        if not self.signum:
            log.warning("%s received: stopping at the next step boundary, after a checkpoint",
                        signal.Signals(signum).name)
        self.signum = signum

    def agreed(self) -> int:
        """The signal any rank received (a collective, so that all ranks stop at the same point), or 0."""
        return int(reduce_across_ranks(maxs={"signal": self.signum})["signal"])


def params_digest(model) -> str:
    """SHA-1 of this rank's parameter bytes: proves a sync left the trainer's weights bit-for-bit alone."""
    digest = hashlib.sha1()
    for _, param in sorted(model.named_parameters()):
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ----------------------------------------------------------------------------- the phases of a rollout step
def generation_phase(run: Run, rollout_step: int):
    """1-2. With the engine awake (one wake-up, one sleep): sync, the evaluation when due, the rollout.

    The evaluation scores the weights after the previous rollout step, which the sync has just handed to the
    engine. Returns (rows, samples, metrics).
    """
    with run.engine.awake():
        phases = sync_weights(run, rollout_step)
        if eval_due(run, rollout_step - 1):
            evaluate(run, rollout_step - 1)
        rows, samples, rollout_metrics = rollout(run, rollout_step)
    return rows, samples, {**phases, **rollout_metrics}


def sync_weights(run: Run, rollout_step: int) -> dict:
    """1. Make the engine serve the current policy, merged or as an adapter (the engine's merge mode)."""
    t0 = time.perf_counter()
    digest_before = params_digest(run.model) if run.cfg.vllm.verify_sync else None
    if run.cfg.vllm.sync:  # false (debugging only): vLLM keeps serving stale weights, which the guard must catch
        run.engine.sync_policy(run.model, run.run_dir / "_rollout_adapter", version=rollout_step, rank=run.rank)
    metrics = dict(sync_s=time.perf_counter() - t0)
    if digest_before is not None:
        metrics["sync_changed_trainer"] = float(digest_before != params_digest(run.model))
    return metrics


def rollout(run: Run, rollout_step: int):
    """2. Sample num_generations completions for this rank's prompts. Returns (rows, samples, metrics)."""
    from vllm import SamplingParams

    cfg, ppr = run.cfg, run.cfg.prompts_per_rank
    t0 = time.perf_counter()
    start = ((rollout_step - 1) * run.world + run.rank) * ppr
    rows = [run.problems[(start + i) % len(run.problems)] for i in range(ppr)]
    sampling = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_completion_length,
                              logprobs=0)  # no per-request seed: each rank's engine has its own stream
    samples = run.engine.generate([r["prompt_ids"] for r in rows], sampling, use_tqdm=run.rank == 0)
    return rows, samples, dict(rollout_s=time.perf_counter() - t0,
                               rollout_tokens=sum(len(s.completion_ids) for s in samples))


def rewards_and_advantages(run: Run, rows, samples, rollout_step: int):
    """3. Score the completions (a NaN/inf reward stops the run) -> (rewards [N], advantages [N])."""
    rewards, returned = score(run.reward_funcs, rows, samples)
    stop_if_nonfinite(f"rollout step {rollout_step}, rewards", returned, run.last_checkpoint)
    return rewards, group_advantages(rewards, run.cfg.num_generations, run.cfg.scale_rewards)


def training_batch(run: Run, samples, advantages: torch.Tensor) -> dict:
    """The padded batch of this rank's completions with their advantages; truncated ones masked out if asked."""
    batch = make_batch(samples, run.pad_id, run.device)
    batch["advantages"] = advantages.to(run.device)
    if run.cfg.mask_truncated_completions:
        batch["response_mask"] = batch["response_mask"] * (~batch["truncated"])[:, None]
    return batch


def mini_batches(run: Run, batch: dict) -> list[slice]:
    size, count = run.cfg.per_device_train_batch_size, batch["input_ids"].shape[0]
    return [slice(i, i + size) for i in range(0, count, size)]


@torch.no_grad()
def old_log_probs(run: Run, batch: dict) -> None:
    """4. Add `old_logprobs` (and `ref_logprobs`, adapter disabled, if beta > 0) [N, R] to ``batch``."""
    cfg, model = run.cfg, run.model
    old, ref = torch.zeros_like(batch["vllm_logprobs"]), torch.zeros_like(batch["vllm_logprobs"])
    model.eval()
    for rows in mini_batches(run, batch):
        sub = select(batch, rows)
        width = sub["response_mask"].shape[1]
        args = (sub["input_ids"], sub["attention_mask"], sub["response_mask"], cfg.temperature)
        with run.autocast():
            old[rows, :width] = packed_log_probs(model, *args)
            if cfg.beta > 0:
                with model.disable_adapter():
                    ref[rows, :width] = packed_log_probs(model, *args)
    batch["old_logprobs"], batch["ref_logprobs"] = old, ref


def importance_sampling(run: Run, batch: dict) -> dict:
    """TRL's vLLM importance-sampling weights ([N, R], or [N, 1] per sequence) into ``batch``; returns their stats."""
    cfg = run.cfg
    if not run.loss_settings.vllm_importance_sampling_correction:
        return {}
    ratio, stats = vllm_importance_sampling_ratio(
        batch["old_logprobs"], batch["vllm_logprobs"], batch["response_mask"], cfg.vllm_importance_sampling_mode,
        cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    batch["importance_sampling_ratio"] = ratio
    return {k: v for k, v in stats.items() if k.startswith("vllm_ratio")}


def gather_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D ``values``, concatenated (lengths may differ); the entropy quantile pools them, as TRL."""
    if not torch.distributed.is_initialized():
        return values
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, values.cpu())
    return torch.cat(everyone).to(values.device)


def mini_batch_loss(run: Run, sub: dict, num_items_in_batch: float):
    """The GRPO loss of one mini-batch (forward included) -> (loss, stats of grpo_loss)."""
    cfg, settings = run.cfg, run.loss_settings
    entropy_mask, args = None, (sub["input_ids"], sub["attention_mask"], sub["response_mask"], cfg.temperature)
    with run.autocast():
        if settings.top_entropy_quantile < 1.0:
            logps, entropies = packed_log_probs(run.model, *args, cfg.padding.legacy_slice, return_entropy=True)
            entropy_mask = high_entropy_mask(entropies, sub["response_mask"], settings.top_entropy_quantile,
                                             gather=gather_across_ranks)
        else:
            logps = packed_log_probs(run.model, *args, legacy_slice=cfg.padding.legacy_slice)
    return grpo_loss(logps, sub["old_logprobs"], sub["advantages"], sub["response_mask"], settings,
                     ref_per_token_logps=sub["ref_logprobs"] if settings.beta != 0.0 else None,
                     importance_sampling_ratio=sub.get("importance_sampling_ratio"), entropy_mask=entropy_mask,
                     num_items_in_batch=num_items_in_batch if settings.loss_type in ("dapo", "cispo") else None)


def update(run: Run, batch: dict, rollout_step: int) -> dict:
    """5. num_iterations passes of steps_per_generation optimizer steps over the rollout's mini-batches.

    Returns the statistics of all mini-batches, by name (sums, counts, `*_min`, `*_max`: `grpo_loss.reduce_op`),
    with `onpolicy_*` for the first mini-batch of the first pass: the only one whose weights are the rollout's.
    """
    cfg, model = run.cfg, run.model
    chunks = mini_batches(run, batch)
    # dapo/cispo weigh every completion token of the rollout (all ranks) the same, as TRL's num_items_in_batch
    num_items_in_batch = reduce_across_ranks(sums={"tokens": batch["response_mask"].sum().item()})["tokens"]
    totals = importance_sampling(run, batch)
    totals = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in totals.items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    bar = tqdm(total=run.updates_per_rollout, desc=f"update {rollout_step}", disable=run.rank != 0, leave=False)
    for iteration in range(cfg.num_iterations):
        for k, rows in enumerate(chunks):
            loss, stats = mini_batch_loss(run, select(batch, rows), num_items_in_batch)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            stop_if_nonfinite(f"rollout step {rollout_step}, iteration {iteration + 1}, mini-batch {k + 1}",
                              dict(loss=loss, ratio=stats["ratio_sum"], grad_norm=grad_norm), run.last_checkpoint)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            stats = {**stats, "loss_sum": loss.detach().double(), "mini_batches": torch.tensor(1.0, dtype=torch.float64)}
            if iteration == 0 and k == 0:
                stats.update(onpolicy_ratio_sum=stats["ratio_sum"], onpolicy_ratio_count=stats["ratio_count"],
                             onpolicy_ratio_min=stats["ratio_min"], onpolicy_ratio_max=stats["ratio_max"])
            totals = accumulate_stats(totals, stats)
            bar.update(1)
    bar.close()
    return {name: value.item() for name, value in totals.items()}


def log_metrics(run: Run, rollout_step: int, rewards, batch, phases: dict, update_stats: dict, t_step: float) -> dict:
    """6. Reduce this rollout step's statistics across ranks by name, append them to metrics.jsonl (rank 0)."""
    mask = batch["response_mask"].bool()
    diff = (batch["vllm_logprobs"] - batch["old_logprobs"]).abs()[mask]
    local = dict(reward_sum=rewards.nansum().item(), reward_sq_sum=(rewards.nan_to_num() ** 2).sum().item(),
                 samples=len(rewards), logprob_diff_sum=diff.sum().item(), logprob_diff_count=diff.numel(),
                 logprob_diff_max=diff.max().item() if diff.numel() else 0.0, **phases, **update_stats)
    kinds = {"sums": {}, "mins": {}, "maxs": {}}
    for name, value in local.items():
        op = "max" if name.endswith(("_s", "_max")) else reduce_op(name)  # phase times: the slowest rank's
        kinds[op + "s"][name] = value
    kinds["maxs"]["peak_mem_gb"] = peak_mem_gb(run.device)
    total = reduce_across_ranks(**kinds)
    metrics = step_metrics(run, rollout_step, total)
    metrics["step_s"] = time.perf_counter() - t_step
    write_metrics(run, metrics)
    if run.rank == 0:
        log.info("rollout %d/%d (optimizer step %d) reward %.3f ratio %.6f [%.4g, %.4g] on-policy |ratio-1| %.1e "
                 "|vllm-trainer| %.2e tok/s %.0f sync %.2fs", rollout_step, run.num_rollout_steps,
                 metrics["global_step"], metrics["reward_mean"], metrics["ratio_mean"], metrics["ratio_min"],
                 metrics["ratio_max"], metrics["ratio_onpolicy_maxdev"], metrics["rollout_logprob_diff_mean"],
                 metrics["rollout_tokens_per_s"], metrics["sync_s"])
    return metrics


def step_metrics(run: Run, rollout_step: int, total: dict) -> dict:
    """The metrics.jsonl line of a rollout step, from its statistics summed (min-ed, max-ed) over ranks."""
    n, ratios = total["samples"], max(1.0, total["ratio_count"])
    reward_mean = total["reward_sum"] / n
    metrics = dict(
        rollout_step=rollout_step, global_step=rollout_step * run.updates_per_rollout, merge=run.cfg.lora.merge,
        legacy_slice=run.cfg.padding.legacy_slice, reward_mean=reward_mean,
        reward_std=math.sqrt(max(0.0, total["reward_sq_sum"] / n - reward_mean**2)),
        ratio_mean=total["ratio_sum"] / ratios, ratio_min=total["ratio_min"], ratio_max=total["ratio_max"],
        ratio_onpolicy_mean=total["onpolicy_ratio_sum"] / max(1.0, total["onpolicy_ratio_count"]),
        ratio_onpolicy_maxdev=max(abs(total["onpolicy_ratio_max"] - 1), abs(1 - total["onpolicy_ratio_min"])),
        rollout_logprob_diff_mean=total["logprob_diff_sum"] / max(1, total["logprob_diff_count"]),
        rollout_logprob_diff_max=total["logprob_diff_max"], rollout_tokens=int(total["rollout_tokens"]),
        rollout_s=total["rollout_s"], rollout_tokens_per_s=total["rollout_tokens"] / total["rollout_s"],
        sync_s=total["sync_s"], update_s=total["update_s"], peak_mem_gb=total["peak_mem_gb"],
        loss=total["loss_sum"] / total["mini_batches"], lr=run.scheduler.get_last_lr()[0],
    )
    if "clip_region" in total:
        metrics.update(clip_frac=total["clip_region"] / ratios, clip_low_frac=total["clip_low"] / ratios,
                       clip_high_frac=total["clip_high"] / ratios)
    if "kl_sum" in total:
        metrics["kl"] = total["kl_sum"] / max(1.0, total["tokens"])
    if "vllm_ratio_sum" in total:
        metrics.update(is_ratio_mean=total["vllm_ratio_sum"] / max(1.0, total["vllm_ratio_count"]),
                       is_ratio_min=total["vllm_ratio_min"], is_ratio_max=total["vllm_ratio_max"])
    if "sync_changed_trainer" in total:
        metrics["sync_changed_trainer"] = int(total["sync_changed_trainer"])
    return metrics


def write_metrics(run: Run, metrics: dict) -> None:
    """Append one line to metrics.jsonl (the plots' source of truth) and hand it to the trackers (rank 0)."""
    if run.rank == 0:
        with open(run.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        run.trackers.log(metrics, step=metrics["global_step"])


def eval_due(run: Run, rollout_steps_done: int) -> bool:
    """Evaluate before training, when eval_steps optimizer steps have passed, and at the end (if eval_steps is set)."""
    if run.cfg.eval_steps is None:
        return False
    after, before = rollout_steps_done * run.updates_per_rollout, (rollout_steps_done - 1) * run.updates_per_rollout
    return (rollout_steps_done == 0 or after // run.cfg.eval_steps > before // run.cfg.eval_steps
            or rollout_steps_done == run.num_rollout_steps)


def evaluate(run: Run, rollout_steps_done: int) -> dict:
    """Mean held-out reward (the accuracy, for a 0/1 reward), greedy and at the training temperature.

    The engine generates on the weights it serves now; each rank scores its share of the held-out problems.
    """
    from vllm import SamplingParams

    cfg = run.cfg
    rows = run.eval_problems[run.rank :: run.world]
    modes = {"greedy": SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length),
             "sampled": SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                       top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_completion_length)}
    sums = {"problems": len(rows)}
    for mode, sampling in modes.items():
        samples = run.engine.generate([r["prompt_ids"] for r in rows], sampling) if rows else []
        rewards = score(run.reward_funcs, rows, samples)[0] if rows else torch.zeros(0)
        sums[f"{mode}_reward_sum"] = rewards.nansum().item()
        sums[f"{mode}_tokens"] = sum(len(s.completion_ids) for s in samples)
    total = reduce_across_ranks(sums=sums)
    n = max(1.0, total["problems"])
    metrics = dict(rollout_step=rollout_steps_done, global_step=rollout_steps_done * run.updates_per_rollout,
                   eval_problems=int(total["problems"]), eval_reward_greedy=total["greedy_reward_sum"] / n,
                   eval_reward_sampled=total["sampled_reward_sum"] / n,
                   eval_completion_tokens_greedy=total["greedy_tokens"] / n)
    write_metrics(run, metrics)
    log.info("eval after rollout step %d (optimizer step %d): held-out reward greedy %.3f, sampled %.3f (%d problems)",
             rollout_steps_done, metrics["global_step"], metrics["eval_reward_greedy"], metrics["eval_reward_sampled"],
             metrics["eval_problems"])
    return metrics


def final_evaluation(run: Run, rollout_steps_done: int) -> dict:
    """The evaluation of the final weights: a generation phase of its own (sync, then evaluate)."""
    with run.engine.awake():
        sync_weights(run, rollout_steps_done + 1)
        return evaluate(run, rollout_steps_done)


def check_engine_follows_trainer(run: Run, metrics: dict) -> None:
    """A mean |vLLM - trainer| old log-prob above the guard's limit means vLLM serves other weights.

    The first rollout step of a run (LoRA B = 0: engine and trainer differ by their kernels alone) calibrates the
    guard: the limit is the larger of vllm.max_logprob_diff (or the dtype's default) and GUARD_BASELINE_MULTIPLE
    times that baseline, so other kernels (vLLM's GPU attention and CUDA graphs against SDPA) do not stop a
    healthy run. A baseline far above any kernel difference (GUARD_BASELINE_CEILING x the dtype's default) means
    the very first sync is broken.
    """
    diff = metrics["rollout_logprob_diff_mean"]
    if run.logprob_diff_baseline is None:
        ceiling = GUARD_BASELINE_CEILING * MAX_LOGPROB_DIFF[run.cfg.model.dtype]
        if diff > ceiling:
            raise RuntimeError(
                f"rollout step {metrics['rollout_step']}: rollout_logprob_diff_mean={diff:.3g} before any update "
                f"exceeds {ceiling:g} ({GUARD_BASELINE_CEILING}x the {run.cfg.model.dtype} default): vLLM does not "
                "serve the trainer's weights even at the start (a broken weight sync or a different checkpoint)")
        run.logprob_diff_baseline = diff
        log.info("log-prob guard: baseline |vLLM - trainer| %.3g at rollout step %d; the run stops above %.3g",
                 diff, metrics["rollout_step"], guard_limit(run))
    limit = guard_limit(run)
    if diff > limit:
        raise RuntimeError(
            f"rollout step {metrics['rollout_step']}: rollout_logprob_diff_mean={diff:.3g} exceeds the guard's "
            f"limit {limit:.3g} (the larger of vllm.max_logprob_diff={run.cfg.max_logprob_diff():g} and "
            f"{GUARD_BASELINE_MULTIPLE}x the first step's baseline {run.logprob_diff_baseline:.3g}): vLLM is not "
            "serving the trainer's weights (a broken or skipped weight sync); stopping instead of training on "
            "stale rollouts. (If the sync works and your kernels just differ more, raise vllm.max_logprob_diff.)")


def guard_limit(run: Run) -> float:
    return max(run.cfg.max_logprob_diff(), GUARD_BASELINE_MULTIPLE * run.logprob_diff_baseline)


def save(run: Run, rollout_step: int) -> Path:
    """7. Checkpoint the state after ``rollout_step`` (collective); a no-op if that checkpoint was just written."""
    global_step = rollout_step * run.updates_per_rollout
    if run.last_checkpoint == checkpoint_path(run.run_dir, global_step):
        return run.last_checkpoint
    state = dict(rollout_step=rollout_step, global_step=global_step,
                 data_position=rollout_step * run.world * run.cfg.prompts_per_rank, world_size=run.world,
                 seed=run.cfg.seed, logprob_diff_baseline=run.logprob_diff_baseline)
    run.last_checkpoint = save_checkpoint(run.run_dir, run.model, run.optimizer, run.scheduler, state,
                                          config_to_dict(run.cfg), run.rank, run.cfg.save_total_limit)
    return run.last_checkpoint


def save_due(run: Run, rollout_step: int) -> bool:
    """Whether this rollout step crossed a multiple of save_steps (optimizer steps), or is the last one."""
    after, before = rollout_step * run.updates_per_rollout, (rollout_step - 1) * run.updates_per_rollout
    return after // run.cfg.save_steps > before // run.cfg.save_steps or rollout_step == run.num_rollout_steps


def finish(run: Run, rollout_step: int, signum: int) -> None:
    """Write the final adapter (or say how to resume after a signal) and take the processes down."""
    if run.rank == 0:
        shutil.rmtree(run.run_dir / "_rollout_adapter", ignore_errors=True)
    if signum:
        log.error("stopped by %s after rollout step %d of %d; checkpoint: %s. To continue, run the same command with "
                  "resume_from_checkpoint=%s", signal.Signals(signum).name, rollout_step, run.num_rollout_steps,
                  run.last_checkpoint, run.last_checkpoint)
    else:
        save_adapter(run.model, run.run_dir / "adapter", run.rank)
        log.info("done: adapter in %s, metrics in %s", run.run_dir / "adapter", run.run_dir / "metrics.jsonl")
    run.trackers.finish()
    run.engine.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (see recipes/configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. lora.merge=false learning_rate=2e-5")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        run = setup(cfg)
    except ConfigError as err:  # a bad config or input: one line, from one process, no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    stop = StopRequest()  # after vLLM is built, so that these handlers are the ones in force

    signum, rollout_step = 0, run.resumed_rollout_step
    for rollout_step in range(run.resumed_rollout_step + 1, run.num_rollout_steps + 1):
        t_step, rng_at_start = time.perf_counter(), rng_state()  # the engine samples from the process's RNG
        rows, samples, phases = generation_phase(run, rollout_step)
        signum = stop.agreed()
        if signum:  # abandon this step: nothing was updated yet, so the state is the one after the previous one
            rollout_step -= 1
            set_rng_state(rng_at_start)  # the resumed run samples this step as it would have
            save(run, rollout_step)
            break

        rewards, advantages = rewards_and_advantages(run, rows, samples, rollout_step)
        t0 = time.perf_counter()
        batch = training_batch(run, samples, advantages)
        old_log_probs(run, batch)
        update_stats = update(run, batch, rollout_step)
        phases["update_s"] = time.perf_counter() - t0

        metrics = log_metrics(run, rollout_step, rewards, batch, phases, update_stats, t_step)
        check_engine_follows_trainer(run, metrics)
        signum = stop.agreed()
        if signum or save_due(run, rollout_step):
            save(run, rollout_step)
        if signum:
            break
    if not signum and eval_due(run, rollout_step) and rollout_step > run.resumed_rollout_step:
        final_evaluation(run, rollout_step)
    finish(run, rollout_step, signum)
    if signum:
        sys.exit(128 + signum)


if __name__ == "__main__":
    main()
