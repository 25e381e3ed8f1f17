"""The hierarchical exchange of a group: sum inside each host, compress across hosts.

A group sent with :data:`~mergecomp.pipeline.plan.HIERARCHICAL` (or
:data:`~mergecomp.pipeline.plan.HIERARCHICAL_TWO_PHASE`) on H hosts of L processes each
(:meth:`~mergecomp.engines.communicator.Communicator.split_hosts`: ``local`` inside this host, ``cross`` over
the processes with this local rank on every host) travels in three collectives::

    in the host    the error-compensated group, uncompressed, zero-padded to L blocks of
                   :attr:`Hosts.chunk` elements (:func:`~mergecomp.schemes.two_phase.shard_bounds`);
                   one all-to-all on ``local`` sends block j to local rank j, which sums the L
                   blocks: its shard of the host's sum
    across hosts   local rank j compresses its shard and exchanges it on ``cross`` by the flat
                   scheme (the compressor's allgather, or allreduce where payloads sum) or, for
                   ``hierarchical-two-phase``, by the two-phase scheme (:mod:`mergecomp.schemes.two_phase`),
                   and aggregates the H hosts' payloads of its shard
    in the host    one allgather on ``local`` of each rank's aggregated shard, uncompressed and
                   padded to ``chunk``; every rank copies the L shards into the group's result

On the wire, per rank: ``(L-1)/L`` of the group's uncompressed bytes out and in by each of
the two collectives inside the host; across hosts, what the scheme sends for a 1/L shard.
The error-feedback memory compensates the whole group before the all-to-all and is fed what
this rank compresses: its shard of the host's sum (the group, zero elsewhere).  On one host, or
on hosts of one process, a hierarchical codec is sent as its flat counterpart (:data:`FLAT`).

:class:`HostLevel` holds these stages as methods of :class:`~mergecomp.pipeline.exchange.Exchange`, which
it is mixed into and whose waits, compression and flat or two-phase scheme it uses across hosts:
``_reduce_in_host`` starts a group and queues ``_across_hosts``, the two-phase allgather where it
applies and ``_gather_in_host`` as its stages (:meth:`~mergecomp.pipeline.exchange.Exchange.advance`);
``_gather_hosts`` ends it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mergecomp.engines.communicator import Communicator
from mergecomp.pipeline.breakdown import ENCODE
from mergecomp.pipeline.plan import HIERARCHICAL, HIERARCHICAL_TWO_PHASE, TWO_PHASE
from mergecomp.schemes.two_phase import Bounds, pad_to, shard_bounds, shard_size, zero_outside

__all__ = ["FLAT", "Hosts", "HostLevel", "across_hosts_of"]

#: the flat scheme each hierarchical codec becomes on one host or on hosts of one process
FLAT = {HIERARCHICAL: "compressed", HIERARCHICAL_TWO_PHASE: TWO_PHASE}


def across_hosts_of(comm: Communicator) -> Optional[Tuple[Communicator, Communicator]]:
    """``(local, cross)`` (:meth:`~mergecomp.engines.communicator.Communicator.split_hosts`, a collective the
    first time) where ``comm`` has several processes on each of several hosts; None where a
    hierarchical codec is its flat counterpart (:data:`FLAT`): one host, or one process per host."""
    local, cross = comm.split_hosts()
    return None if local.size == 1 or cross.size == 1 else (local, cross)


@dataclass
class Hosts:
    """A group in the hierarchical scheme: the communicators inside this host and across
    hosts, the group's ``bounds`` cut in one shard per local rank (each at most ``chunk``
    elements), and whether the shards cross hosts by the two-phase scheme."""

    local: Communicator
    cross: Communicator
    bounds: Bounds
    chunk: int
    two_phase: bool = False

    @property
    def span(self) -> Tuple[int, int]:
        """This rank's shard."""
        return self.bounds[self.local.rank]


class HostLevel:
    """The hierarchical scheme's stages, mixed into :class:`~mergecomp.pipeline.exchange.Exchange` (they
    use its ``comm``, ``compressor``, ``clock``, ``_collected``, ``_compress``, ``_scatter_shards``,
    ``_second_phase`` and ``_reduce``); ``job`` is the group's
    :class:`~mergecomp.pipeline.exchange.InFlight`."""

    def _host_level(self, numel: int, two_phase: bool = False) -> Hosts:
        """The host level of a group of ``numel`` elements in the hierarchical scheme."""
        local, cross = self.comm.split_hosts()
        align = self.compressor.shard_alignment
        return Hosts(local, cross, shard_bounds(numel, local.size, align), shard_size(numel, local.size, align),
                     two_phase)

    def _reduce_in_host(self, job, two_phase: bool) -> None:
        """The scheme's first collective: the compensated group, cut in one shard per local rank
        (padded to equal blocks), by all-to-all inside the host; queue the stages that follow."""
        hosts = job.hosts = self._host_level(job.compensated.numel(), two_phase)
        job.comm, job.span = hosts.local, hosts.span
        job.handle = hosts.local.alltoall_async(_padded(job, job.compensated, hosts.local.size * hosts.chunk))
        job.stages = [self._across_hosts, *([self._second_phase] if two_phase else []), self._gather_in_host]

    def _across_hosts(self, job) -> None:
        """Sum this rank's shard over the host into ``job.compensated`` (zero elsewhere: what
        this rank now holds of the host's gradients, for the memory) and start its compressed
        exchange across hosts: the flat scheme, or the two-phase scheme."""
        rows = self._collected(job, "reduce-scatter in the host")
        (start, stop), compensated = job.span, job.compensated
        torch.sum(rows[:, :stop - start], dim=0, out=compensated[start:stop])
        zero_outside(compensated, start, stop)
        job.count("decode", 1)  # reads every local rank's shard, writes this one, zeroes the rest
        job.comm = job.hosts.cross
        with self.clock(ENCODE, job.group.name):
            if job.hosts.two_phase:
                self._scatter_shards(job)
            else:
                self._compress(job)

    def _gather_in_host(self, job) -> None:
        """Aggregate this rank's shard across hosts and start its allgather inside the host."""
        shard = self._reduce(job, None)
        job.comm = job.hosts.local
        with self.clock(ENCODE, job.group.name):
            job.handle = job.comm.allgather_async(_padded(job, shard, job.hosts.chunk))

    def _gather_hosts(self, job, out: Optional[torch.Tensor]) -> torch.Tensor:
        """The scheme's end: every local rank's aggregated shard into the group's result
        (``out`` when given)."""
        rows = self._collected(job, "allgather in the host")
        like = job.compensated
        result = out if out is not None else job.compressor.scratch(like.numel(), like.dtype, like.device)
        for row, (start, stop) in zip(rows, job.hosts.bounds):
            result[start:stop] = row[:stop - start]
        job.count("decode", 1)
        job.hosts = None
        return result


def _padded(job, tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`~mergecomp.schemes.two_phase.pad_to`, its copy counted as an ``encode`` pass."""
    padded = pad_to(tensor, numel)
    if padded is not tensor:
        job.count("encode", 1, tensor.numel())
    return padded
