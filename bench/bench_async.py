"""Asynchronous rollouts' throughput, side by side in one run: the same config synchronous (max_staleness=0) and with
max_staleness 1 and 2, the trainer and the server each pinned to a core of their own.

    python bench/bench_async.py --out results/bench_async.json --timelines results/bench_async_timelines

One ``vllm serve`` (the lora_merge backend, `grpo.engines.server.serve_command`'s flags) runs under ``taskset`` on
``--server-core``, its CPU kernels bound there too (``VLLM_CPU_OMP_THREADS_BIND``); the recipe runs as one process
(no launcher) under ``taskset`` on ``--trainer-core`` with one thread, so each side has one core and what the async
modes gain is the overlap of the two, not more cores. ``--max-num-seqs`` sizes the server's batch: it sets how long
a rollout takes next to an update (the default makes them comparable on the embedded model, where the gain is
largest).

Each repetition runs the three modes in turn (order rotated every repetition); each run is ``--rollout-steps``
rollout steps of recipes/configs/tiny_cpu.yaml in server mode (no evaluation), and is measured from its own
timeline.jsonl after ``--warmup`` steps (steady state) and over the whole run: rollout steps per minute, the tokens
and completions generated (each arm's work), each side's busy fraction (`grpo.metrics.busy_fractions`); the last
repetition's timeline.jsonl, metrics.jsonl and config.yaml of each mode are kept with ``--timelines``. The speedups
are each repetition's async/sync ratio (the runs followed each other), their median and spread. From the synchronous
runs' phase times (sync S, rollout G, update U, medians): a synchronous step takes S + G + U, an overlapped one at
best max(G, S + U), so the bound is (S + G + U) / max(G, S + U); the JSON gives it beside the measured figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import free_port, machine_info, wait_until_up

from grpo.metrics import busy_fractions

ROOT = Path(__file__).resolve().parents[1]
MODES = (0, 1, 2)  # max_staleness


def start_server(model: str, core: int, max_num_seqs: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = ["taskset", "-c", str(core), sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    command += ["--max-model-len", "160", "--kv-cache-memory-bytes", str(256 * 2**20), "--max-num-seqs"]
    command += [str(max_num_seqs), "--max-num-batched-tokens", "16384", "--enable-scale-out", "--logprobs-mode"]
    command += ["processed_logprobs", "--no-enable-prefix-caching"]
    command += ["--weight-transfer-config", '{"backend": "lora_merge"}']
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url, log_path)
    return proc, url


def train(url: str, core: int, staleness: int, out: Path, overrides: list[str]) -> Path:
    """One run of the recipe pinned to ``core``; returns its run folder."""
    run_name = f"staleness{staleness}"
    command = ["taskset", "-c", str(core), sys.executable, str(ROOT / "recipes" / "grpo_qwen3_4b.py")]
    command += ["--config", str(ROOT / "recipes" / "configs" / "tiny_cpu.yaml"), "vllm.mode=server"]
    command += [f"vllm.server_url={url}", f"max_staleness={staleness}", "eval_steps=null", f"output_dir={out}"]
    command += [f"run_name={run_name}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"max_staleness={staleness} failed:\n{done.stderr[-4000:]}")
    return out / run_name


def measure(run_dir: Path, warmup: int, completions_per_step: int) -> dict:
    """One run's figures: in steady state (after ``warmup`` rollout steps) and over the whole run, the rollout steps
    per minute and the tokens and completions the server generated (each arm's work, to compare), each side's busy
    fraction, the phase medians, and with max_staleness >= 1 the staleness and the fidelity check's worst step."""
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    every = [m for m in metrics if "reward_mean" in m]
    steps = [m for m in every if m["rollout_step"] > warmup]
    phases = {k: statistics.median(m[k] for m in steps) for k in ("sync_s", "rollout_s", "update_s", "step_s")}
    steady, whole = busy_fractions(timeline[warmup:], timeline), busy_fractions(timeline)
    tokens = sum(m["rollout_tokens"] for m in steps)
    result = {
        **steady,
        **{f"median_{k}": v for k, v in phases.items()},
        "rollout_tokens": tokens,
        "completions": completions_per_step * len(steps),
        "rollout_tokens_per_s": tokens / steady["seconds"],
        "whole_run": dict(
            rollout_steps=len(every),
            seconds=whole["seconds"],
            rollout_steps_per_min=whole["rollout_steps_per_min"],
            rollout_tokens=sum(m["rollout_tokens"] for m in every),
            completions=completions_per_step * len(every),
        ),
    }
    if "staleness_mean" in steps[0]:
        result.update(
            staleness_mean=statistics.mean(m["staleness_mean"] for m in steps),
            staleness_max=max(m["staleness_max"] for m in steps),
            updated_in_flight=sum(m["updated_in_flight"] for m in steps),
            rollout_logprob_diff_mean_max=max(m["rollout_logprob_diff_mean"] for m in steps),
        )
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_async.json"))
    parser.add_argument("--model", default=str(ROOT / "cache" / "tiny-qwen3-gsm8k"))
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--rollout-steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="rollout steps left out of each run's figures")
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--trainer-core", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the server's batch (sets a rollout's length)")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size")
    parser.add_argument("--steps-per-generation", type=int, default=4, help="mini-batches per rollout step")
    parser.add_argument(
        "--timelines",
        type=Path,
        help="keep the last repetition's timeline.jsonl and config.yaml of each mode here (recipes/plot_timeline.py)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="recipe overrides for every run, e.g. per_device_train_batch_size=8"
    )
    return parser.parse_args()


def run_repetitions(args: argparse.Namespace, overrides: list[str]) -> tuple[dict[int, list[dict]], list[float]]:
    """Every repetition's run of each mode against one server: (each mode's measurements, the 1-minute load average
    after each repetition)."""
    runs: dict[int, list[dict]] = {mode: [] for mode in MODES}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        server, url = start_server(args.model, args.server_core, args.max_num_seqs, Path(tmp) / "server.log")
        try:
            for rep in range(args.repetitions):
                order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
                for staleness in order:
                    started = time.time()
                    run_dir = train(url, args.trainer_core, staleness, Path(tmp) / f"rep{rep}", overrides)
                    figures = measure(run_dir, args.warmup, args.batch_size * args.steps_per_generation)
                    runs[staleness].append({**figures, "wall_s": time.time() - started})
                    if args.timelines and rep == args.repetitions - 1:
                        keep_timeline(run_dir, args.timelines / run_dir.name)
                    print(f"repetition {rep + 1}, max_staleness={staleness}: {runs[staleness][-1]}", flush=True)
                load.append(os.getloadavg()[0])
        finally:
            server.terminate()
            server.wait(timeout=60)
    return runs, load


def keep_timeline(run_dir: Path, kept: Path) -> None:
    """A run's timeline.jsonl, metrics.jsonl, config.yaml and provenance.json, copied out of the temporary folder
    (for recipes/plot_timeline.py, and to check each arm's tokens)."""
    kept.mkdir(parents=True, exist_ok=True)
    for name in ("timeline.jsonl", "metrics.jsonl", "config.yaml", "provenance.json"):
        shutil.copy(run_dir / name, kept / name)


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values), each=values)


def summary(args: argparse.Namespace, overrides: list[str], runs: dict[int, list[dict]], load: list[float]) -> dict:
    """The JSON: settings, every run, each mode's rollout steps per minute, the speedups and their bound."""
    sync = runs[0]
    phases = {k: statistics.median(r[f"median_{k}"] for r in sync) for k in ("sync_s", "rollout_s", "update_s")}
    s, g, u = phases["sync_s"], phases["rollout_s"], phases["update_s"]

    def per_mode(figure) -> dict:
        return {f"max_staleness={m}": spread([figure(r) for r in runs[m]]) for m in MODES}

    def speedup(mode: int, figure) -> dict:  # each repetition's ratio to the synchronous run beside it
        return spread([figure(a) / figure(b) for a, b in zip(runs[mode], sync)])

    return dict(
        command="python bench/bench_async.py " + " ".join(sys.argv[1:]),
        machine=machine_info(),
        settings=dict(
            config="recipes/configs/tiny_cpu.yaml, vllm.mode=server, eval_steps=null",
            overrides=overrides,
            rollout_steps=args.rollout_steps,
            warmup_steps=args.warmup,
            repetitions=args.repetitions,
            server_max_num_seqs=args.max_num_seqs,
            trainer=f"one process, taskset -c {args.trainer_core}, OMP_NUM_THREADS=1",
            server=f"taskset -c {args.server_core}, VLLM_CPU_OMP_THREADS_BIND={args.server_core}",
        ),
        load_average_1min_per_repetition=load,
        runs={f"max_staleness={mode}": runs[mode] for mode in MODES},
        rollout_steps_per_min=per_mode(lambda r: r["rollout_steps_per_min"]),
        speedup_async1_over_sync=speedup(1, lambda r: r["rollout_steps_per_min"]),
        speedup_async2_over_sync=speedup(2, lambda r: r["rollout_steps_per_min"]),
        rollout_tokens_per_s=per_mode(lambda r: r["rollout_tokens_per_s"]),
        whole_run_rollout_steps_per_min=per_mode(lambda r: r["whole_run"]["rollout_steps_per_min"]),
        whole_run_speedup_async1_over_sync=speedup(1, lambda r: r["whole_run"]["rollout_steps_per_min"]),
        whole_run_speedup_async2_over_sync=speedup(2, lambda r: r["whole_run"]["rollout_steps_per_min"]),
        sync_phase_medians_s=phases,
        speedup_bound_from_sync_phases=(s + g + u) / max(g, s + u),
        note=(
            "A synchronous step is sync + rollout + update (S + G + U); overlapped, the server generates the next "
            "rollout while the trainer syncs and updates, so a step takes at best max(G, S + U): the bound. The "
            "busy fractions show where the measured figure falls short of it. On a 4 + 4 GPU split the same "
            "formula holds with that split's phase times: the gain is largest where G is close to S + U."
        ),
    )


def main() -> None:
    args = parse_args()
    if not Path(args.model).exists():
        raise SystemExit(f"--model {args.model} does not exist: README's main command builds the embedded model")

    # max_steps counts optimizer steps: rollout steps x steps_per_generation (x num_iterations, 1 here)
    shape = [f"per_device_train_batch_size={args.batch_size}", f"steps_per_generation={args.steps_per_generation}"]
    overrides = [*shape, f"max_steps={args.rollout_steps * args.steps_per_generation}", *args.overrides]
    runs, load = run_repetitions(args, overrides)
    result = summary(args, overrides, runs, load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in result if "speedup" in k or k == "sync_phase_medians_s"}, indent=2))


if __name__ == "__main__":
    main()
