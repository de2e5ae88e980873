"""bench/bench_server.py's smallest mode: one lora_merge server on the embedded model, one repetition."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_server_smallest_mode(tiny_model, tmp_path):
    out = tmp_path / "bench_server.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "bench_server.py"),
        "--models",
        "tiny",
        "--rollout-models",
        "--reps",
        "1",
        "--no-adapter",
        "--fork-engine",
        "--rank",
        "8",
        "--tiny-model",
        tiny_model,
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tiny = json.loads(out.read_text())["models"]["tiny"]
    lora_merge, full = tiny["modes"]["lora_merge"], tiny["modes"]["full"]
    assert lora_merge["bytes"] == tiny["factor_bytes_counted"]  # the factors, nothing else
    assert full["bytes"] == 4 * tiny["parameters"]  # every fp32 weight of the model, the tied embedding once
    assert lora_merge["bytes"] < 0.2 * full["bytes"]
    assert lora_merge["median_s"] > 0 and full["median_s"] > 0
    paired = lora_merge["s_over_full_paired"]  # each repetition's ratio, the two syncs back to back
    assert paired["per_repetition"] == [lora_merge["raw_s"][0] / full["raw_s"][0]] == [paired["median"]]
    assert len(tiny["load_average_1min_per_repetition"]) == 1
    # both modes make the server serve the same weights
    assert tiny["greedy_logprobs_compared"] >= 30
    assert tiny["full_vs_lora_merge_greedy_logprobs_max_abs_diff"] <= 1e-6
