"""Merged, compressed averaging of a fixed list of gradients: the TF front end's torch side.

:class:`GradientReducer` adapts TensorFlow's gradients (DLPack views, one torch tensor per
variable) to a :class:`mergecomp.step.MergedStep`, which copies them into its groups,
compresses and communicates each group and returns per-variable views of the results.  Nothing
here imports TensorFlow.  The TF front end calls :meth:`GradientReducer.reduce` once per step,
after the whole backward pass (TF has no per-gradient hook), so groups overlap one another's
encoding and communication but not the backward pass.

Every rank must pass the same variables (names, shapes, dtypes) in the same order.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from mergecomp.comm import Communicator
from mergecomp.exchange import Exchange, resolve
from mergecomp.plan import Group, GroupPlan
from mergecomp.scheduler import MergeScheduler, SchedulerConfig
from mergecomp.step import MergedStep

__all__ = ["GradientReducer"]

_OPS = ("average", "sum")
_NONFINITE = ("raise", "ignore")


class GradientReducer:
    """Average (or sum) gradients over ranks, merged into groups and compressed.

    Args:
        compression: compressor name or :class:`mergecomp.Compressor` (default ``"none"``:
            lossless).
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        groups: ``"auto"`` (the online :class:`~mergecomp.scheduler.MergeScheduler`),
            ``"layerwise"``, an int ``k``, a list of lists of variable names, a
            :class:`~mergecomp.plan.GroupPlan`, or ``None`` (about 25 MB per group, at most 4).
        op: ``"average"`` or ``"sum"`` over ranks.
        nonfinite: ``"raise"`` (FloatingPointError on every rank naming the rank and the
            variables) or ``"ignore"``.
        scheduler: :class:`~mergecomp.scheduler.SchedulerConfig` for ``groups="auto"``.
        comm: the communicator (default: the one :func:`mergecomp.runtime.init` set up).
    """

    def __init__(self, compression="none", memory=None, groups="auto", op: str = "average",
                 nonfinite: str = "raise", scheduler: Optional[SchedulerConfig] = None,
                 comm: Optional[Communicator] = None) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be mct.Average or mct.Sum, got {op!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be 'raise' or 'ignore' in the TensorFlow front end, got {nonfinite!r}")
        if comm is None:
            from mergecomp.runtime import communicator

            comm = communicator()
        self.comm = comm
        self.compressor, self.memory = resolve(compression, memory)
        self._settings = dict(groups=groups, average=op == "average", nonfinite=nonfinite, scheduler=scheduler)
        self.merged: Optional[MergedStep] = None

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

    def _bound(self) -> MergedStep:
        if self.merged is None:
            raise RuntimeError("the GradientReducer has no variables yet: call bind() or reduce() first")
        return self.merged

    def bind(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> None:
        """Fix the variables (once).  Order for merging: reversed, like the backward pass."""
        if self.bound:
            self._check_same(names, shapes, dtypes)
            return
        self.merged = MergedStep(self.compressor, self.memory, self.comm, names, shapes, dtypes,
                                 torch.device("cpu"), observe_order=False, timed=False, hand_out=True,
                                 who="GradientReducer", tensor_kind="variables", cache_tag=["tf"],
                                 **self._settings)

    def _check_same(self, names, shapes, dtypes) -> None:
        merged = self.merged
        mine = list(zip(merged.names, merged.shapes, merged.dtypes))
        theirs = list(zip(names, (torch.Size(s) for s in shapes), dtypes))
        if mine != theirs:
            differ = [f"{a[0]}{tuple(a[1])}:{a[2]} vs {b[0]}{tuple(b[1])}:{b[2]}"
                      for a, b in zip(mine, theirs) if a != b][:4]
            raise ValueError(f"this GradientReducer exchanges {len(mine)} gradients and cannot take a different "
                             f"list ({len(theirs)} given; first differences: {differ}); use one reducer per "
                             f"model")

    def set_plan(self, plan: GroupPlan) -> None:
        """Switch plans between steps; per-element state moves to the new groups."""
        self._bound().set_plan(plan)

    # -- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Reduce one step's gradients (one tensor per bound variable, any layout, read only).

        Returns one tensor per variable with its shape and dtype: views of each group's result,
        which is never written again, so the caller may keep them.
        """
        merged = self._bound()
        if len(grads) != len(merged.names):
            raise ValueError(f"expected {len(merged.names)} gradients, got {len(grads)}")
        # Groups start in plan order as they fill: the first overlaps the copies of the next.
        for i in merged.plan.order:
            merged.add(i, grads[i])
        return merged.finish().tensors(len(grads))

    def schedule_report(self) -> Dict[str, Any]:
        return self._bound().schedule_report()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's plan, step, compressor state, error-feedback memory, scheduler choice."""
        return self._bound().state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the reducer must be bound (after the first step, or
        after :meth:`bind`)."""
        if not self.bound:
            raise RuntimeError("load_state_dict() needs the variables: call it after bind() or the first step")
        self.merged.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GradientReducer(compressor={self.compressor!r}, memory={self.memory!r}, merged={self.merged!r})"
