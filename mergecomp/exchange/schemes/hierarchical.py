"""Hierarchical: sum inside each host, compress across hosts.

A group sent with ``"hierarchical"`` (or ``"hierarchical-two-phase"``) on H hosts of L
processes each (:meth:`~mergecomp.engines.communicator.Communicator.split_hosts`: ``local``
inside this host, ``cross`` over the processes with this local rank on every host) travels in
three collectives::

    in the host    the error-compensated group, uncompressed, zero-padded to L blocks of
                   :attr:`Hosts.chunk` elements (:func:`~mergecomp.exchange.schemes.two_phase.shard_bounds`);
                   one all-to-all on ``local`` sends block j to local rank j, which sums the L
                   blocks: its shard of the host's sum
    across hosts   local rank j compresses its shard and exchanges it on ``cross`` by the scheme
                   of the group's fallback (:mod:`.allgather` or :mod:`.allreduce` as the
                   compressor's payloads require, or :mod:`.two_phase` for
                   ``hierarchical-two-phase``), and aggregates the H hosts' payloads of its shard
    in the host    one allgather on ``local`` of each rank's aggregated shard, uncompressed and
                   padded to ``chunk``; every rank copies the L shards into the group's result

On the wire, per rank: ``(L-1)/L`` of the group's uncompressed bytes out and in by each of
the two collectives inside the host; across hosts, what the scheme sends for a 1/L shard.
The error-feedback memory compensates the whole group before the all-to-all and is fed what
this rank compresses: its shard of the host's sum (the group, zero elsewhere).  On one host, or
on hosts of one process, a group of these schemes is sent by its fallback (:meth:`Hierarchical.applies`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from mergecomp.compressors.base.capabilities import shard_alignment
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.breakdown import ENCODE
from mergecomp.exchange.plan import Group
from mergecomp.exchange.schemes.base import Scheme
from mergecomp.exchange.schemes.two_phase import Bounds, pad_to, shard_bounds, shard_size, zero_outside

if TYPE_CHECKING:
    from mergecomp.exchange.job import Job

__all__ = ["Hierarchical", "HierarchicalTwoPhase", "Hosts", "across_hosts_of"]

def across_hosts_of(comm: Communicator) -> Optional[Tuple[Communicator, Communicator]]:
    """``(local, cross)`` (:meth:`~mergecomp.engines.communicator.Communicator.split_hosts`, a
    collective the first time) where ``comm`` has several processes on each of several hosts;
    None where the hierarchical schemes fall back: one host, or one process per host."""
    local, cross = comm.split_hosts()
    return None if local.size == 1 or cross.size == 1 else (local, cross)


@dataclass
class Hosts:
    """A group in the hierarchical scheme: the communicators inside this host and across hosts,
    and the group's ``bounds`` cut in one shard per local rank (each at most ``chunk`` elements)."""

    local: Communicator
    cross: Communicator
    bounds: Bounds
    chunk: int

    @property
    def span(self) -> Tuple[int, int]:
        """This rank's shard."""
        return self.bounds[self.local.rank]


@dataclass
class InHost:
    """A group in flight in the hierarchical scheme: its hosts' layout, and the job of this
    rank's shard across hosts once that exchange has started."""

    hosts: Hosts
    across: Optional["Job"] = None


class Hierarchical(Scheme):
    """See the module docstring: across hosts, the flat scheme of the compressor."""

    name = "hierarchical"
    sharded = True
    fallback = "compressed"

    @classmethod
    def applies(cls, comm: Communicator) -> bool:
        return across_hosts_of(comm) is not None

    def across(self) -> Scheme:
        """The scheme across hosts (the fallback's)."""
        return self.routes(self.fallback).scheme

    def hosts(self, numel: int) -> Hosts:
        """The host level of a group of ``numel`` elements."""
        local, cross = self.comm.split_hosts()
        align = shard_alignment(self.encoder.compressor)
        return Hosts(local, cross, shard_bounds(numel, local.size, align), shard_size(numel, local.size, align))

    def start(self, job: "Job") -> None:
        """The compensated group, cut in one shard per local rank (padded to equal blocks), by
        all-to-all inside the host."""
        hosts = self.hosts(job.group.numel)
        job.flight = InHost(hosts)
        job.handle = hosts.local.alltoall_async(_padded(job, job.compensated, hosts.local.size * hosts.chunk))
        job.stages = [lambda: self._across_hosts(job)]

    def _across_hosts(self, job: "Job") -> None:
        """Sum this rank's shard over the host into ``job.compensated`` (zero elsewhere: what
        this rank now holds of the host's gradients, for the memory) and start its compressed
        exchange across hosts, whose stages become this group's next ones."""
        rows = self.wait(job, "the reduce-scatter in the host")
        hosts, compensated = job.flight.hosts, job.compensated
        start, stop = hosts.span
        torch.sum(rows[:, :stop - start], dim=0, out=compensated[start:stop])
        zero_outside(compensated, start, stop)
        job.count("decode", 1)  # reads every local rank's shard, writes this one, zeroes the rest
        across = job.flight.across = job.within(self.across(), hosts.cross, hosts.span)
        with self.clock(ENCODE, job.group.name):
            across.scheme.start(across)
        job.overflowed = across.overflowed
        job.stages = [*across.stages, lambda: self._gather_in_host(job)]
        across.stages = []

    def _gather_in_host(self, job: "Job") -> None:
        """Aggregate this rank's shard across hosts and start its allgather inside the host."""
        hosts, across = job.flight.hosts, job.flight.across
        shard = across.scheme.finish(across, None)
        with self.clock(ENCODE, job.group.name):
            job.handle = hosts.local.allgather_async(_padded(job, shard, hosts.chunk))

    def finish(self, job: "Job", out: Optional[torch.Tensor]) -> torch.Tensor:
        """Every local rank's aggregated shard into the group's result."""
        rows = self.wait(job, "the allgather in the host")
        like = job.compensated
        result = out if out is not None else job.compressor.scratch(like.numel(), like.dtype, like.device)
        for row, (start, stop) in zip(rows, job.flight.hosts.bounds):
            result[start:stop] = row[:stop - start]
        job.count("decode", 1)
        return result

    def fold(self, group: Group, comm: Communicator, span: Tuple[int, int]) -> None:
        hosts = self.hosts(group.numel)
        self.across().fold(group, hosts.cross, hosts.span)


class HierarchicalTwoPhase(Hierarchical):
    """The hierarchical scheme with the two-phase scheme across hosts."""

    name = "hierarchical-two-phase"
    fallback = "two-phase"


def _padded(job: "Job", tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`~mergecomp.exchange.schemes.two_phase.pad_to`, its copy counted as an ``encode`` pass."""
    padded = pad_to(tensor, numel)
    if padded is not tensor:
        job.count("encode", 1, tensor.numel())
    return padded
