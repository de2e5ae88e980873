"""The ``lora_merge`` vLLM weight-transfer backend: the trainer sends the LoRA factors, the engine merges them.

A separate ``vllm serve`` (or an in-process ``LLM``) started with ``--weight-transfer-config '{"backend":
"lora_merge"}'`` (the backend is known to vLLM through the ``vllm.general_plugins`` entry point, `plugin.register`)
keeps a pristine copy of the base weights the adapter changes, receives only the LoRA factors at each update and
serves ``W_base + scale * B @ A``, merged in fp32 and reloaded layer-wise: always the base plus the latest update,
never an accumulation of earlier ones. A trainer that dies mid-update leaves the server on its last complete version.

Trainer side (``LoraMergeTrainer``, every trainer rank calls ``send_weights``)::

    trainer = LoraMergeTrainer.connect("http://127.0.0.1:8000", rank=rank)
    stats = trainer.send_weights(peft_model, weight_version="3")   # a collective under FSDP2

The modules, by side: `wire` (the torch.distributed group between the trainer's rank 0 and the server's workers, the
waits that fail fast when the other side is gone, the replies), `update` (what travels: the factors in checkpoint
names, packed into flat buffers), `worker` (the engine worker's side: pristine base, buffering, merge, reload),
`shards` (each worker's tensor/expert-parallel shard of the pristine base, the chunked merge, the room they need),
`trainer` (the trainer's side: vLLM's RL routes, ``send_weights``) and `plugin` (the registration).
"""

from merge.lora_merge.plugin import register
from merge.lora_merge.trainer import LoraMergeTrainer, LoraMergeTrainerInitInfo
from merge.lora_merge.update import LoraUpdate, full_update, lora_update
from merge.lora_merge.wire import BACKEND, WeightTransferError
from merge.lora_merge.worker import LoraMergeInitInfo, LoraMergeUpdateInfo, LoraMergeWeightTransferEngine

__all__ = [
    "BACKEND",
    "register",
    "WeightTransferError",
    "LoraMergeTrainer",
    "LoraMergeTrainerInitInfo",
    "LoraMergeWeightTransferEngine",
    "LoraMergeInitInfo",
    "LoraMergeUpdateInfo",
    "LoraUpdate",
    "lora_update",
    "full_update",
]
