"""The exchange scheme interface, and the base of the schemes that send a group's payload whole.

A scheme moves one merged group's :class:`~mergecomp.exchange.job.Job` between the ranks: it
is the one place that knows the group's collectives, their order, and any state of its own (a
second-stage memory).  The exchange calls, for each group and on every rank in plan order::

    start(job)      the group is checked and (except where the scheme encodes as it goes)
                    error-compensated: encode what the scheme sends first, start its collective
    advance(job)    run the next stage between the first collective and the last, if any
    finish(job, out)  wait, run what is left, and return the reduced group (in ``out``)

Every stage is started in the same order on every rank: the exchange advances every group of
a step once, in plan order, again while any has stages left, and only then finishes them.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from mergecomp.compressors.base.compressor import Payload
from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.breakdown import DECODE, ENCODE, WAIT
from mergecomp.exchange.plan import Group

if TYPE_CHECKING:
    from mergecomp.exchange.encoder import Encoder
    from mergecomp.exchange.job import Job, Route

__all__ = ["Scheme", "WholeGroup", "Routes"]

#: ``routes(codec)``: the :class:`~mergecomp.exchange.job.Route` a group sent with that codec takes
Routes = Callable[[str], "Route"]


class Scheme(abc.ABC):
    """One way of exchanging a group.  One instance per exchange serves all its groups; what
    it keeps per group lives in ``job.flight`` while the group is in flight, and across steps
    in the state holders it lists in :attr:`holders`.

    Args:
        comm: the exchange's communicator: its size divides the sum when averaging.
        encoder: the exchange's :class:`~mergecomp.exchange.encoder.Encoder`.
        routes: the exchange's :data:`Routes` (for a scheme that sends part of its work by another).
    """

    #: the name groups give to be sent this way (a plan codec, the ``scheme`` option)
    name: str = ""
    #: sends the configured compressor's payloads in shards (a plan codec of its own; the
    #: compressor must take a single round)
    sharded: bool = False
    #: sends the group's payload whole on the exchange's communicator: the encode may be fused
    #: with the memory's work, or be the gradient's NaN/Inf check
    whole: bool = False
    #: the payloads travel as their sum on every rank (an allreduce)
    sums: bool = False
    #: the plan codec a group of this scheme is sent with where the scheme does not apply
    #: (:meth:`applies`); None: it applies everywhere
    fallback: Optional[str] = None

    def __init__(self, comm: Communicator, encoder: "Encoder", routes: Routes) -> None:
        self.comm = comm
        self.encoder = encoder
        self.routes = routes
        self.clock = encoder.clock

    @classmethod
    def applies(cls, comm: Communicator) -> bool:
        """Whether groups sent this way on ``comm`` take this scheme, not :attr:`fallback`."""
        return True

    @property
    def holders(self) -> Dict[str, GroupStateful]:
        """The per-group state this scheme keeps across steps, by its checkpoint key (checkpointed,
        kept and put back with a step, moved with its tensors when the plan changes)."""
        return {}

    @abc.abstractmethod
    def start(self, job: "Job") -> None:
        """Encode what is sent first and start the first collective on ``job.comm``."""

    def advance(self, job: "Job") -> bool:
        """Run the job's next stage, if any (:attr:`Job.stages`); returns whether stages are left."""
        if job.stages:
            with self.clock(DECODE, job.group.name):
                job.stages.pop(0)()
        return bool(job.stages)

    @abc.abstractmethod
    def finish(self, job: "Job", out: Optional[torch.Tensor]) -> torch.Tensor:
        """Wait for the job's last collective (its stages all run) and return the reduced
        elements of ``job.span``: in ``out`` when given, else in the codec's scratch."""

    def take_carry(self, name: str) -> Optional[torch.Tensor]:
        """What this scheme's state left for group ``name``'s next compensation when the plan
        changed (:meth:`fold`), removed; None: nothing."""
        return None

    def has_carry(self, name: str) -> bool:
        """Whether :meth:`take_carry` would return something for group ``name``."""
        return False

    def fold(self, group: Group, comm: Communicator, span: Tuple[int, int]) -> None:
        """Before the plan changes away from ``group`` (sent this way among ``comm``'s ranks,
        its elements ``span``): turn its state into what its elements carry to their new groups."""

    def wait(self, job: "Job", phase: str) -> torch.Tensor:
        """The result of the job's collective in flight (the ``wait`` part of the step);
        ``phase`` names it in a timeout's error."""
        with self.clock(WAIT, job.group.name):
            return job.handle.wait(job.what(phase))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WholeGroup(Scheme):
    """The base of the schemes that send each rank's payload of the group whole and aggregate
    the payloads that arrive (:mod:`.allreduce`, :mod:`.allgather`), round by round for a
    compressor of several rounds.  A subclass says how a round's payload is sent
    (:meth:`send`) and what arrives (:meth:`received`)."""

    whole = True

    def start(self, job: "Job") -> None:
        if not job.encoded:
            self.encoder.encode(job)
        job.flight = 1  # the round in flight
        self.send(job, last=job.compressor.rounds == 1)

    def finish(self, job: "Job", out: Optional[torch.Tensor]) -> torch.Tensor:
        compressor, encoder = job.compressor, self.encoder
        while True:
            arrived = self.received(job)
            if job.flight == compressor.rounds:
                start, stop = job.span
                average = encoder.average and self.comm.size > 1  # a mean over one rank divides by 1
                job.count("decode", compressor.passes.aggregated(len(arrived), average), stop - start)
                return encoder.decode_into(job, out, compressor.aggregate, arrived, job.ctx, self.comm.size, average)
            with self.clock(ENCODE, job.group.name):
                job.payload, job.ctx = compressor.next_round(arrived[0], job.ctx)
                job.count("encode", compressor.passes.next_round)
                job.flight += 1
                self.send(job, last=job.flight == compressor.rounds)

    @abc.abstractmethod
    def send(self, job: "Job", last: bool) -> None:
        """Start the collective of the job's payload on ``job.comm``, and feed the memory once
        the ``last`` round's payload is safe from the collective (:meth:`Encoder.feed`)."""

    @abc.abstractmethod
    def received(self, job: "Job") -> List[Payload]:
        """Wait for the round's collective: what arrived, one summed payload or one per rank."""
