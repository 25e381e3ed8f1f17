"""Stage 2: every compressor's exchange of a model's gradients on the GPU, merged against
layer-wise.

For each gradient set (:mod:`mergecomp.scheduler.zoo`: ResNet-50's 161 tensors, GPT-2 small's 148;
randn values, fp32, on the device) and each registered compressor with its default memory, one
step of the exchange itself (:class:`~mergecomp.exchange.exchange.Exchange`) runs on a one-rank
:class:`~mergecomp.scheduler.probes.Rehearsal` (every collective answered at once): the encode,
the memory's work and the decode of every group, for the plans

* ``layerwise``: one group per tensor;
* ``merged1`` and ``merged4``: 1 and 4 groups of about equal bytes.

The gradients are restored, untimed, before every run (error feedback writes into them); each
plan runs ``warmup`` times, then ``repeats`` timed runs between CUDA events; the median is kept.
``ratio`` is layer-wise over the faster merged plan (the paper's claim: up to 3.83x); the best
ratio reported leaves ``none`` out (merged, it sends the gradients as they are: no work at all).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import mergecomp
from mergecomp.scheduler import zoo
from mergecomp_bench.gpu_check.timing import event_ms
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import Group, build_plan, layout
from mergecomp.scheduler.probes import Rehearsal

__all__ = ["MODELS", "PLANS", "gradient_cases", "time_compressor", "run"]

MODELS = ("resnet50", "gpt2-small")
PLANS = ("layerwise", 1, 4)
REPEATS, WARMUP = 5, 2
#: seconds one plan of one compressor may take; a slower one gets fewer timed runs
CASE_BUDGET_S = 4.0

Cases = Dict[str, List[Tuple[Group, torch.Tensor]]]


def gradient_cases(model: str, work: torch.Tensor) -> Cases:
    """Each plan of :data:`PLANS` over ``model``'s gradients (backward order) laid out in the
    flat ``work``: its groups, each with its slice of ``work``."""
    shapes = [torch.Size(s) for s in zoo.backward_shapes(model)]
    order = list(range(len(shapes)))
    nbytes = [4 * math.prod(s) for s in shapes]
    cases = {}
    for spec in PLANS:
        groups, start = [], 0
        for group in layout(build_plan(spec, order, [f"p{i}" for i in order], nbytes), shapes):
            groups.append((group, work[start:start + group.numel]))
            start += group.numel
        cases["layerwise" if spec == "layerwise" else f"merged{spec}"] = groups
    return cases


def time_compressor(name: str, cases: Cases, grads: torch.Tensor, work: torch.Tensor, repeats: int = REPEATS,
                    warmup: int = WARMUP) -> Dict[str, object]:
    """One compressor (default settings and memory) over every plan of ``cases``: the median ms
    of each plan, bits per element on the wire (merged1), and layer-wise over the best merged."""
    compressor = mergecomp.get_compressor(name)
    memory = mergecomp.get_memory(compressor.default_memory)
    exchange = Exchange(compressor, memory, Rehearsal(1, grads.device), average=False)
    calls = exchange.comm.calls

    def step(groups) -> Callable[[], None]:
        def run() -> None:
            del calls[:]
            for group, flat in groups:
                exchange.finish(exchange.start(group, flat, finite=True))
            exchange.end_step()
        return run

    row: Dict[str, object] = {"compressor": name, "memory": memory.name, "ms": {}, "runs": {}}
    for case, groups in cases.items():
        compressor.state.clear()
        memory.state.clear()
        times = event_ms(step(groups), repeats, warmup, setup=lambda: work.copy_(grads), budget_s=CASE_BUDGET_S)
        row["ms"][case], row["runs"][case] = statistics.median(times), len(times)
        if case == "merged1":
            row["bits_per_element"] = 8 * sum(call.nbytes for call in calls) / grads.numel()
    merged = {case: ms for case, ms in row["ms"].items() if case != "layerwise"}
    row["best_merged"] = min(merged, key=merged.get)
    row["ratio"] = row["ms"]["layerwise"] / merged[row["best_merged"]]
    return row


def run(device: torch.device, budget_s: float, names: Optional[Sequence[str]] = None,
        models: Sequence[str] = MODELS, repeats: int = REPEATS, warmup: int = WARMUP,
        log: Callable[[str], None] = print) -> Dict[str, object]:
    """Every compressor (default: all registered) on every model's gradients, until ``budget_s``
    seconds have passed (the cases not started by then are listed as skipped)."""
    names = list(names or mergecomp.compressor_names())
    began = time.perf_counter()
    result: Dict[str, object] = {"models": {}, "skipped": [], "repeats": repeats, "warmup": warmup}
    for model in models:
        numel = zoo.numel(model)
        torch.manual_seed(0)
        grads = torch.randn(numel, device=device)
        work = torch.empty_like(grads)
        cases = gradient_cases(model, work)
        copy_ms = statistics.median(event_ms(lambda: work.copy_(grads), 10, 2))
        rows = []
        log(f"  {model}: {len(cases['layerwise'])} tensors, {numel:,} fp32 elements; memcpy {copy_ms:.2f} ms")
        for name in names:
            if time.perf_counter() - began > budget_s:
                result["skipped"].append(f"{model}/{name}")
                continue
            row = time_compressor(name, cases, grads, work, repeats, warmup)
            rows.append(row)
            ms = row["ms"]
            log(f"    {name:10s} layerwise {ms['layerwise']:8.2f} ms  merged1 {ms['merged1']:8.2f} ms  "
                f"merged4 {ms['merged4']:8.2f} ms  merged/layer-wise {row['ratio']:5.2f}x")
            torch.cuda.empty_cache()
        result["models"][model] = {"tensors": len(cases["layerwise"]), "numel": numel, "memcpy_ms": copy_ms,
                                   "rows": rows}
        del grads, work, cases
        torch.cuda.empty_cache()
    best = [(row["ratio"], model, row["compressor"]) for model, entry in result["models"].items()
            for row in entry["rows"] if row["compressor"] != "none"]  # none merged does no work at all
    if best:
        ratio, model, name = max(best)
        result["best"] = {"ratio": ratio, "model": model, "compressor": name}
    return result
