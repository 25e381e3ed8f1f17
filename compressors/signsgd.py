"""signSGD with majority vote (Bernstein et al., 2018).

Wire: the sign bits of the gradient, 1 bit per element packed in uint8 (``ceil(n / 8)`` bytes);
zeros are sent as ``+``, so an element decodes to ``+1`` or ``-1`` (never 0).  Two-phase: each
rank sends the vote on its shard exactly, as 2-bit codes.  Not summable:
payloads are allgathered and :meth:`aggregate` returns the majority vote, the sign of the sum of
the ranks' signs (0 on a tie), whether or not ``average`` is set.  No options; no memory.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import PartsEncode, ShardedEncode
from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.memory import Residual
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.sign_value import SignParts
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import (compensated_sign_parts, decode_codes, decode_signs, majority_vote, pack_signs,
                                      parts_served)
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]
#: what :meth:`SignSGDCompressor.part_code` returns: the factory of a group's part-by-part kernel
#: (as :class:`~mergecomp.compressors.base.sign_value.SignParts` takes it) and what to do once
#: every part was found finite
PartCode = Tuple[Callable[[torch.Tensor, torch.Tensor], Tuple[Any, None]], Callable[[], None]]


class VoteCodec(Compressor):
    """The phase-2 codec of the majority-vote compressors (two-phase scheme): the vote (``-1``,
    ``0``, ``+1``) sent exactly as 2-bit codes ``vote + 1`` packed 4 per byte.  Summing is not
    needed: each rank sends the vote of its own shard."""

    name = "vote"
    lossless = True  # no second-stage residual to keep
    passes = CodecPasses(compress=3)  # the int8 cast, the shift by 1, the packing

    def compress(self, tensor: torch.Tensor, name: str, shapes=None) -> Tuple[Payload, Ctx]:
        codes = tensor.to(torch.int8).add_(1).view(torch.uint8)
        return (bitpack.pack(codes, 2),), (tensor.numel(), tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        numel, dtype = ctx
        values = torch.arange(-1, 3, dtype=dtype, device=payload[0].device)  # made there: no host copy
        values[3:].zero_()  # the codes -1, 0, 1 and the unused 2 decode to -1, 0, 1, 0
        return decode_codes(payload[0], 2, numel, values, self.scratch(numel, dtype, payload[0].device))


@register_compressor("signsgd")
class SignSGDCompressor(Compressor, ShardedEncode, PartsEncode):
    votes = True
    default_memory = "none"
    shard_alignment = 8  # whole bytes of sign bits
    #: the votes counted and signed in one pass; the parts' code has no memory to update
    passes = CodecPasses(aggregate=1, fused_update=0)
    takes_residual = False  # its parts are the gradient's own bits

    def sign_bits(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The packed sign bits sent for ``tensor`` (subclasses: of a momentum, e.g.)."""
        return pack_signs(tensor, empty=self.scratch)[0]

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Ctx]:
        return (self.sign_bits(tensor, name),), (tensor.numel(), tensor.dtype)

    def compress_fused_parts(self, like: torch.Tensor, name: str, parts: int,
                             residual: Optional[Residual]) -> Optional[SignParts]:
        """Without error feedback (no ``residual``), where a kernel serves ``like``: the bits
        each gradient's own pass writes as it arrives (:class:`SignParts` over
        :meth:`part_code`), the payload :meth:`compress` gives the whole group."""
        code = self.part_code(like, name) if residual is None and parts_served(like) else None
        if code is None:
            return None
        kernel, done = code
        ctx = (like.numel(), like.dtype)

        def sent(bits: torch.Tensor, stats: Any) -> Tuple[Payload, Ctx, Callable[[], None]]:
            done()
            return (bits,), ctx, lambda: None

        return SignParts(self, like, parts, kernel, sent)

    def part_code(self, like: torch.Tensor, name: str) -> Optional[PartCode]:
        """The part-by-part counterpart of :meth:`sign_bits` for group ``name`` (``like``: a flat
        fp32 CPU tensor of its numel), or None where there is none: here the gradient's own bits
        (no side sums, only the NaN/Inf check), nothing to do when done."""
        def kernel(bits: torch.Tensor, sums: torch.Tensor) -> Tuple[Any, None]:
            return compensated_sign_parts(like.numel(), None, (0.0, 0.0), None, bits, sums, side_sums=False), None

        return kernel, lambda: None

    def second_phase(self) -> Compressor:
        return VoteCodec()

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        numel, dtype = ctx
        return decode_signs(payload[0], numel, dtype, out=self.scratch(numel, dtype, payload[0].device))

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx, world_size: int,
                  average: bool) -> torch.Tensor:
        numel, dtype = ctx
        return majority_vote([p[0] for p in payloads], numel, dtype,
                             out=self.scratch(numel, dtype, payloads[0][0].device))
