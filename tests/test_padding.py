"""padding/: one rule from packed (padding-free) values to the left-prompt / right-response layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padding import legacy_slice_response, no_padding_2_padding, packed_log_probs, pad, unpad
from qwen3_lora import tiny_qwen3


def layout(prompt_lens, response_lens, width_p=None, width_r=None, vocab=128, seed=0):
    """A [B, P+R] batch: prompts left-padded in the first P columns, responses right-padded in the last R."""
    width_p = width_p or max(prompt_lens)
    width_r = width_r or max(response_lens)
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lens)
    ids = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, width_p - p: width_p + r] = 1
    ids[mask.bool()] = torch.randint(3, vocab, (int(mask.sum()),), generator=generator)
    return ids, mask, mask[:, width_p:].clone()


def expected_positions(prompt_lens, response_lens, width_r):
    """By the formula: response token j of sample i is scored at packed index start_i + prompt_len_i + j - 1."""
    out = torch.zeros((len(prompt_lens), width_r))
    start = 0
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        for j in range(r):
            out[i, j] = start + p + j - 1
        start += p + r
    return out


@pytest.mark.parametrize("prompts, responses", [
    ([3, 1, 2], [4, 4, 4]),  # left padding only
    ([3, 3, 3], [1, 4, 2]),  # right padding only
    ([3, 1, 2], [1, 4, 2]),  # both
])
def test_layouts(prompts, responses):
    ids, mask, response_mask = layout(prompts, responses)
    packed = unpad(ids, mask)
    assert torch.equal(packed.input_ids, ids[mask.bool()])
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(prompts).add(torch.tensor(responses)).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(p + r) for p, r in zip(prompts, responses)])
    assert torch.equal(packed.position_ids, positions)
    assert torch.equal(packed.indices, torch.nonzero(mask.flatten()).flatten())
    values = torch.arange(len(packed.input_ids), dtype=torch.float32)
    got = no_padding_2_padding(values, mask, response_mask)
    assert torch.equal(got, expected_positions(prompts, responses, response_mask.shape[1]))


def test_verl_case_rows_match_token_positions():
    prompts, responses = [10, 30, 5, 40], [40, 20, 45, 10]
    ids, mask, response_mask = layout(prompts, responses, width_p=40, width_r=45)
    values = torch.arange(int(mask.sum()), dtype=torch.float32)
    got = no_padding_2_padding(values, mask, response_mask)
    assert torch.equal(got, expected_positions(prompts, responses, 45))
    # independent of the formula: values that name the padded column of the token they predict
    column = torch.arange(85).expand(4, 85)
    packed = unpad(ids, mask)
    predicted_column = torch.roll(column.flatten()[packed.indices], -1).float()
    got_columns = no_padding_2_padding(predicted_column, mask, response_mask)
    want = torch.where(response_mask.bool(), torch.arange(40, 85).float().expand(4, 45), torch.tensor(0.0))
    assert torch.equal(got_columns, want)


lengths = st.lists(st.tuples(st.integers(1, 7), st.integers(0, 6)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(0, 3))
def test_round_trip(pairs, trailing):
    prompts, responses = zip(*pairs)
    if max(responses) == 0:
        responses = (1, *responses[1:])
    ids, mask, _ = layout(prompts, responses)
    packed = unpad(ids, mask)
    assert torch.equal(pad(packed.input_ids, packed.indices, *ids.shape), ids * mask)
    features = torch.randn(len(packed.input_ids), *([3] * trailing))
    back = pad(features, packed.indices, *ids.shape)
    assert torch.equal(back[mask.bool()], features) and not back[~mask.bool()].any()


@settings(max_examples=60, deadline=None)
@given(lengths)
def test_matches_a_per_sample_loop_and_legacy_differs(pairs):
    prompts, responses = zip(*pairs)
    if max(responses) == 0:
        responses = (1, *responses[1:])
    ids, mask, response_mask = layout(prompts, responses)
    values = torch.randn(int(mask.sum()))
    got = no_padding_2_padding(values, mask, response_mask)
    naive = torch.zeros_like(got)
    start = 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        sample = values[start: start + p + r]
        naive[i, :r] = sample[p - 1: p + r - 1]
        start += p + r
    assert torch.equal(got, naive)
    legacy = legacy_slice_response(values, mask, response_mask)
    width_p = mask.shape[1] - response_mask.shape[1]
    full = all(p == width_p for p in prompts) and len(set(responses)) == 1
    if full:
        assert torch.equal(legacy, got)
    if len(set(prompts)) > 1 and any(r > 0 for p, r in zip(prompts, responses) if p < width_p):
        assert not torch.equal(legacy, got)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_log_probs_equal_per_sequence_forward(attn, temperature):
    model = tiny_qwen3()
    model.config._attn_implementation = attn
    prompts, responses = [5, 2, 7, 3], [4, 6, 1, 5]
    ids, mask, response_mask = layout(prompts, responses, seed=1)
    got = packed_log_probs(model, ids, mask, response_mask, temperature=temperature)
    width_p = ids.shape[1] - response_mask.shape[1]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens = ids[i, width_p - p: width_p + r]
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0].float() / temperature
        want = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None]).squeeze(-1)[p - 1:]
        assert (got[i, :r] - want).abs().max().item() <= 1e-5
        assert not got[i, r:].any()


def test_packed_forward_needs_use_cache_false():
    """The pitfall this module guards against: with a cache, transformers does not isolate packed samples."""
    model = tiny_qwen3()
    ids, mask, response_mask = layout([5, 3], [4, 6], seed=2)
    packed = unpad(ids, mask)
    with torch.no_grad():
        isolated = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False)
        cached = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=True)
    second = slice(int(packed.cu_seqlens[1]), None)
    assert (isolated.logits[0, second] - cached.logits[0, second]).abs().max() > 1e-3


def test_gradients_flow():
    model = tiny_qwen3()
    ids, mask, response_mask = layout([3, 2], [2, 3])
    packed_log_probs(model, ids, mask, response_mask).sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_errors_name_the_problem():
    ids, mask, response_mask = layout([3, 2], [2, 3])
    values = torch.zeros(int(mask.sum()))
    empty = mask.clone()
    empty[1, :3] = 0
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\] have an empty prompt"):
        no_padding_2_padding(torch.zeros(int(empty.sum())), empty, response_mask)
    stray = response_mask.clone()
    stray[0, 2] = 1
    with pytest.raises(ValueError, match=r"marks padding tokens .* sample\(s\) \[0\]"):
        no_padding_2_padding(values, mask, stray)
    with pytest.raises(ValueError, match="differ in shape"):
        unpad(ids[:, 1:], mask)
    with pytest.raises(ValueError, match="real tokens"):
        no_padding_2_padding(values[1:], mask, response_mask)
