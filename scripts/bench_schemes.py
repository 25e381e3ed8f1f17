"""Bytes per rank and exchange time against the number of ranks: the allgather and the two-phase
schemes for the compressors whose payloads cannot be summed.

For each N, N gloo ranks run inside a network namespace of their own (``unshare -n``, so its
loopback carries nothing but their traffic; needs root).  Every rank feeds the same random
gradients with a model's shapes (default ResNet-50) to a :class:`mergecomp.pipeline.planned.PlannedStep`
(``groups=None``: about 25 MB per group) and exchanges them with each compressor, its two
schemes in turn, round after round (one compressor at a time, which bounds the memory).  Reported per configuration: the median exchange time (``add`` every
tensor + ``finish``; max over ranks), and the bytes one rank sent per step, measured as the
namespace loopback's transmitted bytes (TCP/IP headers and gloo's own messages included) over
the timed steps, divided by N.  One JSON record per (N, compressor, scheme) with ``--json``::

    python scripts/bench_schemes.py --ranks 2,3,4,6,8 --json docs/img/data/schemes_bytes_vs_ranks_resnet50_loopback.jsonl
"""
import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

SCHEMES = ("allgather", "two-phase")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,3,4,6,8", help="comma list of world sizes")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--compressors", default="qsgd,onebit,topk")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round")
    p.add_argument("--json", help="append one JSON record per configuration")
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)  # inside the namespace
    return p.parse_args(argv)


def loopback_tx_bytes() -> int:
    """Bytes transmitted on ``lo`` of this network namespace so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _rank(rank, args, port, out):
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(rank), "MERGECOMP_TIMEOUT": "600"})
    torch.set_num_threads(1)
    import mergecomp.torch as mc
    from mergecomp.scheduler.zoo import named_shapes
    from mergecomp.pipeline.options import FrontEnd, StepOptions
    from mergecomp.pipeline.planned import PlannedStep

    mc.init(engine="torch")
    comm = mc.communicator()
    named = named_shapes(args.model)
    names, shapes = [n for n, _ in named], [s for _, s in named]
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=g) for s in shapes]
    def exchange(step):
        for i in reversed(range(len(grads))):
            step.add(i, grads[i])
        step.finish()

    records = []
    for compressor in args.compressors.split(","):
        steps = {s: PlannedStep(compressor, None, comm, names, shapes, [torch.float32] * len(names),
                                torch.device("cpu"), StepOptions(groups=None, scheme=s), FrontEnd(observe_order=False))
                 for s in SCHEMES}
        times = {s: [] for s in SCHEMES}
        sent = {s: 0 for s in SCHEMES}
        for step in steps.values():  # warm-up: buffers, workspace
            exchange(step)
        for _ in range(args.rounds):
            for scheme, step in steps.items():
                dist.barrier()
                before = loopback_tx_bytes()
                for _ in range(args.steps):
                    began = time.perf_counter()
                    exchange(step)
                    times[scheme].append(time.perf_counter() - began)
                dist.barrier()
                sent[scheme] += loopback_tx_bytes() - before
        for scheme in SCHEMES:
            t = torch.tensor([statistics.median(times[scheme])], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            records.append({"ranks": args.world, "model": args.model, "compressor": compressor, "scheme": scheme,
                            "exchange_s": t.item(),
                            "bytes_per_rank": sent[scheme] / (args.rounds * args.steps) / args.world})
        del steps
    if rank == 0:
        out.put(records)
    mc.shutdown()


def run_inside(args):
    """The ranks of one world size (already inside the namespace); prints their records as JSON."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    while True:  # a rank that dies (e.g. out of memory) ends the run instead of hanging it
        try:
            records = out.get(timeout=5)
            break
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"bench_schemes: rank(s) {dead} of {args.world} died "
                                 f"(exit codes {[procs[r].exitcode for r in dead]})")
    for p in procs:
        p.join()
    print(json.dumps(records))


def main(argv=None):
    args = parse_args(argv)
    if args.world:
        return run_inside(args)
    rows = []
    for world in [int(n) for n in args.ranks.split(",")]:
        inner = [sys.executable, os.path.abspath(__file__), "--world", str(world), "--model", args.model,
                 "--compressors", args.compressors, "--rounds", str(args.rounds), "--steps", str(args.steps)]
        command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        records = json.loads(done.stdout.strip().splitlines()[-1])
        load = os.getloadavg()[0]
        for r in records:
            r["loadavg"] = round(load, 2)
            rows.append(r)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
        print(f"{world} ranks done (load {load:.1f})", file=sys.stderr)
    print("| ranks | compressor | scheme | MB sent per rank per step | exchange s |")
    print("|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']} | {r['compressor']} | {r['scheme']} | {r['bytes_per_rank'] / 2**20:.2f} | "
              f"{r['exchange_s']:.3f} |")


if __name__ == "__main__":
    main()
