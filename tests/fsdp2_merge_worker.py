"""One rank of the 2-process FSDP2 merge test (`checks`, run by tests/distributed_checks.py under torchrun for
tests/test_merge.py, gloo on CPU).

Each rank: shard a LoRA Qwen3 with fully_shard (each decoder layer, then the root), take an optimizer step,
then check merged_lora_params against peft's merge_and_unload() on an unsharded copy, check that its local
shards are bitwise unchanged, and measure the peak extra memory of the iteration against the largest layer.
"""

import copy
import statistics

import torch
from bench_common import rss_peak_during  # RSS sampling; needs MALLOC_MMAP_THRESHOLD_ set low (the test sets it)
from qwen3_lora import shard_and_train, tiny_lora

from merge import decoder_layers, merged_lora_params


def checks(rank: int) -> None:
    model = tiny_lora(layers=4, hidden=512)  # ~10 MB per decoder layer in fp32
    for layer in decoder_layers(model):  # a persistent buffer: FSDP2 leaves it whole, the walk must copy it
        layer.register_buffer("marker", torch.arange(4.0))
    reference = copy.deepcopy(model)  # same initial weights on every rank
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in decoder_layers(model))

    ids = shard_and_train(model, rank)

    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    local_before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(full[name])
    expected = reference.merge_and_unload().state_dict()
    expected.pop("lm_head.weight")  # tied: yielded once, as model.embed_tokens.weight

    def drain():  # memory pass: the consumer drops each tensor at once (a loader copies it into its own buffer)
        return [name for name, _ in merged_lora_params(model)]

    def unshard_only():  # FSDP2's own cost of unsharding the largest layer: the floor for any layer-wise sync
        largest.unshard()
        largest.reshard()

    largest = max(decoder_layers(model), key=lambda layer: sum(p.numel() for p in layer.parameters()))
    names = drain()  # also the warm-up: lazy FSDP state, first-touch pages
    # One pass can miss a short-lived peak or catch an unrelated allocation (more so on a busy machine): each peak
    # is the median of 5 passes.
    extra = statistics.median(rss_peak_during(drain)[1] for _ in range(5))
    floor = statistics.median(rss_peak_during(unshard_only)[1] for _ in range(5))
    walk = merged_lora_params(model)  # a walk that ends early, in step (the consumer stops in layer 0, next layers'
    for _ in range(3):  # all-gathers in flight): what follows must still merge and train
        next(walk)
    walk.close()
    trainer_storage = {
        (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()
    }
    trainer_storage |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    merged = list(merged_lora_params(model))
    shared = [n for n, t in merged if t.untyped_storage().data_ptr() in trainer_storage]
    assert not shared, f"merged_lora_params handed out the trainer's own storage: {shared[:3]}"
    worst = max((t - expected[n]).abs().max().item() for n, t in merged)
    assert set(names) == set(expected) and len(names) == len(expected), set(expected) ^ set(names)
    assert worst == 0, f"merged weights differ from merge_and_unload by {worst}"  # bit for bit
    lora_b = next(n for n in full if "lora_B" in n)
    assert full[lora_b].abs().sum() > 0, "the optimizer step should have made lora_B non-zero"
    changed = [n for n, p in model.named_parameters() if not torch.equal(local_before[n], p.to_local())]
    assert not changed, f"merged_lora_params modified trainer parameters: {changed[:3]}"
    print(
        f"rank {rank}: peak extra memory of merged_lora_params {extra / 2**20:.1f} MiB = "
        f"{extra / layer_bytes:.2f}x the largest decoder layer ({layer_bytes / 2**20:.1f} MiB); "
        f"unshard()+reshard() of that layer alone: {floor / 2**20:.1f} MiB = {floor / layer_bytes:.2f}x"
    )
    # On gloo, FSDP2's unshard() of a layer needs ~2 layers (its all-gather's output + staging). The row merge gathers
    # the merged weights straight into the tensors handed out, so its own layer and the next one's being gathered
    # cost about as much (measured 1.9-2.2 layers; 3.1-3.2 when every layer was unshard()-ed whole, then merged).
    assert extra <= floor + 1.0 * layer_bytes, f"merge peak {extra} B > unshard peak {floor} B + 1 layer"
    assert extra <= 3.0 * layer_bytes, f"merge peak {extra} B > 3x the largest layer ({layer_bytes} B)"

    # training still works after the merge (every group resharded properly)
    model(input_ids=ids, labels=ids).loss.backward()
