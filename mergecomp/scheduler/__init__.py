"""Scheduling merge plans: the online scheduler (:mod:`.online`), its measurements
(:mod:`.probes`), the cost model and plan search (:mod:`.costmodel`), and the offline planner
(:mod:`.offline`, ``mergecomp plan``)."""
from mergecomp.scheduler.online import MergeScheduler, SchedulerConfig

__all__ = ["MergeScheduler", "SchedulerConfig"]
