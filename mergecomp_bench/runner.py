"""Throughput benchmark (after Horovod's pytorch_synthetic_benchmark.py): samples/s per worker
and in total, for a model, a compressor and merge plans, against PyTorch DDP anchors.

Every rank trains on one fixed synthetic batch, so the time is compute + exchange only.  The
same code runs under any launcher: ``torchrun``, plain ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` variables, one process, or the built-in namespace cluster (``--hosts``)::

    mergecomp-bench --hosts 2 --rate 1gbit --model resnet50 --compressor topk --plan auto,layerwise,1
    mergecomp-bench --hosts 2 --rate 1gbit --mode ddp                     # DDP fp32, bucket_cap_mb=25
    mergecomp-bench --hosts 2 --rate 1gbit --mode ddp-fp16                # + fp16_compress_hook
    mergecomp-bench --hosts 2 --rate 1gbit --mode ddp-powersgd --powersgd-rank 1
    mergecomp-bench --mode local                                          # one worker, no exchange
    torchrun --nproc_per_node 2 -m mergecomp_bench --compressor dgc --plan auto

Modes: ``mergecomp`` (``mc.DistributedOptimizer``; ``--plan`` takes a comma list of
``auto``, ``layerwise``, an int number of groups, ``default``, ``fp32`` or ``fp16`` (one fused
group sent uncompressed / cast to fp16, whatever the compressor); ``layerwise``, an int or
``default`` with a suffix ``@two-phase``, ``@hierarchical`` or ``@hierarchical-two-phase`` send
their compressed groups by that scheme),
``ddp``, ``ddp-fp16``,
``ddp-powersgd`` (PyTorch's own hooks, ``start_powerSGD_iter=2``), ``ddp-powersgd-serial`` (the
same hook, each bucket's call waiting for the previous bucket's result: on gloo the stock hook can
issue its collectives in different orders on different ranks and abort), ``local`` (the plain
model and optimizer in one process: the single-worker reference of the scaling factor).

Measurement: ``--warmup`` untimed steps; ``auto`` first runs the scheduler's search (its cost in
steps is reported) and freezes its choice; then ``--rounds`` rounds each time ``--steps`` steps of
every plan in turn (1 settle step after each switch), so slow drifts of a shared machine hit
every plan alike.  A plan's step time is the median of its timed steps, max over ranks; its
breakdown (where rank 0's step time goes, ``mergecomp.exchange.breakdown``) averages its timed steps.
Weights are updated with ``--lr`` (default 0: every step does the same work and long runs cannot
diverge; the optimizer step itself still runs).  With ``--hosts`` the run is repeated
``--repeats`` times (each in a fresh cluster) and the median reported; a run that crashes or
exceeds ``--timeout`` is reported as such.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch

from mergecomp.compressor_args import keyword_args
from mergecomp.exchange.breakdown import GROUP_PARTS, PARTS, combine
from mergecomp.horovod_api.allocator import hold_freed_memory
from mergecomp.pipeline.nonfinite import NONFINITE_POLICIES
from mergecomp_bench.records import machine

MODES = ("mergecomp", "ddp", "ddp-fp16", "ddp-powersgd", "ddp-powersgd-serial", "local")

# -- defaults ------------------------------------------------------------------------------------
MODEL = "resnet50"
BATCH_SIZE = 8           # per worker
THREADS = 1              # torch threads per worker
WARMUP = 5               # untimed steps (after the auto search)
STEPS = 5                # timed steps per plan per round
ROUNDS = 2
LR = 0.0
TIMEOUT = 560.0          # seconds per cluster run (the whole run, all ranks)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mergecomp-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--mode", default="mergecomp", choices=MODES)
    p.add_argument("--model", default=MODEL, help="resnet50 | resnet18 | vgg16 | gpt2-small")
    p.add_argument("--width", type=float, default=1.0, help="width multiplier (1 = the real gradient set)")
    p.add_argument("--input-size", type=int, default=None, help="image side (CNNs, default 32) or sequence length (GPT-2, 64)")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--compressor", default="topk")
    p.add_argument("-C", "--compressor-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--memory", default=None, help="error-feedback memory (default: the compressor's)")
    p.add_argument("--nonfinite", default="propagate", choices=NONFINITE_POLICIES,
                   help="the DistributedOptimizer's nonfinite policy ('ignore': no NaN/Inf check or agreement)")
    p.add_argument("--plan", default="auto",
                   help="comma list of: auto, layerwise, <int groups>, default, fp32 (1 fused group, no "
                        "compression), fp16 (1 fused group cast to fp16); layerwise, an int or default with the "
                        "suffix @two-phase, @hierarchical or @hierarchical-two-phase sends its compressed groups "
                        "by that scheme (e.g. default@two-phase)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="ddp-powersgd(-serial): matrix_approximation_rank")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append one JSON record per measured configuration")
    p.add_argument("--label", default="", help="free text stored in the JSON records")
    cluster = p.add_argument_group("namespace cluster (needs root)")
    cluster.add_argument("--hosts", type=int, default=None,
                         help="run on this many network-namespace hosts (mergecomp_bench.cluster)")
    cluster.add_argument("--rate", default="1gbit", help="link rate per host, e.g. 1gbit, 10gbit, none")
    cluster.add_argument("--procs-per-host", type=int, default=1,
                         help="workers per host, sharing its link (ranks numbered host by host)")
    cluster.add_argument("--repeats", type=int, default=1, help="cluster runs; the median is reported")
    cluster.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per cluster run")
    cluster.add_argument("--result", default=None, help=argparse.SUPPRESS)  # worker -> launcher
    return p


#: a fixed plan label ``<plan>@<scheme>`` sends its compressed groups by one of these schemes
SCHEME_SUFFIXES = ("two-phase", "hierarchical", "hierarchical-two-phase")


def _split_scheme(label: str):
    """``(plan label, scheme or None)`` of a ``--plan`` item."""
    base, _, scheme = label.partition("@")
    if scheme and (scheme not in SCHEME_SUFFIXES or base in ("auto", "fp32", "fp16")):
        raise SystemExit(f"mergecomp-bench: '@scheme' is one of {SCHEME_SUFFIXES} after layerwise, an int or "
                         f"default; got {label!r}")
    return base, scheme or None


def _plan_spec(label: str):
    label, _ = _split_scheme(label)
    if label in ("auto", "layerwise", "fp32", "fp16"):
        return label
    if label == "default":
        return None
    try:
        return int(label)
    except ValueError:
        raise SystemExit(f"mergecomp-bench: --plan items must be auto, layerwise, an int, default, fp32 or fp16, "
                         f"the fixed ones optionally with '@scheme'; got {label!r}")


# -- worker --------------------------------------------------------------------------------------

class _Worker:
    """One rank's benchmark: the model, one fixed batch, a train step and a step timer."""

    def __init__(self, args) -> None:
        from mergecomp_bench.models import build_model, loss

        torch.set_num_threads(args.threads)
        torch.set_flush_denormal(True)
        self.args = args
        self.model, make_batch = build_model(args.model, args.width, args.input_size, args.seed)
        self.loss = loss
        self.rank = int(os.environ.get("RANK", "0"))
        gen = torch.Generator().manual_seed(args.seed + 1 + self.rank)
        self.data, self.target = make_batch(args.batch_size, gen)
        self.optimizer = None

    def step(self) -> float:
        began = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss(self.model(self.data), self.target)
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - began


def _sgd(params, lr: float, momentum: float = 0.9):
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def make_optimizer(w: _Worker, args, groups, scheduler=None):
    """``mc.DistributedOptimizer`` around SGD (momentum 0.9, none with the dgc memory, which
    applies momentum itself) for the worker's model; parameters broadcast from rank 0."""
    import mergecomp
    import mergecomp.torch as mc
    from mergecomp.scheduler.online import SchedulerConfig

    mc.init()
    compressor = mergecomp.get_compressor(args.compressor, **keyword_args(args.compressor_arg))
    memory = args.memory or compressor.default_memory
    momentum = 0.0 if memory == "dgc" else 0.9
    w.optimizer = mc.DistributedOptimizer(_sgd(w.model.parameters(), args.lr, momentum),
                                          named_parameters=w.model.named_parameters(), compression=compressor,
                                          memory=memory, groups=groups, scheduler=scheduler or SchedulerConfig(),
                                          nonfinite=args.nonfinite)
    mc.broadcast_parameters(w.model.state_dict(), root_rank=0)
    return w.optimizer


def search_auto(w: _Worker, max_steps: int = 200) -> Dict:
    """Train until the scheduler has chosen (``groups="auto"``), then freeze its choice.
    Returns the schedule report, the steps it took and its wall time."""
    opt = w.optimizer
    began = time.perf_counter()
    steps = 0
    while opt.scheduler is None or opt.scheduler.phase != "monitor":
        w.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"the scheduler did not settle within {max_steps} steps")
    report = opt.schedule_report()
    opt.merged.stop_scheduler()  # measuring other plans must not trigger a retune
    return {"schedule_report": report, "search_steps_total": steps, "search_wall_s": time.perf_counter() - began}


def fixed_plan(opt, label: str):
    """The GroupPlan of a plan label over the optimizer's (final) backward order: ``layerwise``,
    an int, ``default`` (25 MB groups, at most 4), ``fp32``/``fp16`` (one fused group, codec
    ``none``/``fp16``: plain fused allreduce); with a suffix ``@<scheme>`` (e.g.
    ``default@two-phase``) its compressed groups use that scheme."""
    from mergecomp.exchange.plan import GroupPlan

    order = opt.plan.order
    if label in ("fp32", "fp16"):
        return GroupPlan((tuple(order),), ("none" if label == "fp32" else "fp16",))
    spec = _plan_spec(label)
    if spec is None:
        spec = _default_groups(opt.param_groups)
    opt.set_plan(spec)
    scheme = _split_scheme(label)[1]
    if scheme:
        plan = opt.plan
        opt.set_plan(GroupPlan(plan.groups, tuple(scheme if c == "compressed" else c for c in plan.codec_names())))
    return opt.plan


def measure_plans(w: _Worker, plans: Dict[str, object], rounds: int, steps: int,
                  breakdowns: Optional[Dict[str, List[Dict]]] = None) -> Dict[str, List[float]]:
    """Step times of each plan: ``rounds`` rounds over all plans, each plan ``1 + steps`` steps
    per round (the first, after the switch, untimed).  ``breakdowns``: each plan's label gets
    the step breakdown of its timed steps in every round appended."""
    times: Dict[str, List[float]] = {label: [] for label in plans}
    opt = w.optimizer
    opt.breakdown_window = max(opt.breakdown_window, steps)
    for _ in range(rounds):
        for label, plan in plans.items():
            opt.set_plan(plan)
            w.step()
            times[label] += [w.step() for _ in range(steps)]
            if breakdowns is not None:
                breakdowns.setdefault(label, []).append(opt.step_breakdown(steps))
    return times


def describe_plan(plan, sizes: Sequence[int]) -> Dict:
    return {"groups": len(plan), "codecs": list(plan.codec_names()),
            "group_mb": [round(sum(sizes[i] for i in g) / 2**20, 2) for g in plan.groups] if len(plan) <= 8 else None}


def _run_mergecomp(w: _Worker, args) -> List[Dict]:
    labels = [s.strip() for s in args.plan.split(",") if s.strip()]
    for label in labels:
        _plan_spec(label)  # validate before starting
    first = "auto" if "auto" in labels else labels[0]
    initial = _plan_spec(first)
    opt = make_optimizer(w, args, 1 if initial in ("fp32", "fp16") else initial)
    plans, extra = {}, {}
    if first == "auto":
        extra["auto"] = search_auto(w)
        plans["auto"] = opt.plan
    else:
        w.step()  # the first step fixes the backward order
    for _ in range(args.warmup):
        w.step()
    for label in labels:
        if label != "auto":
            plans[label] = fixed_plan(opt, label)
    breakdowns: Dict[str, List[Dict]] = {}
    times = measure_plans(w, plans, args.rounds, args.steps, breakdowns)
    sizes = [p.numel() * p.element_size() for p in w.model.parameters()]
    comm = opt.merged.comm
    records = []
    for label in labels:
        records.append({"plan": label, "step_s": _slowest(comm, statistics.median(times[label])),
                        "steps_s": times[label], **describe_plan(plans[label], sizes),
                        "compressor_repr": repr(opt.compressor), "memory": repr(opt.memory),
                        "nonfinite": opt.merged.nonfinite,
                        "breakdown": combine(breakdowns[label]), **extra.get(label, {})})
    return records


def _default_groups(param_groups) -> int:
    """The DistributedOptimizer's ``groups=None``: about 25 MB per group, at most 4."""
    total = sum(p.numel() * p.element_size() for g in param_groups for p in g["params"])
    return max(1, min(4, math.ceil(total / (25 * 2**20))))


def _slowest(comm, value: float) -> float:
    return float(comm.allgather(torch.tensor([value], dtype=torch.float64), "bench agreement").max())


def one_bucket_at_a_time(hook):
    """DDP comm hook ``hook`` whose call for a bucket first waits for the future it returned for
    the previous bucket of the step, so every rank issues the hook's collectives in one order."""
    previous = []

    def serialized(state, bucket):
        if previous and bucket.index() != 0:  # bucket 0 opens a step: the last one has finished
            previous.pop().wait()
        previous[:] = [hook(state, bucket)]
        return previous[0]

    return serialized


def ddp_with_hook(module, mode: str, powersgd_rank: int = 1, start_powersgd_iter: int = 2):
    """``module`` in DDP (gloo, ``bucket_cap_mb=25``; the process group made from the
    environment) with the hook of ``mode``: ``ddp`` (none), ``ddp-fp16`` (PyTorch's
    ``fp16_compress_hook``), ``ddp-powersgd`` / ``ddp-powersgd-serial`` (``powerSGD_hook``; the
    serial one through :func:`one_bucket_at_a_time`).  Returns (the DDP module, the hook's description)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model = DDP(module, bucket_cap_mb=25)
    hook = "none"
    if mode == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        hook = "fp16_compress_hook"
    elif mode.startswith("ddp-powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=start_powersgd_iter)
        serial = mode.endswith("-serial")
        model.register_comm_hook(state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook) if serial
                                 else powerSGD_hook.powerSGD_hook)
        hook = (f"powerSGD_hook(rank={powersgd_rank}, start_powerSGD_iter={start_powersgd_iter}"
                f"{', serialized' if serial else ''})")
    elif mode != "ddp":
        raise ValueError(f"unknown DDP mode {mode!r}")
    return model, hook


def _run_ddp(w: _Worker, args) -> List[Dict]:
    import torch.distributed as dist

    model, hook = ddp_with_hook(w.model, args.mode, args.powersgd_rank)
    w.optimizer = _sgd(model.parameters(), args.lr)
    w.model = model
    for _ in range(args.warmup + 1):
        w.step()
    times = [w.step() for _ in range(args.steps * args.rounds)]
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [{"plan": "ddp", "hook": hook, "step_s": float(t), "steps_s": times, "bucket_cap_mb": 25}]


def _run_local(w: _Worker, args) -> List[Dict]:
    w.optimizer = _sgd(w.model.parameters(), args.lr)
    for _ in range(args.warmup + 1):
        w.step()
    times = [w.step() for _ in range(args.steps * args.rounds)]
    return [{"plan": "local", "step_s": statistics.median(times), "steps_s": times}]


def run_worker(args) -> List[Dict]:
    """Run the benchmark on this rank; every rank returns the same records.  Every mode runs
    with the malloc settings ``mergecomp.init`` makes (:func:`mergecomp.horovod_api.allocator.hold_freed_memory`),
    so the DDP anchors and the single worker are measured under the same allocator."""
    hold_freed_memory()
    w = _Worker(args)
    runner = {"mergecomp": _run_mergecomp, "ddp": _run_ddp, "ddp-fp16": _run_ddp, "ddp-powersgd": _run_ddp,
              "ddp-powersgd-serial": _run_ddp, "local": _run_local}[args.mode]
    records = runner(w, args)
    world = int(os.environ.get("WORLD_SIZE", "1")) if args.mode != "local" else 1
    for r in records:
        r.update(_common(args, world))
        r["samples_per_s_worker"] = args.batch_size / r["step_s"]
        r["samples_per_s_total"] = r["samples_per_s_worker"] * world
        r["status"] = "ok"
    return records


def _common(args, world: int) -> Dict:
    return {"mode": args.mode, "model": args.model, "width": args.width, "input_size": args.input_size,
            "batch_size": args.batch_size, "threads": args.threads, "world_size": world,
            "compressor": args.compressor if args.mode == "mergecomp" else None,
            "compressor_args": args.compressor_arg, "rate": os.environ.get("MERGECOMP_CLUSTER_RATE", args.rate
                                                                          if args.hosts else "launcher"),
            "lr": args.lr, "label": args.label, "date": datetime.date.today().isoformat(), "loadavg": loadavg(),
            **machine()}


def loadavg() -> Optional[str]:
    """The 1/5/15-minute load average when the record was made (the machine may be shared)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def _print_table(records: List[Dict]) -> None:
    print("| mode | compressor | plan | workers | link | step s | samples/s/worker | samples/s total | status |")
    print("|---|---|---|---:|---|---:|---:|---:|---|")
    for r in records:
        step = f"{r['step_s']:.3f}" if r.get("step_s") else "-"
        per = f"{r['samples_per_s_worker']:.1f}" if r.get("samples_per_s_worker") else "-"
        tot = f"{r['samples_per_s_total']:.1f}" if r.get("samples_per_s_total") else "-"
        name = r.get("compressor") or r.get("hook") or "-"
        print(f"| {r['mode']} | {name} | {r.get('plan', '-')} | {r.get('world_size', '-')} | {r.get('rate', '-')} "
              f"| {step} | {per} | {tot} | {r['status']} |", flush=True)
    _print_breakdowns([r for r in records if r.get("breakdown")])
    for r in records:
        report = r.get("schedule_report")
        if report and report.get("chosen"):
            c = report["chosen"]
            print(f"auto: chose {c['groups']} group(s) {c['codecs']} "
                  f"({', '.join(f'{s / 2**20:.1f}MB' for s in c['sizes'])}), measured {c['measured_s']:.3f}s; "
                  f"search {report['search_steps']} scheduler steps ({r['search_steps_total']} incl. the first)")


def _ms(entry: Dict, parts: Sequence[str]) -> str:
    """``entry``'s ``<part>_s`` for each of ``parts``, in milliseconds, as table cells."""
    return " | ".join(f"{1e3 * entry[part + '_s']:.1f}" for part in parts)


def _print_breakdowns(records: List[Dict]) -> None:
    """Where rank 0's step time goes, per record, then per group."""
    if not records:
        return
    print(f"\nWhere a step's time goes (rank 0, mean ms per step)\n\n| compressor | plan | step | "
          f"{' | '.join(PARTS)} |\n|---|---|{'---:|' * (len(PARTS) + 1)}")
    for r in records:
        print(f"| {r['compressor']} | {r['plan']} | {_ms(r['breakdown'], ['step'])} | {_ms(r['breakdown'], PARTS)} |")
    print(f"\n| compressor | plan | group MB | codec | {' | '.join(GROUP_PARTS)} | passes (by stage) |\n"
          f"|---|---|---:|---|{'---:|' * len(GROUP_PARTS)}---|")
    for r in records:
        for g in r["breakdown"]["groups"]:
            stages = ", ".join(f"{stage} {passes:.3g}" for stage, passes in g["passes_by_stage"].items())
            print(f"| {r['compressor']} | {r['plan']} | {g['bytes'] / 2**20:.1f} | {g['codec']} | "
                  f"{_ms(g, GROUP_PARTS)} | {g['passes']:.3g} ({stages}) |", flush=True)


# -- launcher ------------------------------------------------------------------------------------

def _launch_cluster(args, argv: List[str]) -> List[Dict]:
    from mergecomp_bench.cluster import Cluster, ClusterError, install_signal_handlers

    install_signal_handlers()
    rate = None if str(args.rate).lower() in ("none", "unlimited", "0") else args.rate
    runs: List[List[Dict]] = []
    failures: List[Dict] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            worker = [sys.executable, "-m", "mergecomp_bench", *_strip_launcher_args(argv), "--result", result]
            env = {"MERGECOMP_TIMEOUT": str(int(args.timeout))}
            began = time.perf_counter()
            try:
                with Cluster(args.hosts, rate, procs_per_host=args.procs_per_host) as cluster:
                    codes = cluster.run(worker, timeout=args.timeout, threads=args.threads, env=env)
                    time.sleep(0.2)  # let the output threads drain
                    lines = [line for out in cluster.output for line in out]
            except ClusterError as err:
                raise SystemExit(f"mergecomp-bench: {err}") from None
            wall = time.perf_counter() - began
            if os.path.exists(result):  # rank 0 wrote the agreed numbers: every rank finished measuring
                with open(result) as f:
                    runs.append([{**r, "exit_codes": codes} for r in json.load(f)])
                if any(codes):
                    print(f"# run {repeat + 1}/{args.repeats}: measured, but exit codes {codes} "
                          f"(a rank failed while exiting)", flush=True)
            else:
                status = "timeout" if 124 in codes else "crashed"
                errors = [line.strip() for line in lines if "rror" in line and "hostname" not in line]
                failures.append({**_common(args, args.hosts * args.procs_per_host), "status": status, "exit_codes": codes,
                                 "wall_s": wall, "plan": "ddp" if args.mode.startswith("ddp") else args.plan,
                                 "repeat": repeat, "error": errors[0][:300] if errors else None,
                                 "hook": (f"{args.mode}(rank={args.powersgd_rank})" if args.mode.startswith("ddp-powersgd")
                                          else args.mode if args.mode.startswith("ddp") else None)})
                print(f"# run {repeat + 1}/{args.repeats}: {status} (exit codes {codes}, {wall:.0f}s)", flush=True)
    records = []
    if runs:
        for i, first in enumerate(runs[0]):
            same = [run[i] for run in runs]
            merged = dict(first)
            merged["step_s_runs"] = [r["step_s"] for r in same]
            if "breakdown" in first:
                merged["breakdown"] = combine([r["breakdown"] for r in same])
            merged["step_s"] = statistics.median(merged["step_s_runs"])
            merged["samples_per_s_worker"] = args.batch_size / merged["step_s"]
            merged["samples_per_s_total"] = merged["samples_per_s_worker"] * args.hosts * args.procs_per_host
            merged["repeats_ok"] = len(runs)
            merged["repeats_failed"] = len(failures)
            records.append(merged)
    return records + failures


def _strip_launcher_args(argv: List[str]) -> List[str]:
    """The worker gets the same options minus the launcher's (--hosts, --repeats, --json)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        key = item.split("=", 1)[0]
        if key in ("--hosts", "--repeats", "--json", "--procs-per-host"):
            skip = "=" not in item
            continue
        out.append(item)
    return out


def _leave_group() -> None:
    """Tear the process group down once the records are safe: gloo's teardown has hung a rank
    now and then, which then costs the launcher's grace period instead of the measurement."""
    import torch.distributed as dist

    import mergecomp.torch as mc

    if mc.is_initialized():
        mc.shutdown()
    elif dist.is_available() and dist.is_initialized():  # DDP's: leave together, as mc.shutdown() does
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.hosts:
        records = _launch_cluster(args, argv)
    elif args.result:  # a cluster worker: write the records for the launcher (rank 0)
        records = run_worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.result, "w") as f:
                json.dump(records, f)
        _leave_group()
        return 0
    else:
        records = run_worker(args)
        _leave_group()
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    _print_table(records)
    if args.json:
        with open(args.json, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0 if all(r["status"] == "ok" for r in records) else 1
