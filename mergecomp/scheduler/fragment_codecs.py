"""Each Streaming DiLoCo fragment's codec for the link (``mc.DiLoCo(..., fragment_codecs="auto")``).

A fragment's exchange is hidden when it lands within the inner steps it is kept in flight (its
*window*).  What it sends within that window only decides quality: the exact average beats a
rounding, which beats a coarse code.  So the choice is the least lossy codec of
:data:`LADDER` whose exchange fits the window, and the configured compressor (the floor: it
sends the first, timed round) where none does.  A codec the compressor already beats in bits
is never taken: ``compression="fp16"`` is not replaced by 8-bit QSGD.

Each candidate's exchange is predicted by the scheduler's probes
(:func:`mergecomp.scheduler.probes.exchange_within`): its own work rehearsed at the fragment's
size, its collectives replayed on the link.  The climb starts at the fewest bits and stops at the
first candidate whose collectives alone overrun the window (more bits cross no faster), so a
slow link pays for probing the small codecs only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Sequence, Tuple

from mergecomp.exchange.plan import COMPRESSED, WARMUP_QSGD, WARMUP_QSGD4

__all__ = ["LADDER", "FIT_SHARE", "NAMES", "Candidate", "choose"]

#: the codecs a fragment may take besides the compressor, least lossy first: the exact average,
#: fp16, QSGD's 8-bit codes (127 levels: INTELLECT-1's int8), its 4-bit codes (Streaming
#: DiLoCo's 4 bits); the QSGD routes are unbiased and outside error feedback
LADDER = ("none", "fp16", WARMUP_QSGD, WARMUP_QSGD4)
#: how a fragment's codec reads in logs and tables
NAMES = {"none": "fp32", "fp16": "fp16", WARMUP_QSGD: "8-bit QSGD", WARMUP_QSGD4: "4-bit QSGD",
         COMPRESSED: "the compressor"}
#: the share of the window a codec's predicted exchange may take (the rest: the prediction's
#: error, and the engine's threads competing with the inner steps for the CPU)
FIT_SHARE = 0.75


@dataclass(frozen=True)
class Candidate:
    """A codec for one fragment: its plan codec name and the bits per element one rank sends with it."""

    codec: str
    bits: float


def choose(floor_s: float, candidates: Sequence[Candidate], predict: Callable[[Candidate], Tuple[float, float]],
           window_s: float) -> Dict[str, object]:
    """The codec for one fragment: ``candidates`` least lossy first, the compressor last (its
    exchange took ``floor_s`` seconds).  From the fewest bits up, each candidate with more bits
    than the compressor gets ``predict(candidate)``, its ``(own work, collectives)`` seconds
    (the same on every rank); it fits when their sum is within :data:`FIT_SHARE` of
    ``window_s``; the climb stops at the first whose collectives alone do not fit.  The least
    lossy that fit is chosen, else the compressor.  Returns ``{"codec", "bits", "predicted_s"}``
    and ``"predictions"`` (codec -> seconds, of the compressor and of every candidate predicted)."""
    floor, budget = candidates[-1], FIT_SHARE * window_s
    predictions: Dict[str, float] = {floor.codec: floor_s}
    chosen = floor
    for candidate in reversed([c for c in candidates[:-1] if c.bits > floor.bits]):
        own, network = predict(candidate)
        predictions[candidate.codec] = own + network
        if own + network <= budget:
            chosen = candidate
        if network > budget:
            break
    return {"codec": chosen.codec, "bits": chosen.bits, "predicted_s": predictions[chosen.codec],
            "predictions": predictions}
