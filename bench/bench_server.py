"""Server mode's sync and rollout costs, side by side in one run: lora_merge vs full merged weights vs vLLM LoRA.

    python bench/bench_server.py --out results/bench_server.json

For each model, real ``vllm serve`` subprocesses on this machine (`grpo.engines.server.serve_command`'s flags): one
with the ``lora_merge`` backend, one with ``--enable-lora`` (vLLM serving the adapter). The trainer side is this
process: a peft LoRA (r = 32, alpha = 64, every linear layer, non-zero lora_B) on the served checkpoint, synced
through the recipe's `ServerEngine.sync_policy` (``/pause``, the transfer, ``/resume``) in these ways:

  lora_merge               the recipe's setting: the factors over the gloo group, in the engine's dtype below fp32
                           (bf16: the dtype the trainer's forward reads them in) and as trained in fp32; the server
                           merges W_base + scale*B@A in fp32 from its pristine base and reloads layer-wise
                           (`merge.lora_merge`), measuring the merge's precision below fp32 (sync_delta_*)
  lora_merge_no_stats      bf16 engines: the same without the precision figures (vllm.sync_precision_stats=false)
  lora_merge_fp32_factors  bf16 engines: the factors sent in fp32, as trained. Against lora_merge, the merged bf16
                           weights differ by what rounding the factors to bf16 changes, computed here
  full                     the whole merged model (`merge.merged_lora_params`, in the engine's dtype) over the same
                           group and the same layer-wise reload (``update="full"``): it stands in for vLLM's own
                           full-weight transfer, whose backends (NCCL, CUDA IPC) need GPUs
  adapter                  vLLM LoRA: the adapter saved as safetensors, then ``/v1/load_lora_adapter`` on the LoRA
                           server

Each repetition runs the modes in turn (order reversed every other repetition); a lora_merge mode first reconnects
(its own group, the pristine base read again), and every mode syncs once untimed, so only a steady-state sync is
timed. Times over the full sync's are paired: each repetition's ratio (the two ran back to back), their median and
spread; the 1-minute load average is recorded after each repetition. Bytes:
what crosses the wire (the factors, the weights) or the adapter file. After lora_merge (with fp32 factors where
there is that mode) and after full the server's greedy log-probs on fixed prompts are compared: both must serve the
same weights.

Models: "small" (the 26.5M Qwen3 of `grpo.tasks.tiny_gsm8k`, fp32, as bench/bench_rollout.py and bench_sync.py),
"qwen3-4b-1layer" and "qwen3-4b-4layers" (1 and 4 decoder layers of Qwen3-4B's exact shape with its 151,936-token
vocabulary, bf16, `grpo.qwen3_4b_shape`). From the two depths, Qwen3-4B's 36 layers are extrapolated: bytes exactly
(the 4-layer model's per-layer bytes x 36 + the rest), seconds by a line through the two depths per mode
(t(L) = t(1) + (L - 1) * (t(4) - t(1)) / 3: the fixed costs once, the per-layer cost 36 times). "tiny" (the embedded
default, fp32) is the smallest mode, for the test.

Rollouts (``--rollout-models``, default small): the server's tokens/s serving the base weights (lora_merge of a
zero adapter: W_base exactly), the merged weights (lora_merge of the policy) and the adapter (vLLM LoRA, the other
server), on the same prompts with the same seeds and sampling (``ignore_eos``: every mode generates the same number
of tokens), interleaved repetitions, medians and ratios (merged/base also as the median of each repetition's ratio).

The machine is shared: every timing here is a median of interleaved repetitions, and the ratios are what to read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import requests
import torch
from bench_common import ALL_LINEAR, machine_info, serve, wait_until_up, with_random_lora
from transformers import AutoModelForCausalLM

from grpo.engines.server import ServerEngine
from grpo.tasks.tiny_gsm8k import build_tiny_model, format_prompt, make_problems
from merge.lora_merge import LoraMergeTrainer, lora_update

QWEN3_4B_LAYERS = 36
MODELS = {  # name -> engine dtype
    "tiny": "float32",
    "small": "float32",
    "qwen3-4b-1layer": "bfloat16",
    "qwen3-4b-4layers": "bfloat16",
}
DEPTHS = {"qwen3-4b-1layer": 1, "qwen3-4b-4layers": 4}  # decoder layers of Qwen3-4B's shape
SCORE_PROMPTS = ["Q: 3+4=?\nA:", "Q: 12+30=?\nA:", "Q: 7+7=?\nA:"]


def model_dir(name: str, cache: Path, tiny_model: str | None = None) -> str:
    if name == "tiny":
        return tiny_model or build_tiny_model(cache / "tiny-qwen3-gsm8k")
    if name == "small":
        return build_tiny_model(cache / "bench-small", size="small", seed=0, warmup_steps=0)
    from grpo.qwen3_4b_shape import build_qwen3_4b_shape

    return build_qwen3_4b_shape(cache / name, num_layers=DEPTHS[name], dtype="bfloat16")


# ----------------------------------------------------------------------------- servers
@contextlib.contextmanager
def servers(model: str, dtype: str, log_dir: Path, lora_rank: int | None, fork_engine: bool):
    """The lora_merge server and, with ``lora_rank``, the LoRA server (started together); yields their URLs."""
    started = [serve(model, log_dir / "lora_merge.log", dtype=dtype, fork_engine=fork_engine)]
    if lora_rank is not None:
        started.append(serve(model, log_dir / "lora.log", dtype=dtype, lora_rank=lora_rank, fork_engine=fork_engine))
    try:
        for (proc, url), name in zip(started, ["lora_merge.log", "lora.log"]):
            wait_until_up(proc, url, log_dir / name)
        yield [url for _, url in started] + [None] * (2 - len(started))
    finally:
        for proc, _ in started:
            proc.terminate()
        for proc, _ in started:
            proc.wait(timeout=60)


# ----------------------------------------------------------------------------- trainer side
def policy(model: str, rank: int, lora_b_std: float = 0.01):
    """The served checkpoint in fp32 with a LoRA (alpha = 2 * rank) on every linear layer."""
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return with_random_lora(base, rank=rank, targets=ALL_LINEAR, lora_b_std=lora_b_std)


def factor_bytes(peft_model) -> int:
    """The LoRA factors' bytes, counted from the peft model's parameters."""
    return sum(p.numel() * p.element_size() for name, p in peft_model.named_parameters() if "lora_" in name)


@torch.no_grad()
def bf16_factor_error(peft_model, engine_dtype: torch.dtype) -> dict:
    """What sending the factors in bf16 changes: per targeted weight, ``(W + s*B@A).to(engine)`` with fp32 factors
    vs with bf16-cast factors (both merged in fp32, as the server does): the share of merged elements that differ,
    the largest difference, and the relative difference of the delta itself."""
    update = lora_update(peft_model)
    weights = {name: p for name, p in peft_model.get_base_model().state_dict().items()}
    differ = total = 0
    largest = err_sq = delta_sq = 0.0
    for entry, (b, a) in update.by_entry():
        base = weights[entry["target"].replace(".weight", ".base_layer.weight")].float()
        delta = (b.float() @ a.float()) * entry["scale"]
        delta_cast = (b.bfloat16().float() @ a.bfloat16().float()) * entry["scale"]
        merged, merged_cast = (base + delta).to(engine_dtype), (base + delta_cast).to(engine_dtype)
        differ += int((merged != merged_cast).sum())
        total += merged.numel()
        largest = max(largest, (merged.float() - merged_cast.float()).abs().max().item())
        err_sq += (delta_cast - delta).pow(2).sum().item()
        delta_sq += delta.pow(2).sum().item()
    return dict(
        merged_elements_differing=differ / total, merged_max_abs_diff=largest, delta_rel_err=(err_sq / delta_sq) ** 0.5
    )


def generate(url: str, model: str, prompt_ids: list[list[int]], sampling: dict, seeds: list[int]) -> list[dict]:
    """``/inference/v1/generate`` for every prompt, sent together (as `ServerEngine.generate`)."""

    def one(ids, seed):
        response = requests.post(
            f"{url}/inference/v1/generate",
            timeout=600,
            json=dict(token_ids=ids, model=model, sampling_params={**sampling, "seed": seed}),
        )
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(max_workers=min(32, len(prompt_ids))) as pool:
        return list(pool.map(one, prompt_ids, seeds))


def greedy_logprobs(engine: ServerEngine, max_tokens: int = 16) -> list[float]:
    prompt_ids = [engine.tokenizer(p)["input_ids"] for p in SCORE_PROMPTS]
    sampling = dict(n=1, temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    responses = generate(engine.url, engine.served_name, prompt_ids, sampling, [0] * len(prompt_ids))
    return [entry["logprob"] for r in responses for c in r["choices"] for entry in c["logprobs"]["content"]]


# ----------------------------------------------------------------------------- the benchmark
def bench_sync(name: str, args, log_dir: Path) -> dict:
    dtype = MODELS[name]
    model = model_dir(name, args.cache, args.tiny_model)
    peft_model = policy(model, args.rank)
    zero_model = policy(model, args.rank, lora_b_std=0.0) if name in args.rollout_models else None
    engine_dtype = getattr(torch, dtype)
    lora = None
    lora_rank = None if args.no_adapter else args.rank
    with servers(model, dtype, log_dir / name, lora_rank, args.fork_engine) as (merge_url, lora_url):
        merged = ServerEngine(merge_url, model, dtype=dtype)  # the recipe's settings for this dtype
        recipe = dict(update="lora", wire_dtype=merged.wire_dtype, precision_stats=merged.precision_stats)
        modes = {"lora_merge": recipe}
        if merged.wire_dtype is not None:
            modes["lora_merge_no_stats"] = {**recipe, "precision_stats": False}
            modes["lora_merge_fp32_factors"] = {**recipe, "wire_dtype": None}
        modes["full"] = dict(update="full", wire_dtype=dtype)
        adapter_engine = ServerEngine(lora_url, model, merge=False) if lora_url else None
        if adapter_engine:
            modes["adapter"] = {}
        adapter_dir = log_dir / name  # the run's temporary folder
        version = iter(range(1, 10**6))
        seconds = {mode: [] for mode in modes}
        wire_seconds = {mode: [] for mode in modes}
        nbytes, checks = {}, {}

        def sync(mode: str) -> tuple[float, dict]:
            start = time.perf_counter()
            if mode == "adapter":
                metrics = adapter_engine.sync_policy(peft_model, adapter_dir / "adapter", next(version), 0)
            else:
                metrics = merged.sync_policy(peft_model, None, next(version), 0)
            return time.perf_counter() - start, metrics

        load = []  # the 1-minute load average after each repetition: what else shared the cores meanwhile
        for rep in range(args.reps):
            for mode in modes if rep % 2 == 0 else list(modes)[::-1]:
                if mode != "adapter":  # reconnect in this mode (it reads the pristine base again)
                    if merged.transfer is not None:
                        merged.transfer.shutdown()
                    merged.transfer = LoraMergeTrainer.connect(merge_url, rank=0, num_workers=1, **modes[mode])
                sync(mode)  # one untimed sync in every mode (lora_merge's connects): only steady state is timed
                elapsed, metrics = sync(mode)
                seconds[mode].append(elapsed)
                if mode == "adapter":
                    nbytes[mode] = (adapter_dir / "adapter" / "adapter_model.safetensors").stat().st_size
                else:
                    nbytes[mode] = int(metrics["sync_bytes"])
                    wire_seconds[mode].append(merged.transfer.last_sync["sync_seconds"])
                    if rep == 0 and mode in ("lora_merge_fp32_factors" if merged.wire_dtype else "lora_merge", "full"):
                        checks[mode] = greedy_logprobs(merged)
            load.append(os.getloadavg()[0])

        if zero_model is not None:  # rollouts need the lora_merge connection and the adapter on the LoRA server
            merged.transfer.shutdown()
            merged.transfer = LoraMergeTrainer.connect(merge_url, rank=0, num_workers=1, **recipe)
            lora = bench_rollout(args, merged, adapter_engine, peft_model, zero_model, version)
        merged.close()
        if adapter_engine:
            adapter_engine.close()

    result = dict(
        model=model,
        engine_dtype=dtype,
        lora_rank=args.rank,
        lora_alpha=2 * args.rank,
        targets=ALL_LINEAR,
        parameters=sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" not in n),
        factor_bytes_counted=factor_bytes(peft_model),
        repetitions=args.reps,
        load_average_1min_per_repetition=load,
        modes=mode_figures(modes, nbytes, seconds, wire_seconds),
        # lora_merge with fp32 factors (the full sync merges those, as the server does): the same weights, the same
        # greedy log-probs. (With bf16 factors, 7% of the merged weights move by one ulp, and on a random model's
        # near-uniform logits a greedy path can then branch: no token-by-token comparison.)
        full_vs_lora_merge_greedy_logprobs_max_abs_diff=max(
            abs(x - y) for mode, logprobs in checks.items() if mode != "full" for x, y in zip(logprobs, checks["full"])
        ),
        greedy_logprobs_compared=len(checks["full"]),
    )
    if merged.wire_dtype == "bfloat16":
        result["bf16_factors_vs_fp32_factors"] = bf16_factor_error(peft_model, engine_dtype)
    if lora is not None:
        result["rollout"] = lora
    return result


def paired(ratios: list[float]) -> dict:
    """Ratios measured within one repetition each (the two syncs ran back to back, under the same load): their
    median and their spread."""
    return dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios), per_repetition=ratios)


def mode_figures(modes: dict, nbytes: dict, seconds: dict, wire_seconds: dict) -> dict:
    """Per sync mode: its bytes and median seconds, the bytes over the full sync's, the time over the full sync's
    as the median of the per-repetition ratios with their spread (`paired`), the median time on the wire and in
    the server (lora_merge and full), the raw samples and what the mode's settings mean."""
    return {
        mode: dict(
            bytes=nbytes[mode],
            bytes_over_full=nbytes[mode] / nbytes["full"],
            median_s=statistics.median(seconds[mode]),
            s_over_full_paired=paired([t / full for t, full in zip(seconds[mode], seconds["full"])]),
            median_wire_and_server_s=(statistics.median(wire_seconds[mode]) if wire_seconds[mode] else None),
            raw_s=seconds[mode],
            **settings_note(mode, modes.get(mode, {})),
        )
        for mode in modes
    }


def settings_note(mode: str, settings: dict) -> dict:
    notes = {
        "lora_merge": "the recipe's setting: the LoRA factors over the gloo group (in the engine's dtype below fp32), "
        "merged in fp32 in the server, precision figures below fp32",
        "lora_merge_no_stats": "as lora_merge, without the precision figures (vllm.sync_precision_stats=false)",
        "lora_merge_fp32_factors": "as lora_merge, the factors sent in fp32 as trained",
        "full": "the whole merged model in the engine's dtype over the same gloo group and layer-wise reload: "
        "stands in for vLLM's own full-weight transfer (NCCL / CUDA IPC backends, GPU only)",
        "adapter": "vLLM LoRA: the adapter saved as safetensors (bytes: the file), /v1/load_lora_adapter",
    }
    return dict(what=notes[mode], trainer_settings=settings)


def at_36_layers(one: float, four: float) -> float:
    return one + (QWEN3_4B_LAYERS - 1) * (four - one) / 3


def extrapolate(one: dict, four: dict) -> dict:
    """Qwen3-4B's 36 layers from its 1- and 4-layer slices: per mode, bytes and seconds on the line through the two
    depths (bytes exactly: every layer sends the same, the rest is fixed). The time over the full sync's is also
    extrapolated per repetition (repetition i of both depths, each mode against full), its median and spread: a
    slope through two noisy medians alone says nothing about how far the ratio can be trusted."""
    out = dict(
        how="per mode, the line through the 1-layer and the 4-layer measurements: "
        "x(36) = x(1) + 35 * (x(4) - x(1)) / 3, for the bytes (exact) and the median seconds (fixed costs once, "
        "the per-layer cost 36 times); s_over_full_paired: the same line per repetition, each mode over full",
        layers=QWEN3_4B_LAYERS,
        modes={},
    )
    for mode in four["modes"]:
        at = {depth: (r["modes"][mode]["bytes"], r["modes"][mode]["median_s"]) for depth, r in ((1, one), (4, four))}
        per_layer = [(at[4][i] - at[1][i]) / 3 for i in range(2)]
        out["modes"][mode] = dict(
            bytes=int(round(at[1][0] + (QWEN3_4B_LAYERS - 1) * per_layer[0])),
            bytes_per_layer=per_layer[0],
            seconds=at[1][1] + (QWEN3_4B_LAYERS - 1) * per_layer[1],
            seconds_per_layer=per_layer[1],
        )
    full = out["modes"]["full"]
    raw = {depth: r["modes"] for depth, r in ((1, one), (4, four))}
    full_36 = [at_36_layers(a, b) for a, b in zip(raw[1]["full"]["raw_s"], raw[4]["full"]["raw_s"])]
    for name, mode in out["modes"].items():
        mode["bytes_over_full"] = mode["bytes"] / full["bytes"]
        mode_36 = [at_36_layers(a, b) for a, b in zip(raw[1][name]["raw_s"], raw[4][name]["raw_s"])]
        mode["s_over_full_paired"] = paired([t / f for t, f in zip(mode_36, full_36)])
    return out


def report(path: Path) -> None:
    """Recompute the summaries of a run's JSON from its raw repetitions (``raw_s``), in place: the file keeps its
    measurements and its ``command``; ``report_command`` records this step."""
    out = json.loads(path.read_text())
    for result in out["models"].values():
        for mode in result["modes"].values():
            mode.pop("median_s_over_full", None)  # the ratio of two medians, replaced by the paired ratios
            full = result["modes"]["full"]["raw_s"]
            mode["s_over_full_paired"] = paired([t / f for t, f in zip(mode["raw_s"], full)])
    if set(DEPTHS) <= set(out["models"]):
        out["qwen3_4b_36_layers"] = extrapolate(*(out["models"][name] for name in DEPTHS))
    out["report_command"] = f"python bench/bench_server.py --report {path}"
    path.write_text(json.dumps(out, indent=2))


def bench_rollout(
    args, merged: ServerEngine, adapter_engine: ServerEngine | None, peft_model, zero_model, version
) -> dict:
    """Tokens/s of the lora_merge server on the base and the merged weights, and of the LoRA server's adapter."""
    prompts = [
        merged.tokenizer(format_prompt(p["question"]))["input_ids"] for p in make_problems(args.rollout_prompts, seed=1)
    ]
    seeds = list(range(len(prompts)))
    sampling = dict(
        n=args.rollout_n,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=args.rollout_max_tokens,
        logprobs=0,
        detokenize=False,
        ignore_eos=True,
    )
    modes = ["base", "merged"] + (["lora"] if adapter_engine else [])

    def run(mode: str) -> tuple[int, float]:
        if mode == "lora":
            url, model = adapter_engine.url, adapter_engine.lora_name
        else:  # W_base exactly (a zero adapter) or the policy, pushed by lora_merge (not timed)
            merged.sync_policy(zero_model if mode == "base" else peft_model, None, next(version), 0)
            url, model = merged.url, merged.served_name
        start = time.perf_counter()
        responses = generate(url, model, prompts, sampling, seeds)
        seconds = time.perf_counter() - start
        return sum(len(c["token_ids"]) for r in responses for c in r["choices"]), seconds

    for mode in modes:  # warm-up
        run(mode)
    tokens = {mode: [] for mode in modes}
    rates = {mode: [] for mode in modes}
    for rep in range(args.rollout_reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            count, seconds = run(mode)
            tokens[mode].append(count)
            rates[mode].append(count / seconds)
    median = {mode: statistics.median(rates[mode]) for mode in modes}
    out = dict(
        prompts=len(prompts),
        n=args.rollout_n,
        max_tokens=args.rollout_max_tokens,
        repetitions=args.rollout_reps,
        median_tokens_per_s=median,
        merged_over_base=median["merged"] / median["base"],
        # the ratio within each repetition (the two modes ran back to back), then its median: the machine's slow
        # spells, which last longer than one repetition, cancel
        merged_over_base_paired=statistics.median(m / b for m, b in zip(rates["merged"], rates["base"])),
        raw_tokens_per_s=rates,
        tokens=tokens,
    )
    if "lora" in median:
        out["merged_over_lora"] = median["merged"] / median["lora"]
        out["lora_over_base"] = median["lora"] / median["base"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["small", "qwen3-4b-1layer", "qwen3-4b-4layers"], choices=list(MODELS)
    )
    parser.add_argument("--rollout-models", nargs="*", default=["small"], choices=list(MODELS))
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions of each sync mode")
    parser.add_argument("--no-adapter", action="store_true", help="no LoRA server: lora_merge and full only")
    parser.add_argument(
        "--fork-engine", action="store_true", help="servers through bench/serve_forking.py (up sooner; the tests')"
    )
    parser.add_argument("--rollout-reps", type=int, default=9)
    parser.add_argument("--rollout-prompts", type=int, default=16)
    parser.add_argument("--rollout-n", type=int, default=4)
    parser.add_argument("--rollout-max-tokens", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=Path("cache"))
    parser.add_argument("--tiny-model", help="the 'tiny' model's folder (default: the embedded default, in --cache)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_server.json"))
    parser.add_argument("--report", type=Path, help="recompute the summaries of this run's JSON, measuring nothing")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    start = time.perf_counter()
    out = dict(
        machine=machine_info(),
        command="python bench/bench_server.py " + " ".join(sys.argv[1:]),
        note="one run on a shared machine: timings are medians of interleaved repetitions; read the paired ratios "
        "(each repetition's syncs ran back to back) with their spread, and the load recorded per repetition",
        models={},
    )
    with tempfile.TemporaryDirectory(prefix="bench-server-logs-") as logs:
        for name in args.models:
            (Path(logs) / name).mkdir()
            result = bench_sync(name, args, Path(logs))
            out["models"][name] = result
            for mode, r in result["modes"].items():
                print(
                    f"{name} {mode}: {r['bytes'] / 2**20:.2f} MiB ({100 * r['bytes_over_full']:.2f}% of full), "
                    f"median {r['median_s']:.3f} s ({r['s_over_full_paired']['median']:.2f}x full, paired, "
                    f"{r['s_over_full_paired']['min']:.2f}-{r['s_over_full_paired']['max']:.2f})",
                    flush=True,
                )
            if "rollout" in result:
                r = result["rollout"]
                print(
                    f"{name} rollout tok/s {r['median_tokens_per_s']}, merged/base {r['merged_over_base']:.3f} "
                    f"(paired {r['merged_over_base_paired']:.3f})",
                    flush=True,
                )
    if set(DEPTHS) <= set(out["models"]):
        out["qwen3_4b_36_layers"] = extrapolate(*(out["models"][name] for name in DEPTHS))
        for mode, r in out["qwen3_4b_36_layers"]["modes"].items():
            print(
                f"36 layers {mode}: {r['bytes'] / 2**30:.3f} GiB ({100 * r['bytes_over_full']:.2f}%), "
                f"~{r['seconds']:.2f} s ({r['s_over_full_paired']['median']:.2f}x paired, "
                f"{r['s_over_full_paired']['min']:.2f}-{r['s_over_full_paired']['max']:.2f})",
                flush=True,
            )
    out["wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
