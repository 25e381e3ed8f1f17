"""The base of the sign compressors whose bits decode to two values of each rank's own
(1-bit SGD, EF-SignSGD).  The sign-bit operations themselves are in :mod:`mergecomp.codecs`."""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch

from .codecs import decode_signs, sign_sum
from .compressor import Compressor, Payload

__all__ = ["SignValueCompressor"]


class SignValueCompressor(Compressor):
    """Payload ``(sign bits, values...)`` where each rank's bits decode to two values of its
    own (:meth:`sides`); not summable.  The aggregate sums the ranks' decodes with
    :func:`mergecomp.codecs.sign_sum` (one pass natively on fp32 CPU) instead of one full-size
    decode and add per rank."""

    shard_alignment = 8  # whole bytes of sign bits

    def sides(self, payload: Payload) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(negative, positive)``: what a 0 bit and a 1 bit of this payload decode to."""
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        numel, dtype = ctx
        negative, positive = self.sides(payload)
        return decode_signs(payload[0], numel, dtype, negative, positive,
                            out=self.scratch(numel, dtype, payload[0].device))

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, world_size: int,
                  average: bool) -> torch.Tensor:
        numel, dtype = ctx
        return sign_sum([p[0] for p in payloads], [self.sides(p) for p in payloads], numel, dtype,
                        divisor=world_size if average else 1,
                        out=self.scratch(numel, dtype, payloads[0][0].device))

    def aggregate_passes(self, payloads: int, average: bool) -> float:
        return 1  # every rank's bits decoded, summed and divided in one pass
