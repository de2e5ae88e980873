#!/usr/bin/env bash
# Regenerates every file in results/ (after `bash setup.sh`), one job after another on a quiet machine:
# the timings are only comparable when nothing else shares the cores. ~25 min on the 2-core CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
launch=(.venv/bin/accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml recipes/grpo_qwen3_4b.py
        --config recipes/configs/tiny_cpu.yaml)
# A new run refuses to overwrite checkpoints; checkpoints are not committed, so clear them first.
rm -rf results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy
"${launch[@]}"                                                   # README's main command
"${launch[@]}" lora.merge=false run_name=tiny-cpu-lora
"${launch[@]}" padding.legacy_slice=true max_steps=40 run_name=tiny-cpu-legacy
.venv/bin/python recipes/plot_metrics.py results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy \
    --out results/grpo_metrics.png
.venv/bin/python recipes/bench_rollout.py --out results/bench_rollout.json
.venv/bin/python recipes/bench_sync.py --out results/bench_sync.json
.venv/bin/python recipes/plot_bench.py results/bench_rollout.json results/bench_sync.json --out results/bench.png
