"""The codec side of a group's exchange: error compensation, encoding, the memory's update and
decoding into the result, as every scheme (:mod:`mergecomp.schemes`) asks for them.

A scheme decides *what* is encoded when (the whole group, its shards, a shard of the host's
sum); the :class:`Encoder` does it the one way the pipeline does it everywhere, on the
exchange's clock, counting its passes on the group's :class:`~mergecomp.pipeline.job.Job`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.memory import Memory
from mergecomp.kernels.codecs import all_finite
from mergecomp.kernels.workspace import Workspace
from mergecomp.pipeline.breakdown import MEMORY, Stopwatch
from mergecomp.pipeline.job import Job

__all__ = ["Encoder"]

#: one encoded part of a group: ``(payload, ctx)``
Encoded = Tuple[Payload, Any]


class Encoder:
    """Encodes with the configured ``compressor`` (or the job's own codec) and keeps the
    error-feedback ``memory`` in step with what was sent.

    Args:
        compressor: the configured compressor (its shard alignment and second-phase codec are
            the sharded schemes').
        memory: the first-stage error-feedback memory.
        clock: the exchange's stopwatch (:mod:`mergecomp.pipeline.breakdown`).
        workspace: the codecs' scratch buffers, or None.
        check_finite: a payload that may overflow (a cast) is checked where error feedback
            compensated it (:attr:`Job.overflowed`).
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

    def fuse(self, job: Job) -> bool:
        """Compensate and encode the whole group by the compressor's fused encode
        (:meth:`Compressor.compress_fused`), where it offers one for this memory: returns
        whether it did (``job.compensated`` stays the gradient as given; :meth:`feed` then runs
        the memory's update)."""
        return self.take(job, job.compressor.compress_fused(job.compensated, job.group.name, job.group.shapes,
                                                            self.memory))

    def take(self, job: Job, fused: Optional[Tuple[Payload, Any, Callable[[], None]]]) -> bool:
        """The job's payload from a fused encode's ``(payload, ctx, update)``; None: returns False."""
        if fused is None:
            return False
        job.payload, job.ctx, job.update = fused
        job.encoded = True
        job.count("encode", job.compressor.fused_compress_passes)
        return True

    def encode(self, job: Job) -> None:
        """Encode the elements of ``job.span`` as one payload (a part of the group as a shard,
        :meth:`Compressor.compress_shard`).  A payload that may overflow is checked where error
        feedback compensated it, or where the encode is the gradient's NaN/Inf check
        (:attr:`Job.checked_by_encode`: a payload found not finite is zeroed, and the gradient
        checked again to tell NaN/Inf from an overflow)."""
        (start, stop), compensated, compressor = job.span, job.compensated, job.compressor
        job.count("encode", compressor.compress_passes, stop - start)
        finite = None
        if stop - start == compensated.numel():
            job.payload, job.ctx, finite = compressor.compress_checked(compensated, job.group.name, job.group.shapes)
        else:
            job.payload, job.ctx = compressor.compress_shard(compensated[start:stop], job.group.name, start,
                                                             compensated.numel())
        if job.checked_by_encode or (compressor.may_overflow and self.check_finite and job.feedback
                                     and self.memory.feeds_back):
            if finite is None:
                finite = all_finite(job.payload[0])
                job.count("check", 1, stop - start)
            job.overflowed = torch.as_tensor(finite, device=compensated.device).logical_not()
            if job.checked_by_encode and job.overflowed:  # on the CPU; a NaN/Inf gradient, or one beyond the cast
                job.finite = all_finite(compensated)
                job.overflowed &= job.finite
                for t in job.payload:
                    t.zero_()

    def encode_shards(self, job: Job, bounds: Sequence[Tuple[int, int]]) -> List[Encoded]:
        """Each ``(start, stop)`` of ``bounds`` (cutting ``job.span``) encoded as a payload of its own."""
        compressor, compensated, name = job.compressor, job.compensated, job.group.name
        job.count("encode", compressor.compress_passes, job.span[1] - job.span[0])
        return [compressor.compress_shard(compensated[a:b], name, a, compensated.numel()) for a, b in bounds]

    def feed(self, job: Job) -> None:
        """The memory's update for the job's payload, once it is sent or copied: a fused
        encode's own update, or :meth:`Memory.feed` of what the payload encodes."""
        name = job.group.name
        if job.update is not None:
            with self.clock(MEMORY, name):
                job.update()
                job.count("memory", job.compressor.fused_update_passes)
            job.update = None
        elif job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, name):
                job.count("memory", self.memory.feed(job.compressor, job.compensated, name, job.payload, job.ctx,
                                                     job.span[0]))

    def feed_shards(self, job: Job, shards: Sequence[Encoded], bounds: Sequence[Tuple[int, int]]) -> None:
        """The memory's update for ``shards`` (from :meth:`encode_shards` over ``bounds``)."""
        if job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, job.group.name):
                job.count("memory", self.memory.feed_parts(
                    job.compressor, job.compensated, job.group.name,
                    [(payload, ctx, start) for (payload, ctx), (start, _) in zip(shards, bounds)]))

    def decode_into(self, job: Job, out: Optional[torch.Tensor], decode: Callable[..., torch.Tensor],
                    *args) -> torch.Tensor:
        """``decode(*args)``, in ``out`` when given: the codec decodes straight into it when it
        takes its output from the workspace, else the result is copied there (``copy-out``)."""
        lend = (self.workspace.serving(out) if out is not None and self.workspace is not None
                else contextlib.nullcontext())
        with lend:
            result = decode(*args)
        if out is not None and result.data_ptr() != out.data_ptr():
            result = out.copy_(result)
            job.count("copy-out", 1, out.numel())
        return result
