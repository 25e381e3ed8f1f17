"""Reduce-scatter: each rank ends with its own shard of the group, reduced over the ranks (FSDP's
reduce-scatter, ``mc.fsdp``).

The group's buffer is ``N`` equal chunks, chunk ``d`` the shard rank ``d`` reduces (the
caller's layout: FSDP pads its flat gradients so)::

    start    cut the error-compensated group into its N chunks, compress each on its own, as
             two-phase's first phase does (:meth:`ShardedEncode.compress_shard`); one all-to-all
             sends chunk d's payload to rank d, each row followed by a flag: whether the
             sender's gradients were finite
    finish   rank d aggregates the N - 1 payloads it received (their sum) and adds its own
             chunk exactly: the sum, or the mean, of chunk d over the ranks

The memory keeps what was not sent: zero at the own chunk, which is never compressed.  On the
wire, per rank: ``(N - 1) / N`` of the group's compressed bytes out and in.  A sender's flag
makes every rank's shard NaN and :attr:`Job.all_finite` False, so that the caller puts the
step's state back on every rank.  On one rank the own chunk is the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from mergecomp.exchange.schemes.base import Scheme
from mergecomp.exchange.schemes.two_phase import Bounds
from mergecomp.kernels.wire import Spec, pack_rows, unpack_payload

if TYPE_CHECKING:
    from mergecomp.exchange.job import Job

__all__ = ["ReduceScatter", "chunk_bounds"]

#: bytes after each packed payload row: 1 where the sender's gradients were not finite
_FLAG_BYTES = 8  # keeps the rows 8-aligned


def chunk_bounds(numel: int, parts: int) -> Bounds:
    """``parts`` equal ``(start, stop)`` chunks of ``numel`` elements; ValueError where they
    cannot be equal."""
    if numel % parts:
        raise ValueError(f"a reduce-scatter cuts its group into {parts} equal chunks; {numel} elements do not")
    chunk = numel // parts
    return [(d * chunk, (d + 1) * chunk) for d in range(parts)]


@dataclass
class Scattered:
    """A group in flight: its chunks, the ctx and specs of this rank's chunk's payloads."""

    bounds: Bounds
    ctx: Any
    specs: List[Spec]


class ReduceScatter(Scheme):
    """See the module docstring: :meth:`finish` returns this rank's reduced chunk."""

    name = "reduce-scatter"

    def start(self, job: "Job") -> None:
        comm, encoder = job.comm, self.encoder
        bounds = chunk_bounds(job.span[1] - job.span[0], comm.size)
        if comm.size == 1:
            job.flight = Scattered(bounds, None, [])
            return
        own = bounds[comm.rank]
        shards = encoder.encode_shards(job, bounds)
        rows, specs = pack_rows([payload for payload, _ in shards])
        flags = job.finite.logical_not().to(torch.uint8).expand(comm.size, _FLAG_BYTES)
        job.flight = Scattered(bounds, shards[comm.rank][1], specs[comm.rank])
        job.handle = comm.alltoall_async(torch.cat([rows, flags], dim=1).reshape(-1))
        others = [d for d in range(comm.size) if d != comm.rank]
        encoder.feed_shards(job, [shards[d] for d in others], [bounds[d] for d in others], exact=own)

    def finish(self, job: "Job", out: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk reduced over the ranks (in ``out`` when given); NaN where any
        sender's gradients were not finite."""
        comm, scattered, compressor = job.comm, job.flight, job.compressor
        start, stop = scattered.bounds[comm.rank]
        own = job.compensated[start:stop]
        result = out if out is not None else compressor.scratch(stop - start, own.dtype, own.device)
        if comm.size == 1:
            job.all_finite = True
            return result.copy_(own)
        received = self.wait(job, "the compressed reduce-scatter").view(comm.size, -1)
        job.all_finite = not bool(received[:, -1].any())
        if not job.all_finite:
            return result.fill_(float("nan"))
        payloads = [unpack_payload(received[s, :-_FLAG_BYTES], scattered.specs)
                    for s in range(comm.size) if s != comm.rank]
        job.count("decode", compressor.passes.aggregated(len(payloads), False), stop - start)
        torch.add(compressor.aggregate(payloads, scattered.ctx, 1, False), own, out=result)
        return result.div_(comm.size) if self.encoder.average else result
