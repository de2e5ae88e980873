"""The sync section: merged_lora_params over the whole model (one decoder layer at a time, W + scale * B @ A)
against a plain walk of the base weights (unshard / copy / reshard, no LoRA); and whether each row of B @ A on this
device is the same whichever rows are computed together (what the row merge of several ranks relies on,
merge/row_merge.py), for the first layer's LoRA Linears at 2, 4 and 8 ranks and in pieces of 16 rows."""

from __future__ import annotations

import torch

from bench.gpu_kit.timing import timed
from grpo.memory_plan import GIB
from merge import decoder_layers, merged_lora_params


def plain_walk(model):
    """The base weights, copied group by group as merged_lora_params unshards them (no LoRA arithmetic)."""
    layers = decoder_layers(model)
    layer_params = {id(p) for layer in layers for p in layer.parameters()}
    for layer in layers:
        layer.unshard()
        yield from ((n, p.detach().clone()) for n, p in layer.named_parameters() if "lora_" not in n)
        layer.reshard()
    model.unshard()  # the root group: embedding (tied lm_head), final norm
    yield from (
        (n, p.detach().clone()) for n, p in model.named_parameters() if id(p) not in layer_params and "lora_" not in n
    )
    model.reshard()


def consume(weights) -> int:
    """Walk ``weights`` as a push would, dropping each tensor; returns the bytes seen."""
    total = 0
    for _, tensor in weights:
        total += tensor.numel() * tensor.element_size()
    return total


def row_products_equal(model, worlds=(2, 4, 8)) -> dict[str, bool]:
    """For each world size w: whether every rank's rows of ``B @ A`` (``B[k*c:(k+1)*c] @ A``, c = ceil(out / w)), for
    every LoRA Linear of the first decoder layer, equal those rows of the whole product bit for bit, in the factors'
    dtype and in bf16; and the same for pieces of ``MIN_ROWS`` rows, the fewest the row merge lets a rank merge (a piece
    with fewer rows is left out: the row merge unshard()s such a layer whole)."""
    from peft.tuners.lora import Linear as LoraLinear

    from merge.row_merge import MIN_ROWS

    def whole(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    pairs = []
    for module in decoder_layers(model)[0].modules():
        if isinstance(module, LoraLinear):
            a, b = (whole(f[module.active_adapters[0]].weight).detach() for f in (module.lora_A, module.lora_B))
            pairs += [(a, b), (a.bfloat16(), b.bfloat16())]
    chunks = {str(world): (lambda rows, world=world: -(-rows // world)) for world in worlds}
    chunks[f"{MIN_ROWS} rows"] = lambda rows: MIN_ROWS
    equal = {}
    for label, chunk_of in chunks.items():
        same = True
        for a, b in pairs:
            product, chunk = b @ a, chunk_of(b.shape[0])
            pieces = [k for k in range(0, b.shape[0], chunk) if min(chunk, b.shape[0] - k) >= MIN_ROWS]
            same &= all(torch.equal(b[k : k + chunk] @ a, product[k : k + chunk]) for k in pieces)
        equal[label] = same
    return equal


def check_sync(model, dtype: torch.dtype, device: torch.device) -> dict:
    merged_s, merged_bytes = timed(lambda: consume(merged_lora_params(model, dtype=dtype)), device)
    plain_s, plain_bytes = timed(lambda: consume(plain_walk(model)), device)
    return dict(
        merged_lora_params_s=merged_s,
        plain_walk_s=plain_s,
        merged_over_plain=merged_s / plain_s,
        merged_gib=merged_bytes / GIB,
        plain_gib=plain_bytes / GIB,
        row_products_equal=row_products_equal(model),
    )
