"""PowerSGD (Vogels et al., 2019): rank-``r`` approximation by one step of power iteration.

``shapes`` splits the flat buffer into its parameters (``None``: a single 1-D tensor).  A tensor
with at least 2 dims is viewed as the matrix ``M`` (``shape[0]`` x the rest) and compressed when
``(m + n) * rank * min_compression_rate < m * n`` and ``rank < min(m, n)``; every other tensor
is sent raw.  Two summed (allreduced) rounds, in the gradient's dtype:

1. ``P = M @ Q`` for every matrix (``m x r``), followed by the raw elements.
2. Each summed ``P`` is orthogonalized (QR); ``Q = M^T @ P`` (``n x r``) for every matrix.

The result is ``P @ Q_sum^T`` for the matrices and the round-1 sum for the raw elements.  The
summed ``Q`` (columns normalized, which leaves the iteration unchanged) is the warm start of the
next step, in ``state[name]["q"]`` (every batch's ``Q`` concatenated, flat, as the payload orders
them: :mod:`mergecomp.compressors.base.low_rank`); the first ``Q`` is
drawn from a generator seeded with ``stable_seed(name, 0)``, so it is the same on every rank.
Wire, per element of a compressed matrix: ``(m + n) * r / (m * n)`` of the gradient's element.
fp16/bf16 gradients are multiplied in fp32 and sent in their own dtype.  ``factor_dtype="bf16"``
sends both rounds (factors and raw elements) in bf16 instead: half the bits of fp32 gradients,
so rank ``2r`` for the wire of rank ``r``; this rank's rounding of ``Q`` and of its raw elements
is in what it decodes, hence in the error-feedback memory (the rounding of the sums is not).
fp16 is not offered: the summed ``Q`` of the second round could overflow it unchecked.

Note: ``ctx`` holds this rank's input tensor (round 2 needs the local ``M``, and ``decompress``
of the local payload returns this rank's own approximation, local raw elements included, for
the error-feedback memory); the input must stay unchanged until the last round.
Defaults: ``rank=1``, ``warm_start=True``, ``min_compression_rate=2``, ``factor_dtype=None``
(the gradient's dtype), memory ``residual``.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import SubtractsDecode
from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.low_rank import (FACTOR_DTYPES, Layout, check_options, factor_views, group_layout,
                                                 matrices, multiply, new_payload, orthogonalize, raw_runs,
                                                 raw_views, write_group)
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.sparse import stable_seed
from mergecomp.kernels.quantize import work_dtype
from mergecomp.kernels.transfer import pinned, to_device
from mergecomp.registry import register_compressor


class PowerSGDCtx(NamedTuple):
    name: str
    numel: int
    dtype: torch.dtype  # the gradient's
    wire: torch.dtype  # the payloads'
    layout: Layout
    tensor: torch.Tensor  # this rank's input
    ps: Tuple[torch.Tensor, ...] = ()  # round 2: each batch's orthogonalized summed P (k x m x r, work dtype)
    raw_sum: Optional[torch.Tensor] = None  # round 2: the summed raw elements


@register_compressor("powersgd")
class PowerSGDCompressor(Compressor, SubtractsDecode):
    summable = True
    rounds = 2
    default_memory = "residual"
    low_rank = True
    #: ``M @ Q`` and ``M^T @ P`` read the group once each; decoding writes it once (the average
    #: is taken on Q and the raw runs as they are written)
    passes = CodecPasses(compress=1, next_round=1, decompress=1, aggregate=1)

    def __init__(self, rank: int = 1, warm_start: bool = True,
                 min_compression_rate: float = 2.0, factor_dtype: Optional[str] = None) -> None:
        super().__init__()
        min_compression_rate = check_options("powersgd", rank, min_compression_rate, factor_dtype)
        if not isinstance(warm_start, bool):
            raise ValueError(f"powersgd warm_start must be a bool, got {warm_start!r}")
        self.rank = int(rank)
        self.warm_start = warm_start
        self.min_compression_rate = min_compression_rate
        self.factor_dtype = factor_dtype

    # -- helpers ------------------------------------------------------------------------------
    def _initial_q(self, name: str, layout: Layout, work: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        state = self.group_state(name)
        q = state.get("q")
        if self.warm_start and q is not None and q.numel() == layout.q_numel:
            if q.dtype != work or q.device != device:
                q = state["q"] = q.to(device=device, dtype=work)
            return q
        step = 0
        if not self.warm_start:
            counter = state.setdefault("step", torch.zeros((), dtype=torch.int64))
            step = int(counter)  # a CPU scalar: no device synchronization
            counter.add_(1)
        generator = torch.Generator().manual_seed(stable_seed(name, step))
        q = to_device(torch.randn(layout.q_numel, generator=generator, pin_memory=pinned(device)), device).to(work)
        if self.warm_start:
            state["q"] = q
        return q

    # -- the pipeline -------------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, PowerSGDCtx]:
        numel = tensor.numel()
        layout = group_layout("powersgd", name, numel, shapes, self.rank, self.min_compression_rate)
        wire = FACTOR_DTYPES.get(self.factor_dtype, tensor.dtype)
        ctx = PowerSGDCtx(name, numel, tensor.dtype, wire, layout, tensor)
        work = work_dtype(tensor.dtype)
        payload, ps = new_payload(layout, "p", wire, tensor, raw_from=tensor)
        if layout.matrices:
            q = self._initial_q(name, layout, work, tensor.device)
            multiply(ps, matrices(tensor, layout, work), factor_views(q, layout, "q"))
        return (payload,), ctx

    def next_round(self, summed: Payload, ctx: PowerSGDCtx) -> Tuple[Payload, PowerSGDCtx]:
        layout, work = ctx.layout, work_dtype(ctx.dtype)
        flat = summed[0]
        p_numel = layout.p_numel
        ps = orthogonalize(factor_views(flat[:p_numel].to(work), layout, "p"))
        payload, qs = new_payload(layout, "q", ctx.wire, flat)
        multiply(qs, [m.transpose(1, 2) for m in matrices(ctx.tensor, layout, work)], ps)
        return (payload,), ctx._replace(ps=tuple(ps), raw_sum=flat[p_numel:])

    def _reconstruct(self, q_flat: torch.Tensor, ctx: PowerSGDCtx, raw: Sequence[torch.Tensor],
                     divisor: int = 1) -> torch.Tensor:
        """``P @ Q^T / divisor`` for each matrix and ``raw / divisor`` for the raw runs, each
        written once into a group-sized tensor (the division goes to the small ``Q``)."""
        if ctx.raw_sum is None:
            raise ValueError("powersgd decodes only the last round's payload")
        out = self.scratch(ctx.numel, ctx.dtype, q_flat.device)
        q_flat = q_flat.to(work_dtype(ctx.dtype))
        write_group(self._pairs(q_flat if divisor == 1 else q_flat / divisor, ctx), raw, ctx.layout, ctx.numel, out,
                    divisor=divisor)
        return out

    @staticmethod
    def _pairs(q_flat: torch.Tensor, ctx: PowerSGDCtx) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(P, Q)`` of each batch: the round-2 ``P``'s with the ``Q``'s in ``q_flat`` (any
        dtype; in the work dtype)."""
        return list(zip(ctx.ps, factor_views(q_flat.to(work_dtype(ctx.dtype)), ctx.layout, "q")))

    def decompress(self, payload: Payload, ctx: PowerSGDCtx) -> torch.Tensor:
        """This rank's own approximation: ``P @ Q_local^T`` and its own raw elements, as sent."""
        return self._reconstruct(payload[0], ctx, raw_runs(ctx.tensor, ctx.layout, ctx.wire))

    def subtract_decoded(self, payload: Payload, ctx: PowerSGDCtx, minuend: torch.Tensor,
                         out: Callable[[], torch.Tensor]) -> bool:
        """``minuend - P @ Q_local^T`` for the matrices (each written once) and ``minuend`` less
        its own raw elements as sent (zeros where finite and sent in fp32) for the raw runs; fp32
        groups only."""
        if ctx.raw_sum is None or work_dtype(ctx.dtype) != ctx.dtype or minuend.numel() != ctx.numel:
            return False
        write_group(self._pairs(payload[0], ctx), raw_runs(ctx.tensor, ctx.layout, ctx.wire), ctx.layout, ctx.numel,
                    out(), minuend)
        return True

    def aggregate(self, payloads: Sequence[Payload], ctx: PowerSGDCtx, world_size: int,
                  average: bool) -> torch.Tensor:
        q_sum = payloads[0][0]
        for payload in payloads[1:]:
            q_sum = q_sum + payload[0]
        layout = ctx.layout
        raw = [] if ctx.raw_sum is None else raw_views(ctx.raw_sum, layout)
        out = self._reconstruct(q_sum, ctx, raw, world_size if average else 1)
        if self.warm_start and layout.matrices:
            work = work_dtype(ctx.dtype)
            q = q_sum.to(work).clone()
            for qs in factor_views(q, layout, "q"):
                norms = torch.linalg.vector_norm(qs, dim=1, keepdim=True)
                qs.div_(norms.clamp_min_(torch.finfo(work).tiny))
            self.group_state(ctx.name)["q"] = q
        return out
