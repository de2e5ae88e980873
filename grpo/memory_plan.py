"""Memory per device for each phase of a rollout step, estimated from the model's config alone (no weights).

    python -m grpo.memory_plan --config recipes/configs/qwen3_4b_gsm8k.yaml --world 1 8 [overrides]
    python -m grpo.memory_plan --config recipes/configs/qwen3_4b_gsm8k.yaml --qwen3-4b-shape   # no hub needed

The recipe prints this plan at start and stops before loading anything when the largest phase does not fit on the
device. The terms (per device, bytes):

  policy shard      base weights in model.dtype / world (FSDP2 shards; one process holds them whole)
  unsharded layers  two decoder layers in the compute dtype: the one in use and the one prefetched
  LoRA + AdamW      fp32 LoRA weights, gradients and two moments (16 bytes per LoRA parameter) / world
  vLLM weights      the whole model in model.dtype: every rank runs its own engine (tensor parallel 1)
  KV cache          vllm.kv_cache_gb
  vLLM runtime      what vLLM allocates besides weights and KV cache: the sampler's fp32 logits of max_num_seqs
                    sequences over the vocabulary (x3: logits, the sorted copy top-k/top-p sorts, probabilities),
                    one engine step's activations (max_num_batched_tokens tokens through the widest layer), and
                    a 1 GiB margin for CUDA graphs unless vllm.enforce_eager
  activations       one mini-batch (per_device_train_batch_size x the longest sequence): with gradient
                    checkpointing each layer keeps its input and one layer is recomputed at a time; without,
                    every layer keeps its intermediates. Plus the logits (compute-dtype logits and their gradient,
                    the fp32 log-softmax): of one chunk of padding.logprob_chunk_size response positions (the
                    LM head runs on response positions only, chunk by chunk, recomputed in the backward), or of
                    every packed token when logprob_chunk_size is null.
  unsharded root    FSDP2's root group (embedding, tied lm_head, final norm) in the compute dtype: unsharded
                    through the whole forward and the whole backward, which enclose every layer's (0.72 GiB at
                    Qwen3-4B in bf16)
  sync copies       the largest group's tensors in flight during a sync (the root's, at Qwen3-4B): its all-gather
                    and merged_lora_params' copy of it when sharded, and the layer vLLM's reload rebuilds
  vLLM CUDA graphs  vLLM 0.32's sleep mode releases weights and KV cache but keeps its CUDA graphs on the GPU
                    (sleep_mode_offload_cudagraph defaults to False): the 1 GiB margin stays in the update phase

vllm.mode=server: the engine runs on the server's devices, so none of the vLLM terms count on a training device;
the plan gives the server's own per worker (``server``, with vllm.server_tensor_parallel_size workers: its weights,
KV cache and runtime; the lora_merge backend's shard of the pristine targeted base weights, in pinned host memory
unless vllm.server_base_on_device; the merge's peak on the device, the largest reloaded layer full-shaped plus its
shard plus the fp32 chunks, `merge.lora_merge.shards`; two updates' LoRA factors, whole on every worker).
`check_server_fits` checks the worker's device side; the
server itself refuses at connect when its shard and merge peak do not fit beside its KV cache.

Phases: sync (shard + LoRA/AdamW + vLLM weights + sync copies), rollout (shard + LoRA/AdamW + vLLM weights + KV
cache + vLLM runtime), update (shard + LoRA/AdamW + unsharded layers + unsharded root + activations, plus vLLM's
weights, KV cache and runtime unless vllm.enable_sleep_mode releases them, which leaves the CUDA graphs). An
estimate, not a measurement: allocator fragmentation and the CUDA context (~1 GiB) come on top, so the check leaves
10% of the device free.
"""

from __future__ import annotations

import argparse

import torch

from grpo.config import RecipeConfig, load_config

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _parameter_counts(model_config, target_modules: list[str], rank: int) -> dict[str, int]:
    """Total, largest decoder layer and LoRA parameter counts of the model ``model_config`` describes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    layers = model.model.layers
    lora = sum(
        rank * (module.in_features + module.out_features)
        for layer in layers
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules
    )
    total = sum(p.numel() for p in model.parameters())
    # FSDP2's root group: what no decoder layer holds (embedding, tied or own lm_head, final norm)
    root = total - sum(p.numel() for layer in layers for p in layer.parameters())
    # the lora_merge server's pristine copy: every block (attention, MLP) holding a target, siblings included
    targeted = sum(
        sum(p.numel() for p in block.parameters())
        for layer in layers
        for block in layer.children()
        if any(name.rsplit(".", 1)[-1] in target_modules for name, _ in block.named_modules())
    )
    # vLLM's reload buffers one of its layers (q/k/v fused, gate/up fused) full-shaped while the server merges
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    reloaded = 0
    for layer in layers:
        sizes: dict[str, int] = {}
        hit: set[str] = set()
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                leaf = name.rsplit(".", 1)[-1]
                key = name.rsplit(".", 1)[0] + "." + fused.get(leaf, leaf)
                sizes[key] = sizes.get(key, 0) + module.weight.numel()
                if leaf in target_modules:
                    hit.add(key)
        reloaded = max([reloaded] + [sizes[key] for key in hit])
    if "embed_tokens" in target_modules:
        reloaded = max(reloaded, model.get_input_embeddings().weight.numel())
    return dict(
        total=total,
        layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        lora=lora,
        root=root,
        targeted=targeted,
        reloaded=reloaded,
    )


def _activation_bytes(c, cfg: RecipeConfig, compute_bytes: int, checkpointing: bool) -> int:
    """One mini-batch's activations kept for the backward, logits included."""
    tokens = cfg.per_device_train_batch_size * (cfg.data.max_prompt_length + cfg.max_completion_length)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    intermediate = getattr(c, "intermediate_size", 4 * c.hidden_size)
    # norms and residuals, q/k/v and their rotated copies, attention output, the MLP's gate/up/act/product
    per_layer = compute_bytes * tokens * (8 * c.hidden_size + 3 * qkv + 4 * intermediate)
    stored = (
        compute_bytes * tokens * c.hidden_size * c.num_hidden_layers + per_layer
        if checkpointing
        else per_layer * c.num_hidden_layers
    )
    # padding.packed_log_probs projects only the response positions, padding.logprob_chunk_size rows at a time
    # (each chunk recomputed in the backward); without chunks, every packed token's logits at once
    chunk = cfg.padding.logprob_chunk_size
    rows = tokens if chunk is None else min(chunk, cfg.per_device_train_batch_size * cfg.max_completion_length)
    logits = rows * c.vocab_size * (2 * compute_bytes + 4)
    return stored + logits


def _vllm_runtime_bytes(c, cfg: RecipeConfig, world: int) -> float:
    """The sampler's buffers, one engine step's activations and the CUDA-graph margin (module docstring)."""
    max_num_seqs = cfg.vllm_max_num_seqs(world)
    sampler = 3 * max_num_seqs * c.vocab_size * 4
    intermediate = getattr(c, "intermediate_size", 4 * c.hidden_size)
    step = max(cfg.vllm.max_num_batched_tokens, cfg.data.max_prompt_length + cfg.max_completion_length)
    activations = step * (2 * intermediate + 4 * c.hidden_size) * _BYTES[cfg.model.dtype]
    return sampler + activations + (0 if cfg.vllm.enforce_eager else GIB)


def _sync_copies_bytes(params: int, sharded: bool, gather_bytes: int, weight_bytes: int) -> int:
    """One group's tensors in flight during a weight sync: FSDP2's all-gather and merged_lora_params' copies of it
    (sharded only: unsharded, the tensors it yields are views), and the layer vLLM's reload rebuilds before copying
    it into the engine's weights (vllm/model_executor/model_loader/reload/layerwise.py: materialize_layer)."""
    return params * ((gather_bytes + weight_bytes if sharded else 0) + weight_bytes)


def _merge_peak_bytes(reloaded: int, tp: int, weight_bytes: int) -> float:
    """A server worker's merge peak (`merge.lora_merge.shards.merge_peak_bytes`): the largest reloaded layer
    full-shaped, the shard of it vLLM rebuilds, and four fp32 chunks."""
    from merge.lora_merge.shards import CHUNK_ELEMENTS

    return reloaded * weight_bytes * (1 + 1 / tp) + 16 * min(CHUNK_ELEMENTS, reloaded / tp)


def memory_plan(
    model_config,
    cfg: RecipeConfig,
    world: int,
    checkpointing: bool | None = None,
    compute_dtype: str | None = None,
    sharded: bool | None = None,
) -> dict:
    """Bytes per device of each term and each phase (see the module docstring).

    ``sharded``: whether FSDP2 shards the policy (default: world > 1, as the recipe does).
    """
    checkpointing = cfg.gradient_checkpointing if checkpointing is None else checkpointing
    sharded = world > 1 if sharded is None else sharded
    counts = _parameter_counts(model_config, cfg.lora.target_modules, cfg.lora.r)
    weight_bytes = _BYTES[cfg.model.dtype]
    compute_bytes = _BYTES[compute_dtype or cfg.model.dtype]
    terms = {
        "policy shard": counts["total"] * weight_bytes / world,
        "unsharded layers": 2 * counts["layer"] * compute_bytes if sharded else 0,
        # FSDP2's root group stays unsharded through the model's forward and its backward, every layer's included
        "unsharded root": counts["root"] * compute_bytes if sharded else 0,
        "LoRA + AdamW": 16 * counts["lora"] / world,
        "vLLM weights": counts["total"] * weight_bytes,
        "KV cache": cfg.vllm.kv_cache_gb * GIB,
        "vLLM runtime": _vllm_runtime_bytes(model_config, cfg, world),
        # the largest group's (the root's) all-gather, its copies and vLLM's rebuilt layer, during a sync
        "sync copies": max(
            _sync_copies_bytes(counts[group], sharded, compute_bytes, weight_bytes) for group in ("root", "layer")
        ),
        # vLLM 0.32's sleep keeps CUDA graphs on the GPU (sleep_mode_offload_cudagraph=False): the runtime's margin
        "vLLM CUDA graphs": GIB if cfg.vllm.enable_sleep_mode and not cfg.vllm.enforce_eager else 0,
        "activations": _activation_bytes(model_config, cfg, compute_bytes, checkpointing),
    }
    server = None
    if cfg.vllm.mode == "server":
        tp = cfg.vllm.server_tensor_parallel_size
        server = {name: terms[name] for name in ("vLLM weights", "KV cache", "vLLM runtime")}
        server["vLLM weights"] /= tp
        where = "device" if cfg.vllm.server_base_on_device else "host"
        server[f"pristine base ({where})"] = counts["targeted"] * weight_bytes / tp
        server["merge peak (device)"] = _merge_peak_bytes(counts["reloaded"], tp, weight_bytes)
        # every worker receives the whole update (the factors are not split by TP) and keeps the one it serves, to
        # rebuild it at a restore, beside the next: two updates' buffers, in the wire's dtype (fp32 but in bf16/fp16)
        factor_bytes = weight_bytes if cfg.model.dtype in ("bfloat16", "float16") else 4
        server["LoRA factors x2 (device)"] = 2 * counts["lora"] * factor_bytes
        # a server sync gathers LoRA factors only (no base weights unsharded, no engine here to rebuild a layer)
        terms.update(
            {name: 0.0 for name in ("vLLM weights", "KV cache", "vLLM runtime", "vLLM CUDA graphs", "sync copies")}
        )
    trainer = terms["policy shard"] + terms["LoRA + AdamW"]
    engine = terms["vLLM weights"] + terms["KV cache"] + terms["vLLM runtime"]
    phases = {
        "sync": trainer + terms["vLLM weights"] + terms["sync copies"],
        "rollout": trainer + engine,
        "update": trainer
        + terms["unsharded layers"]
        + terms["unsharded root"]
        + terms["activations"]
        + (terms["vLLM CUDA graphs"] if cfg.vllm.enable_sleep_mode else engine),
    }
    return dict(terms=terms, phases=phases, parameters=counts, server=server)


def device_memory_bytes(device: torch.device) -> float:
    """What one process may use: its GPU's memory, or on CPU the machine's memory shared by its local processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    import psutil

    return psutil.virtual_memory().total / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def format_plan(plan: dict, device_bytes: float | None = None) -> str:
    lines = [f"{name:>17}: {value / GIB:7.2f} GiB" for name, value in plan["terms"].items()]
    lines += [f"{'phase ' + name:>17}: {value / GIB:7.2f} GiB" for name, value in plan["phases"].items()]
    if device_bytes:
        lines.append(f"{'device':>17}: {device_bytes / GIB:7.2f} GiB")
    if plan["server"]:
        lines.append("the server, per worker:")
        lines += [f"{name:>24}: {value / GIB:7.2f} GiB" for name, value in plan["server"].items()]
    return "\n".join(lines)


def check_fits(plan: dict, device_bytes: float, cfg: RecipeConfig) -> str | None:
    """None if every phase fits in 90% of ``device_bytes``; else a message naming the phase and what to change."""
    phase, need = max(plan["phases"].items(), key=lambda item: item[1])
    if need <= 0.9 * device_bytes:
        return None
    hints = [
        f"per_device_train_batch_size={cfg.per_device_train_batch_size} (activations "
        f"{plan['terms']['activations'] / GIB:.1f} GiB)"
    ]
    if not cfg.gradient_checkpointing:
        hints.append("gradient_checkpointing=true")
    if not cfg.vllm.enable_sleep_mode:
        hints.append("vllm.enable_sleep_mode=true (GPU)")
    hints.append(f"vllm.kv_cache_gb={cfg.vllm.kv_cache_gb:g}")
    return (
        f"the configured run needs about {need / GIB:.1f} GiB per device in its {phase} phase, more than 90% of "
        f"the device's {device_bytes / GIB:.1f} GiB; lower {', '.join(hints)}, or use more processes\n"
        + format_plan(plan, device_bytes)
    )


def server_device_bytes(plan: dict) -> float:
    """What one server worker holds on its device (server mode): everything but a base kept in host memory."""
    return sum(value for name, value in (plan["server"] or {}).items() if name != "pristine base (host)")


def check_server_fits(plan: dict, device_bytes: float, cfg: RecipeConfig) -> str | None:
    """Server mode, a worker on a device of ``device_bytes``: None if its share fits in 90% of it; else what to
    change. (The server checks the same at connect, against what its KV cache really left free.)"""
    need = server_device_bytes(plan)
    if not plan["server"] or need <= 0.9 * device_bytes:
        return None
    hints = [f"vllm.kv_cache_gb={cfg.vllm.kv_cache_gb:g}"]
    if cfg.vllm.server_base_on_device:
        hints.insert(0, "vllm.server_base_on_device=false")
    return (
        f"each of the server's {cfg.vllm.server_tensor_parallel_size} worker(s) needs about {need / GIB:.1f} GiB "
        f"of its device, more than 90% of {device_bytes / GIB:.1f} GiB: "
        + ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in plan["server"].items())
        + f"; set {' or '.join(hints)}, or serve with a larger --tensor-parallel-size "
        "(vllm.server_tensor_parallel_size)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 8], help="processes (GPUs) to plan for")
    parser.add_argument("--device-gib", type=float, default=80.0, help="memory of one device")
    parser.add_argument(
        "--qwen3-4b-shape",
        action="store_true",
        help="plan for Qwen3-4B's architecture (grpo/qwen3_4b_shape.py) instead of model.name_or_path",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from transformers import AutoConfig

    cfg = load_config(args.config, args.overrides)
    if args.qwen3_4b_shape:
        from grpo.qwen3_4b_shape import qwen3_4b_config

        model_config = qwen3_4b_config()
    else:
        model_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    for world in args.world:
        for checkpointing in (True, False):
            plan = memory_plan(model_config, cfg, world, checkpointing)
            print(
                f"\n{cfg.model.name_or_path}, {world} device(s), gradient_checkpointing={checkpointing}, "
                f"sleep mode {cfg.vllm.enable_sleep_mode}:"
            )
            print(format_plan(plan, args.device_gib * GIB))
            if plan["server"]:
                print(
                    f"  the server's own memory per worker (vllm.mode=server, "
                    f"{cfg.vllm.server_tensor_parallel_size} worker(s)): "
                    + ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in plan["server"].items())
                )
                print("  " + (check_server_fits(plan, args.device_gib * GIB, cfg) or "the server's workers fit"))
            problem = check_fits(plan, args.device_gib * GIB, cfg)
            print("fits" if problem is None else "does NOT fit")


if __name__ == "__main__":
    main()
