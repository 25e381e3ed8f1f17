"""Where a benchmark record came from, and appending records to a JSON-lines file.

Every record a benchmark appends with :func:`append` carries :func:`provenance`: the command
that made it, the commit it ran (with ``+`` when the tree had changes), the machine and the
date, so that a table rendered from it (:mod:`mergecomp_bench.results`) can be reproduced.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

__all__ = ["machine", "provenance", "append"]

ROOT = Path(__file__).resolve().parents[1]


def machine() -> Dict[str, object]:
    """The CPU's model name, its logical CPUs, torch's and Python's versions."""
    import torch

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def _commit() -> Optional[str]:
    """The repository's HEAD (short), with ``+`` when its tracked files differ from it; None
    outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode:
        return None
    return head.stdout.strip() + ("+" if git("diff", "--quiet", "HEAD").returncode else "")


def provenance() -> Dict[str, object]:
    """``command`` (this process's command line), ``commit``, ``date`` and :func:`machine`."""
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "-", *sys.argv[1:]])
    return {"command": command, "commit": _commit(), "date": datetime.date.today().isoformat(), **machine()}


def append(path: str, record: Dict[str, object], made_by: Dict[str, object]) -> None:
    """``record`` with ``made_by`` (a :func:`provenance`, taken once per run) as one line of
    ``path``; the record's own keys win."""
    with open(path, "a") as f:
        f.write(json.dumps({**made_by, **record}) + "\n")
