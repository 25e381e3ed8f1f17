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

from mergecomp import bitpack, native
from mergecomp.compressor import Compressor, Payload
from mergecomp.quantize import stochastic_round_, work_dtype
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
        work = work_dtype(tensor.dtype)
        if numel == 0:
            return (bitpack.pack(tensor.new_empty(0, dtype=torch.uint8), 2),
                    torch.zeros(1, device=tensor.device)), (numel, tensor.dtype)
        fast = native.usable(tensor)
        if fast:  # min, max, sum and sum of squares in one pass
            low, high, total, squares = native.moments(tensor).to(work).unbind()
        else:
            low, high = torch.aminmax(tensor)
        s = torch.maximum(-low, high).to(work)
        if self.clip is not None and numel >= 2:
            if not fast:  # two fused reductions: 3x cheaper than x.std()
                total = tensor.sum(dtype=work)
                squares = torch.linalg.vector_norm(tensor, dtype=work).square()
            std = ((squares - total * total / numel).clamp_min(0) / (numel - 1)).sqrt()
            bound = std * self.clip
            s = torch.where(bound > 0, torch.minimum(s, bound), s)
        scalar = s.to(torch.float32).reshape(1)
        # t = sign(x) * Bernoulli(min(|x|, s) / s), against the scalar as it is sent (fp32):
        # |x| / s clamped to 1 does the clipping.
        sent = scalar.to(work)
        inverse = torch.where(sent > 0, 1 / sent, 0)
        if fast:  # t + 1 in {0, 1, 2}, drawn and packed in one pass
            packed = self.scratch(bitpack.packed_size(numel, 2), torch.uint8, tensor.device)
            return (native.stochastic_codes(tensor, inverse, numel, -1, 1, 1, 2, packed),
                    scalar), (numel, tensor.dtype)
        scaled = self.scratch(numel, work, tensor.device)
        torch.mul(tensor, inverse, out=scaled).clamp_(-1, 1)
        codes = stochastic_round_(scaled, shift=1, empty=self.scratch)  # t + 1 in {0, 1, 2}
        return (bitpack.pack(codes, 2), scalar), (numel, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scalar = payload
        numel, dtype = ctx
        s = scalar.to(dtype).reshape(())
        zero = torch.zeros((), dtype=dtype, device=s.device)
        values = torch.stack([-s, zero, s, zero])
        out = self.scratch(numel, dtype, packed.device)
        if native.usable(out, packed):
            return native.decode_codes(packed, 2, numel, values, out)
        return bitpack.decode(packed, 2, numel, values, out=out)
