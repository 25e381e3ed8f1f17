"""QSGD (Alistarh et al., 2017): unbiased stochastic quantization to ``levels`` levels.

The flat buffer is cut into buckets of ``bucket_size`` elements (the last one may be shorter;
``None``: one bucket for the whole group), each with its own L2 norm.  Element ``x`` of a bucket
with norm ``||v||`` is sent as the signed level ``sign(x) * l``, ``l`` the stochastic rounding of
``levels * |x| / ||v||`` (so ``E[decode] = x``), and decodes to ``sign(x) * l * ||v|| / levels``.

Wire: the levels in ``[-levels, levels]`` as int8 (8 bits per element) or, for ``levels <= 7``,
as 4-bit codes ``l + levels`` packed two to a byte (low nibble first), and one fp32 norm per
bucket: ``8 + 32 / bucket_size`` or ``4 + 32 / bucket_size`` bits per element.  Not summable
(allgathered, or two-phase).
Defaults: ``levels=64`` (at most 127), ``bucket_size=512``; no error-feedback memory.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import ShardedEncode
from mergecomp.compressors.base.compressor import Payload, SummedDecode
from mergecomp.kernels.codecs import levels_sum, qsgd_encode
from mergecomp.kernels.quantize import work_dtype
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("qsgd")
class QSGDCompressor(SummedDecode, ShardedEncode):
    def __init__(self, levels: int = 64, bucket_size: Optional[int] = 512) -> None:
        super().__init__()
        if isinstance(levels, bool) or int(levels) != levels or not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be an integer in [1, 127], got {levels!r}")
        if bucket_size is not None and (isinstance(bucket_size, bool)
                                        or int(bucket_size) != bucket_size or bucket_size < 1):
            raise ValueError(f"qsgd bucket_size must be a positive integer or None, got {bucket_size!r}")
        self.levels = int(levels)
        self.bits = 4 if self.levels <= 7 else 8  # bits per level on the wire
        self.bucket_size = None if bucket_size is None else int(bucket_size)

    @property
    def shard_alignment(self) -> int:
        """Two-phase shards hold whole buckets."""
        return self.bucket_size or 1

    def _bucket_size(self, numel: int) -> int:
        return numel if self.bucket_size is None else self.bucket_size

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Ctx]:
        numel = tensor.numel()
        payload = qsgd_encode(tensor, self._bucket_size(numel), self.levels, self.bits,
                              empty=self.scratch)
        return payload, (numel, tensor.dtype)

    def decode_sum(self, payloads: Sequence[Payload], ctx: Ctx, divisor: int) -> torch.Tensor:
        """Every payload's levels times its own steps, in one pass (:func:`mergecomp.kernels.codecs.levels_sum`)."""
        numel, dtype = ctx
        work = work_dtype(dtype)
        steps = [norms.to(work) / self.levels for _, norms in payloads]
        out = self.scratch(numel, dtype, payloads[0][0].device)
        shift = 0 if self.bits == 8 else self.levels
        return levels_sum([level for level, _ in payloads], steps, self._bucket_size(numel), out, self.bits, shift,
                          divisor)
