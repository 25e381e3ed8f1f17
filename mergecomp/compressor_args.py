"""Command-line parsing shared by the ``mergecomp`` subcommands (``plan``, ``bench``)."""
from __future__ import annotations

import ast
from typing import Dict, Sequence

__all__ = ["keyword_args"]


def keyword_args(pairs: Sequence[str]) -> Dict[str, object]:
    """``["ratio=0.05", "selection=exact"]`` -> ``{"ratio": 0.05, "selection": "exact"}``
    (values parsed as Python literals where they are, else kept as strings)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"mergecomp: -C takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out
