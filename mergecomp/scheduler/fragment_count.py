"""How many Streaming DiLoCo fragments the link needs (``mc.DiLoCo(..., fragments="auto")``).

A fragment's outer step lands the inner steps it is in flight (its *delay*) after its send, and
the loss follows that delay far more than the number of fragments (docs/scheduler.md,
``diloco-staleness``).  More fragments make each exchange smaller, so it is hidden behind fewer
inner steps, but P fragments in ``sync_every`` = H inner steps leave each at most H // P - 1 of
them in flight.  So the choice is the smallest delay that some fragment count hides, and the
fewest fragments that hide their exchange within it.  An exchange is hidden behind d inner steps
when it is predicted within :data:`~mergecomp.scheduler.fragment_codecs.FIT_SHARE` of them (the
rest: the prediction's error, and the engine's threads competing with the inner steps).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

from mergecomp.scheduler.fragment_codecs import FIT_SHARE

__all__ = ["covering", "choose"]


def covering(exchange_s: float, step_s: float) -> float:
    """The fewest inner steps of ``step_s`` seconds whose :data:`FIT_SHARE` holds an exchange of
    ``exchange_s`` seconds (at least 1; infinite without a step time)."""
    if step_s <= 0:
        return math.inf
    return max(1, math.ceil(exchange_s / (FIT_SHARE * step_s)))


def choose(exchange_s: Mapping[int, float], step_s: float, sync_every: int,
           delay: Optional[int] = None) -> Dict[str, object]:
    """The fragment count and delay for ``sync_every`` = H inner steps of ``step_s`` seconds, from
    ``exchange_s`` (fragment count P -> seconds of the exchange of its largest fragment; the
    candidates, each with H // P >= 2).  Without ``delay``: the smallest delay d that some P
    hides (d <= H // P - 1, :func:`covering`), with the fewest fragments that do; where none
    hides its exchange, the fewest fragments with their longest delay (P fragments overlap at
    most H - P inner steps of a round: one fragment the most).  With ``delay``: the fewest
    fragments hidden within it, else the most that may keep it (each smaller exchange stalls
    less).  Returns ``{"fragments", "delay", "hidden", "covering"}`` (``covering``: P -> the
    inner steps its exchange needs)."""
    needs = {p: covering(seconds, step_s) for p, seconds in exchange_s.items()}
    allowed = {p: sync_every // p - 1 for p in exchange_s}
    if delay is None:
        hidden = [(need, p) for p, need in needs.items() if need <= allowed[p]]
        fragments, chosen = min(hidden)[::-1] if hidden else (min(needs), allowed[min(needs)])
    else:
        keeping = [p for p in needs if delay <= allowed[p]]
        hidden = [p for p in keeping if needs[p] <= delay]
        fragments, chosen = (min(hidden) if hidden else max(keeping)), delay
    return {"fragments": fragments, "delay": int(chosen), "hidden": bool(hidden), "covering": needs}
