"""vllm.mode=server: one real ``vllm serve`` subprocess with the ``lora_merge`` backend, shared by this module.

The served log-probs after a push are those of peft's ``merge_and_unload()`` model; a second push leaves no trace of
the first; a trainer killed between /start_weight_update and /finish_weight_update leaves the server on the
previous complete version; a trainer rank killed during a sync of the recipe leaves the server serving its last
complete version, and the run resumed against the same server ends as an uninterrupted run. MoE expert LoRA and
LoRA on embeddings: an in-process ``LLM`` with the same backend (tests/lora_merge_moe_worker.py), cheaper than a
second server. lora.merge=false, one test with a second server of its own (vLLM's LoRA serving): the served
log-probs after a load are the peft model's, and a second load replaces the first adapter, name and weights.
"""

import contextlib
import copy
import functools
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from bench_common import free_port, serve, wait_until_up
from recipe_runs import launch, read_metrics
from torchrun import WORKER_ENV, figures_of, torchrun

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Q: 3+4=?\nA:", "Q: 12+30=?\nA:", "Q: 7+7=?\nA:"]
# |served - merge_and_unload()| over sampled tokens, fp32. Sampling at temperature 1 picks rare tokens whose large
# logits carry the absolute error of vLLM's GEMMs against torch's: 3e-7..9.5e-7 mean and 1e-6..5e-5 at the worst
# token from one server launch to the next (AVX2 and CI machines). Leaving one layer unmerged errs by 3e-2 mean.
SERVED_MEAN, SERVED_LARGEST = 2e-6, 1e-4


@contextlib.contextmanager
def serving(model: str, log_path: Path, **options):
    """A ``vllm serve`` subprocess on ``model`` (`bench_common.serve`), small enough for the tests; yields (url,
    model path) once it answers, stops it after."""
    proc, url = serve(
        model,
        log_path,
        kv_cache_bytes=64 * 2**20,
        max_num_seqs=16,
        max_num_batched_tokens=8192,
        fork_engine=True,
        **options,
    )
    try:
        wait_until_up(proc, url, log_path)
        yield url, model
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """``vllm serve`` on the embedded model with the lora_merge backend; yields (url, model path)."""
    with serving(tiny_model, tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


def policy(model_dir: str, seed: int):
    """The embedded model with a rank-8 LoRA on every linear projection, its lora_B drawn from ``seed``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def reference_logprobs(model, samples) -> torch.Tensor:
    """The sampled tokens' log-probs under ``model`` (temperature 1), every sample's, concatenated."""
    references = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
            references.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0])
    return torch.cat(references)


def served_vs(engine, reference) -> tuple[float, float, list]:
    """(mean, max) |served - ``reference`` model| over the log-probs of tokens the server samples, and the samples."""
    from vllm import SamplingParams

    prompt_ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    samples = engine.generate(prompt_ids, SamplingParams(n=2, temperature=1.0, max_tokens=24, logprobs=0))
    served = torch.tensor([logprob for s in samples for logprob in s.logprobs])
    errors = (served - reference_logprobs(reference, samples)).abs()
    return errors.mean().item(), errors.max().item(), samples


def served_vs_merged(engine, peft_model) -> tuple[float, float, list]:
    """(mean, max) |served - merge_and_unload()| over the sampled tokens' log-probs, and the samples."""
    return served_vs(engine, copy.deepcopy(peft_model).merge_and_unload())


def test_push_serves_merge_and_unload_and_a_second_push_leaves_no_trace(server):
    from grpo.engines.server import ServerEngine
    from merge.lora_merge import LoraMergeTrainer

    url, model_dir = server
    engine = ServerEngine(url, model_dir)
    first, second = policy(model_dir, seed=1), policy(model_dir, seed=2)
    metrics = engine.sync_policy(first, None, version=1, rank=0)
    mean, largest, samples = served_vs_merged(engine, first)
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)
    assert sum(len(s.completion_ids) for s in samples) > 10
    base_bytes = sum(p.numel() * 4 for n, p in first.named_parameters() if "lora_" not in n)
    assert 0 < metrics["sync_bytes"] < 0.2 * base_bytes  # the factors, not the model
    assert not any(name.startswith("sync_delta_") for name in metrics)  # fp32: the recipe measures no precision

    # a trainer asking for the precision figures gets them from the workers (fp32: nothing lost in the cast)
    engine.transfer = LoraMergeTrainer.connect(url, rank=0, precision_stats=True)
    metrics = engine.sync_policy(second, None, version=2, rank=0)
    assert metrics["sync_delta_kept"] == pytest.approx(1.0, abs=1e-6)
    mean, largest, _ = served_vs_merged(engine, second)
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)
    assert requests.get(f"{url}/weight_info").json()["weight_version"] == "2"
    engine.close()


def test_a_weight_version_never_reads_blocks_another_cached_while_the_unsalted_control_does(server):
    """The salt alone, with no /pause between the versions to clear the cache (a sync clears it as well)."""
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine

    url, model = server
    engine = ServerEngine(url, model)
    prompt = [8 + i % 50 for i in range(150)]  # more than one 128-token block
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=4, logprobs=0)

    def cached_tokens(version: str, salt: str | None = None) -> int:
        requests.post(f"{url}/update_weight_version", json={"new_version": version}).raise_for_status()
        engine.version = version  # a label only: the weights and the cache stay
        if salt is None:
            pending = engine.send([prompt], sampling)
            engine.receive(pending)
            return pending.cached_tokens[0]
        body = dict(token_ids=prompt, model=engine.served_name, cache_salt=salt, sampling_params={"max_tokens": 1})
        reply = requests.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        assert cached_tokens("1") == 0
        version_1 = engine.cache_salt()
        assert cached_tokens("1") == 128  # one version's requests share their blocks
        assert cached_tokens("2") == 0  # the next version's salt reaches none of them
        assert cached_tokens("2", salt=version_1) == 128  # the control: they are still there, under version 1's salt
    finally:
        engine.close()


@pytest.fixture
def lora_server(tiny_model, tmp_path):
    """``vllm serve`` on the embedded model with vLLM's LoRA serving (lora.merge=false); yields (url, model path).
    Function-scoped: one test uses it, and it stops as soon as that test ends."""
    with serving(tiny_model, tmp_path / "lora_server.log", lora_rank=8) as running:
        yield running


def test_adapter_mode_serves_the_peft_model_and_each_load_replaces_the_last(lora_server, tmp_path):
    """lora.merge=false: the saved adapter, loaded with /v1/load_lora_adapter, samples what the peft model computes.

    The reference is the unmerged peft model: vLLM's LoRA computes ``x W + (x A) (scale B)`` in fp32 (scale = 2 folded
    into B exactly; its CPU punica ops, vllm/lora/ops/torch_ops, run in the activations' dtype), as peft does.
    merge_and_unload() rounds ``W + scale B A`` into one fp32 weight instead, which alone moves these log-probs by up
    to 7.6e-6 (mean 8.9e-7) and would leave no margin under the bounds of the lora_merge test.
    """
    from grpo.engines.server import ServerEngine

    url, model_dir = lora_server
    engine = ServerEngine(url, model_dir, merge=False)
    first, second = policy(model_dir, seed=1), policy(model_dir, seed=2)
    adapter_dir = tmp_path / "adapter"
    engine.sync_policy(first, adapter_dir, version=1, rank=0)
    mean, largest, samples = served_vs(engine, first)  # generate checks every completion's weight version
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)
    assert sum(len(s.completion_ids) for s in samples) > 10
    served = torch.tensor([logprob for s in samples for logprob in s.logprobs])
    with first.disable_adapter():  # the agreement is not trivial: the adapter moves the log-probs far more
        assert (served - reference_logprobs(first, samples)).abs().mean() > 0.1

    engine.sync_policy(second, adapter_dir, version=2, rank=0)  # the same folder, rewritten
    mean, largest, _ = served_vs(engine, second)
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)
    assert requests.get(f"{url}/weight_info").json()["weight_version"] == "2"
    adapters = [m["id"] for m in requests.get(f"{url}/v1/models").json()["data"] if m["parent"]]
    assert adapters == ["policy-2"]  # the first adapter was unloaded
    engine.close()

    resumed = ServerEngine(url, model_dir, merge=False)  # a run resumed after a kill: it never saw policy-2
    resumed.sync_policy(first, adapter_dir, version=3, rank=0)
    adapters = [m["id"] for m in requests.get(f"{url}/v1/models").json()["data"] if m["parent"]]
    assert adapters == ["policy-3"]  # the killed run's adapter was unloaded too
    resumed.close()


KILLED_TRAINER = textwrap.dedent("""
    import os, signal, sys
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import asdict
    from merge.lora_merge import LoraMergeTrainer, LoraMergeUpdateInfo
    from merge.lora_merge.wire import broadcast
    from test_server_mode import policy

    url, model_dir = sys.argv[1], sys.argv[2]
    update = __import__("merge.lora_merge", fromlist=["lora_update"]).lora_update(policy(model_dir, seed=3))
    trainer = LoraMergeTrainer.connect(url, rank=0)
    entries, buffers = update.packed()
    sizes = {dtype: b.numel() for dtype, b in buffers.items()}
    trainer._connect(update.shapes, sizes, sum(b.numel() * b.element_size() for b in buffers.values()))
    trainer.client.start_weight_update()
    call = ThreadPoolExecutor(1).submit(trainer.client.update_weights, asdict(LoraMergeUpdateInfo(
        entries=entries, buffers=sizes)))
    for buffer in buffers.values():  # every factor arrives: only /finish_weight_update is missing
        broadcast(trainer.group, buffer).wait()
    call.result()
    print("KILLED BEFORE FINISH", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_trainer_killed_between_start_and_finish_leaves_the_previous_version(server):
    from grpo.engines.server import ServerEngine

    url, model_dir = server
    engine = ServerEngine(url, model_dir)
    complete = policy(model_dir, seed=4)
    engine.sync_policy(complete, None, version=10, rank=0)
    engine.close()
    env = {**os.environ, "PYTHONPATH": WORKER_ENV["PYTHONPATH"]}  # the script imports this module
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, url, model_dir], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9 and "KILLED BEFORE FINISH" in killed.stdout, killed.stderr[-3000:]

    engine = ServerEngine(url, model_dir)
    engine.version = "10"  # what the server must still serve
    mean, largest, _ = served_vs_merged(engine, complete)
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)
    # a new trainer takes over: the leftovers of the killed one are discarded, its own push lands
    engine.sync_policy(policy(model_dir, seed=5), None, version=11, rank=0)
    assert requests.get(f"{url}/weight_info").json()["weight_version"] == "11"
    engine.close()


def deterministic(line: dict) -> dict:
    """A metrics.jsonl line less what depends on the clock or the machine (timings, throughputs, memory)."""
    return {k: v for k, v in line.items() if not k.endswith(("_s", "_per_s")) and not k.startswith("peak_mem")}


def differences(got: dict, want: dict) -> dict:
    """Keys whose values differ: integers, flags and the rewards of the samples exactly; other floats beyond 1e-5
    relative. The server's log-probs of the same tokens differ in the last bits with how it batches the two ranks'
    requests (4e-8 on the IS ratio), and through the IS correction so do the loss and ratios (1e-9 relative)."""
    exact = ("reward_mean", "reward_std", "rollout_tokens")
    return {
        k: (got.get(k), v)
        for k, v in want.items()
        if not (
            got.get(k) == v
            or (isinstance(v, float) and k not in exact and abs(got.get(k, float("nan")) - v) <= 1e-5 * max(1, abs(v)))
        )
    }


def test_trainer_rank_killed_during_a_sync_resumes_exactly_against_the_same_server(server, tmp_path):
    """The recipe on 2 ranks, 3 rollout steps, a checkpoint after each. Rank 0 SIGKILLed in rollout step 3's sync
    while the server waits for the factors: the server keeps serving version 2, unpaused. The run resumed from its
    last checkpoint against the same server re-syncs before its first rollout (server-side seeds come from the
    checkpointed RNG), and its metrics equal an uninterrupted run's, every deterministic key of every line."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from grpo.engines.server import ServerEngine

    url, model_dir = server
    overrides = [
        "vllm.mode=server",
        f"vllm.server_url={url}",
        "save_steps=2",
        "reward_funcs=[faulty_rewards:exact_answer_then_sigkill_rank0_in_sync]",
    ]
    reference, expected = launch(tmp_path / "uninterrupted", model_dir, *overrides)
    assert reference.returncode == 0, reference.stderr[-5000:]

    out = tmp_path / "killed"
    killed, _ = launch(out, model_dir, *overrides, env={"SIGKILL_RANK0_IN_SYNC": "2"})
    assert killed.returncode != 0 and "SIGKILL rank 0 in the weight sync" in killed.stdout, killed.stderr[-5000:]
    with safe_open(out / "run" / "checkpoint-2" / "adapter_model.safetensors", "pt") as adapter:
        factor_bytes = sum(math.prod(adapter.get_slice(k).get_shape()) * 4 for k in adapter.keys())  # fp32
    assert [m["sync_bytes"] for m in expected] == [factor_bytes] * 3  # every sync sends the factors, only them
    assert [m["rollout_step"] for m in read_metrics(out)] == [1, 2]
    assert requests.get(f"{url}/weight_info").json()["weight_version"] == "2"
    assert requests.get(f"{url}/is_paused").json()["is_paused"] is False
    # version 2 is the policy after rollout step 1: checkpoint-2's adapter, merged
    engine = ServerEngine(url, model_dir)
    engine.version = "2"
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mean, largest, _ = served_vs_merged(engine, PeftModel.from_pretrained(base, str(out / "run" / "checkpoint-2")))
    engine.close()
    # trained weights, against transformers' own forward of merge_and_unload() (one sequence at a time, not the
    # recipe's packed forward): 1.12e-6 mean on an AVX2 machine; single tokens of the recipe's own fp32 runs are up
    # to 3.8e-5 off (rollout_logprob_diff_max). The recipe's fp32 figure (<= 1e-6) is asserted on its metrics below.
    assert mean <= SERVED_MEAN and largest <= SERVED_LARGEST, (mean, largest)

    resumed, metrics = launch(out, model_dir, *overrides, "resume_from_checkpoint=last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "continuing at rollout step 3 of 3" in resumed.stderr
    assert requests.get(f"{url}/weight_info").json()["weight_version"] == "3"  # its own push, numbered as before
    # fidelity on every step, before and after the resume: what vLLM sampled is what the trainer scores
    assert [m["rollout_step"] for m in metrics] == [1, 2, 3]
    assert max(m["rollout_logprob_diff_mean"] for m in metrics) <= 1e-6, metrics
    assert [m["ratio_onpolicy_maxdev"] for m in metrics] == [0.0, 0.0, 0.0]
    got, want = [deterministic(m) for m in metrics], [deterministic(m) for m in expected]
    print(f"compared {sum(len(line) for line in want)} keys x lines ({len(want)} lines)")
    assert len(want) == 3 and len(want[0]) > 20
    assert [line.keys() for line in got] == [line.keys() for line in want]
    assert [differences(g, w) for g, w in zip(got, want)] == [{}, {}, {}]


def test_moe_expert_and_embedding_lora_merge_in_process(engine_workers):
    """tests/lora_merge_moe_worker.py: an in-process LLM with the backend, LoRA on attention, experts, embeddings."""
    errors = figures_of(engine_workers, "lora_merge_moe_worker.py")
    assert errors["base_error"] <= 1e-5  # the engine computes what the trainer computes
    assert errors["lora_effect"] > 0.1 and errors["embedding_lora_effect"] > 0.01  # the agreement is not trivial
    assert errors["first_error"] <= 1e-5
    assert errors["second_error"] <= 1e-5  # nothing of the first push is left
    assert errors["weight_version"] == "2"


def test_a_sync_that_fails_part_way_leaves_the_previous_version_served(engine_workers):
    """tests/lora_merge_fault_worker.py: a fault after 3 reloaded tensors of an update. The engine serves the previous
    update again, bit for bit, with no parameter on the meta device; the control (no restore) leaves some on meta.
    A fault inside vLLM's per-layer reload leaves every parameter in its own storage (``data_ptr()``)."""
    figures = figures_of(engine_workers, "lora_merge_fault_worker.py")
    assert "injected fault" in figures["error_True"] and "serves the previous version again" in figures["error_True"]
    assert len(figures["reloaded_before_fault"]) == 3  # the fault came part-way through the reload
    assert figures["on_meta_True"] == [] and figures["after_fault_vs_first"] == 0.0
    assert figures["weight_version_after_fault"] == "1"
    assert figures["second_vs_first"] > 1e-3  # the failed update would have changed what is served
    assert "the server's weights are incomplete" in figures["error_False"] and figures["on_meta_False"]
    # vLLM's warning for every layer a sync does not reload stays out of the server's log (the control logs them)
    assert figures["failed_to_load_logged"] == 0 and figures["failed_to_load_unfiltered"] > 5, figures
    # a fault inside vLLM's own layer reload: every parameter keeps its storage, the previous version is served
    assert "injected out-of-memory" in figures["reload_error_True"]
    assert figures["reload_moved_True"] == [] and figures["reload_on_meta_True"] == []
    assert figures["reload_vs_before_True"] == 0.0 and figures["reload_version_True"] == "1"
    # control: vLLM's finalize keeps the failing layer's temporaries, while the restore reports success
    assert figures["reload_moved_False"] and "serves the previous version again" in figures["reload_error_False"]


def test_a_bf16_server_serves_the_unmerged_peft_model_from_bf16_factors(engine_workers):
    """tests/lora_merge_bf16_worker.py: a bf16 in-process engine, the factors sent in bf16 (half the fp32 bytes) and
    merged in fp32. Served log-probs against the unmerged peft model at the precision the server holds: within
    bf16's rounding of the merged weights after the push; the control (before it) is far off."""
    figures = figures_of(engine_workers, "lora_merge_bf16_worker.py")
    assert figures["sync_bytes"] * 2 == figures["fp32_factor_bytes"]
    assert figures["after_mean"] <= 5e-3 and figures["after_max"] <= 5e-2, figures
    assert figures["before_mean"] > 20 * figures["after_mean"], figures  # the push is what makes them agree
    assert figures["sync_delta_kept"] == pytest.approx(1.0, abs=0.01)  # bf16's cast keeps the update


def test_an_fp16_server_refuses_merged_weights_past_fp16s_range():
    """The worker's merge checks each merged float16 tensor before it is reloaded (a failure restores the previous
    version, as above)."""
    from types import SimpleNamespace

    from merge.lora_merge import LoraMergeWeightTransferEngine, WeightTransferError

    engine = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float16), device=torch.device("cpu"), base={"w": torch.ones(4, 4)}
    )

    def merge(scale: float):  # W = 1 everywhere, B @ A = 1 everywhere (B: 4 x 1, A: 1 x 4 of ones)
        entry = dict(target="w", kind="lora", scale=scale, transpose=False, b=["float32", 0, [4, 1]])
        entry["a"] = ["float32", 4, [1, 4]]
        return list(LoraMergeWeightTransferEngine._merged(engine, [entry], {"float32": torch.ones(8)}, None))

    [(name, merged)] = merge(1.0)  # the control: 2 everywhere
    assert name == "w" and merged.dtype == torch.float16 and bool((merged == 2).all())
    with pytest.raises(WeightTransferError, match="the merged w holds 16 inf/NaN entries in float16"):
        merge(1e5)


class FakeServer:
    """An HTTP server answering the routes `check_server` probes, as a vLLM server would; ``backend``:
    whether /collective_rpc finds a weight-transfer engine. ``generate_delay``: seconds a generation takes (None:
    it never answers, as on a server whose engine is gone); ``health``: what /health answers (None: nothing)."""

    def __init__(self, backend: bool, generate_delay: float | None = 0.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.health: int | None = 200
        self.paused = threading.Event()  # vLLM's /pause, /resume, /is_paused: a paused server holds generations
        self.server_info = {  # /server_info's settings, as a server started by serve_command reports them (its
            # prefix cache aside: test_a_prefix_cache_is_accepted_only_where_it_honours_the_salt_every_request_carries)
            "model_config": {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32", "max_model_len": 256},
            "cache_config": {"enable_prefix_caching": False},
        }
        self.posts: list[str] = []  # every POST's path and query, in order
        self.routed: dict[tuple, str | None] = {}  # each generation's token ids: its X-data-parallel-rank header
        # with prefix caching on: whether the cache keys blocks by cache_salt ("salted") or not ("unsalted"), and
        # whether a reply reports its cached tokens
        self.cache_keys, self.reports_cached_tokens, self.cached = "salted", True, set()
        self.released = threading.Event()  # lets the requests left hanging go at stop()
        self.generating = threading.Semaphore(0)  # released once per generation request received
        self.health_probes, self.generations_now, self.generations_most = 0, 0, 0
        self.counting = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    with fake.counting:
                        fake.health_probes += 1
                if self.path == "/health" and fake.health != 200:
                    if fake.health is None:
                        fake.released.wait()
                    return self.reply(fake.health or 503, {})
                answers = {
                    "/is_paused": {"is_paused": fake.paused.is_set()},  # vLLM 0.32's rl/online/api_router.py
                    "/v1/models": {"data": [{"id": "served"}]},
                    "/get_world_size": {"world_size": 1},
                    "/server_info": {"vllm_config": fake.server_info},
                }
                self.reply(200, answers.get(self.path.split("?")[0], {}))

            def do_POST(self):
                fake.posts.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/collective_rpc":
                    self.reply(200 if backend else 500, {})
                elif self.path.startswith("/pause"):
                    fake.paused.set()
                    self.reply(200, {"status": "paused"})
                elif self.path == "/resume":
                    fake.paused.clear()
                    self.reply(200, {"status": "resumed"})
                elif self.path == "/inference/v1/generate":
                    if "token_ids" not in body:
                        self.reply(422, {})
                        return
                    fake.routed[tuple(body["token_ids"])] = self.headers.get("X-data-parallel-rank")
                    while fake.paused.is_set() and not fake.released.wait(0.05):
                        pass  # queued until /resume, as vLLM's engine holds a request that arrives while paused
                    fake.generating.release()
                    with fake.counting:
                        fake.generations_now += 1
                        fake.generations_most = max(fake.generations_most, fake.generations_now)
                    fake.released.wait(generate_delay)  # None: until stop()
                    with fake.counting:
                        fake.generations_now -= 1
                    key = (tuple(body["token_ids"]), body.get("cache_salt") if fake.cache_keys == "salted" else None)
                    cached, _ = (len(body["token_ids"]) - 1 if key in fake.cached else 0), fake.cached.add(key)
                    usage = {"prompt_tokens_details": {"cached_tokens": cached}} if fake.reports_cached_tokens else {}
                    if not fake.released.is_set():  # one completion, sampled from weight version "7"
                        self.reply(
                            200,
                            {
                                "usage": usage,
                                "choices": [
                                    {
                                        "index": 0,
                                        "token_ids": [5, 6],
                                        "finish_reason": "length",
                                        "logprobs": {
                                            "content": [
                                                {"token_id": 5, "logprob": -1.0},
                                                {"token_id": 6, "logprob": -2.0},
                                            ]
                                        },
                                        "weight_versions": [{"version": "7", "start": 0, "end": 2}],
                                    }
                                ],
                            },
                        )
                else:
                    self.reply(200, {})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda request, address: None  # a reply to a client that went away: expected
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop_listening(self):
        """What a front end told to shut down does: new connections are refused, open ones stay open."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def stop(self):
        self.stop_listening()
        self.released.set()


def test_unreachable_server_and_server_without_the_backend_are_one_line_each():
    from grpo.engines.server import ServerError, check_server

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match="no vLLM server answers") as caught:
        check_server(url, "cache/tiny-qwen3-gsm8k")
    message = str(caught.value)
    assert url in message and "--weight-transfer-config" in message and "\n" not in message
    fake = FakeServer(backend=False)
    try:
        with pytest.raises(ServerError, match="has no weight-transfer backend") as caught:
            check_server(fake.url, "cache/tiny-qwen3-gsm8k")
        assert '--weight-transfer-config \'{"backend": "lora_merge"}\'' in str(caught.value)
        check_server(fake.url, "cache/tiny-qwen3-gsm8k", merge=False)  # LoRA serving needs none
    finally:
        fake.stop()


def test_a_server_whose_settings_differ_from_the_runs_is_refused_naming_each_flag():
    from grpo.engines.server import ServerError, check_server_settings

    fake = FakeServer(backend=True)
    try:
        check_server_settings(fake.url, "m", dtype="float32", max_model_len=160)  # the control: all match
        fake.server_info["model_config"].update(
            logprobs_mode="raw_logprobs", dtype="torch.bfloat16", quantization="fp8", max_model_len=128
        )
        fake.server_info["cache_config"].update(enable_prefix_caching=True, block_size=16)
        fake.cache_keys = "unsalted"
        fake.server_info["parallel_config"] = {"data_parallel_size": 2, "data_parallel_hybrid_lb": True}
        with pytest.raises(ServerError, match="cannot serve this run") as caught:
            check_server_settings(fake.url, "m", dtype="float32", max_model_len=160)
        message = str(caught.value)
        flags = ("processed_logprobs", "ignores cache_salt", "--dtype float32", "fp8", "--max-model-len 160")
        flags += ("--data-parallel-hybrid-lb",)
        assert all(flag in message for flag in flags), message
        assert fake.url in message and "\n" not in message
    finally:
        fake.stop()


def test_a_prefix_cache_is_accepted_only_where_it_honours_the_salt_every_request_carries():
    from grpo.engines.server import ServerError, check_server_settings

    fake = FakeServer(backend=True)
    fake.server_info["cache_config"].update(enable_prefix_caching=True, block_size=16)
    check = functools.partial(check_server_settings, fake.url, "m", dtype="float32", max_model_len=160)
    try:
        check()  # keyed by salt and reporting cached tokens: accepted
        assert fake.posts.count("/inference/v1/generate") == 3
        fake.cache_keys = "unsalted"  # one salt's blocks serve another's prompt
        with pytest.raises(ServerError, match=r"ignores cache_salt \(16 of a 17-token prompt .*--no-enable-prefix"):
            check()
        fake.cache_keys, fake.reports_cached_tokens = "salted", False  # cannot tell
        with pytest.raises(ServerError, match="--enable-prompt-tokens-details"):
            check()
        fake.reports_cached_tokens = True
        with pytest.raises(ServerError, match="TRL's requests carry no cache_salt"):  # the TRL recipe's check
            check(salted=False)
        check(max_model_len=17)  # no prompt can fill a block: nothing is ever cached, nothing to ask
        assert fake.posts.count("/inference/v1/generate") == 9
    finally:
        fake.stop()


def test_a_server_left_paused_is_resumed_at_start_up_before_the_cache_probe(caplog):
    """A trainer stopped while it held a weight update's pause leaves the server paused; the next run's start-up
    finds it so (/is_paused), resumes it and logs it, and the cache-salt probe then answers. The control: a server
    that is not paused is not resumed."""
    from grpo.engines.server import check_server, check_server_settings

    fake = FakeServer(backend=True)
    fake.server_info["cache_config"].update(enable_prefix_caching=True, block_size=16)
    check = functools.partial(check_server_settings, fake.url, "m", dtype="float32", max_model_len=160)
    try:
        check()
        assert "/resume" not in fake.posts and "was paused" not in caplog.text
        requests.post(f"{fake.url}/pause", params={"mode": "keep"}, timeout=10)
        check_server(fake.url, "m")
        # on a paused server each probe request would wait out its 120 s
        ThreadPoolExecutor(1).submit(check).result(timeout=60)
        assert not fake.paused.is_set() and fake.posts.count("/resume") == 1
        assert f"the vLLM server at {fake.url} was paused" in caplog.text
        assert fake.posts.count("/inference/v1/generate") == 7  # 3 probes each, and check_server's empty one
    finally:
        fake.stop()


def test_modules_to_save_are_refused_in_server_mode_before_the_server_is_asked():
    from grpo.config import ConfigError, load_config
    from grpo.engines.build import prepare_engine

    overrides = [
        "vllm.mode=server",
        "lora.modules_to_save=[lm_head]",
        f"vllm.server_url=http://127.0.0.1:{free_port()}",
    ]
    cfg = load_config(ROOT / "recipes" / "configs" / "tiny_cpu.yaml", overrides)
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save=\['lm_head'\] would never reach the server"):
        prepare_engine(cfg, rank=0, world=1, device_type="cpu")


@pytest.fixture
def tokenizer_dir(tmp_path):
    from grpo.tasks.tiny_gsm8k import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_rollout_from_another_weight_version_stops_naming_both(tokenizer_dir):
    from vllm import SamplingParams

    from grpo.engines.interface import EngineStateError
    from grpo.engines.server import ServerEngine

    fake = FakeServer(backend=True)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir)
        engine.version = "7"
        [sample] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=0))
        assert sample.completion_ids == [5, 6] and sample.logprobs == [-1.0, -2.0] and sample.truncated
        engine.version = "8"  # the trainer pushed 8; the server answers from 7
        with pytest.raises(EngineStateError, match=r"weight version\(s\) \['7'\], not \['8'\]"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=0))
    finally:
        fake.stop()


def test_the_recipes_server_settings_reach_the_lora_merge_trainer(tokenizer_dir, monkeypatch):
    from grpo.config import load_config
    from grpo.engines.server import ServerEngine
    from merge.lora_merge import LoraMergeTrainer

    sent = []

    def send_weights(trainer, model, weight_version=None):
        sent.append((trainer.init_info, weight_version))
        trainer.last_sync = {"sync_bytes": 1.0}
        return {}

    monkeypatch.setattr(LoraMergeTrainer, "send_weights", send_weights)
    fake = FakeServer(backend=True)
    try:
        overrides = [f"vllm.server_url={fake.url}", f"model.name_or_path={tokenizer_dir}", "model.dtype=bfloat16"]
        cfg = load_config(ROOT / "recipes" / "configs" / "tiny_cpu.yaml", ["vllm.mode=server", *overrides])
        for on_device in (False, True):
            cfg.vllm.server_base_on_device = on_device
            engine = ServerEngine.from_config(cfg, rank=0, world=1, device_type="cpu")
            assert engine.sync_policy(None, None, version=4, rank=0) == {"sync_bytes": 1.0}
            info, version = sent[-1]
            assert info.base_on_device is on_device and version == "4"
            assert (info.wire_dtype, info.transport, info.num_workers, info.master_address) == (
                "bfloat16",
                "gloo",
                1,
                "127.0.0.1",
            )
            engine.close()
    finally:
        fake.stop()


SYNC_ROUTES = ("/pause", "/resume", "/start_weight_update", "/update_weights", "/finish_weight_update")


@pytest.mark.parametrize(
    "pause_mode, data_parallel, paused",
    [("keep", 2, "whole update"), ("keep", 1, "finish"), ("wait", 2, "finish")],
    ids=["async-dp2", "async-dp1", "sync-dp2"],
)
def test_a_data_parallel_server_generating_during_a_sync_is_paused_for_the_whole_update(
    tokenizer_dir, monkeypatch, pause_mode, data_parallel, paused
):
    """A mixture-of-experts server with data parallelism steps its engines in lockstep and takes the update's calls
    between steps: with max_staleness >= 1 (pause mode "keep") it is generating, and one engine in the factors'
    broadcast would wait for good on another in a step's collective. So it is paused before /start_weight_update.
    Controls: without data parallelism, or synchronous (nothing in flight), only /finish_weight_update is paused."""
    from grpo.engines.server import ServerEngine
    from merge.lora_merge import LoraMergeTrainer

    def send_weights(trainer, model, weight_version=None):  # the update's calls, in `LoraMergeTrainer`'s order
        trainer.client.start_weight_update()
        trainer.client.update_weights({"entries": [], "buffers": {}, "round": 1})
        trainer.client.finish_weight_update(weight_version)
        trainer.last_sync = {"sync_bytes": 0.0}
        return {}

    monkeypatch.setattr(LoraMergeTrainer, "send_weights", send_weights)
    fake = FakeServer(backend=True)
    fake.server_info["parallel_config"] = {"data_parallel_size": data_parallel}
    try:
        engine = ServerEngine(fake.url, tokenizer_dir, pause_mode=pause_mode)
        engine.sync_policy(None, None, version=3, rank=0)
        calls = [path for path in fake.posts if path.split("?")[0] in SYNC_ROUTES]
        pause = f"/pause?mode={pause_mode}&clear_cache=true"
        expected = {
            "whole update": [pause, "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"],
            "finish": ["/start_weight_update", "/update_weights", pause, "/finish_weight_update", "/resume"],
        }
        assert calls == expected[paused], calls
    finally:
        fake.stop()


@pytest.mark.parametrize(
    "parallel, engines",
    [
        ({"data_parallel_size": 4}, 4),
        ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_hybrid_lb": True}, 2),
        ({"data_parallel_size": 1}, 1),
    ],
    ids=["dp4", "dp4-hybrid-lb", "dp1"],
)
def test_on_a_data_parallel_server_each_route_goes_to_one_engine(tokenizer_dir, parallel, engines):
    """Six routed requests from trainer rank 1 (routes 0..5, as an episode's prompt index) carry vLLM's
    ``X-data-parallel-rank`` header, (route + 1) mod the engines the front end routes to (data_parallel_size, or
    data_parallel_size_local behind a hybrid load balancer: vLLM refuses a rank outside that range); requests
    without a route carry none, so vLLM balances them. The control, one engine: no header at all."""
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine

    fake = FakeServer(backend=True)
    fake.server_info["parallel_config"] = parallel
    try:
        engine = ServerEngine(fake.url, tokenizer_dir, rank=1)
        engine.version = "7"
        sampling = SamplingParams(max_tokens=2, logprobs=0)
        engine.receive(engine.send([[1, 2, k] for k in range(6)], sampling, routes=list(range(6))))
        engine.receive(engine.send([[3, 4]], sampling))
        want = {(1, 2, k): str((k + 1) % engines) if engines > 1 else None for k in range(6)}
        assert fake.routed == {**want, (3, 4): None}
    finally:
        fake.stop()


def test_server_dying_mid_run_stops_naming_the_url_and_how_to_resume(tokenizer_dir):
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine, ServerError

    fake = FakeServer(backend=True)
    engine = ServerEngine(fake.url, tokenizer_dir)
    engine.version = "3"
    fake.stop()
    with pytest.raises(ServerError, match="resume_from_checkpoint=last") as caught:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, logprobs=0))
    assert fake.url in str(caught.value)


def test_a_wire_error_in_a_sync_reads_as_the_server_gone_when_it_no_longer_answers(tokenizer_dir):
    """Killed mid-sync, the server leaves the trainer gloo's own error ("Connection closed by peer"), not the
    backend's: it stops the run in the one line of a server gone when /health no longer answers, and is raised as
    it is while the server answers (the control)."""
    from grpo.engines.server import ServerEngine, ServerError

    class ClosedPeer:
        def send_weights(self, model, weight_version=None):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32927")

    fake = FakeServer(backend=True)
    engine = ServerEngine(fake.url, tokenizer_dir)
    engine.transfer = ClosedPeer()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as caught:
        engine.sync_policy(None, None, version=2, rank=0)
    assert not isinstance(caught.value, ServerError)
    fake.stop()
    with pytest.raises(ServerError, match="stopped answering during a weight sync; .*resume_from_checkpoint=last"):
        engine.sync_policy(None, None, version=2, rank=0)


def test_a_connection_dropped_once_is_sent_again_with_the_same_seed(tokenizer_dir, monkeypatch):
    """A pooled connection the front end closed just as a request reused it (uvicorn's 5 s keep-alive) fails once:
    the request goes again, seed and all, and the rollout carries on."""
    import requests
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine

    fake = FakeServer(backend=True)
    sent, real_request = [], requests.Session.request

    def drops_the_first_generation(session, method, url, **kwargs):
        if url.endswith("/inference/v1/generate") and "token_ids" in (kwargs.get("json") or {}):
            sent.append(kwargs["json"]["sampling_params"]["seed"])
            if len(sent) == 1:
                raise requests.ConnectionError("('Connection aborted.', RemoteDisconnected())")
        return real_request(session, method, url, **kwargs)

    monkeypatch.setattr(requests.Session, "request", drops_the_first_generation)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir)
        engine.version = "7"
        [sample] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=0))
        assert sample.completion_ids == [5, 6] and len(sent) == 2 and sent[0] == sent[1]
    finally:
        fake.stop()


@pytest.mark.parametrize("failure", ["engine dead (503)", "front end shutting down", "no answer"])
def test_a_wait_on_a_server_that_stops_answering_ends_naming_the_url(tokenizer_dir, monkeypatch, failure):
    """The generation never answers (the engine is gone; a front end shutting down keeps its connections open): the
    health watch ends the wait once /health has failed for server_timeout seconds, with one line naming the URL."""
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine, ServerError
    from merge import server_health

    monkeypatch.setattr(server_health, "HEALTH_PROBE_S", 0.5)
    fake = FakeServer(backend=True, generate_delay=None)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir, server_timeout=2.0)
        engine.version = "7"
        waiting = ThreadPoolExecutor(1).submit(engine.generate, [[1, 2, 3]] * 3, SamplingParams(max_tokens=2))
        assert all(fake.generating.acquire(timeout=60) for _ in range(3))  # the requests are in flight
        if failure == "engine dead (503)":
            fake.health = 503
        elif failure == "no answer":
            fake.health = None
        else:
            fake.stop_listening()
        start = time.monotonic()
        with pytest.raises(ServerError, match="stopped answering while generating") as caught:
            waiting.result(timeout=60)
        assert 2.0 <= time.monotonic() - start < 30
        message = str(caught.value)
        assert fake.url in message and "resume_from_checkpoint=last" in message and "\n" not in message
    finally:
        fake.stop()


def test_a_healthy_server_is_waited_for_past_the_timeout(tokenizer_dir, monkeypatch):
    """The control: a generation slower than server_timeout on a server whose /health answers is not stopped."""
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine
    from merge import server_health

    monkeypatch.setattr(server_health, "HEALTH_PROBE_S", 0.5)
    fake = FakeServer(backend=True, generate_delay=3.0)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir, server_timeout=1.0)
        engine.version = "7"
        samples = engine.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=2, logprobs=0))
        assert [s.completion_ids for s in samples] == [[5, 6]] * 3
    finally:
        fake.stop()


def test_requests_in_flight_stay_within_the_connection_pool(tokenizer_dir, caplog):
    """160 requests sent at once (5 rollouts of 32 prompts) by an engine sized for 128: at most 128 are in flight,
    each on a pooled connection, so urllib3 never discards one ("Connection pool is full"); the rest wait their
    turn. A config's engine is sized for what it sends at once (`max_requests_in_flight`)."""
    from vllm import SamplingParams

    from grpo.config import load_config
    from grpo.engines.server import ServerEngine

    fake = FakeServer(backend=True, generate_delay=0.5)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir)
        engine.version = "7"
        pending = [engine.send([[1, 2, step]] * 32, SamplingParams(max_tokens=2, logprobs=0)) for step in range(5)]
        assert all(len(engine.receive(p)) == 32 for p in pending)
        assert "Connection pool is full" not in caplog.text
        assert fake.generations_most <= 128 and engine.requests.threads == 128
    finally:
        fake.stop()
    from grpo.engines.server import max_requests_in_flight

    cfg = load_config(ROOT / "recipes" / "configs" / "tiny_cpu.yaml", ["vllm.mode=server", "max_staleness=2"])
    rollout = cfg.per_device_train_batch_size * cfg.steps_per_generation
    assert max_requests_in_flight(cfg, world=2) == 3 * rollout + -(-cfg.data.num_eval // 2)


def test_waits_on_the_server_share_one_health_probe(tokenizer_dir, monkeypatch):
    """32 episodes each waiting on a request of their own (as tool episodes do) probe /health together: one probe
    every HEALTH_PROBE_S, not one per wait."""
    from vllm import SamplingParams

    from grpo.engines.server import ServerEngine
    from merge import server_health

    monkeypatch.setattr(server_health, "HEALTH_PROBE_S", 0.25)
    fake = FakeServer(backend=True, generate_delay=2.0)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir)
        engine.version = "7"
        sampling = SamplingParams(max_tokens=2, logprobs=0)
        start, probes_before = time.monotonic(), fake.health_probes
        with ThreadPoolExecutor(32) as pool:
            waits = [pool.submit(engine.generate, [[1, 2, i]], sampling) for i in range(32)]
            assert all(len(wait.result(timeout=60)) == 1 for wait in waits)
        probes, seconds = fake.health_probes - probes_before, time.monotonic() - start
        assert 1 <= probes <= seconds / server_health.HEALTH_PROBE_S + 1, (probes, seconds)
    finally:
        fake.stop()


def test_a_server_gone_during_a_sync_stops_naming_the_url_and_how_to_resume(tokenizer_dir, monkeypatch):
    from grpo.engines.server import ServerEngine, ServerError
    from merge.lora_merge import LoraMergeTrainer

    def send_weights(trainer, model, weight_version=None):  # what the sync's /pause meets on a server gone
        raise requests.ConnectionError("Connection refused")

    monkeypatch.setattr(LoraMergeTrainer, "send_weights", send_weights)
    fake = FakeServer(backend=True)
    try:
        engine = ServerEngine(fake.url, tokenizer_dir)
        with pytest.raises(ServerError, match="stopped answering during a weight sync") as caught:
            engine.sync_policy(None, None, version=3, rank=0)
        assert fake.url in str(caught.value) and "resume_from_checkpoint=last" in str(caught.value)
        assert engine.version is None  # nothing is generated on weights the server may not hold
    finally:
        fake.stop()


def test_a_failure_on_rank_0_during_a_sync_stops_every_rank_within_seconds(tmp_path):
    """tests/server_sync_worker.py, 2 processes: rank 0 raises a plain RuntimeError in its side of a sync (not a
    `ServerError`). Rank 0 raises it; rank 1, waiting for rank 0 in the sync's collective, stops at once with one line
    naming it, instead of waiting out the process group's timeout. Neither takes the version as served. The control,
    the sync before, gives both ranks rank 0's figures."""
    torchrun("server_sync_worker.py", str(tmp_path), ok_marker="sync failure OK", timeout=300)
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["type"] == "RuntimeError" and first["message"].startswith("injected: the TCPStore could not bind")
    assert second["type"] == "SyncError" and "ServerError" in second["bases"]  # the recipe's one-line stop
    expected = "rank 0 failed during the weight sync: RuntimeError: injected: the TCPStore could not bind (address"
    assert second["message"].startswith(expected) and "\n" not in second["message"], second
    assert first["seconds"] < 10 and second["seconds"] < 10, (first, second)
    assert first["version"] == second["version"] == "1"
    # a fresh engine's first sync, rank 1's /get_world_size refused: no rank enters the factors' gather (where rank
    # 0 would wait for rank 1 in FSDP2's all-gathers, rank 1 for rank 0 in the outcome's), both stop with its line
    first, second = (json.loads((tmp_path / f"first_sync_rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["type"] == second["type"] == "ServerError", (first, second)
    assert first["message"] == second["message"] == "GET http://127.0.0.1:1/get_world_size -> 503: injected"
    assert not first["gathered"] and not second["gathered"] and first["version"] is second["version"] is None


def test_a_server_holding_another_model_is_refused_at_the_first_sync_naming_the_tensor(server, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo.engines.server import ServerEngine, ServerError

    url, model_dir = server
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    config.intermediate_size *= 2  # same names, other shapes
    other = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["down_proj"]))
    engine = ServerEngine(url, model_dir)
    with pytest.raises(ServerError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: the server's model"):
        engine.sync_policy(other, None, version=99, rank=0)
    assert requests.get(f"{url}/is_paused").json()["is_paused"] is False  # resumed after the refusal
    engine.close()


def test_an_update_of_an_undeclared_tensor_is_refused_at_once_naming_it_and_the_next_lands(server):
    """The trainer declared q_proj at connect; an update that also names down_proj is refused by the trainer itself,
    naming it; past that check (the trainer's record of its targets bypassed), by the server's worker before any
    byte moves, and the trainer's error names it too, instead of gloo's send timeout. Controls: the declared update
    lands before, and the next one lands after, its version served."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from merge.lora_merge import LoraMergeTrainer, WeightTransferError

    url, model_dir = server

    def adapter(*modules):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return get_peft_model(model, LoraConfig(r=2, target_modules=list(modules)))

    declared, wider = adapter("q_proj"), adapter("q_proj", "down_proj")
    trainer = LoraMergeTrainer.connect(url, rank=0, timeout=20, precision_stats=False)
    try:
        trainer.send_weights(declared, weight_version="declared-1")  # the control
        trainer._refuse_undeclared = lambda shapes, sizes: None  # past the trainer's own check: the worker's
        with pytest.raises(WeightTransferError, match=r"rank 1 failed: .*not declared at init.*down_proj"):
            trainer.send_weights(wider, weight_version="wider")
        assert requests.get(f"{url}/weight_info").json()["weight_version"] == "declared-1"
        trainer.send_weights(declared, weight_version="declared-2")  # the retry
        assert requests.get(f"{url}/weight_info").json()["weight_version"] == "declared-2"
    finally:
        trainer.shutdown()


def test_pristine_base_is_the_checkpoint_in_the_engine_dtype(tiny_model):
    """The base the server merges into is the base it serves and the trainer computes with in the same model.dtype:
    an fp32 checkpoint served in bf16 merges into bf16-rounded W (as the colocated merge does), not into fp32 W."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from merge.lora_merge.base import pristine_base

    checkpoint = load_file(str(Path(tiny_model) / "model.safetensors"))
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert checkpoint[q_proj].dtype == torch.float32
    engine = SimpleNamespace(model=tiny_model, revision=None, dtype=torch.bfloat16)
    base, pinned = pristine_base(engine, {q_proj: list(checkpoint[q_proj].shape)}, torch.device("cpu"))
    assert pinned is None  # no CUDA: nothing pinned
    # q_proj's layer-mates (k, v: vLLM's qkv_proj) come along, each the checkpoint's tensor rounded to bf16
    assert {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"} <= set(base)
    assert all(torch.equal(tensor, checkpoint[name].to(torch.bfloat16)) for name, tensor in base.items())


def test_a_base_in_host_memory_is_pinned_in_one_buffer_of_its_exact_size(tiny_model, monkeypatch):
    """On a CUDA machine the base's tensors are views into one host buffer, pinned where it lies (vLLM's
    ``host_register``, stood in for here: this machine has no CUDA) and unpinned when the trainer goes: its bytes
    are the base's, each start aligned, where torch's ``pin_memory()`` would round each tensor up to a power of two
    (CachingHostAllocator.h). The values are the checkpoint's in the engine's dtype, as without pinning."""
    from types import SimpleNamespace

    import vllm.v1.kv_offload.cpu.host_register as host_register
    from safetensors.torch import load_file

    from merge.lora_merge.base import PIN_ALIGN, pristine_base
    from merge.lora_merge.worker import LoraMergeWeightTransferEngine

    registered, unregistered = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_register, "host_register", lambda ptr, size: registered.append((ptr, size)) or True)
    monkeypatch.setattr(host_register, "host_unregister", lambda ptr: unregistered.append(ptr))
    checkpoint = load_file(str(Path(tiny_model) / "model.safetensors"))
    targets = {f"model.layers.{i}.mlp.down_proj.weight": None for i in range(2)}
    targets = {name: list(checkpoint[name].shape) for name in targets}
    engine = SimpleNamespace(model=tiny_model, revision=None, dtype=torch.bfloat16)
    base, pinned = pristine_base(engine, targets, torch.device("cpu"))
    exact = sum(-(-t.numel() * 2 // PIN_ALIGN) * PIN_ALIGN for t in base.values())
    assert registered == [(pinned.data_ptr(), exact)] and pinned.numel() == exact
    assert all(t.untyped_storage().data_ptr() == pinned.data_ptr() for t in base.values())
    assert all(torch.equal(t, checkpoint[name].to(torch.bfloat16)) for name, t in base.items())
    worker = LoraMergeWeightTransferEngine.__new__(LoraMergeWeightTransferEngine)
    worker.group, worker.transport, worker.pinned = None, "gloo", pinned
    worker.shutdown()
    assert unregistered == [pinned.data_ptr()] and worker.pinned is None


def test_a_quantized_base_is_refused_at_connect_naming_the_tensor(tmp_path):
    """A checkpoint whose targeted weights are not floats (int8/fp8 with scales beside them) cannot take the merge."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from merge.lora_merge import WeightTransferError
    from merge.lora_merge.base import checkpoint_layout

    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    save_file({q: torch.zeros(4, 4), k: torch.zeros(4, 4, dtype=torch.int8)}, str(tmp_path / "model.safetensors"))
    engine = SimpleNamespace(model=str(tmp_path), revision=None, dtype=torch.bfloat16)
    assert set(checkpoint_layout(engine, {q: [4, 4]})) == {q, k}  # the control: a float target merges
    with pytest.raises(WeightTransferError, match=rf"stores {k} as I8 .*serve the unquantized base"):
        checkpoint_layout(engine, {q: [4, 4], k: [4, 4]})


def test_the_checkpoint_is_found_where_vllm_loaded_it_and_other_sources_are_refused(tmp_path, monkeypatch):
    """A model id resolves as vLLM's default loader resolves it, in the server's ``--download-dir`` (before: a
    ``snapshot_download`` of its own, into the default cache, which downloads again or fails offline); a load format
    or a weight source without local safetensors files is refused, naming it. Control: a local directory."""
    from types import SimpleNamespace

    import vllm.model_executor.model_loader.weight_utils as weight_utils
    from safetensors.torch import save_file

    from merge.lora_merge import WeightTransferError
    from merge.lora_merge.base import checkpoint_layout

    q = "model.layers.0.self_attn.q_proj.weight"
    save_file({q: torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    local = SimpleNamespace(model=str(tmp_path), revision=None, dtype=torch.float32, model_weights="")
    assert set(checkpoint_layout(local, {q: [4, 4]})) == {q}  # the control: a local directory, vLLM's defaults
    asked = []

    def download_weights_from_hf(model, cache_dir, allow_patterns, revision, subfolder=None, ignore_patterns=None):
        asked.append((model, cache_dir, allow_patterns, revision, ignore_patterns))
        return str(tmp_path)

    monkeypatch.setattr(weight_utils, "download_weights_from_hf", download_weights_from_hf)
    hub = SimpleNamespace(model="Qwen/Qwen3-4B", revision="main", dtype=torch.float32, model_weights="")
    load = SimpleNamespace(load_format="auto", download_dir="/models", ignore_patterns=["original/**"])
    assert set(checkpoint_layout(hub, {q: [4, 4]}, load)) == {q}
    assert asked == [("Qwen/Qwen3-4B", "/models", ["*.safetensors"], "main", ["original/**"])]
    refusals = [
        (local, SimpleNamespace(load_format="runai_streamer"), "--load-format runai_streamer"),
        (SimpleNamespace(**{**vars(local), "model_weights": "s3://bucket/qwen"}), load, "streams its weights from s3"),
        (SimpleNamespace(**{**vars(local), "model": str(tmp_path / "empty")}), load, "has no safetensors files"),
    ]
    (tmp_path / "empty").mkdir()
    for model_config, load_config, named in refusals:
        with pytest.raises(WeightTransferError, match=named):
            checkpoint_layout(model_config, {q: [4, 4]}, load_config)


def test_memory_plan_in_server_mode_counts_no_vllm_memory_on_training_devices():
    from grpo.config import load_config
    from grpo.memory_plan import memory_plan
    from grpo.qwen3_4b_shape import qwen3_4b_config

    config = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k.yaml"
    colocate = memory_plan(qwen3_4b_config(), load_config(config, []), world=4)
    server = memory_plan(qwen3_4b_config(), load_config(config, ["vllm.mode=server"]), world=4)
    assert colocate["server"] is None and colocate["terms"]["vLLM weights"] > 0
    assert all(server["terms"][name] == 0 for name in ("vLLM weights", "KV cache", "vLLM runtime"))
    assert server["server"]["vLLM weights"] == colocate["terms"]["vLLM weights"]
    # the pristine copy: the targeted blocks (all attention and MLP weights here), less than the whole model
    weights, pristine = server["server"]["vLLM weights"], server["server"]["pristine base (host)"]
    assert 0.5 * weights < pristine < weights
    assert server["phases"]["rollout"] < colocate["phases"]["rollout"]
    on_device = memory_plan(
        qwen3_4b_config(), load_config(config, ["vllm.mode=server", "vllm.server_base_on_device=true"]), world=4
    )
    assert on_device["server"]["pristine base (device)"] == pristine and on_device["terms"] == server["terms"]
