"""What the low-rank compressors (PowerSGD, ACP-SGD) share: which tensors of a group are
compressed as matrices, views of the flat factors, their orthogonalization, the raw runs as
sent, and a decode (the products ``P Q^T`` and the raw runs) written into the group.

A tensor with at least 2 dims is the matrix ``M`` (``shape[0]`` x the rest) and compressed at
rank ``r`` where ``(m + n) r * min_compression_rate < m n`` and ``r < min(m, n)``; every other
tensor is sent raw.  Factors concatenate every matrix's ``P`` (``m x r``) or ``Q`` (``n x r``)
flat, in matrix order.  ``factor_dtype`` names the dtype the payloads travel in (None: the
gradient's); fp16 is not offered: a sum of factors could overflow it where nothing checks.
"""
from __future__ import annotations

import functools
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.kernels import codecs

__all__ = ["FACTOR_DTYPES", "Layout", "check_options", "group_layout", "factor_views", "orthogonalize",
           "raw_runs", "write_group"]

#: ``factor_dtype`` names and the dtypes the payloads travel in
FACTOR_DTYPES = {"bf16": torch.bfloat16}


class Layout(NamedTuple):
    matrices: Tuple[Tuple[int, int, int], ...]  # (offset, rows, cols) of each compressed tensor
    raw: Tuple[Tuple[int, int], ...]  # (offset, length) of the raw runs, adjacent ones merged
    rank: int

    @property
    def p_numel(self) -> int:
        return sum(m for _, m, _ in self.matrices) * self.rank

    @property
    def q_numel(self) -> int:
        return sum(n for _, _, n in self.matrices) * self.rank


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
            matrices.append((offset, m, n))
        elif size:
            if raw and raw[-1][0] + raw[-1][1] == offset:
                raw[-1] = (raw[-1][0], raw[-1][1] + size)
            else:
                raw.append((offset, size))
        offset += size
    return Layout(tuple(matrices), tuple(raw), rank)


def factor_views(flat: torch.Tensor, layout: Layout, which: str) -> List[torch.Tensor]:
    """Views of ``flat`` as each matrix's ``P`` (``which="p"``: m x r) or ``Q`` (``"q"``: n x r)."""
    dim = {"p": 1, "q": 2}[which]
    views, offset = [], 0
    for matrix in layout.matrices:
        size = matrix[dim] * layout.rank
        views.append(flat[offset:offset + size].view(matrix[dim], layout.rank))
        offset += size
    return views


def orthogonalize(factors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Orthonormal bases (reduced QR) of the ``rows x r`` matrices ``factors``, batched by rows."""
    out: List[Optional[torch.Tensor]] = [None] * len(factors)
    by_rows = {}
    for i, f in enumerate(factors):
        by_rows.setdefault(f.shape[0], []).append(i)
    for members in by_rows.values():
        bases = torch.linalg.qr(torch.stack([factors[i] for i in members])).Q
        for j, i in enumerate(members):
            out[i] = bases[j]
    return out


def raw_runs(tensor: torch.Tensor, layout: Layout, wire: torch.dtype) -> List[torch.Tensor]:
    """The raw runs of ``tensor`` as sent: rounded to ``wire`` (views where it is their dtype)."""
    return [tensor[offset:offset + length].to(wire) for offset, length in layout.raw]


def write_group(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], raw: Sequence[torch.Tensor], layout: Layout,
                numel: int, out: torch.Tensor, minuend: Optional[torch.Tensor] = None, divisor: int = 1) -> None:
    """The group-sized ``out`` from a decode: each matrix ``P @ Q^T`` for its ``(P, Q)`` in
    ``pairs`` (work dtype; a factor already divided where the result is averaged), each raw run
    its values in ``raw`` divided by ``divisor``; with ``minuend``, ``minuend`` less all that
    (a residual).  Each element written once; the products by
    :func:`mergecomp.kernels.codecs.low_rank`, past the cache for a large group, whose output is
    read only once it is whole."""
    stream = codecs.streamed(numel)
    for (offset, m, n), (p, q) in zip(layout.matrices, pairs):
        rows = slice(offset, offset + m * n)
        codecs.low_rank(p, q, out[rows].view(m, n), None if minuend is None else minuend[rows].view(m, n), stream)
    for (offset, length), values in zip(layout.raw, raw):
        run = slice(offset, offset + length)
        if minuend is None:
            torch.div(values, divisor, out=out[run])
        else:
            torch.sub(minuend[run], values, out=out[run])
