"""Two-phase: a compressed reduce-scatter by all-to-all, then an allgather of each rank's
compressed aggregate of its shard.

With ``allgather`` every rank receives the N-1 other payloads of the whole group and decodes
N of them: bytes and decode work per rank grow with N.  Two-phase keeps both flat in N::

    phase 1  cut the error-compensated group into N shards (:func:`shard_bounds`), compress
             each shard on its own (:meth:`ShardedEncode.compress_shard`); one all-to-all sends
             shard j's payload to rank j
    phase 2  rank j aggregates the N payloads of its shard as the allgather scheme aggregates
             whole groups (mean or sum; the majority vote for the sign methods), adds its
             second-stage residual, compresses the result with the phase-2 codec
             (:meth:`ShardedEncode.second_phase`) and keeps what that codec did not send as the
             new residual; one allgather brings every rank the N aggregated shards
    finish   every rank decodes shard r from rank r's row into the group's buffer

On the wire, per rank: ``(N-1)/N`` of the group's compressed bytes out and in by the
all-to-all, the same again by the allgather.  Payloads travel packed into bytes
(:func:`mergecomp.kernels.wire.pack_rows`), each shard's padded to the largest shard's, so every
rank sends equal blocks; a shard's payload size depends only on its numel, so all ranks agree.

Second-stage residual: kept only when the exchange's memory does error feedback, and not where
the phase-2 codec is lossless (the majority vote, sent exactly as 2-bit codes).  It lives in
:class:`ShardMemory` per group, one shard long.  When the merge plan changes, each rank's
residual is put back at its elements, scaled to a gradient of its own (times N when averaging),
as a one-off ``carry`` that the next exchange of the new group adds to the compensated
gradient; the first-stage memory keeps whatever of it is not sent, so applied updates plus
both stages' residuals still sum to the gradients.

On one rank the group is sent whole (:meth:`TwoPhase.applies`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from mergecomp.compressors.base.capabilities import second_phase, shard_alignment
from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.compressors.memories import ResidualMemory
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.breakdown import ENCODE, MEMORY
from mergecomp.exchange.encoder import Encoder, feed
from mergecomp.exchange.plan import Group
from mergecomp.exchange.schemes.base import Routes, Scheme
from mergecomp.kernels.wire import Spec, pack_payload, pack_rows, unpack_payload

if TYPE_CHECKING:
    from mergecomp.exchange.job import Job

__all__ = ["TwoPhase", "shard_size", "shard_bounds", "pad_to", "zero_outside", "Sharded", "ShardLayouts",
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
    :class:`~mergecomp.compressors.base.compressor.Compressor` contract), so every rank can read
    every rank's aggregated shard."""

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
    """A group in flight in the two-phase scheme: its shards' ``bounds``, this rank's shard's
    phase-1 ``ctx`` and payload ``specs`` (every rank's payload of that shard has them), every
    shard's phase-2 ``layouts`` and the phase-2 row ``width`` in bytes.  The bounds are the
    group's elements (a hierarchical group's shards cover this rank's shard of the host's sum)."""

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


class TwoPhase(Scheme):
    """See the module docstring.  ``holders``: the second-stage memory, as ``"shard_memory"``."""

    name = "two-phase"
    sharded = True

    def __init__(self, comm: Communicator, encoder: "Encoder", routes: Routes) -> None:
        super().__init__(comm, encoder, routes)
        #: the codec of each rank's aggregated shard
        self.second = second_phase(encoder.compressor)
        self.second.workspace = encoder.workspace
        self.layouts = ShardLayouts(self.second)
        #: the second-stage residuals, and the carries a plan change leaves
        self.memory = ShardMemory()

    @classmethod
    def applies(cls, comm: Communicator) -> bool:
        return comm.size > 1

    @property
    def holders(self) -> Dict[str, GroupStateful]:
        return {"shard_memory": self.memory}

    def bounds(self, comm: Communicator, span: Tuple[int, int]) -> Bounds:
        """The shards of the elements ``span``, one per rank of ``comm``."""
        start, stop = span
        return shard_bounds(stop - start, comm.size, shard_alignment(self.encoder.compressor), start)

    def start(self, job: "Job") -> None:
        """Phase 1: compress each shard of ``job.span``, start the all-to-all, feed the
        first-stage memory."""
        comm, encoder = job.comm, self.encoder
        bounds = self.bounds(comm, job.span)
        shards = encoder.encode_shards(job, bounds)
        rows, specs = pack_rows([payload for payload, _ in shards])
        job.flight = Sharded.create(bounds, shards[comm.rank][1], specs[comm.rank], self.layouts, job.compensated)
        job.handle = comm.alltoall_async(rows.reshape(-1))
        encoder.feed_shards(job, shards, bounds)
        job.stages = [lambda: self._second_phase(job)]

    def _second_phase(self, job: "Job") -> None:
        """Phase 2: wait for the all-to-all, aggregate this rank's shard, feed the second-stage
        memory and start the allgather of its compressed aggregate."""
        sharded, compressor, name, second, encoder = job.flight, job.compressor, job.group.name, self.second, \
            self.encoder
        rows = self.wait(job, "the all-to-all")
        arrived = [unpack_payload(row, sharded.specs) for row in rows]
        total = compressor.aggregate(arrived, sharded.ctx, self.comm.size, encoder.average)
        shard = total.numel()
        job.count("decode", compressor.passes.aggregated(len(arrived), encoder.average), shard)
        feedback = job.feedback and encoder.memory.feeds_back and not second.lossless
        compensated = total
        if feedback:
            with self.clock(MEMORY, name):
                compensated = self.memory.compensate(total, name)
                job.count("compensate", self.memory.passes.compensate, shard)
        with self.clock(ENCODE, name):
            payload, ctx = second.compress(compensated, name)
            job.count("encode", second.passes.compress, shard)
            raw, _ = pack_payload(payload)
            job.handle = job.comm.allgather_async(sharded.pad(raw))
        if feedback:
            with self.clock(MEMORY, name):
                job.count("memory", feed(self.memory, second, compensated, name, [(payload, ctx, 0)]), shard)

    def finish(self, job: "Job", out: Optional[torch.Tensor]) -> torch.Tensor:
        """Phase 2's end: decode every rank's aggregated shard into the aggregate of ``job.span``."""
        rows = self.wait(job, "the allgather")
        sharded, second, like, encoder = job.flight, self.second, job.compensated, self.encoder
        offset, end = job.span
        result = out if out is not None else job.compressor.scratch(end - offset, like.dtype, like.device)
        for row, (start, stop), (ctx, specs) in zip(rows, sharded.bounds, sharded.layouts):
            job.count("decode", second.passes.decompress, stop - start)
            encoder.decode_into(job, result[start - offset:stop - offset], second.decompress,
                                unpack_payload(row, specs), ctx)
        return result

    def take_carry(self, name: str) -> Optional[torch.Tensor]:
        return self.memory.take_carry(name)

    def has_carry(self, name: str) -> bool:
        return self.memory.has_carry(name)

    def fold(self, group: Group, comm: Communicator, span: Tuple[int, int]) -> None:
        """This rank's second-stage residual of ``group`` becomes a carry at its elements, scaled
        to a gradient of its own (times the number of ranks when averaging)."""
        start, _ = self.bounds(comm, span)[comm.rank]
        self.memory.fold(group.name, group.numel, start, self.comm.size if self.encoder.average else 1)
