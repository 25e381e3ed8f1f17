"""The base of the sign compressors whose bits decode to two values of each rank's own
(1-bit SGD, EF-SignSGD).  The sign-bit operations themselves are in :mod:`mergecomp.codecs`."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from . import native
from .codecs import compensated_signs, pack_signs, sign_sum
from .codecs.sums import SignStats
from .compressor import Payload, SummedDecode
from .memory import Memory

__all__ = ["SignValueCompressor"]


class SignValueCompressor(SummedDecode):
    """Payload ``(sign bits, values...)`` where each rank's bits decode to two values of its
    own (:meth:`sides`); not summable.  The aggregate sums the ranks' decodes with
    :func:`mergecomp.codecs.sign_sum` (one pass natively on fp32 CPU) instead of one full-size
    decode and add per rank."""

    shard_alignment = 8  # whole bytes of sign bits

    def encode(self, bits: torch.Tensor, stats: SignStats, tensor: torch.Tensor) -> Tuple[Payload, Any]:
        """The payload and ctx of ``tensor`` from its packed sign ``bits`` and their ``stats``."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any]:
        return self.encode(*pack_signs(tensor, empty=self.scratch), tensor)

    #: the fused encode's one pass (it writes the compensated gradient); the memory only notes
    #: the two decoded values
    fused_compress_passes, fused_update_passes = 1, 0

    def compress_fused(self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]],
                       memory: Memory) -> Optional[Tuple[Payload, Any, Callable[[], None]]]:
        """With the residual memory (:meth:`Memory.fused_residual`, its residual carried),
        where a kernel serves the tensors (:func:`mergecomp.codecs.compensated_signs`): one
        pass reads the gradient and the buffer the step before left, and writes the compensated
        gradient into that buffer with the bits and their sums; the memory notes the two values
        the bits decode to, and the residual (the compensated gradient less its decode) is
        folded into the next step's pass.  Compensate, compress and feed make four passes (the
        third decodes the payload into a temporary)."""
        residual = memory.fused_residual(tensor, name, carried=True)
        if residual is None or not native.usable(tensor, *(() if residual.old is None else (residual.old,))):
            return None
        bits, stats = compensated_signs(tensor, residual.old, residual.sides, keep=residual.target(),
                                        empty=self.scratch)
        payload, ctx = self.encode(bits, stats, tensor)
        residual.carry(*(float(v) for v in self.sides(payload)))
        return payload, ctx, lambda: None

    def sides(self, payload: Payload) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(negative, positive)``: what a 0 bit and a 1 bit of this payload decode to."""
        raise NotImplementedError

    def decode_sum(self, payloads: Sequence[Payload], ctx: Any, divisor: int) -> torch.Tensor:
        numel, dtype = ctx
        return sign_sum([p[0] for p in payloads], [self.sides(p) for p in payloads], numel, dtype, divisor=divisor,
                        out=self.scratch(numel, dtype, payloads[0][0].device))
