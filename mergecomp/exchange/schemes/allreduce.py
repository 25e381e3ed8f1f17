"""Allreduce: payloads that add up (:attr:`~mergecomp.compressors.base.compressor.Compressor.summable`:
casts, rand-k's shared indices, PowerSGD's factors) are summed over the ranks in place.

On the wire, per rank: about twice the payload (a ring allreduce).  A payload of several
tensors is concatenated into one buffer first (one collective per round).  The memory is fed
before the last round's collective, which overwrites the payload with the sum.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import torch

from mergecomp.compressors.base.compressor import Payload
from mergecomp.exchange.schemes.base import WholeGroup

if TYPE_CHECKING:
    from mergecomp.exchange.job import Job

__all__ = ["AllReduce"]


class AllReduce(WholeGroup):
    """Each round's payload summed over the ranks by one allreduce."""

    name = "allreduce"
    sums = True

    def send(self, job: "Job", last: bool) -> None:
        if last:  # the sum is taken in place: this rank's payload is needed for the memory first
            self.encoder.feed(job)
        payload = job.payload
        buffer = payload[0] if len(payload) == 1 else torch.cat([t.reshape(-1) for t in payload])
        job.handle = job.comm.allreduce_async(buffer)

    def received(self, job: "Job") -> List[Payload]:
        summed = self.wait(job, f"round {job.flight}")
        if len(job.payload) == 1:
            return [(summed,)]
        return [tuple(part.view(t.shape) for part, t in zip(summed.split([t.numel() for t in job.payload]),
                                                              job.payload))]
