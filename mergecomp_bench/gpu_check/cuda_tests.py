"""Stage 1: the CUDA tests (``tests/cuda`` of the repository) in a pytest process of their own,
within a time limit; the counts, the failures and the skip reasons are read back from its JUnit
XML (``cuda_tests.xml``), its output kept in ``cuda_tests.log`` (one line per test: a run killed
at its time limit is read from there)."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["run", "wait_or_interrupt", "read_junit", "read_log"]

TESTS = "tests/cuda"
#: seconds of the budget kept for pytest to report after an interrupt (its failures' tracebacks
#: and the JUnit XML of the tests it finished), before it is killed
REPORT_S = 20


def read_junit(path: Path) -> Dict[str, object]:
    """Counts (``tests``, ``passed``, ``failed``, ``errors``, ``skipped``), the ids of the tests
    that failed or erred, and the distinct skip reasons, from a pytest JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failed: List[str] = []
    reasons: List[str] = []
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                failed.append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                failed.append(name)
            elif (skipped := case.find("skipped")) is not None:
                counts["skipped"] += 1
                reason = skipped.get("message", "")
                if reason not in reasons:
                    reasons.append(reason)
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return {**counts, "failing": failed, "skip_reasons": reasons}


def read_log(path: Path) -> Dict[str, object]:
    """What :func:`read_junit` reads, from the per-test lines of ``pytest -v``'s output: for a
    run stopped before it wrote its JUnit XML (the tests it finished; no skip reasons)."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: List[str] = []
    outcomes = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}
    for line in path.read_text(errors="replace").splitlines():
        match = re.match(r"(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)\b", line)
        if match:
            counts["tests"] += 1
            counts[outcomes[match.group(2)]] += 1
            if match.group(2) in ("FAILED", "ERROR"):
                failed.append(match.group(1))
    return {**counts, "failing": failed, "skip_reasons": []}


def run(repo: Path, out: Path, timeout_s: float) -> Dict[str, object]:
    """``python -m pytest tests/cuda`` in ``repo`` (each test limited too where pytest-timeout is
    installed); what :func:`read_junit` reads, the exit code and seconds, or why it gave none.
    At ``timeout_s - REPORT_S`` seconds pytest is interrupted (SIGINT, as Ctrl-C), so that it
    still reports the failures so far and writes its JUnit XML; killed if it has not exited
    ``REPORT_S`` seconds later."""
    xml, log = out / "cuda_tests.xml", out / "cuda_tests.log"
    command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "--durations=15", TESTS, "-p", "no:cacheprovider",
               f"--junitxml={xml}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command.append(f"--timeout={int(timeout_s * 0.8)}")
    began = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=repo, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        code = wait_or_interrupt(process, max(timeout_s - REPORT_S, 1))
    result: Dict[str, object] = {"command": " ".join(command[1:]), "seconds": time.perf_counter() - began,
                                 "exit_code": code, "log": log.name}
    if code is None:
        result["problem"] = f"timed out after {timeout_s:.0f} s"
    if xml.exists():
        result.update(read_junit(xml), junit=xml.name)
    else:
        result.update(read_log(log))
        if code is not None:
            result["problem"] = f"pytest exited with {code} and wrote no JUnit XML (see {log.name})"
    return result


def wait_or_interrupt(process: subprocess.Popen, seconds: float) -> Optional[int]:
    """The exit code of ``process`` (the leader of its own session) if it exits within
    ``seconds``; else None, once its session was interrupted (SIGINT, as Ctrl-C: pytest and the
    workers it spawned) and it exited, or was killed ``REPORT_S`` seconds later."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=REPORT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return None
