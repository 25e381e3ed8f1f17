"""Merged, compressed averaging of a fixed list of gradients: the TF front end's torch side.

:class:`GradientReducer` takes one torch tensor per variable (DLPack views of TF's gradients),
copies them into one flat buffer per merged group, runs each group through
:class:`mergecomp.exchange.Exchange` and returns per-variable views of the reduced groups.
Nothing here imports TensorFlow.  The TF front end calls :meth:`GradientReducer.reduce` once
per step, after the whole backward pass (TF has no per-gradient hook), so groups overlap one
another's encoding and communication but not the backward pass.

Every rank must pass the same variables (names, shapes, dtypes) in the same order.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from mergecomp.agreement import check_ranks_agree
from mergecomp.exchange import NONFINITE_POLICIES, Exchange, NonfiniteCheck
from mergecomp.plan import Group, GroupPlan, build_plan, layout, remap_state
from mergecomp.scheduler import MergeScheduler, SchedulerConfig, exchange_scheduler

__all__ = ["GradientReducer"]

#: ``groups=None``: groups of about 25 MB, at most 4 (as in mergecomp.torch)
_DEFAULT_GROUP_BYTES = 25 * 2**20
_DEFAULT_MAX_GROUPS = 4
_OPS = ("average", "sum")


class GradientReducer:
    """Average (or sum) gradients over ranks, merged into groups and compressed.

    Args:
        compression: compressor name or :class:`mergecomp.Compressor`.
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        groups: ``"auto"`` (the online :class:`~mergecomp.scheduler.MergeScheduler`),
            ``"layerwise"``, an int ``k``, a list of lists of variable names, a
            :class:`~mergecomp.plan.GroupPlan`, or ``None`` (about 25 MB per group, at most 4).
        op: ``"average"`` or ``"sum"`` over ranks.
        nonfinite: ``"raise"`` (FloatingPointError on every rank naming the rank and the
            variables) or ``"ignore"``.
        scheduler: :class:`~mergecomp.scheduler.SchedulerConfig` for ``groups="auto"``.
        comm: the communicator (default: ``mergecomp.torch``'s, set up by ``init()``).
    """

    def __init__(self, compression="dgc", memory=None, groups="auto", op: str = "average",
                 nonfinite: str = "raise", scheduler: Optional[SchedulerConfig] = None, comm=None) -> None:
        if op not in _OPS:
            raise ValueError(f"op must be mct.Average or mct.Sum, got {op!r}")
        if nonfinite not in NONFINITE_POLICIES or nonfinite == "skip":
            raise ValueError(f"nonfinite must be 'raise' or 'ignore' in the TensorFlow front end, got {nonfinite!r}")
        if comm is None:
            from mergecomp.torch.runtime import communicator

            comm = communicator()
        self.comm = comm
        self.exchange = Exchange.create(compression, memory, comm, average=op == "average",
                                        check_finite=nonfinite != "ignore",
                                        recycle=False)  # results go to user code as tensors
        self.nonfinite = nonfinite
        self._auto = groups == "auto"
        self._spec = None if self._auto else groups
        self._scheduler_config = scheduler or SchedulerConfig()
        self.scheduler: Optional[MergeScheduler] = None
        self.names: List[str] = []
        self.shapes: List[torch.Size] = []
        self.dtypes: List[torch.dtype] = []
        self._plan: Optional[GroupPlan] = None
        self._groups: List[Group] = []
        self._last_end: Optional[float] = None

    # -- setup ------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self._plan is not None

    @property
    def plan(self) -> GroupPlan:
        return self._plan

    @property
    def groups(self) -> List[Group]:
        return list(self._groups)

    def bind(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> None:
        """Fix the variables (once).  Order for merging: reversed, like the backward pass."""
        if self.bound:
            self._check_same(names, shapes, dtypes)
            return
        if not names:
            raise ValueError("no variables to exchange gradients for")
        duplicates = sorted({n for n in names if list(names).count(n) > 1})
        if duplicates:
            raise ValueError(f"variable names must be unique, got duplicates {duplicates}")
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtypes = list(dtypes)
        check_ranks_agree(self.exchange, {
            "variables (names, shapes, dtypes)": [(n, tuple(s), str(d)) for n, s, d in zip(names, self.shapes, dtypes)],
            "groups": repr(self._spec if not self._auto else ("auto", self._scheduler_config)),
            "nonfinite": self.nonfinite}, "GradientReducer")
        order = list(reversed(range(len(self.names))))
        self._install(self._make_plan(order))
        if self._auto:
            self._start_scheduler(order)

    def _check_same(self, names, shapes, dtypes) -> None:
        mine = list(zip(self.names, self.shapes, self.dtypes))
        theirs = list(zip(names, (torch.Size(s) for s in shapes), dtypes))
        if mine != theirs:
            differ = [f"{a[0]}{tuple(a[1])}:{a[2]} vs {b[0]}{tuple(b[1])}:{b[2]}"
                      for a, b in zip(mine, theirs) if a != b][:4]
            raise ValueError(f"this GradientReducer exchanges {len(mine)} gradients and cannot take a different "
                             f"list ({len(theirs)} given; first differences: {differ}); use one reducer per "
                             f"model")

    def _nbytes(self) -> List[int]:
        return [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes)]

    def _make_plan(self, order: Sequence[int], spec=None) -> GroupPlan:
        nbytes = self._nbytes()
        spec = self._spec if spec is None else spec
        if spec is None:
            spec = max(1, min(_DEFAULT_MAX_GROUPS, math.ceil(sum(nbytes) / _DEFAULT_GROUP_BYTES)))
        return build_plan(spec, order, self.names, nbytes, self.dtypes)

    def _install(self, plan: GroupPlan) -> None:
        self._plan = plan
        self._groups = layout(plan, self.shapes)
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self._groups)

    def set_plan(self, plan: GroupPlan) -> None:
        """Switch plans between steps; per-element state moves to the new groups."""
        new = layout(plan, self.shapes)
        for holder in (self.exchange.memory, self.exchange.compressor):
            holder.load_state_dict(remap_state(holder.state_dict(), self._groups, new))
        self._install(plan)

    def _start_scheduler(self, order: List[int]) -> None:
        self.scheduler = exchange_scheduler(
            self.exchange, self._scheduler_config, order, self._nbytes(), self.shapes, self.dtypes[order[0]],
            torch.device("cpu"), lambda plan: self._make_plan(order, plan),
            ["tf"] + [f"{n}:{tuple(s)}:{d}" for n, s, d in zip(self.names, self.shapes, self.dtypes)])
        cached = self.scheduler.initial_plan()
        if cached is not None:
            self.set_plan(cached)

    # -- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Reduce one step's gradients (one tensor per bound variable, any layout, read only).

        Returns one tensor per variable with its shape and dtype: views of each group's result,
        which is never written again, so the caller may keep them.
        """
        if len(grads) != len(self.names):
            raise ValueError(f"expected {len(self.names)} gradients, got {len(grads)}")
        jobs, buffers = [], []
        for k, group in enumerate(self._groups):
            flat = self._buffer(k, grads[group.indices[0]])
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                flat[offset:offset + n].copy_(grads[i].reshape(-1))
            buffers.append(flat)
            jobs.append(self.exchange.start(group, flat, self._plan.codec(k)))
        check = None
        if self.nonfinite != "ignore":
            check = NonfiniteCheck(self.comm, [job.finite for job in jobs], self.exchange.step)
        results = [self.exchange.finish(job) for job in jobs]
        bad = check.culprits([group.name for group in self._groups]) if check else []
        step = self.exchange.step
        self.exchange.step += 1
        if bad:
            self._last_end = None
            self._raise_nonfinite(bad, step)
        for k, (flat, result) in enumerate(zip(buffers, results)):
            if result.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                self._buffers[k] = None  # the result is the buffer (plain allreduce): it goes to the caller
        out: List[Optional[torch.Tensor]] = [None] * len(self.names)
        for group, flat in zip(self._groups, results):
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                out[i] = flat[offset:offset + n].view(self.shapes[i])
        self._schedule()
        return out

    def _buffer(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """Group ``k``'s flat input buffer, reused across steps: a fresh 100 MB buffer costs
        about 4x a copy on this machine (page faults; see docs/frontends.md)."""
        flat = self._buffers[k]
        if flat is None or flat.dtype != like.dtype or flat.device != like.device:
            flat = self._buffers[k] = torch.empty(self._groups[k].numel, dtype=like.dtype, device=like.device)
        return flat

    def _raise_nonfinite(self, bad, step: int) -> None:
        by_name = {group.name: group for group in self._groups}
        where = "; ".join(f"rank {rank}, group {name!r}" for rank, name in bad)
        names = sorted({self.names[i] for _, name in bad for i in by_name[name].indices})
        raise FloatingPointError(f"non-finite gradient at step {step} ({where}); variables in those groups: "
                                 f"{names[:8]}{' ...' if len(names) > 8 else ''}")

    def _schedule(self) -> None:
        """Feed the step's wall time to the scheduler (no per-gradient ready times in TF)."""
        now = time.perf_counter()
        previous, self._last_end = self._last_end, now
        if self.scheduler is None or previous is None:
            return
        plan = self.scheduler.observe(now - previous, [0.0] * len(self.names), self._plan)
        if plan is not None and plan != self._plan:
            self.set_plan(plan)

    def schedule_report(self) -> Dict[str, Any]:
        if self.scheduler is None:
            return {"phase": "fixed", "groups": len(self._groups)}
        return self.scheduler.report()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's plan, step, compressor state, error-feedback memory, scheduler choice."""
        return {"plan": self._plan.to_json() if self._plan else None, **self.exchange.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the reducer must be bound (after the first step, or
        after :meth:`bind`)."""
        if not self.bound:
            raise RuntimeError("load_state_dict() needs the variables: call it after bind() or the first step")
        if state.get("plan") is not None:
            self._install(self._make_plan(self._plan.order, GroupPlan.from_json(state["plan"])))
        self.exchange.load_state_dict(state)
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        self._last_end = None

    def __repr__(self) -> str:
        return (f"GradientReducer(compressor={self.exchange.compressor!r}, memory={self.exchange.memory!r}, "
                f"groups={len(self._groups)})")
