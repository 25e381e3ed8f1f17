"""One merged group in flight: what the exchange and the group's scheme share about it.

The exchange (:mod:`mergecomp.exchange.exchange`) makes a :class:`Job` when a group starts,
checks and compensates it, and hands it to the group's scheme (:mod:`mergecomp.exchange.schemes`), which
encodes it through the exchange's :class:`~mergecomp.exchange.encoder.Encoder`, starts its
collectives, runs its later stages and decodes the result.  A scheme that moves part of the
group elsewhere (the hierarchical scheme across hosts) gives that part a job of its own
(:meth:`Job.within`); a job's fields keep their meaning from start to finish.  How the group
travels is its :class:`Route`, resolved once per codec by the exchange.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.engines.communicator import Communicator, Handle
from mergecomp.exchange.breakdown import STAGES
from mergecomp.exchange.plan import UNFED, Group

__all__ = ["Route", "Job"]


@dataclass(frozen=True)
class Route:
    """How a group travels (:meth:`~mergecomp.exchange.exchange.Exchange.route`).

    ``name``: the codec it is sent with: a plan codec (``"compressed"``, ``"fp16"``,
    ``"none"``), a sharded scheme's name (moved by that scheme where it applies, else by its
    fallback's route, or where it has none by allreduce or allgather), or a route outside
    error feedback (:data:`~mergecomp.exchange.plan.UNFED`); ``compressor``
    encodes it; ``scheme`` (a :class:`~mergecomp.exchange.schemes.base.Scheme`) moves it."""

    name: str
    compressor: Compressor
    scheme: Any

    @property
    def feedback(self) -> bool:
        """The error-feedback memory and the compressor state take part (every route but those
        of :data:`~mergecomp.exchange.plan.UNFED`)."""
        return self.name not in UNFED

    @property
    def sums_losslessly(self) -> bool:
        """The group travels as the plain sum of the ranks' gradients (a lossless codec by
        allreduce): any rank's NaN/Inf reaches every rank's result, and no state keeps it."""
        return self.compressor.lossless and self.scheme.sums


class Job:
    """A group whose exchange has started.

    ``compensated`` is the flat group: the gradient, error-compensated once the memory has
    taken part (as given after a fused encode); schemes may write it.  ``comm`` and ``span``
    say where the scheme compresses it: the exchange's communicator and every element, or,
    for a job made by :meth:`within`, a communicator of part of the ranks and the elements
    ``[start, stop)`` of the group.
    """

    def __init__(self, group: Group, route: Route, compensated: torch.Tensor, comm: Communicator,
                 step: int) -> None:
        self.group = group
        #: how it travels
        self.route = route
        #: what encodes it (the route's compressor) and what moves it (its scheme)
        self.compressor, self.scheme = route.compressor, route.scheme
        self.compensated = compensated
        self.comm = comm
        self.span: Tuple[int, int] = (0, group.numel)
        #: the step and this process's rank among all ranks, for errors
        self.step, self.rank = step, comm.rank
        #: 0-d bool: the gradient held no NaN/Inf (a non-finite one was zeroed)
        self.finite: Optional[torch.Tensor] = None
        #: 0-d bool: the payload of the finite, error-compensated gradient overflowed (its
        #: cast to fp16, e.g.); None: not checked (:attr:`Compressor.may_overflow`)
        self.overflowed: Optional[torch.Tensor] = None
        #: whether every rank's gradient was finite, where the scheme carries the ranks' flags
        #: with their payloads (a reduce-scatter's, known at its finish); None: not known
        self.all_finite: Optional[bool] = None
        #: the gradient's NaN/Inf check is left to the encode (a cast that checks its payload
        #: in its own pass, with no error feedback to keep NaN out of)
        self.checked_by_encode = False
        #: the error-feedback memory takes part (:attr:`Route.feedback`)
        self.feedback = route.feedback
        #: what the encoder made: this rank's payload and its ctx
        self.payload: Payload = ()
        self.ctx: Any = None
        #: the payload was made by a fused encode, whose memory update runs in place of a feed
        self.encoded = False
        #: ``compensated`` is the decode's output, not read after the encode (and the decode
        #: lent it by the workspace); ``zeroed``: the fused encode left it all zeros
        self.scratch = False
        self.zeroed = False
        self.update: Optional[Callable[[], None]] = None
        #: the payload's tensors are the encoder's own, written by nothing until the next step
        #: (:class:`~mergecomp.compressors.base.compressor.FusedParts`): a one-tensor payload
        #: goes on the wire without a copy
        self.owned = False
        #: the collective in flight
        self.handle: Optional[Handle] = None
        #: what the scheme runs between its first collective and its last, in order
        #: (:meth:`~mergecomp.exchange.schemes.base.Scheme.advance`)
        self.stages: List[Callable[[], None]] = []
        #: the scheme's own record of the group in flight
        self.flight: Any = None
        #: passes over the group's elements so far, by stage (:mod:`mergecomp.exchange.breakdown`)
        self.passes: Dict[str, float] = {}

    def within(self, scheme: Any, comm: Communicator, span: Tuple[int, int]) -> "Job":
        """A job for the elements ``span`` of this group, moved by ``scheme`` among ``comm``'s
        ranks: the same group, route, compressor, ``compensated`` tensor and checks, its passes
        counted with this job's."""
        part = Job(self.group, dataclasses.replace(self.route, scheme=scheme), self.compensated, comm, self.step)
        part.span, part.rank, part.finite = span, self.rank, self.finite
        part.passes = self.passes
        return part

    def count(self, stage: str, passes: float, numel: Optional[int] = None) -> None:
        """Tally ``passes`` over ``numel`` of the group's elements (default: all of them) in
        ``stage`` (one of :data:`~mergecomp.exchange.breakdown.STAGES`), as passes over the whole group."""
        total = self.group.numel
        if total and passes and numel != 0:
            self.passes[stage] = self.passes.get(stage, 0.0) + passes * (total if numel is None else numel) / total

    def what(self, phase: str) -> str:
        """``phase`` of this group, for errors: which group, its size, the step and the rank."""
        group = self.group
        return (f"{phase} of group {group.name!r} ({len(group.indices)} tensors, {group.numel} elements) at step "
                f"{self.step} on rank {self.rank}")

    def describe(self) -> Dict[str, Any]:
        """The group as a step breakdown lists it (:meth:`~mergecomp.exchange.breakdown.Breakdown.end_step`)."""
        return {"name": self.group.name, "codec": self.route.name,
                "bytes": self.group.numel * self.compensated.element_size(),
                "passes_by_stage": {stage: self.passes[stage] for stage in STAGES if stage in self.passes}}
