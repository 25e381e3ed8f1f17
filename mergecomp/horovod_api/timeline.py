"""Horovod's timeline: a Chrome trace (open in ``chrome://tracing`` or Perfetto) of the tensor
collectives of the global process set, one row per collective name, with each collective's
``NEGOTIATE_<KIND>`` span (submitted until every rank had submitted it) and ``<KIND>`` span (the
collective itself), and with ``mark_cycles`` an instant ``CYCLE_START`` per negotiation round.
Rank 0 writes the file at :func:`stop_timeline` (or at the next :func:`start_timeline`)."""
from __future__ import annotations

import json
import threading
import time
from typing import Dict, List, Optional

__all__ = ["Timeline", "start_timeline", "stop_timeline"]


class Timeline:
    """Events of one recording, written to ``path`` as a JSON array by :meth:`write`."""

    def __init__(self, path: str, mark_cycles: bool) -> None:
        self.path, self.mark_cycles = path, mark_cycles
        self._start = time.time()
        self._events: List[dict] = []
        self._rows: Dict[str, int] = {}
        self._lock = threading.Lock()

    def _now(self) -> int:
        return int((time.time() - self._start) * 1e6)

    def event(self, name: str, phase: str, begin: bool) -> None:
        with self._lock:
            row = self._rows.setdefault(name, len(self._rows) + 1)
            self._events.append({"name": phase, "ph": "B" if begin else "E", "ts": self._now(), "pid": row, "tid": 1})

    def cycle(self) -> None:
        if self.mark_cycles:
            with self._lock:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "ts": self._now(), "pid": 0, "tid": 1})

    def write(self) -> None:
        with self._lock:
            rows = [{"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}}
                    for name, row in self._rows.items()]
            info = {"name": "trace_info", "ph": "M", "pid": 0,
                    "args": {"start_time_since_epoch_in_micros": int(self._start * 1e6)}}
            with open(self.path, "w") as f:
                json.dump([info] + rows + self._events, f)


def _coordinator():
    from mergecomp.horovod_api.process_sets import resolve

    return resolve(None, "start_timeline").coordinator


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the global process set's collectives into ``file_path`` (rank 0 writes it),
    ending a recording in progress first."""
    stop_timeline()
    _coordinator().timeline = Timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """End the recording and write its file (rank 0)."""
    coordinator = _coordinator()
    timeline: Optional[Timeline] = coordinator.timeline
    coordinator.timeline = None
    if timeline is not None and coordinator.comm.rank == 0:
        timeline.write()
