"""How much of the LoRA update survives the cast of the merged weights to the engine's dtype (opt-in telemetry)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["MergePrecisionStats"]


class MergePrecisionStats:
    """How much of the LoRA update survives the cast of the merged weights to the engine's dtype (opt-in telemetry).

    Pass one to :func:`merged_lora_params` (``precision_stats=``); it accumulates, over the merged tensors (the
    weights the adapter changes: LoRA Linear/Embedding weights, a LoRA bias, ``target_parameters`` such as fused
    MoE experts), with every quantity in fp32:

    - ``Δ = scaling · B @ A`` (peft's delta; recomputed from fp32 factors where peft's is below fp32),
    - ``d = cast(W + Δ) − cast(W)``: what the engine's weights actually move by (``cast``: to the yielded dtype;
      ``W``: the base weight as the merge reads it, e.g. bf16, so ``cast(W) = W`` when both are bf16).

    :meth:`metrics` gives ``sync_delta_kept = Σ⟨d, Δ⟩ / Σ‖Δ‖²`` (the share of the update that survives; 1 when
    nothing is lost), ``sync_delta_rel_err = sqrt(Σ‖d − Δ‖² / Σ‖Δ‖²)``, and ``sync_delta_zeroed``: the fraction of
    the entries with ``Δ ≠ 0`` whose ``d`` is 0 (updates rounded away entirely). NaN where undefined (``Δ = 0``
    everywhere, e.g. peft's initial ``B = 0``).

    Measured on a sample: every ``row_stride``-th row of each merged tensor (rows: the last dimension's vectors, so a
    weight's output rows, each expert's rows of a fused expert tensor, every ``row_stride``-th entry of a bias), and
    all of it with ``row_stride=1``. The figures are ratios of sums over those rows, estimates of the whole's; with
    the default stride of 32 they cost about 5% of a bf16 sync instead of doubling it (bench/bench_sync.py measures
    both, and how far the sample's figures are from the whole's: 1e-4 or less).

    Meant for a target dtype below fp32 (bf16/fp16 engines), though it measures whatever dtype is yielded (with fp32 it
    only sees fp32 rounding). The sums are kept on the tensors' device as float64 (per tensor, or per chunk of
    ``CPU_CHUNK`` elements on CPU, reduced in fp32 by ``torch.dot``, accumulated in float64) so that the merge never
    waits on the device; :meth:`metrics` reads them (one sync). Under FSDP2 each rank measures the rows it merges
    (its own rows of a decoder layer's weights, or all of a group it unshards), and the walk sums the ranks' pieces
    (:meth:`add_across_ranks`), so every rank ends with the same figures. Accumulates across calls until :meth:`reset`.
    """

    FIELDS = ("dot", "delta_sq", "err_sq", "nonzero", "zeroed")  # Σ⟨d,Δ⟩, Σ‖Δ‖², Σ‖d−Δ‖², #(Δ≠0), #(Δ≠0, d=0)
    CPU_CHUNK = 1 << 18  # elements (1 MiB in fp32)
    ROW_STRIDE = 32

    def __init__(self, row_stride: int = ROW_STRIDE) -> None:
        if not isinstance(row_stride, int) or row_stride < 1:
            raise ValueError(f"row_stride={row_stride!r}: measure every row_stride-th row, an int >= 1")
        self.row_stride = row_stride
        self.sums: torch.Tensor | None = None  # float64 [len(FIELDS)], on the device of the first merged tensor
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # sampled rows not yet summed
        self.pending_entries = 0
        self.entries = 0  # entries of the merged tensors measured (the sampled rows')
        self.tensors = 0  # merged tensors measured
        self.reducing: list[tuple[dist.Work, torch.Tensor]] = []  # sums over ranks in flight (`add_across_ranks`)

    def reset(self) -> None:
        self.__init__(self.row_stride)

    def sampled_rows(self, tensor: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """The rows of ``tensor`` (viewed as rows of its last dimension) whose index, counted from ``first_row`` (where
        ``tensor`` is a piece of a larger one), is a multiple of ``row_stride``; flat, and always a copy (the tensor
        may be a buffer that FSDP2 frees or the merge overwrites)."""
        rows = tensor.detach().reshape(-1, tensor.shape[-1] if tensor.dim() > 1 else 1)
        # clone before flattening: a single sampled row, or a 1-D tensor's, would flatten to a view
        return rows[(-first_row) % self.row_stride :: self.row_stride].clone().flatten()

    @torch.no_grad()
    def add(self, weight: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor, first_row: int = 0) -> None:
        """Account one merged tensor (or the piece of one starting at row ``first_row``): ``weight`` = W (the weight
        without the update, cast here to ``merged``'s dtype), ``delta`` = Δ, ``merged`` = cast(W + Δ) (what is
        yielded); on the sampled rows only (`sampled_rows`)."""
        self.add_sampled(*(self.sampled_rows(t, first_row) for t in (weight, delta, merged)))

    @torch.no_grad()
    def add_sampled(self, weight: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor) -> None:
        """`add` for rows already sampled (`sampled_rows` of each): a caller that merges in place samples Δ first.
        The rows wait until ``CPU_CHUNK`` entries have come, then are summed together: a few operations per chunk
        instead of a dozen per tensor (the small tensors' cost was those operations' own, not their arithmetic)."""
        self.pending.append((weight.to(merged.dtype), delta, merged))
        self.pending_entries += delta.numel()
        self.entries += delta.numel()
        self.tensors += 1
        if self.pending_entries >= self.CPU_CHUNK:
            self._sum_pending()

    def _sum_pending(self) -> None:
        if not self.pending:
            return
        base, delta, merged = (torch.cat(parts) for parts in zip(*self.pending))  # exact: cat only upcasts
        self.pending, self.pending_entries = [], 0
        # on CPU in cache-sized chunks: each chunk's passes then read memory once (2.5x faster on a Qwen3-4B MLP
        # weight); on a GPU in one piece (few kernels, no chunk loop)
        step = max(1, self.CPU_CHUNK if delta.device.type == "cpu" else delta.numel())
        rows = [
            self._sums(base[start : start + step], delta[start : start + step].float(), merged[start : start + step])
            for start in range(0, delta.numel(), step)
        ]
        row = torch.stack(rows).sum(0) if rows else torch.zeros(len(self.FIELDS), dtype=torch.float64)
        if self.sums is None:
            self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=row.device)
        self.sums += row.to(self.sums.device)

    @staticmethod
    def _sums(base: torch.Tensor, delta: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """``FIELDS`` of one flat piece, float64 (the dots in fp32)."""
        moved = merged.to(torch.float32, copy=True)  # one fresh fp32 buffer: d, then d − Δ
        moved.sub_(base)  # in fp32 (a bf16 base is upcast exactly)
        dot, delta_sq = torch.dot(moved, delta), torch.dot(delta, delta)
        # Δ = 0 leaves an entry as it was (cast(W + 0) = cast(W)), so {d ≠ 0} ⊂ {Δ ≠ 0} and the entries that
        # Δ ≠ 0 leaves unmoved number count(Δ ≠ 0) − count(d ≠ 0)
        nonzero = torch.count_nonzero(delta)
        counts = torch.stack([nonzero, nonzero - torch.count_nonzero(moved)])
        err = moved.sub_(delta)
        sums = torch.stack([dot, delta_sq, torch.dot(err, err)])
        return torch.cat([sums.to(torch.float64), counts.to(torch.float64)])

    @torch.no_grad()
    def add_across_ranks(self, pieces: MergePrecisionStats, group: dist.ProcessGroup, device: torch.device) -> None:
        """Add ``pieces``' sums over the ranks of ``group`` (a collective, started here and finished when the figures
        are read, so that the merge does not wait for it): each rank measured its own rows of the same tensors, so the
        sums and entries add up and the tensors count once. ``device``: where ``group`` reduces."""
        pieces._sum_pending()
        local = torch.zeros(len(self.FIELDS) + 1, dtype=torch.float64, device=device)
        if pieces.sums is not None:
            local[:-1] = pieces.sums
        local[-1] = pieces.entries
        self.reducing.append((dist.all_reduce(local, group=group, async_op=True), local))
        self.tensors += pieces.tensors

    def _finish_reductions(self) -> None:
        for work, summed in self.reducing:
            work.wait()
            if self.sums is None:
                self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=summed.device)
            self.sums += summed[:-1].to(self.sums.device)
            self.entries += int(summed[-1].item())
        self.reducing = []

    def totals(self) -> dict[str, float]:
        """The raw float64 sums (``FIELDS``; zeros before any merged tensor), with ``entries`` and ``tensors``."""
        self._sum_pending()
        self._finish_reductions()
        values = [0.0] * len(self.FIELDS) if self.sums is None else self.sums.tolist()
        return {**dict(zip(self.FIELDS, values)), "entries": self.entries, "tensors": self.tensors}

    def metrics(self) -> dict[str, float]:
        """``sync_delta_kept``, ``sync_delta_rel_err``, ``sync_delta_zeroed`` (see the class docstring)."""
        t = self.totals()
        nan = float("nan")
        return {
            "sync_delta_kept": t["dot"] / t["delta_sq"] if t["delta_sq"] > 0 else nan,
            "sync_delta_rel_err": (t["err_sq"] / t["delta_sq"]) ** 0.5 if t["delta_sq"] > 0 else nan,
            "sync_delta_zeroed": t["zeroed"] / t["nonzero"] if t["nonzero"] > 0 else nan,
        }
