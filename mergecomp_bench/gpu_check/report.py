"""The GPU check's verdict line and its summary files (``summary.json``, ``summary.md``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

__all__ = ["verdict", "write", "markdown"]


def _problems(summary: Dict) -> List[str]:
    """What makes the check fail: failed or erring tests, a stage that broke or ran out of time."""
    problems = []
    tests = summary["stages"]["tests"]
    if "problem" in tests:
        problems.append(f"CUDA tests: {tests['problem']}")
    bad = tests.get("failed", 0) + tests.get("errors", 0)
    if bad:
        names = ", ".join(name.rpartition("::")[2] for name in tests["failing"][:3])
        problems.append(f"{bad} of {tests['tests']} CUDA tests failed ({names}{', ...' if bad > 3 else ''})")
    for stage in ("codecs", "training"):
        if "error" in summary["stages"].get(stage, {}):
            problems.append(f"{stage}: {summary['stages'][stage]['error']}")
    for model, entry in summary["stages"].get("training", {}).get("models", {}).items():
        problems += [f"training: {model}/{row['config']}: {row['error']}" for row in entry["rows"] if "error" in row]
    return problems


def _highlights(summary: Dict) -> List[str]:
    """The numbers the verdict line quotes: the best merged/layer-wise ratio, mergecomp's step
    time against plain torch."""
    out = []
    best = summary["stages"].get("codecs", {}).get("best")
    if best:
        out.append(f"merged vs layer-wise up to {best['ratio']:.2f}x ({best['compressor']}, {best['model']})")
    for model, entry in summary["stages"].get("training", {}).get("models", {}).items():
        steps = {row["config"]: row for row in entry["rows"]}
        shown = [f"{label} {steps[label]['x']:.2f}x" for label in ("none", "topk", "onebit momentum")
                 if steps.get(label, {}).get("x") is not None]
        if shown:
            out.append(f"{model} step vs torch: {', '.join(shown)}")
    return out


def verdict(summary: Dict) -> Tuple[str, str]:
    """``(status, line)``: ``"pass"``, ``"fail"`` or ``"no-cuda"``, and the one line printed last."""
    tests = summary["stages"]["tests"]
    problems = _problems(summary)
    if not summary["device"]["cuda"]:
        if problems:
            return "fail", f"gpu_check: FAIL without a CUDA device: {'; '.join(problems)}"
        return "no-cuda", f"gpu_check: no CUDA device: {tests.get('skipped', 0)} tests skipped"
    where = f"on {summary['device']['name']}"
    if problems:
        return "fail", f"gpu_check: FAIL {where}: {'; '.join(problems)}"
    parts = [f"{tests['passed']} CUDA tests passed, {tests['skipped']} skipped", *_highlights(summary),
             f"{summary['seconds']:.0f} s"]
    return "pass", f"gpu_check: PASS {where}: {'; '.join(parts)}"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def _stage_status(stage: Dict) -> List[str]:
    lines = []
    for key in ("skipped_stage", "error"):
        if key in stage:
            lines += [f"{'Skipped' if key == 'skipped_stage' else 'Error'}: {stage[key]}", ""]
    if stage.get("skipped"):
        lines += [f"Not run (time budget): {', '.join(stage['skipped'])}", ""]
    return lines


def markdown(summary: Dict) -> str:
    """``summary`` for people: the device, each stage's result and time, the verdict."""
    device, stages = summary["device"], summary["stages"]
    lines = ["# GPU check", "", f"Device: {device.get('name') or 'no CUDA device'}; torch {device['torch']}"
             f"{'; CUDA ' + str(device['cuda_version']) if device.get('cuda_version') else ''}; "
             f"{device.get('count', 0)} GPU(s).", "", f"**{summary['verdict']}**", ""]
    tests = stages["tests"]
    lines += [f"## Stage 1: CUDA tests ({tests['seconds']:.1f} s, budget {summary['budget_s']['tests']} s)", "",
              f"`{tests['command']}`: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
              f"{tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped.", ""]
    lines += [f"Problem: {tests['problem']}", ""] if "problem" in tests else []
    lines += [f"- failed: `{name}`" for name in tests.get("failing", [])] + ([""] if tests.get("failing") else [])
    lines += [f"- skipped: {reason}" for reason in tests.get("skip_reasons", [])] + [""]
    codecs = stages["codecs"]
    lines += [f"## Stage 2: merged against layer-wise exchange ({codecs.get('seconds', 0):.1f} s, "
              f"budget {summary['budget_s']['codecs']} s)", "", *_stage_status(codecs)]
    for model, entry in codecs.get("models", {}).items():
        lines += [f"{model}: {entry['tensors']} tensors, {entry['numel']:,} fp32 elements, memcpy "
                  f"{entry['memcpy_ms']:.2f} ms; medians of {codecs['repeats']} runs (CUDA events).", ""]
        lines += _table(["compressor", "memory", "bits/elem", "layerwise ms", "merged1 ms", "merged4 ms",
                         "layerwise / best merged"],
                        [[row["compressor"], row["memory"], f"{row['bits_per_element']:.3g}",
                          *(f"{row['ms'][case]:.2f}" for case in ("layerwise", "merged1", "merged4")),
                          f"{row['ratio']:.2f}x"] for row in entry["rows"]])
    training = stages["training"]
    lines += [f"## Stage 3: training step time on one GPU ({training.get('seconds', 0):.1f} s, "
              f"budget {summary['budget_s']['training']} s)", "", *_stage_status(training)]
    for model, entry in training.get("models", {}).items():
        lines += [f"{model}, batch {entry['batch']}: {training['steps']} timed steps after {training['warmup']}.", ""]
        lines += _table(["config", "ms/step", "x torch", "aten ops", "groups", "peak GiB", "loss", "scheduler chose"],
                        [[row["config"], row["error"]] + ["-"] * 6 if "median_ms" not in row else
                         [row["config"], f"{row['median_ms']:.2f}", "-" if row.get("x") is None else f"{row['x']:.2f}x",
                          "-" if row.get("aten_ops") is None else f"{row['aten_ops']:.0f}",
                          "-" if row.get("groups") is None else str(row["groups"]),
                          "-" if row.get("peak_gib") is None else f"{row['peak_gib']:.1f}",
                          f"{row['loss']:.3f}", str(row.get("chosen") or "-")] for row in entry["rows"]])
    lines += [f"Total: {summary['seconds']:.1f} s (budget {sum(summary['budget_s'].values())} s).", ""]
    return "\n".join(lines)


def write(out: Path, summary: Dict) -> Tuple[Path, Path]:
    """``summary.json`` and ``summary.md`` in ``out``."""
    json_path, md_path = out / "summary.json", out / "summary.md"
    json_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    md_path.write_text(markdown(summary))
    return json_path, md_path
