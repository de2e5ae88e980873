"""Small random Qwen3 + LoRA models shared by the tests (no download)."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_qwen3(seed: int = 0, dtype=torch.float32, layers: int = 2, hidden: int = 64, tie: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
                         max_position_embeddings=256)
    return Qwen3ForCausalLM(config).to(dtype)


def tiny_lora(seed=0, dtype=torch.float32, targets=ALL_LINEAR, layers=2, hidden=64, tie=True, **lora):
    """A LoRA model whose lora_B is non-zero, so merging changes every targeted weight."""
    model = get_peft_model(tiny_qwen3(seed, dtype, layers, hidden, tie),
                           LoraConfig(r=8, lora_alpha=16, target_modules=targets, **lora))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model
