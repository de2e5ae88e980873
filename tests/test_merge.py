"""merged_lora_params against peft's merge_and_unload() on an unsharded copy (plain and 2-process FSDP2), and its
merge-precision telemetry (MergePrecisionStats)."""

import copy
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from qwen3_lora import tiny_lora, tiny_qwen3
from qwen3_moe_lora import tiny_moe_lora
from torchrun import passed

from merge import MergePrecisionStats, UnsupportedAdapterError, merged_lora_params, normalize_peft_param_name

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
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], base.model.layers[0].self_attn.q_proj.base_layer.weight
    )
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "dtype, lora",
    [
        (torch.float32, dict(lora_alpha=12)),  # scaling 1.5: scaled, then added
        (torch.float32, dict(lora_alpha=8, use_rslora=True)),  # 8 / sqrt(8)
        (torch.bfloat16, dict(lora_alpha=12, autocast_adapter_dtype=False)),  # bf16 factors: peft's own delta
        (torch.float32, dict(lora_alpha=4)),  # scaling 0.5: one fused pass
    ],
)
def test_bit_for_bit_merge_and_unload_at_any_scaling(dtype, lora):
    """The in-place merge of a Linear (`_linear_product`, `_add_scaled`) rounds as peft's merge does, whatever the
    scaling; the control: the fused pass at a scaling that is not a power of two does not."""
    model = tiny_lora(dtype=dtype, **lora)
    expected = reference_state(model)
    got = dict(merged_lora_params(model))
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())
    scaling = next(m.scaling["default"] for m in lora_layers(model))
    if math.frexp(scaling)[0] != 0.5 and dtype == torch.float32:
        layer = lora_layers(model)[0]
        a, b, w = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.get_base_layer().weight
        assert not torch.equal(torch.add(w, b @ a, alpha=scaling), w + (b @ a) * scaling)


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
    assert not torch.equal(
        got["model.embed_tokens.weight"], model.get_base_model().model.embed_tokens.base_layer.weight
    )


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", None),
        ("base_model.model.model.embed_tokens.lora_embedding_A.default", None),
        ("base_model.model.model.norm.modules_to_save.default.weight", "model.norm.weight"),
        ("base_model.model.model.norm.original_module.weight", None),
        ("base_model.model.lm_head.weight", "lm_head.weight"),
        ("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
    ],
)
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


def test_fsdp2_two_processes(two_process_checks):
    """2 processes on gloo: see tests/fsdp2_merge_worker.py for what each rank asserts."""
    passed(two_process_checks, "fsdp2_merge_worker:checks")


def merged_with_stats(
    model, dtype=torch.bfloat16, row_stride: int = 1
) -> tuple[dict[str, torch.Tensor], MergePrecisionStats]:
    stats = MergePrecisionStats(row_stride)
    return dict(merged_lora_params(model, dtype=dtype, precision_stats=stats)), stats


@pytest.mark.parametrize(
    "model_dtype, adapter_autocast, row_stride",
    [(torch.float32, True, 1), (torch.bfloat16, True, 1), (torch.bfloat16, False, 1), (torch.float32, True, 8)],
)  # bf16 factors: Δ recomputed in fp32; row_stride 8: the default sample, every 8th row
def test_precision_stats_leave_the_output_alone_and_match_a_direct_computation(
    model_dtype, adapter_autocast, row_stride
):
    model = tiny_lora(dtype=model_dtype, autocast_adapter_dtype=adapter_autocast)
    with_stats, stats = merged_with_stats(model, row_stride=row_stride)
    without = dict(merged_lora_params(model, dtype=torch.bfloat16))
    assert with_stats.keys() == without.keys() and all(torch.equal(with_stats[n], without[n]) for n in without)
    # the same figures, computed directly from every LoRA layer of the model, on every row_stride-th row
    dot = delta_sq = err_sq = nonzero = zeroed = entries = 0.0
    whole = dict(dot=0.0, delta_sq=0.0)
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weight = module.get_base_layer().weight
            a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            delta = b @ a * module.scaling["default"]  # Δ in fp32; the merge adds peft's (bf16 from bf16 factors)
            merged = (weight + module.get_delta_weight("default")).to(weight.dtype).to(torch.bfloat16)
            moved = merged.float() - weight.bfloat16().float()
            whole["dot"] += (moved * delta).double().sum().item()
            whole["delta_sq"] += (delta * delta).double().sum().item()
            moved, delta = moved[::row_stride], delta[::row_stride]
            dot += (moved * delta).double().sum().item()
            delta_sq += (delta * delta).double().sum().item()
            err_sq += ((moved - delta) ** 2).double().sum().item()
            nonzero += (delta != 0).sum().item()
            zeroed += ((delta != 0) & (moved == 0)).sum().item()
            entries += delta.numel()
    got = stats.metrics()
    assert stats.entries == entries and stats.totals()["nonzero"] == nonzero and stats.totals()["zeroed"] == zeroed
    assert got["sync_delta_kept"] == pytest.approx(dot / delta_sq, rel=1e-6)
    assert got["sync_delta_rel_err"] == pytest.approx(math.sqrt(err_sq / delta_sq), rel=1e-5)
    assert got["sync_delta_zeroed"] == zeroed / nonzero
    assert 0.99 < got["sync_delta_kept"] < 1 and 0 < got["sync_delta_rel_err"] < 0.01
    if row_stride > 1:  # the sample: an eighth of the entries, its figure close to the whole's
        assert stats.entries * 8 == sum(m.get_base_layer().weight.numel() for m in lora_layers(model))
        assert got["sync_delta_kept"] == pytest.approx(whole["dot"] / whole["delta_sq"], abs=1e-3)


def lora_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]


def test_precision_stats_sample_the_rows_of_each_piece_by_their_place_in_the_whole():
    """A tensor merged in pieces (the server merges in chunks of rows) samples the rows the whole tensor would."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 16, generator=generator).bfloat16()
    delta = torch.randn(37, 16, generator=generator) * 1e-2
    merged = (weight.float() + delta).bfloat16()
    whole, pieces = MergePrecisionStats(8), MergePrecisionStats(8)
    whole.add(weight, delta, merged)
    for start in range(0, 37, 10):
        pieces.add(weight[start : start + 10], delta[start : start + 10], merged[start : start + 10], first_row=start)
    assert whole.entries == pieces.entries == 5 * 16  # rows 0, 8, 16, 24, 32
    assert pieces.totals() == pytest.approx(whole.totals() | {"tensors": 4}, rel=1e-6)
    with pytest.raises(ValueError, match="row_stride=0"):
        MergePrecisionStats(0)
    for tensor in (weight[:5], weight[:, 0], weight):  # one sampled row; a 1-D tensor; every 8th row
        sampled = MergePrecisionStats(8).sampled_rows(tensor)
        assert sampled.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()  # never a view


def grid_case(model_dtype, delta: float, adapter_autocast: bool = True):
    """q_proj of every layer: W on bf16 grid points in ±[1 + 2^-7, 2 - 2^-7] (one ulp: 2^-7), and a rank-1 LoRA with
    scaling · B @ A = ``delta`` in every entry, exactly."""
    model = tiny_lora(dtype=model_dtype, targets=["q_proj"], autocast_adapter_dtype=adapter_autocast)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                weight = module.get_base_layer().weight
                steps = torch.randint(1, 127, weight.shape, generator=generator)
                signs = torch.randint(0, 2, weight.shape, generator=generator) * 2 - 1
                weight.copy_(signs * (1 + steps * 2.0**-7))
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.zero_(), b.zero_()
                a[0] = 1.0
                b[:, 0] = delta / module.scaling["default"]  # scaling: a power of two (alpha = 2 * rank)
    return model


@pytest.mark.parametrize(
    "model_dtype, adapter_autocast", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_precision_stats_constructed_cases(model_dtype, adapter_autocast):
    # |Δ| = 1/4 ulp of W everywhere: every entry rounds back to W, nothing of the update survives
    _, quarter = merged_with_stats(grid_case(model_dtype, 2.0**-9, adapter_autocast))
    assert quarter.metrics() == {"sync_delta_kept": 0.0, "sync_delta_rel_err": 1.0, "sync_delta_zeroed": 1.0}
    # |Δ| = one ulp of W everywhere: every entry moves by exactly Δ
    _, one_ulp = merged_with_stats(grid_case(model_dtype, 2.0**-7, adapter_autocast))
    assert one_ulp.metrics() == {"sync_delta_kept": 1.0, "sync_delta_rel_err": 0.0, "sync_delta_zeroed": 0.0}
    assert one_ulp.tensors == 2 and one_ulp.entries == 2 * 64 * 64  # q_proj of both layers, nothing else


def test_precision_stats_undefined_without_an_update_and_accumulate_until_reset():
    model = tiny_lora(targets=["q_proj"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.zero_()  # peft's initial state: Δ = 0
    _, stats = merged_with_stats(model)
    assert all(math.isnan(v) for v in stats.metrics().values()) and stats.entries == 2 * 64 * 64
    _, once = merged_with_stats(tiny_lora())
    twice = MergePrecisionStats(1)
    for _ in range(2):
        dict(merged_lora_params(tiny_lora(), dtype=torch.bfloat16, precision_stats=twice))
    assert twice.entries == 2 * once.entries and twice.metrics() == pytest.approx(once.metrics())
    twice.reset()
    assert twice.entries == 0 and math.isnan(twice.metrics()["sync_delta_kept"])


def test_precision_stats_in_chunks_equal_one_piece(monkeypatch):
    """On CPU the sums run in chunks of CPU_CHUNK elements: chunks that split every tensor unevenly give the counts
    exactly and the sums to float rounding."""
    _, whole = merged_with_stats(tiny_lora())
    monkeypatch.setattr(MergePrecisionStats, "CPU_CHUNK", 1000)  # 64 x 64 weights: 5 chunks, the last 96 elements
    _, chunked = merged_with_stats(tiny_lora())
    got, want = chunked.totals(), whole.totals()
    assert want["nonzero"] > 0 and 0 < want["zeroed"] < want["nonzero"]  # a case with something to count
    assert {k: got[k] for k in ("nonzero", "zeroed", "entries", "tensors")} == {
        k: want[k] for k in ("nonzero", "zeroed", "entries", "tensors")
    }
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("model_dtype, adapter_autocast", [(torch.float32, True), (torch.bfloat16, False)])
def test_precision_stats_cover_moe_experts(model_dtype, adapter_autocast):
    """LoRA on parameters (fused experts): the merged expert tensors are measured too, outputs unchanged."""
    model = tiny_moe_lora(dtype=model_dtype, targets="experts", autocast_adapter_dtype=adapter_autocast)
    with_stats, stats = merged_with_stats(model)
    without = dict(merged_lora_params(model, dtype=torch.bfloat16))
    assert all(torch.equal(with_stats[n], without[n]) for n in without)
    experts = [m.mlp.experts for m in model.get_base_model().model.layers]
    fused = sum(m.get_base_layer().gate_up_proj.numel() + m.get_base_layer().down_proj.numel() for m in experts)
    assert stats.entries == fused and stats.tensors == 4
    got = stats.metrics()
    assert 0.99 < got["sync_delta_kept"] < 1 and 0 < got["sync_delta_rel_err"] < 0.01


def test_precision_stats_fsdp2_two_processes(two_process_checks):
    """2 processes on gloo: see tests/fsdp2_precision_worker.py for what each rank asserts."""
    passed(two_process_checks, "fsdp2_precision_worker:checks")
