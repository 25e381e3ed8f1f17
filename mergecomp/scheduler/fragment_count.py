"""How many Streaming DiLoCo fragments the link needs (``mc.DiLoCo(..., fragments="auto")``).

A fragment's outer step lands the inner steps it is in flight (its *delay*) after its send, and
its local parameters then take the global ones: the inner steps it trained meanwhile are lost to
it.  The loss follows that delay far more than the number of fragments (docs/scheduler.md,
``diloco-staleness``, H = 10: 2, 3 or 5 fragments 1 or 2 inner steps late ended within 0.3 %
of landing at once, 2 fragments 4 steps late +2.8 %), and the whole model landing late pays most
(one fragment 1, 2, 3, 6 and 9 steps late +1.0, +1.4, +1.9, +7.7 and +34 %), so where two
fragments fit in H with a delay (H >= 4) one is not chosen.  More fragments make each exchange
smaller, so it hides behind fewer inner steps, but P fragments in ``sync_every`` = H inner steps
leave each at most H // P - 1 of them in flight.  So the choice is the smallest delay, at most
:data:`STALE_SHARE` of H, behind which some fragment count hides its exchange, and the fewest
fragments that hide it there (at equal delays the grid's counts ended within a seed's spread of
each other).  Where no count hides its exchange within that bound, it will hold the inner steps
up whatever the count, and the count that holds them least there is taken.  An exchange is hidden
behind d inner steps when it is predicted within
:data:`~mergecomp.scheduler.fragment_codecs.FIT_SHARE` of them (the rest: the prediction's error,
and the engine's threads competing with the inner steps).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

from mergecomp.scheduler.fragment_codecs import FIT_SHARE

__all__ = ["STALE_SHARE", "covering", "choose"]

#: the longest delay chosen for the user, as a share of H (at least 1 inner step)
STALE_SHARE = 0.25


def covering(exchange_s: float, step_s: float, share: float = FIT_SHARE) -> float:
    """The fewest inner steps of ``step_s`` seconds whose ``share`` holds an exchange of
    ``exchange_s`` seconds (at least 1; infinite without a step time).  The default share
    (:data:`FIT_SHARE`) is for a predicted exchange; a timed one takes the whole steps (1)."""
    if step_s <= 0:
        return math.inf
    return max(1, math.ceil(exchange_s / (share * step_s)))


def choose(exchange_s: Mapping[int, float], step_s: float, sync_every: int,
           delay: Optional[int] = None) -> Dict[str, object]:
    """The fragment count and delay for ``sync_every`` = H inner steps of ``step_s`` seconds, from
    ``exchange_s`` (fragment count P -> seconds of the exchange of its largest fragment; the
    candidates, each with H // P >= 2, P = 1 among them; P = 1 only where no other is).  Each
    P may keep its exchange in flight for ``delay`` inner steps where given (the counts with
    H // P > delay), else for up to H // P - 1 of them and :data:`STALE_SHARE` of H.  The
    smallest delay behind which some count's exchange hides (:func:`covering`; with ``delay``:
    it), and the fewest fragments hidden there; where none is, the count whose exchanges are predicted to hold the inner
    steps up least in a round (P times what each exchange overruns its delay's share), at its
    longest delay.  Returns ``{"fragments", "delay", "hidden", "covering", "wait_s"}``:
    ``covering`` P -> the inner steps its exchange needs, ``wait_s`` the predicted hold-up per
    round (0 where hidden)."""
    needs = {p: covering(seconds, step_s) for p, seconds in exchange_s.items()}
    counts = [p for p in exchange_s if p > 1] or list(exchange_s)
    if delay is None:
        bound = max(1, int(STALE_SHARE * sync_every))
        delays = {p: min(sync_every // p - 1, bound) for p in counts}
    else:
        delays = {p: delay for p in counts if delay <= sync_every // p - 1} or {1: delay}
    hidden = [(needs[p] if delay is None else delay, p) for p in delays if needs[p] <= delays[p]]
    if hidden:
        (chosen, fragments), wait = min(hidden), 0.0
    else:
        waits = {p: p * max(0.0, exchange_s[p] - FIT_SHARE * d * step_s) for p, d in delays.items()}
        fragments = min(waits, key=lambda p: (waits[p], p))
        chosen, wait = delays[fragments], waits[fragments]
    return {"fragments": fragments, "delay": int(chosen), "hidden": bool(hidden), "covering": needs, "wait_s": wait}
