"""Sign bits: 1 bit per element, ``x >= 0`` (so zeros travel as ``+``), packed 8 per byte as
:func:`mergecomp.kernels.bitpack.pack` lays them out (``ceil(numel / 8)`` uint8)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from mergecomp.kernels import bitpack, native
from mergecomp.kernels.codecs.levels import codes_sum, decode_codes
from mergecomp.kernels.codecs.sums import SignStats, exact_where_overflowed
from mergecomp.kernels.workspace import fresh

__all__ = ["pack_signs", "compensated_signs", "sign_remainder", "momentum_signs", "decode_signs", "majority_vote",
           "sign_sum", "compensated_sign_parts", "momentum_sign_parts", "parts_served", "streamed"]

#: one of the two values a sign bit decodes to: a float or a 0-d/1-element tensor
Value = Union[float, torch.Tensor]


def pack_signs(x: torch.Tensor, empty: Optional[Callable] = None) -> Tuple[torch.Tensor, SignStats]:
    """``(bits, stats)``: the sign bits of ``x`` (any shape, read flat) and its
    :class:`~mergecomp.kernels.codecs.sums.SignStats` (the sum of each side, ``sum |x|``,
    ``count(x >= 0)``), from the same pass on the native path.  ``empty(numel, dtype, device)`` allocates the bits there
    (e.g. a compressor's :meth:`~mergecomp.Compressor.scratch`); default ``torch.empty``."""
    if native.usable(x):
        out = (empty or fresh)(bitpack.packed_size(x.numel(), 1), torch.uint8, x.device)
        bits, fused = native.pack_signs(x.reshape(-1), out)
        return bits, SignStats(x, fused=exact_where_overflowed(fused, lambda: x))
    positive = x >= 0
    return bitpack.pack(positive, 1), SignStats(x, positive=positive)


def compensated_signs(x: torch.Tensor, carried: Optional[torch.Tensor], sides: Tuple[float, float] = (0.0, 0.0),
                      keep: Optional[torch.Tensor] = None,
                      empty: Optional[Callable] = None) -> Optional[Tuple[torch.Tensor, SignStats]]:
    """:func:`pack_signs` of the compensated gradient ``v = x + residual``, bit for bit, from one
    pass where a kernel serves the tensors; else None, and the caller compensates and calls
    :func:`pack_signs` (the torch path would make as many passes).  The residual is
    :func:`sign_remainder` of ``carried`` with ``sides`` (``(0, 0)``: ``carried`` itself; None:
    no residual), never written out.  ``keep`` (fp32, ``x``'s numel; may be ``carried``)
    receives ``v``; ``x`` is not written.  ``empty`` as in :func:`pack_signs`."""
    operands = [t for t in (x, carried, keep) if t is not None]
    if not native.usable(*operands):
        return None
    out = (empty or fresh)(bitpack.packed_size(x.numel(), 1), torch.uint8, x.device)
    bits, fused = native.compensated_signs(x, carried, float(sides[0]), float(sides[1]), keep, out)

    def compensated() -> torch.Tensor:
        if keep is not None:
            return keep
        return x if carried is None else x + sign_remainder(carried, *sides, out=torch.empty_like(carried))

    return bits, SignStats(x, fused=exact_where_overflowed(fused, compensated))


def sign_remainder(v: torch.Tensor, negative: Value, positive: Value, out: torch.Tensor) -> torch.Tensor:
    """``out = v - (positive where v >= 0, else negative)``: what of ``v`` its two-valued sign
    decode did not give back (the residual error feedback keeps), one pass; ``out`` (``v``'s
    numel and dtype) may be ``v``.  Returns ``out``."""
    if native.usable(v, out):
        return native.sign_residual(v, float(negative), float(positive), out)
    side = torch.where(v >= 0, torch.as_tensor(positive, dtype=v.dtype), torch.as_tensor(negative, dtype=v.dtype))
    return torch.sub(v, side, out=out)


def momentum_signs(x: torch.Tensor, momentum: torch.Tensor, beta: float,
                   empty: Optional[Callable] = None) -> torch.Tensor:
    """Signum's step: ``momentum = beta * momentum + (1 - beta) * x`` in place (``momentum``
    has ``x``'s numel, dtype and device), then the sign bits of the new momentum, as
    :func:`pack_signs` packs them, in one pass on the native path.  Returns the bits."""
    if native.usable(x, momentum):
        out = (empty or fresh)(bitpack.packed_size(x.numel(), 1), torch.uint8, x.device)
        return native.momentum_signs(x, momentum, beta, out)
    momentum.lerp_(x, 1.0 - beta)  # beta m + (1 - beta) x, one pass
    return pack_signs(momentum, empty)[0]


def decode_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype,
                 negative: Value = -1.0, positive: Value = 1.0,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``positive`` where the element was >= 0, ``negative`` elsewhere: ``numel`` values in
    ``dtype`` on ``packed``'s device, written into ``out`` when given.  Returns them."""
    values = _pair(negative, positive, dtype, packed.device)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed.device)
    return decode_codes(packed, 1, numel, values, out)


def majority_vote(packed: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sign of the sum of the ranks' ``±1`` votes (``packed``: each rank's ``numel`` sign bits):
    ``+1``, ``-1``, or 0 on a tie, as ``numel`` values of ``dtype``, written into ``out`` when
    given.  Returns them.

    The torch path counts the ``+`` votes ``c`` per element in bytes (int32 above 255 voters);
    the vote is ``sign(2 c - voters) = sign(c - voters / 2)``.
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


def sign_sum(packed: Sequence[torch.Tensor], sides: Sequence[Tuple[Value, Value]], numel: int,
             dtype: torch.dtype, divisor: int = 1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_r decode_signs(packed[r], numel, dtype, *sides[r]) / divisor``: the ranks' sign
    bits, each decoded to its own ``(negative, positive)`` pair, summed (:func:`codes_sum`: in
    one pass on the native path, no full-size decode per rank).  ``numel`` values of ``dtype``,
    written into ``out`` when given.  Returns them."""
    values = [_pair(*side, dtype, packed[0].device) for side in sides]
    return codes_sum(packed, 1, values, numel, divisor, out)


def _pair(negative: Value, positive: Value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[negative, positive]`` in ``dtype`` on ``device``: a float is filled in there, a tensor
    moved; never a tensor made on the host and copied, which on a CUDA device waits for it."""
    return torch.stack([v.reshape(()).to(device=device, dtype=dtype) if isinstance(v, torch.Tensor)
                        else torch.full((), v, dtype=dtype, device=device) for v in (negative, positive)])


def compensated_sign_parts(numel: int, carried: Optional[torch.Tensor], sides: Tuple[float, float],
                           keep: Optional[torch.Tensor], bits: torch.Tensor, sums: torch.Tensor,
                           side_sums: bool = True) -> native.CompensatedSignParts:
    """:func:`compensated_signs` of a group of ``numel`` elements, part by part as its gradients
    arrive (a kernel only: see :func:`parts_served`): the group's bits go to ``bits``, each
    part's row of sums (fp64) to ``sums``; ``keep`` receives ``v``, past the cache for a large
    group.  ``side_sums`` False (no residual, nothing kept: signSGD's bits): the rows only tell
    whether a part is finite."""
    return native.CompensatedSignParts(numel, carried, float(sides[0]), float(sides[1]), keep, bits, sums,
                                       stream=streamed(numel), sums=side_sums)


def momentum_sign_parts(numel: int, momentum: torch.Tensor, weight: float, keep: torch.Tensor, bits: torch.Tensor,
                        sums: torch.Tensor) -> native.MomentumSignParts:
    """:func:`momentum_signs` of a group of ``numel`` elements, part by part (a kernel only): the
    new momentum ``momentum + weight * (x - momentum)`` into ``keep``, its bits into ``bits``;
    each part's row of ``sums`` tells whether it is finite."""
    return native.MomentumSignParts(numel, momentum, weight, keep, bits, sums, stream=streamed(numel))


def parts_served(*tensors: torch.Tensor) -> bool:
    """Whether the part-by-part sign kernels serve these tensors (contiguous fp32 CPU, kernels
    on); there is no torch path for encoding a group part by part."""
    return native.usable(*tensors)


def streamed(numel: int) -> bool:
    """Whether an output of ``numel`` elements that is read again only later is written past
    the cache."""
    return numel >= native.STREAM_MIN
