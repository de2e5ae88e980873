"""What the ``lora_merge`` backend sends: the update in the base checkpoint's names, packed into flat buffers.

The factors are gathered from FSDP2 shards one parameter at a time (``full_tensor()`` on the factor only; the base
weights are never unsharded).

Linear and Embedding LoRA are sent as their factors. LoRA on parameters (``target_parameters``: fused MoE experts)
is sent as factors too, one entry per checkpoint tensor (an expert's gate, up or down projection): each such tensor
is one block of one expert's fused matrix, whose delta is ``B_e @ A_e`` (peft; transposed where the parameter is
held experts x in x out), so its factors are the block's rows of ``B_e`` and columns of ``A_e``. Which block each
checkpoint tensor is comes from transformers' own conversion (what ``save_pretrained`` applies), run once per model
and kind of parameter on index probes (`learn_blocks`, remembered in `LEARNED_BLOCKS`); a conversion that does not
cut rectangular blocks is refused, naming the parameter. A tensor that several entries share (an expert's ``A_e``,
in its gate's entry and its up's) is sent once.

`LoraUpdate.cast` casts what is sent (the trainer's ``wire_dtype``). `full_update` is the whole merged model instead
(`merge.merged_lora_params`, every tensor), for ``update="full"``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers.core_model_loading import revert_weight_conversion

from merge import UnsupportedAdapterError, check_supported, normalize_peft_param_name
from merge.lora_merge.wire import BACKEND


def _full(param: torch.Tensor) -> torch.Tensor:
    """A factor gathered whole (``full_tensor()`` on an FSDP2 shard: a collective over the factor alone)."""
    full_tensor = getattr(param, "full_tensor", None)
    return (full_tensor() if callable(full_tensor) else param).detach()


@dataclass(frozen=True)
class _Block:
    """Where one checkpoint tensor lies in a fused parameter ``[experts,] rows x cols``: rows ``rows`` and columns
    ``cols`` (half-open ranges) of expert ``expert``'s matrix, transposed in the checkpoint or not."""

    expert: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    transposed: bool

    @property
    def shape(self) -> torch.Size:
        shape = (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        return torch.Size(shape[::-1] if self.transposed else shape)


# base model -> {(parameter name, numbers as "#"; shape): its checkpoint tensors' blocks, in conversion order}
LEARNED_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_block(rows: torch.Tensor, cols: torch.Tensor | None, fused_rows: int, fused_cols: int) -> _Block | None:
    """The block that the index probes of `learn_blocks` came back as in one checkpoint tensor (``rows``: expert *
    fused_rows + row; ``cols``: column), or None where they are not one rectangular block of one expert."""
    if cols is None or rows.ndim != 2 or rows.shape != cols.shape or rows.numel() == 0:
        return None
    for transposed in (False, True):
        r, c = (rows.T, cols.T) if transposed else (rows, cols)
        (n, m), first_row, first_col = r.shape, int(r[0, 0]), int(c[0, 0])
        expert, row = divmod(first_row, fused_rows)
        if row + n > fused_rows or first_col + m > fused_cols:
            continue
        if torch.equal(r, torch.arange(first_row, first_row + n, dtype=r.dtype)[:, None].expand(n, m)) and torch.equal(
            c, torch.arange(first_col, first_col + m, dtype=c.dtype).expand(n, m)
        ):
            return _Block(expert, (row, row + n), (first_col, first_col + m), transposed)
    return None


def learn_blocks(base, name: str, shape: torch.Size) -> list[_Block]:
    """Each checkpoint tensor's block of the fused parameter ``name``, read off transformers' conversion of two
    index probes (stride-0 views: memory only where the conversion copies)."""
    experts, fused_rows, fused_cols = (1, *shape) if len(shape) == 2 else shape
    dtype = torch.int32 if experts * fused_rows < 2**31 and fused_cols < 2**31 else torch.int64
    rows = torch.arange(experts * fused_rows, dtype=dtype).view(experts, fused_rows, 1).expand(-1, -1, fused_cols)
    cols = torch.arange(fused_cols, dtype=dtype).view(1, 1, fused_cols).expand(experts, fused_rows, -1)
    rows, cols = rows.reshape(shape), cols.reshape(shape)  # still views
    try:
        reverted_rows = revert_weight_conversion(base, {name: rows})
        reverted_cols = revert_weight_conversion(base, {name: cols})
    except Exception as error:
        raise UnsupportedAdapterError(
            f"{name}: transformers' conversion to checkpoint tensors failed on index probes ({error}); the "
            f"{BACKEND} backend cannot send its LoRA as factors"
        ) from error
    blocks = []
    for target, target_rows in reverted_rows.items():
        block = _as_block(target_rows, reverted_cols.get(target), fused_rows, fused_cols)
        if block is None:
            raise UnsupportedAdapterError(
                f"{name}: its checkpoint tensor {target} is not one rectangular block of one expert's matrix; the "
                f"{BACKEND} backend cannot send its LoRA as factors"
            )
        blocks.append(block)
    return blocks


def _checkpoint_blocks(base, name: str, shape: torch.Size) -> list[tuple[str, torch.Size, _Block]]:
    """The checkpoint tensors (name, shape, block) that transformers' conversion (what ``save_pretrained`` does)
    makes of the fused parameter ``name``. The names come from converting a meta tensor; the blocks are learned once
    per base model and kind of parameter (every layer's experts convert alike)."""
    targets = revert_weight_conversion(base, {name: torch.empty(shape, device="meta")})
    learned = LEARNED_BLOCKS.setdefault(base, {})
    key = (re.sub(r"\d+", "#", name), tuple(shape))
    if key not in learned:
        learned[key] = learn_blocks(base, name, shape)
    blocks = learned[key]
    if [tuple(t.shape) for t in targets.values()] != [tuple(block.shape) for block in blocks]:
        raise UnsupportedAdapterError(f"{name}: converts to other checkpoint tensors than {key[0]} did")
    return [(target, tensor.shape, block) for (target, tensor), block in zip(targets.items(), blocks)]


SLOTS = {"lora": ("b", "a"), "weight": ("w",)}  # each kind's tensors, in order


def _memory_key(tensor: torch.Tensor) -> tuple:
    """Equal for views of the same memory alike (an expert's A, in its gate's entry and its up's): sent once."""
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


@dataclass
class LoraUpdate:
    """One update in checkpoint names: ``entries`` describe each targeted base tensor (``kind`` "lora": ``delta =
    transpose?(B @ A) * scale`` from factors; "weight": the whole new tensor, for ``update="full"``), ``tensors``
    hold the factors/weights in entry order (entries may share a tensor: it
    is sent once), ``shapes`` the base tensors' shapes (what the server's checkpoint must hold)."""

    entries: list[dict] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def add(self, entry: dict, tensors: list[torch.Tensor], shape) -> None:
        self.entries.append(entry)
        self.tensors.extend(tensors)
        self.shapes[entry["target"]] = list(shape)

    def by_entry(self) -> Iterator[tuple[dict, list[torch.Tensor]]]:
        """Each entry with its tensors (B, A for "lora")."""
        tensors = iter(self.tensors)
        for entry in self.entries:
            yield entry, [next(tensors) for _ in SLOTS[entry["kind"]]]

    def sent_bytes(self) -> Iterator[tuple[dict, int]]:
        """Each entry with the bytes it adds to what is sent (none for a tensor an earlier entry sends)."""
        sent = set()
        for entry, tensors in self.by_entry():
            nbytes = 0
            for tensor in tensors:
                if _memory_key(tensor) not in sent:
                    sent.add(_memory_key(tensor))
                    nbytes += tensor.numel() * tensor.element_size()
            yield entry, nbytes

    def packed(self) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """The entries with each tensor's ``[dtype, offset, shape]`` in its dtype's flat buffer, and the buffers;
        entries that share a tensor share its slot."""
        chunks: dict[str, list[torch.Tensor]] = {}
        sizes: dict[str, int] = {}
        slots_by_memory: dict[tuple, list] = {}
        entries = []
        for entry, tensors in self.by_entry():
            slots = {}
            for key, tensor in zip(SLOTS[entry["kind"]], tensors):
                memory = _memory_key(tensor)
                if memory not in slots_by_memory:
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    slots_by_memory[memory] = [dtype, sizes.get(dtype, 0), list(tensor.shape)]
                    sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
                    chunks.setdefault(dtype, []).append(tensor.reshape(-1))
                slots[key] = list(slots_by_memory[memory])
            entries.append({**entry, **slots})
        return entries, {dtype: torch.cat(parts) for dtype, parts in chunks.items()}

    @property
    def nbytes(self) -> int:
        """The bytes sent."""
        return sum(nbytes for _, nbytes in self.sent_bytes())

    def cast(self, dtype: torch.dtype | None) -> LoraUpdate:
        """The same update with every floating-point tensor cast to ``dtype`` (None: unchanged); a tensor shared by
        entries stays shared."""
        if dtype is None:
            return self
        cast: dict[tuple, torch.Tensor] = {}
        tensors = []
        for tensor in self.tensors:
            if tensor.is_floating_point():
                tensor = cast.setdefault(_memory_key(tensor), tensor.to(dtype))
            tensors.append(tensor)
        return LoraUpdate(self.entries, tensors, self.shapes)


@torch.no_grad()
def lora_update(model) -> LoraUpdate:
    """The active LoRA adapter of a peft model (plain or FSDP2-sharded), in the base checkpoint's names.

    A collective under FSDP2: every rank calls it, and every rank gets the full factors (gathered one at a time).
    Linear/Embedding LoRA: the factors ``B``, ``A`` and peft's scaling. LoRA on parameters (fused MoE experts):
    per checkpoint tensor (one expert's gate, up or down projection, as transformers' conversion splits the fused
    tensor on ``save_pretrained``) the factors of its block of peft's delta: the block's rows of the expert's
    ``B_e``, the block's columns of its ``A_e`` (gate and up of one expert share ``A_e``, sent once).
    """
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapter = check_supported(model)
    base = model.get_base_model()
    update = LoraUpdate()
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, ParamWrapper):
            if adapter not in module.lora_A:
                continue
            name = normalize_peft_param_name(f"{module_name}.{module.parameter_name}")
            shape = module.get_param().shape
            # peft (get_delta_weight): expert e's delta is B_e @ A_e (out x in) for a 2-D parameter and a 3-D one
            # held experts x out x in, its transpose for one held experts x in x out (peft refuses fan_in_fan_out here)
            product_layout = len(shape) == 2 or module._did_swap_in_out_features
            a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)
            a = a.reshape(module.num_experts, -1, a.shape[-1])  # experts x rank x in
            b = b.reshape(b.shape[0], -1, module.num_experts)  # out x rank x experts
            scale = float(module.scaling[adapter])
            for target, target_shape, block in _checkpoint_blocks(base, name, shape):
                b_rows, a_cols = (block.rows, block.cols) if product_layout else (block.cols, block.rows)
                update.add(
                    {"target": target, "kind": "lora", "scale": scale, "transpose": block.transposed == product_layout},
                    [b[slice(*b_rows), :, block.expert], a[block.expert, :, slice(*a_cols)]],
                    target_shape,
                )
            continue
        embedding = adapter in getattr(module, "lora_embedding_A", {})
        if not embedding and adapter not in module.lora_A:
            continue
        if module.lora_bias.get(adapter, False):
            raise UnsupportedAdapterError(f"{module_name}: lora_bias=True is not supported by the {BACKEND} backend")
        if embedding:
            b, a = module.lora_embedding_B[adapter], module.lora_embedding_A[adapter]
        else:
            b, a = module.lora_B[adapter].weight, module.lora_A[adapter].weight
        target = f"{normalize_peft_param_name(module_name)}.weight"
        # peft: Linear delta = transpose(B @ A, fan_in_fan_out) * s; Embedding delta = (B @ A).T * s
        transpose = embedding or bool(getattr(module, "fan_in_fan_out", False))
        update.add(
            {"target": target, "kind": "lora", "scale": float(module.scaling[adapter]), "transpose": transpose},
            [_full(b), _full(a)],
            module.get_base_layer().weight.shape,
        )
    return update


@torch.no_grad()
def full_update(model, dtype: torch.dtype | None = None) -> LoraUpdate:
    """The whole merged model (`merge.merged_lora_params`: every tensor, LoRA merged in, in ``dtype``) as an
    update of kind "weight": what a full-weight sync sends. A collective under FSDP2, like ``lora_update``."""
    from merge import merged_lora_params

    update = LoraUpdate()
    for name, tensor in merged_lora_params(model, dtype=dtype):
        update.add({"target": name, "kind": "weight"}, [tensor.contiguous()], tensor.shape)
    return update
