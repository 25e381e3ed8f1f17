"""Compression by casting to a narrower floating dtype (fp16, bf16): summable by allreduce."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import CheckedEncode
from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.kernels.codecs import cast_finite

__all__ = ["CastCompressor"]


class CastCompressor(Compressor, CheckedEncode):
    """Sends ``tensor.to(wire_dtype)``; the sum over ranks is taken in ``wire_dtype``.

    ``prescale`` divides by the given factor before the cast and multiplies back after the sum
    (Horovod's ``gradient_predivide_factor``): set it to the world size when gradients are
    large enough that their fp16 sum could overflow (65504).
    """

    summable = True
    #: dtype on the wire; None keeps the gradient's own dtype
    wire_dtype: Optional[torch.dtype] = None

    def __init__(self, prescale: float = 1.0) -> None:
        super().__init__()
        if prescale <= 0:
            raise ValueError(f"prescale must be positive, got {prescale}")
        self.prescale = float(prescale)
        # compress: one cast or division, none when the tensor itself is sent (for a gradient
        # in another dtype than ``wire_dtype``); decompress: a cast back from ``wire_dtype``, and
        # a multiplication with ``prescale``
        self._passes = CodecPasses(compress=0 if self.lossless else 1,
                                   decompress=(0 if self.wire_dtype is None else 1) + (self.prescale != 1.0))

    @property
    def may_overflow(self) -> bool:
        """A cast to fp16 or bf16, whose largest values are below fp32's."""
        return self.wire_dtype in (torch.float16, torch.bfloat16)

    @property
    def lossless(self) -> bool:
        """The tensor itself is sent (no cast, no prescale)."""
        return self.wire_dtype is None and self.prescale == 1.0

    @property
    def passes(self) -> CodecPasses:
        return self._passes

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, torch.dtype]:
        payload, ctx, _ = self.compress_checked(tensor, name, shapes)
        return payload, ctx

    def compress_checked(self, tensor: torch.Tensor, name: str,
                         shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, torch.dtype, Optional[bool]]:
        """The cast to fp16 of a contiguous fp32 CPU tensor tells, from its own pass, whether
        every value fits (:func:`mergecomp.kernels.codecs.cast_finite`)."""
        wire_dtype = self.wire_dtype or tensor.dtype
        if self.prescale == 1.0 and wire_dtype == tensor.dtype:
            return (tensor,), tensor.dtype, None
        wire = self.scratch(tensor.numel(), wire_dtype, tensor.device)
        if self.prescale == 1.0:
            return (wire,), tensor.dtype, cast_finite(tensor, wire)
        # Divide in the gradient's dtype and round to the wire dtype in the same pass.
        return (torch.div(tensor, self.prescale, out=wire),), tensor.dtype, None

    def decompress(self, payload: Payload, ctx: torch.dtype) -> torch.Tensor:
        wire = payload[0]
        if self.prescale == 1.0:
            return wire if wire.dtype == ctx else self.scratch(wire.numel(), ctx, wire.device).copy_(wire)
        # never in place: a memory decodes this rank's payload before the payload is sent
        out = self.scratch(wire.numel(), ctx, wire.device)
        return torch.mul(wire, self.prescale, out=out) if wire.dtype == ctx else out.copy_(wire).mul_(self.prescale)
