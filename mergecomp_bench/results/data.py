"""The benchmark records in ``docs/img/data``, read by name: a missing record raises
(``LookupError``) instead of rendering a blank."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

__all__ = ["DATA", "read", "records", "finished", "document", "named"]

DATA = Path(__file__).resolve().parents[2] / "docs" / "img" / "data"


def read(name: str) -> str:
    path = DATA / name
    if not path.exists():
        raise LookupError(f"record {path} does not exist")
    return path.read_text()


def records(name: str) -> List[dict]:
    """A JSON-lines record's runs."""
    return [json.loads(line) for line in read(name).splitlines() if line.strip()]


def finished(name: str) -> List[dict]:
    """The runs of a record that finished (``status`` ok, or none given)."""
    return [run for run in records(name) if run.get("status", "ok") == "ok"]


def document(name: str) -> dict:
    """A record written as one JSON document (``gpu_check_*.json``)."""
    return json.loads(read(name))


def named(pattern: str) -> List[str]:
    """The names of the records matching a glob ``pattern``, sorted."""
    return sorted(path.name for path in DATA.glob(pattern))
