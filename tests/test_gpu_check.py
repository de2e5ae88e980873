"""bench/gpu_check.py, the GPU kit, in its CPU smoke mode: every section runs, on a machine without vLLM."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the kit runs without vLLM: an import of it anywhere on the kit's path fails here, as on a GPU machine without vLLM
WITHOUT_VLLM = (
    "import runpy, sys; sys.modules['vllm'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_the_gpu_kit_runs_every_section_without_vllm(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert not report["vllm_imported"] and report["environment"]["device"] == "cpu"
    update, sync, attention, fp16 = report["update"], report["sync"], report["attention"], report["fp16"]
    assert len(update["steps"]) == 2 and all(s["finite"] and s["grad_norm"] > 0 for s in update["steps"])
    assert update["plan_update_gib"] > 0 and "peak_allocated_gib" not in update  # a GPU measures it
    assert sync["merged_gib"] == sync["plain_gib"] > 0 and sync["merged_lora_params_s"] > 0
    assert sync["row_products_equal"] == {"2": True, "4": True, "8": True, "16 rows": True}
    assert attention["per_sample"]["max_abs_delta_logps"] == 0 and attention["samples"] == 4
    assert "varlen" not in attention  # CUDA only
    sdpa = attention["sdpa_mask"]  # transformers' T x T mask: the same attention, up to bf16 rounding
    assert 0 < sdpa["max_abs_delta_logps"] < 5e-2 and sdpa["max_abs_delta_lora_grad"] < 0.1 * sdpa["max_abs_lora_grad"]
    assert len(fp16["steps"]) == 4 and fp16["all_losses_finite"] and fp16["steps"][0]["loss_scale"] == 2.0**16
    for line in (
        "update: peak allocated / plan",
        "sync: merged_lora_params / plain walk",
        "sync: rows of B @ A as in the whole, at 2/4/8 ranks/16 rows  True/True/True/True",
        "attention varlen",
        "fp16: losses finite, skipped, last scale",
    ):
        assert line in proc.stdout


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """A first GPU run must not lose every figure to one section's error: the error goes into the JSON, the other
    sections run, and the kit exits non-zero naming the failed section."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(kit, "check_sync", broken)
    for name in ("check_attention", "check_fp16"):  # the sections' own work runs in the test above
        monkeypatch.setattr(kit, name, lambda *args, name=name: {"figure": name})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "gpu_check.json"
    with pytest.raises(SystemExit, match="the section\\(s\\) sync failed"):
        kit.main(["--smoke", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["sync"] == {"error": "RuntimeError: CUDA out of memory (injected)"}
    assert len(report["update"]["steps"]) == 2  # the section before the failing one, measured
    assert report["attention"] == {"figure": "check_attention"} and report["fp16"] == {"figure": "check_fp16"}
