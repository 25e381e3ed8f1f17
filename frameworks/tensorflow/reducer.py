"""Merged, compressed averaging of a fixed list of gradients: the TF front end's torch side.

:class:`GradientReducer` adapts TensorFlow's gradients (DLPack views, one torch tensor per
variable) to a :class:`mergecomp.pipeline.planned.PlannedStep`, which copies them into its groups,
compresses and communicates each group and returns per-variable views of the results.  Nothing
here imports TensorFlow.  The TF front end calls :meth:`GradientReducer.reduce` once per step,
after the whole backward pass (TF has no per-gradient hook), so groups overlap one another's
encoding and communication but not the backward pass.

Every rank must pass the same variables (names, shapes, dtypes) in the same order.  Variables
marked local (Horovod's ``register_local_var``, ``PartialDistributedGradientTape``) keep their
own rank's gradient; with ``backward_passes_per_step`` N > 1 the gradients are summed locally
over N calls and exchanged on the N-th.

Under Horovod's elastic API (:mod:`mergecomp.tensorflow.elastic`) every reducer of the process
(:func:`live`) is built again on the new world after a reset (:meth:`GradientReducer.rebuild`),
and after each sync (:func:`rejoin_at_next_exchange`) every one rejoins at its next exchange,
which every rank reaches at the same point, whether it stayed or just joined.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch

from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.exchange import Exchange, resolve
from mergecomp.exchange.plan import Group, GroupPlan
from mergecomp.horovod_api.arguments import Average, check_horovod_args, scaling
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.planned import PlannedStep
from mergecomp.scheduler.online import MergeScheduler

__all__ = ["GradientReducer", "live", "rejoin_at_next_exchange"]

#: every GradientReducer of this process
_LIVE: "weakref.WeakSet[GradientReducer]" = weakref.WeakSet()
#: elastic syncs of this process so far; a reducer that has not rejoined after the last one does
#: at its next exchange
_syncs = 0


def live() -> List["GradientReducer"]:
    """Every :class:`GradientReducer` of this process (the optimizers' and the tapes')."""
    return list(_LIVE)


def rejoin_at_next_exchange() -> None:
    """An elastic sync happened (every rank of the new world calls it at the same point): every
    reducer, alive now or made later, rejoins the others at its next exchange
    (:meth:`~mergecomp.pipeline.step.MergedStep.rejoin`: rank 0's plan and replicated state,
    this rank's own memory where it stayed, none where it joined)."""
    global _syncs
    _syncs += 1


class GradientReducer:
    """Average (or sum) gradients over ranks, merged into groups and compressed.

    Args:
        compression: compressor name or :class:`mergecomp.Compressor` (default ``"none"``:
            lossless).
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        groups: ``"auto"`` (the online :class:`~mergecomp.scheduler.online.MergeScheduler`),
            ``"layerwise"``, an int ``k``, a list of lists of variable names, a
            :class:`~mergecomp.exchange.plan.GroupPlan`, or ``None`` (about 25 MB per group, at most 4).
        op: ``"average"`` or ``"sum"`` over ranks.
        comm: the communicator (default: the one :func:`mergecomp.horovod_api.runtime.init` set up).
        gradient_predivide_factor: with ``op="average"``, each rank's gradient is divided by
            this factor before the sum and the sum multiplied by ``factor / size`` (Horovod's).
        backward_passes_per_step: exchange once every this many :meth:`reduce` calls, the sum
            of their gradients (:meth:`reduce` returns None in between).
        average_aggregated_gradients: divide that sum by ``backward_passes_per_step``.
        scale_local_gradients: divide local variables' gradients by the number of ranks (as
            the exchanged ones are averaged).
        options: mergecomp's options by keyword (:class:`~mergecomp.pipeline.options.StepOptions`):
            ``nonfinite`` (default ``"propagate"``: every rank's gradients come back NaN and the
            error-feedback memory is put back, so a ``LossScaleOptimizer`` skips the step on
            every rank; ``"raise"``: FloatingPointError on every rank naming the rank and the
            variables; ``"ignore"``), ``scheduler``, ``compression_warmup_steps``,
            ``compression_warmup_codec``, ``uncompressed`` (Keras: names are variables' ``path``, e.g. ``"dense/bias"``),
            ``min_compress_numel``, ``scheme``.
    """

    def __init__(self, compression="none", memory=None, groups="auto", op: str = Average,
                 comm: Optional[Communicator] = None, *, gradient_predivide_factor: float = 1.0,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 scale_local_gradients: bool = True, **options) -> None:
        factor = check_horovod_args(op, gradient_predivide_factor)
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
        self.compressor, self.memory = resolve(compression, memory)
        self._settings = (options, groups, op, factor)  # what rebuild() applies to another world
        self._on(comm)
        self.passes = backward_passes_per_step
        self._average_passes = average_aggregated_gradients
        self._scale_local = scale_local_gradients
        self.warn_sparse = True  # a tf.IndexedSlices gradient warns that it is exchanged densely
        self.merged: Optional[PlannedStep] = None
        self._local: List[bool] = []  # per bound variable: keeps its own rank's gradient
        self._sums: Optional[List[torch.Tensor]] = None  # gradients summed over passes so far
        self._count = 0
        self._rejoined = 0  # the elastic syncs of this process when it last rejoined
        self._carried: Optional[tuple] = None  # (state,) to carry into the step built at the next exchange
        _LIVE.add(self)

    def _on(self, comm: Optional[Communicator]) -> None:
        """The communicator (default: the runtime's) and the options its number of ranks scales."""
        if comm is None:
            from mergecomp.horovod_api.runtime import communicator

            comm = communicator()
        options, groups, op, factor = self._settings
        self.comm = comm
        self.options = StepOptions.create("GradientReducer", options,
                                          fixed={"groups": groups, **scaling(op, factor, comm.size)})
        self.options.check(self.compressor)

    # -- setup ------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self.merged is not None

    @property
    def exchange(self) -> Exchange:
        return self._bound().exchange

    @property
    def plan(self) -> GroupPlan:
        return self._bound().plan

    @property
    def groups(self) -> List[Group]:
        return self._bound().groups

    @property
    def scheduler(self) -> Optional[MergeScheduler]:
        return self._bound().scheduler

    def _bound(self) -> PlannedStep:
        if self.merged is None:
            raise RuntimeError("the GradientReducer has no variables yet: call bind() or reduce() first")
        return self.merged

    def bind(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
             local: Optional[Sequence[bool]] = None) -> None:
        """Fix the variables (once): ``local[i]`` marks a variable whose gradient is not
        exchanged.  Order for merging: reversed, like the backward pass."""
        local = [False] * len(names) if local is None else [bool(x) for x in local]
        if self.bound:
            self._check_same(names, shapes, dtypes, local)
            return
        exchanged = [i for i, is_local in enumerate(local) if not is_local]
        if not exchanged:
            raise ValueError("every variable is local: there is no gradient to exchange")
        self._bound_as = (list(names), [torch.Size(s) for s in shapes], list(dtypes), local)
        self._local, self._exchanged = local, exchanged
        self._build()

    def _build(self) -> None:
        names, shapes, dtypes, _ = self._bound_as
        exchanged = self._exchanged
        self.merged = PlannedStep(self.compressor, self.memory, self.comm, [names[i] for i in exchanged],
                                  [shapes[i] for i in exchanged], [dtypes[i] for i in exchanged],
                                  torch.device("cpu"), self.options,
                                  FrontEnd("GradientReducer", "variables", observe_order=False, timed=False,
                                           hand_out=True, cache_tag=("tf",)))

    def rebuild(self, state: Optional[Dict[str, Any]] = None) -> None:
        """Exchange on the runtime's world as it is now, after ``init()`` joined a world of
        other ranks (an elastic reset), with the same settings (the average over the new number
        of ranks); the gradients summed towards an exchange are dropped.  The merged step is
        built again at the next exchange, where a worker that joined builds its own (the
        construction's collectives meet), carrying ``state`` over as this rank's own: this
        reducer's :meth:`state_dict` from before the reset, its last commit (None: afresh);
        after a sync it then rejoins the others (:func:`rejoin_at_next_exchange`)."""
        self._on(None)
        self._sums, self._count = None, 0
        if self.bound:  # built at the next exchange
            self._carried = (state,)

    def _check_same(self, names, shapes, dtypes, local) -> None:
        mine = list(zip(*self._bound_as))
        theirs = list(zip(names, (torch.Size(s) for s in shapes), dtypes, local))
        if mine != theirs:
            differ = [f"{a[0]}{tuple(a[1])}:{a[2]}{' (local)' * a[3]} vs {b[0]}{tuple(b[1])}:{b[2]}"
                      f"{' (local)' * b[3]}"
                      for a, b in zip(mine, theirs) if a != b][:4]
            raise ValueError(f"this GradientReducer exchanges {len(mine)} gradients and cannot take a different "
                             f"list ({len(theirs)} given; first differences: {differ}); use one reducer per "
                             f"model")

    def set_plan(self, plan: GroupPlan) -> None:
        """Switch plans between steps; per-element state moves to the new groups."""
        self._bound().set_plan(plan)

    # -- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, grads: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Reduce one step's gradients (one tensor per bound variable, any layout, read only).

        Returns one tensor per variable with its shape and dtype (exchanged ones: views of each
        group's result, which is never written again, so the caller may keep them), or None on
        a call that only adds to the local sums (``backward_passes_per_step`` > 1).
        """
        merged = self._bound()
        if len(grads) != len(self._local):
            raise ValueError(f"expected {len(self._local)} gradients, got {len(grads)}")
        if self._carried is not None:  # the first exchange since an elastic reset
            (state,), self._carried = self._carried, None
            self._build()
            merged = self.merged
            if state is not None:
                merged.carry_over(state)
        if self._rejoined != _syncs:  # the first exchange since an elastic sync, on every rank
            merged.rejoin(0)
            self._rejoined = _syncs
        if self.passes > 1:
            grads = self._accumulate(grads)
            if grads is None:
                return None
        # Groups start in plan order as they fill: the first overlaps the copies of the next.
        for j in merged.plan.order:
            merged.add(j, grads[self._exchanged[j]])
        out = list(grads)
        for i, reduced in zip(self._exchanged, merged.finish().tensors(len(self._exchanged))):
            out[i] = reduced
        scale_local = 1.0 / self.comm.size if self._scale_local else 1.0
        per_pass = 1.0 / self.passes if self._average_passes else 1.0
        for i, is_local in enumerate(self._local):
            factor = per_pass * (scale_local if is_local else 1.0)
            if factor != 1.0:
                out[i] = out[i] * factor
        return out

    def _accumulate(self, grads: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Add ``grads`` to the local sums; the sums on every ``passes``-th call, else None."""
        if self._sums is None:
            self._sums = [g.clone(memory_format=torch.contiguous_format) for g in grads]
        else:
            for total, g in zip(self._sums, grads):
                total.add_(g)
        self._count += 1
        if self._count < self.passes:
            return None
        sums, self._sums, self._count = self._sums, None, 0
        return sums

    def schedule_report(self) -> Dict[str, Any]:
        return self._bound().schedule_report()

    def step_breakdown(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Where the last ``steps`` exchanges' time went (:meth:`~mergecomp.pipeline.step.MergedStep.step_breakdown`;
        the update is not timed: it counts as compute)."""
        return self._bound().step_breakdown(steps)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Optional[Dict[str, Any]]:
        """This rank's plan, step, compressor state, error-feedback memory, scheduler choice.
        Between an elastic reset and the next exchange: the state carried over (:meth:`rebuild`;
        None where it starts afresh)."""
        if self._carried is not None:
            return copy.deepcopy(self._carried[0])
        return self._bound().state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the reducer must be bound (after the first step, or
        after :meth:`bind`)."""
        if not self.bound:
            raise RuntimeError("load_state_dict() needs the variables: call it after bind() or the first step")
        self.merged.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GradientReducer(compressor={self.compressor!r}, memory={self.memory!r}, merged={self.merged!r})"
