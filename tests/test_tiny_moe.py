"""The embedded mixture-of-experts model of grpo/tasks/tiny_gsm8k.py (size "tiny-moe"), without its warm-up."""

import pytest

from grpo.tasks.tiny_gsm8k import MOE_SIZES, SIZES, build_tiny_model, new_model
from merge.vllm_compat import has_fused_experts


def test_tiny_moe_is_a_qwen3_moe_vllm_cpu_can_serve():
    model = new_model("tiny-moe", vocab_size=128, tie_word_embeddings=True)
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and has_fused_experts(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as vLLM's Qwen3-MoE ties them
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # every layer has experts
    # vLLM-CPU attention kernels: vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes
    assert config.head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    assert config.hidden_size % 32 == 0 and config.moe_intermediate_size % 32 == 0  # vLLM-CPU grouped-GEMM MoE


def test_sizes_are_checked(tmp_path):
    assert not set(SIZES) & set(MOE_SIZES)
    with pytest.raises(ValueError, match="tiny-moe"):
        build_tiny_model(tmp_path, size="huge")
