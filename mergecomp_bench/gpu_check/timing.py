"""GPU time by CUDA events: untimed warm-up runs, then each timed run between two events on the
current stream, read once the second has been reached (host time would be launch time)."""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

__all__ = ["event_ms"]


def event_ms(run: Callable[[], None], repeats: int, warmup: int = 1,
             setup: Optional[Callable[[], None]] = None, budget_s: Optional[float] = None) -> List[float]:
    """Milliseconds of each of ``repeats`` timed calls of ``run()`` on the current CUDA stream,
    after ``warmup`` untimed ones; ``setup()`` (untimed, queued before the first event) before
    every call.  With ``budget_s``, fewer timed calls (at least one) where the warm-up says
    ``repeats`` would not fit."""
    setup = setup or (lambda: None)
    spent = 0.0
    for _ in range(max(1, warmup)):
        setup()
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        spent = time.perf_counter() - began
    if budget_s is not None and spent * repeats > budget_s:
        repeats = max(1, int(budget_s // max(spent, 1e-9)))
    times = []
    for _ in range(repeats):
        setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times

