"""Micro-benchmark: encode + decode time of every compressor on ResNet-50's gradients,
layer-wise versus merged, against a memcpy of the same bytes.

Run (the full run takes a few minutes on 2 CPU cores)::

    python scripts/bench_compressors.py                        # all registered compressors
    python scripts/bench_compressors.py --json bench.json      # also write the results as JSON
    python scripts/bench_compressors.py --compressors fp16,topk --repeats 3 --threads 2
    python scripts/bench_compressors.py --memory none           # the codecs without their memory

What is timed, per compressor with its default settings and its default error-feedback memory:
one step of the exchange itself (``mergecomp.exchange.exchange.Exchange``) on one rank, for every
group of a plan: its encode, the memory's work and the decode of this rank's payload (the sum
over one rank: no division).  The communicator is a one-rank
``mergecomp.scheduler.probes.Rehearsal``, which answers every collective at once, so only the
codec's and the memory's work (and packing the payload into bytes) is timed.  A compressor with
``rounds > 1`` (PowerSGD) runs every round.  The error-feedback memory (``--memory``: a memory
name, ``none``, or ``default``, each compressor's own) takes part as in training (compensate
before, the residual update after, or the compressor's fused encode); the gradients are then
restored, untimed, before each run, since the exchange writes into them.  As in the pipeline on
CPU, each run is one step of the exchange's :class:`mergecomp.kernels.workspace.Workspace`
(outputs recycled; ``--no-workspace``: fresh allocations).  The gradient set is ResNet-50's 161
tensors (``mergecomp.scheduler.zoo``; 25,557,032 fp32 elements, randn values) in backward order,
cut into:

* ``layerwise``: 161 groups, one tensor each (``shapes=[shape]``);
* ``merged 1/2/4``: 1, 2 and 4 groups of about equal bytes (``mergecomp.exchange.plan.build_plan`` with an
  int spec), each passed its members' shapes.

Each case runs once to warm up (state, allocator), then ``--repeats`` times; the median is
reported (``--stat min``: the fastest run, steadier on a machine shared with other jobs).
The baseline is ``dst.copy_(src)`` of the 25.6 M floats, timed right before every timed run (after
the untimed restore); a row's memcpy is the ``--stat`` of its baseline runs, and its ratios use it.

Prints the machine (CPU model, torch version, threads), then a markdown table: bits per element on
the wire (merged 1, all rounds), the medians (or minima) in ms, the ratios ``merged 1 / memcpy``,
``best merged / memcpy`` and ``layerwise / best merged``, and PASS/FAIL against the targets below
(reported, never asserted).  ``n`` is the number of timed repeats (fewer for very slow cases, see
``--budget``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import torch

import mergecomp
from mergecomp.scheduler import zoo
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import build_plan, layout
from mergecomp.scheduler.probes import Rehearsal

# -- defaults ------------------------------------------------------------------------------------
REPEATS = 5
STAT = "median"
WARMUP = 1
THREADS = 2
MERGED_GROUPS = (1, 2, 4)
#: seconds one case (one compressor, one plan) may take in total; slower cases get fewer repeats
BUDGET_S = 20.0
SEED = 0
#: ResNet-50: 161 parameter tensors, 25,557,032 elements
RESNET50_TENSORS = 161
RESNET50_NUMEL = 25_557_032
#: targets: merged (best of 1/2/4 groups) time, memory included, at most this many times memcpy
ELEMENTWISE = ("fp16", "bf16", "signsgd", "onebit", "terngrad", "qsgd", "efsignsgd", "signum")
SPARSIFIERS = ("topk", "dgc", "randk")
TARGET_X_MEMCPY = {**{name: 2.0 for name in ELEMENTWISE}, **{name: 4.0 for name in SPARSIFIERS}}

# -- arguments -----------------------------------------------------------------------------------
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compressors", default="",
                    help="comma-separated names (default: every registered compressor)")
parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per case")
parser.add_argument("--stat", choices=("median", "min"), default=STAT,
                    help="statistic of the timed runs that is reported")
parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed runs per case (>= 1)")
parser.add_argument("--threads", type=int, default=THREADS, help="torch.set_num_threads")
parser.add_argument("--budget", type=float, default=BUDGET_S,
                    help="seconds per case; a case whose warm-up says it would exceed this gets "
                         "fewer repeats (at least 1)")
parser.add_argument("--json", default=None, help="also write the results to this JSON file")
parser.add_argument("--memory", default="default",
                    help="error-feedback memory around each compressor: a memory name, 'none', or "
                         "'default' for each compressor's default_memory (the default)")
parser.add_argument("--no-workspace", action="store_true",
                    help="allocate every output afresh instead of recycling it step by step as "
                         "the pipeline does on CPU (mergecomp.kernels.workspace)")
args = parser.parse_args()
STATISTICS = {"median": statistics.median, "min": min}

# -- setup ---------------------------------------------------------------------------------------
torch.set_num_threads(args.threads)
torch.manual_seed(SEED)
names = args.compressors.split(",") if args.compressors else mergecomp.compressor_names()

cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
            if line.startswith("model name")), platform.processor() or "unknown CPU")
thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
machine = {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "python": platform.python_version(),
           "THP_MEM_ALLOC_ENABLE": thp, "workspace": not args.no_workspace, "memory": args.memory}
print(f"machine: {cpu}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
      f"{torch.get_num_threads()} threads; python {platform.python_version()}; "
      f"THP_MEM_ALLOC_ENABLE={thp}; workspace {'off' if args.no_workspace else 'on'}; memory {args.memory}")
print("load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))

# glibc serves allocations above its mmap threshold with fresh pages (a page fault per 4 KiB on
# first touch) and raises that threshold, up to 32 MiB, when such a block is freed.  Free one
# block just under the cap first, so every case sees the same allocator whatever ran before it.
torch.empty(30 << 20, dtype=torch.uint8).fill_(0)

shapes = [torch.Size(s) for s in zoo.backward_shapes("resnet50")]
numels = [math.prod(s) for s in shapes]
assert len(shapes) == RESNET50_TENSORS
assert sum(numels) == RESNET50_NUMEL
order = list(range(len(shapes)))
param_names = [f"p{i}" for i in order]
nbytes = [4 * n for n in numels]
grads = torch.randn(RESNET50_NUMEL)  # the backward-ordered gradients, one flat fp32 buffer
work = grads.clone()  # what the groups hold: compensate writes into it

plans = {"layerwise": build_plan("layerwise", order, param_names, nbytes)}
for k in MERGED_GROUPS:
    plans[f"merged{k}"] = build_plan(k, order, param_names, nbytes)
# Each group is a contiguous run of the backward order, hence a contiguous slice of `grads`.
cases = {}
for case, plan in plans.items():
    groups = layout(plan, shapes)
    start = 0
    cases[case] = []
    for g in groups:
        cases[case].append((g, work[start:start + g.numel]))
        start += g.numel
    assert start == RESNET50_NUMEL
print(f"gradients: resnet50, {len(shapes)} tensors, {RESNET50_NUMEL:,} fp32 elements; "
      + ", ".join(f"{case}: {len(groups)} groups" for case, groups in cases.items()))


def run_case(exchange, groups):
    """Exchange every group once (one step); returns the bytes put on the wire over all rounds."""
    calls = exchange.comm.calls
    del calls[:]
    for group, flat in groups:
        exchange.finish(exchange.start(group, flat, finite=True))
    exchange.end_step()
    return sum(call.nbytes for call in calls)


def time_ms(fn, repeats, warmup, budget, setup=None, baseline=None):
    """Wall time of ``fn()`` in ms (``--stat`` of the timed runs), all timed runs (ms), the page
    faults per timed run, the warm-up's result and the baseline's timed runs (ms): ``setup()``,
    when given, runs untimed before each run, then ``baseline()``, when given, timed on its own
    right before ``fn()``, so both see the machine in the same state.  The (last) warm-up run
    decides whether ``repeats`` runs fit in ``budget`` seconds."""
    setup = setup or (lambda: None)
    spent, result = 0.0, None
    for _ in range(max(1, warmup)):
        setup()
        t0 = time.perf_counter()
        result = fn()
        spent = time.perf_counter() - t0
    if spent * repeats > budget:
        repeats = max(1, int(budget // max(spent, 1e-9)))
    times, base, faults = [], [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        setup()
        if baseline is not None:
            t0 = time.perf_counter()
            baseline()
            base.append(1e3 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats
    return STATISTICS[args.stat](times), times, faults, result, base


# -- measurement ---------------------------------------------------------------------------------
dst = torch.empty_like(grads)


def memcpy():
    dst.copy_(grads)


def memcpy_ms():
    return time_ms(memcpy, max(args.repeats, 10), args.warmup, 1e9)[0]


memcpy_start = memcpy_ms()
print(f"memcpy baseline: {memcpy_start:.2f} ms for {RESNET50_NUMEL:,} floats "
      f"({4 * RESNET50_NUMEL / memcpy_start / 1e6:.2f} GB/s read)")

results = []
for name in names:
    compressor = mergecomp.get_compressor(name)
    memory = mergecomp.get_memory(compressor.default_memory if args.memory == "default" else args.memory)
    restore = (lambda: work.copy_(grads)) if memory.feeds_back else None
    exchange = Exchange(compressor, memory, Rehearsal(1, torch.device("cpu")), average=False,
                        recycle=not args.no_workspace)
    # The baseline runs right before every timed run of the compressor, so that the ratios
    # compare numbers taken under the same conditions on a machine shared with other jobs.
    row = {"compressor": name, "memory": memory.name, "settings": {k: repr(v) for k, v in compressor.settings().items()},
           "rounds": compressor.rounds, "ms": {}, "repeats": {}, "runs_ms": {}, "memcpy_runs_ms": {},
           "page_faults": {}}
    for case, groups in cases.items():
        compressor.state.clear()
        memory.state.clear()
        (row["ms"][case], row["runs_ms"][case], row["page_faults"][case], wire,
         row["memcpy_runs_ms"][case]) = time_ms(lambda: run_case(exchange, groups), args.repeats,
                                                args.warmup, args.budget, restore, memcpy)
        row["repeats"][case] = len(row["runs_ms"][case])
        row["bits_per_element" if case == "merged1" else f"bits_{case}"] = 8 * wire / RESNET50_NUMEL
        print(f"  {name:10s} {case:10s} {row['ms'][case]:9.2f} ms  (n={row['repeats'][case]}, "
              f"{row['page_faults'][case]:.0f} page faults per run)", file=sys.stderr, flush=True)
    row["memcpy_ms"] = STATISTICS[args.stat]([t for runs in row["memcpy_runs_ms"].values() for t in runs])
    merged = {k: row["ms"][f"merged{k}"] for k in MERGED_GROUPS}
    best_k = min(merged, key=merged.get)
    row["best_merged"] = best_k
    row["merged1_x_memcpy"] = merged[1] / row["memcpy_ms"]
    row["best_x_memcpy"] = merged[best_k] / row["memcpy_ms"]
    row["layerwise_x_best"] = row["ms"]["layerwise"] / merged[best_k]
    target = TARGET_X_MEMCPY.get(name)
    row["target_x_memcpy"] = target
    row["pass_target"] = None if target is None else row["best_x_memcpy"] <= target
    row["pass_merged_vs_layerwise"] = max(merged.values()) <= row["ms"]["layerwise"]
    results.append(row)

# -- output --------------------------------------------------------------------------------------


def verdict(ok):
    return "-" if ok is None else ("PASS" if ok else "FAIL")


with_memory = args.memory != "none"
header = ["compressor", *(["memory"] if with_memory else []), "bits/elem", "memcpy ms", "layerwise ms"] + [f"merged{k} ms" for k in MERGED_GROUPS] + [
    "merged1/memcpy", "best/memcpy", "layerwise/best", "target", "merged<=target",
    "merged<=layerwise", "n"]
print()
print(f"times: the {args.stat} of the timed runs; memcpy: dst.copy_(src) of the 25,557,032 "
      f"fp32, timed right before each timed run of the row ({memcpy_start:.2f} ms at the start)")
print()
print("| " + " | ".join(header) + " |")
print("|" + "|".join("---" if i <= with_memory else "---:" for i in range(len(header))) + "|")
for row in results:
    ms = row["ms"]
    repeats = sorted(set(row["repeats"].values()))
    cells = [row["compressor"], *([row["memory"]] if with_memory else []), f"{row['bits_per_element']:.3g}", f"{row['memcpy_ms']:.1f}",
             f"{ms['layerwise']:.1f}"]
    cells += [f"{ms[f'merged{k}']:.1f}" + ("*" if k == row["best_merged"] else "")
              for k in MERGED_GROUPS]
    cells += [f"{row['merged1_x_memcpy']:.2f}x", f"{row['best_x_memcpy']:.2f}x",
              f"{row['layerwise_x_best']:.2f}x",
              "-" if row["target_x_memcpy"] is None else f"<= {row['target_x_memcpy']:g}x",
              verdict(row["pass_target"]), verdict(row["pass_merged_vs_layerwise"]),
              "/".join(str(r) for r in repeats)]
    print("| " + " | ".join(cells) + " |")
print()
print("load average (1, 5, 15 min) at end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
print("* = best merged plan. merged<=target: best merged / memcpy within the target; "
      "merged<=layerwise: every merged plan at most the layer-wise time.")

if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "load_average_end": os.getloadavg(), "stat": args.stat,
                   "memcpy_ms_start": memcpy_start, "repeats": args.repeats, "warmup": args.warmup,
                   "numel": RESNET50_NUMEL, "tensors": RESNET50_TENSORS, "results": results},
                  f, indent=2)
    print(f"wrote {args.json}")
