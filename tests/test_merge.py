"""merged_lora_params against peft's merge_and_unload() on an unsharded copy (plain and 2-process FSDP2)."""

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from merge import UnsupportedAdapterError, merged_lora_params, normalize_peft_param_name
from qwen3_lora import tiny_lora, tiny_qwen3
from torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]


def reference_state(model) -> dict[str, torch.Tensor]:
    """peft's own merge, on a copy; a tied lm_head appears once (under the embedding's name), as we yield it."""
    state = copy.deepcopy(model).merge_and_unload().state_dict()
    if model.get_base_model().config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_merge_and_unload(dtype):
    model = tiny_lora(dtype=dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = reference_state(model)
    got = dict(merged_lora_params(model))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype, name
        if dtype == torch.float32:
            assert (tensor - expected[name]).abs().max().item() <= 1e-6, name
        else:
            assert torch.equal(tensor, expected[name]), name  # bf16: bit-exact, computed as peft computes it
    # merging changed the targeted weights, and only the copy: the trainer's parameters are bitwise unchanged
    base = model.get_base_model()
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base.model.layers[0].self_attn.q_proj.base_layer.weight)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_order_is_layer_by_layer_then_root():
    names = [n for n, _ in merged_lora_params(tiny_lora(layers=3))]
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of) and set(layer_of) == {0, 1, 2}
    first_root = next(i for i, n in enumerate(names) if not n.startswith("model.layers."))
    assert all(not n.startswith("model.layers.") for n in names[first_root:])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: once


def test_dtype_cast():
    got = dict(merged_lora_params(tiny_lora(), dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in got.values())


def test_modules_to_save_and_bias_free_targets():
    model = tiny_lora(targets=["q_proj", "down_proj"], modules_to_save=["model.norm"])
    with torch.no_grad():
        model.get_base_model().model.norm.modules_to_save["default"].weight.add_(0.5)
    expected = reference_state(model)
    got = dict(merged_lora_params(model))
    assert set(got) == set(expected)
    assert torch.equal(got["model.norm.weight"], expected["model.norm.weight"])
    assert (got["model.norm.weight"] - 1.5).abs().max() == 0  # the trained copy, not original_module


def test_lora_on_embeddings():
    with pytest.raises(UnsupportedAdapterError, match="tied to lm_head"):
        list(merged_lora_params(tiny_lora(targets=["embed_tokens", "q_proj"], tie=True)))
    model = tiny_lora(targets=["embed_tokens", "q_proj"], tie=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_embedding_" in name:  # peft starts embedding LoRA with A = 0
                param.normal_(std=0.1)
    expected = reference_state(model)
    got = dict(merged_lora_params(model))
    assert set(got) == set(expected) and "lm_head.weight" in got
    assert (got["model.embed_tokens.weight"] - expected["model.embed_tokens.weight"]).abs().max() <= 1e-6
    assert not torch.equal(got["model.embed_tokens.weight"],
                           model.get_base_model().model.embed_tokens.base_layer.weight)


@pytest.mark.parametrize("name, expected", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", None),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", None),
    ("base_model.model.model.norm.modules_to_save.default.weight", "model.norm.weight"),
    ("base_model.model.model.norm.original_module.weight", None),
    ("base_model.model.lm_head.weight", "lm_head.weight"),
    ("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
])
def test_normalize_peft_param_name(name, expected):
    assert normalize_peft_param_name(name) == expected


def test_unsupported_adapters_raise_clearly():
    with pytest.raises(UnsupportedAdapterError, match="PeftModel"):
        list(merged_lora_params(tiny_qwen3()))
    dora = get_peft_model(tiny_qwen3(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(UnsupportedAdapterError, match="use_dora"):
        list(merged_lora_params(dora))
    two = tiny_lora()
    two.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "second"])
    with pytest.raises(UnsupportedAdapterError, match="exactly one active adapter"):
        list(merged_lora_params(two))


def test_fsdp2_two_processes():
    """torchrun, 2 processes on gloo: see tests/fsdp2_merge_worker.py for what each rank asserts."""
    torchrun("fsdp2_merge_worker.py", ok_marker="FSDP2 MERGE OK", MALLOC_MMAP_THRESHOLD_="65536")
