"""GRPO with LoRA under FSDP2; every rollout comes from a colocated vLLM engine serving *merged* weights.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py \
        --config recipes/configs/tiny_cpu.yaml [lora.merge=false learning_rate=2e-5 ...]

One step, top to bottom:
  1. sync    merge=on : stream merged_lora_params(model) (one decoder layer unsharded at a time) into vLLM
             merge=off: save the adapter, serve it with a fresh LoRARequest
  2. rollout vLLM samples num_generations completions per prompt, with the sampled tokens' log-probs
  3. reward  TRL-style reward functions -> group-normalized advantages
  4. old     one no-grad packed forward per mini-batch -> old (and reference) log-probs, via `padding`
  5. update  num_iterations x steps_per_generation mini-batches of the PPO-clip loss (later ones off-policy)
  6. log     one JSON line per step in results/<run_name>/metrics.jsonl
  7. save    checkpoint-<global_step>/ every `save_steps` optimizer steps, at the end, and on SIGINT/SIGTERM

Faults stop the run with a message instead of training on bad numbers: a NaN/inf reward, loss, ratio or
gradient norm stops the step before the optimizer update (the last checkpoint stays the last good one), and
a broken weight sync is caught by the |vLLM - trainer| log-prob check. `resume_from_checkpoint=<dir>|last`
continues at the next step with the same results as an uninterrupted run.

Parallelism: `accelerate launch` only starts the processes; this script joins them (gloo on CPU, NCCL on
GPU) and shards with `fully_shard` itself (each decoder layer, then the root), torchtitan-style. On CPU,
accelerate's own FSDP path starts unsharded processes without an error, so it is not used.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
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
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in the trainer's process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
import yaml
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `merge`, `padding` from the repo root
from checkpointing import (checkpoint_path, list_checkpoints, load_checkpoint, resolve_checkpoint,  # noqa: E402
                           save_adapter, save_checkpoint)
from grpo_config import VLLM_LORA_RANKS, ConfigError, RecipeConfig, config_to_dict, load_config  # noqa: E402
from merge import decoder_layers, merged_lora_params  # noqa: E402
from padding import packed_log_probs  # noqa: E402

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------- setup
def init_distributed() -> tuple[int, int, torch.device]:
    """Join the processes `accelerate launch` (or torchrun) started; refuse to run silently unsharded."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_FSDP", "false") == "true" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(
            f"the accelerate config asks for FSDP version {os.environ.get('FSDP_VERSION', '1')}; "
            "this recipe shards with FSDP2 only: set `fsdp_version: 2` in its fsdp_config"
        )
    cuda = torch.cuda.is_available()
    if world > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        return dist.get_rank(), world, device
    return 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu")


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def load_reward_funcs(names: list[str]):
    """'module:function' -> callable with TRL's signature ``f(completions, **columns) -> list[float]``."""
    funcs = []
    for name in names:
        module_name, sep, attr = name.partition(":")
        if not sep:
            raise ConfigError(f"reward_funcs entry {name!r} must look like 'module:function'")
        try:
            funcs.append(getattr(importlib.import_module(module_name), attr))
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"reward_funcs entry {name!r} cannot be imported: {err}") from err
    return funcs


def reward_columns(func) -> list[str]:
    """Dataset columns a TRL-style reward function asks for by name (beyond prompts/completions)."""
    skip = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
    params = inspect.signature(func).parameters.values()
    return [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in skip and p.default is p.empty]


def load_problems(cfg: RecipeConfig) -> list[dict]:
    if cfg.data.name == "generated":
        from tiny_gsm8k import make_problems

        return make_problems(cfg.data.num_generated, seed=cfg.seed)
    from datasets import load_dataset

    local = Path(cfg.data.name)
    try:
        if local.exists():
            suffix = local.suffix.lstrip(".")
            if local.is_file() and suffix in ("json", "jsonl", "csv", "parquet"):
                data = load_dataset("json" if suffix == "jsonl" else suffix, data_files=str(local), split=cfg.data.split)
            else:
                data = load_dataset(str(local), cfg.data.config_name, split=cfg.data.split)
        else:
            data = load_dataset(cfg.data.name, cfg.data.config_name, split=cfg.data.split)
    except Exception as err:  # datasets raises many types; name the bad value either way
        raise ConfigError(f"data.name={cfg.data.name!r} (split {cfg.data.split!r}) cannot be loaded: {err}") from err
    return [dict(row) for row in data]


def tokenize_prompts(cfg: RecipeConfig, tokenizer, problems: list[dict]) -> list[dict]:
    """Add `prompt` (text) and `prompt_ids`; drop empty or over-long prompts with a counted warning."""
    kept, empty, too_long = [], 0, 0
    for row in problems:
        try:
            text = cfg.data.prompt_template.format(**row)
        except KeyError as err:
            raise ConfigError(f"data.prompt_template={cfg.data.prompt_template!r} names column {err} that "
                              f"data.name={cfg.data.name!r} lacks; it has {sorted(row)}") from None
        if cfg.data.use_chat_template and tokenizer.chat_template:
            messages = ([{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else [])
            messages.append({"role": "user", "content": text})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(text).input_ids
        if not text.strip() or not ids:
            empty += 1
        elif len(ids) > cfg.data.max_prompt_length:
            too_long += 1
        else:
            kept.append({**row, "prompt": text, "prompt_ids": ids})
    if empty or too_long:
        log.warning("dropped %d empty and %d prompts longer than data.max_prompt_length=%d tokens (of %d)",
                    empty, too_long, cfg.data.max_prompt_length, len(problems))
    if not kept:
        raise ConfigError(f"no usable prompt in data.name={cfg.data.name!r} (all empty or too long)")
    return kept


def build_policy(cfg: RecipeConfig, device: torch.device, world: int):
    dtype = getattr(torch, cfg.model.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.model.name_or_path, dtype=dtype, attn_implementation=cfg.model.attn_implementation
    ).to(device)
    if not cfg.lora.merge:
        check_vllm_lora_targets(model, cfg.lora.target_modules)
    lora = {k: v for k, v in config_to_dict(cfg)["lora"].items() if k != "merge"}
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora), autocast_adapter_dtype=False)
    if world > 1:
        # FSDP2, torchtitan-style: one group per decoder layer (what merged_lora_params unshards), then the root.
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if unsharded:
            raise RuntimeError(f"{len(unsharded)} parameters are not sharded under FSDP2, e.g. {unsharded[:3]}")
    return model


def check_vllm_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """lora.merge=false: vLLM serves LoRA on the decoder layers' linear projections only."""
    servable = {name.rsplit(".", 1)[-1] for layer in decoder_layers(model)
                for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}
    unservable = sorted(set(target_modules) - servable)
    if unservable:
        raise ConfigError(f"lora.merge=false: vLLM cannot serve LoRA on lora.target_modules {unservable}; it serves "
                          f"the decoder layers' linear projections {sorted(servable)}. Drop them, or use "
                          "lora.merge=true (merged weights serve any target)")


def build_engine(cfg: RecipeConfig, rank: int, world: int):
    from vllm import LLM

    kwargs = dict(
        model=cfg.model.name_or_path,
        dtype=cfg.model.dtype,
        seed=cfg.seed + rank,
        max_model_len=cfg.data.max_prompt_length + cfg.max_completion_length,
        enforce_eager=cfg.vllm.enforce_eager,
        max_num_seqs=cfg.vllm.max_num_seqs,
        kv_cache_memory_bytes=int(cfg.vllm.kv_cache_gb * 2**30),
        logprobs_mode="processed_logprobs",  # log-probs of the tempered distribution, as the trainer computes
        enable_prefix_caching=False,
    )
    if world > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per rank, in-process
    if not cfg.lora.merge:  # the rank was checked against vLLM's limits with the config
        wanted = cfg.vllm.max_lora_rank or cfg.lora.r
        kwargs.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= wanted), max_loras=1)
    return LLM(**kwargs)


class NonFiniteError(RuntimeError):
    """A NaN or inf in a training quantity; the step was stopped before it could change the weights."""


def stop_if_nonfinite(where: str, quantities: dict[str, torch.Tensor], last_checkpoint: Path | None) -> None:
    """Collective: every rank raises if any rank found a NaN/inf in one of ``quantities``."""
    local = [v.full_tensor() if isinstance(v, DTensor) else v for v in quantities.values()]
    bad = all_reduce([float(not bool(torch.isfinite(v.detach()).all())) for v in local], dist.ReduceOp.MAX)
    names = [name for name, flag in zip(quantities, bad) if flag]
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
        return int(all_reduce([float(self.signum)], dist.ReduceOp.MAX)[0])


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


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group (or batch) std unless scale='none'."""
    grouped = rewards.view(-1, group)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "group":
        return centered / (grouped.std(dim=1).repeat_interleave(group) + 1e-4)
    if scale == "batch":
        return centered / (rewards.std() + 1e-4)
    return centered


def make_batch(samples: list[dict], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded responses -> input_ids/attention_mask [N, P+R], response_mask [N, R]."""
    width_p = max(len(s["prompt_ids"]) for s in samples)
    width_r = max(1, max(len(s["completion_ids"]) for s in samples))
    n = len(samples)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    vllm_logprobs = torch.zeros((n, width_r))
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["completion_ids"])
        input_ids[i, width_p - p : width_p] = torch.tensor(s["prompt_ids"])
        input_ids[i, width_p : width_p + r] = torch.tensor(s["completion_ids"], dtype=torch.long)
        attention_mask[i, width_p - p : width_p + r] = 1
        vllm_logprobs[i, :r] = torch.tensor(s["vllm_logprobs"])
    response_mask = attention_mask[:, width_p:].clone()
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                 vllm_logprobs=vllm_logprobs)
    return {k: v.to(device) for k, v in batch.items()}


def select(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """Rows of a batch, with the columns trimmed to the longest prompt and response among them."""
    sub = {k: v[rows] for k, v in batch.items()}
    width_r = batch["response_mask"].shape[1]
    width_p = batch["attention_mask"].shape[1] - width_r
    prompt_used = sub["attention_mask"][:, :width_p].sum(1).max().item()
    response_used = max(1, sub["response_mask"].sum(1).max().item())
    cols = slice(width_p - prompt_used, width_p + response_used)
    for key in ("input_ids", "attention_mask"):
        sub[key] = sub[key][:, cols]
    for key in ("response_mask", "vllm_logprobs", "old_logprobs", "ref_logprobs", "advantages_tok"):
        if key in sub:
            sub[key] = sub[key][:, :response_used]
    return sub


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


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (see recipes/configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. lora.merge=false learning_rate=2e-5")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)

    rank, world, device = init_distributed()
    run_dir = Path(cfg.output_dir) / cfg.run_name
    resume = resolve_checkpoint(cfg.resume_from_checkpoint, run_dir) if cfg.resume_from_checkpoint else None
    earlier_checkpoints = list_checkpoints(run_dir)
    if resume is None and earlier_checkpoints:
        raise ConfigError(f"{run_dir} already holds {earlier_checkpoints[-1].name} from an earlier run: continue "
                          "it with resume_from_checkpoint=last, or choose another run_name or output_dir")
    resumed_step = json.loads((resume / "trainer_state.json").read_text())["step"] if resume else 0
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
        # a resumed run keeps the steps up to its checkpoint and redoes the rest
        metrics_file.write_text("".join(line + "\n" for line in earlier if json.loads(line)["step"] <= resumed_step))
    log.info("run %s: %d process(es) on %s, merge=%s", run_dir, world, device.type, cfg.lora.merge)

    # The embedded default builds its own small model (rank 0; the others wait for it).
    if cfg.model.build_tiny:
        if rank == 0:
            from tiny_gsm8k import build_tiny_model

            build_tiny_model(cfg.model.name_or_path, size=cfg.model.build_tiny, seed=cfg.model.build_seed)
        if dist.is_initialized():
            dist.barrier()
    name = cfg.model.name_or_path
    if not Path(name).exists() and (os.environ.get("HF_HUB_OFFLINE") == "1" or name.startswith(("/", ".", "~"))
                                    or name.count("/") != 1):  # hub ids look like org/name
        raise ConfigError(f"model.name_or_path={name!r} does not exist locally"
                          + (" and HF_HUB_OFFLINE=1" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""))

    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    reward_funcs = load_reward_funcs(cfg.reward_funcs)
    problems = load_problems(cfg)
    needed = {c for f in reward_funcs for c in reward_columns(f)}
    missing = sorted(needed - set(problems[0]))
    if missing:
        raise ConfigError(f"data.name={cfg.data.name!r} lacks column(s) {missing} that reward_funcs "
                          f"{cfg.reward_funcs} need; it has {sorted(problems[0])}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    problems = tokenize_prompts(cfg, tokenizer, problems)
    random.Random(cfg.seed).shuffle(problems)

    model = build_policy(cfg, device, world)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    updates_per_step = cfg.steps_per_generation * cfg.num_iterations
    num_steps = math.ceil(cfg.max_steps / updates_per_step)  # max_steps counts optimizer steps, as in TRL
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, num_steps * updates_per_step))
    last_checkpoint = None
    if resume:
        load_checkpoint(resume, model, optimizer, scheduler, config_to_dict(cfg), rank)
        last_checkpoint = resume
        log.info("resumed from %s: continuing at step %d of %d", resume, resumed_step + 1, num_steps)

    def checkpoint(step: int) -> Path:
        """Save the state after ``step`` rollouts (collective); a no-op if that checkpoint was just written."""
        if last_checkpoint == checkpoint_path(run_dir, step * updates_per_step):
            return last_checkpoint
        state = dict(step=step, global_step=step * updates_per_step, data_position=step * world * ppr,
                     world_size=world, seed=cfg.seed)
        return save_checkpoint(run_dir, model, optimizer, scheduler, state, config_to_dict(cfg), rank,
                               cfg.save_total_limit)

    llm = build_engine(cfg, rank, world)
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    engine_dtype = getattr(torch, cfg.model.dtype)
    adapter_dir = run_dir / "_rollout_adapter"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ppr = cfg.prompts_per_rank
    eps_low, eps_high = cfg.epsilon, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon

    stop = StopRequest()  # after vLLM is built, so that these handlers are the ones in force
    signum, step = 0, resumed_step
    for step in range(resumed_step + 1, num_steps + 1):
        t_step = time.perf_counter()
        # 1. sync ---------------------------------------------------------------------------------
        t0 = time.perf_counter()
        digest_before = params_digest(model) if cfg.vllm.verify_sync else None
        lora_request = None
        if not cfg.vllm.sync:
            pass  # debugging only: vLLM keeps serving stale weights, which rollout_logprob_diff must catch
        elif cfg.lora.merge:
            llm.collective_rpc("reload_weights", kwargs=dict(
                weights_iterator=merged_lora_params(model, dtype=engine_dtype), is_checkpoint_format=True))
            llm.reset_prefix_cache()
        else:
            save_adapter(model, adapter_dir, rank)
            lora_request = LoRARequest(f"policy-step{step}", step, str(adapter_dir))
        sync_changed = float(digest_before is not None and digest_before != params_digest(model))
        sync_s = time.perf_counter() - t0

        # 2. rollout ------------------------------------------------------------------------------
        t0 = time.perf_counter()
        start = ((step - 1) * world + rank) * ppr
        rows = [problems[(start + i) % len(problems)] for i in range(ppr)]
        sampling = SamplingParams(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k if cfg.top_k > 0 else -1, max_tokens=cfg.max_completion_length,
                                  logprobs=0, seed=cfg.seed * 100_003 + step * world + rank)
        outputs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in rows], sampling,
                               lora_request=lora_request, use_tqdm=rank == 0)
        rollout_s = time.perf_counter() - t0
        samples = []
        for row, out in zip(rows, outputs):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                samples.append(dict(row=row, prompt_ids=row["prompt_ids"], completion_ids=ids, text=comp.text,
                                    truncated=comp.finish_reason == "length",
                                    vllm_logprobs=[lp[t].logprob for lp, t in zip(comp.logprobs, ids)]))
        rollout_tokens = sum(len(s["completion_ids"]) for s in samples)
        signum = stop.agreed()
        if signum:  # abandon this step: nothing was updated yet, so the state is the one after step - 1
            step -= 1
            last_checkpoint = checkpoint(step)
            break

        # 3. reward -------------------------------------------------------------------------------
        columns = {k: [s["row"][k] for s in samples] for k in rows[0] if k not in ("prompt", "prompt_ids")}
        table, returned = [], {}
        for name, func in zip(cfg.reward_funcs, reward_funcs):  # TRL's call: prompts, completions, ids, columns
            values = func(prompts=[s["row"]["prompt"] for s in samples], completions=[s["text"] for s in samples],
                          completion_ids=[s["completion_ids"] for s in samples], **columns)
            table.append([math.nan if v is None else v for v in values])
            returned[f"reward from {name}"] = torch.tensor([v for v in values if v is not None], dtype=torch.float64)
        stop_if_nonfinite(f"step {step}, rewards", returned, last_checkpoint)
        rewards = torch.tensor(table, dtype=torch.float32).nansum(dim=0)  # None means "not applicable", as in TRL
        advantages = group_advantages(rewards, cfg.num_generations, cfg.scale_rewards)

        # 4. old (and reference) log-probs: own no-grad forward, before any update ---------------
        t0 = time.perf_counter()
        batch = make_batch(samples, pad_id, device)
        if cfg.mask_truncated_completions:
            truncated = torch.tensor([s["truncated"] for s in samples], device=device)
            batch["response_mask"] = batch["response_mask"] * (~truncated)[:, None]
        batch["advantages_tok"] = advantages.to(device)[:, None].expand_as(batch["response_mask"]).contiguous()
        mb = cfg.per_device_train_batch_size
        chunks = [slice(i, i + mb) for i in range(0, len(samples), mb)]
        old, ref = torch.zeros_like(batch["vllm_logprobs"]), torch.zeros_like(batch["vllm_logprobs"])
        model.eval()
        with torch.no_grad():
            for rows_mb in chunks:
                sub = select(batch, rows_mb)
                width = sub["response_mask"].shape[1]
                old[rows_mb, :width] = packed_log_probs(model, sub["input_ids"], sub["attention_mask"],
                                                        sub["response_mask"], cfg.temperature)
                if cfg.beta > 0:
                    with model.disable_adapter():
                        ref[rows_mb, :width] = packed_log_probs(model, sub["input_ids"], sub["attention_mask"],
                                                                sub["response_mask"], cfg.temperature)
        batch["old_logprobs"], batch["ref_logprobs"] = old, ref
        mask = batch["response_mask"].bool()
        diff = (batch["vllm_logprobs"] - old).abs()[mask]

        # 5. update -------------------------------------------------------------------------------
        model.train()
        tokens_per_mb = max(1.0, mask.sum().item() / len(chunks))
        stats = dict(ratio_sum=0.0, ratio_min=math.inf, ratio_max=-math.inf, clipped=0.0, tokens=0.0, loss=0.0)
        bar = tqdm(total=updates_per_step, desc=f"update {step}", disable=rank != 0, leave=False)
        for iteration in range(cfg.num_iterations):
            for k, rows_mb in enumerate(chunks):
                sub = select(batch, rows_mb)
                m = sub["response_mask"].float()
                logp = packed_log_probs(model, sub["input_ids"], sub["attention_mask"], sub["response_mask"],
                                        cfg.temperature, legacy_slice=cfg.padding.legacy_slice)
                log_ratio = (logp - sub["old_logprobs"]) * m
                ratio = torch.exp(log_ratio)
                adv = sub["advantages_tok"]
                per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
                if cfg.beta > 0:
                    delta = sub["ref_logprobs"] - logp
                    per_token = per_token + cfg.beta * (torch.exp(delta) - delta - 1)
                if cfg.loss_type == "grpo":
                    loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
                elif cfg.loss_type == "bnpo":
                    loss = (per_token * m).sum() / m.sum().clamp(min=1)
                elif cfg.loss_type == "dr_grpo":
                    loss = (per_token * m).sum() / (m.shape[0] * cfg.max_completion_length)
                else:  # dapo: every token of the rollout weighs the same, whichever mini-batch it is in
                    loss = (per_token * m).sum() / tokens_per_mb
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                           cfg.max_grad_norm)
                stop_if_nonfinite(f"step {step}, iteration {iteration + 1}, mini-batch {k + 1}",
                                  dict(loss=loss, ratio=ratio[sub["response_mask"].bool()], grad_norm=grad_norm),
                                  last_checkpoint)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    real = ratio.detach()[sub["response_mask"].bool()]
                    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
                    stats["ratio_sum"] += real.sum().item()
                    stats["ratio_min"] = min(stats["ratio_min"], real.min().item() if real.numel() else math.inf)
                    stats["ratio_max"] = max(stats["ratio_max"], real.max().item() if real.numel() else -math.inf)
                    stats["clipped"] += (clipped & sub["response_mask"].bool()).sum().item()
                    stats["tokens"] += real.numel()
                    stats["loss"] += loss.item()
                bar.update(1)
        bar.close()
        update_s = time.perf_counter() - t0

        # 6. log ----------------------------------------------------------------------------------
        sums = all_reduce([rewards.nansum().item(), (rewards.nan_to_num() ** 2).sum().item(), len(samples),
                           stats["ratio_sum"], stats["clipped"], stats["tokens"], diff.sum().item(), diff.numel(),
                           rollout_tokens, stats["loss"] / updates_per_step, sync_changed])
        mins = all_reduce([stats["ratio_min"]], dist.ReduceOp.MIN)
        maxs = all_reduce([stats["ratio_max"], diff.max().item() if diff.numel() else 0.0, rollout_s, sync_s,
                           update_s, peak_mem_gb(device)], dist.ReduceOp.MAX)
        n = sums[2]
        reward_mean = sums[0] / n
        metrics = dict(
            step=step, global_step=step * updates_per_step, merge=cfg.lora.merge,
            legacy_slice=cfg.padding.legacy_slice, reward_mean=reward_mean,
            reward_std=math.sqrt(max(0.0, sums[1] / n - reward_mean**2)),
            ratio_mean=sums[3] / max(1, sums[5]), ratio_min=mins[0], ratio_max=maxs[0],
            clip_frac=sums[4] / max(1, sums[5]), rollout_logprob_diff_mean=sums[6] / max(1, sums[7]),
            rollout_logprob_diff_max=maxs[1], rollout_tokens=int(sums[8]), rollout_s=maxs[2],
            rollout_tokens_per_s=sums[8] / maxs[2], sync_s=maxs[3], update_s=maxs[4],
            step_s=time.perf_counter() - t_step, peak_mem_gb=maxs[5], loss=sums[9] / world,
            lr=scheduler.get_last_lr()[0],
        )
        if cfg.vllm.verify_sync:
            metrics["sync_changed_trainer"] = int(sums[10])
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            log.info("step %d/%d reward %.3f ratio %.6f [%.4g, %.4g] |vllm-trainer| %.2e tok/s %.0f sync %.2fs",
                     step, num_steps, metrics["reward_mean"], metrics["ratio_mean"], metrics["ratio_min"],
                     metrics["ratio_max"], metrics["rollout_logprob_diff_mean"], metrics["rollout_tokens_per_s"],
                     metrics["sync_s"])
        if metrics["rollout_logprob_diff_mean"] > cfg.vllm.max_logprob_diff:
            raise RuntimeError(
                f"step {step}: rollout_logprob_diff_mean={metrics['rollout_logprob_diff_mean']:.3g} exceeds "
                f"vllm.max_logprob_diff={cfg.vllm.max_logprob_diff}: vLLM is not serving the trainer's weights "
                "(a broken or skipped weight sync); stopping instead of training on stale rollouts"
            )

        # 7. save ---------------------------------------------------------------------------------
        signum = stop.agreed()
        crossed = step * updates_per_step // cfg.save_steps > (step - 1) * updates_per_step // cfg.save_steps
        if crossed or signum or step == num_steps:
            last_checkpoint = checkpoint(step)
        if signum:
            break

    if rank == 0:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    if signum:
        log.error("stopped by %s after step %d of %d; checkpoint: %s. To continue, run the same command with "
                  "resume_from_checkpoint=%s", signal.Signals(signum).name, step, num_steps, last_checkpoint,
                  last_checkpoint)
    else:
        save_adapter(model, run_dir / "adapter", rank)
        log.info("done: adapter in %s, metrics in %s", run_dir / "adapter", run_dir / "metrics.jsonl")
    del llm  # vLLM's shutdown tears down its process groups; it must run before ours is destroyed
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if signum:
        sys.exit(128 + signum)


if __name__ == "__main__":
    main()
