"""Driving the online scheduler from a planned step (``groups="auto"``).

:class:`PlanSearch` starts the :class:`~mergecomp.scheduler.online.MergeScheduler` once the
step's backward order is known, gives it every finished step's wall time and the gradients'
arrival times, and installs the plans it asks for.  The search covers the tensors that are
not exempt from compression: its plans leave out the exempt groups, which the step appends
again (:meth:`~mergecomp.pipeline.planned.PlannedStep.set_plan`).

Its samples are read on the device's clock (:mod:`mergecomp.scheduler.clock`): on a CUDA device
a step ends, for the scheduler, once the device has done its work (one synchronization per step
while the scheduler searches), the profiled step's arrival times are CUDA events, and once a
plan is chosen each step's time comes from CUDA events read a step late (no synchronization).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from mergecomp.exchange.plan import EXEMPT, GroupPlan
from mergecomp.scheduler.clock import Arrivals, StepEnds
from mergecomp.scheduler.online import MergeScheduler, SchedulerConfig, exchange_scheduler

__all__ = ["PlanSearch"]


class PlanSearch:
    """The online search of the plan of ``step`` (a :class:`~mergecomp.pipeline.planned.PlannedStep`),
    with ``config``; ``cache_tag``: words prefixed to the plan cache's signature."""

    def __init__(self, step, config: SchedulerConfig, cache_tag: Sequence[str] = ()) -> None:
        self.step = step
        self.config = config
        self.cache_tag = list(cache_tag)
        #: the scheduler, once :meth:`start` ran; None after :meth:`stop`
        self.scheduler: Optional[MergeScheduler] = None
        #: False once stopped, or where every tensor is exempt (nothing to search)
        self.active = True
        self._order: List[int] = []  # the tensors the scheduler cuts, in backward order
        #: each step's seconds (settled while searching, read a step late while watching)
        self._ends = StepEnds(step.device)

    def start(self) -> None:
        """Build the scheduler over the step's current order (final by now), and take its cached
        plan where the cache holds one."""
        step = self.step
        if not self.active:
            return
        order = [i for i in step.plan.order if not step.exempt_flags[i]]
        if not order:  # every tensor is exempt: nothing to search
            self.active = False
            return
        self._order = order
        exempt = [f"exempt:{step.exempt}"] if step.exempt else []
        self.scheduler = exchange_scheduler(
            step.exchange, self.config, order, step.nbytes(), step.shapes, step.dtypes[order[0]], step.device,
            lambda plan: step.make_plan(order, plan),
            self.cache_tag + exempt + [f"{n}:{tuple(s)}:{d}" for n, s, d in zip(step.names, step.shapes, step.dtypes)],
            step.options.scheme)
        cached = self.scheduler.initial_plan()
        if cached is not None:
            step.set_plan(cached)

    def observe(self, arrivals: Optional[Arrivals]) -> None:
        """A step finished (its results stand): give its wall time (and the tensors' arrival
        times, ``arrivals``; None: all at once) to the scheduler, and switch plans when it says
        so.  Warm-up steps are no samples: the search starts once compression has begun."""
        step = self.step
        if self.scheduler is None:
            self._ends.forget()
            return
        seconds = self._ends.seconds(lagged=self.scheduler.phase == "monitor")
        if seconds is None or step.step <= step.warmup_steps:
            return
        order = self._order
        if arrivals is None:
            since_first = [0.0] * len(order)
        else:
            ready = arrivals.seconds()
            first = min(ready[i] for i in order)
            since_first = [ready[i] - first for i in order]
        current = self._searched()
        plan = self.scheduler.observe(seconds, since_first, current)
        if plan is not None and plan != current:
            step.set_plan(plan)

    def profiles_next(self) -> bool:
        """Whether the step starting now is the one the scheduler profiles, whose arrival times
        it reads (on a CUDA device they are then stamped with events, :class:`Arrivals`)."""
        return self.scheduler is not None and self.scheduler.phase == "profile"

    def skip_sample(self) -> None:
        """The step in progress is no timing sample (it held NaN/Inf, or state was loaded)."""
        self._ends.forget()

    def _searched(self) -> GroupPlan:
        """The current plan without its exempt groups (what the scheduler's plans look like)."""
        plan = self.step.plan
        kept = [g for g, codec in enumerate(plan.codec_names()) if codec != EXEMPT]
        return GroupPlan(tuple(plan.groups[g] for g in kept), tuple(plan.codec(g) for g in kept))

    def stop(self) -> None:
        """Keep the current plan from now on: no further search or re-tuning."""
        self.scheduler, self.active = None, False

    def report(self) -> Dict[str, Any]:
        """What the scheduler tried and chose (:meth:`MergeScheduler.report`); before it started
        ``{"phase": "starting"}``, once stopped ``{"phase": "fixed"}``, with the number of groups."""
        if self.scheduler is not None:
            return self.scheduler.report()
        return {"phase": "starting" if self.active else "fixed", "groups": len(self.step.groups)}

    def load_state_dict(self, state: Optional[Dict[str, Any]], started: bool) -> None:
        """Resume the scheduler's choice (``state``: its :meth:`MergeScheduler.state_dict`, or
        None) where the step's order is final (``started``: the search runs)."""
        self._ends.forget()
        if started and self.scheduler is None:
            self.start()
        if state and self.scheduler is not None:
            self.scheduler.load_state_dict(state)
