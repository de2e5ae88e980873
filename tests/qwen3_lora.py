"""Small random Qwen3 + LoRA models shared by the tests (no download)."""

import torch
from bench_common import ALL_LINEAR, with_random_lora
from transformers import Qwen3Config, Qwen3ForCausalLM


def tiny_qwen3(
    seed: int = 0, dtype=torch.float32, layers: int = 2, hidden: int = 64, tie: bool = True
) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    return Qwen3ForCausalLM(config).to(dtype)


def shard_and_train(model, rank: int, mp_policy=None) -> torch.Tensor:
    """fully_shard each decoder layer, then the root (with ``mp_policy``), and take one AdamW step on a batch that
    differs per rank (so lora_B is non-zero); returns the batch's ids."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from merge import decoder_layers

    kwargs = {} if mp_policy is None else dict(mp_policy=mp_policy)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "parameters are not sharded"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return ids


def tiny_lora(seed=0, dtype=torch.float32, targets=ALL_LINEAR, layers=2, hidden=64, tie=True, **lora):
    """A rank-8 LoRA model whose lora_B is non-zero, so merging changes every targeted weight."""
    return with_random_lora(
        tiny_qwen3(seed, dtype, layers, hidden, tie), rank=8, targets=targets, lora_b_std=0.1, seed=seed, **lora
    )
