"""TernGrad (Wen et al., 2017): stochastic ternarization to ``{-s, 0, s}``.

The gradient is first clipped at ``clip`` standard deviations (GRACE style: ``c = clip * std(x)``,
``x`` clamped to ``[-c, c]``; skipped when ``clip`` is None, when the std is 0 or for fewer than
2 elements).  With ``s = max |x|``, element ``x`` is sent as ``t = sign(x) * Bernoulli(|x| / s)``
and decodes to ``t * s``: unbiased whenever no element was clipped.

Wire: the codes ``t + 1`` at 2 bits per element packed in uint8 (``ceil(n / 4)`` bytes) and the
fp32 scalar ``s``: ``2 + 32 / n`` bits per element.  Not summable (allgathered).
Defaults: ``clip=2.5``; no error-feedback memory.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import ShardedEncode
from mergecomp.compressors.base.compressor import Payload, SummedDecode
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import codes_sum, moments, stochastic_codes
from mergecomp.kernels.quantize import work_dtype
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("terngrad")
class TernGradCompressor(SummedDecode, ShardedEncode):
    shard_alignment = 4  # whole bytes of 2-bit codes
    passes = CodecPasses(compress=2, aggregate=1)  # the moments, then the codes

    def __init__(self, clip: Optional[float] = 2.5) -> None:
        super().__init__()
        if clip is not None:
            clip = float(clip)
            if not clip > 0:
                raise ValueError(f"terngrad clip must be positive or None, got {clip}")
        self.clip = clip

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Ctx]:
        numel = tensor.numel()
        work = work_dtype(tensor.dtype)
        if numel == 0:
            return (bitpack.pack(tensor.new_empty(0, dtype=torch.uint8), 2),
                    torch.zeros(1, device=tensor.device)), (numel, tensor.dtype)
        stats = moments(tensor)  # min, max and squared deviations: one pass where fused
        low, high = stats.extremes()
        s = torch.maximum(-low, high)
        if self.clip is not None and numel >= 2:
            std = (stats.deviations() / (numel - 1)).sqrt()
            bound = std * self.clip
            s = torch.where(bound > 0, torch.minimum(s, bound), s)
        scalar = s.to(torch.float32).reshape(1)
        # t = sign(x) * Bernoulli(min(|x|, s) / s), against the scalar as it is sent (fp32):
        # |x| / s clamped to 1 does the clipping.
        sent = scalar.to(work)
        inverse = torch.where(sent > 0, 1 / sent, 0)
        # t + 1 in {0, 1, 2}, packed at 2 bits
        codes = stochastic_codes(tensor, inverse, numel, -1, 1, 1, 2, empty=self.scratch)
        return (codes, scalar), (numel, tensor.dtype)

    def decode_sum(self, payloads: Sequence[Payload], ctx: Ctx, divisor: int) -> torch.Tensor:
        """Every payload's codes decoded to its own ``{-s, 0, s}``, in one pass
        (:func:`mergecomp.kernels.codecs.codes_sum`)."""
        numel, dtype = ctx
        values = []
        for _, scalar in payloads:
            s = scalar.to(dtype).reshape(())
            zero = torch.zeros((), dtype=dtype, device=s.device)
            values.append(torch.stack([-s, zero, s, zero]))
        return codes_sum([packed for packed, _ in payloads], 2, values, numel, divisor,
                         self.scratch(numel, dtype, payloads[0][0].device))
