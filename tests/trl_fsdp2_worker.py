"""One rank of the 2-process FSDP2 test of merge.trl (run by tests/test_trl_integration.py through torchrun, gloo).

Each rank: a LoRA model on the tiny checkpoint (argv[1]) with a random non-zero adapter, sharded with fully_shard
per decoder layer then the root; TRL's own VLLMGeneration (colocate, in-process engine on this rank) with
merge.trl's sync installed. Checked on every rank: what reaches vLLM's reload_weights equals merge_and_unload() of
an unsharded copy, the engine then samples with the merged model's log-probs, the trainer's shards are bitwise
unchanged; server mode through TRL's real VLLMClient (network recorded) streams the same tensors with matching
metadata from the main process while the other rank takes part in the unsharding; a root-only sharding is refused.
"""

import sys

import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from qwen3_lora import ALL_LINEAR
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.generation.vllm_generation import VLLMGeneration
from trl_helpers import (
    RecordingVLLMClient,
    broadcast_recorded,
    completion_logprobs,
    expected_tensors,
    max_abs_diff,
    merged_copy,
    params_digest,
    randomize_lora_b,
)

from grpo.tasks.tiny_gsm8k import format_prompt, make_problems
from merge import decoder_layers
from merge.trl import check_fsdp2_layout, install_merged_lora_sync, vllm_engine_kwargs


def lora_model(model_dir: str):
    torch.manual_seed(0)  # the same adapter on every rank
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"),
    )
    randomize_lora_b(model)
    return model


def recorded(weights, into: list):
    """Pass ``weights`` through, keeping a copy of each pair."""
    for name, tensor in weights:
        into.append((name, tensor.detach().clone()))
        yield name, tensor


def main():
    model_dir = sys.argv[1]
    accelerator = Accelerator(cpu=True)  # joins torchrun's processes on gloo, as TRL's trainer does on CPU
    rank = accelerator.process_index
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = lora_model(model_dir)
    reference = merged_copy(model)
    expected = expected_tensors(reference)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "parameters are not sharded"

    with vllm_engine_kwargs(dtype="float32", kv_cache_memory_bytes=64 * 2**20, enforce_eager=True):
        generation = VLLMGeneration(
            model=model,
            accelerator=accelerator,
            processing_class=tokenizer,
            mode="colocate",
            max_model_length=128,
            max_num_seqs=8,
            max_completion_length=16,
        )
    install_merged_lora_sync(generation)

    # colocate: record what reaches vLLM's reload_weights, and let it load
    pushed = []
    rpc = generation.llm.collective_rpc

    def recording_rpc(method, kwargs=None, **rest):
        if kwargs and "weights_iterator" in kwargs:  # the reload (merge.vllm_compat.reload_vllm_weights)
            kwargs = dict(kwargs, weights_iterator=recorded(kwargs["weights_iterator"], pushed))
        return rpc(method, kwargs=kwargs, **rest)

    generation.llm.collective_rpc = recording_rpc
    before = params_digest(model)
    generation.sync_weights()
    assert params_digest(model) == before, "the colocate sync changed the trainer's shards"
    colocate_diff = max_abs_diff(pushed, expected)
    assert colocate_diff <= 1e-6, f"pushed tensors differ from merge_and_unload() by {colocate_diff}"

    prompts = [tokenizer(format_prompt(p["question"])).input_ids for p in make_problems(4, seed=rank)]
    _, completions, logprobs, _ = generation.generate(prompts=prompts, images=None, num_generations=1)
    reference.eval()
    diffs = torch.cat(
        [
            (torch.tensor([lp[0] for lp in seq_logprobs]) - completion_logprobs(reference, p, list(c))).abs()
            for p, c, seq_logprobs in zip(prompts, completions, logprobs)
        ]
    )
    assert diffs.mean() <= 1e-4, f"vLLM samples with log-probs {diffs.mean():.3g} away from the merged model"

    # server: TRL's client on the main process, the network recorded; every rank iterates (unshard collectives)
    generation.mode = "server"  # a server-mode VLLMGeneration differs in `mode` and in `vllm_client` (main only)
    generation.vllm_client = RecordingVLLMClient() if accelerator.is_main_process else None
    with broadcast_recorded() as streamed:
        generation.sync_weights()
    assert params_digest(model) == before, "the server sync changed the trainer's shards"
    if accelerator.is_main_process:
        posts = generation.vllm_client.posts
        assert [url for url, _ in posts] == [
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
        ], posts
        info = posts[1][1]["update_info"]
        assert info["names"] == [name for name, _ in streamed]
        assert info["dtype_names"] == [str(t.dtype).removeprefix("torch.") for _, t in streamed]
        assert info["shapes"] == [list(t.shape) for _, t in streamed]
        server_diff = max_abs_diff(streamed, expected)
        assert server_diff <= 1e-6, f"streamed tensors differ from merge_and_unload() by {server_diff}"
    else:
        assert not streamed, "only the main process streams to the server"

    root_only = lora_model(model_dir)
    fully_shard(root_only)
    try:
        check_fsdp2_layout(root_only)
        raise AssertionError("a model sharded only at the root was accepted")
    except ValueError as err:
        assert "decoder layer 0 is not a fully_shard group" in str(err), err

    print(
        f"TRL FSDP2 OK rank {rank}: pushed {len(pushed)} tensors, max |diff| {colocate_diff:.1e}; "
        f"|vLLM - merged| log-prob mean {diffs.mean():.1e} over {diffs.numel()} tokens",
        flush=True,
    )
    # no teardown: vLLM's engine shutdown at exit destroys the process groups, the default one included


if __name__ == "__main__":
    main()
