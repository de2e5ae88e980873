"""One rank of the 2-process FSDP2 merge-precision telemetry test (`checks`, run by tests/distributed_checks.py for
tests/test_merge.py).

For each case: build a LoRA model (same weights on every rank), shard it with fully_shard (each decoder layer, then
the root; with the case's MixedPrecisionPolicy), take an optimizer step, then merge to bf16 with a
MergePrecisionStats and check that its sums equal those of the same merge of an unsharded copy with the same
parameters, and are the same on both ranks (each rank measures the rows it merges; the walk sums the ranks', also for a
consumer that stops after the last tensor). Each case's decoder layers are row-merged (`merge.row_merge`) or not, as
the case expects, and its bf16 tensors are checked bit for bit against the walk that unshard()s every layer whole,
including rows the two ranks do not divide evenly (hidden size 65).
"""

import copy
import itertools

import torch
import torch.distributed as dist
from bench_common import with_random_lora
from qwen3_lora import shard_and_train, tiny_lora, tiny_qwen3
from qwen3_moe_lora import tiny_moe_lora
from torch.distributed.fsdp import MixedPrecisionPolicy

import merge.merged_params
from merge import MergePrecisionStats, decoder_layers, merged_lora_params
from merge.row_merge import layer_rows


def embedding_lora_in_each_layer():
    """A LoRA on an Embedding inside each decoder layer (unused by the forward; only the merge reads it)."""
    model = tiny_qwen3(tie=False)  # a LoRA on an embedding tied to lm_head is refused
    for layer in model.model.layers:
        layer.extra = torch.nn.Embedding(10, 64)
    lora = with_random_lora(model, rank=8, targets=["q_proj", "extra"], lora_b_std=0.1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_embedding" in name:
                param.normal_()
    return lora


BF16_ALL_GATHER = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {  # name: (model builder, FSDP2 mixed precision policy or None, whether its layers are row-merged)
    "dense fp32": (lambda: tiny_lora(), None, True),
    "dense fp32, bf16 all-gather, uneven rows": (lambda: tiny_lora(hidden=65), BF16_ALL_GATHER, True),
    "dense, 12 rows a rank (fewer than MIN_ROWS)": (lambda: tiny_lora(hidden=24), None, False),
    "dense, an Embedding LoRA in each layer": (embedding_lora_in_each_layer, None, False),
    "moe bf16 base + fp32 adapters, bf16 all-gather": (
        lambda: tiny_moe_lora(dtype=torch.bfloat16),
        BF16_ALL_GATHER,
        False,
    ),
}


def merged_bf16(
    model, whole_layers: bool = False, stop_after: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The walk's tensors cast to bf16 and its precision figures; ``whole_layers``: every layer unshard()-ed whole;
    ``stop_after``: the consumer stops after that many tensors (the generator is closed, not exhausted)."""
    stats = MergePrecisionStats()
    layer_rows_of_the_walk = merge.merged_params.layer_rows
    if whole_layers:
        merge.merged_params.layer_rows = lambda layer, adapter: None
    try:
        walk = merged_lora_params(model, dtype=torch.bfloat16, precision_stats=stats)
        tensors = dict(itertools.islice(walk, stop_after))
        walk.close()
    finally:
        merge.merged_params.layer_rows = layer_rows_of_the_walk
    return tensors, stats.totals()


def assert_same_figures(name: str, got: dict, expected: dict) -> None:
    """Counts exactly; the sums up to their order (each rank sums its rows of the row-merged layers, then ranks')."""
    counts = ("nonzero", "zeroed", "entries", "tensors")
    assert all(got[k] == expected[k] for k in counts), f"{name}: {got} != {expected}"
    close = all(abs(got[k] - expected[k]) <= 1e-6 * abs(expected[k]) for k in ("dot", "delta_sq", "err_sq"))
    assert close, f"{name}: {got} != {expected}"


def check_case(name: str, build, mp_policy, expect_rows: bool, rank: int) -> None:
    model = build()
    reference = copy.deepcopy(model)  # same initial weights on every rank
    shard_and_train(model, rank, mp_policy)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            param.copy_(full[param_name])
            if mp_policy is not None and "lora_" not in param_name:  # the merge reads W as the all-gather casts it
                param.data = param.data.to(mp_policy.param_dtype)

    row_merged = [layer_rows(layer, "default") is not None for layer in decoder_layers(model)]
    assert row_merged == [expect_rows] * len(row_merged), f"{name}: row-merged {row_merged}"
    (rows, sharded), (whole, whole_figures) = merged_bf16(model), merged_bf16(model, whole_layers=True)
    stopped = merged_bf16(model, stop_after=len(rows))[1]
    assert_same_figures(f"{name}, a consumer that stops after the last tensor", stopped, sharded)
    assert list(rows) == list(whole), f"{name}: names differ"
    differing = [n for n in rows if not torch.equal(rows[n], whole[n])]
    assert not differing, f"{name}: the row merge differs from the unshard()-ed merge in {differing}"
    unsharded = merged_bf16(reference)[1]
    assert unsharded["delta_sq"] > 0 and unsharded["entries"] > 0, f"{name}: nothing measured: {unsharded}"
    assert_same_figures(f"{name}, FSDP2 against unsharded", sharded, unsharded)
    assert_same_figures(f"{name}, row-merged against whole layers", sharded, whole_figures)
    on_ranks = [None, None]
    dist.all_gather_object(on_ranks, sharded)
    assert on_ranks[0] == on_ranks[1], f"{name}: ranks differ: {on_ranks}"
    print(
        f"rank {rank}: {name}: {sharded['tensors']} merged tensors, {sharded['entries']} entries, "
        f"the figures of the unsharded model",
        flush=True,
    )


def checks(rank: int) -> None:
    for name, (build, mp_policy, expect_rows) in CASES.items():
        check_case(name, build, mp_policy, expect_rows, rank)
