"""Sparse payloads (values + int32 indices, or a bitmap), written once for every sparsifier.

Wire format of a :class:`SparseCompressor` payload: ``(values, indices)``, ``values`` in the
gradient's dtype (top-k's ``value_dtype`` casts them), ``k = max(1, ceil(ratio * numel))`` of them
(:func:`num_selected`, exact), and ``indices`` either int32 (k of them, in any order) or, with
``index_format="bitmap"``, a bitmap of ``ceil(numel / 8)`` uint8 bytes (bit ``i`` of byte
``i // 8``'s little end: element ``i`` is sent) with the values in ascending index order;
``"auto"`` sends the bitmap where it is smaller (``32 k > numel``: a ratio above 1/32).  Both are
functions of numel, ratio and the settings only, so every rank sends the same number of bytes, and
both decode to the same tensor, bit for bit.  The decode tells them apart by the dtype.

Also here: a fast top-k selection for large merged buffers (a threshold estimated from a strided
sample, then an exact top-k among the candidates above it, found by
:func:`mergecomp.kernels.codecs.indices_above` without a full-size ``abs()`` or slow ``nonzero`` pass)
and the shared-seed index trick used by rand-k.
"""
from __future__ import annotations

import functools
import math
import zlib
from fractions import Fraction
from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import SparseEntries
from mergecomp.compressors.base.compressor import Compressor, Payload, check_ratio
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import indices_above, largest, zero_
from mergecomp.kernels.transfer import pinned, to_device

__all__ = [
    "SparseCompressor",
    "INDEX_FORMATS",
    "num_selected",
    "topk_indices",
    "topk_abs_indices",
    "sample_rank",
    "sample_stride",
    "sample_threshold",
    "candidate_capacity",
    "shared_random_indices",
    "stable_seed",
]

#: Candidates kept above the sampled threshold, relative to k: enough to rarely fall back to an
#: exact top-k over the whole buffer, few enough that the final top-k among them is cheap.
_OVERSAMPLE = 1.3
_MIN_SAMPLE = 16384


def num_selected(numel: int, ratio: float) -> int:
    """How many elements a sparsifier with ``ratio`` keeps out of ``numel``:
    ``min(numel, max(1, ceil(ratio * numel)))``, the product taken exactly in integers with
    ``ratio`` read as the shortest decimal that gives the float (its ``repr``: 0.07 is 7/100,
    so 200 elements keep 14, where the float product 14.000000000000002 would round up)."""
    numerator, denominator = _as_decimal(float(ratio))
    return min(numel, max(1, -(-numerator * numel // denominator)))


@functools.lru_cache(maxsize=64)
def _as_decimal(ratio: float) -> Tuple[int, int]:
    """``ratio`` as the fraction ``(numerator, denominator)`` of its ``repr`` (parsed once)."""
    exact = Fraction(repr(ratio))
    return exact.numerator, exact.denominator


def topk_indices(magnitude: torch.Tensor, k: int, method: str = "exact") -> torch.Tensor:
    """Indices (int64) of the ``k`` largest entries of the non-negative 1-D ``magnitude``.

    ``method="exact"`` is ``torch.topk``.  ``method="threshold"`` returns the same set (ties
    aside) faster on large buffers: it estimates the k-th largest value from a strided sample,
    keeps the candidates above it and runs the exact top-k only among those (on fp32 CPU
    tensors by the kernel of :func:`mergecomp.kernels.codecs.largest`: ascending, of equal values the first),
    falling back to the full top-k when the estimate kept fewer than ``k``.
    """
    return _topk(magnitude, k, method, absolute=False)


def topk_abs_indices(tensor: torch.Tensor, k: int, method: str = "exact") -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of the 1-D ``tensor`` largest in magnitude.

    The same as ``topk_indices(tensor.abs(), k, method)``, but the threshold method never
    materializes ``|tensor|``: the magnitudes are taken chunk by chunk, while still in cache.
    """
    return _topk(tensor, k, method, absolute=True)


def _topk(values: torch.Tensor, k: int, method: str, absolute: bool) -> torch.Tensor:
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    if method not in ("exact", "threshold"):
        raise ValueError(f"top-k selection must be 'exact' or 'threshold', got {method!r}")
    if method == "threshold":
        sample = values[::sample_stride(n, k)]
        threshold = sample_threshold(sample.abs() if absolute else sample, k, n)
        candidates = indices_above(values, threshold, absolute, candidate_capacity(k))
        if candidates.numel() >= k:
            return largest(candidates, values.index_select(0, candidates), k, absolute)
    magnitude = values.abs() if absolute else values
    return magnitude.topk(k, sorted=False).indices


def sample_stride(n: int, k: int) -> int:
    """The stride of the sample that estimates the top-``k`` threshold of ``n`` elements: a prime,
    so that a sample of a matrix laid out row by row meets every column (a stride sharing a
    factor with the row length sees only some: on GPT-2's 64-wide token embedding a stride of
    160 saw two columns of 64, and the threshold kept half of 3.2 M elements as candidates)."""
    return _prime_at_least(max(1, n // min(n, max(_MIN_SAMPLE, math.ceil(200 * n / k)))))


@functools.lru_cache(maxsize=256)
def _prime_at_least(m: int) -> int:
    """The smallest prime ``>= m`` (1 for 1: every element)."""
    if m <= 2:
        return m
    candidate = m | 1
    while any(candidate % d == 0 for d in range(3, math.isqrt(candidate) + 1, 2)):
        candidate += 2
    return candidate


def sample_rank(sampled: int, k: int, n: int) -> int:
    """The rank (1: the largest) in a sample of ``sampled`` of ``n`` elements of the value that
    about ``_OVERSAMPLE * k`` of them reach."""
    return min(sampled, math.ceil(_OVERSAMPLE * k * sampled / n))


def sample_threshold(sample: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """0-d: the value that about ``_OVERSAMPLE * k`` of the ``n`` elements reach, estimated
    from the (magnitude) ``sample`` of them taken every :func:`sample_stride` elements."""
    return sample.topk(sample_rank(sample.numel(), k, n), sorted=False).values.min()


def candidate_capacity(k: int) -> int:
    """How many elements above the sampled threshold a scan makes room for at first."""
    return int(2 * _OVERSAMPLE * k + 1024)


def stable_seed(name: str, step: int) -> int:
    """A seed that is the same on every rank and process for group ``name`` at ``step``."""
    return (zlib.crc32(name.encode()) * 1_000_003 + step) % (2**63 - 1)


def shared_random_indices(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """``k`` indices drawn uniformly with replacement from ``[0, numel)``, identical on all ranks
    for the same seed whatever their device (a CPU generator; moved to ``device`` without the
    host waiting for it, :mod:`mergecomp.kernels.transfer`)."""
    generator = torch.Generator().manual_seed(seed)
    return to_device(torch.randint(numel, (k,), generator=generator, pin_memory=pinned(device)), device)


#: how a sparse payload names its elements (module docstring)
INDEX_FORMATS = ("int32", "bitmap", "auto")


class SparseCompressor(Compressor, SparseEntries):
    """Keeps ``k`` elements chosen by :meth:`select`; payload ``(values, indices)`` with
    ``index_format``'s indices (module docstring)."""

    default_memory = "residual"
    #: decompress: zeroing the dense output (the scatter touches k entries; none where the
    #: workspace lends it zeroed); aggregate: one scatter of every rank's entries into it
    passes = CodecPasses(aggregate=1)

    def __init__(self, ratio: float = 0.01, index_format: str = "int32") -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        if index_format not in INDEX_FORMATS:
            raise ValueError(f"{type(self).__name__} index_format must be one of {INDEX_FORMATS}, "
                             f"got {index_format!r}")
        self.index_format = index_format

    def select(self, tensor: torch.Tensor, k: int, name: str) -> torch.Tensor:
        """Indices of the ``k`` elements of ``tensor`` to send."""
        raise NotImplementedError

    def sends_bitmap(self, numel: int, k: int) -> bool:
        """Whether a payload of ``k`` of ``numel`` elements names them by a bitmap."""
        return self.index_format == "bitmap" or (self.index_format == "auto" and 32 * k > numel)

    def _payload(self, values: torch.Tensor, indices: torch.Tensor, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of distinct ``indices`` as they go on the wire: int32 indices, or
        the bitmap with the values in ascending index order."""
        if not self.sends_bitmap(numel, values.numel()):
            return values, indices.to(torch.int32)
        ordered, order = indices.long().sort()
        mask = torch.zeros(numel, dtype=torch.bool, device=indices.device)
        mask[ordered] = True
        return values[order], bitpack.pack(mask, 1)

    def compress(
        self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]] = None
    ) -> Tuple[Payload, Tuple[int, torch.dtype]]:
        indices = self.select(tensor, num_selected(tensor.numel(), self.ratio), name)
        values = tensor.index_select(0, indices)
        return self._payload(values, indices, tensor.numel()), (tensor.numel(), tensor.dtype)

    @staticmethod
    def _indices(indices: torch.Tensor, numel: int) -> torch.Tensor:
        """int64 indices of a payload's ``indices`` (int32, or a bitmap: ascending)."""
        if indices.dtype == torch.uint8:
            return bitpack.unpack(indices, 1, numel).nonzero().view(-1)
        return indices.long()

    def decompress(self, payload: Payload, ctx: Tuple[int, torch.dtype]) -> torch.Tensor:
        values, indices = payload
        return self._scatter(values, self._indices(indices, ctx[0]), ctx)

    def _scatter(self, values: torch.Tensor, indices: torch.Tensor, ctx: Tuple[int, torch.dtype]) -> torch.Tensor:
        numel, dtype = ctx
        dense = self.scratch(numel, dtype, values.device)
        if self.workspace is None or not self.workspace.holds_zeros(dense):
            zero_(dense)
        # scatter_add_ accumulates repeated indices like index_add_, and is faster on CPU.
        return dense.scatter_add_(0, indices, values.to(dtype))

    def sent_entries(self, payload: Payload, ctx: Tuple[int, torch.dtype]):
        values, indices = payload  # one rank's selection: the indices are distinct
        return self._indices(indices, ctx[0]), values.to(ctx[1])

    def aggregate(self, payloads, ctx, world_size, average):
        # One scatter-add over all ranks' entries instead of one dense decode per rank.
        values = torch.cat([p[0] for p in payloads]).to(ctx[1])  # values sent in half precision: divided in full
        indices = torch.cat([self._indices(p[1], ctx[0]) for p in payloads])
        if average:  # k values per rank, not the dense buffer
            values = values.div_(world_size)
        return self._scatter(values, indices, ctx)
