"""Sign bits shared by the sign-based compressors (signSGD, Signum, EF-SignSGD, 1-bit SGD).

``pack_signs(x)`` sends 1 bit per element: ``x >= 0`` (so zeros travel as ``+``), packed 8 per
byte with :mod:`mergecomp.bitpack`.  ``unpack_signs`` returns the bits as a bool tensor,
``decode_signs`` as ``±1`` in a float dtype, and ``majority_vote`` takes the sign of the sum of
several ranks' ``±1`` (ties give 0).
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import bitpack

__all__ = ["pack_signs", "unpack_signs", "decode_signs", "majority_vote"]


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """``ceil(n / 8)`` uint8 bytes holding ``tensor >= 0`` (1 bit per element)."""
    return bitpack.pack(tensor >= 0, 1)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` sign bits of ``packed`` as a bool tensor (True where the element was >= 0)."""
    return bitpack.unpack(packed, 1, numel).bool()


def decode_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``+1`` where the element was >= 0, ``-1`` elsewhere, in ``dtype``."""
    bits = bitpack.unpack(packed, 1, numel)
    return bits.to(dtype).mul_(2).sub_(1)


def majority_vote(packed: Sequence[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Sign of the sum of the ranks' ``±1`` votes: ``+1``, ``-1``, or 0 on a tie."""
    voters = len(packed)
    if voters == 0:
        raise ValueError("majority_vote needs at least one payload")
    ones = torch.stack([bitpack.unpack(p, 1, numel) for p in packed]).sum(dim=0, dtype=torch.int32)
    # sum of ±1 votes = 2 * (#plus) - voters
    return (ones.mul_(2).sub_(voters)).sign_().to(dtype)
