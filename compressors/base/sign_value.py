"""The base of the sign compressors whose bits decode to two values of each rank's own
(1-bit SGD, EF-SignSGD), and the sign pass part by part as a group's gradients arrive, which
signSGD shares.  The sign-bit operations themselves are in :mod:`mergecomp.kernels.codecs`."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import FusedEncode, FusedParts, PartsEncode, ShardedEncode
from mergecomp.compressors.base.compressor import Compressor, Payload, SummedDecode
from mergecomp.compressors.base.memory import Residual
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import compensated_sign_parts, compensated_signs, pack_signs, parts_served, sign_sum
from mergecomp.kernels.codecs.sums import SignStats, exact_where_overflowed
from mergecomp.kernels.wire import word_padded

__all__ = ["SignValueCompressor", "SignParts"]


class SignValueCompressor(SummedDecode, ShardedEncode, FusedEncode, PartsEncode):
    """Payload ``(sign bits, values...)`` where each rank's bits decode to two values of its
    own (:meth:`sides`); not summable.  The aggregate sums the ranks' decodes with
    :func:`mergecomp.kernels.codecs.sign_sum` (one pass natively on fp32 CPU) instead of one
    full-size decode and add per rank.  With the residual memory, the encode takes the memory's
    work in its own pass, for the whole group or part by part (its residual carried: the
    compensated gradient and the two values its bits decode to)."""

    shard_alignment = 8  # whole bytes of sign bits
    carries_residual = True
    #: the fused encode's one pass (it writes the compensated gradient); the memory only notes
    #: the two decoded values
    passes = CodecPasses(aggregate=1, fused_compress=1, fused_update=0)

    def encode(self, bits: torch.Tensor, stats: SignStats, tensor: torch.Tensor) -> Tuple[Payload, Any]:
        """The payload and ctx of ``tensor`` from its packed sign ``bits`` and their ``stats``."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any]:
        return self.encode(*pack_signs(tensor, empty=self.scratch), tensor)

    def compress_fused(self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]],
                       residual: Residual, check: bool = False,
                       clear: bool = False) -> Optional[Tuple[Payload, Any, Callable[[], None]]]:
        """With the residual memory's ``residual`` (carried), where a kernel serves the tensors
        (:func:`mergecomp.kernels.codecs.compensated_signs`): one
        pass reads the gradient and the buffer the step before left, and writes the compensated
        gradient into that buffer with the bits and their sums; the memory notes the two values
        the bits decode to, and the residual (the compensated gradient less its decode) is
        folded into the next step's pass.  Compensate, compress and feed make four passes (the
        third decodes the payload into a temporary)."""
        if not self._served(tensor, residual):
            return None
        bits, stats = compensated_signs(tensor, residual.old, residual.sides, keep=residual.target(),
                                        empty=self.scratch)
        return self._sent(bits, stats, tensor, residual)

    def compress_fused_parts(self, like: torch.Tensor, name: str, parts: int,
                             residual: Optional[Residual]) -> Optional["SignParts"]:
        """:meth:`compress_fused` part by part (:class:`SignParts`) with the residual memory
        on fp32 CPU groups where the kernels are on."""
        if residual is None or not self._served(like, residual):
            return None

        def kernel(bits: torch.Tensor, sums: torch.Tensor) -> Tuple[Any, torch.Tensor]:
            keep = residual.target()  # the memory's target, taken at the first part
            return compensated_sign_parts(like.numel(), residual.old, residual.sides, keep, bits, sums), keep

        return SignParts(self, like, parts, kernel, lambda bits, stats: self._sent(bits, stats, like, residual))

    @staticmethod
    def _served(like: torch.Tensor, residual: Residual) -> bool:
        """Whether a kernel serves ``like`` (the group's gradient or a tensor like it) and the
        carried buffer."""
        return parts_served(like, *(() if residual.old is None else (residual.old,)))

    def _sent(self, bits: torch.Tensor, stats: SignStats, like: torch.Tensor,
              residual: Residual) -> Tuple[Payload, Any, Callable[[], None]]:
        """The fused encode's ``(payload, ctx, update)`` from the group's ``bits`` and ``stats``;
        the memory notes the two values the bits decode to."""
        payload, ctx = self.encode(bits, stats, like)
        residual.carry(*(float(v) for v in self.sides(payload)))
        return payload, ctx, lambda: None

    def sides(self, payload: Payload) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(negative, positive)``: what a 0 bit and a 1 bit of this payload decode to."""
        raise NotImplementedError

    def decode_sum(self, payloads: Sequence[Payload], ctx: Any, divisor: int) -> torch.Tensor:
        numel, dtype = ctx
        return sign_sum([p[0] for p in payloads], [self.sides(p) for p in payloads], numel, dtype, divisor=divisor,
                        out=self.scratch(numel, dtype, payloads[0][0].device))


class SignParts(FusedParts):
    """A sign code of a group, part by part: each gradient's pass (a part-by-part kernel of
    :mod:`mergecomp.kernels.codecs`, made by ``kernel(bits, sums)`` at the first part) reads the
    gradient where autograd left it and writes its bits into the group's and its row of
    ``sums``; :meth:`finish` adds the rows in part order and returns ``sent(bits, stats)``, the
    ``(payload, ctx, update)`` of the fused encode.  ``kernel`` also returns
    the tensor holding the values it coded, whose fp32 side sums are worked out again in fp64
    where they overflowed; None: its rows only check finiteness, exactly (the stats given to
    ``sent`` are then zeros)."""

    def __init__(self, compressor: Compressor, like: torch.Tensor, parts: int,
                 kernel: Callable[[torch.Tensor, torch.Tensor], Tuple[Any, Optional[torch.Tensor]]],
                 sent: Callable[[torch.Tensor, SignStats], Tuple[Payload, Any, Callable[[], None]]]) -> None:
        self.kept = []
        self._like = like
        self._make_kernel = kernel
        self._sent = sent
        self._kernel: Optional[Callable[[int, int, torch.Tensor], bool]] = None
        self._coded: Optional[torch.Tensor] = None
        # the bits, then zeros to a whole 8-byte word: the payload goes on the wire as it lies
        # (:func:`~mergecomp.kernels.wire.pack_payload`)
        size = bitpack.packed_size(like.numel(), 1)
        words = compressor.scratch(word_padded(size), torch.uint8, like.device)
        words[size - (like.numel() % 8 != 0):].zero_()  # the padding bits and bytes, which no part writes
        self._bits = words[:size]
        # each part's row written by its add(); every part is added before finish()
        self._sums = compressor.scratch(parts * 3, torch.float64, like.device).view(parts, 3)

    def add(self, part: int, start: int, tensor: torch.Tensor) -> bool:
        if self._kernel is None:
            self._kernel, self._coded = self._make_kernel(self._bits, self._sums)
        if self._kernel(part, start, tensor):
            return True
        if self._coded is None:
            return False  # the kernel's check of the values alone is exact (no sums to overflow)
        sums, coded = self._sums[part], self._coded[start:start + tensor.numel()]
        sums.copy_(exact_where_overflowed(sums, lambda: coded))  # finite values whose fp32 runs overflowed
        return bool(torch.isfinite(sums).all())

    def finish(self) -> Tuple[Payload, Any, Callable[[], None]]:
        return self._sent(self._bits, SignStats(self._like, fused=self._sums.sum(0)))
