"""Time to accuracy with AdamW on a transformer: validation loss against wall-clock seconds on
the 2-host namespace cluster, for DDP's own exchange and hooks and for mergecomp.

Every configuration trains the same GPT-2 (``bench_adam``'s 4 layers x 256, byte-level, on
CPython's standard-library sources; AdamW, warm-up + cosine LR schedule) from the same seed, one
worker per host, one thread each, the hosts joined by ``--rate`` links (``mergecomp_bench.cluster``;
root).  The clock counts training steps only (batch sampling and the evaluations every 50 steps
are left out).  The target is DDP fp32's final validation loss (mean of its last four
evaluations) plus 1 %; a configuration's time to accuracy is the training time of its first
evaluation at or below it.  Each run also times the same step without any exchange (forward,
backward, AdamW on a copy of the model on one worker), 10 times before training and twice at
every evaluation, so that it shares the run's load (the record's ``compute_s``, the median): the
share of a step above that is time spent on the exchange, mostly waiting on the network.

Configurations: ``ddp`` (DDP, fp32 allreduce, ``bucket_cap_mb=25``), ``ddp-fp16`` (PyTorch's
``fp16_compress_hook``), ``ddp-powersgd[:RANK]`` (PyTorch's ``powerSGD_hook``, serialized per
bucket so it runs on gloo, ``start_powerSGD_iter=--after``), and mergecomp as in ``bench_adam``:
``COMPRESSOR[:args]@MODE`` (``grad``: gradients exchanged; ``momentum/R``:
``exchange_momentum_after=--after``, ``variance_refresh_every=R``; ``^fp16`` or ``^qsgd``: the
warm-up and the refreshes sent as fp16 or 8-bit QSGD), with ``groups=--groups``; ``@auto``:
``exchange_momentum_after="auto"`` with the run's length and LR warm-up.  ``hook:`` before any of
those: the same through mergecomp's DDP communication hook, the momentum exchange driven from
AdamW's step hooks, as the transformers ``Trainer``, Accelerate and Lightning's
``MergecompDDPStrategy`` run it (DDP's buckets are the groups).
``--after`` defaults to each configuration's LR warm-up (5 % of its steps).
``COMPRESSOR[:args]@diloco/H[+MEMORY]``: ``mc.DiLoCo`` around the same AdamW, its pseudo-gradient
sent with that compressor every H steps (``none@diloco/H``: dense DiLoCo), groups as above;
``@averaging/H``: the same with plain SGD at lr 1 as the outer optimizer (the parameters averaged
every H steps, Local SGD).  ``~P~D`` after either: Streaming DiLoCo, P fragments, each exchange in
flight for D inner steps (``fragments``, ``fragment_sync_delay``; ``~P~auto``: chosen by timing the
first round, in the record as ``sync_delay``); ``~P~D~auto``: ``fragment_codecs="auto"`` too (the
codecs chosen in the record as ``fragment_codecs``, each fragment's predictions as ``codec_choices``);
``~auto~D``: ``fragments="auto"`` (the count chosen in the record as ``fragments``, its predictions as
``fragment_choice``).
A suffix ``*F`` stretches that configuration's schedule to F times ``--steps`` (a user who
trains F times longer because each step costs less).

    G=docs/img/data/time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_warmup.jsonl
    python scripts/bench_time_to_accuracy.py --batch 2 --json $G --configs "ddp-fp16,onebit@momentum/64^qsgd"
    python scripts/bench_time_to_accuracy.py --report $G --seed 0 --plot docs/img/time_to_accuracy_gpt2_4x256_batch2_1gbit.png
"""
import argparse
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_convergence import StdlibBytes, compressor_of, memory_of  # noqa: E402
from bench_adam import (CONTEXT, DECAY, LR, bits_over_run, exchange_options, lr_warmup, make_model,  # noqa: E402
                        parse_config, random_windows, rank_data, schedule, wrap_adamw)
from mergecomp_bench.results import TARGET, time_to  # noqa: E402

BASELINE = "ddp"
CONFIGS = "ddp-fp16,ddp-powersgd,none@grad,onebit@momentum/64,efsignsgd@momentum/64"
EVAL_EVERY, EVAL_WINDOWS = 50, 128

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--configs", default=CONFIGS, help=f"comma list; {BASELINE} always runs first")
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--batch", type=int, default=4, help="windows of 64 bytes per worker and step")
parser.add_argument("--after", type=int, default=None,
                    help="exchange_momentum_after and PowerSGD's start_powerSGD_iter; default: the configuration's "
                         "LR warm-up (5 %% of its steps)")
parser.add_argument("--lr-warmup", type=int, default=None, help="LR warm-up updates; default: 5 %% of the steps")
parser.add_argument("--stop", type=int, default=None,
                    help="train only each configuration's first STOP updates (its schedule unchanged): early training")
parser.add_argument("--groups", default="auto", help="mergecomp's groups= ('auto' or a number of groups)")
parser.add_argument("--seed", type=int, default=0, help="the seed to run, or (--report) to report")
parser.add_argument("--hosts", type=int, default=2)
parser.add_argument("--rate", default="1gbit", help="each host's link (tc tbf), or 'loopback'")
parser.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
parser.add_argument("--json", default=None, help="append one JSON record (with its curve) per configuration")
parser.add_argument("--no-baseline", action="store_true",
                    help=f"do not run {BASELINE} first (its losses do not depend on the link: --report takes the "
                         f"target from its record at another rate)")
parser.add_argument("--report", default=None, help="print the table from the records of earlier --json runs")
parser.add_argument("--plot", default=None, help="with --report: save validation loss against seconds here")
parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one configuration on this rank
parser.add_argument("--out", default=None, help=argparse.SUPPRESS)


class StepAlone:
    """One worker's step, nothing exchanged: forward, backward and AdamW on a copy of the model,
    timed at the start (:meth:`time`) and again at every evaluation, so that its median shares the
    load of the whole run (and of a DiLoCo exchange in flight) with the run's own steps."""

    def __init__(self, model, train, batch):
        self.model = copy.deepcopy(model)
        self.adamw = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=DECAY)
        self.generator = torch.Generator().manual_seed(12345)
        self.train, self.batch = train, batch
        self.times = []
        self.time(2, keep=False)  # first steps: allocations

    def time(self, repeats, keep=True):
        """Take ``repeats`` steps, their seconds kept unless ``keep`` is False."""
        for _ in range(repeats):
            windows = random_windows(self.train, self.generator, self.batch)
            began = time.perf_counter()
            self.adamw.zero_grad()
            self.model(input_ids=windows, labels=windows).loss.backward()
            self.adamw.step()
            if keep:
                self.times.append(time.perf_counter() - began)

    def median(self):
        return statistics.median(self.times)


def wrap_ddp(model, config, steps, after, warm):
    """``model`` in DDP with the hook ``config`` names, and AdamW: (module to call, optimizer, scheduler)."""
    from mergecomp_bench.runner import ddp_with_hook

    mode, _, rank = config.partition(":")
    mode = "ddp-powersgd-serial" if mode == "ddp-powersgd" else mode  # the stock hook aborts on gloo
    ddp, _ = ddp_with_hook(model, mode, int(rank or 1), max(2, after))
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=DECAY)
    return ddp, adamw, torch.optim.lr_scheduler.LambdaLR(adamw, schedule(steps, warm))


def wrap_hook(model, config, steps, after, warm):
    """``model`` in DDP (gloo, ``bucket_cap_mb=25``, ``gradient_as_bucket_view=True`` as the
    integrations build it) with mergecomp's communication hook for
    ``config`` (:func:`bench_adam.exchange_options`, as ``DistributedOptimizer`` gets it), and
    AdamW, whose momentum the hook exchanges: (module to call, optimizer, scheduler, the hook's
    state)."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import mergecomp.torch as mc
    from mergecomp.torch.integrations._hook import BUCKET_VIEWS

    compression, options, _, _ = exchange_options(config, steps, after, warm)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ddp = DistributedDataParallel(model, bucket_cap_mb=25, **BUCKET_VIEWS)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=DECAY)
    state, hook = mc.ddp_comm_hook(compression, named_parameters=model.named_parameters(), optimizer=adamw, **options)
    ddp.register_comm_hook(state, hook)
    return ddp, adamw, torch.optim.lr_scheduler.LambdaLR(adamw, schedule(steps, warm)), state


def wrap_diloco(model, config, steps, warm, groups):
    """AdamW with the LR schedule, and ``mc.DiLoCo`` around it as ``config``
    (``COMPRESSOR[:args]@diloco/H[+MEMORY][~P[~D[~auto]]]``, D an int or ``auto``) says: (optimizer, scheduler, the DiLoCo,
    bits per element per step)."""
    import mergecomp
    import mergecomp.torch as mc

    config, *streaming = config.split("~")
    fragments, delay, codecs = [x if x == "auto" else int(x) for x in streaming] + [1, 0, None][len(streaming):]
    spec, mode, memory, sync_every, _ = parse_config(config)
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    outer = mc.averaging if mode == "averaging" else None
    searched = {} if codecs and groups == "auto" else {"groups": groups}  # fragment_codecs: 1 group a fragment
    diloco = mc.DiLoCo(model.named_parameters(), adamw, sync_every=sync_every, compression=compressor_of(spec),
                       memory=memory_of(memory) if memory else None, outer_optimizer=outer, **searched,
                       fragments=fragments, fragment_sync_delay=delay, fragment_codecs=codecs)
    shapes = [p.shape for p in model.parameters()]
    bits = mergecomp.bits_per_element(diloco.compressor, sum(s.numel() for s in shapes), shapes=shapes) / sync_every
    return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, schedule(steps, warm)), diloco, bits


def worker(args):
    """One configuration on this rank (the cluster's RANK, WORLD_SIZE, MASTER_ADDR...); rank 0
    writes the record to ``--out``."""
    import mergecomp.torch as mc

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config, _, factor = args.worker.partition("*")
    steps = round(args.steps * float(factor or 1))
    trained_steps = min(steps, args.stop or steps)  # the schedule is `steps` long either way
    warm = args.lr_warmup or lr_warmup(steps)
    after = args.after or warm
    train, held_out = rank_data(rank, world, EVAL_WINDOWS)
    torch.manual_seed(args.seed)
    model = make_model()
    alone = StepAlone(model, train, args.batch)
    alone.time(10)
    bits = hook = diloco = wrapped = None  # wrapped: a DistributedOptimizer
    if config.startswith(("ddp", "hook:")):
        import torch.distributed as dist

        if config.startswith("hook:"):
            net, opt, lr_schedule, hook = wrap_hook(model, config[len("hook:"):], steps, after, warm)
        else:
            net, opt, lr_schedule = wrap_ddp(model, config, steps, after, warm)
        finish = dist.destroy_process_group
    elif "@diloco/" in config or "@averaging/" in config:
        mc.init(engine="torch")
        groups = int(args.groups) if args.groups.isdigit() else args.groups
        opt, lr_schedule, diloco, bits = wrap_diloco(model, config, steps, warm, groups)
        net = model

        def finish():
            diloco.close()
            mc.shutdown()
    else:
        mc.init(engine="torch")
        groups = int(args.groups) if args.groups.isdigit() else args.groups
        opt, lr_schedule, _ = wrap_adamw(model, config, steps, after, groups=groups, warm=warm)
        wrapped = opt
        mc.broadcast_parameters(model.state_dict(), root_rank=0)
        net = model

        def finish():
            opt.remove_hooks()
            mc.shutdown()
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    curve, times, trained = [], [], 0.0
    for step in range(1, trained_steps + 1):
        windows = random_windows(train, generator, args.batch)
        began = time.perf_counter()
        opt.zero_grad()
        net(input_ids=windows, labels=windows).loss.backward()
        opt.step()
        lr_schedule.step()
        times.append(time.perf_counter() - began)
        trained += times[-1]
        if step % EVAL_EVERY == 0 or step == trained_steps:
            with torch.no_grad():
                loss = model(input_ids=held_out, labels=held_out).loss.item()
            curve.append({"step": step, "seconds": trained, "test_loss": loss})
            alone.time(2)
    if hook is not None:  # bound by the first step
        momentum = hook.momentum
        bits = bits_over_run(hook.merged, [p.shape for p in model.parameters()], trained_steps,
                             None if momentum is None else momentum.exchange)
    elif wrapped is not None:
        bits = bits_over_run(wrapped.merged, [p.shape for group in wrapped.param_groups for p in group["params"]],
                             trained_steps, wrapped.momentum_exchange)
    finish()
    if diloco is not None and diloco.fragment_codecs is not None:  # the codecs chosen, from the second round on
        sizes = [sum(diloco.params[i].numel() for i in f.indices) for f in diloco.fragments]
        bits = sum(n * c["bits"] for n, c in zip(sizes, diloco.codec_choices)) / sum(sizes) / diloco.sync_every
    if rank == 0:
        record = {"config": args.worker, "steps": steps, "seed": args.seed, "batch": args.batch, "world": world,
                  "groups": None if config.startswith("ddp") else args.groups,
                  "after": after, "lr_warmup": warm, "stop": args.stop, "bits_per_element": bits,
                  "step_s": statistics.median(times),
                  "compute_s": alone.median(), "compute_samples": len(alone.times), "train_s": trained,
                  "final_test_loss": StdlibBytes.final_loss(curve), "curve": curve,
                  **({} if diloco is None else {"fragments": len(diloco.fragments), "sync_delay": diloco.sync_delay,
                                                 "fragment_choice": diloco.fragment_choice,
                                                 "fragment_codecs": diloco.fragment_codecs,
                                                 "codec_choices": diloco.codec_choices}),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        with open(args.out, "w") as f:
            json.dump(record, f)


def run_cluster(args, configs, command_of, timeout):
    """Every configuration in turn on one cluster of ``args.hosts`` hosts at ``args.rate``, each
    worker started as ``command_of(config, out)`` (rank 0 writes its JSON record to ``out``); yields
    each record (``status`` says how it ended) with the rate and the load before and after."""
    from mergecomp_bench.cluster import Cluster, install_signal_handlers
    from mergecomp_bench.runner import loadavg

    install_signal_handlers()
    with Cluster(args.hosts, None if args.rate in ("none", "unlimited") else args.rate) as cluster, \
            tempfile.TemporaryDirectory() as scratch:
        for config in configs:
            out = os.path.join(scratch, "record.json")
            load = loadavg()
            codes = cluster.run(command_of(config, out), timeout=timeout, threads=1)
            if any(codes) or not os.path.exists(out):
                record = {"config": config, "status": f"exit codes {codes}"}
            else:
                with open(out) as f:
                    record = {**json.load(f), "status": "ok"}
                os.remove(out)
            yield {**record, "rate": args.rate, "load_before": load, "load_after": loadavg()}


def worker_command(args):
    """``command_of`` for :func:`run_cluster`: this script as one configuration's worker."""
    options = [(f"--{name.replace('_', '-')}", str(value)) for name, value in
               (("after", args.after), ("lr_warmup", args.lr_warmup), ("stop", args.stop)) if value]
    return lambda config, out: [sys.executable, os.path.abspath(__file__), "--worker", config, "--out", out,
                                "--steps", str(args.steps), "--batch", str(args.batch), "--groups", args.groups,
                                "--seed", str(args.seed), *(x for option in options for x in option)]


def report(records):
    base = next((r for r in records if r["config"] == BASELINE and r["status"] == "ok"), None)
    if base is None:
        sys.exit(f"no finished {BASELINE} record among these (its final loss sets the target)")
    target = base["final_test_loss"] * (1 + TARGET)
    base_time = time_to(base, target)
    fp16 = next((r for r in records if r["config"] == "ddp-fp16" and r["status"] == "ok"), None)
    fp16_time = fp16 and time_to(fp16, target)
    print(f"GPT-2 4x256 on stdlib bytes, AdamW, {base['world']} workers x batch {base['batch']} x {CONTEXT} bytes, "
          f"{base['steps']} steps, {base['rate']} links, seed {base['seed']}; target: DDP fp32's final validation "
          f"loss {base['final_test_loss']:.4f} + 1 % = {target:.4f}\n")
    print("| configuration | steps | step (s) | exchange share of the step | bits per element (run) | validation loss "
          "| vs DDP fp32 | time to target (s) | vs DDP fp32 | vs DDP fp16 hook | peak RSS MB (rank 0) | load before/after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if r["status"] != "ok":
            print(f"| {r['config']} | {r['status']} |" + " |" * 10)
            continue
        reached = time_to(r, target)
        bits = "32" if r["config"] == "ddp" else "16" if r["config"] == "ddp-fp16" else \
            "-" if r["bits_per_element"] is None else f"{r['bits_per_element']:.2f}"
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"  # records from before it was measured
        speed = lambda ref: "-" if reached is None or ref is None else f"{ref / reached:.2f}x"  # noqa: E731
        print(f"| {r['config']} | {r['steps']} | {r['step_s']:.3f} | {1 - r['compute_s'] / r['step_s']:.0%} | {bits} | "
              f"{r['final_test_loss']:.4f} | {100 * (r['final_test_loss'] / base['final_test_loss'] - 1):+.2f} % | "
              f"{'not reached' if reached is None else f'{reached:.0f}'} | {speed(base_time)} | {speed(fp16_time)} | "
              f"{rss} | {r['load_before']} / {r['load_after']} |")
    return target


def label(record):
    """A record's configuration for people: ``onebit@momentum/64*1.25`` -> ``mergecomp onebit,
    momentum exchanged (R=64), 1.25x the steps``, with its ``groups=`` for lossless mergecomp."""
    config, _, factor = record["config"].partition("*")
    names = {"ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook", "ddp-powersgd": "DDP + PowerSGD hook (rank 1)"}
    route = " through the DDP hook" if config.startswith("hook:") else ""
    config = config[len("hook:"):] if route else config
    if config in names:
        name = names[config]
    else:
        spec, mode, _, refresh, warmup_codec = parse_config(config)
        name = (f"mergecomp {spec}{route}" + (f" (lossless), groups={record.get('groups') or 'auto'}" if spec == "none" else "")
                + (f", momentum exchanged (R={refresh})" if mode == "momentum" else "")
                + (f", momentum exchanged as increments (R={refresh})" if mode == "increment" else "")
                + (", momentum exchanged (\"auto\")" if mode == "auto" else "")
                + (f", {warmup_codec} warm-up" if warmup_codec else ""))
    return name + (f", {factor}x the steps" if factor else "")


def plot(records, target, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    done = [r for r in records if r["status"] == "ok"]
    for r in done:
        ax.plot([p["seconds"] for p in r["curve"]], [p["test_loss"] for p in r["curve"]], label=label(r))
    ax.axhline(target, color="grey", linestyle=":", label="target: DDP fp32's final loss + 1 %")
    ax.set_ylim(min(p["test_loss"] for r in done for p in r["curve"]) * 0.99, target * 1.35)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss")
    base = records[0]
    ax.set_title(f"GPT-2 4x256 with AdamW, {base['world']} hosts joined by {base['rate']} links "
                 f"(gloo, 1 CPU thread each)", fontsize=9)
    ax.legend(fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.report:
        records = [r for path in args.report.split(",") for r in map(json.loads, open(path)) if r["seed"] == args.seed]
        target = report(records)
        if args.plot:
            plot(records, target, args.plot)
        return
    configs = [] if args.no_baseline else [BASELINE]
    configs += [c for c in args.configs.split(",") if c and c not in configs]
    records = []
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    for record in run_cluster(args, configs, worker_command(args), args.timeout):
        record.setdefault("seed", args.seed)
        records.append(record)
        if args.json:
            append(args.json, record, made_by)
        shown = f"{record['final_test_loss']:.4f} in {record['train_s']:.0f} s" if record["status"] == "ok" \
            else record["status"]
        print(f"# {record['config']}: {shown}", file=sys.stderr, flush=True)
    if not args.no_baseline:
        report(records)


if __name__ == "__main__":
    main()
