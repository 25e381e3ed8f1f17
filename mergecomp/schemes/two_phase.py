"""The two-phase exchange of a group whose compressor's payloads cannot be summed.

With ``allgather`` every rank receives the N-1 other payloads of the whole group and decodes
N of them: bytes and decode work per rank grow with N.  Two-phase keeps both flat in N::

    phase 1  cut the error-compensated group into N shards (:func:`shard_bounds`), compress
             each shard on its own (:meth:`Compressor.compress_shard`); one all-to-all sends
             shard j's payload to rank j
    phase 2  rank j aggregates the N payloads of its shard as the allgather scheme aggregates
             whole groups (mean or sum; the majority vote for the sign methods), adds its
             second-stage residual, compresses the result with the phase-2 codec
             (:meth:`Compressor.second_phase`) and keeps what that codec did not send as the
             new residual; one allgather brings every rank the N aggregated shards
    finish   every rank decodes shard r from rank r's row into the group's buffer

On the wire, per rank: ``(N-1)/N`` of the group's compressed bytes out and in by the
all-to-all, the same again by the allgather.  Payloads travel packed into bytes
(:func:`mergecomp.kernels.wire.pack_rows`), each shard's padded to the largest shard's, so every
rank sends equal blocks; a shard's payload size depends only on its numel, so all ranks agree.

Second-stage residual: kept only when the exchange's memory does error feedback, and not for
the majority vote (sent exactly, as 2-bit codes).  It lives in :class:`ShardMemory` per group,
one shard long.  When the merge plan changes, each rank's residual is put back at its elements,
scaled to a gradient of its own (times N when averaging), as a one-off ``carry`` that the next
exchange of the new group adds to the compensated gradient; the first-stage memory keeps
whatever of it is not sent, so applied updates plus both stages' residuals still sum to the
gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.memory import ResidualMemory
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import decode_codes
from mergecomp.kernels.wire import Spec, pack_payload

__all__ = ["shard_size", "shard_bounds", "pad_to", "zero_outside", "Sharded", "ShardLayouts", "VoteCodec",
           "ShardMemory"]

Bounds = List[Tuple[int, int]]
#: how to read one shard's phase-2 payload: the codec's ctx and the payload's specs
Layout = Tuple[Any, List[Spec]]


def shard_size(numel: int, parts: int, align: int = 1) -> int:
    """The length of the full shards of :func:`shard_bounds`: ``ceil(numel / parts)`` rounded up
    to a multiple of ``align``."""
    if parts < 1 or align < 1:
        raise ValueError(f"shard_bounds needs parts >= 1 and align >= 1, got {parts} and {align}")
    chunk = -(-numel // parts)
    return -(-chunk // align) * align


def shard_bounds(numel: int, parts: int, align: int = 1, start: int = 0) -> Bounds:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``[start, start + numel)``: each is
    :func:`shard_size` long, except the last ones, which may be shorter or empty."""
    chunk = shard_size(numel, parts, align)
    return [(start + min(j * chunk, numel), start + min((j + 1) * chunk, numel)) for j in range(parts)]


def pad_to(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat ``tensor`` zero-padded to ``numel`` elements (``tensor`` itself when it has them)."""
    if tensor.numel() == numel:
        return tensor
    padded = tensor.new_zeros(numel)
    padded[:tensor.numel()] = tensor
    return padded


def zero_outside(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``tensor`` with every element outside ``[start, stop)`` set to zero (in place)."""
    tensor[:start].zero_()
    tensor[stop:].zero_()
    return tensor


class ShardLayouts:
    """The phase-2 codec's ``ctx``, payload specs and packed bytes for a shard of a given numel
    and dtype, found once by encoding zeros (they depend on nothing else, by the
    :class:`~mergecomp.compressors.base.compressor.Compressor` contract), so every rank can read every rank's
    aggregated shard."""

    def __init__(self, codec: Compressor) -> None:
        self.codec = codec
        self._known: Dict[Tuple[int, torch.dtype, torch.device], Tuple[Layout, int]] = {}

    def of(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tuple[Layout, int]:
        key = (numel, dtype, torch.device(device))
        if key not in self._known:
            payload, ctx = self.codec.compress(torch.zeros(numel, dtype=dtype, device=device), "__layout__")
            self.codec.state.pop("__layout__", None)
            raw, specs = pack_payload(payload)
            self._known[key] = ((ctx, specs), raw.numel())
        return self._known[key]


@dataclass
class Sharded:
    """A group in the two-phase scheme: its shards' ``bounds``, this rank's shard's phase-1
    ``ctx`` and payload ``specs`` (every rank's payload of that shard has them), every shard's
    phase-2 ``layouts`` and the phase-2 row ``width`` in bytes.  The bounds are the group's
    elements (a hierarchical group's shards cover this rank's shard of the host's sum)."""

    bounds: Bounds
    ctx: Any
    specs: List[Spec]
    layouts: List[Layout]
    width: int

    @classmethod
    def create(cls, bounds: Bounds, ctx: Any, specs: List[Spec], layouts: ShardLayouts,
               like: torch.Tensor) -> "Sharded":
        found = [layouts.of(stop - start, like.dtype, like.device) for start, stop in bounds]
        return cls(bounds, ctx, specs, [layout for layout, _ in found], max(n for _, n in found))

    def pad(self, raw: torch.Tensor) -> torch.Tensor:
        """This rank's packed phase-2 payload, zero-padded to :attr:`width` bytes."""
        return pad_to(raw, self.width)


class VoteCodec(Compressor):
    """The phase-2 codec of the majority-vote compressors: the vote (``-1``, ``0``, ``+1``) sent
    exactly as 2-bit codes ``vote + 1`` packed 4 per byte.  Summing is not needed: each rank
    sends the vote of its own shard."""

    name = "vote"
    compress_passes = 3  # the int8 cast, the shift by 1, the packing

    def compress(self, tensor: torch.Tensor, name: str, shapes=None) -> Tuple[Payload, Any]:
        codes = tensor.to(torch.int8).add_(1).view(torch.uint8)
        return (bitpack.pack(codes, 2),), (tensor.numel(), tensor.dtype)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        numel, dtype = ctx
        values = torch.tensor([-1, 0, 1, 0], dtype=dtype, device=payload[0].device)
        return decode_codes(payload[0], 2, numel, values, self.scratch(numel, dtype, payload[0].device))


class ShardMemory(ResidualMemory):
    """The second-stage residual of each group (``state[group]["residual"]``, as long as the
    shard this rank aggregates) and the ``carry`` a plan change leaves (the group's numel: per
    element, so it follows its tensors to the new groups like any first-stage state)."""

    def fold(self, name: str, numel: int, start: int, scale: float) -> None:
        """Turn group ``name``'s residual into a group-long (``numel``) ``carry``: the residual,
        times ``scale``, at the elements it belongs to, from ``start`` on; zeros elsewhere."""
        fields = self.state.get(name)
        residual = fields.pop("residual", None) if fields else None
        if residual is None:
            return
        carry = fields.get("carry")
        if carry is None:
            carry = fields["carry"] = residual.new_zeros(numel)
        carry[start:start + residual.numel()].add_(residual, alpha=scale)

    def has_carry(self, name: str) -> bool:
        """Whether group ``name`` has a carry (:meth:`take_carry`)."""
        return "carry" in self.state.get(name, {})

    def take_carry(self, name: str) -> Optional[torch.Tensor]:
        """Group ``name``'s carry, removed (None if there is none)."""
        fields = self.state.get(name)
        return fields.pop("carry", None) if fields else None
