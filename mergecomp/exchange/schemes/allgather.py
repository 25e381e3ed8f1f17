"""Allgather: every rank's payload of the whole group goes to every rank, which decodes and
aggregates them all (the mean, or a majority vote).

On the wire, per rank: its payload out and the N-1 others' in: bytes and decode work grow with
the number of ranks N (:mod:`.two_phase` keeps them flat).  A payload travels as one byte
buffer (one collective per group and round, :mod:`mergecomp.kernels.wire`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

from mergecomp.compressors.base.compressor import Payload
from mergecomp.exchange.schemes.base import WholeGroup
from mergecomp.kernels.wire import pack_payload, specs_of, unpack_payload

if TYPE_CHECKING:
    from mergecomp.exchange.job import Job

__all__ = ["AllGather"]


class AllGather(WholeGroup):
    """Each round's payload, packed into bytes, gathered from every rank by one allgather."""

    name = "allgather"

    def send(self, job: "Job", last: bool) -> None:
        buffer, _ = pack_payload(job.payload, borrow=job.owned)
        job.handle = job.comm.allgather_async(buffer)
        if last:
            self.encoder.feed(job)

    def received(self, job: "Job") -> List[Payload]:
        rows = self.wait(job, f"round {job.flight}")
        specs = specs_of(job.payload)  # every rank's payload has this rank's shapes and dtypes
        return [unpack_payload(row, specs) for row in rows]
