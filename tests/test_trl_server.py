"""merge.trl in TRL's server mode against a real ``vllm serve`` with the lora_merge backend (test_server_mode's
server fixture): recipes/grpo_trl.py trains a few steps in this process, each sync sending the factors only, and
the served log-probs are the peft model's; a server without a backend, one holding another model, one with other
settings and one that goes away mid-run (while generating, hanging, or during a sync) each stop with one line."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from test_server_mode import FakeServer, serving  # noqa: E402
from test_trl_integration import recipe_argv, trl_process  # noqa: E402, F401 - a fixture, used by name
from trl_helpers import randomize_lora_b, sampled_vs_policy  # noqa: E402

from merge.trl import MergedLoraSync, TRLServerError, lora_merge_server_client  # noqa: E402

MAX_LOGPROB_DIFF = 1e-6  # mean |vLLM - trainer| in fp32 through a lora_merge server


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """A ``vllm serve`` on the embedded model with the lora_merge backend (test_server_mode's), without a prefix
    cache (TRL's requests carry no cache_salt: docs/trl.md); (url, model path)."""
    with serving(tiny_model, tmp_path_factory.mktemp("server") / "server.log", prefix_caching=False) as running:
        yield running


def served_vs_trainer(trainer) -> tuple[float, float]:
    """Sample with TRL's own server generation, score the samples with the trainer's peft model: mean |served -
    trainer| with the adapter, and without it (what a server that never received the factors would match)."""
    tokenizer = trainer.processing_class
    prompts = [tokenizer(f"Q: {q}\nA:").input_ids for q in ("Ava has 3 pens and gets 4 more. How many now?",)] * 4
    served, with_adapter, without = sampled_vs_policy(trainer, trainer.vllm_generation, prompts, num_generations=4)
    assert served.numel() > 10
    return (served - with_adapter).abs().mean().item(), (served - without).abs().mean().item()


@pytest.mark.usefixtures("trl_process")
def test_trl_server_mode_sends_the_factors_and_serves_the_peft_models_logprobs(server, tmp_path):
    import grpo_trl

    url, model_dir = server
    argv = recipe_argv(tmp_path, model_dir, "server", "--vllm_mode", "server", "--vllm_server_base_url", url)
    trainer = grpo_trl.setup(argv + ["--max_steps", "4"])
    installed = trainer.vllm_generation.sync_weights.method  # the recipe's timer around merge.trl's sync
    assert isinstance(installed, MergedLoraSync) and installed.backend == "lora_merge"
    assert installed.transfer is None  # TRL opened no NCCL communicator; the sync connects at its first call
    randomize_lora_b(trainer.model)  # the policy differs from the base from the first sync on
    trainer.train()

    metrics = [json.loads(line) for line in (tmp_path / "server" / "metrics.jsonl").read_text().splitlines()]
    factor_bytes = sum(p.numel() * 4 for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert [m["rollout_step"] for m in metrics] == [1, 2]
    for line in metrics:
        assert line["sync_bytes"] == line["adapter_factor_bytes"] == factor_bytes
        assert line["rollout_logprob_diff_mean"] <= MAX_LOGPROB_DIFF  # TRL's own
        assert line["token_logprob_diff_mean"] <= MAX_LOGPROB_DIFF  # this project's, same tokens
        assert abs(line["is_ratio_mean"] - 1) <= 1e-5

    # after training: the served log-probs are the adapter's, far from the base's
    trainer.vllm_generation.sync_weights()
    with_adapter, without = served_vs_trainer(trainer)
    assert with_adapter <= MAX_LOGPROB_DIFF and without > 1000 * MAX_LOGPROB_DIFF, (with_adapter, without)
    # the control: move the adapter and skip the sync: the server no longer serves the trainer's policy
    randomize_lora_b(trainer.model, seed=1)
    stale, _ = served_vs_trainer(trainer)
    assert stale > 1000 * MAX_LOGPROB_DIFF, stale
    trainer.vllm_generation.sync_weights()
    assert served_vs_trainer(trainer)[0] <= MAX_LOGPROB_DIFF
    installed.transfer.shutdown()


def test_a_server_holding_another_model_is_refused_in_one_line_naming_the_tensor(server):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_client import VLLMClient

    url, model_dir = server
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    config.intermediate_size *= 2  # same names, other shapes
    other = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["down_proj"]))
    accelerator = SimpleNamespace(is_main_process=True, process_index=0)
    generation = SimpleNamespace(mode="server", model=other, accelerator=accelerator, vllm_client=VLLMClient(url))
    sync = MergedLoraSync(generation, backend="lora_merge")
    with pytest.raises(TRLServerError, match=r"refused: .*model\.layers\.0\.mlp\.down_proj\.weight") as caught:
        sync()
    assert url in str(caught.value) and "\n" not in str(caught.value)
    assert requests.get(f"{url}/is_paused").json()["is_paused"] is False  # resumed after the refusal
    sync.transfer.shutdown()


def test_a_server_without_a_backend_is_refused_and_a_lora_merge_one_opens_no_communicator():
    import trl.generation.vllm_generation as vllm_generation

    fake = FakeServer(backend=False)  # its /server_info names no weight-transfer backend
    try:
        with lora_merge_server_client():
            client = vllm_generation.VLLMClient(base_url=fake.url)
        with pytest.raises(TRLServerError, match="has no weight-transfer backend") as caught:
            client.init_communicator(device="cpu")  # TRL's own would raise NotImplementedError for a CPU device
        assert fake.url in str(caught.value) and '{"backend": "lora_merge"}' in str(caught.value)
        fake.server_info["weight_transfer_config"] = {"backend": "lora_merge"}  # the control
        client.init_communicator(device="cpu")
        assert client.weight_transfer_backend == "lora_merge" and client.communicator is None
    finally:
        fake.stop()
    assert vllm_generation.VLLMClient.__name__ == "VLLMClient"  # restored after the block


def test_trls_server_entry_refuses_a_server_that_cannot_serve_the_run_naming_each_flag():
    """`merge.trl` checks the server's settings as the recipe does (`merge.server_settings`), before any sync.
    Control: the same server with the run's settings."""
    import trl.generation.vllm_generation as vllm_generation

    fake = FakeServer(backend=True)
    fake.server_info["weight_transfer_config"] = {"backend": "lora_merge"}
    fake.server_info["model_config"].update(logprobs_mode="raw_logprobs", quantization="fp8")
    try:
        with lora_merge_server_client():
            client = vllm_generation.VLLMClient(base_url=fake.url)
        with pytest.raises(TRLServerError, match="cannot serve this run") as caught:
            client.init_communicator(device="cpu")
        message = str(caught.value)
        assert "--logprobs-mode processed_logprobs" in message and "--quantization" in message and fake.url in message
        fake.server_info["model_config"].update(logprobs_mode="processed_logprobs", quantization=None)
        client.init_communicator(device="cpu")
        assert client.weight_transfer_backend == "lora_merge"
    finally:
        fake.stop()


def test_a_server_gone_during_generation_stops_in_one_line_naming_the_url():
    from requests.adapters import HTTPAdapter
    from trl.generation.vllm_client import VLLMClient

    from merge.trl import _watch_generation

    fake = FakeServer(backend=True)
    client = VLLMClient(base_url=fake.url)
    client.session.mount("http://", HTTPAdapter())  # TRL retries for ~1 min first; the line after is the same
    accelerator = SimpleNamespace(is_main_process=True)
    _watch_generation(SimpleNamespace(accelerator=accelerator, vllm_client=client, server_timeout=5.0))
    fake.stop()
    with pytest.raises(TRLServerError, match="stopped answering while generating") as caught:
        client.generate(prompts=[[1, 2, 3]], max_tokens=2)
    message = str(caught.value)
    assert fake.url in message and "resume_from_checkpoint" in message and "\n" not in message


@pytest.mark.parametrize(
    "failure",
    [
        requests.ConnectionError("Connection refused"),  # what the sync's HTTP calls meet on a server gone
        RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8940"),  # mid-send
    ],
)
def test_a_server_gone_during_a_sync_stops_in_one_line_naming_the_url(failure, monkeypatch):
    from trl.generation.vllm_client import VLLMClient

    from merge.lora_merge import LoraMergeTrainer

    def send_weights(trainer, model, weight_version=None):
        raise failure

    monkeypatch.setattr(LoraMergeTrainer, "send_weights", send_weights)
    fake = FakeServer(backend=True)
    try:
        accelerator = SimpleNamespace(is_main_process=True, process_index=0)
        generation = SimpleNamespace(
            mode="server", model=torch.nn.Linear(1, 1), accelerator=accelerator, vllm_client=VLLMClient(fake.url)
        )
        sync = MergedLoraSync(generation, backend="lora_merge")
        with pytest.raises(TRLServerError, match="while taking a weight sync|during a sync") as caught:
            sync()
        message = str(caught.value)
        assert fake.url in message and "resume_from_checkpoint" in message and "\n" not in message
        assert sync.last_sync_bytes is None
    finally:
        fake.stop()


def test_a_generation_left_hanging_by_an_unhealthy_server_ends_in_one_line(monkeypatch):
    """TRL's client sets no timeout: a front end shutting down keeps the request open. The health watch ends the
    wait once /health has failed for the timeout; the control: a slower generation on a healthy server is waited for."""
    import threading

    from merge import server_health
    from merge import trl as merge_trl

    monkeypatch.setattr(server_health, "HEALTH_PROBE_S", 0.5)
    fake = FakeServer(backend=True)
    try:
        slow = lambda: threading.Event().wait(3.0) or "done"  # noqa: E731
        assert merge_trl._watching_health(fake.url, "generating", slow, server_timeout=1.0) == "done"
        fake.health = 503
        hanging = threading.Event().wait
        with pytest.raises(TRLServerError, match=r"stopped answering while generating \(/health answers 503") as caught:
            merge_trl._watching_health(fake.url, "generating", hanging, server_timeout=1.0)
        assert fake.url in str(caught.value) and "\n" not in str(caught.value)
    finally:
        fake.stop()


def test_the_recipe_refuses_a_server_with_other_settings_in_one_line(capsys):
    import grpo_trl

    fake = FakeServer(backend=True)
    fake.server_info["model_config"]["logprobs_mode"] = "raw_logprobs"
    try:
        # refused before any model loads: the model path is never read
        argv = recipe_argv(Path("unused"), "cache/tiny-qwen3-gsm8k", "refused", "--vllm_mode", "server")
        with pytest.raises(SystemExit) as exit_info:
            grpo_trl.main(argv + ["--vllm_server_base_url", fake.url])
    finally:
        fake.stop()
    assert exit_info.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and fake.url in line and "--logprobs-mode processed_logprobs" in line


def test_an_adapter_training_more_than_lora_factors_is_refused_for_a_lora_merge_server():
    from qwen3_lora import tiny_lora

    from merge import UnsupportedAdapterError
    from merge.trl import refuse_non_lora_training

    refuse_non_lora_training(tiny_lora())  # the control: LoRA factors only
    with pytest.raises(UnsupportedAdapterError, match=r"also trains 1 other tensor\(s\) \(.*embed_tokens"):
        refuse_non_lora_training(tiny_lora(modules_to_save=["embed_tokens"]))


def test_the_committed_server_run_meets_its_bounds():
    """results/trl-tiny-cpu-server (docs/trl.md): every step within the fp32 bound, every sync the factors."""
    run = Path(__file__).resolve().parents[1] / "results" / "trl-tiny-cpu-server" / "metrics.jsonl"
    metrics = [json.loads(line) for line in run.read_text().splitlines()]
    assert len(metrics) == 30
    assert max(m["token_logprob_diff_mean"] for m in metrics) <= MAX_LOGPROB_DIFF
    assert max(m["rollout_logprob_diff_mean"] for m in metrics) <= MAX_LOGPROB_DIFF
    assert all(m["sync_bytes"] == m["adapter_factor_bytes"] for m in metrics)
