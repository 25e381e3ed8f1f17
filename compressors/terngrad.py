"""TernGrad (Wen et al., 2017): stochastic ternarization to ``{-s, 0, s}``.

The gradient is first clipped at ``clip`` standard deviations (GRACE style: ``c = clip * std(x)``,
``x`` clamped to ``[-c, c]``; skipped when ``clip`` is None, when the std is 0 or for fewer than
2 elements).  With ``s = max |x|``, element ``x`` is sent as ``t = sign(x) * Bernoulli(|x| / s)``
and decodes to ``t * s``: unbiased whenever no element was clipped.

Wire: the codes ``t + 1`` at 2 bits per element packed in uint8 (``ceil(n / 4)`` bytes) and the
fp32 scalar ``s``: ``2 + 32 / n`` bits per element.  Not summable (allgathered).
Defaults: ``clip=2.5``; no error-feedback memory.
"""
from typing import Optional, Sequence, Tuple

import torch

from mergecomp import bitpack
from mergecomp.compressor import Compressor, Payload
from mergecomp.quantize import stochastic_round, work_dtype
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("terngrad")
class TernGradCompressor(Compressor):
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
        x = tensor.to(work_dtype(tensor.dtype))
        if self.clip is not None and numel >= 2:
            bound = x.std() * self.clip
            bound = torch.where(bound > 0, bound, torch.inf)
            x = torch.maximum(torch.minimum(x, bound), -bound)
        magnitude = x.abs()
        scalar = (magnitude.max() if numel else x.new_zeros(())).to(torch.float32).reshape(1)
        # Bernoulli(|x| / s) against the scalar as it is sent (fp32), clamped to [0, 1].
        s = scalar.to(x.dtype)
        prob = torch.where(s > 0, magnitude / s, 0).clamp_(max=1)
        codes = stochastic_round(prob).mul_(x.sign()).add_(1)
        return (bitpack.pack(codes, 2), scalar), (numel, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scalar = payload
        numel, dtype = ctx
        work = work_dtype(dtype)
        codes = bitpack.unpack(packed, 2, numel).to(work).sub_(1)
        return codes.mul_(scalar.to(work)).to(dtype)
