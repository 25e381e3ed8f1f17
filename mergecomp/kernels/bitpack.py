"""Pack small integer codes (1, 2 or 4 bits each) into uint8 and back, vectorized.

``pack(codes, bits)`` takes a 1-D integer/bool tensor with values in ``[0, 2**bits)`` and returns
``ceil(n * bits / 8)`` bytes; element ``i`` lives in byte ``i // (8 // bits)`` at bit offset
``bits * (i % (8 // bits))``.  ``unpack(packed, bits, n)`` inverts it (returns uint8 codes), and
``decode(packed, bits, n, values)`` returns ``values[code]`` for each code directly (for a
decoder that maps codes to numbers: one pass instead of unpack, convert, scale, shift).

How (both directions are one pass over the codes, no per-lane loops):

* ``pack`` views the ``8 // bits`` code bytes that share an output byte as one integer lane
  (int64 for 1 bit, int32 for 2, int16 for 4) and multiplies it by a constant that moves code
  ``j`` to bit ``bits * j`` of the lane's top byte; the other partial products either overflow
  out of the lane or stay below the top byte without carrying into it (checked exhaustively by
  the tests).  The top byte is the packed byte.  A tail of fewer than ``8 // bits`` codes is
  packed separately into the last byte (no padded copy of the input).
* ``unpack`` looks every byte up in a 256-entry table whose entries are the ``8 // bits`` code
  bytes of that byte, read as one integer lane: one gather writes the codes.  ``decode`` does the
  same with a 256-row table of the ``8 // bits`` values of each byte.
"""
from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import torch

__all__ = ["pack", "unpack", "decode", "packed_size"]

_SUPPORTED = (1, 2, 4)
#: integer type holding the ``8 // bits`` code bytes of one packed byte
_LANE = {1: torch.int64, 2: torch.int32, 4: torch.int16}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _per_byte(bits: int) -> int:
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")
    return 8 // bits


def packed_size(n: int, bits: int) -> int:
    """Number of bytes ``pack`` returns for ``n`` codes of ``bits`` bits."""
    per = _per_byte(bits)
    return (n + per - 1) // per


def _multiplier(bits: int) -> int:
    """Lane multiplier moving code ``j`` (at bit ``8 j``) to bit ``8 (per - 1) + bits * j``."""
    per = 8 // bits
    return sum(1 << (8 * (per - 1) - (8 - bits) * j) for j in range(per))


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _pack_slow(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference packing of a short uint8 tail (fewer than one lane's worth of codes)."""
    per = 8 // bits
    padded = torch.zeros(per, dtype=torch.uint8, device=codes.device)
    padded[:codes.numel()] = codes
    # The shifted lanes occupy disjoint bits, so their sum is their bitwise OR.
    return (padded << _shifts(bits, codes.device)).sum(dtype=torch.uint8).reshape(1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = _per_byte(bits)
    n = codes.numel()
    codes = codes.reshape(-1)
    if codes.dtype == torch.bool:
        codes = codes.contiguous().view(torch.uint8)  # bools are stored as bytes 0/1
    elif codes.dtype != torch.uint8:
        codes = codes.to(torch.uint8)
    else:
        codes = codes.contiguous()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    full = n // per
    if full:
        body = codes[:full * per]
        if body.storage_offset() % per:
            body = body.clone()  # the lane view needs lane-aligned storage
        product = body.view(_LANE[bits]) * _multiplier(bits)
        if _LITTLE_ENDIAN:
            out[:full] = product.view(torch.uint8)[per - 1::per]
        else:
            out[:full] = product >> (8 * (per - 1))  # keeps the low byte
    if n % per:
        out[full:] = _pack_slow(codes[full * per:], bits)
    return out


_TABLES: Dict[Tuple[int, torch.device], torch.Tensor] = {}


def _table(bits: int, device: torch.device) -> torch.Tensor:
    """256 lanes: lane ``b`` holds the ``8 // bits`` codes of byte ``b`` as bytes."""
    key = (bits, device)
    table = _TABLES.get(key)
    if table is None:
        mask = (1 << bits) - 1
        codes = (torch.arange(256, dtype=torch.uint8).reshape(-1, 1) >> _shifts(bits, "cpu")) & mask
        table = _TABLES[key] = codes.contiguous().view(_LANE[bits]).reshape(256).to(device)
    return table


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    _per_byte(bits)
    index = packed.reshape(-1).to(torch.int32)
    lanes = torch.index_select(_table(bits, packed.device), 0, index)
    return lanes.view(torch.uint8)[:n]


def decode(packed: torch.Tensor, bits: int, n: int, values: torch.Tensor,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``values[unpack(packed, bits, n)]`` in one gather: ``values`` is a 1-D tensor with one
    entry per code (``2 ** bits`` of them, on ``packed``'s device); returns ``n`` entries in its
    dtype, written into ``out`` (contiguous, ``n`` elements of that dtype) when it is given.
    E.g. sign bits to ``±1``: ``decode(packed, 1, n, torch.tensor([-1.0, 1.0]))``."""
    per = _per_byte(bits)
    if values.dim() != 1 or values.numel() != 1 << bits:
        raise ValueError(f"decode needs {1 << bits} values for {bits}-bit codes, got shape "
                         f"{tuple(values.shape)}")
    # Gather each row as one wide word where the row's bytes allow it: index_select is several
    # times faster on a 1-D table of 16-byte words than on a (256, 4) float table.
    row_bytes = per * values.element_size()
    lane = next(t for t in _GATHER_LANES if row_bytes % _itemsize(t) == 0)
    if row_bytes > _itemsize(lane) and packed.is_cuda:
        # CUDA gathers rows of several words ~15x slower than single words (an H200: 9.4 ms
        # against 0.66 ms this way for 124 M 1-bit codes to fp32): look each code up on its own
        return torch.index_select(values, 0, unpack(packed, bits, n).to(torch.int32), out=out)
    codes = _table(bits, values.device).view(torch.uint8).view(256, per)
    rows = values[codes.long()]  # (256, per): the values of every possible byte
    table = rows.view(torch.uint8).view(lane).view(256, -1).squeeze(1)
    index = packed.reshape(-1).to(torch.int32)
    if out is None:
        return torch.index_select(table, 0, index).view(values.dtype).view(-1)[:n]
    full = n // per
    body = out[:full * per]
    if full and body.data_ptr() % _itemsize(lane) == 0:
        torch.index_select(table, 0, index[:full], out=body.view(lane).view(full, -1).squeeze(1))
    elif full:
        body.copy_(torch.index_select(table, 0, index[:full]).view(values.dtype).view(-1))
    if n > full * per:
        out[full * per:] = torch.index_select(table, 0, index[full:]).view(values.dtype).view(-1)[:n - full * per]
    return out


#: word types ``decode`` gathers rows as, widest first
_GATHER_LANES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
