"""Where a step's time goes: per-step timings of a :class:`~mergecomp.pipeline.step.MergedStep`, kept for
the last steps in a small ring and averaged on request (``opt.step_breakdown()``).

A step runs from the end of the previous step to the end of this one: the end of its
optimizer update where the front end times it (the PyTorch optimizer), else the end of
:meth:`~mergecomp.pipeline.step.MergedStep.finish`.  Its seconds split into parts that add up to it:

``compute``
    the rest: forward, backward (with the hooks of gradients already in their slots, which
    only count them), ``zero_grad``, data loading, the training loop's own work;
``encode``
    copying in gradients that were not in their slots (NaN/Inf-checked in the same pass), the
    prescale, the NaN/Inf check, a front end's transform (``before_start``), compressing (with
    a fused encode, the memory's compensation too), starting collectives (in the backward
    hooks, and for groups started by ``finish``);
``memory``
    the error-feedback memory: compensate and the residual update (both stages of two-phase;
    nothing after a fused encode, whose pass does both, counted as ``encode``);
``wait``
    blocked on collectives after the backward pass: the exposed wire time;
``decode``
    aggregating and decoding after the waits, copies of the results, ``finish``'s bookkeeping;
``scheduler``
    the online scheduler at the end of the step (its probes, plan switches);
``optimizer``
    the wrapped optimizer's update (0 where the front end does not time it).

Seconds are host time between ``time.perf_counter`` stamps (no device synchronization): on a
GPU, kernels run asynchronously, so device work shows up where the host next waits for it.

Each group also reports its bytes (its gradients'), the codec it was sent with, its own
encode/memory/wait/decode seconds (the parts above less the step-level bookkeeping) and the
passes the path made over its elements, by stage.  One pass reads or writes every element of
the group once (a fused kernel reading the gradient and writing a residual is one pass);
work on payload-sized data (k sparse entries, packed bits) and the engine's own copies are not
counted, and work on part of the group counts as that fraction of a pass.  Stages:
``copy-in`` (gradients into the buffer, prescaling), ``check`` (a NaN/Inf pass apart from the
copy), ``compensate``, ``encode``, ``memory`` (the residual update with any decode it needs),
``decode`` (aggregation), ``copy-out`` (results copied back).  A fused encode
(:class:`~mergecomp.compressors.base.capabilities.FusedEncode`) compensates and
updates the memory in its encode pass: that pass counts as ``encode``, none as ``compensate`` or
``memory``.  The counts are declared next to the code that makes the passes
(``passes`` on compressors and memories, :mod:`mergecomp.compressors.base.passes`) for the fused
kernels' path (contiguous fp32 CPU tensors); the eager torch versions elsewhere make more
(:mod:`mergecomp.kernels.native`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

__all__ = ["PARTS", "GROUP_PARTS", "STAGES", "ENCODE", "MEMORY", "WAIT", "DECODE", "SCHEDULER", "DEFAULT_WINDOW",
           "Stopwatch", "Breakdown", "combine"]

ENCODE, MEMORY, WAIT, DECODE, SCHEDULER = "encode", "memory", "wait", "decode", "scheduler"
#: a step's parts, in the order they are reported
PARTS = ("compute", ENCODE, MEMORY, WAIT, DECODE, SCHEDULER, "optimizer")
#: the parts a group reports
GROUP_PARTS = (ENCODE, MEMORY, WAIT, DECODE)
#: the stages a group's passes are counted in, in path order
STAGES = ("copy-in", "check", "compensate", "encode", "memory", "decode", "copy-out")
#: steps a :class:`Breakdown` keeps unless told otherwise
DEFAULT_WINDOW = 20

#: (part, group name or None for the step's own work)
Key = Tuple[str, Optional[str]]


class Stopwatch:
    """Exclusive seconds by (part, group): ``with clock(part, group):`` charges the time spent
    inside to that key, except what nested blocks charge to theirs.  Single-threaded."""

    def __init__(self) -> None:
        self.seconds: Dict[Key, float] = {}
        self._open: List[Key] = []
        self._since = 0.0
        self._next: Key = ("", None)

    def __call__(self, part: str, group: Optional[str] = None) -> "Stopwatch":
        self._next = (part, group)
        return self

    def __enter__(self) -> None:
        now = time.perf_counter()
        if self._open:
            self._charge(now)
        self._open.append(self._next)
        self._since = now

    def __exit__(self, *exc) -> None:
        self._charge(time.perf_counter())
        self._open.pop()

    def _charge(self, now: float) -> None:
        key = self._open[-1]
        self.seconds[key] = self.seconds.get(key, 0.0) + now - self._since
        self._since = now

    def take(self) -> Dict[Key, float]:
        """The seconds charged since the last call; starts afresh."""
        seconds, self.seconds = self.seconds, {}
        return seconds


def _mean(records: Sequence[Dict[str, Any]], key: str) -> float:
    steps = sum(r["steps"] for r in records)
    return sum(r[key] * r["steps"] for r in records) / steps if steps else 0.0


def _same_group(group: Dict[str, Any]) -> Tuple[str, str]:
    return group["name"], group["codec"]


def combine(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The average of breakdowns (as :meth:`Breakdown.summary` returns them), weighted by their
    ``steps``.  Its groups are those of the last record, each averaged over the records that
    had a group of that name sent with that codec (its own ``steps``)."""
    out: Dict[str, Any] = {"steps": sum(r["steps"] for r in records), "step_s": _mean(records, "step_s"),
                           **{f"{part}_s": _mean(records, f"{part}_s") for part in PARTS}, "groups": []}
    for group in records[-1]["groups"] if records else ():
        same = [g for r in records for g in r["groups"] if _same_group(g) == _same_group(group)]
        stages = {stage: sum(g["passes_by_stage"].get(stage, 0.0) * g["steps"] for g in same)
                  / sum(g["steps"] for g in same) for stage in group["passes_by_stage"]}
        out["groups"].append({"name": group["name"], "codec": group["codec"], "bytes": group["bytes"],
                              "steps": sum(g["steps"] for g in same),
                              **{f"{part}_s": _mean(same, f"{part}_s") for part in GROUP_PARTS},
                              "passes": sum(stages.values()), "passes_by_stage": stages})
    return out


class Breakdown:
    """The timings of the last :attr:`window` steps (see the module docstring).

    :meth:`end_step` closes a step with its mergecomp work from a :class:`Stopwatch`;
    :meth:`end_update` adds the optimizer update that followed it; :meth:`summary` averages."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self._steps: Deque[Dict[str, Any]] = deque(maxlen=self._checked(window))
        self._since: Optional[float] = None  # when the last step ended
        self._open: Optional[Dict[str, Any]] = None  # the last step, while its update may follow

    @staticmethod
    def _checked(window: int) -> int:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"the breakdown window must be an int >= 1, got {window!r}")
        return window

    @property
    def window(self) -> int:
        """How many steps are kept (settable; the newest are kept)."""
        return self._steps.maxlen

    @window.setter
    def window(self, steps: int) -> None:
        self._steps = deque(self._steps, maxlen=self._checked(steps))

    def end_step(self, seconds: Dict[Key, float], groups: Sequence[Dict[str, Any]]) -> None:
        """Close a step now: ``seconds`` is its mergecomp work (:meth:`Stopwatch.take`), whose
        group keys name ``groups`` (each ``name``, ``codec``, ``bytes``, ``passes_by_stage``).
        The first step after construction or :meth:`forget` only marks where the next begins."""
        now = time.perf_counter()
        since, self._since, self._open = self._since, now, None
        if since is None:
            return
        parts = dict.fromkeys(PARTS, 0.0)
        by_group = {group["name"]: dict.fromkeys(GROUP_PARTS, 0.0) for group in groups}
        for (part, name), spent in seconds.items():
            parts[part] += spent
            if name in by_group:
                by_group[name][part] += spent
        parts["compute"] = now - since - sum(parts.values())
        self._open = {"steps": 1, "step_s": now - since, **{f"{p}_s": s for p, s in parts.items()},
                      "groups": [{**group, "steps": 1, **{f"{p}_s": s for p, s in by_group[group["name"]].items()}}
                                 for group in groups]}
        self._steps.append(self._open)

    def end_update(self, began: float, ended: float) -> None:
        """The optimizer's update ran from ``began`` to ``ended`` (``perf_counter``) after the
        last step's :meth:`end_step`: that step now ends at ``ended`` (the time before ``began``
        is the training loop's: compute)."""
        if self._since is None:
            return
        step = self._open
        if step is not None:
            step["optimizer_s"] += ended - began
            step["compute_s"] += began - self._since
            step["step_s"] += ended - self._since
        self._since, self._open = ended, None

    def forget(self) -> None:
        """The step in progress is no sample (it failed, or state was loaded): the next step
        only marks where the one after it begins."""
        self._since = self._open = None

    def summary(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """The last ``steps`` kept steps (default: all), averaged: ``steps``, ``step_s``, one
        ``<part>_s`` per part of :data:`PARTS`, and ``groups`` (the last step's, see
        :func:`combine`), each with ``name``, ``codec``, ``bytes``, ``steps``,
        ``<part>_s`` for :data:`GROUP_PARTS`, ``passes`` and ``passes_by_stage``."""
        kept = list(self._steps)
        if steps is not None:
            kept = kept[-steps:] if steps > 0 else []
        return combine(kept)
