"""The lora_merge server's pristine base in host memory on a CUDA machine: what pinning it costs (<= 1 minute).

    PYTHONPATH=. python bench/gpu_host_pinning.py --out results/gpu_host_pinning.json   # one CUDA GPU, 24 GiB RAM

A server worker (TP=1) keeps the base weights the adapter changes in host memory and copies them to the GPU at each
merge (merge/lora_merge/base.py). It lays them out as views of one buffer (each start 512-byte aligned,
`host_layout`) and pins that buffer where it lies (cudaHostRegister, through vLLM's ``host_register``): exactly its
bytes. torch's pinned allocator (``pin_memory=True``) rounds every allocation up to a power of two. This measures,
at Qwen3-4B's shape with the LoRA of recipes/configs/qwen3_4b_gsm8k.yaml (seven projections, bf16):

  bytes     the base, the one buffer, torch's pinned allocator tensor by tensor (its host_memory_stats) and the
            power-of-two sum that rounding predicts
  copies    host-to-GPU rate of the whole base from the pageable buffer, from the registered buffer
  time      cudaHostRegister of the buffer against pin_memory tensor by tensor

No vLLM is imported (cudaHostRegister is called through torch's cudart), and no weights are read: the values are
zeros, the sizes are the real ones.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_common import write_report

from grpo.config import load_config
from grpo.qwen3_4b_shape import qwen3_4b_config

GIB = 1024**3
CONFIG = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"
PIN_ALIGN = 512  # merge.lora_merge.base.PIN_ALIGN (that module imports vLLM, absent on the GPU kit's machine)


def lora_target_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a lora_merge worker keeps pristine for the LoRA of recipes/configs/qwen3_4b_gsm8k.yaml
    (its target modules in every decoder layer), in checkpoint order, as `merge.lora_merge.base.checkpoint_layout`
    finds them in the files: read off the model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    targets = set(load_config(CONFIG).lora.target_modules)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return {
        name: tuple(param.shape)
        for name, param in model.named_parameters()
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets
    }


def seconds(fn, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(model_config, device: torch.device) -> dict:
    shapes = lora_target_shapes(model_config)
    sizes = {n: torch.Size(s).numel() * 2 for n, s in shapes.items()}  # bf16
    offsets, total = {}, 0
    for name, size in sizes.items():
        offsets[name], total = total, total + -(-size // PIN_ALIGN) * PIN_ALIGN
    buffer = torch.zeros(total, dtype=torch.uint8)  # zeros: every page is faulted in before anything is timed
    views = [buffer[offsets[n] : offsets[n] + sizes[n]].view(torch.bfloat16).view(shapes[n]) for n in shapes]
    targets = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes.values()]

    def copy_all():
        for view, target in zip(views, targets):
            target.copy_(view, non_blocking=True)

    copy_all()  # warm-up
    pageable_s = seconds(copy_all, device)
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    rc = int(cudart.cudaHostRegister(buffer.data_ptr(), total, 0))
    register_s = time.perf_counter() - start
    registered_s = seconds(copy_all, device) if rc == 0 else None
    if rc == 0:
        cudart.cudaHostUnregister(buffer.data_ptr())
    views.clear()
    del buffer
    before = torch.cuda.host_memory_stats()
    start = time.perf_counter()
    one_by_one = [torch.empty(s, dtype=torch.bfloat16, pin_memory=True) for s in shapes.values()]
    pin_memory_s = time.perf_counter() - start
    after = torch.cuda.host_memory_stats()
    del one_by_one
    base = sum(sizes.values())
    return dict(
        tensors=len(shapes),
        base_gib=base / GIB,
        one_buffer_gib=total / GIB,
        power_of_two_gib=sum(1 << (size - 1).bit_length() for size in sizes.values()) / GIB,
        pin_memory_stats_gib={
            k: (after[k] - before.get(k, 0)) / GIB for k in after if "bytes" in k and k.endswith("current")
        },
        cuda_host_register_rc=rc,
        cuda_host_register_s=register_s,
        pin_memory_tensor_by_tensor_s=pin_memory_s,
        copy_gib_per_s=dict(
            pageable=base / GIB / pageable_s, registered=None if registered_s is None else base / GIB / registered_s
        ),
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench/gpu_host_pinning.py needs a CUDA GPU")
    device = torch.device("cuda", 0)
    report = dict(
        command=" ".join(["python", "bench/gpu_host_pinning.py", *(argv if argv is not None else sys.argv[1:])]),
        gpu=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        **measure(qwen3_4b_config(), device),
    )
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
