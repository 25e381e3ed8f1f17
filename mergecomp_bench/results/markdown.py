"""How the rendered docs write a table and its cells: signed differences, speed-ups, ranges,
compressor names.  Imports nothing of the package, so any module (the compatibility tables
included) may use it."""
from __future__ import annotations

import math
import statistics
from typing import Callable, Iterable, Sequence

__all__ = ["table", "signed", "times", "span", "median_span", "seed_list", "compressor_name", "groups_label", "link"]


def table(header: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: ``align`` holds each column's ``---`` / ``---:``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def signed(value: float, digits: int = 2, unit: str = "%") -> str:
    """``+0.65 %`` / ``−0.33 pp`` (a minus sign, as the docs write it); ``diverged`` for NaN."""
    if math.isnan(value):
        return "diverged"
    text = f"{abs(value):.{digits}f}"
    return ("−" if value < 0 and float(text) else "+") + f"{text} {unit}"


def link(rate: str) -> str:
    """A bench's ``--rate`` as the docs write it: ``10mbit`` 10 Mbit/s, ``1gbit`` 1 Gbit/s."""
    return rate.replace("mbit", " Mbit/s").replace("gbit", " Gbit/s")


def times(ratio: float) -> str:
    """A speed-up: ``1.67x``."""
    return f"{ratio:.2f}x"


def span(values: Iterable[float], write: Callable[[float], str]) -> str:
    """``lo to hi`` of ``values`` as ``write`` writes them; one value where the two agree."""
    ordered = sorted(values)
    lo, hi = write(ordered[0]), write(ordered[-1])
    return lo if lo == hi else f"{lo} to {hi}"


def median_span(values: Sequence[float], write: Callable[[float], str]) -> str:
    """``median (lo to hi)``, or the one value (where they all read the same)."""
    middle, spread = write(statistics.median(values)), span(values, write)
    return middle if spread == middle else f"{middle} ({spread})"


def seed_list(seeds: Iterable[int]) -> str:
    """``seed 0`` or ``seeds 0, 1, 2``."""
    seeds = sorted(seeds)
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


#: how the tables name a compressor
_NAMES = {"none": "fp32 (`none`)", "fp16": "fp16", "bf16": "bf16", "qsgd": "QSGD", "terngrad": "TernGrad",
          "signsgd": "signSGD", "signum": "Signum", "efsignsgd": "EF-signSGD", "onebit": "1-bit SGD",
          "topk": "top-k", "randk": "rand-k", "dgc": "DGC", "powersgd": "PowerSGD", "acpsgd": "ACP-SGD"}


def compressor_name(compressor: str) -> str:
    return _NAMES.get(compressor, f"`{compressor}`")


def groups_label(plan: dict) -> str:
    """A plan's groups in MB, with the route each takes where it is not the compressor's own."""
    codecs = plan["codecs"]
    if len(set(codecs)) == 1:
        route = "" if codecs[0] == "compressed" else f", {codecs[0]}"
        return " + ".join(f"{mb:.1f}" for mb in plan["group_mb"]) + " MB" + route
    return " + ".join(f"{mb:.1f}" + ("" if codec == "compressed" else f" {codec}")
                      for mb, codec in zip(plan["group_mb"], codecs)) + " MB"
