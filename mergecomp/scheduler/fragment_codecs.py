"""Each Streaming DiLoCo fragment's codec for the link (``mc.DiLoCo(..., fragment_codecs="auto")``).

A fragment's exchange is hidden when it lands within the inner steps it is kept in flight (its
*window*).  What it sends within that window only decides quality: the exact average beats a
rounding, which beats a coarse code.  So the choice is the least lossy codec of
:data:`LADDER` whose exchange fits the window, and the configured compressor (the floor: it
sends the first, timed round) where none does.  A codec the compressor already beats in bits
is never taken: ``compression="fp16"`` is not replaced by 8-bit QSGD.

The prediction scales the fragment's first exchange, timed on every rank with the configured
compressor, by each codec's bytes on the wire (ring allreduce for payloads that add up, ring
allgather otherwise, :mod:`mergecomp.scheduler.costmodel`): all of the timed exchange is taken
to move with the bytes, which overstates a larger codec's time where latency or encoding took
part of it, so the error is on the side of the compressor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from mergecomp.exchange.plan import COMPRESSED, WARMUP_QSGD, WARMUP_QSGD4
from mergecomp.scheduler.costmodel import ring_allgather, ring_allreduce

__all__ = ["LADDER", "FIT_SHARE", "NAMES", "Candidate", "wire_bytes", "choose"]

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
    """A codec for one fragment: its plan codec name, the bits per element one rank sends with
    it, and whether its payloads add up (sent by allreduce, else allgather)."""

    codec: str
    bits: float
    summable: bool


def wire_bytes(candidate: Candidate, numel: int, world_size: int) -> float:
    """Bytes that cross one rank's link for a fragment of ``numel`` elements sent with
    ``candidate`` (the ring collectives' per-byte cost at unit bandwidth)."""
    ring = ring_allreduce if candidate.summable else ring_allgather
    return ring(0.0, 1.0, world_size).per_byte * candidate.bits * numel / 8


def choose(timed_s: float, timed: Candidate, candidates: Sequence[Candidate], numel: int, world_size: int,
           window_s: float) -> Dict[str, object]:
    """The codec for one fragment of ``numel`` elements whose exchange with ``timed`` took
    ``timed_s`` seconds (the slowest rank's): the first of ``candidates`` (least lossy first,
    the compressor last) that sends more bits than the compressor and is predicted to fit
    :data:`FIT_SHARE` of ``window_s``, else the compressor.  Returns ``{"codec", "bits",
    "predicted_s"}`` (its bits per element and predicted seconds) and every candidate's
    prediction under ``"predictions"`` (codec -> seconds)."""
    seconds_per_byte = timed_s / max(wire_bytes(timed, numel, world_size), 1.0)
    floor = candidates[-1]
    predictions: Dict[str, float] = {c.codec: seconds_per_byte * wire_bytes(c, numel, world_size) for c in candidates}
    fitting: List[Candidate] = [c for c in candidates[:-1]
                                if c.bits > floor.bits and predictions[c.codec] <= FIT_SHARE * window_s]
    chosen = fitting[0] if fitting else floor
    return {"codec": chosen.codec, "bits": chosen.bits, "predicted_s": predictions[chosen.codec],
            "predictions": predictions}
