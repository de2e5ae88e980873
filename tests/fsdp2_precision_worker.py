"""One rank of the 2-process FSDP2 merge-precision telemetry test (run by tests/test_merge.py through torchrun).

For each case: build a LoRA model (same weights on every rank), shard it with fully_shard (each decoder layer, then
the root; with the case's MixedPrecisionPolicy), take an optimizer step, then merge to bf16 with a
MergePrecisionStats and check that its sums equal those of the same merge of an unsharded copy with the same
parameters, and are the same on both ranks (every rank merges the full, unsharded layer: no reduction needed).
"""

import copy

import torch
import torch.distributed as dist
from qwen3_lora import shard_and_train, tiny_lora
from qwen3_moe_lora import tiny_moe_lora
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchrun import finish_worker

from merge import MergePrecisionStats, merged_lora_params

CASES = {  # name: (model builder, FSDP2 mixed precision policy or None)
    "dense fp32": (lambda: tiny_lora(), None),
    "moe bf16 base + fp32 adapters, bf16 all-gather": (
        lambda: tiny_moe_lora(dtype=torch.bfloat16),
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    ),
}


def totals(model) -> dict[str, float]:
    stats = MergePrecisionStats()
    for _ in merged_lora_params(model, dtype=torch.bfloat16, precision_stats=stats):
        pass
    return stats.totals()


def check_case(name: str, build, mp_policy, rank: int) -> None:
    model = build()
    reference = copy.deepcopy(model)  # same initial weights on every rank
    shard_and_train(model, rank, mp_policy)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            param.copy_(full[param_name])

    sharded, unsharded = totals(model), totals(reference)
    assert unsharded["delta_sq"] > 0 and unsharded["entries"] > 0, f"{name}: nothing measured: {unsharded}"
    assert sharded == unsharded, f"{name}: FSDP2 {sharded} != unsharded {unsharded}"
    on_ranks = [None, None]
    dist.all_gather_object(on_ranks, sharded)
    assert on_ranks[0] == on_ranks[1], f"{name}: ranks differ: {on_ranks}"
    print(
        f"rank {rank}: {name}: {sharded['tensors']} merged tensors, {sharded['entries']} entries, "
        f"same figures as unsharded",
        flush=True,
    )


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for name, (build, mp_policy) in CASES.items():
        check_case(name, build, mp_policy, rank)
    print(f"rank {rank}: FSDP2 PRECISION OK")
    finish_worker()


if __name__ == "__main__":
    main()
