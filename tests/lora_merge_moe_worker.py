"""Run by tests/test_server_mode.py in a process apart from pytest's (vLLM binds threads and keeps global state;
tests/vllm_workers.py runs the engine workers there one after another): an in-process vLLM-CPU ``LLM`` started with the
``lora_merge`` weight-transfer backend, on a random tiny Qwen3-MoE with untied embeddings, receives LoRA factors on
attention, the fused experts and the input embeddings; its log-probs on fixed tokens are compared with peft's
``merge_and_unload()`` model, after a first and a second push.

    python tests/lora_merge_moe_worker.py OUT.json
"""

import copy
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: LLM's own RL calls

import torch
from peft import LoraConfig, get_peft_model
from qwen3_moe_lora import ATTENTION, EXPERTS, tiny_cpu_llm, tiny_qwen3_moe
from vllm_moe_push_worker import hf_logprobs

from merge.lora_merge import LoraMergeTrainer


def policy(model_dir: str, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[*ATTENTION, "embed_tokens"], target_parameters=EXPERTS)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


def main(out_path: str) -> None:
    from vllm import SamplingParams

    model_dir = tempfile.mkdtemp()
    tiny_qwen3_moe(tie=False).save_pretrained(model_dir)
    llm = tiny_cpu_llm(model_dir, weight_transfer_config={"backend": "lora_merge"})
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))

    def largest_error(reference: torch.Tensor) -> float:
        outputs = llm.generate(
            [{"prompt_token_ids": row.tolist()} for row in tokens],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False,
        )
        served = torch.tensor(
            [
                [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], row[1:].tolist())]
                for out, row in zip(outputs, tokens)
            ]
        )
        return (served - reference).abs().max().item()  # NaN never within a bound

    trainer = LoraMergeTrainer.connect(llm, rank=0)
    first, second = policy(model_dir, seed=1), policy(model_dir, seed=2)
    expected_first = hf_logprobs(copy.deepcopy(first).merge_and_unload(), tokens)
    expected_second = hf_logprobs(copy.deepcopy(second).merge_and_unload(), tokens)
    with first.disable_adapter():
        base = hf_logprobs(first, tokens)
    embedding_only = copy.deepcopy(first)
    with torch.no_grad():
        for name, param in embedding_only.named_parameters():
            if "lora_B" in name:  # every LoRA but the embedding's (whose factors are lora_embedding_*)
                param.zero_()
    embedding_effect = (hf_logprobs(embedding_only.merge_and_unload(), tokens) - base).abs().max().item()
    result = dict(
        base_error=largest_error(base),
        lora_effect=(expected_first - base).abs().max().item(),
        embedding_lora_effect=embedding_effect,
    )
    stats = trainer.send_weights(first, weight_version="1")
    result["first_error"] = largest_error(expected_first)
    trainer.send_weights(second, weight_version="2")
    result["second_error"] = largest_error(expected_second)
    result["weight_version"] = llm.get_weight_version()
    result["sync_delta_kept"] = stats.get("sync_delta_kept")
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
