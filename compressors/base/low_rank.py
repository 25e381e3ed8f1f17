"""What the low-rank compressors (PowerSGD, ACP-SGD) share: which tensors of a group are
compressed as matrices, batched views of them and of the flat factors, their orthogonalization,
the raw runs as sent, and a decode (the products ``P Q^T`` and the raw runs) written into the
group.

A tensor with at least 2 dims is the matrix ``M`` (``shape[0]`` x the rest) and compressed at
rank ``r`` where ``(m + n) r * min_compression_rate < m n`` and ``r < min(m, n)``; every other
tensor is sent raw, adjacent ones as one run.  Matrices of one shape at equal spacing (the same
weight of consecutive layers) form a :class:`Batch`, and so do raw runs of one length: each is
worked on as one ``k x m x n`` (or ``k x length``) strided view of the group, so a step costs
O(batches) operations, not O(tensors).  Factors concatenate every batch's ``P`` (``k x m x r``)
or ``Q`` (``k x n x r``) flat, batch after batch in the order of their first tensors; the raw
elements follow the same order.  ``factor_dtype`` names the dtype the payloads travel in (None:
the gradient's); fp16 is not offered: a sum of factors could overflow it where nothing checks.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.kernels import codecs

__all__ = ["FACTOR_DTYPES", "Batch", "Layout", "check_options", "group_layout", "factor_views", "orthogonalize",
           "matrices", "multiply", "new_payload", "raw_runs", "raw_views", "write_group"]

#: ``factor_dtype`` names and the dtypes the payloads travel in
FACTOR_DTYPES = {"bf16": torch.bfloat16}


class Batch(NamedTuple):
    """``count`` tensors of one ``shape`` in a group: the first at element ``offset``, each one
    ``stride`` elements after the one before."""
    offset: int
    stride: int
    count: int
    shape: Tuple[int, ...]  # (m, n): matrices; (length,): raw runs

    @property
    def numel(self) -> int:
        return self.count * math.prod(self.shape)

    def of(self, group: torch.Tensor) -> torch.Tensor:
        """The members in the flat contiguous ``group``: a ``(count, *shape)`` strided view
        (ValueError for any other ``group``: a view of it would read the wrong elements)."""
        if group.dim() != 1 or not group.is_contiguous():
            raise ValueError(f"low-rank compressors take a flat contiguous group, got shape {tuple(group.shape)} "
                             f"with strides {group.stride()}")
        strides = (self.stride, self.shape[1], 1) if len(self.shape) == 2 else (self.stride, 1)
        return group.as_strided((self.count, *self.shape), strides, group.storage_offset() + self.offset)


class Layout(NamedTuple):
    matrices: Tuple[Batch, ...]  # the compressed tensors, shape (m, n)
    raw: Tuple[Batch, ...]  # the raw runs, shape (length,)
    rank: int

    @property
    def p_numel(self) -> int:
        return sum(b.count * b.shape[0] for b in self.matrices) * self.rank

    @property
    def q_numel(self) -> int:
        return sum(b.count * b.shape[1] for b in self.matrices) * self.rank


def check_options(name: str, rank: int, min_compression_rate: float, factor_dtype: Optional[str]) -> float:
    """ValueError naming the option where one is bad; returns ``min_compression_rate`` as a float."""
    if isinstance(rank, bool) or int(rank) != rank or rank < 1:
        raise ValueError(f"{name} rank must be a positive integer, got {rank!r}")
    min_compression_rate = float(min_compression_rate)
    if not min_compression_rate >= 0:
        raise ValueError(f"{name} min_compression_rate must be >= 0, got {min_compression_rate}")
    if factor_dtype is not None and factor_dtype not in FACTOR_DTYPES:
        raise ValueError(f"{name} factor_dtype must be None or one of {tuple(FACTOR_DTYPES)} (fp16 could "
                         f"overflow in the summed factors), got {factor_dtype!r}")
    return min_compression_rate


def group_layout(who: str, group: str, numel: int, shapes: Optional[Sequence[torch.Size]], rank: int,
                 min_rate: float) -> Layout:
    """The :class:`Layout` of group ``group`` of ``numel`` elements, tensors ``shapes`` (None:
    one 1-D tensor); ValueError where they do not add up."""
    shapes = ((numel,),) if shapes is None else tuple(tuple(int(d) for d in s) for s in shapes)
    if sum(math.prod(s) for s in shapes) != numel:
        raise ValueError(f"{who}: shapes {shapes} do not add up to the {numel} elements of group {group!r}")
    return _layout(shapes, rank, min_rate)


@functools.lru_cache(maxsize=256)
def _layout(shapes: Tuple[Tuple[int, ...], ...], rank: int, min_rate: float) -> Layout:
    matrices, raw, offset = [], [], 0
    for shape in shapes:
        size = math.prod(shape)
        m = shape[0] if len(shape) >= 2 else 0
        n = size // m if m else 0
        if m and rank < min(m, n) and (m + n) * rank * min_rate < m * n:
            matrices.append((offset, (m, n)))
        elif size:
            if raw and raw[-1][0] + raw[-1][1][0] == offset:
                raw[-1] = (raw[-1][0], (raw[-1][1][0] + size,))
            else:
                raw.append((offset, (size,)))
        offset += size
    return Layout(_batched(matrices), _batched(raw), rank)


#: the later members of its shape a batch's first member tries as the next one (the same-shape
#: tensors of one layer, e.g. attention's four projections, are the candidates to skip)
_STRIDE_CANDIDATES = 8


def _batched(members: Sequence[Tuple[int, Tuple[int, ...]]]) -> Tuple[Batch, ...]:
    """``(offset, shape)`` members, by offset, as batches ordered by their first members: the
    first member not yet in a batch starts one and takes the longest run at equal spacing among
    the next members of its shape (so two tensors of one shape in each layer make two batches
    a layer apart, not pairs)."""
    by_shape: Dict[Tuple[int, ...], List[int]] = {}
    for offset, shape in members:
        by_shape.setdefault(shape, []).append(offset)
    batches = []
    for shape, offsets in by_shape.items():
        free = set(offsets)
        for i, first in enumerate(offsets):
            if first not in free:
                continue
            best = [first]
            for later in [o for o in offsets[i + 1:] if o in free][:_STRIDE_CANDIDATES]:
                run, step = [first], later - first
                while run[-1] + step in free:
                    run.append(run[-1] + step)
                if len(run) > len(best):
                    best = run
            free.difference_update(best)
            batches.append(Batch(first, best[1] - first if len(best) > 1 else math.prod(shape), len(best), shape))
    return tuple(sorted(batches))


def matrices(group: torch.Tensor, layout: Layout, work: torch.dtype) -> List[torch.Tensor]:
    """Each batch of the group's matrices (k x m x n) in the ``work`` dtype (views where it is
    the group's)."""
    return [batch.of(group).to(work) for batch in layout.matrices]


def factor_views(flat: torch.Tensor, layout: Layout, which: str) -> List[torch.Tensor]:
    """Views of ``flat`` as each batch's ``P`` (``which="p"``: k x m x r) or ``Q`` (``"q"``: k x n x r)."""
    dim = {"p": 0, "q": 1}[which]
    views, offset = [], 0
    for batch in layout.matrices:
        rows = batch.shape[dim]
        size = batch.count * rows * layout.rank
        views.append(flat[offset:offset + size].view(batch.count, rows, layout.rank))
        offset += size
    return views


def orthogonalize(factors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Orthonormal bases (reduced QR) of each batch of ``rows x r`` matrices in ``factors``."""
    return [torch.linalg.qr(f).Q for f in factors]


def raw_runs(tensor: torch.Tensor, layout: Layout, wire: torch.dtype) -> List[torch.Tensor]:
    """Each batch of raw runs of the group ``tensor`` as sent (k x length): rounded to ``wire``
    (views where it is their dtype)."""
    return [batch.of(tensor).to(wire) for batch in layout.raw]


def raw_views(flat: torch.Tensor, layout: Layout) -> List[torch.Tensor]:
    """Views of ``flat`` (the raw elements of a payload) as each batch of raw runs (k x length)."""
    return [run.view(batch.count, -1) for batch, run in zip(layout.raw, flat.split([b.numel for b in layout.raw]))]


def new_payload(layout: Layout, which: str, wire: torch.dtype, like: torch.Tensor,
                raw_from: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """A fresh flat ``wire`` payload (fresh: the allreduce sums in place) for each batch's factor
    ``which``, with views of it as those factors (:func:`factor_views`, left to fill); with
    ``raw_from`` (a group), that group's raw runs after them, copied in (rounded to ``wire``)."""
    factors = layout.p_numel if which == "p" else layout.q_numel
    total = factors + (0 if raw_from is None else sum(b.numel for b in layout.raw))
    payload = like.new_empty(total, dtype=wire)
    if raw_from is not None:
        for view, batch in zip(raw_views(payload[factors:], layout), layout.raw):
            view.copy_(batch.of(raw_from))
    return payload, factor_views(payload, layout, which)


def multiply(outs: Sequence[torch.Tensor], lefts: Sequence[torch.Tensor], rights: Sequence[torch.Tensor]) -> None:
    """``out = left @ right`` for each batch (k x a x b times k x b x c), rounded to ``out``'s dtype."""
    for out, left, right in zip(outs, lefts, rights):
        if out.dtype == left.dtype:
            torch.bmm(left, right, out=out)
        else:
            out.copy_(torch.bmm(left, right))


def write_group(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], raw: Sequence[torch.Tensor], layout: Layout,
                numel: int, out: torch.Tensor, minuend: Optional[torch.Tensor] = None, divisor: int = 1) -> None:
    """The group-sized ``out`` from a decode: each batch's products ``P @ Q^T`` for its ``(P, Q)``
    in ``pairs`` (k x m x r and k x n x r, work dtype; a factor already divided where the result
    is averaged), each batch of raw runs its values in ``raw`` (k x length) divided by
    ``divisor``; with ``minuend``, ``minuend`` less all that (a residual).  Each element written
    once; the products by :func:`mergecomp.kernels.codecs.low_rank`, past the cache for a large
    group, whose output is read only once it is whole."""
    stream = codecs.streamed(numel)
    for batch, (p, q) in zip(layout.matrices, pairs):
        codecs.low_rank(p, q, batch.of(out), None if minuend is None else batch.of(minuend), stream)
    for batch, values in zip(layout.raw, raw):
        if minuend is None:
            torch.div(values, divisor, out=batch.of(out))
        else:
            torch.sub(batch.of(minuend), values, out=batch.of(out))
