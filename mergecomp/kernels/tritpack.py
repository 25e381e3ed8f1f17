"""Pack ternary codes (0, 1 or 2) five to a byte, in base 3, and decode them, vectorized.

``pack(codes)`` takes a 1-D integer tensor with values in ``{0, 1, 2}`` and returns
``ceil(n / 5)`` bytes: element ``i`` is digit ``i % 5`` (least significant first) of byte
``i // 5``, so a byte holds ``c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4`` (at most 242): 1.6 bits per
code, where :mod:`mergecomp.kernels.bitpack`'s 2-bit codes take 2 (log2(3) = 1.585 is the bound).
``decode(packed, n, values)`` returns ``values[code]`` for each code in one gather, through a
table of the five values of every possible byte (several ranks' decodes summed:
:func:`mergecomp.kernels.codecs.trits_sum`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["PER_BYTE", "pack", "decode", "packed_size"]

#: codes per byte
PER_BYTE = 5
_PLACES = (1, 3, 9, 27, 81)


def packed_size(n: int) -> int:
    """Number of bytes :func:`pack` returns for ``n`` codes."""
    return -(-n // PER_BYTE)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (``n`` values in ``{0, 1, 2}``, any integer dtype) as ``packed_size(n)`` uint8."""
    codes = codes.reshape(-1)
    n = codes.numel()
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes.to(torch.uint8)
    full = n // PER_BYTE
    out = torch.empty(packed_size(n), dtype=torch.uint8, device=codes.device)
    if full:  # Horner's rule over the five strided digit columns (below 243: no uint8 overflow)
        digits, body = codes[:full * PER_BYTE].view(full, PER_BYTE), out[:full]
        torch.mul(digits[:, PER_BYTE - 1], 3, out=body)
        for j in range(PER_BYTE - 2, 0, -1):
            body.add_(digits[:, j]).mul_(3)
        body.add_(digits[:, 0])
    if n > full * PER_BYTE:
        tail = codes[full * PER_BYTE:]
        places = torch.tensor(_PLACES[:tail.numel()], dtype=torch.uint8, device=codes.device)
        out[full] = (tail * places).sum(dtype=torch.uint8)
    return out


_DIGITS: Dict[torch.device, torch.Tensor] = {}


def _digits(device: torch.device) -> torch.Tensor:
    """(256, 5) int64: the base-3 digits of every byte (bytes above 242 never occur)."""
    table = _DIGITS.get(device)
    if table is None:
        byte = torch.arange(256).reshape(-1, 1)
        table = _DIGITS[device] = (byte // torch.tensor(_PLACES) % 3).to(device)
    return table


def decode(packed: torch.Tensor, n: int, values: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values[code]`` for the ``n`` codes in ``packed``: ``values`` holds 3 entries (one per
    code, on ``packed``'s device); returns ``n`` entries in its dtype, written into ``out``
    (contiguous, ``n`` elements) when it is given.  One gather of a row of five values per byte."""
    if values.dim() != 1 or values.numel() != 3:
        raise ValueError(f"decode needs 3 values for ternary codes, got shape {tuple(values.shape)}")
    rows = values[_digits(values.device)]  # (256, 5): the values of every possible byte
    index = packed.reshape(-1).to(torch.int32)
    full = n // PER_BYTE
    if out is None:
        out = torch.empty(n, dtype=values.dtype, device=values.device)
    if full:
        torch.index_select(rows, 0, index[:full], out=out[:full * PER_BYTE].view(full, PER_BYTE))
    if n > full * PER_BYTE:
        out[full * PER_BYTE:] = rows[index[full]][:n - full * PER_BYTE]
    return out
