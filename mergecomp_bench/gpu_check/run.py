"""The GPU check, stage by stage, each within its time budget (together 495 s; about 2 minutes
on one H200), then ``summary.json``, ``summary.md`` and one verdict line, printed last.

    python scripts/gpu_check.py [OUT_DIR]      (what ``bash scripts/gpu_check.sh`` runs)

Exit status: 0 when the check passes or there is no CUDA device, 1 when it fails.
"""
from __future__ import annotations

import argparse
import platform
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from mergecomp_bench.gpu_check import codec_times, cuda_tests, report, step_times

__all__ = ["BUDGET_S", "device_info", "main"]

#: seconds each stage may take (on one H200 they took 59, 14 and 33)
BUDGET_S = {"tests": 270, "codecs": 150, "training": 75}
DEFAULT_OUT = "gpu_check_out"


def device_info() -> Dict[str, object]:
    cuda = torch.cuda.is_available()
    return {"cuda": cuda, "count": torch.cuda.device_count() if cuda else 0,
            "name": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
            "cuda_version": torch.version.cuda, "python": platform.python_version()}


def _stage(title: str, work: Callable[[], Dict[str, object]]) -> Dict[str, object]:
    """``work()``'s result with its seconds; an exception becomes the stage's ``error``."""
    print(f"{title}", flush=True)
    began = time.perf_counter()
    try:
        result = work()
    except Exception as err:  # the check reports it and goes on to its verdict
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
    result["seconds"] = result.get("seconds", time.perf_counter() - began)
    print(f"{title}: {result['seconds']:.1f} s", flush=True)
    return result


def main(argv: Optional[List[str]] = None, repo: Optional[Path] = None) -> int:
    parser = argparse.ArgumentParser(description="Check mergecomp on a GPU: CUDA tests, merged vs layer-wise "
                                                 "codec times, training step times; one verdict line last.")
    parser.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = parser.parse_args(argv)
    repo = Path(repo or Path(__file__).resolve().parents[3])
    out = Path(args.out).resolve()  # pytest runs in the repository: an absolute path
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = device_info()
    print(f"gpu_check: {device['name'] or 'no CUDA device'}; torch {device['torch']}, CUDA {device['cuda_version']}; "
          f"output in {out}", flush=True)
    stages: Dict[str, Dict[str, object]] = {}
    stages["tests"] = _stage(f"stage 1: CUDA tests (budget {BUDGET_S['tests']} s)",
                             lambda: cuda_tests.run(repo, out, BUDGET_S["tests"]))
    tests = stages["tests"]
    print(f"  {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('errors', 0)} errors, "
          f"{tests.get('skipped', 0)} skipped" + (f"; {tests['problem']}" if "problem" in tests else ""), flush=True)
    if device["cuda"]:
        gpu = torch.device("cuda", 0)
        stages["codecs"] = _stage(f"stage 2: merged vs layer-wise codec times (budget {BUDGET_S['codecs']} s)",
                                  lambda: codec_times.run(gpu, BUDGET_S["codecs"]))
        stages["training"] = _stage(f"stage 3: training step times (budget {BUDGET_S['training']} s)",
                                    lambda: step_times.run(gpu, BUDGET_S["training"]))
    else:
        stages["codecs"] = {"skipped_stage": "no CUDA device", "seconds": 0.0}
        stages["training"] = {"skipped_stage": "no CUDA device", "seconds": 0.0}
    summary = {"device": device, "budget_s": BUDGET_S, "stages": stages, "seconds": time.perf_counter() - began}
    summary["status"], summary["verdict"] = report.verdict(summary)
    json_path, md_path = report.write(out, summary)
    print(f"wrote {json_path} and {md_path}", flush=True)
    print(summary["verdict"], flush=True)
    return 1 if summary["status"] == "fail" else 0
