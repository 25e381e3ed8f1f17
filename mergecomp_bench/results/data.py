"""The benchmark records in ``docs/img/data``, read by name: a missing record raises
(``LookupError``) instead of rendering a blank; and where each came from (:func:`provenance`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

__all__ = ["DATA", "INDEX", "read", "records", "finished", "document", "named", "provenance_index", "provenance"]

DATA = Path(__file__).resolve().parents[2] / "docs" / "img" / "data"
#: The provenance of the records whose rows do not carry their own (found in git), by record name.
INDEX = "provenance.json"
#: What :func:`mergecomp_bench.records.provenance` writes into every row of a new record.
_MADE_BY = ("command", "commit", "date", "cpu", "cpus", "torch", "python")


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


def provenance_index() -> Dict[str, dict]:
    """``docs/img/data/provenance.json``'s entries by record name (``command``, ``recorded_in``,
    ``machine``, ``note``), without its ``about``."""
    return {name: entry for name, entry in json.loads(read(INDEX)).items() if name != "about"}


def provenance(record: str) -> dict:
    """Where ``record`` came from.

    When every row (or the one document) carries ``command`` and ``commit``, as
    :func:`mergecomp_bench.records.append` writes them: ``{"source": "rows", "runs": [...]}``, each
    distinct ``command``/``commit``/``date``/machine of its rows, in their order. Otherwise its entry
    in :data:`INDEX`, with ``"source": "index"`` (``command`` may be None where none was found: its
    ``note`` says so). ``LookupError`` when the record does not exist, ``KeyError`` naming it when
    it has neither.
    """
    if not (DATA / record).exists():
        raise LookupError(f"record {DATA / record} does not exist")
    if record.endswith(".jsonl"):
        rows = records(record)
    elif record.endswith(".json") and isinstance(document(record), dict):
        rows = [document(record)]
    else:
        rows = []
    if rows and all(row.get("command") and row.get("commit") for row in rows):
        runs: List[dict] = []
        for row in rows:
            run = {key: row[key] for key in _MADE_BY if key in row}
            if run not in runs:
                runs.append(run)
        return {"source": "rows", "runs": runs}
    entry = provenance_index().get(record)
    if entry is None:
        raise KeyError(f"{record}: its rows carry no command and commit, and {INDEX} has no entry for it")
    return {"source": "index", **entry}
