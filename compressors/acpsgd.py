"""ACP-SGD (Zhang et al., 2023): PowerSGD's rank-``r`` approximation with one factor per step,
alternating, so one allreduce of half PowerSGD's traffic.

The matrices and raw tensors are PowerSGD's (:mod:`mergecomp.compressors.base.low_rank`:
``shapes`` splits the group; each tensor with at least 2 dims is ``M``, ``shape[0]`` x the
rest, compressed where ``(m + n) r * min_compression_rate < m n`` and ``r < min(m, n)``).
Every rank holds the same orthonormal factor of each matrix from the step before, and the
steps alternate:

* holding ``Q`` (``n x r``): send ``P = M Q`` (``m x r``); the result is ``P_sum Q^T``, and the
  orthogonalized ``P_sum`` is held next;
* holding ``P`` (``m x r``): send ``Q = M^T P`` (``n x r``); the result is ``P Q_sum^T``, and the
  orthogonalized ``Q_sum`` is held next.

Each is the projection of the summed ``M`` onto the held factor's space, so the error feedback
(residual memory) keeps what a step leaves out.  The first factor is a ``Q`` drawn from a
generator seeded with ``stable_seed(name, 0)`` and orthogonalized, the same on every rank.  One
summed (allreduced) round per step: the sent factor of every matrix, then the raw elements, in
the gradient's dtype (``factor_dtype="bf16"``: bf16, this rank's rounding kept in its decode).
Wire per element of a matrix: ``r / n`` and ``r / m`` of the gradient's element on alternate
steps (PowerSGD's of rank ``r / 2`` on average over two steps).

State (``state[name]``): ``factor`` (every batch's held factor, flat, in the payload's order:
:mod:`mergecomp.compressors.base.low_rank`; work dtype) and
``holds_p`` (0-d bool on the CPU: the factor is ``P``), advanced by ``aggregate`` once per step
on every rank.  A group whose layout changed starts again from the drawn ``Q``.
Defaults: ``rank=4``, ``min_compression_rate=2``, ``factor_dtype=None``, memory ``residual``.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import SubtractsDecode
from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.low_rank import (FACTOR_DTYPES, Layout, check_options, factor_views, group_layout,
                                                 matrices, multiply, new_payload, orthogonalize, raw_views,
                                                 write_group)
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.sparse import stable_seed
from mergecomp.kernels.quantize import work_dtype
from mergecomp.registry import register_compressor


class ACPCtx(NamedTuple):
    name: str
    numel: int
    dtype: torch.dtype  # the gradient's
    wire: torch.dtype  # the payload's
    layout: Layout
    tensor: torch.Tensor  # this rank's input
    holds: str  # "q": P is sent; "p": Q is sent
    held: Tuple[torch.Tensor, ...]  # each batch's held orthonormal factors (k x rows x r, work dtype)


@register_compressor("acpsgd")
class ACPSGDCompressor(Compressor, SubtractsDecode):
    summable = True
    default_memory = "residual"
    low_rank = True
    #: the payload sizes repeat every two steps (P, then Q)
    period = 2
    #: one product reads the group; decoding writes it once (the average taken on the factor)
    passes = CodecPasses(compress=1, decompress=1, aggregate=1)

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, factor_dtype: Optional[str] = None) -> None:
        super().__init__()
        min_compression_rate = check_options("acpsgd", rank, min_compression_rate, factor_dtype)
        self.rank = int(rank)
        self.min_compression_rate = min_compression_rate
        self.factor_dtype = factor_dtype

    def _held(self, name: str, layout: Layout, work: torch.dtype,
              device: torch.device) -> Tuple[str, List[torch.Tensor]]:
        """Which factor group ``name`` holds and each batch's (orthonormal) view of it."""
        state = self.group_state(name)
        factor = state.get("factor")
        holds = "p" if factor is not None and bool(state["holds_p"]) else "q"  # a CPU scalar: no device sync
        if factor is None or factor.numel() != (layout.q_numel if holds == "q" else layout.p_numel):
            generator = torch.Generator().manual_seed(stable_seed(name, 0))  # first step, or a new layout
            drawn = torch.randn(layout.q_numel, generator=generator, dtype=torch.float64)
            factor = torch.cat([q.reshape(-1) for q in orthogonalize(factor_views(drawn, layout, "q"))])
            holds = "q"
        state["holds_p"] = torch.tensor(holds == "p")
        state["factor"] = factor.to(device=device, dtype=work)
        return holds, factor_views(state["factor"], layout, holds)

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, ACPCtx]:
        numel = tensor.numel()
        layout = group_layout("acpsgd", name, numel, shapes, self.rank, self.min_compression_rate)
        wire = FACTOR_DTYPES.get(self.factor_dtype, tensor.dtype)
        work = work_dtype(tensor.dtype)
        holds, held = ("q", []) if not layout.matrices else self._held(name, layout, work, tensor.device)
        ctx = ACPCtx(name, numel, tensor.dtype, wire, layout, tensor, holds, tuple(held))
        payload, sent = new_payload(layout, self._sent(ctx), wire, tensor, raw_from=tensor)
        ms = matrices(tensor, layout, work)
        multiply(sent, ms if holds == "q" else [m.transpose(1, 2) for m in ms], held)
        return (payload,), ctx

    @staticmethod
    def _sent(ctx: ACPCtx) -> str:
        """The factor this step sends: ``"p"`` while ``Q`` is held, else ``"q"``."""
        return "p" if ctx.holds == "q" else "q"

    def _split(self, flat: torch.Tensor, ctx: ACPCtx) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """A payload (this rank's or the sum): each batch's sent factor (in the work dtype) and
        each batch of raw runs."""
        k = ctx.layout.p_numel if ctx.holds == "q" else ctx.layout.q_numel
        sent = factor_views(flat[:k].to(work_dtype(ctx.dtype)), ctx.layout, self._sent(ctx))
        return sent, raw_views(flat[k:], ctx.layout)

    @staticmethod
    def _pairs(sent: Sequence[torch.Tensor], ctx: ACPCtx, divisor: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(P, Q)`` of each batch: the sent factor (divided by ``divisor``) with the held one."""
        sent = [s if divisor == 1 else s / divisor for s in sent]
        return [(s, h) if ctx.holds == "q" else (h, s) for s, h in zip(sent, ctx.held)]

    def _decode(self, sent: Sequence[torch.Tensor], raw: Sequence[torch.Tensor], ctx: ACPCtx,
                divisor: int) -> torch.Tensor:
        """The group from a payload's :meth:`_split`: ``P Q^T`` of each matrix and the raw runs,
        divided by ``divisor``."""
        out = self.scratch(ctx.numel, ctx.dtype, ctx.tensor.device)
        write_group(self._pairs(sent, ctx, divisor), raw, ctx.layout, ctx.numel, out, divisor=divisor)
        return out

    def decompress(self, payload: Payload, ctx: ACPCtx) -> torch.Tensor:
        """This rank's own approximation (its sent factor with the held one) and its raw
        elements, as sent."""
        return self._decode(*self._split(payload[0], ctx), ctx, 1)

    def subtract_decoded(self, payload: Payload, ctx: ACPCtx, minuend: torch.Tensor,
                         out: Callable[[], torch.Tensor]) -> bool:
        """``minuend`` less :meth:`decompress`, each element written once; fp32 groups only."""
        if work_dtype(ctx.dtype) != ctx.dtype or minuend.numel() != ctx.numel:
            return False
        sent, raw = self._split(payload[0], ctx)
        write_group(self._pairs(sent, ctx), raw, ctx.layout, ctx.numel, out(), minuend)
        return True

    def aggregate(self, payloads: Sequence[Payload], ctx: ACPCtx, world_size: int, average: bool) -> torch.Tensor:
        """The summed approximation (averaged over ``world_size`` with ``average``); the summed
        factor, orthogonalized, is held for the next step."""
        summed = payloads[0][0]
        for payload in payloads[1:]:
            summed = summed + payload[0]
        sent, raw = self._split(summed, ctx)
        out = self._decode(sent, raw, ctx, world_size if average else 1)
        if ctx.layout.matrices:
            state = self.group_state(ctx.name)
            state["factor"] = torch.cat([f.reshape(-1) for f in orthogonalize(sent)])
            state["holds_p"] = torch.tensor(ctx.holds == "q")
        return out
