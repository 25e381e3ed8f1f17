"""Pack small integer codes (1, 2 or 4 bits each) into uint8 and back, vectorized.

``pack(codes, bits)`` takes a 1-D integer/bool tensor with values in ``[0, 2**bits)`` and returns
``ceil(n * bits / 8)`` bytes; element ``i`` lives in byte ``i // (8 // bits)`` at bit offset
``bits * (i % (8 // bits))``.  ``unpack(packed, bits, n)`` inverts it (returns uint8 codes).
"""
from __future__ import annotations

import torch

__all__ = ["pack", "unpack", "packed_size"]

_SUPPORTED = (1, 2, 4)


def _per_byte(bits: int) -> int:
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")
    return 8 // bits


def packed_size(n: int, bits: int) -> int:
    """Number of bytes ``pack`` returns for ``n`` codes of ``bits`` bits."""
    per = _per_byte(bits)
    return (n + per - 1) // per


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = _per_byte(bits)
    n = codes.numel()
    codes = codes.reshape(-1).to(torch.uint8)
    pad = (-n) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per) << _shifts(bits, codes.device)
    # The shifted lanes occupy disjoint bits, so their sum is their bitwise OR.
    return lanes.sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    _per_byte(bits)
    mask = (1 << bits) - 1
    codes = (packed.reshape(-1, 1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:n]
