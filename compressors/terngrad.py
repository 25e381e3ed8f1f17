"""TernGrad (Wen et al., 2017): stochastic ternarization to ``{-s, 0, s}``.

The gradient is first clipped at ``clip`` standard deviations (GRACE style: ``c = clip * std(x)``,
``x`` clamped to ``[-c, c]``; skipped when ``clip`` is None, when the std is 0 or for fewer than
2 elements).  With ``s = max |x|``, element ``x`` is sent as ``t = sign(x) * Bernoulli(|x| / s)``
and decodes to ``t * s``: unbiased whenever no element was clipped.

Wire: the codes ``t + 1`` and the fp32 scalar ``s``; with ``packing="2bit"`` (the default) the
codes at 2 bits each (``ceil(n / 4)`` bytes, :mod:`mergecomp.kernels.bitpack`): ``2 + 32 / n``
bits per element; with ``packing="base3"`` five to a byte in base 3 (``ceil(n / 5)`` bytes,
:mod:`mergecomp.kernels.tritpack`): ``1.6 + 32 / n`` bits, a fifth fewer bytes, drawn and decoded
in one pass each as the 2-bit codes are.  Not summable (allgathered).
Defaults: ``clip=2.5``, ``packing="2bit"``; no error-feedback memory.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import ShardedEncode
from mergecomp.compressors.base.compressor import Payload, SummedDecode
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.kernels import tritpack
from mergecomp.kernels.codecs import codes_sum, moments, stochastic_codes, stochastic_trits, trits_sum
from mergecomp.kernels.quantize import work_dtype
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]
#: codes per byte of each packing
_PACKINGS = {"2bit": 4, "base3": tritpack.PER_BYTE}


@register_compressor("terngrad")
class TernGradCompressor(SummedDecode, ShardedEncode):
    def __init__(self, clip: Optional[float] = 2.5, packing: str = "2bit") -> None:
        super().__init__()
        if clip is not None:
            clip = float(clip)
            if not clip > 0:
                raise ValueError(f"terngrad clip must be positive or None, got {clip}")
        if packing not in _PACKINGS:
            raise ValueError(f"terngrad packing must be one of {tuple(_PACKINGS)}, got {packing!r}")
        self.clip = clip
        self.packing = packing
        self.shard_alignment = _PACKINGS[packing]  # shards of whole bytes of codes
        # the moments, then the codes; the decode
        self.passes = CodecPasses(compress=2, aggregate=1)

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Ctx]:
        numel = tensor.numel()
        work = work_dtype(tensor.dtype)
        if numel == 0:
            return (tensor.new_empty(0, dtype=torch.uint8), torch.zeros(1, device=tensor.device)), (numel, tensor.dtype)
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
        # t + 1 in {0, 1, 2}, packed at 2 bits or in base 3 as they are drawn
        if self.packing == "2bit":
            codes = stochastic_codes(tensor, inverse, numel, -1, 1, 1, 2, empty=self.scratch)
        else:
            codes = stochastic_trits(tensor, inverse, numel, -1, 1, 1, empty=self.scratch)
        return (codes, scalar), (numel, tensor.dtype)

    def decode_sum(self, payloads: Sequence[Payload], ctx: Ctx, divisor: int) -> torch.Tensor:
        """Every payload's codes decoded to its own ``{-s, 0, s}`` and summed, in one pass
        (:func:`mergecomp.kernels.codecs.codes_sum`, :func:`mergecomp.kernels.codecs.trits_sum`)."""
        numel, dtype = ctx
        values = []
        for _, scalar in payloads:
            s = scalar.to(dtype).reshape(())
            zero = torch.zeros((), dtype=dtype, device=s.device)
            values.append(torch.stack([-s, zero, s] if self.packing == "base3" else [-s, zero, s, zero]))
        packed, out = [codes for codes, _ in payloads], self.scratch(numel, dtype, payloads[0][0].device)
        if self.packing == "2bit":
            return codes_sum(packed, 2, values, numel, divisor, out)
        return trits_sum(packed, values, numel, divisor, out)
