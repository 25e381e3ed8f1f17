"""The codec side of a group's exchange: error compensation, encoding, the memory's update and
decoding into the result, as every scheme (:mod:`mergecomp.exchange.schemes`) asks for them.

A scheme decides *what* is encoded when (the whole group, its shards, a shard of the host's
sum); the :class:`Encoder` does it the one way the pipeline does it everywhere, on the
exchange's clock, counting its passes on the group's :class:`~mergecomp.exchange.job.Job`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from mergecomp.compressors.base.capabilities import (NOT_FINITE, Fused, FusedEncode, FusedParts, NotFinite, PartsEncode,
                                                     SparseEntries, SubtractsDecode, encode_checked, encode_shard)
from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.memory import Memory
from mergecomp.exchange.breakdown import MEMORY, Stopwatch
from mergecomp.exchange.job import Job
from mergecomp.kernels.codecs import all_finite
from mergecomp.kernels.workspace import Workspace

__all__ = ["Encoder", "fused", "fused_parts", "feed"]

#: one encoded part of a group: ``(payload, ctx)``
Encoded = Tuple[Payload, Any]


def fused(compressor: Compressor, memory: Memory, tensor: torch.Tensor, name: str,
          shapes: Optional[Sequence[torch.Size]] = None, check: bool = False,
          clear: bool = False) -> Union[None, Fused, NotFinite]:
    """``compressor``'s fused encode of group ``name`` with ``memory``
    (:class:`~mergecomp.compressors.base.capabilities.FusedEncode`), where the compressor offers
    one for the memory's residual: ``(payload, ctx, update)``, or with ``check`` (for a
    compressor that ``checks_finite``) :data:`NOT_FINITE` for a ``tensor`` holding NaN/Inf;
    else None.  ``clear`` (for a compressor that ``clears``): ``tensor`` zeroed by the encode."""
    if not isinstance(compressor, FusedEncode):
        return None
    residual = memory.fused_residual(tensor, name, carried=compressor.carries_residual)
    check = check and compressor.checks_finite
    clear = clear and compressor.clears
    return None if residual is None else compressor.compress_fused(tensor, name, shapes, residual, check, clear)


def fused_parts(compressor: Compressor, memory: Memory, like: torch.Tensor, name: str,
                parts: int) -> Optional[FusedParts]:
    """``compressor``'s fused encode of group ``name`` (``like``: a tensor of its numel, dtype
    and device) part by part as its ``parts`` gradients arrive, with ``memory``
    (:class:`~mergecomp.compressors.base.capabilities.PartsEncode`), where it offers one; else
    None."""
    if not isinstance(compressor, PartsEncode):
        return None
    residual = None
    if not memory.passthrough:
        if not compressor.takes_residual:
            return None
        residual = memory.fused_residual(like, name, carried=compressor.carries_residual)
        if residual is None:
            return None
    return compressor.compress_fused_parts(like, name, parts, residual)


def feed(memory: Memory, codec: Compressor, compensated: torch.Tensor, name: str,
         parts: Sequence[Tuple[Payload, Any, int]], exact: Optional[Tuple[int, int]] = None) -> float:
    """Tell ``memory`` what of ``compensated`` (group ``name``) ``codec`` sent in ``parts``, each
    ``(payload, ctx, start)``: payloads of ranges of ``compensated`` in order, each from its
    ``start`` on (as many elements as it decodes to), with ``exact`` (``(start, stop)``) sent
    exactly, in the one gap between them if any, and nothing else.  The cheapest way the codec
    and the memory allow: the codec writes the residual of a whole-group payload itself
    (:class:`~mergecomp.compressors.base.capabilities.SubtractsDecode`, where the memory lends
    its buffer); the sent entries (``update_sparse``); nothing for a lossless payload of the
    whole group the memory takes note of (``sent_whole``); else the decodes side by side, zero
    elsewhere (``update``).  Returns the passes made over ``compensated``."""
    whole = len(parts) == 1 and parts[0][2] == 0 and exact is None
    if whole and isinstance(codec, SubtractsDecode):
        writer = memory.residual_writer(name, compensated)
        payload, ctx, _ = parts[0]
        if writer is not None and codec.subtract_decoded(payload, ctx, compensated, writer):
            return codec.passes.subtract_decoded
    entries = [codec.sent_entries(payload, ctx) if isinstance(codec, SparseEntries) else None
               for payload, ctx, _ in parts]
    if all(e is not None for e in entries):
        indices = [i + start if start else i for (i, _), (_, _, start) in zip(entries, parts)]
        values = [v for _, v in entries]
        if exact is not None:  # in the gradient's dtype: nothing of the exact range is left behind
            indices.append(torch.arange(*exact, dtype=indices[0].dtype, device=indices[0].device))
            values = [v.to(compensated.dtype) for v in values] + [compensated[exact[0]:exact[1]]]
        memory.update_sparse(compensated, name, *(torch.cat(t) if len(t) > 1 else t[0] for t in (indices, values)))
        return memory.passes.sparse_update
    first = codec.decompress(*parts[0][:2])
    if whole and first.numel() == compensated.numel():
        if codec.lossless and memory.sent_whole(name):
            return 0  # nothing left behind: no residual to write
        memory.update(compensated, name, first)
        return codec.passes.decompress + memory.passes.update
    sent = codec.scratch(compensated.numel(), first.dtype, first.device)
    sent[:parts[0][2]].zero_()
    stop = decoded = 0
    for g, (payload, ctx, start) in enumerate(parts):
        part = first if g == 0 else codec.decompress(payload, ctx)
        stop = start + part.numel()
        sent[start:stop] = part
        decoded += part.numel()
    sent[stop:].zero_()
    if exact is not None:
        sent[exact[0]:exact[1]] = compensated[exact[0]:exact[1]]
    memory.update(compensated, name, sent)
    # the decodes, the copies into `sent` and the zeros around them, the update
    return codec.passes.decompress * decoded / max(compensated.numel(), 1) + 1 + memory.passes.update


class Encoder:
    """Encodes with the configured ``compressor`` (or the job's own codec) and keeps the
    error-feedback ``memory`` in step with what was sent.

    Args:
        compressor: the configured compressor (its shard alignment and second-phase codec are
            the sharded schemes').
        memory: the first-stage error-feedback memory.
        clock: the exchange's stopwatch (:mod:`mergecomp.exchange.breakdown`).
        workspace: the codecs' scratch buffers, or None.
        check_finite: a payload that may overflow (a cast) is checked (:attr:`Job.overflowed`).
        average: results are the mean over ranks (else the sum).
    """

    def __init__(self, compressor: Compressor, memory: Memory, clock: Stopwatch, workspace: Optional[Workspace],
                 check_finite: bool, average: bool) -> None:
        self.compressor = compressor
        self.memory = memory
        self.clock = clock
        self.workspace = workspace
        self.check_finite = check_finite
        self.average = average

    def compensate(self, job: Job, carry: Optional[torch.Tensor]) -> None:
        """Fold the memory and ``carry`` (what a plan change left; None: nothing) into the job's
        gradient."""
        name, memory = job.group.name, self.memory
        with self.clock(MEMORY, name):
            job.compensated = memory.compensate(job.compensated, name)
            job.count("compensate", memory.compensate_passes_of(name))
            if carry is not None:
                job.compensated.add_(carry)
                job.count("compensate", 1)

    def fuse(self, job: Job, check: bool = False) -> Union[bool, NotFinite]:
        """Compensate and encode the whole group by the compressor's fused encode
        (:class:`~mergecomp.compressors.base.capabilities.FusedEncode`), where it offers one for
        this memory's residual: returns whether it did (``job.compensated`` stays the gradient
        as given; :meth:`feed` then runs the memory's update).  ``check``: the encode is also
        the gradient's NaN/Inf check, where the compressor ``checks_finite``; it returns
        :data:`NOT_FINITE` for a gradient holding one (nothing taken, the memory's target
        written).  Where the job's buffer is :attr:`~mergecomp.exchange.job.Job.scratch`, a
        compressor that ``clears`` zeroes it in the same pass (:attr:`Job.zeroed`)."""
        encoded = fused(job.compressor, self.memory, job.compensated, job.group.name, job.group.shapes, check,
                        job.scratch)
        if encoded is NOT_FINITE:
            return encoded
        taken = self.take(job, encoded)
        job.zeroed = taken and job.scratch and job.compressor.clears
        return taken

    def parts(self, name: str, like: torch.Tensor, parts: int) -> Optional[FusedParts]:
        """The configured compressor's encode of group ``name`` part by part with this memory
        (:func:`fused_parts`), or None."""
        return fused_parts(self.compressor, self.memory, like, name, parts)

    def take(self, job: Job, encoded: Optional[Fused]) -> bool:
        """The job's payload from a fused encode's ``(payload, ctx, update)``; None: returns False.
        A payload that may overflow is checked as :meth:`encode` checks it (top-k's values cast
        to fp16: a pass over the k values)."""
        if encoded is None:
            return False
        job.payload, job.ctx, job.update = encoded
        job.encoded = True
        job.count("encode", job.compressor.passes.fused_compress)
        if job.compressor.may_overflow and self.check_finite:
            self._check_payload(job, None, job.payload[0].numel())
        return True

    def _check_payload(self, job: Job, finite: Optional[bool], numel: int) -> None:
        """:attr:`Job.overflowed` from ``finite`` (whether the payload is, where its encode
        told), else from a pass over the payload's first tensor, counted over ``numel``."""
        if finite is None:
            finite = all_finite(job.payload[0])
            job.count("check", 1, numel)
        job.overflowed = torch.as_tensor(finite, device=job.compensated.device).logical_not()

    def encode(self, job: Job) -> None:
        """Encode the elements of ``job.span`` as one payload (a part of the group as a shard,
        :meth:`~mergecomp.compressors.base.capabilities.ShardedEncode.compress_shard`).  A
        payload that may overflow is checked (in the encode's own pass where it has one); where
        the encode is also the gradient's NaN/Inf check (:attr:`Job.checked_by_encode`), a
        payload found not finite is zeroed, and the gradient checked again to tell NaN/Inf from
        an overflow."""
        (start, stop), compensated, compressor = job.span, job.compensated, job.compressor
        job.count("encode", compressor.passes.compress, stop - start)
        finite = None
        if stop - start == compensated.numel():
            job.payload, job.ctx, finite = encode_checked(compressor, compensated, job.group.name, job.group.shapes)
        else:
            job.payload, job.ctx = encode_shard(compressor, compensated[start:stop], job.group.name, start,
                                                compensated.numel())
        if job.checked_by_encode or (compressor.may_overflow and self.check_finite):
            self._check_payload(job, finite, stop - start)
            if job.checked_by_encode and job.overflowed:  # on the CPU; a NaN/Inf gradient, or one beyond the cast
                job.finite = all_finite(compensated)
                job.overflowed &= job.finite
                for t in job.payload:
                    t.zero_()

    def encode_shards(self, job: Job, bounds: Sequence[Tuple[int, int]]) -> List[Encoded]:
        """Each ``(start, stop)`` of ``bounds`` (cutting ``job.span``) encoded as a payload of its own."""
        compressor, compensated, name = job.compressor, job.compensated, job.group.name
        job.count("encode", compressor.passes.compress, job.span[1] - job.span[0])
        return [encode_shard(compressor, compensated[a:b], name, a, compensated.numel()) for a, b in bounds]

    def feed(self, job: Job) -> None:
        """The memory's update for the job's payload, once it is sent or copied: a fused
        encode's own update, or :func:`feed` of what the payload encodes."""
        name = job.group.name
        if job.update is not None:
            with self.clock(MEMORY, name):
                job.update()
                job.count("memory", job.compressor.passes.fused_update)
            job.update = None
        elif job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, name):
                job.count("memory", feed(self.memory, job.compressor, job.compensated, name,
                                         [(job.payload, job.ctx, job.span[0])]))

    def feed_shards(self, job: Job, shards: Sequence[Encoded], bounds: Sequence[Tuple[int, int]],
                    exact: Optional[Tuple[int, int]] = None) -> None:
        """The memory's update for ``shards`` (from :meth:`encode_shards` over ``bounds``), and the
        range ``exact`` sent as it is (:func:`feed`)."""
        if job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, job.group.name):
                job.count("memory", feed(self.memory, job.compressor, job.compensated, job.group.name,
                                         [(payload, ctx, start) for (payload, ctx), (start, _) in zip(shards, bounds)],
                                         exact))

    def decode_into(self, job: Job, out: Optional[torch.Tensor], decode: Callable[..., torch.Tensor],
                    *args) -> torch.Tensor:
        """``decode(*args)``, in ``out`` when given: the codec decodes straight into it when it
        takes its output from the workspace (lent as holding zeros where the job's fused encode
        zeroed it, :attr:`Job.zeroed`), else the result is copied there (``copy-out``)."""
        lend = (self.workspace.serving(out, zeroed=job.zeroed and out is job.compensated)
                if out is not None and self.workspace is not None else contextlib.nullcontext())
        with lend:
            result = decode(*args)
        if out is not None and result.data_ptr() != out.data_ptr():
            result = out.copy_(result)
            job.count("copy-out", 1, out.numel())
        return result
