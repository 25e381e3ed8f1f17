"""How many passes over a group's elements a codec's and a memory's operations make.

The step breakdown (:mod:`mergecomp.exchange.breakdown`) counts them per group: one pass reads or
writes every element of the group once (a fused kernel reading the gradient and writing a
residual is one pass); work on payload-sized data (k sparse entries, packed bits) is not
counted.  Each compressor and memory declares its counts next to its code as ``passes``, for the
fused kernels' path (contiguous fp32 CPU tensors); the eager torch versions elsewhere make more.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["CodecPasses", "MemoryPasses"]


class CodecPasses(NamedTuple):
    """A compressor's passes.

    Attributes:
        compress: over its input, per ``compress`` (or per shard, over the shard).
        decompress: over its output, per payload decoded.
        aggregate: over the group, for the whole ``aggregate`` of any number of payloads, where
            that is one pass; None: one decode per payload, an add for each after the first,
            and a division when averaging.
        next_round: over the group, per ``next_round`` (compressors of several rounds).
        subtract_decoded: over the group, where ``subtract_decoded`` writes a residual.
        fused_compress, fused_update: a fused encode's pass (counted as ``encode``, the
            compensation folded into it) and its memory update (counted as ``memory``).
    """

    compress: float = 1
    decompress: float = 1
    aggregate: Optional[float] = None
    next_round: float = 0
    subtract_decoded: float = 1
    fused_compress: float = 1
    fused_update: float = 1

    def aggregated(self, payloads: int, average: bool) -> float:
        """Passes ``aggregate`` makes over the group for ``payloads`` payloads."""
        if self.aggregate is not None:
            return self.aggregate
        return payloads * self.decompress + payloads - 1 + (1 if average else 0)


class MemoryPasses(NamedTuple):
    """An error-feedback memory's passes over the group: its ``compensate``, its ``update`` (with
    the dense decode it is given), and its ``update_sparse`` (None: a dense zero tensor, then
    ``update``)."""

    compensate: float = 0
    update: float = 0
    update_sparse: Optional[float] = None

    @property
    def sparse_update(self) -> float:
        """Passes of ``update_sparse``."""
        return 1 + self.update if self.update_sparse is None else self.update_sparse
