"""Response-token log-probs from one padding-free (packed) forward, the LM head run only where the response is read.

:func:`packed_log_probs` packs a ``[B, P + R]`` rollout batch (:mod:`padding.layout`), runs the model once, and
maps the values back with :func:`padding.layout.no_padding_2_padding`; :func:`sampled_log_probs` scores tokens
under the distribution vLLM samples from (temperature, top-k / top-p).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from padding.layout import PackedBatch, legacy_slice_response, no_padding_2_padding, response_layout, unpad
from padding.sampling import truncated_selective_log_softmax, truncation_active

__all__ = ["packed_log_probs", "sampled_log_probs", "selective_log_softmax", "token_entropy", "DEFAULT_CHUNK_SIZE"]


def selective_log_softmax(logits: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """``log_softmax(logits)[k, targets[k]]`` for ``[T, V]`` logits without a full ``[T, V]`` fp32 copy at once."""
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        block = logits[start : start + chunk_size].float()
        picked = block.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(block, dim=-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy (nats, fp32, detached) of ``softmax(logits[k])`` for ``[T, V]`` logits, chunk by chunk like
    :func:`selective_log_softmax`. Detached: it only selects tokens and feeds metrics, so no ``[T, V]``
    activation is kept for the backward."""
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        log_probs = torch.log_softmax(logits[start : start + chunk_size].float(), dim=-1)
        out.append(-(log_probs.exp() * log_probs).sum(-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


# Rows of the LM head per chunk: the logits of one chunk ([chunk, V] in the compute dtype, plus the fp32 copies of
# the log-softmax) are freed before the next chunk and recomputed in the backward. See packed_log_probs.
DEFAULT_CHUNK_SIZE = 512


def _read_positions(attention_mask: torch.Tensor, response_mask: torch.Tensor, legacy_slice: bool):
    """(read [B, R] bool, positions [N]): the packed rows ``values[positions]`` that the mapping puts in the ``read``
    cells of ``[B, R]`` (row-major); every other cell is 0. Found by mapping ``1 .. T`` through the rule itself, so
    the legacy rule reads exactly what it reads from a full ``[T]`` vector (and 0 where it reads padding)."""
    to_response = legacy_slice_response if legacy_slice else no_padding_2_padding
    total = int(attention_mask.sum())
    index = to_response(torch.arange(1, total + 1, device=attention_mask.device), attention_mask, response_mask) - 1
    read = index >= 0
    return read, index[read]


class _ResponseHead(torch.nn.Module):
    """Stands in for the LM head during one forward: ``[1, N, H]`` hidden states of the read positions ->
    ``[1, N]`` fp32 log-probs of ``targets``, ``chunk_size`` rows at a time through the real head.

    Each chunk's logits are dropped once its log-probs (and detached entropies) are taken; when autograd records,
    the chunk runs under a non-reentrant checkpoint, so the backward recomputes that chunk's logits (through the
    head's own ``__call__``: peft LoRA on the head, hooks and FSDP unshard hooks included) instead of keeping them.
    """

    def __init__(
        self,
        head,
        targets,
        temperature: float,
        chunk_size: int,
        entropies: list | None,
        top_k: int = 0,
        top_p: float = 1.0,
    ):
        super().__init__()
        object.__setattr__(self, "head", head)  # not registered: the model's parameter names stay as they are
        self.targets, self.temperature, self.chunk_size, self.entropies = targets, temperature, chunk_size, entropies
        self.top_k, self.top_p = top_k, top_p
        self.output = None

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor):
        logits = self.head(hidden)[0]  # [n, V], the model's (or autocast's) dtype, as the full forward makes them
        rows = max(1, logits.shape[0])
        values = sampled_log_probs(logits, targets, self.temperature, self.top_k, self.top_p, chunk_size=rows)
        entropy = token_entropy(logits / self.temperature, chunk_size=rows) if self.entropies is not None else None
        return values, entropy

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != self.targets.shape[0]:
            raise RuntimeError(
                f"the LM head got hidden states {tuple(hidden.shape)}, expected [1, "
                f"{self.targets.shape[0]}, H]: the model did not apply logits_to_keep as an index"
            )
        if hidden.shape[1] == 0:  # nothing to score; keep the graph connected (zero gradients)
            self.output = hidden[:, :, 0].float()
            return self.output
        record = torch.is_grad_enabled()
        values, entropies = [], []
        for start in range(0, hidden.shape[1], self.chunk_size):
            args = (hidden[:, start : start + self.chunk_size], self.targets[start : start + self.chunk_size])
            value, entropy = checkpoint(self._chunk, *args, use_reentrant=False) if record else self._chunk(*args)
            values.append(value)
            entropies.append(entropy)
        if self.entropies is not None:
            self.entropies.append(torch.cat(entropies))
        self.output = torch.cat(values)[None]
        return self.output


def _parent_of(model: torch.nn.Module, child: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for module in model.modules():
        for name, candidate in module.named_children():
            if candidate is child:
                return module, name
    raise RuntimeError("the model's output embeddings (LM head) are not one of its submodules")


def sampled_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float, chunk_size: int = 1024
) -> torch.Tensor:
    """Log-probs ``[T]`` of ``targets`` under the distribution vLLM samples from, given raw ``[T, V]`` logits:
    ``log_softmax(logits / T)``, or, when top-k / top-p truncate, vLLM's renormalised truncated distribution
    (:mod:`padding.sampling`), whose log-probs vLLM returns as ``processed_logprobs``."""
    if truncation_active(top_k, top_p, logits.shape[-1]):
        return truncated_selective_log_softmax(logits, targets, temperature, top_k, top_p, chunk_size=chunk_size)
    if temperature != 1.0:
        logits = logits / temperature
    return selective_log_softmax(logits, targets, chunk_size=chunk_size)


def _full_logits_values(model, packed: PackedBatch, temperature: float, return_entropy: bool, top_k: int, top_p: float):
    """Every packed position's ``[T, V]`` logits -> ``values`` ``[T]`` (and entropies)."""
    logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False).logits[0]
    # values[k] scores packed token k + 1; the last slot (and each sample's last) is never read.
    targets = torch.roll(packed.input_ids, shifts=-1)
    values = sampled_log_probs(logits, targets, temperature, top_k, top_p)
    return values, token_entropy(logits / temperature) if return_entropy else None


def packed_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    legacy_slice: bool = False,
    return_entropy: bool = False,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response-token log-probs ``[B, R]`` (fp32, 0 at padding) from one padding-free forward.

    ``model`` is any Hugging Face causal LM (or a peft/FSDP wrapper of one). The forward gets the packed
    ids as one ``[1, T]`` row with restarting ``position_ids`` and ``use_cache=False``: transformers
    builds the block-diagonal (per-sample) causal mask from ``position_ids`` only when no cache is used;
    with the default cache the samples attend to each other and the result is silently wrong.
    ``legacy_slice=True`` maps the values with the wrong rule :func:`legacy_slice_response`.
    ``return_entropy=True`` returns ``(log_probs, entropies)``: ``entropies`` ``[B, R]`` is the entropy of the
    tempered next-token distribution at each response position (:func:`token_entropy`, detached, 0 at
    padding), mapped by the same rule as the log-probs.

    LM head only where read, ``chunk_size`` rows at a time. The forward gets ``logits_to_keep`` = the ``N`` packed
    positions the mapping reads (``start_i + prompt_len_i + j - 1`` per scored response token; with
    ``legacy_slice`` the positions that rule reads), so the decoder's final hidden states are projected at those
    ``N`` rows only, never at prompt tokens. For the duration of the forward the model's LM head is swapped for
    :class:`_ResponseHead`, which runs the real head on ``chunk_size`` rows at a time and turns each chunk's logits
    into log-probs (and entropies) at once; under autograd each chunk is a non-reentrant checkpoint, so its logits
    are recomputed in the backward instead of being kept. The head runs inside the model's (FSDP2 root's) own
    forward, so the root's unsharded parameters, LoRA on ``lm_head`` and the FSDP2 hooks behave as in a plain
    forward. The largest logits tensor is ``[min(N, chunk_size), V]`` instead of ``[T, V]`` (plus, with full logits,
    the ``[T, V]`` fp32 copies that the log-softmax keeps for the backward); the values are those of the full-logits
    computation up to the matmul's rounding (fp32: <= 1e-6).

    ``chunk_size`` (default 512, :data:`DEFAULT_CHUNK_SIZE`): memory grows with it, time does not drop. Measured
    on CPU (2 shared cores, fp32, a 1-layer H = 256 LoRA model at V = 151,936, T = 2048 packed tokens of which
    N = 1024 scored, forward + backward, two runs each): chunk 64 / 128 / 256 / 512 / 1024 rows took 18.2 / 17.6 /
    18.3-19.2 / 15.4-21.5 / 14.8-20.3 s with a peak RSS of 148 / 297 / 594 / 1187 / 2374 MiB (2.3 MiB per row);
    the full logits (``chunk_size=None``) took 18.9-28.2 s and 4154 MiB. 512 rows keep a chunk's logits at 0.16 GB
    in bf16 (0.3 GB in fp32, ~1.2 GB live at the backward's peak) and its matmul ([512, H] x [H, V]: 0.4 TFLOP at
    H = 2560) large enough to fill a GPU. ``chunk_size=None`` runs the full-logits computation (every packed
    position, one ``[T, V]`` tensor); so does a model without ``get_output_embeddings``.
    """
    response_layout(attention_mask, response_mask)  # fail before the forward on a bad layout
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size}")
    to_response = legacy_slice_response if legacy_slice else no_padding_2_padding
    packed = unpad(input_ids, attention_mask)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if chunk_size is None or head is None:
        values, entropies = _full_logits_values(model, packed, temperature, return_entropy, top_k, top_p)
        log_probs = to_response(values, attention_mask, response_mask)
        return (log_probs, to_response(entropies, attention_mask, response_mask)) if return_entropy else log_probs

    read, positions = _read_positions(attention_mask, response_mask, legacy_slice)
    targets = torch.roll(packed.input_ids, shifts=-1)[positions]  # values[k] scores packed token k + 1
    entropies = [] if return_entropy else None
    parent, name = _parent_of(model, head)
    response_head = _ResponseHead(head, targets, temperature, chunk_size, entropies, top_k, top_p)
    setattr(parent, name, response_head)
    try:
        output = model(
            input_ids=packed.input_ids[None],
            position_ids=packed.position_ids[None],
            use_cache=False,
            logits_to_keep=positions,
        ).logits
    finally:
        setattr(parent, name, head)
    if output is not response_head.output:  # e.g. a logit soft-cap or scale applied after the head
        raise RuntimeError(
            f"{type(model).__name__} changes its LM head's output before returning it as logits: "
            "run packed_log_probs with chunk_size=None (full logits)"
        )
    log_probs = torch.zeros(read.shape, dtype=torch.float32, device=output.device).index_put((read,), output[0])
    if not return_entropy:
        return log_probs
    entropy = torch.zeros(read.shape, dtype=torch.float32, device=output.device)
    return log_probs, entropy.index_put((read,), entropies[0]) if entropies else entropy
