"""Asynchronous rollouts (max_staleness >= 1) against one real ``vllm serve`` with the ``lora_merge`` backend.

An update lands between two decode steps of a request in flight (pause mode "keep"): its tokens come back labelled
with both versions. The recipe with max_staleness=1, stopped by SIGTERM with requests in flight, leaves no request
running on the server; resumed, it has one row per step, trained on tokens at most one version behind, and the
trainer's log-probs under the factors of the version that sampled each completion equal vLLM's (the fidelity
check). A server that dies stops every rank with one line (the last test: it kills the module's server). Pure parts
(the refusals, the interval arithmetic) need no server.
"""

import json
import os
import re
import signal
import threading
import time

import psutil
import pytest
import requests
import torch
from bench_common import serve, wait_until_up
from recipe_runs import ROOT, forked_launch, launch, read_lines, read_metrics

from grpo.config import ConfigError, load_config
from grpo.engines.rollout_queue import union_seconds
from grpo.policy_versions import PolicyVersions, sampler_log_probs

CONFIG = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["max_staleness=1"], "needs vllm.mode=server"),
        (["max_staleness=1", "vllm.mode=server", "lora.merge=false"], "needs lora.merge=true"),
        (
            ["max_staleness=2", "vllm.mode=server", "vllm_importance_sampling_correction=false"],
            "needs vllm_importance_sampling_correction=true",
        ),
        (["max_staleness=-1"], "max_staleness=-1 is out of range"),
    ],
)
def test_what_asynchronous_rollouts_need_is_refused_in_one_line(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_config(CONFIG, overrides)
    assert load_config(CONFIG, ["max_staleness=1", "vllm.mode=server"]).max_staleness == 1


def test_union_seconds_counts_overlaps_once_and_clips_to_the_window():
    assert union_seconds([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert union_seconds([(0, 2), (1, 3), (5, 6)], 2.5, 5.5) == 1.0
    assert union_seconds([], 0, 1) == 0


def test_the_fidelity_check_scores_each_token_by_the_version_that_sampled_it():
    """Trainer step 3, max_staleness 1: version 3's tokens are scored by the old log-probs on every completion,
    version 2's by a forward on version 2's factors in the first mini-batch (rows 0-2), also in a completion that
    holds both (an update that landed in flight, a sync between two turns); version 0 is older than the bound's
    window (never scored), and row 3's version-2 token lies outside the mini-batch (left out)."""
    versions = torch.tensor([[3, 3, 0], [2, 3, 3], [2, 2, 2], [2, 3, 3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    old = -torch.arange(1, 13, dtype=torch.float32).view(4, 3)
    batch = dict(
        versions=versions,
        response_mask=mask,
        old_logprobs=old,
        attention_mask=torch.cat([torch.ones(4, 2, dtype=torch.long), mask], dim=1),
        input_ids=torch.zeros(4, 5, dtype=torch.long),
    )
    policies = PolicyVersions(torch.nn.Linear(2, 2), keep=1)
    policies.remember(2)
    scored = []

    def score(sub):  # version 2's log-probs of the mini-batch: -100, -101, ...
        scored.append(sub["response_mask"].shape)
        return -100 - torch.arange(sub["response_mask"].numel(), dtype=torch.float32).view_as(sub["response_mask"])

    logps, known = sampler_log_probs(batch, slice(0, 3), policies, rollout_step=3, max_staleness=1, score=score)
    assert scored == [torch.Size([3, 3])]
    assert known.tolist() == [[True, True, False], [True, True, True], [True, True, True], [False, True, True]]
    assert logps[1].tolist() == [-103.0, -5.0, -6.0]  # both versions of one completion, each its own
    assert logps[2].tolist() == [-106.0, -107.0, -108.0] and logps[0, :2].tolist() == [-1.0, -2.0]
    assert logps[3].tolist() == old[3].tolist()


def test_policy_versions_swap_back():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    policies = PolicyVersions(model, keep=1)
    policies.remember(1)
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    policies.remember(2)
    now = model.weight.detach().clone()
    with policies.serving(1):
        assert torch.equal(model.weight, first)
    assert torch.equal(model.weight, now)
    policies.remember(3)  # keeps the last keep + 1 versions: 2 and 3
    assert sorted(policies.saved) == [2, 3]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """``vllm serve`` on the embedded model, lora_merge backend, 4 sequences at a time (generation takes long
    enough for updates to land in flight); yields (process, url, model path)."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    proc, url = serve(
        tiny_model, log_path, kv_cache_bytes=64 * 2**20, max_num_seqs=4, max_num_batched_tokens=8192, fork_engine=True
    )
    try:
        wait_until_up(proc, url, log_path)
        yield proc, url, tiny_model
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def lora_policy(model_dir: str, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def running_requests(url: str, gauge: str = "vllm:num_requests_running") -> float:
    """vLLM's gauge of requests being generated (or of those waiting: ``vllm:num_requests_waiting``), from /metrics."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(gauge + "{"))


def served_prompt_logprobs(url: str, model_dir: str, token_ids: list[int]) -> list[float]:
    """log p(token t | tokens before t) for t >= 1, as the server serves them now (its prompt log-probs)."""
    sampling = dict(max_tokens=1, prompt_logprobs=0, detokenize=False)
    body = dict(token_ids=token_ids, model=model_dir, sampling_params=sampling)
    reply = requests.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()
    return [step[str(token)]["logprob"] for step, token in zip(reply["prompt_logprobs"][1:], token_ids[1:])]


@pytest.mark.parametrize("clear_cache", [True, False])
def test_an_update_lands_between_decode_steps_of_requests_in_flight(server, monkeypatch, clear_cache):
    """Pause mode "keep": four long requests sent under version 1 (as many as the server runs at once) are frozen for
    the sync of version 2 and continue on it; each one's tokens come back labelled 1 then 2 (with mode "wait" they
    would finish on version 1 first). The pause clears the cache: vLLM preempts the requests
    (``vllm:num_preemptions_total``) and prefills them again on version 2, so each token's log-prob is that of the
    version that sampled it, given the whole prefix: checked token by token, every completion, against each version's
    prompt log-probs. The control, a pause that keeps the cache, continues the requests on KV version 1 computed,
    and their tokens after the update match neither version."""
    from merge.lora_merge import LoraMergeTrainer

    _, url, model_dir = server
    trainer = LoraMergeTrainer.connect(url, rank=0, pause_mode="keep")
    if not clear_cache:
        post = trainer.client._post
        monkeypatch.setattr(
            trainer.client, "_pause", lambda: post("/pause", params={"mode": "keep", "clear_cache": "false"})
        )
    policies = {"1": lora_policy(model_dir, seed=1), "2": lora_policy(model_dir, seed=2)}
    prompts = [[1, 2, 3 + i] for i in range(4)]
    replies: list[dict] = [{} for _ in prompts]
    try:
        trainer.send_weights(policies["1"], weight_version="1")

        def long_request(i: int):
            sampling = dict(max_tokens=200, temperature=1.0, seed=i, ignore_eos=True, logprobs=0, detokenize=False)
            body = dict(token_ids=prompts[i], model=model_dir, sampling_params=sampling)
            replies[i].update(requests.post(f"{url}/inference/v1/generate", json=body, timeout=300).json())

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        deadline = time.time() + 60
        while running_requests(url) < len(prompts) and time.time() < deadline:
            time.sleep(0.05)
        preempted = running_requests(url, "vllm:num_preemptions_total")
        trainer.send_weights(policies["2"], weight_version="2")
        for thread in threads:
            thread.join(timeout=300)
        preempted = running_requests(url, "vllm:num_preemptions_total") - preempted
        completions = []
        for prompt, reply in zip(prompts, replies):
            [choice] = reply["choices"]
            sampled = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"]]
            completions.append((prompt, prompt + choice["token_ids"], sampled, spans))
        gaps = [{} for _ in completions]
        for version in policies:  # each version's own log-probs of the tokens it sampled, every completion
            trainer.send_weights(policies[version], weight_version=f"score-{version}")
            for gap, (prompt, tokens, sampled, spans) in zip(gaps, completions):
                served = served_prompt_logprobs(url, model_dir, tokens)[len(prompt) - 1 :]
                for _, begin, end in (span for span in spans if span[0] == version):
                    gap[version] = max(abs(a - b) for a, b in zip(served[begin:end], sampled[begin:end]))
    finally:
        trainer.shutdown()
    print(f"clear_cache={clear_cache}: preempted {preempted:g}, max |sampled - served| per version {gaps}")
    for _, _, sampled, spans in completions:  # every request was in flight when the update landed
        assert [v for v, _, _ in spans] == ["1", "2"] and spans[0][1] == 0 and spans[-1][2] == 200, spans
        assert 0 < spans[0][2] == spans[1][1] < 200 and len(sampled) == 200, spans
    assert all(gap["1"] < 1e-4 for gap in gaps), gaps
    if clear_cache:
        assert preempted >= len(prompts) and all(gap["2"] < 1e-4 for gap in gaps), (preempted, gaps)
    else:
        assert preempted == 0 and all(gap["2"] > 1e-3 for gap in gaps), (preempted, gaps)


def test_abort_in_flight_drops_this_engines_requests_on_the_server(server):
    """`ServerEngine.abort_in_flight` (what close() does first) names the requests as vLLM 0.32 does
    (``generate-tokens-<id>``): the server drops them at once, running and queued alike."""
    from vllm import SamplingParams

    from grpo.engines.interface import EngineStateError
    from grpo.engines.server import ServerEngine

    _, url, model_dir = server
    engine = ServerEngine(url, model_dir)
    engine.version = "0"
    # 128 requests of 250 tokens each (no end of sequence stops them), 4 at a time: 8,000 decode steps, far more than
    # the 8 s the control waits could hold on any CPU (the server's max_model_len is 256)
    pending = engine.send([[1, 2, 3]] * 128, SamplingParams(n=1, max_tokens=250, logprobs=0, ignore_eos=True))
    deadline = time.time() + 60
    while running_requests(url, "vllm:num_requests_waiting") < 1 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(8)
    assert not all(future.done() for future in pending.futures)  # the control: left alone, they go on
    assert running_requests(url) >= 1 and engine.in_flight  # 4 at a time: the rest wait in the server's queue
    engine.abort_in_flight()
    deadline = time.time() + 8  # answered because aborted: generating them would take twice that or more
    while not all(future.done() for future in pending.futures) and time.time() < deadline:
        time.sleep(0.1)
    assert running_requests(url) == 0 and running_requests(url, "vllm:num_requests_waiting") == 0
    assert all(future.done() for future in pending.futures) and not engine.in_flight
    engine.close()
    with pytest.raises(EngineStateError, match="closed"):  # an episode's later turn after close() is never sent
        engine.send([[1, 2, 3]], SamplingParams(n=1, max_tokens=4))


def test_max_staleness_1_stops_cleanly_on_sigterm_and_resumes_with_exact_fidelity(server, tmp_path):
    """A run with max_staleness=1 stopped by SIGTERM with requests in flight: one line saying how to resume, no
    request left running on the server. Resumed, it ends with one row per rollout step; every step trained on tokens
    at most one version behind (steps after the first: some one behind), and vLLM's log-probs equal the trainer's
    under the weights that sampled them, stale tokens included (<= 1e-6, fp32)."""
    _, url, model_dir = server
    overrides = ["vllm.mode=server", f"vllm.server_url={url}", "max_staleness=1", "save_steps=2"]
    log = tmp_path / "interrupted.log"
    proc = forked_launch(log, tmp_path, model_dir, *overrides, "max_steps=40")
    deadline = time.time() + 600
    while len(read_metrics(tmp_path)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode != 0 and "stopped by SIGTERM" in text and "resume_from_checkpoint=" in text, text[-5000:]
    deadline = time.time() + 30  # the requests it had sent are aborted, not left generating
    while running_requests(url) and time.time() < deadline:
        time.sleep(0.5)
    assert running_requests(url) == 0

    resumed, metrics = launch(tmp_path, model_dir, *overrides, "max_steps=12", "resume_from=last")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    first = int(re.search(r"continuing at rollout step (\d+)", resumed.stderr).group(1))
    assert [m["rollout_step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    lines = read_lines(tmp_path)
    assert len(lines) == len({json.dumps(line, sort_keys=True) for line in lines})
    # nothing queued at a start: the first step of each process samples on its own version; later ones lag by one
    fresh = {1, first}
    assert [m["staleness_max"] for m in metrics] == [0 if m["rollout_step"] in fresh else 1 for m in metrics]
    assert all(m["stale_completions"] > 0 for m in metrics if m["rollout_step"] not in fresh)
    assert all(m["fidelity_tokens"] > 0 and m["rollout_logprob_diff_mean"] <= 1e-6 for m in metrics), metrics
    assert all("is_ratio_mean" in m and "rollout_wait_s" in m and "server_idle_s" in m for m in metrics)
    timeline = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    assert [t["rollout_step"] for t in timeline] == [1, 2, 3, 4, 5, 6]
    assert all(set(t["trainer"]) == {"sync", "rollout", "update"} and t["server"] for t in timeline)


def test_a_server_that_dies_mid_run_stops_every_rank_with_one_line(server, tmp_path):
    """The module's last test: it kills the shared server (its API server, engine and workers)."""
    server_proc, url, model_dir = server
    out, log = tmp_path / "run-out", tmp_path / "run.log"
    overrides = ["vllm.mode=server", f"vllm.server_url={url}", "max_staleness=1", "vllm.server_timeout=5"]
    proc = forked_launch(log, out, model_dir, *overrides, "max_steps=40")
    deadline = time.time() + 600
    while not read_metrics(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    for child in psutil.Process(server_proc.pid).children(recursive=True):
        child.kill()
    server_proc.kill()
    server_proc.wait(timeout=60)
    proc.wait(timeout=300)
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("error: the vLLM server at")]
    assert proc.returncode != 0 and len(lines) == 2, text[-5000:]  # one line from each rank
    assert all(url in line and "resume_from_checkpoint=last" in line for line in lines), lines
