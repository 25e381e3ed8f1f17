"""Quantization codes: stochastic rounding to integer codes, QSGD's encode and decode, and the
decode of packed codes through a table of their values."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from mergecomp.kernels import bitpack, native, tritpack
from mergecomp.kernels.quantize import bucket_norms, per_bucket_scale, stochastic_round_, work_dtype
from mergecomp.kernels.workspace import fresh

__all__ = ["decode_codes", "codes_sum", "trits_sum", "stochastic_codes", "stochastic_trits", "qsgd_encode",
           "scale_levels", "levels_sum"]


def decode_codes(packed: torch.Tensor, bits: int, numel: int, values: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """``values[code]`` for each of the ``numel`` ``bits``-bit codes (1, 2 or 4) in ``packed``
    (uint8, laid out as :func:`mergecomp.kernels.bitpack.pack` does), written into ``out`` (contiguous,
    ``numel`` elements of ``values``' dtype).  ``values``: ``2 ** bits`` entries on ``packed``'s
    device.  Returns ``out``."""
    if native.usable(out, packed):
        return native.decode_codes(packed, bits, numel, values, out)
    return bitpack.decode(packed, bits, numel, values, out=out)


def codes_sum(packed: Sequence[torch.Tensor], bits: int, values: Sequence[torch.Tensor], numel: int,
              divisor: int = 1, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_r decode_codes(packed[r], bits, numel, values[r]) / divisor``: every rank's codes
    decoded through its own values and summed in rank order, into ``out`` (``numel`` elements of
    ``values``' dtype; allocated when None).  One pass over ``out`` on the native path, where
    every rank's decode is added while a block of ``out`` is in cache; else a decode per rank
    into a temporary.  Returns ``out``."""
    if out is None:
        out = torch.empty(numel, dtype=values[0].dtype, device=packed[0].device)
    if native.usable(out, *packed):
        return native.codes_sum(packed, bits, torch.stack(list(values)), numel, divisor, out)
    decode_codes(packed[0], bits, numel, values[0], out)
    for codes, table in zip(packed[1:], values[1:]):
        out.add_(decode_codes(codes, bits, numel, table, torch.empty_like(out)))
    return out.div_(divisor) if divisor != 1 else out


def trits_sum(packed: Sequence[torch.Tensor], values: Sequence[torch.Tensor], numel: int, divisor: int,
              out: torch.Tensor) -> torch.Tensor:
    """:func:`codes_sum` for base-3 codes five to a byte (:mod:`mergecomp.kernels.tritpack`), each
    rank's through its own 3 values: one pass over ``out`` on the native path, else a gather per
    rank into a temporary.  Returns ``out``."""
    if native.usable(out, *packed):
        return native.trits_sum(packed, torch.stack(list(values)), numel, divisor, out)
    tritpack.decode(packed[0], numel, values[0], out)
    for codes, table in zip(packed[1:], values[1:]):
        out.add_(tritpack.decode(codes, numel, table))
    return out.div_(divisor) if divisor != 1 else out


def stochastic_codes(x: torch.Tensor, scales: torch.Tensor, bucket: int, lo: int, hi: int,
                     shift: int, bits: int, empty: Optional[Callable] = None) -> torch.Tensor:
    """``floor(clamp(x * scales[i // bucket], lo, hi) + u) + shift`` for each element ``i`` of
    the flat ``x``, ``u`` uniform in (0, 1) (see :func:`mergecomp.kernels.quantize.stochastic_round_`),
    so the codes are unbiased.  ``scales``: one per bucket of ``bucket`` elements (the last one
    may be shorter); ``lo``, ``hi``, ``shift``: integers.  Returns, for ``bits == 8``, the
    ``numel`` int8 codes; for ``bits`` 1, 2 or 4, the codes (in ``[0, 2 ** bits)``) packed as
    :func:`mergecomp.kernels.bitpack.pack` does.  ``empty(numel, dtype, device)`` allocates the int8
    codes, the native path's packed codes and the torch path's temporaries; default
    ``torch.empty``.

    The two paths draw different random numbers (equally unbiased)."""
    n, empty = x.numel(), empty or fresh
    if native.usable(x):
        out = (empty(n, torch.int8, x.device) if bits == 8
               else empty(bitpack.packed_size(n, bits), torch.uint8, x.device))
        return native.stochastic_codes(x, scales, bucket, lo, hi, shift, bits, out)
    scaled = per_bucket_scale(x, scales, bucket, out=empty(n, work_dtype(x.dtype), x.device))
    if bits == 8:  # clamped after rounding, in int8 (a quarter of the bytes): the same codes
        # for integral bounds, as long as the rounded values fit in int8
        codes = stochastic_round_(scaled, shift, empty=empty)
        return empty(n, torch.int8, x.device).copy_(codes).clamp_(lo + shift, hi + shift)
    return bitpack.pack(stochastic_round_(scaled.clamp_(lo, hi), shift, empty=empty), bits)


def stochastic_trits(x: torch.Tensor, scales: torch.Tensor, bucket: int, lo: int, hi: int, shift: int,
                     empty: Optional[Callable] = None) -> torch.Tensor:
    """:func:`stochastic_codes`' codes (in ``{0, 1, 2}`` after ``shift``) packed five to a byte in
    base 3 (:mod:`mergecomp.kernels.tritpack`): drawn and packed in one pass on the native path
    (the same codes as its int8 ones), else drawn as int8 and packed.  ``empty`` as there."""
    if native.usable(x):
        return native.stochastic_trits(x, scales, bucket, lo, hi, shift,
                                       (empty or fresh)(tritpack.packed_size(x.numel()), torch.uint8, x.device))
    return tritpack.pack(stochastic_codes(x, scales, bucket, lo, hi, shift, 8, empty))


def qsgd_encode(x: torch.Tensor, bucket: int, levels: int, bits: int = 8,
                empty: Optional[Callable] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """QSGD's payload for the flat ``x``: ``(codes, norms)``, ``norms`` the fp32 L2 norm of each
    bucket of ``bucket`` elements (the last one may be shorter) and ``codes`` the levels
    ``l = floor(levels * x / norm + u)`` in ``[-levels, levels]`` (0 in a bucket whose norm is
    0), ``u`` as in :func:`stochastic_codes`: ``numel`` int8 for ``bits == 8``; for ``bits ==
    4`` (``levels <= 7``) the codes ``l + levels`` packed two to a byte as
    :func:`mergecomp.kernels.bitpack.pack` does.  ``empty`` as there."""
    n = x.numel()
    if native.usable(x) and 0 < bucket <= native.CACHED_BUCKET:  # norms and levels in one pass
        out = (empty or fresh)(n, torch.int8, x.device) if bits == 8 else \
            (empty or fresh)(bitpack.packed_size(n, 4), torch.uint8, x.device)
        return native.qsgd_encode(x, bucket, levels, bits, out, torch.empty(-(-n // bucket)))
    work = work_dtype(x.dtype)
    norms = bucket_norms(x, bucket, work).to(torch.float32)
    # Quantize against the norms as they are sent (fp32), so the decode is unbiased.
    sent = norms.to(work)
    scale = torch.where(sent > 0, levels / sent, 0)
    shift = 0 if bits == 8 else levels
    return stochastic_codes(x, scale, bucket, -levels, levels, shift, bits, empty), norms


def scale_levels(codes: torch.Tensor, steps: torch.Tensor, bucket: int, out: torch.Tensor,
                 bits: int = 8, shift: int = 0) -> torch.Tensor:
    """``out[i] = (code[i] - shift) * steps[i // bucket]``: the codes (int8 for ``bits == 8``,
    packed 4-bit uint8 for ``bits == 4``) scaled by one step per bucket of ``bucket`` elements
    (the last one may be shorter), into ``out`` (``numel`` elements, floating point, the codes'
    count).  Returns ``out``."""
    if native.usable(out, codes):
        return native.scale_levels(codes, steps, bucket, bits, shift, out)
    out.copy_(codes if bits == 8 else bitpack.unpack(codes, bits, out.numel()))  # no int x float math
    if shift:
        out.sub_(shift)
    return per_bucket_scale(out, steps, bucket, out=out)


def levels_sum(codes: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], bucket: int, out: torch.Tensor,
               bits: int = 8, shift: int = 0, divisor: int = 1) -> torch.Tensor:
    """``sum_r scale_levels(codes[r], steps[r], bucket, ...) / divisor``: every rank's levels
    scaled by its own steps and summed in rank order, into ``out``.  One pass over ``out`` on the
    native path; else a decode per rank into a temporary.  Returns ``out``."""
    if native.usable(out, *codes):
        return native.levels_sum(codes, steps, bucket, bits, shift, divisor, out)
    scale_levels(codes[0], steps[0], bucket, out, bits, shift)
    for level, step in zip(codes[1:], steps[1:]):
        out.add_(scale_levels(level, step, bucket, torch.empty_like(out), bits, shift))
    return out.div_(divisor) if divisor != 1 else out
