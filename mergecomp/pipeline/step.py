"""One training step of merged groups, for a list of named tensors: what every front end's step
shares, whoever cuts the groups.

A :class:`MergedStep` owns, for tensors ``0..n-1`` (names, shapes, dtypes):

* the step's lifecycle: :meth:`~MergedStep.launch` hands a group to the exchange (the
  compression warm-up and the ``scheme`` option decide its codec); :meth:`~MergedStep.finish`
  agrees across ranks on non-finite groups, waits for and decodes every group, applies the
  non-finite policy (``"propagate"``, ``"raise"``, ``"skip"`` or ``"ignore"``) and returns the
  reduced groups;
* the current layout of groups, and moving error-feedback and compressor state onto new groups
  (:func:`~mergecomp.exchange.plan.remap_state`); the tensors exempt from compression;
* checkpoints (:meth:`~MergedStep.state_dict`) and where each step's time went
  (:meth:`~MergedStep.step_breakdown`, :mod:`mergecomp.exchange.breakdown`).

Where the groups come from is a subclass's: a merge plan, filled as gradients arrive
(:class:`~mergecomp.pipeline.planned.PlannedStep`: the PyTorch optimizer, TensorFlow), or the
caller's buckets (:class:`~mergecomp.pipeline.buckets.BucketStep`: the DDP hook).  The step
counter is the exchange's (:meth:`~mergecomp.exchange.exchange.Exchange.end_step`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from mergecomp.compressors.base.capabilities import FusedParts
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.breakdown import DECODE, ENCODE, WAIT, Breakdown
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.job import Job, Route
from mergecomp.exchange.plan import COMPRESSED, EXEMPT, Group, GroupPlan, remap_state
from mergecomp.exchange.schemes import SHARDED
from mergecomp.pipeline.agreement import check_ranks_agree
from mergecomp.pipeline.nonfinite import OVERFLOWED, NonfiniteCheck
from mergecomp.pipeline.resharding import EVERY_RANK, differing_fields, fold, rejoined
from mergecomp.pipeline.options import WARMUP_CODECS, FrontEnd, StepOptions

__all__ = ["MergedStep", "Reduced", "HoldsMergedStep"]

logger = logging.getLogger("mergecomp")


@dataclass
class Reduced:
    """One step's result: ``flats[g]`` is group ``groups[g]``'s reduced flat gradient."""

    groups: List[Group]
    flats: List[torch.Tensor]
    #: what :meth:`tensors` returns, where the step made it (each tensor's slot in its group's
    #: buffer, the same objects step after step, or the gradient it was sent from)
    views: Optional[List[torch.Tensor]] = None
    #: the tensors whose result is not where their gradient was given (the front end points
    #: them at it); None: any of them may be
    moved: Optional[List[int]] = None
    #: the ranks found NaN/Inf in this step's groups (``nonfinite="propagate"``: every result is NaN)
    nonfinite: bool = False

    def tensors(self, count: int) -> List[torch.Tensor]:
        """Views of the ``count`` tensors' reduced gradients, by tensor index, in their shapes."""
        if self.views is None or len(self.views) != count:
            self.views = [None] * count
            for group, flat in zip(self.groups, self.flats):
                for i, offset, n, shape in zip(group.indices, group.offsets, group.numels(), group.shapes):
                    self.views[i] = flat[offset:offset + n].view(shape)
        return list(self.views)


class HoldsMergedStep:
    """What every front end that holds a :class:`MergedStep` as ``self.merged`` shows of it."""

    merged: "MergedStep"
    exchange = property(lambda self: self.merged.exchange, doc="the :class:`~mergecomp.exchange.exchange.Exchange`")
    compressor = property(lambda self: self.merged.exchange.compressor, doc="the configured compressor")
    memory = property(lambda self: self.merged.exchange.memory, doc="the error-feedback memory")
    plan = property(lambda self: self.merged.plan, doc="the current :class:`~mergecomp.exchange.plan.GroupPlan`")
    groups = property(lambda self: self.merged.groups, doc="the current groups, with their tensors' offsets")
    scheduler = property(lambda self: self.merged.scheduler, doc="the online scheduler (``groups='auto'``)")
    skipped_steps = property(lambda self: self.merged.skipped_steps, doc="steps skipped for NaN/Inf")
    breakdown_window = property(lambda self: self.merged.timings.window,
                                lambda self, steps: setattr(self.merged.timings, "window", steps),
                                doc="how many steps :meth:`step_breakdown` keeps (settable; default 20)")

    def step_breakdown(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Where the last ``steps`` steps' time went, averaged (default: the steps kept, see
        :attr:`breakdown_window`): :meth:`MergedStep.step_breakdown`."""
        return self.merged.step_breakdown(steps)


class MergedStep:
    """Merged, compressed reduction of one step's gradients of named tensors.

    Args:
        compression: compressor name (``mergecomp.compressor_names()``) or instance.
        memory: error-feedback memory name or instance; None: the compressor's default.
        comm: the engine.
        names: one unique name per tensor (plan specs and errors use them).
        shapes, dtypes: of each tensor's gradient.
        device: where the gradients live.
        options: :class:`~mergecomp.pipeline.options.StepOptions`.
        front_end: :class:`~mergecomp.pipeline.options.FrontEnd`.
    """

    #: what the step's groups are, for the ranks' agreement (subclasses)
    groups_agreed: str = ""
    #: the online scheduler, where a subclass runs one
    scheduler = None
    #: ``before_start(g, group, flat, missing)``, set by a front end between steps: called as
    #: group ``g`` of the step is about to start, every gradient in its ``flat`` buffer (zeros for
    #: its tensors ``missing`` a gradient), to transform them in place (the momentum exchange's
    #: momentum); returns whether every value it wrote is finite where it knows (None: the group
    #: is checked as it starts)
    before_start: Optional[Callable[[int, Group, torch.Tensor, Sequence[int]], Optional[bool]]] = None

    def __init__(self, compression, memory, comm: Communicator, names: Sequence[str],
                 shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], device: torch.device,
                 options: Optional[StepOptions] = None, front_end: Optional[FrontEnd] = None) -> None:
        self.options = options = options or StepOptions()
        self.front_end = front_end = front_end or FrontEnd()
        duplicates = sorted({n for n in names if list(names).count(n) > 1})
        if duplicates:
            raise ValueError(f"{front_end.who}: tensor names must be unique, got duplicates {duplicates}")
        self.exchange = Exchange.create(compression, memory, comm, average=options.average,
                                        check_finite=options.nonfinite != "ignore", recycle=not front_end.hand_out,
                                        keep_state=options.nonfinite == "propagate")
        options.check(self.exchange.compressor)
        self.comm = comm
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.device = torch.device(device)
        self.skipped_steps = 0
        self._exemptions = options.exemptions
        self._exempt = self._exemptions.flags(self.names, [s.numel() for s in self.shapes])
        #: the last steps' timings (:meth:`step_breakdown`)
        self.timings = Breakdown()
        check_ranks_agree(self.exchange, {
            f"{front_end.tensor_kind} (names, shapes, dtypes)": [(n, tuple(s), str(d)) for n, s, d in
                                                                  zip(self.names, self.shapes, self.dtypes)],
            **options.described(), **({"groups": self.groups_agreed} if self.groups_agreed else {}),
            **dict(front_end.agree)}, front_end.who)
        self._plan, self._groups = GroupPlan(()), []
        #: set by a front end before a step's first tensor: this step sends every group as the
        #: compression warm-up does (outside error feedback, with ``compression_warmup_codec``);
        #: cleared when the step ends
        self.exact = False
        self._reset()

    # -- what it holds ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps finished so far (checkpointed)."""
        return self.exchange.step

    @property
    def plan(self) -> GroupPlan:
        return self._plan

    @property
    def groups(self) -> List[Group]:
        """The current groups with their tensors' offsets."""
        return list(self._groups)

    @property
    def nonfinite(self) -> str:
        return self.options.nonfinite

    @property
    def warmup_steps(self) -> int:
        return self.options.compression_warmup_steps

    def end_warmup(self) -> None:
        """End the compression warm-up now: the step about to start compresses (a front end
        whose warm-up length is decided as the run goes)."""
        self.options = replace(self.options, compression_warmup_steps=self.step)

    @property
    def in_flight(self) -> bool:
        """Whether a step has begun (a group started) and not finished."""
        return bool(self._started)

    @property
    def exempt(self) -> List[str]:
        """Names of the tensors sent uncompressed (``uncompressed``, ``min_compress_numel``)."""
        return [n for n, e in zip(self.names, self._exempt) if e]

    @property
    def compressing(self) -> bool:
        """Whether this step's groups are compressed: the compression warm-up is over and the
        step is not :attr:`exact`."""
        return self.step >= self.warmup_steps and not self.exact

    def tensor_names(self, group: Group) -> List[str]:
        return [self.names[i] for i in group.indices]

    # -- state that follows the tensors --------------------------------------------------------
    def _holders(self) -> tuple:
        """What holds per-group state that follows the tensors when groups change."""
        return tuple(self.exchange.holders().values())

    def _fold(self) -> None:
        """The schemes' state of the current groups becomes per-element carries."""
        self.exchange.fold(self._groups, [self.route(codec, compressing=True) for codec in self._plan.codec_names()])

    def _remap(self, new: Sequence[Group]) -> None:
        """Move the state of the current groups onto ``new``."""
        old = self._groups
        self._fold()
        for holder in self._holders():
            holder.load_state_dict(remap_state(holder.state_dict(), old, new))

    # -- one step ----------------------------------------------------------------------------
    def _reset(self) -> None:
        """A step begins: nothing started."""
        self._started: List[Job] = []
        self._outs: List[torch.Tensor] = []
        #: whether this step checks its gradients for NaN/Inf (decided as its first group starts)
        self._checking = self.nonfinite != "ignore"

    def _checks(self) -> bool:
        """Whether this step's gradients are checked for NaN/Inf and the ranks agree on the
        culprits: under every policy but ``"ignore"``, except ``"propagate"`` when every group
        this step can send travels as the plain sum of the ranks' gradients
        (:attr:`~mergecomp.exchange.job.Route.sums_losslessly`; not so where
        :attr:`before_start` transforms them): any rank's NaN/Inf then reaches every rank's
        result of its group by itself, and no state needs putting back."""
        if self.nonfinite != "propagate":
            return self.nonfinite != "ignore"
        if self.before_start is not None:  # the front end must know (Reduced.nonfinite)
            return True
        return not all(self.route(codec).sums_losslessly for codec in (*self._plan.codec_names(), COMPRESSED))

    def launch(self, group: Group, flat: torch.Tensor, codec: str, finite: Optional[bool] = None,
               copied: int = 0, parts: Optional[FusedParts] = None) -> Job:
        """Start ``group`` from ``flat``, into which ``copied`` elements were written (pass by
        pass) this step, or from its ``parts`` (:meth:`Exchange.start`); ``codec``: the plan's
        (the warm-up and the ``scheme`` option decide how it travels)."""
        if not self._started:
            self._checking = self._checks()
        job = self.exchange.start(group, flat, self.route(codec), finite, parts, self._checking,
                                  scratch=not self.front_end.hand_out)
        job.count("copy-in", 1, copied)
        self._started.append(job)
        self._outs.append(flat)
        return job

    def route(self, codec: str, compressing: Optional[bool] = None) -> Route:
        """How a group of the plan's ``codec`` travels this step (:meth:`Exchange.route`), or
        on a step that is (not) ``compressing``: outside compression an exempt group's stays
        ``"exempt"``, the others take the warm-up's; while compressing ``"compressed"``
        travels by the ``scheme`` option's sharded scheme where it names one."""
        if not (self.compressing if compressing is None else compressing):
            codec = EXEMPT if codec == EXEMPT else WARMUP_CODECS[self.options.compression_warmup_codec]
        elif codec == COMPRESSED and self.options.scheme in SHARDED:
            codec = self.options.scheme
        return self.exchange.route(codec)

    def finish(self) -> Optional[Reduced]:
        """Finish the step: start what is left, wait, decode, average; then count the step.
        Returns the reduced gradients, or None for a step skipped under ``nonfinite="skip"``;
        raises FloatingPointError under ``"raise"``.  A step that does not raise joins
        :meth:`step_breakdown`."""
        clock = self.exchange.clock
        jobs = self._started  # this step's groups: _finish starts the rest into this list
        try:
            with clock(DECODE):
                reduced = self._finish()
        except BaseException:
            clock.take()
            self.timings.forget()
            raise
        self.timings.end_step(clock.take(), [job.describe() for job in jobs])
        return reduced

    def _finish(self) -> Optional[Reduced]:
        """:meth:`finish`, its parts on the exchange's clock."""
        clock = self.exchange.clock
        with clock(ENCODE):
            self._start_rest()
        jobs, outs = self._started, self._outs
        groups = [job.group for job in jobs]
        check = NonfiniteCheck(self.comm, jobs, self.step) if self._checking else None
        hand_out = self.front_end.hand_out
        pending = jobs  # the groups' later collectives, stage by stage, in plan order
        while pending:
            pending = [job for job in pending if self.exchange.advance(job)]
        flats = [self.exchange.finish(job, out=None if hand_out else out) for job, out in zip(jobs, outs)]
        bad = []
        if check:
            with clock(WAIT):
                bad = check.culprits([group.name for group in groups])
        if bad and self.nonfinite == "propagate":  # every rank's result is NaN: GradScaler skips the step
            for flat in flats:
                flat.fill_(float("nan"))
        reduced = self._decoded(jobs, flats)
        step = self.exchange.end_step()
        if self.step == self.warmup_steps > 0:
            logger.info("%s: compression warm-up over after %d steps; %r compresses from now on",
                        self.front_end.who, self.step, self.exchange.compressor)
        self._end_step(bool(bad))
        self.exact = False
        if bad:
            fed = {job.group.name for job in jobs if job.feedback}
            return self._nonfinite(bad, reduced, step, fed)
        self.exchange.commit()
        if self.options.postscale != 1.0:
            for flat in flats:
                flat.mul_(self.options.postscale)
        return self._reduced(reduced)

    # the subclass's part of a step
    def _start_rest(self) -> None:
        """At :meth:`finish`: start the groups not started yet."""

    def _decoded(self, jobs: List[Job], flats: List[torch.Tensor]) -> Reduced:
        """Every started group's result is in ``flats`` (NaN where the step propagates NaN/Inf):
        the step's result."""
        return Reduced([job.group for job in jobs], flats)

    def _end_step(self, bad: bool) -> None:
        """The step is counted (``bad``: it held NaN/Inf): what was started is done with."""
        self._reset()

    def _reduced(self, reduced: Reduced) -> Reduced:
        """This step's result, of a step without NaN/Inf, once the step is counted."""
        return reduced

    def abort(self) -> None:
        """Forget a step that cannot finish (an interrupted backward pass): its collectives are
        out of step with the other ranks', so the caller must fail the step on every rank."""
        self.exchange.rollback()
        self.exchange.clock.take()
        self.timings.forget()
        self._reset()

    def _nonfinite(self, bad: List[Tuple[int, str, int]], reduced: Reduced, step: int,
                   fed: Set[str]) -> Optional[Reduced]:
        """Apply the policy to a step in which ``bad`` (rank, group name, why: the bits of
        :class:`~mergecomp.pipeline.nonfinite.NonfiniteCheck`) held NaN/Inf.  A group whose
        error-compensated payload overflowed here (its name in ``fed``: its route fed the memory
        this step) starts its error feedback afresh, under every policy; one that overflowed on
        a route outside error feedback (the fp16 warm-up) keeps its memory."""
        who, policy = self.front_end.who, self.nonfinite
        if policy == "propagate":
            self.exchange.rollback()
        self.exchange.forget([name for rank, name, why in bad
                              if rank == self.comm.rank and why & OVERFLOWED and name in fed])

        def overflow(name: str) -> str:
            return ": its values, finite, overflowed the 16-bit cast for the wire" + (
                " (error feedback included), so its memory starts afresh" if name in fed else "")
        where = "; ".join(f"rank {rank}, group {name!r}" + (overflow(name) if why & OVERFLOWED else "")
                          for rank, name, why in bad)
        if policy == "propagate":  # its results are NaN (_finish): every rank's GradScaler skips it
            logger.info("%s: non-finite gradient at step %d (%s); every rank's result is NaN", who, step, where)
            reduced.nonfinite = True
            return reduced
        if policy == "raise":
            by_name = {group.name: group for group in reduced.groups}
            names = sorted({n for _, name, _ in bad for n in self.tensor_names(by_name[name])})
            raise FloatingPointError(f"{who}: non-finite gradient at step {step} ({where}); "
                                     f"{self.front_end.tensor_kind} in those groups: {names[:8]}"
                                     f"{' ...' if len(names) > 8 else ''}")
        self.skipped_steps += 1
        logger.warning("%s: skipping step %d: non-finite gradient (%s)", who, step, where)
        return None

    def step_breakdown(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Where this process's time went in the last ``steps`` steps, averaged (default: every
        step kept, ``timings.window``): the parts of a step and each group's seconds, bytes and
        passes over its elements (:mod:`mergecomp.exchange.breakdown`)."""
        return self.timings.summary(steps)

    @contextlib.contextmanager
    def time_update(self) -> Iterator[None]:
        """Time the optimizer update a front end runs after :meth:`finish`: it joins that
        step's breakdown as its ``optimizer`` part."""
        began = time.perf_counter()
        yield
        self.timings.end_update(began, time.perf_counter())

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's layout, tensor shapes, rank and world size, step, skipped steps, the
        exchange's per-group state (compressor, error-feedback memory, the schemes')."""
        return {"plan": self._plan.to_json(), "shapes": [list(s) for s in self.shapes],
                "rank": self.comm.rank, "world_size": self.comm.size, "skipped_steps": self.skipped_steps,
                **self.exchange.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` between steps (each rank its own), or every old rank's
        (:func:`~mergecomp.pipeline.resharding.to_fold`: :meth:`load_ranks`)."""
        who = self.front_end.who
        if self.in_flight:
            raise RuntimeError(f"{who}: load_state_dict() must be called between steps")
        if EVERY_RANK in state:
            return self.load_ranks(state[EVERY_RANK], state["residuals"])
        shapes = [torch.Size(s) for s in state["shapes"]]
        if self.names and shapes != self.shapes:
            raise ValueError(f"{who}: the checkpoint holds {len(shapes)} tensors of other shapes than "
                             f"the {len(self.shapes)} here; it was saved for another model")
        self._load_layout(GroupPlan.from_json(state["plan"]), shapes, state)
        self.skipped_steps = int(state["skipped_steps"])
        fresh = {key: {} for key in self.exchange.holders()}
        saved_size = state.get("world_size", self.comm.size)
        if saved_size != self.comm.size:  # per-rank residuals and measured timings do not carry over
            logger.warning("%s: the checkpoint was saved with %d ranks and runs on %d: error-feedback "
                           "residuals and compressor state start afresh, and the scheduler searches again",
                           who, saved_size, self.comm.size)
            state = {**state, **fresh, "scheduler": None}
        elif state.get("rank", self.comm.rank) != self.comm.rank:  # another rank's residuals
            logger.warning("%s: the checkpoint holds rank %d's error-feedback residuals and compressor state, "
                           "which start afresh here (save and load one checkpoint per rank to keep them)",
                           who, state["rank"])
            state = {**state, **fresh}
        self.exchange.load_state_dict(state)
        self.timings.forget()
        self._loaded(state)

    def load_ranks(self, states: Sequence[Dict[str, Any]], residuals: str = "fold") -> None:
        """Restore from every rank's :meth:`state_dict` of the job that saved them, between
        steps: this rank's own where the world has as many ranks, else the state
        :func:`~mergecomp.pipeline.resharding.fold` makes of them (``residuals``: ``"fold"``,
        each per-rank memory the mean of the old ranks'; ``"drop"``: fresh), logged."""
        if len(states) == self.comm.size:
            return self.load_state_dict(states[self.comm.rank])
        folded = fold(states, list(self.exchange.holders()), residuals)
        logger.warning("%s: the checkpoint was saved by %d ranks and runs on %d: per-rank error-feedback state %s, "
                       "and the scheduler searches again", self.front_end.who, len(states), self.comm.size,
                       "is the mean of the old ranks'" if residuals == "fold" else "starts afresh")
        self.load_state_dict(folded)

    def carry_over(self, own: Dict[str, Any]) -> None:
        """Load ``own``, this rank's :meth:`state_dict` from before the world changed (a Horovod
        elastic reset), into this step built on the new world, no collective: everything but
        the sharded schemes' memories, and the scheduler's timings where the world changed size
        (:func:`~mergecomp.pipeline.resharding.rejoined`).  :meth:`rejoin` then makes it agree."""
        root = {key: value for key, value in own.items() if key != "memory"}
        state = rejoined(own, root, None, list(self.exchange.holders()), self.comm.size)
        self.load_state_dict({**state, "rank": self.comm.rank, "world_size": self.comm.size})

    def rejoin(self, root: int = 0) -> None:
        """After the world changed (a Horovod elastic reset), on every rank of the new world:
        rank ``root``'s plan, step counters and replicated compressor state (PowerSGD's ``Q``);
        this rank's own error-feedback memory and per-rank compressor state where it continues
        the root's run (it stayed: :meth:`carry_over`), none where it does not (it joined); the
        scheduler searches again on a world of another size
        (:func:`~mergecomp.pipeline.resharding.rejoined`).  One broadcast of the root's state
        without its memory, and one allreduce of a flag per compressor field."""
        if self.in_flight:
            raise RuntimeError(f"{self.front_end.who}: ranks can only rejoin between steps")
        own = self.state_dict()
        shared = self.comm.broadcast_object(
            {key: value for key, value in own.items() if key != "memory"} if self.comm.rank == root else None, root)
        flags = differing_fields(own, shared)
        if flags:
            flags = self.comm.allreduce_async(torch.tensor(flags, dtype=torch.int32, device=self.comm.device)).wait(
                "the rejoin's per-rank compressor state").cpu().tolist()
        state = rejoined(own, shared, flags, list(self.exchange.holders()), self.comm.size)
        self.load_state_dict({**state, "rank": self.comm.rank, "world_size": self.comm.size})

    def _load_layout(self, plan: GroupPlan, shapes: List[torch.Size], state: Dict[str, Any]) -> None:
        """Take the checkpoint's layout ``plan`` (of tensors of ``shapes``)."""
        raise NotImplementedError

    def _loaded(self, state: Dict[str, Any]) -> None:
        """After :meth:`load_state_dict` loaded the exchange's state: what else ``state`` holds."""

    def agree_with(self, root: int) -> None:
        """Take rank ``root``'s layout, step counter, skipped steps and scheduler state on every
        rank (after a checkpoint was loaded on some ranks only; every rank calls it).
        Error-feedback memory and compressor state stay where every rank is at ``root``'s step
        and holds such state or none does; otherwise they start afresh on every rank (logged)."""
        if self.in_flight:
            raise RuntimeError(f"{self.front_end.who}: ranks can only agree between steps")
        holders = self.exchange.holders()
        has_state = any(holder.state for holder in holders.values())
        seen = self.comm.allgather(torch.tensor([self.step, int(has_state)], dtype=torch.int64,
                                                device=self.comm.device), "the resume agreement").cpu()
        shared = self.comm.broadcast_object(
            {k: v for k, v in self.state_dict().items() if k not in holders}, root)
        keep = bool((seen == seen[root]).all())
        if not keep and seen[:, 1].any():
            logger.warning("%s: ranks resumed from different steps or not all of them loaded a checkpoint "
                           "(steps %s): error-feedback residuals and compressor state start afresh on every "
                           "rank", self.front_end.who, seen[:, 0].tolist())
        self.load_state_dict({**shared, "rank": self.comm.rank,
                              **{key: holder.state_dict() if keep else {} for key, holder in holders.items()}})

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(compressor={self.exchange.compressor!r}, memory={self.exchange.memory!r}, "
                f"groups={len(self._groups)}, step={self.step})")
