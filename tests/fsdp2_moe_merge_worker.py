"""One rank of the 2-process FSDP2 merge test for MoE and mixed precision (`checks`, run by tests/distributed_checks.py
for tests/test_merge_moe.py).

For each case: build a LoRA model (same weights on every rank), shard it with fully_shard (each decoder layer,
then the root; with the case's MixedPrecisionPolicy), take an optimizer step, then check that
merged_lora_params equals peft's merge_and_unload() of an unsharded copy with the same parameters, as
save_pretrained writes it (names, dtypes, values: bit-exact in bf16), that the lora_merge backend's update
(`merge.lora_merge.lora_update`) equals the unsharded copy's, that the local shards are bitwise unchanged,
and that training still runs afterwards.
"""

import copy

import torch
from qwen3_lora import shard_and_train, tiny_lora
from qwen3_moe_lora import tiny_moe_lora
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers.core_model_loading import revert_weight_conversion

from merge import merged_lora_params
from merge.lora_merge import lora_update

BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {  # name: (model builder, FSDP2 mixed precision policy or None)
    "moe fp32": (lambda: tiny_moe_lora(targets="both"), None),
    "moe bf16 base + fp32 adapters, bf16 all-gather": (lambda: tiny_moe_lora(dtype=torch.bfloat16), BF16_COMPUTE),
    "moe bf16 everything": (lambda: tiny_moe_lora(dtype=torch.bfloat16, autocast_adapter_dtype=False), None),
    "dense bf16 base + fp32 adapters, bf16 all-gather": (lambda: tiny_lora(dtype=torch.bfloat16), BF16_COMPUTE),
}


def saved_merge(model) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload() of ``model`` in checkpoint form (tied lm_head dropped), as save_pretrained converts it.

    save_pretrained itself writes on rank 0 only; tests/test_merge_moe.py checks the unsharded merge against its files.
    """
    merged = model.merge_and_unload()
    state = revert_weight_conversion(merged, merged.state_dict())
    if merged.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def check_case(name: str, build, mp_policy, rank: int) -> None:
    model = build()
    reference = copy.deepcopy(model)  # same initial weights on every rank
    ids = shard_and_train(model, rank, mp_policy)

    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    local_before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            param.copy_(full[param_name])
    rounded = copy.deepcopy(reference)  # what the merge would give from factors all-gathered in bf16
    sent, sent_unsharded = lora_update(model), lora_update(reference)  # the lora_merge backend's factors
    assert sent.entries == sent_unsharded.entries and sent.nbytes == sent_unsharded.nbytes, name
    assert all(torch.equal(a, b) for a, b in zip(sent.tensors, sent_unsharded.tensors)), name
    expected = saved_merge(reference)

    got = dict(merged_lora_params(model))
    assert set(got) == set(expected), f"{name}: names differ: {sorted(set(got) ^ set(expected))[:6]}"
    for key, tensor in got.items():
        assert tensor.dtype == expected[key].dtype, f"{name}: {key} is {tensor.dtype}, not {expected[key].dtype}"
        if tensor.dtype == torch.float32:
            error = (tensor - expected[key]).abs().max().item()
            assert error <= 1e-6, f"{name}: {key} differs from merge_and_unload by {error}"
        else:
            assert torch.equal(tensor, expected[key]), f"{name}: {key} is not bit-exact with merge_and_unload"
    cast = dict(merged_lora_params(model, dtype=torch.bfloat16))
    assert all(torch.equal(cast[k], t.to(torch.bfloat16)) for k, t in got.items()), f"{name}: dtype= cast differs"

    lora_b = next(n for n in full if "lora_B" in n)
    assert full[lora_b].abs().sum() > 0, "the optimizer step should have made lora_B non-zero"
    if mp_policy is not None:  # the test can fail: bf16-rounded factors give other bits
        with torch.no_grad():
            for param_name, param in rounded.named_parameters():
                if "lora_" in param_name:
                    param.copy_(param.to(mp_policy.param_dtype))
        from_rounded = saved_merge(rounded)
        assert any(not torch.equal(got[k], from_rounded[k]) for k in got), f"{name}: rounding made no difference"
    changed = [n for n, p in model.named_parameters() if not torch.equal(local_before[n], p.to_local())]
    assert not changed, f"{name}: merged_lora_params modified trainer parameters: {changed[:3]}"
    model(input_ids=ids, labels=ids).loss.backward()  # training still works (every group resharded properly)
    print(f"rank {rank}: {name}: {len(got)} tensors OK", flush=True)


def checks(rank: int) -> None:
    for name in CASES:
        check_case(name, *CASES[name], rank)
