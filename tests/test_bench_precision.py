"""bench/bench_precision.py on the tiny model: the merged cast drops a sub-ulp update in bf16 and keeps one of a few
ulps; served modes reproduce a few-ulp update in fp16; the plot renders from the JSON."""

import argparse

import matplotlib.image
import pytest
from bench_precision import bench_model
from plot_precision import plot


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bench-precision")
    args = argparse.Namespace(
        dtypes=["bfloat16", "float16"],
        update_ulps=[0.05, 3.0],
        rank=32,
        sequences=4,
        tokens=48,
        kv_cache_gb=0.05,
        cache=str(cache),
    )
    return bench_model("tiny", args)


def point(run, dtype, ulps):
    return next(r for r in run["results"] if r["dtype"] == dtype and r["update_ulps"] == ulps)


def test_the_bf16_cast_drops_a_sub_ulp_update_and_keeps_a_larger_one(tiny_run):
    small, large = point(tiny_run, "bfloat16", 0.05), point(tiny_run, "bfloat16", 3.0)
    assert small["sync_delta_zeroed"] > 0.8 and small["sync_delta_kept"] < 0.3  # most entries round back to W
    # with exact (fp32) arithmetic on the pushed weights, the log-probs lose what the weights lost
    assert small["merged_weights_fp32_compute"]["update_share"] < 0.5
    assert large["sync_delta_kept"] > 0.95
    assert large["merged_weights_fp32_compute"]["update_share"] == pytest.approx(1.0, abs=0.1)
    fp16 = point(tiny_run, "float16", 3.0)
    for mode in ("vllm_merged", "vllm_adapter", "trainer"):
        assert fp16[mode]["update_share"] == pytest.approx(1.0, abs=0.1), (mode, fp16[mode])
        assert fp16[mode]["mean_abs_err"] < point(tiny_run, "bfloat16", 3.0)[mode]["mean_abs_err"]  # fp16 is closer
    assert fp16["vllm_merged"]["vllm_minus_trainer"] < large["vllm_merged"]["vllm_minus_trainer"]


def test_the_plot_renders_from_the_json(tiny_run, tmp_path):
    out = plot(dict(runs=[tiny_run]), tmp_path / "precision.png")
    assert matplotlib.image.imread(out).shape[1] > 1000
