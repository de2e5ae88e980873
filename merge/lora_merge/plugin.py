"""The ``vllm.general_plugins`` entry point of the ``lora_merge`` backend (pyproject.toml: ``lora_merge =
"merge.lora_merge.plugin:register"``), which ``vllm serve`` and ``LLM`` load in every process."""

from __future__ import annotations

from merge.lora_merge.wire import BACKEND


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend in both of vLLM's factories (idempotent:
    vLLM loads general plugins once per process, in every process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "merge.lora_merge.worker", "LoraMergeWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "merge.lora_merge.trainer", "LoraMergeTrainer")
