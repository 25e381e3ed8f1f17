"""Payloads as bytes on the wire: one uint8 buffer per payload, one row per rank.

Each payload tensor's bytes start on an 8-byte boundary of the buffer, so a received row can be
viewed back as the payload's tensors in place (:func:`unpack_payload`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = ["Payload", "Spec", "pack_payload", "specs_of", "unpack_payload", "pack_rows", "word_padded"]

#: what a codec sends: a tuple of tensors
Payload = Tuple[torch.Tensor, ...]
#: what :func:`unpack_payload` needs of each payload tensor: its dtype and shape
Spec = Tuple[torch.dtype, torch.Size]

_ALIGN = 8


def word_padded(nbytes: int) -> int:
    """``nbytes`` rounded up to the 8-byte boundary each payload tensor's bytes start on."""
    return nbytes + (-nbytes) % _ALIGN


def specs_of(payload: Payload) -> List[Spec]:
    """What :func:`unpack_payload` needs to read ``payload``'s packed bytes back."""
    return [(tensor.dtype, tensor.shape) for tensor in payload]


def pack_payload(payload: Payload, borrow: bool = False) -> Tuple[torch.Tensor, List[Spec]]:
    """Concatenate the payload tensors' bytes into one uint8 tensor (8-byte aligned parts).
    ``borrow``: a payload of one contiguous tensor that starts on an 8-byte boundary of its
    storage, and whose storage holds zeros up to the next one after it, is sent as it lies (no
    copy; the same bytes); the caller guarantees nothing writes it until the collective is over."""
    if borrow and len(payload) == 1 and payload[0].is_contiguous():
        tensor = payload[0]
        start, nbytes = tensor.storage_offset() * tensor.element_size(), tensor.numel() * tensor.element_size()
        padded = word_padded(nbytes)
        storage = tensor.untyped_storage()
        if start % _ALIGN == 0 and start + padded <= storage.nbytes():
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, start, (padded,))
            return raw, specs_of(payload)
    parts = []
    for tensor in payload:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        pad = word_padded(raw.numel()) - raw.numel()
        if pad:
            parts.append(raw.new_zeros(pad))
    return torch.cat(parts), specs_of(payload)


def unpack_payload(raw: torch.Tensor, specs: Sequence[Spec]) -> Payload:
    """Views of ``raw`` (one rank's packed bytes) as the payload tensors described by ``specs``;
    a tensor without elements comes back as a new empty tensor (the zero-byte rows of a gathered
    ``(ranks, 0)`` buffer start at unaligned offsets, which no dtype view accepts)."""
    tensors, offset = [], 0
    for dtype, shape in specs:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append(raw[offset:offset + nbytes].view(dtype).view(shape) if nbytes
                       else raw.new_empty(shape, dtype=dtype))
        offset += word_padded(nbytes)
    return tuple(tensors)


def pack_rows(payloads: Sequence[Payload]) -> Tuple[torch.Tensor, List[List[Spec]]]:
    """The payloads' bytes (:func:`pack_payload`) as the rows of one ``(len(payloads), width)``
    uint8 tensor, each padded with zeros to the widest; and each payload's specs."""
    packed = [pack_payload(p) for p in payloads]
    width = max(raw.numel() for raw, _ in packed)
    rows = packed[0][0].new_zeros(len(packed), width)
    for row, (raw, _) in zip(rows, packed):
        row[:raw.numel()] = raw
    return rows, [specs for _, specs in packed]
