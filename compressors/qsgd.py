"""QSGD (Alistarh et al., 2017): unbiased stochastic quantization to ``levels`` levels.

The flat buffer is cut into buckets of ``bucket_size`` elements (the last one may be shorter;
``None``: one bucket for the whole group), each with its own L2 norm.  Element ``x`` of a bucket
with norm ``||v||`` is sent as the signed level ``sign(x) * l``, ``l`` the stochastic rounding of
``levels * |x| / ||v||`` (so ``E[decode] = x``), and decodes to ``sign(x) * l * ||v|| / levels``.

Wire: int8 levels in ``[-levels, levels]`` (8 bits per element) and one fp32 norm per bucket:
``8 + 32 / bucket_size`` bits per element.  Not summable (allgathered).
Defaults: ``levels=64`` (at most 127), ``bucket_size=512``; no error-feedback memory.
"""
import math
from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressor import Compressor, Payload
from mergecomp.quantize import stochastic_round, work_dtype
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("qsgd")
class QSGDCompressor(Compressor):
    def __init__(self, levels: int = 64, bucket_size: Optional[int] = 512) -> None:
        super().__init__()
        if isinstance(levels, bool) or int(levels) != levels or not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be an integer in [1, 127], got {levels!r}")
        if bucket_size is not None and (isinstance(bucket_size, bool)
                                        or int(bucket_size) != bucket_size or bucket_size < 1):
            raise ValueError(f"qsgd bucket_size must be a positive integer or None, got {bucket_size!r}")
        self.levels = int(levels)
        self.bucket_size = None if bucket_size is None else int(bucket_size)

    def _buckets(self, numel: int) -> Tuple[int, int]:
        """(number of buckets, bucket length) for a buffer of ``numel`` elements."""
        if self.bucket_size is None:
            return 1, numel
        return math.ceil(numel / self.bucket_size), self.bucket_size

    def _padded(self, flat: torch.Tensor, count: int, size: int) -> torch.Tensor:
        pad = count * size - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(count, size)

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Ctx]:
        numel = tensor.numel()
        count, size = self._buckets(numel)
        x = self._padded(tensor.to(work_dtype(tensor.dtype)), count, size)
        # Quantize against the norm as it is sent (fp32), so the decode is unbiased.
        norms = torch.linalg.vector_norm(x, dim=1).to(torch.float32)
        norm = norms.to(x.dtype).unsqueeze(1)
        scaled = torch.where(norm > 0, x.abs() / norm, 0).mul_(self.levels)
        level = stochastic_round(scaled).clamp_(max=self.levels)
        level = level.mul_(x.sign()).view(-1)[:numel].to(torch.int8)
        return (level, norms), (numel, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        level, norms = payload
        numel, dtype = ctx
        count, size = self._buckets(numel)
        work = work_dtype(dtype)
        x = self._padded(level.to(work), count, size)
        x = x.mul_(norms.to(work).unsqueeze(1) / self.levels)
        return x.view(-1)[:numel].to(dtype)
