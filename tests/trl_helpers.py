"""Shared by the TRL tests (tests/test_trl_*.py) and tests/trl_fsdp2_worker.py: TRL's vLLM client without a network,
the expected merged weights, a parameter digest, per-sequence log-probs, a random adapter, a dense reward and the
trainer's scores of every multi-turn episode TRL generates."""

from __future__ import annotations

import contextlib
import copy
import hashlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from trl.generation.vllm_client import VLLMClient


class RecordingVLLMClient(VLLMClient):
    """TRL 1.16's ``VLLMClient`` with its HTTP requests recorded (``posts``) instead of sent.

    Everything else is TRL's own code: ``update_named_params`` announces the tensors with ``/update_weights`` and
    hands the iterator to vLLM's ``packed_nccl_broadcast_producer``, which :func:`broadcast_recorded` replaces.
    """

    def __init__(self):  # VLLMClient.__init__ connects to a server; set only what the weight sync reads
        self.base_url = "http://vllm.invalid"
        self.communicator = object()  # stands for the NCCL group; the recorder ignores it
        self._updating_weights = False
        self.posts: list[tuple[str, dict | None]] = []

    def _post(self, url: str, **kwargs) -> dict:
        self.posts.append((url.removeprefix(self.base_url), kwargs.get("json")))
        return {"success": True}


@contextlib.contextmanager
def broadcast_recorded():
    """Replace the NCCL broadcast of TRL's client with a recorder; yields the ``(name, tensor)`` list it fills."""
    import trl.generation.vllm_client as client_module

    streamed: list[tuple[str, torch.Tensor]] = []
    broadcast = client_module.packed_nccl_broadcast_producer

    def record(iterator, group, src, post_iter_func, **kwargs):  # vLLM's signature
        for item in iterator:
            streamed.append((item[0], post_iter_func(item).detach().clone()))

    client_module.packed_nccl_broadcast_producer = record
    try:
        yield streamed
    finally:
        client_module.packed_nccl_broadcast_producer = broadcast


def merged_copy(peft_model) -> torch.nn.Module:
    """peft's ``merge_and_unload()`` of a copy of an unsharded peft model (the original keeps its adapter)."""
    return copy.deepcopy(peft_model).merge_and_unload()


def expected_tensors(merged_model) -> dict[str, torch.Tensor]:
    """What a merged-weights sync must push: the merged model's state dict, a tied lm_head once (as the embedding)."""
    expected = merged_model.state_dict()
    if merged_model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return expected


def max_abs_diff(got: list[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> float:
    """Max |got - expected| over all tensors, after checking the names match one to one."""
    names = [name for name, _ in got]
    assert len(names) == len(set(names)), "a tensor was pushed twice"
    assert set(names) == set(expected), f"names differ: {sorted(set(names) ^ set(expected))[:5]}"
    return max((tensor.float() - expected[name].float()).abs().max().item() for name, tensor in got)


def params_digest(model: torch.nn.Module) -> str:
    """SHA-1 of this process's parameter bytes (local shards under FSDP2)."""
    digest = hashlib.sha1()
    for _, param in sorted(model.named_parameters()):
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def completion_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0):
    """Log-probs of the completion tokens under ``model`` (one unpadded sequence, eval mode)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]


@torch.no_grad()
def randomize_lora_b(model, seed: int = 0, std: float = 0.02) -> None:
    """Non-zero lora_B (peft starts it at zero), so the adapter changes the policy from the first sync on."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def digit_fraction_reward(completions, **kwargs) -> list[float]:
    """TRL reward function: the fraction of digits in the completion (dense, so every group has reward variance); of
    its last message's content where completions are chat messages."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in texts]


def sampled_vs_policy(trainer, generation, prompts: list[list[int]], num_generations: int):
    """Sample ``prompts`` with TRL's own ``generation.generate``; return the sampled tokens' log-probs as the engine
    served them, and as the trainer's peft model scores them with its adapter and without it (what an engine that
    never received the adapter would match)."""
    _, completions, logprobs, _ = generation.generate(prompts=prompts, images=None, num_generations=num_generations)
    model = trainer.model
    model.eval()
    sampled = torch.cat([torch.tensor([lp[0] for lp in seq]) for seq in logprobs])
    with_adapter = torch.cat([completion_logprobs(model, p, list(c)) for p, c in zip(prompts, completions)])
    with model.disable_adapter():
        without = torch.cat([completion_logprobs(model, p, list(c)) for p, c in zip(prompts, completions)])
    return sampled, with_adapter, without


def record_syncs(trainer) -> list:
    """Wrap the trainer's weight sync (the recipe's timer around merge.trl's MergedLoraSync) so that each sync
    records the trainer's parameter digest before and after it and its LoRA weights; returns the record list."""
    from types import SimpleNamespace

    model, generation = trainer.model, trainer.vllm_generation
    timed_sync, syncs = generation.sync_weights, []

    def checked_sync():
        before = params_digest(model)
        timed_sync()
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        syncs.append(SimpleNamespace(before=before, after=params_digest(model), lora=lora))

    generation.sync_weights = checked_sync
    return syncs


def short_recipe_argv(config: str, out: Path, model: str, run_name: str, *overrides: str) -> list[str]:
    """recipes/grpo_trl.py's arguments for ``recipes/configs/<config>``, shortened for a test: the given model as is
    (no build), rollouts of 8 x 2 completions per device, a dense reward besides the exact answer; ``overrides``
    last."""
    root = Path(__file__).resolve().parents[1]
    return [
        "--config",
        str(root / "recipes" / "configs" / config),
        "--output_dir",
        str(out),
        "--run_name",
        run_name,
        "--model_name_or_path",
        model,
        "--build_tiny",
        "null",
        "--per_device_train_batch_size",
        "8",
        "--steps_per_generation",
        "2",
        "--learning_rate",
        "5e-3",
        "--num_generated",
        "64",
        "--vllm_kv_cache_gb",
        "0.0625",
        "--reward_funcs",
        "grpo.tasks.rewards:gsm8k_exact_answer_reward",
        "trl_helpers:digit_fraction_reward",
        *overrides,
    ]


def turn_numbers(tool_mask: torch.Tensor) -> torch.Tensor:
    """Each completion token's turn (1, 2, ...) from TRL's ``tool_mask`` (1: the model's token, 0: a tool result's):
    one more than the tool results that came before it."""
    tool = ~tool_mask
    result_starts = tool & torch.cat([torch.tensor([True]), ~tool[:-1]])
    return 1 + torch.cumsum(result_starts.long(), 0)


class EpisodeScores:
    """Stands in for the trainer's ``_generate`` (on the instance): each episode it returns (prompt ids, completion
    ids, ``tool_mask``, messages, vLLM's per-token log-probs) is scored by the trainer's model with its adapter and
    without it, one unpadded sequence at a time. Kept per model token (``tool_mask`` 1): vLLM's log-prob,
    |vLLM - trainer|, |vLLM - base model| and its turn (`turn_numbers`); and the tool messages TRL appended."""

    def __init__(self, trainer):
        self.generate, self.model = trainer._generate, trainer.model
        self.sampled, self.adapter, self.base, self.turns = [], [], [], []
        self.tool_calls = 0

    def __call__(self, prompts):
        output = self.generate(prompts)
        prompt_ids, completion_ids, tool_mask, completions, logprobs = output[:5]
        if tool_mask is None:  # no tools: every completion token is the model's, in one turn
            tool_mask = [[1] * len(ids) for ids in completion_ids]
        for prompt, completion, mask, messages, sampled in zip(
            prompt_ids, completion_ids, tool_mask, completions, logprobs
        ):
            mask = torch.tensor(mask, dtype=torch.bool)
            sampled = torch.tensor(sampled, dtype=torch.float32)[mask]
            with_adapter = completion_logprobs(self.model, list(prompt), list(completion))[mask]
            with self.model.disable_adapter():
                without = completion_logprobs(self.model, list(prompt), list(completion))[mask]
            self.sampled.append(sampled)
            self.adapter.append((sampled - with_adapter).abs())
            self.base.append((sampled - without).abs())
            self.turns.append(turn_numbers(mask)[mask])
            self.tool_calls += sum(message["role"] == "tool" for message in messages)
        return output

    def per_turn(self, relative: bool = False) -> dict[int, tuple[float, int]]:
        """Mean |vLLM - trainer| and model tokens of each turn, over every episode scored; ``relative``: each token's
        |vLLM - trainer| over max(1, |its log-prob|)."""
        diff, turns = torch.cat(self.adapter), torch.cat(self.turns)
        if relative:
            diff = diff / torch.cat(self.sampled).abs().clamp(min=1.0)
        return {int(t): (diff[turns == t].mean().item(), int((turns == t).sum())) for t in turns.unique()}
