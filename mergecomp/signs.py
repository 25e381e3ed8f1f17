"""Sign bits shared by the sign-based compressors (signSGD, Signum, EF-SignSGD, 1-bit SGD).

``pack_signs(x)`` sends 1 bit per element: ``x >= 0`` (so zeros travel as ``+``), packed 8 per
byte with :mod:`mergecomp.bitpack`.  ``decode_signs`` maps the bits straight to two values
(``±1``, ``±scale``, or two means) in one gather, and ``majority_vote`` takes the sign of the sum
of several ranks' ``±1`` (ties give 0).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from . import bitpack, native
from .compressor import Compressor, Payload
from .workspace import fresh

__all__ = ["pack_signs", "decode_signs", "majority_vote", "SignValueCompressor"]

Value = Union[float, torch.Tensor]


def pack_signs(tensor: torch.Tensor, empty: Optional[Callable] = None) -> torch.Tensor:
    """``ceil(n / 8)`` uint8 bytes holding ``tensor >= 0`` (1 bit per element).  ``empty(numel,
    dtype, device)`` allocates them (e.g. a compressor's :meth:`~mergecomp.Compressor.scratch`);
    default ``torch.empty``."""
    if native.usable(tensor):
        out = (empty or fresh)(bitpack.packed_size(tensor.numel(), 1), torch.uint8, tensor.device)
        return native.pack_signs(tensor.reshape(-1), out)[0]
    return bitpack.pack(tensor >= 0, 1)


def decode_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype,
                 negative: Value = -1.0, positive: Value = 1.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``positive`` where the element was >= 0, ``negative`` elsewhere: ``numel`` values in
    ``dtype`` on ``packed``'s device (the two values may be floats or 0-d/1-element tensors),
    written into ``out`` when given."""
    values = torch.stack([torch.as_tensor(v, device=packed.device).reshape(())
                          for v in (negative, positive)]).to(dtype)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed.device)
    if native.usable(out, packed):
        return native.decode_codes(packed, 1, numel, values, out)
    return bitpack.decode(packed, 1, numel, values, out=out)


def majority_vote(packed: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sign of the sum of the ranks' ``±1`` votes: ``+1``, ``-1``, or 0 on a tie.

    Counts the ``+`` votes ``c`` per element in bytes (int32 above 255 voters); the vote is
    ``sign(2 c - voters) = sign(c - voters / 2)``, written into ``out`` (``numel`` elements
    of ``dtype``) when given.
    """
    voters = len(packed)
    if voters == 0:
        raise ValueError("majority_vote needs at least one payload")
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed[0].device)
    if (voters <= native.MAX_VOTERS and native.usable(out, *packed)
            and all(p.dtype == torch.uint8 and p.numel() * 8 >= numel for p in packed)):
        return native.majority_vote(packed, numel, out)
    ones = bitpack.unpack(packed[0], 1, numel)
    if voters > 1:
        ones = ones.to(torch.uint8 if voters < 256 else torch.int32, copy=True)
        for p in packed[1:]:
            ones.add_(bitpack.unpack(p, 1, numel))
    # Convert first: mixed integer/float arithmetic takes a slow path (5x slower here).
    return out.copy_(ones).sub_(voters / 2).sign_()


class SignValueCompressor(Compressor):
    """Payload ``(sign bits, values...)`` where each rank's bits decode to two values of its
    own (:meth:`sides`); not summable.  The aggregate sums the ranks' decodes in one pass
    (natively on fp32 CPU) instead of one full-size decode and add per rank."""

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
        device = payloads[0][0].device
        out = self.scratch(numel, dtype, device)
        packed = [p[0] for p in payloads]
        if native.usable(out, *packed):
            values = torch.stack([torch.stack([v.reshape(()) for v in self.sides(p)]) for p in payloads])
            return native.sign_sum(packed, values, numel, 1.0 / world_size if average else 1.0, out)
        total = self.decompress(payloads[0], ctx)
        for payload in payloads[1:]:
            negative, positive = self.sides(payload)
            total.add_(decode_signs(payload[0], numel, dtype, negative, positive))
        return total.div_(world_size) if average else total
