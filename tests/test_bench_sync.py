"""The drift measurement of bench/bench_sync.py (bench_common.merge_unmerge_drift): peft's in-place merge/unmerge
drifts in bf16, ours does not."""

import torch
from bench_common import merge_unmerge_drift
from qwen3_lora import tiny_lora


def test_peft_merge_unmerge_drifts_in_bf16_and_merged_lora_params_does_not():
    model = tiny_lora(dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in (0.0, 1e-2):  # a fixed adapter, and lora_B changed before every cycle (as training does)
        drift = merge_unmerge_drift(model, cycles=(1, 5), lora_b_step=step)
        for cycles in ("1", "5"):
            peft, ours = drift["peft_merge_unmerge"][cycles], drift["merged_lora_params"][cycles]
            assert peft["changed"] > 0 and peft["max_abs"] > 0 and peft["mean_abs"] > 0, (step, cycles, peft)
            assert ours == dict(max_abs=0.0, mean_abs=0.0, changed=0, elements=peft["elements"]), (step, cycles, ours)
        assert drift["dtype"] == "bfloat16"
    # the measurement restores the trainer's weights and the adapter
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
