"""The clocks the scheduler's samples are read on: the device's, not the host's launch times.

On the CPU a kernel has run when the call that launched it returns, so the host clock times the
work.  On a CUDA device it has only been queued: host seconds between two points are launch
times, and a plan chosen on them would be chosen on how fast Python enqueues kernels.  So:

* :func:`settle` waits for the device's queued work (a no-op on the CPU);
* :func:`settled_now` reads the host clock once the device has caught up: the end of a step, of
  a probe, of a replayed collective;
* :class:`Arrivals` stamps when each gradient of a step arrived, leaving out the hooks' own
  work: host seconds on the CPU; on a CUDA device, events recorded on the current stream
  (where the backward pass queues its kernels), read once the step's work is done;
* :class:`StepEnds` times each step: settled (one synchronization) while the scheduler
  searches, by CUDA events read a step late while it only watches.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Deque, Iterator, List, Optional, Tuple

import torch

__all__ = ["settle", "settled_now", "Arrivals", "StepEnds"]


def settle(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def settled_now(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done."""
    settle(device)
    return time.perf_counter()


class Arrivals:
    """When each of ``count`` tensors' gradients arrived in one step, in seconds on one clock,
    the seconds of the hooks' own work (:meth:`own_work`) left out.

    ``events``: stamp with CUDA events on the current stream of ``device`` (a CUDA device): a
    stamp is when the device reached it, so a gradient's is when the kernels that made it were
    done.  Otherwise (the CPU, or steps whose arrival times nobody reads) host seconds.  Read
    :meth:`seconds` after the step's work is done (:func:`settle`)."""

    def __init__(self, count: int, device: torch.device, events: bool = False) -> None:
        self.events = events and torch.device(device).type == "cuda"
        self._at: List[Optional[float]] = [None] * count  # host: arrival minus own work so far
        self._spent = 0.0  # host: seconds of own work so far
        self._marks: List[Tuple[int, torch.cuda.Event, int]] = []  # events: (tensor, stamp, spans before)
        self._spans: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []  # events: own work

    def _event(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def arrived(self, i: int) -> None:
        """Tensor ``i``'s gradient is here (before any work of the hook's own for it)."""
        if self.events:
            self._marks.append((i, self._event(), len(self._spans)))
        else:
            self._at[i] = time.perf_counter() - self._spent

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """Work of the hooks' own (copies, encodes, collectives started): left out of the
        arrival times that follow."""
        if self.events:
            began = self._event()
            try:
                yield
            finally:
                self._spans.append((began, self._event()))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self._spent += time.perf_counter() - began

    def seconds(self) -> List[float]:
        """Each tensor's arrival (seconds on one clock, own work left out; 0.0 for a tensor
        that did not arrive)."""
        if not self.events:
            return [0.0 if t is None else t for t in self._at]
        out = [0.0] * len(self._at)
        if not self._marks:
            return out
        first = self._marks[0][1]
        first.synchronize()
        spans = [0.0]  # own seconds of the first n spans
        for began, ended in self._spans:
            ended.synchronize()
            spans.append(spans[-1] + began.elapsed_time(ended) / 1e3)
        for i, stamp, before in self._marks:
            stamp.synchronize()
            out[i] = first.elapsed_time(stamp) / 1e3 - spans[before]
        return out


class StepEnds:
    """The seconds of each step on ``device``'s clock, for the scheduler's samples.

    :meth:`seconds` is called at the end of every step, the same number of times on every rank.
    ``lagged=False``: the step just ended, once the device has done its work (one
    synchronization; the host clock on the CPU).  ``lagged=True`` on a CUDA device: an event
    marks this step's end, and the step before it is returned from the two events before, waited
    for (the device has usually finished them: the host waits for no work of this step), so a
    step that only watches the step time never stalls the host; on the CPU the same as
    ``lagged=False``.  None where no sample is ready yet (the first step, or the first two after
    switching to events); every rank gets None at the same steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._last: Optional[float] = None  # when the last settled step ended
        self._marks: Deque["torch.cuda.Event"] = deque(maxlen=3)

    def forget(self) -> None:
        """The step in progress is no sample: the next one only marks where the one after begins."""
        self._last = None
        self._marks.clear()

    def seconds(self, lagged: bool = False) -> Optional[float]:
        if lagged and self.cuda:
            self._last = None
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
            if len(self._marks) < 3:
                return None
            self._marks[1].synchronize()
            return self._marks[0].elapsed_time(self._marks[1]) / 1e3
        self._marks.clear()
        previous, self._last = self._last, settled_now(self.device)
        return None if previous is None else self._last - previous
