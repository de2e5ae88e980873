"""Small random Qwen3 + LoRA models shared by the tests (no download)."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench_common import ALL_LINEAR, with_random_lora


def tiny_qwen3(seed: int = 0, dtype=torch.float32, layers: int = 2, hidden: int = 64, tie: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
                         max_position_embeddings=256)
    return Qwen3ForCausalLM(config).to(dtype)


def tiny_lora(seed=0, dtype=torch.float32, targets=ALL_LINEAR, layers=2, hidden=64, tie=True, **lora):
    """A rank-8 LoRA model whose lora_B is non-zero, so merging changes every targeted weight."""
    return with_random_lora(tiny_qwen3(seed, dtype, layers, hidden, tie), rank=8, targets=targets, lora_b_std=0.1,
                            seed=seed, **lora)
