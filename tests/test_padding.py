"""padding/: one rule from packed (padding-free) values to the left-prompt / right-response layout.

Layout (see padding/__init__.py): row i of a [B, P + R] batch is a prompt LEFT-padded inside the first P
columns, then a response RIGHT-padded inside the last R columns. values[k] of a packed forward scores the
token after packed position k, so response token j of sample i is read at packed index
start_i + prompt_len_i + j - 1.
"""

import inspect
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

import padding.packed_attention as packed_attention
from padding import (
    PackedBatch,
    legacy_slice_response,
    no_padding_2_padding,
    packed_log_probs,
    pad,
    selective_log_softmax,
    token_entropy,
    unpad,
)

VOCAB = 128


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def layout(prompt_lens, response_lens, width_p=None, width_r=None, seed=0, mask_dtype=torch.long):
    """[B, P+R] ids, attention_mask and [B, R] response_mask: prompts left-padded, responses right-padded."""
    width_p = max(prompt_lens) if width_p is None else width_p
    width_r = max(response_lens) if width_r is None else width_r
    assert width_p >= max(prompt_lens) and width_r >= max(response_lens)
    batch = len(prompt_lens)
    ids = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, width_p - p : width_p + r] = 1
    generator = torch.Generator().manual_seed(seed)
    ids[mask.bool()] = torch.randint(3, VOCAB, (int(mask.sum()),), generator=generator)
    return ids, mask.to(mask_dtype), mask[:, width_p:].clone().to(mask_dtype)


def expected_packed_index(prompt_lens, response_lens, width_r):
    """By the documented formula, as floats: start_i + prompt_len_i + j - 1 at real response tokens, else 0."""
    out = torch.zeros((len(prompt_lens), width_r))
    start = 0
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        for j in range(r):
            out[i, j] = start + p + j - 1
        start += p + r
    return out


def naive_no_padding_2_padding(values, attention_mask, response_mask):
    """Per-sample Python loop that does not use the formula: find the packed slot k of the response token in
    column P + j of row i, and read values[k - 1] (the output at the token before it)."""
    batch, total = attention_mask.shape
    width_r = response_mask.shape[1]
    width_p = total - width_r
    out = torch.zeros((batch, width_r, *values.shape[1:]), dtype=values.dtype)
    k = 0
    for i in range(batch):
        slot_of_column = {}
        for column in range(total):
            if attention_mask[i, column]:
                slot_of_column[column] = k
                k += 1
        for j in range(width_r):
            if response_mask[i, j]:
                slot = slot_of_column[width_p + j]
                assert slot - 1 >= 0 and (slot - 1) in slot_of_column.values()  # predicted from its own sample
                out[i, j] = values[slot - 1]
    assert k == values.shape[0]
    return out


def tiny_qwen3(attn="sdpa", seed=0, layers=2):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_implementation=attn,
        dtype=torch.float32,
    )
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == attn
    return model


def per_sequence_reference(model, ids, attention_mask, response_mask, temperature=1.0):
    """Each sample alone, unpadded: log_softmax(logits[:-1] / t) gathered at tokens[1:], response part."""
    width_r = response_mask.shape[1]
    width_p = ids.shape[1] - width_r
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i in range(ids.shape[0]):
        row = attention_mask[i].bool()
        tokens = ids[i][row]
        prompt_len = int(row[:width_p].sum())
        response_len = int(response_mask[i].sum())
        logits = model(input_ids=tokens[None]).logits[0].float() / temperature
        log_probs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[1:, None]).squeeze(-1)
        out[i, :response_len] = log_probs[prompt_len - 1 : prompt_len - 1 + response_len]
    return out


# ragged: left padding (prompts 1..7), right padding (responses 0..6), a 1-token prompt and an empty response
MODEL_PROMPTS, MODEL_RESPONSES = [5, 1, 7, 3, 2], [4, 6, 1, 0, 5]


# ----------------------------------------------------------------------------------------------------------
# 1. hand-built layouts
# ----------------------------------------------------------------------------------------------------------


def test_unpad_left_padding_only_by_hand():
    # P = 3, R = 2, every response full length
    ids = torch.tensor([[0, 11, 12, 13, 14], [21, 22, 23, 24, 25], [0, 0, 31, 32, 33]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    response_mask = mask[:, 3:].clone()
    packed = unpad(ids, mask)
    assert isinstance(packed, PackedBatch)
    assert packed.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, 24, 25, 31, 32, 33]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]
    assert packed.cu_seqlens.tolist() == [0, 4, 9, 12]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.indices.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14]
    values = torch.arange(12, dtype=torch.float32)
    # sample 0: start 0, prompt 2 -> 1, 2 ; sample 1: start 4, prompt 3 -> 6, 7 ; sample 2: start 9, prompt 1 -> 9, 10
    assert no_padding_2_padding(values, mask, response_mask).tolist() == [[1, 2], [6, 7], [9, 10]]
    # the token each slot predicts: its id must be the response token in that cell
    predicted = torch.roll(packed.input_ids, -1)
    assert torch.equal(no_padding_2_padding(predicted, mask, response_mask), ids[:, 3:])


def test_unpad_right_padding_only_by_hand():
    # P = 2, R = 3, every prompt full length
    ids = torch.tensor([[11, 12, 13, 0, 0], [21, 22, 23, 24, 25], [31, 32, 33, 34, 0]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    response_mask = mask[:, 2:].clone()
    packed = unpad(ids, mask)
    assert packed.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 25, 31, 32, 33, 34]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 12]
    assert packed.indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    values = torch.arange(12, dtype=torch.float32)
    # sample 0: start 0 -> 1 ; sample 1: start 3 -> 4, 5, 6 ; sample 2: start 8 -> 9, 10
    assert no_padding_2_padding(values, mask, response_mask).tolist() == [[1, 0, 0], [4, 5, 6], [9, 10, 0]]
    # here (full prompts) the legacy rule happens to agree
    assert torch.equal(
        legacy_slice_response(values, mask, response_mask), no_padding_2_padding(values, mask, response_mask)
    )


def test_unpad_left_and_right_padding_by_hand():
    # P = 3, R = 3
    ids = torch.tensor(
        [[0, 0, 11, 12, 13, 0], [21, 22, 23, 24, 0, 0], [0, 31, 32, 33, 34, 35], [0, 0, 41, 0, 0, 0]]
    )  # last sample: prompt only, empty response
    mask = (ids != 0).long()
    response_mask = mask[:, 3:].clone()
    packed = unpad(ids, mask)
    assert packed.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 31, 32, 33, 34, 35, 41]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 12, 13]
    assert packed.indices.tolist() == [2, 3, 4, 6, 7, 8, 9, 13, 14, 15, 16, 17, 20]
    values = torch.arange(13, dtype=torch.float32)
    expected = [
        [0, 1, 0],  # start 0, prompt 1
        [5, 0, 0],  # start 3, prompt 3
        [8, 9, 10],  # start 7, prompt 2
        [0, 0, 0],
    ]  # no response
    got = no_padding_2_padding(values, mask, response_mask)
    assert got.tolist() == expected
    assert torch.equal(got, expected_packed_index([1, 3, 2, 1], [2, 1, 3, 0], 3))
    predicted = torch.roll(packed.input_ids, -1)
    assert torch.equal(no_padding_2_padding(predicted, mask, response_mask), ids[:, 3:])
    # legacy rule: rows start at column 0, slice [:, -4:-1] = columns 2..4 of the re-padded rows
    assert legacy_slice_response(values, mask, response_mask).tolist() == [[2, 0, 0], [5, 0, 0], [9, 10, 11], [0, 0, 0]]


@pytest.mark.parametrize(
    "prompts, responses",
    [
        ([3, 1, 2], [4, 4, 4]),  # left padding only
        ([3, 3, 3], [1, 4, 2]),  # right padding only
        ([3, 1, 2], [1, 4, 2]),  # both
    ],
)
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.int32])
def test_layouts_against_the_formula(prompts, responses, mask_dtype):
    ids, mask, response_mask = layout(prompts, responses, mask_dtype=mask_dtype)
    packed = unpad(ids, mask)
    assert torch.equal(packed.input_ids, ids[mask.bool()])
    lengths = [p + r for p, r in zip(prompts, responses)]
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert torch.equal(packed.position_ids, torch.cat([torch.arange(n) for n in lengths]))
    assert torch.equal(packed.indices, torch.nonzero(mask.flatten()).flatten())
    values = torch.arange(len(packed.input_ids), dtype=torch.float32)
    got = no_padding_2_padding(values, mask, response_mask)
    assert torch.equal(got, expected_packed_index(prompts, responses, response_mask.shape[1]))


# ----------------------------------------------------------------------------------------------------------
# 2. verl's case
# ----------------------------------------------------------------------------------------------------------

VERL_PROMPTS, VERL_RESPONSES, VERL_P, VERL_R = [10, 30, 5, 40], [40, 20, 45, 10], 40, 45


def test_verl_case_rows_are_the_token_positions():
    ids, mask, response_mask = layout(VERL_PROMPTS, VERL_RESPONSES, VERL_P, VERL_R)
    assert ids.shape == (4, 85)
    total = int(mask.sum())
    assert total == sum(VERL_PROMPTS) + sum(VERL_RESPONSES) == 200
    got = no_padding_2_padding(torch.arange(total, dtype=torch.float32), mask, response_mask)
    starts = [0, 50, 100, 150]
    for i, (start, p, r) in enumerate(zip(starts, VERL_PROMPTS, VERL_RESPONSES)):
        want = [float(start + p + j - 1) for j in range(r)] + [0.0] * (VERL_R - r)
        assert got[i].tolist() == want, f"row {i}"
    # e.g. sample 1 (prompt 30 left-padded by 10) response token 0 is read at packed 50 + 30 - 1 = 79
    assert got[1, 0].item() == 79.0 and got[3, 9].item() == 150 + 40 + 9 - 1


def test_verl_case_independent_of_the_formula():
    """values encode the padded (row, column) of the token they predict: unpad the column ids, shift by one."""
    ids, mask, response_mask = layout(VERL_PROMPTS, VERL_RESPONSES, VERL_P, VERL_R)
    batch, total = ids.shape
    cell = torch.arange(batch * total).view(batch, total)  # row * L + column
    packed_cell = unpad(cell, mask).input_ids
    predicted_cell = torch.roll(packed_cell, -1).float()  # values[k] is about the token after k
    got = no_padding_2_padding(predicted_cell, mask, response_mask)
    response_cells = cell[:, VERL_P:].float()  # response token j of row i lives at (i, P + j)
    want = torch.where(response_mask.bool(), response_cells, torch.zeros(()))
    assert torch.equal(got, want)
    # the same with real token ids: the value read at [i, j] is about token ids[i, P + j]
    predicted_ids = torch.roll(unpad(ids, mask).input_ids, -1)
    assert torch.equal(no_padding_2_padding(predicted_ids, mask, response_mask), ids[:, VERL_P:] * response_mask)
    # and the legacy rule gets three of the four rows wrong (only the full 40-token prompt is right)
    legacy = legacy_slice_response(predicted_cell, mask, response_mask)
    assert [torch.equal(legacy[i], want[i]) for i in range(4)] == [False, False, False, True]


# ----------------------------------------------------------------------------------------------------------
# 3. properties
# ----------------------------------------------------------------------------------------------------------


@st.composite
def batches(draw, max_batch=6, max_prompt=9, max_response=8):
    """(prompt_lens, response_lens, P, R) with prompt >= 1, response >= 0, and optional extra padding columns."""
    size = draw(st.integers(1, max_batch))
    prompts = draw(st.lists(st.integers(1, max_prompt), min_size=size, max_size=size))
    responses = draw(st.lists(st.integers(0, max_response), min_size=size, max_size=size))
    width_p = max(prompts) + draw(st.integers(0, 2))
    width_r = max(responses) + draw(st.integers(0, 2))
    return prompts, responses, width_p, width_r


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from([torch.long, torch.bool]), st.integers(0, 2**16))
def test_pad_inverts_unpad(batch, mask_dtype, seed):
    prompts, responses, width_p, width_r = batch
    ids, mask, _ = layout(prompts, responses, width_p, width_r, seed=seed, mask_dtype=mask_dtype)
    packed = unpad(ids, mask)
    assert packed.input_ids.shape[0] == sum(prompts) + sum(responses)
    assert torch.equal(pad(packed.input_ids, packed.indices, *ids.shape), ids * mask.long())
    # trailing dims: [B, L, 3] values survive the round trip, zero at padding
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn((*ids.shape, 3), generator=generator)
    packed_features = features.flatten(0, 1)[packed.indices]
    assert packed_features.shape == (packed.input_ids.shape[0], 3)
    back = pad(packed_features, packed.indices, *ids.shape)
    assert torch.equal(back, features * mask.bool()[..., None])
    # [T, 2, 3] too
    deeper = torch.randn((packed.input_ids.shape[0], 2, 3), generator=generator)
    back = pad(deeper, packed.indices, *ids.shape)
    assert torch.equal(back[mask.bool()], deeper) and not back[~mask.bool()].any()


@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(0, 2), st.integers(0, 2**16))
def test_no_padding_2_padding_matches_a_per_sample_loop(batch, trailing, seed):
    prompts, responses, width_p, width_r = batch
    ids, mask, response_mask = layout(prompts, responses, width_p, width_r, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((int(mask.sum()), *([3] * trailing)), generator=generator)
    got = no_padding_2_padding(values, mask, response_mask)
    assert got.shape == (len(prompts), width_r, *([3] * trailing))
    assert torch.equal(got, naive_no_padding_2_padding(values, mask, response_mask))
    index = no_padding_2_padding(torch.arange(int(mask.sum()), dtype=torch.float32), mask, response_mask)
    assert torch.equal(index, expected_packed_index(prompts, responses, width_r))
    # response_mask may mark only some real response tokens (e.g. nothing after EOS): same rule, fewer cells
    subset = response_mask * (torch.rand(response_mask.shape, generator=generator) < 0.5)
    got = no_padding_2_padding(values, mask, subset)
    assert torch.equal(got, naive_no_padding_2_padding(values, mask, subset))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 8), st.integers(0, 2**16))
def test_legacy_slice_is_right_when_everything_is_full_length(size, width_p, width_r, seed):
    ids, mask, response_mask = layout([width_p] * size, [width_r] * size, seed=seed)
    values = torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(
        legacy_slice_response(values, mask, response_mask), no_padding_2_padding(values, mask, response_mask)
    )


@settings(max_examples=80, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_legacy_slice_is_wrong_when_prompt_lengths_differ(batch, seed):
    prompts, responses, width_p, width_r = batch
    ids, mask, response_mask = layout(prompts, responses, width_p, width_r, seed=seed)
    values = torch.arange(1, int(mask.sum()) + 1, dtype=torch.float32)  # distinct and non-zero
    correct = no_padding_2_padding(values, mask, response_mask)
    legacy = legacy_slice_response(values, mask, response_mask)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if p == width_p:  # a prompt that fills all P columns is read right, whatever its response length
            assert torch.equal(legacy[i], correct[i])
        else:  # a left-padded prompt shifts every response token of its row
            assert (legacy[i, :r] != correct[i, :r]).all()
        assert not legacy[i, r:].any() and not correct[i, r:].any()
    affected = any(p < width_p and r > 0 for p, r in zip(prompts, responses))
    if len(set(prompts)) > 1 and affected:
        assert not torch.equal(legacy, correct)
    if all(p == width_p for p in prompts):
        assert torch.equal(legacy, correct)


# ----------------------------------------------------------------------------------------------------------
# 4. a real Qwen3 forward
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_packed_log_probs_equal_the_per_sequence_forward(attn, temperature, monkeypatch):
    model = tiny_qwen3(attn)
    if attn == "eager":  # make sure the eager kernel is really the one that runs
        import transformers.models.qwen3.modeling_qwen3 as qwen3

        calls = []
        original = qwen3.eager_attention_forward

        def spy(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(qwen3, "eager_attention_forward", spy)
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=1)
    with torch.no_grad():
        got = packed_log_probs(model, ids, mask, response_mask, temperature=temperature)
        want = per_sequence_reference(model, ids, mask, response_mask, temperature)
    if attn == "eager":
        assert calls, "eager attention was not used"
    assert got.dtype == torch.float32 and got.shape == response_mask.shape
    assert (got - want).abs().max().item() <= 1e-5
    assert not got[~response_mask.bool()].any()
    assert (got[response_mask.bool()] < 0).all()
    if temperature != 1.0:  # the temperature really divides the logits: t = 1 gives other values
        with torch.no_grad():
            plain = packed_log_probs(model, ids, mask, response_mask)
            plain_ref = per_sequence_reference(model, ids, mask, response_mask, 1.0)
        assert (plain - plain_ref).abs().max().item() <= 1e-5
        assert (plain - got)[response_mask.bool()].abs().max().item() > 1e-3


def spy_on_sdpa(monkeypatch):
    """Records (query length, mask given, is_causal) of every sdpa call packed_sdpa makes."""
    calls = []
    original = packed_attention.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], attention_mask is not None, kwargs.get("is_causal")))
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", spy)
    return calls


def test_packed_sdpa_attends_within_each_sample_at_its_own_length(monkeypatch):
    """One causal sdpa call per sample and layer, on that sample's tokens only: no T x T mask."""
    model = tiny_qwen3("packed_sdpa")
    calls = spy_on_sdpa(monkeypatch)
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=1)
    with torch.no_grad():
        packed_log_probs(model, ids, mask, response_mask)
    lengths = [p + r for p, r in zip(MODEL_PROMPTS, MODEL_RESPONSES)]
    assert calls == [(length, False, True) for _ in range(model.config.num_hidden_layers) for length in lengths]


def test_packed_sdpa_loss_and_gradients_equal_the_masked_sdpa():
    """The same forward and backward as transformers' block-diagonal mask, within fp32 rounding."""
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=4)
    results = {}
    for attn in ("packed_sdpa", "sdpa"):
        model = tiny_qwen3(attn)
        loss = -(packed_log_probs(model, ids, mask, response_mask, temperature=0.7) * response_mask).sum()
        loss.backward()
        results[attn] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (loss, grads), (want_loss, want_grads) = results["packed_sdpa"], results["sdpa"]
    assert abs(loss.item() - want_loss.item()) <= 1e-4 * abs(want_loss.item())
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert any(g.abs().max() > 0 for n, g in grads.items() if "self_attn" in n)  # attention really trained


def test_packed_sdpa_leaves_padded_batches_and_cached_decoding_to_sdpa(monkeypatch):
    """Anything that is not a packed row runs sdpa with transformers' mask: bitwise the sdpa model's output."""
    packed_model, sdpa_model = tiny_qwen3("packed_sdpa"), tiny_qwen3("sdpa")
    calls = spy_on_sdpa(monkeypatch)
    ids, mask, _ = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=2)
    with torch.no_grad():
        got = packed_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        want = sdpa_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)
    assert calls and all(length == ids.shape[1] and masked for length, masked, _ in calls)
    width_p = max(MODEL_PROMPTS)
    for rows in ([2], [0, 1, 2]):  # greedy decoding with a KV cache: one prompt, then left-padded prompts
        prompts, prompt_mask = ids[rows, :width_p], mask[rows, :width_p]
        generated = {
            name: model.generate(prompts, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            for name, model in (("packed_sdpa", packed_model), ("sdpa", sdpa_model))
        }
        assert torch.equal(generated["packed_sdpa"], generated["sdpa"])


def test_packed_sample_bounds_follow_transformers_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    bounds = packed_attention.packed_sample_bounds(position_ids, 10)
    assert bounds == [0, 3, 5, 6, 10]
    sample_of_token = find_packed_sequence_indices(position_ids)[0]
    for sample, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert (sample_of_token[start:end] == sample).all()
    assert packed_attention.packed_sample_bounds(torch.arange(6)[None], 6) is None  # one sample
    assert packed_attention.packed_sample_bounds(torch.arange(3, 9)[None], 6) is None  # one sample, offset
    # transformers splits any restart, wherever it restarts (padded rows come with a mask: see the test above)
    assert packed_attention.packed_sample_bounds(torch.tensor([[1, 1, 0, 1]]), 4) == [0, 1, 2, 4]
    assert packed_attention.packed_sample_bounds(torch.tensor([[4, 5, 2, 3]]), 4) == [0, 2, 4]
    assert packed_attention.packed_sample_bounds(torch.tensor([[5]]), 1) is None  # a decoding step
    assert packed_attention.packed_sample_bounds(None, 4) is None


def per_sequence_entropy(model, ids, attention_mask, response_mask, temperature=1.0):
    """Each sample alone, unpadded: Categorical(logits / t).entropy() at the positions predicting the response."""
    width_p = ids.shape[1] - response_mask.shape[1]
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for i in range(ids.shape[0]):
        row = attention_mask[i].bool()
        prompt_len, response_len = int(row[:width_p].sum()), int(response_mask[i].sum())
        logits = model(input_ids=ids[i][row][None]).logits[0].float() / temperature
        entropy = torch.distributions.Categorical(logits=logits).entropy()
        out[i, :response_len] = entropy[prompt_len - 1 : prompt_len - 1 + response_len]
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_entropy_equals_the_per_sequence_categorical_entropy(temperature):
    model = tiny_qwen3("sdpa")
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=5)
    log_probs, entropies = packed_log_probs(model, ids, mask, response_mask, temperature, return_entropy=True)
    with torch.no_grad():
        want = per_sequence_entropy(model, ids, mask, response_mask, temperature)
        plain = packed_log_probs(model, ids, mask, response_mask, temperature)
    assert entropies.dtype == torch.float32 and entropies.shape == response_mask.shape
    assert (entropies - want).abs().max().item() <= 1e-5
    assert not entropies[~response_mask.bool()].any() and (entropies[response_mask.bool()] > 0).all()
    assert torch.equal(log_probs.detach(), plain)  # the flag changes nothing about the log-probs
    assert log_probs.requires_grad and not entropies.requires_grad  # entropy is detached: no [T, V] kept
    if temperature != 1.0:  # the entropy is the tempered distribution's
        assert (entropies - per_sequence_entropy(model, ids, mask, response_mask)).abs().max().item() > 1e-3


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_token_entropy_chunks_equal_the_categorical_entropy(chunk_size):
    logits = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    want = torch.distributions.Categorical(logits=logits.float()).entropy()
    got = token_entropy(logits, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (10,)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert token_entropy(logits[:0]).shape == (0,)


def test_packed_log_probs_with_a_response_mask_narrower_than_the_attention_mask():
    """Real response tokens that are not scored (e.g. after EOS) still sit in the sequence and shift nothing."""
    model = tiny_qwen3("sdpa")
    ids, mask, full = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=2)
    narrow = full.clone()
    narrow[0, 2:] = 0  # sample 0 scores 2 of its 4 response tokens
    narrow[4, 1] = 0  # sample 4 skips one in the middle
    with torch.no_grad():
        got = packed_log_probs(model, ids, mask, narrow)
        want = per_sequence_reference(model, ids, mask, full)
    assert (got - want * narrow).abs().max().item() <= 1e-5
    assert got[0, :2].ne(0).all() and not got[0, 2:].any() and got[4, 1] == 0 and got[4, 2] != 0


def test_packed_log_probs_temperature_divides_the_logits():
    """Direct check: log-softmax of logits / t on a fake model whose logits are known."""
    ids, mask, response_mask = layout([2, 3], [3, 1], seed=3)
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, generator=generator) * 3

    class Lookup(torch.nn.Module):  # logits depend only on the current token
        def forward(self, input_ids, position_ids, use_cache):
            assert use_cache is False
            return type("Out", (), {"logits": table[input_ids]})()

    temperature = 0.5
    got = packed_log_probs(Lookup(), ids, mask, response_mask, temperature=temperature)
    for i in range(2):
        for j in range(int(response_mask[i].sum())):
            previous, token = ids[i, 3 + j - 1], ids[i, 3 + j]
            want = torch.log_softmax(table[previous] / temperature, -1)[token]
            assert abs(got[i, j].item() - want.item()) <= 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("cache", ["use_cache=True", "default"])
def test_pitfall_packed_forward_with_a_cache_mixes_samples(attn, cache):
    """With a KV cache transformers does not build the per-sample mask from position_ids: samples see each other."""
    model = tiny_qwen3(attn)
    assert model.config.use_cache is True  # so omitting use_cache means a cache
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=1)
    packed = unpad(ids, mask)
    kwargs = {"use_cache": True} if cache == "use_cache=True" else {}
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], **kwargs).logits[0]
        values = selective_log_softmax(logits, torch.roll(packed.input_ids, -1))
        cached = no_padding_2_padding(values, mask, response_mask)
        want = per_sequence_reference(model, ids, mask, response_mask)
        right = packed_log_probs(model, ids, mask, response_mask)
    assert (right - want).abs().max().item() <= 1e-5
    # the first sample has nothing before it to leak from; every later one does
    assert (cached[0] - want[0]).abs().max().item() <= 1e-5
    assert (cached[1:] - want[1:]).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# 5. errors
# ----------------------------------------------------------------------------------------------------------


class NeverCalled(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("the forward ran before the layout was validated")


def test_empty_prompt_names_the_sample():
    ids, mask, response_mask = layout([3, 2, 4, 1], [2, 3, 1, 2])  # P = 4
    empty = mask.clone()
    empty[2, :4] = 0  # sample 2 loses its whole prompt
    values = torch.zeros(int(empty.sum()))
    with pytest.raises(ValueError, match=r"sample\(s\) \[2\] have an empty prompt"):
        no_padding_2_padding(values, empty, response_mask)
    with pytest.raises(ValueError, match=r"\[2\]"):
        packed_log_probs(NeverCalled(), ids, empty, response_mask)
    both = empty.clone()
    both[0, :4] = 0
    with pytest.raises(ValueError, match=r"sample\(s\) \[0, 2\] have an empty prompt"):
        no_padding_2_padding(torch.zeros(int(both.sum())), both, response_mask)


def test_response_mask_on_padding_raises():
    ids, mask, response_mask = layout([3, 2], [2, 3])  # R = 3, sample 0 response has one padding slot
    values = torch.zeros(int(mask.sum()))
    stray = response_mask.clone()
    stray[0, 2] = 1
    with pytest.raises(ValueError, match=r"marks padding tokens .* sample\(s\) \[0\]"):
        no_padding_2_padding(values, mask, stray)
    with pytest.raises(ValueError, match=r"sample\(s\) \[0\]"):
        packed_log_probs(NeverCalled(), ids, mask, stray)


def test_mismatched_shapes_raise():
    ids, mask, response_mask = layout([3, 2], [2, 3])  # [2, 6], R = 3
    values = torch.zeros(int(mask.sum()))
    with pytest.raises(ValueError, match="differ in shape"):
        unpad(ids[:, 1:], mask)
    with pytest.raises(ValueError, match=r"must be \[B, L\]"):
        unpad(ids.flatten(), mask.flatten())
    with pytest.raises(ValueError, match="rows"):
        pad(values[1:], unpad(ids, mask).indices, *ids.shape)
    with pytest.raises(ValueError, match="real tokens"):
        no_padding_2_padding(values[1:], mask, response_mask)
    with pytest.raises(ValueError, match="real tokens"):
        no_padding_2_padding(torch.zeros(values.shape[0] + 1), mask, response_mask)
    with pytest.raises(ValueError, match="response_mask must be"):
        no_padding_2_padding(values, mask, response_mask[:1])  # batch mismatch
    with pytest.raises(ValueError, match="response_mask must be"):
        no_padding_2_padding(values, mask, torch.ones(2, 7, dtype=torch.long))  # wider than the batch
    with pytest.raises(ValueError, match="response_mask must be"):
        no_padding_2_padding(values, mask, response_mask[0])  # 1-D
    with pytest.raises(ValueError, match=r"must be \[B, L\]"):
        no_padding_2_padding(values, mask[0], response_mask)
    with pytest.raises(ValueError, match="differ in shape"):
        packed_log_probs(NeverCalled(), ids[:, :-1], mask, response_mask)


# ----------------------------------------------------------------------------------------------------------
# 6. gradients
# ----------------------------------------------------------------------------------------------------------


def test_gradients_flow_and_match_the_per_sequence_forward():
    model = tiny_qwen3("sdpa")
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=4)
    packed_log_probs(model, ids, mask, response_mask, temperature=0.9).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]:
        assert grads[name].abs().sum().item() > 0, name
    nonzero = sum(bool(g.abs().sum() > 0) for g in grads.values())
    assert nonzero == len(grads), [n for n, g in grads.items() if not g.abs().sum() > 0]
    # and they are the gradients of the per-sequence loss
    model.zero_grad(set_to_none=True)
    per_sequence_reference(model, ids, mask, response_mask, 0.9).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------
# 7. the LM head only at the positions read, in chunks
# ----------------------------------------------------------------------------------------------------------


def full_logits_log_probs(
    model, ids, attention_mask, response_mask, temperature=1.0, legacy_slice=False, return_entropy=False
):
    """packed_log_probs without the chunked head: [T, V] logits at every packed position, then the mapping."""
    packed = unpad(ids, attention_mask)
    logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False).logits[0]
    if temperature != 1.0:
        logits = logits / temperature
    values = selective_log_softmax(logits, torch.roll(packed.input_ids, shifts=-1))
    to_response = legacy_slice_response if legacy_slice else no_padding_2_padding
    log_probs = to_response(values, attention_mask, response_mask)
    if not return_entropy:
        return log_probs
    return log_probs, to_response(token_entropy(logits), attention_mask, response_mask)


def lora_model(kind: str, dtype=torch.float32):
    from qwen3_lora import tiny_lora
    from qwen3_moe_lora import tiny_moe_lora

    if kind == "dense":  # LoRA on every linear layer of the decoder, tied lm_head
        return tiny_lora(dtype=dtype)
    if kind == "dense, LoRA on an untied lm_head":
        return tiny_lora(dtype=dtype, targets=["q_proj", "v_proj", "lm_head"], tie=False)
    return tiny_moe_lora(dtype=dtype)  # LoRA on attention and the fused experts


def loss_and_grads(model, log_probs_fn, *args, **kwargs):
    """(log-probs, entropies or None, LoRA gradients) of the recipe-like loss -mean(log-probs of response tokens)."""
    out = log_probs_fn(model, *args, **kwargs)
    log_probs, entropies = out if isinstance(out, tuple) else (out, None)
    response_mask = args[2]
    (-(log_probs * response_mask).sum() / response_mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return log_probs.detach(), entropies, grads


LAYOUTS = {  # name: (prompt lengths, response lengths, P, R)
    "ragged (left- and right-padded)": (MODEL_PROMPTS, MODEL_RESPONSES, None, None),
    "no padding": ([4, 4, 4], [5, 5, 5], None, None),
    "extra padding columns": ([2, 6, 3], [3, 1, 4], 8, 6),
}


@pytest.mark.parametrize("legacy_slice", [False, True])
@pytest.mark.parametrize(
    "kind, layout_name",
    [
        *(("dense", name) for name in LAYOUTS),
        ("dense, LoRA on an untied lm_head", "ragged (left- and right-padded)"),
        ("moe", "ragged (left- and right-padded)"),
    ],
)
def test_response_head_equals_the_full_logits_fp32(kind, legacy_slice, layout_name):
    """Log-probs, entropies and LoRA gradients of the chunked response-only head equal the full-logits path's."""
    prompts, responses, width_p, width_r = LAYOUTS[layout_name]
    ids, mask, response_mask = layout(prompts, responses, width_p, width_r, seed=7)
    model = lora_model(kind)
    args = (ids, mask, response_mask, 0.7, legacy_slice, True)
    want, want_entropy, want_grads = loss_and_grads(model, full_logits_log_probs, *args)
    for chunk_size in (3, 1024):
        got, entropy, grads = loss_and_grads(model, packed_log_probs, *args, chunk_size=chunk_size)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # |log-prob| ~ 5: 1-2 fp32 ulps
        torch.testing.assert_close(entropy, want_entropy, atol=1e-6, rtol=1e-6)
        assert not got[~response_mask.bool()].any() and not entropy[~response_mask.bool()].any()
        assert grads.keys() == want_grads.keys() and all("lora_" in n for n in grads) and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=0, msg=name)
        assert any(g.abs().max() > 0 for g in grads.values()) or not want.any()  # legacy may read only padding
    if legacy_slice and layout_name != "no padding":  # the legacy rule reads other rows: really another mapping
        assert (full_logits_log_probs(model, *args[:4]) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind, autocast", [("dense", False), ("dense", True), ("moe", False)])
def test_response_head_equals_the_full_logits_bf16(kind, autocast):
    """bf16 base, fp32 LoRA (peft's default), also under the single-process recipe's bf16 autocast (run.autocast):
    the same values as the full-logits path (1e-5 absolute and relative), gradients (1e-5 absolute, 1e-3 relative)."""
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=8)
    model = lora_model(kind, torch.bfloat16)
    context = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    with torch.no_grad(), context():
        want = full_logits_log_probs(model, ids, mask, response_mask, 0.7, False, True)
        got = packed_log_probs(model, ids, mask, response_mask, 0.7, False, True, chunk_size=4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    with context():
        _, _, want_grads = loss_and_grads(model, full_logits_log_probs, ids, mask, response_mask, 0.7)
        _, _, grads = loss_and_grads(model, packed_log_probs, ids, mask, response_mask, 0.7, chunk_size=4)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-3, msg=name)


def spy_on_lm_head(model):
    """Records the shape of every output of the model's real LM head (forward and the backward's recompute)."""
    shapes = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    return shapes


def test_the_lm_head_runs_on_response_positions_only_in_chunks():
    """No [T, V] logits: the head sees chunks of the N scored positions, in the forward and again in the backward."""
    model = lora_model("dense")
    shapes = spy_on_lm_head(model)
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=9)
    total, scored, vocab = int(mask.sum()), int(response_mask.sum()), model.config.vocab_size
    assert scored == 16 and total == 34
    log_probs = packed_log_probs(model, ids, mask, response_mask, chunk_size=5)
    assert shapes == [(1, 5, vocab), (1, 5, vocab), (1, 5, vocab), (1, 1, vocab)]  # 16 rows in chunks of 5
    log_probs.sum().backward()  # each chunk's logits recomputed, last chunk first
    assert sorted(shapes[4:]) == sorted(shapes[:4])
    shapes.clear()
    with torch.no_grad():
        packed_log_probs(model, ids, mask, response_mask)  # default chunk: all 16 at once; no recompute
        assert shapes == [(1, scored, vocab)]
        packed_log_probs(
            model, ids, mask, response_mask, chunk_size=None
        )  # the full-logits path: every packed position
        assert shapes[1:] == [(1, total, vocab)]
        legacy = response_mask.clone()
        shapes.clear()
        packed_log_probs(model, ids, mask, legacy, legacy_slice=True)  # the legacy rule: what it reads, no more
        assert shapes[0][1] == int((legacy_slice_response(torch.ones(total), mask, response_mask) != 0).sum())


def test_the_model_is_left_as_it_was():
    """The LM head is swapped only during the forward: back afterwards, also when the forward raises."""
    model = lora_model("dense")
    head, names = model.get_output_embeddings(), [n for n, _ in model.named_parameters()]
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=9)
    packed_log_probs(model, ids, mask, response_mask).sum().backward()
    assert model.get_output_embeddings() is head and [n for n, _ in model.named_parameters()] == names
    with pytest.raises(IndexError):  # a token id beyond the vocabulary: the embedding raises mid-forward
        packed_log_probs(model, ids + 1000 * mask, mask, response_mask)
    assert model.get_output_embeddings() is head


def test_no_response_token_at_all_gives_zeros_and_a_graph():
    model = lora_model("dense")
    ids, mask, response_mask = layout([3, 2], [0, 0], width_r=2, seed=3)
    log_probs, entropies = packed_log_probs(model, ids, mask, response_mask, return_entropy=True)
    assert log_probs.shape == entropies.shape == (2, 2) and not log_probs.any() and not entropies.any()
    log_probs.sum().backward()  # no error: the loss of an all-empty mini-batch still backpropagates (zeros)


def test_a_model_that_changes_the_head_output_is_refused():
    """A logit soft-cap or scale after the head (Gemma-2, Cohere, Granite) would be applied to log-probs: refused."""

    class Scaled(Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Scaled(tiny_qwen3("sdpa").config).eval()
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=9)
    with pytest.raises(RuntimeError, match="chunk_size=None"):
        packed_log_probs(model, ids, mask, response_mask)
    with pytest.raises(ValueError, match="chunk_size"):
        packed_log_probs(model, ids, mask, response_mask, chunk_size=0)
    assert packed_log_probs(model, ids, mask, response_mask, chunk_size=None).shape == response_mask.shape


# ----------------------------------------------------------------------------------------------------------
# 8. packed_sdpa: one host read per forward
# ----------------------------------------------------------------------------------------------------------


def bounds_read_every_time(position_ids, length):
    """packed_sample_bounds done with device tensor ops and several host reads, in every layer (the slower way)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length) or length < 2:
        return None
    row = position_ids[0]
    starts = (torch.diff(row) != 1).nonzero().flatten() + 1
    if starts.numel() == 0 or row[0] != 0 or row[starts].any():
        return None
    return [0, *starts.tolist(), length]


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


def count_host_reads_in_attention(monkeypatch):
    """Counts the Tensor methods that copy to the host (.tolist(), .item(), bool(t), ...) while packed_sdpa's
    attention function runs (all layers), by wrapping the function transformers looks up for each layer."""
    from transformers import AttentionInterface

    inside, reads = [False], []
    for method in HOST_READS:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            if inside[0]:
                reads.append(_method)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)

    def attention(*args, **kwargs):
        inside[0] = True
        try:
            return packed_attention.packed_sdpa_attention(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setitem(AttentionInterface._global_mapping, packed_attention.PACKED_SDPA, attention)
    return reads


def test_packed_sdpa_reads_the_sample_bounds_once_per_forward(monkeypatch):
    model = tiny_qwen3("packed_sdpa", layers=4)  # a read per layer would show as 4
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=1)
    packed = unpad(ids, mask)
    position_ids = packed.position_ids[None]

    def forward():
        return model(input_ids=packed.input_ids[None], position_ids=position_ids, use_cache=False).logits

    reads = count_host_reads_in_attention(monkeypatch)
    with torch.no_grad():
        with monkeypatch.context() as patch:  # the old per-layer bounds: the reference output
            patch.setattr(packed_attention, "packed_sample_bounds", bounds_read_every_time)
            want = forward()
        assert reads == ["__bool__", "__bool__", "tolist"] * 4, reads  # what the counter saw before: 3 per layer
        reads.clear()
        got = forward()
        assert reads == ["tolist"], reads  # one read in the first of 4 layers, none in the others
        assert torch.equal(got, want)
        reads.clear()
        forward()
        assert reads == []  # the same position_ids tensor: already read
        position_ids = packed.position_ids[None].clone()  # a new tensor: read once
        forward()
        assert reads == ["tolist"]
    # an in-place change of the same tensor is seen (one sample instead of five: no longer a packed row)
    position_ids[0] = torch.arange(position_ids.shape[1])
    assert packed_attention.packed_sample_bounds(position_ids, position_ids.shape[1]) is None
    # and through packed_log_probs, gradients included: one read in the forward, none in the backward
    reads.clear()
    packed_log_probs(model, ids, mask, response_mask).sum().backward()
    assert reads == ["tolist"], reads


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_packed_sample_bounds_equal_transformers_packed_sequences(positions):
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = torch.tensor([positions])
    got = packed_attention.packed_sample_bounds(position_ids, len(positions))
    sample_of_token = find_packed_sequence_indices(position_ids)
    if sample_of_token is None or len(positions) < 2:
        assert got is None
    else:
        assert got == [0, *(torch.diff(sample_of_token[0]).nonzero().flatten() + 1).tolist(), len(positions)]


# ----------------------------------------------------------------------------------------------------------
# 9. packed_sdpa: no T x T mask; on CUDA one variable-length FlashAttention call per layer
# ----------------------------------------------------------------------------------------------------------


def per_sample_attention_with_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """packed_sdpa as it was before: transformers' T x T mask built (and ignored), one sdpa call per sample."""
    bounds = packed_attention.packed_sample_bounds(kwargs.get("position_ids"), query.shape[2])
    assert bounds is not None and attention_mask is not None and attention_mask.shape[-2:] == (query.shape[2],) * 2
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal", "position_ids")}
    outputs = [
        packed_attention.sdpa_attention_forward(
            module,
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )[0]
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=1), None


def count_mask_builds(monkeypatch):
    """Counts the [B, 1, q, kv] masks transformers' sdpa_mask materialises (its two expansion paths)."""
    import transformers.masking_utils as masking_utils

    built = []
    for name in ("_non_vmap_expansion_sdpa", "_vmap_expansion_sdpa"):
        original = getattr(masking_utils, name)

        def counted(*args, _original=original, **kwargs):
            built.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(masking_utils, name, counted)
    return built


def loss_and_lora_like_grads(model, ids, mask, response_mask):
    loss = -(packed_log_probs(model, ids, mask, response_mask, temperature=0.7) * response_mask).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_sdpa_builds_no_mask_for_packed_rows_and_is_bitwise_as_before(monkeypatch):
    """A packed row's forward and backward build no T x T mask; log-probs, loss and every gradient are bitwise
    those of the per-sample path that still had transformers build the mask (registered under another name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    monkeypatch.setitem(AttentionInterface._global_mapping, "packed_sdpa_before", per_sample_attention_with_mask)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "packed_sdpa_before", sdpa_mask)
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=4)
    built = count_mask_builds(monkeypatch)
    before = loss_and_lora_like_grads(tiny_qwen3("packed_sdpa_before"), ids, mask, response_mask)
    assert len(built) == 1  # the counter sees transformers' mask: one per forward
    built.clear()
    loss, grads = loss_and_lora_like_grads(tiny_qwen3("packed_sdpa"), ids, mask, response_mask)
    assert built == []
    assert torch.equal(loss, before[0])
    assert grads.keys() == before[1].keys() and all(torch.equal(g, before[1][n]) for n, g in grads.items())
    # a padded batch still gets its mask (and sdpa): the packed-row skip is that exact case only
    with torch.no_grad():
        tiny_qwen3("packed_sdpa")(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(built) == 1


def test_the_mask_is_skipped_only_for_transformers_packed_row_predicate():
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function

    packed = and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long)))
    assert packed_attention.causal_within_packed_samples(packed)
    assert (
        packed_attention.packed_sdpa_mask(
            batch_size=1, q_length=4, kv_length=4, mask_function=packed, allow_is_causal_skip=False
        )
        is None
    )
    padded = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)  # with a 2-D mask: built as sdpa builds it
    assert packed_attention.packed_sdpa_mask(
        batch_size=1, q_length=4, kv_length=4, mask_function=packed, attention_mask=padded, allow_is_causal_skip=False
    ).shape == (1, 1, 4, 4)
    extra = and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 4)), causal_mask_function)
    for other in (causal_mask_function, extra, and_masks(causal_mask_function)):
        assert not packed_attention.causal_within_packed_samples(other)


def fake_varlen_attn(calls):
    """torch.nn.attention.varlen.varlen_attn's contract (its docstring and FlashAttention's), run on the CPU:
    [T, H, D] rows, int32 cumulative bounds on the row's device, causal as window_size=(-1, 0), GQA by flag."""

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        assert query.dim() == 3 and key.shape[0] == query.shape[0] and query.is_contiguous() and key.is_contiguous()
        assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32 and cu_seq_q.device == query.device
        bounds = cu_seq_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == query.shape[0]
        assert max_q == max_k == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
        assert window_size == (-1, 0) and enable_gqa == (query.shape[1] != key.shape[1]) and scale is not None
        calls.append(len(bounds) - 1)
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[s:e].transpose(0, 1),
                key[s:e].transpose(0, 1),
                value[s:e].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=enable_gqa,
            ).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outputs)

    return varlen_attn


def fake_varlen_attn_torch_2_11(calls):
    """torch 2.11's varlen_attn (seen on an H100): no ``enable_gqa`` keyword, as many key/value heads as query heads."""
    current = fake_varlen_attn(calls)

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=None
    ):
        assert key.shape[1] == value.shape[1] == query.shape[1], (
            "FlashAttention without GQA: one key head per query head"
        )
        return current(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    return varlen_attn


@pytest.mark.parametrize("contract", [fake_varlen_attn, fake_varlen_attn_torch_2_11], ids=["torch-2.13", "torch-2.11"])
def test_packed_sdpa_on_cuda_makes_one_varlen_call_per_layer(monkeypatch, contract):
    """The CUDA branch, run on the CPU against varlen_attn's contract (torch has no CPU kernel for it) as torch 2.13
    and 2.11 define it: one call per layer over the whole row; log-probs and gradients as the per-sample path's."""
    ids, mask, response_mask = layout(MODEL_PROMPTS, MODEL_RESPONSES, seed=4)
    want = loss_and_lora_like_grads(tiny_qwen3("packed_sdpa"), ids, mask, response_mask)
    calls = []
    fake = contract(calls)
    monkeypatch.setattr(packed_attention, "varlen_attn", fake)
    monkeypatch.setattr(packed_attention, "VARLEN_PARAMETERS", inspect.signature(fake).parameters)
    monkeypatch.setattr(packed_attention, "varlen_usable", lambda query, key, dropout: True)
    sdpa_calls = spy_on_sdpa(monkeypatch)
    model = tiny_qwen3("packed_sdpa")
    loss, grads = loss_and_lora_like_grads(model, ids, mask, response_mask)
    samples = sum(1 for p, r in zip(MODEL_PROMPTS, MODEL_RESPONSES) if p + r)
    assert calls == [samples] * model.config.num_hidden_layers and sdpa_calls == []
    torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_varlen_is_chosen_only_where_torchs_kernel_runs(monkeypatch):
    def tensors(device_type, dtype, head_dim=128):  # what varlen_usable reads of the query and the key
        query = SimpleNamespace(is_cuda=device_type == "cuda", shape=(1, 4, 8, head_dim), dtype=dtype, device="cuda:0")
        return query, SimpleNamespace(dtype=dtype)

    monkeypatch.setattr(packed_attention, "_flash_capable", lambda device: True)
    for device_type, dtype, head_dim, dropout, want in [
        ("cuda", torch.bfloat16, 128, 0.0, True),
        ("cuda", torch.float16, 256, 0.0, True),
        ("cuda", torch.float32, 128, 0.0, False),
        ("cpu", torch.bfloat16, 128, 0.0, False),
        ("cuda", torch.bfloat16, 512, 0.0, False),
        ("cuda", torch.bfloat16, 128, 0.1, False),
    ]:
        query, key = tensors(device_type, dtype, head_dim)
        assert packed_attention.varlen_usable(query, key, dropout) is want, (device_type, dtype, head_dim, dropout)
    query, key = tensors("cuda", torch.bfloat16)
    monkeypatch.setattr(packed_attention, "VARLEN_ON_CUDA", False)  # gpu_check's per-sample comparison
    assert not packed_attention.varlen_usable(query, key, 0.0)
    monkeypatch.setattr(packed_attention, "VARLEN_ON_CUDA", True)
    monkeypatch.setattr(packed_attention, "_flash_capable", lambda device: False)  # pre-Ampere
    assert not packed_attention.varlen_usable(query, key, 0.0)
