"""What exempting small tensors from compression (``min_compress_numel``) costs and saves, on
ResNet-50's gradient shapes (random values) and 2 gloo ranks.  Two tables:

* parts, for each threshold: the tensors below it, the time of the one extra group that sends
  them (:class:`mergecomp.exchange.exchange.Exchange` ``start`` + ``finish`` of their merged buffer with
  the codec ``"exempt"``: NaN/Inf check, allreduce, average; the copies into group buffers are
  left out, as every tensor is copied into some group either way), and per compressor the
  encode + decode time of those tensors merged in one group (``compress`` + ``decompress`` of
  their concatenation; an upper bound of what exempting them saves, since inside a large group
  they cost only their bytes).  Medians of ``--repeats`` runs, max over ranks.
* exchange, unless ``--rounds 0``: the whole exchange (every tensor added to a PlannedStep with
  2 groups, then ``finish``) per compressor and threshold, the thresholds round-robin one step
  each so that a drift of the machine weighs on all alike; median of the rounds, max over ranks.

Run it plainly (it starts the 2 ranks itself)::

    python scripts/bench_exempt.py
    python scripts/bench_exempt.py --compressors topk,qsgd --thresholds 0,1024,16384 --rounds 0
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--compressors", default="topk,qsgd,onebit")
    p.add_argument("--thresholds", default="0,1024,16384,65536")
    p.add_argument("--repeats", type=int, default=50, help="runs of each part")
    p.add_argument("--rounds", type=int, default=20, help="exchange steps per threshold (0: skip)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def median_seconds(run, repeats):
    run()  # untimed: first-use costs
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(args.threads)
    import mergecomp
    import mergecomp.torch as mc
    from mergecomp.scheduler import zoo
    from mergecomp.exchange.exchange import Exchange
    from mergecomp.exchange.plan import EXEMPT, GroupPlan, layout
    from mergecomp.pipeline.options import FrontEnd, StepOptions
    from mergecomp.pipeline.planned import PlannedStep

    mc.init(engine="torch")
    comm = mc.communicator()
    named = list(reversed(zoo.named_shapes(args.model)))  # backward order
    names, shapes = [n for n, _ in named], [torch.Size(s) for _, s in named]
    generator = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=generator) for s in shapes]
    thresholds = [int(t) for t in args.thresholds.split(",")]
    compressors = args.compressors.split(",")

    def slowest(values):
        local = torch.tensor(values, dtype=torch.float64).unsqueeze(0)
        return comm.allgather(local, "bench").max(dim=0).values.tolist()

    parts = []
    for t in thresholds:
        small = [i for i, s in enumerate(shapes) if s.numel() < t]
        row = [0.0] * (1 + len(compressors))
        if small:
            exchange = Exchange.create("none", None, comm)
            group = layout(GroupPlan((tuple(small),)), shapes)[0]
            flat = torch.cat([grads[i].reshape(-1) for i in small])
            buffer = torch.empty_like(flat)
            row[0] = median_seconds(lambda: exchange.finish(exchange.start(group, buffer.copy_(flat), exchange.route(EXEMPT))),
                                    args.repeats)
            for c, name in enumerate(compressors):
                codec = mergecomp.get_compressor(name)
                row[1 + c] = median_seconds(
                    lambda: codec.decompress(*codec.compress(flat.clone(), "g", [shapes[i] for i in small])),
                    args.repeats)
        parts.append((t, len(small), sum(shapes[i].numel() for i in small), slowest(row)))

    exchange = []
    for name in compressors if args.rounds else ():
        steps = {t: PlannedStep(name, None, comm, names, shapes, [torch.float32] * len(names), torch.device("cpu"),
                                StepOptions(groups=2, min_compress_numel=t), FrontEnd(observe_order=False))
                 for t in thresholds}
        times = {t: [] for t in thresholds}
        for r in range(args.warmup + args.rounds):
            for t, step in steps.items():
                began = time.perf_counter()
                for i in step.plan.order:
                    step.add(i, grads[i])
                step.finish()
                if r >= args.warmup:
                    times[t].append(time.perf_counter() - began)
        exchange.append((name, slowest([statistics.median(times[t]) for t in thresholds])))
        del steps
    if rank == 0:
        results.put((parts, exchange))
    mc.shutdown()


def main():
    args = parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load = os.getloadavg()[0]
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    parts, exchange = results.get()
    for p in procs:
        p.join()
    print(f"{args.model}, 2 gloo ranks, {args.threads} thread(s) each; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    compressors = args.compressors.split(",")
    print("\n| min_compress_numel | exempt tensors | exempt elements | extra group ms | "
          + " | ".join(f"{c} encode+decode ms" for c in compressors) + " |")
    print("|---:|---:|---:|---:|" + "---:|" * len(compressors))
    for t, count, elements, row in parts:
        print(f"| {t} | {count} | {elements} | " + " | ".join(f"{1e3 * v:.2f}" for v in row) + " |")
    if exchange:
        thresholds = [t for t, *_ in parts]
        print("\n| compressor | " + " | ".join(f"exchange ms, {t}" for t in thresholds) + " |")
        print("|---|" + "---:|" * len(thresholds))
        for name, row in exchange:
            print(f"| {name} | " + " | ".join(f"{1e3 * v:.1f}" for v in row) + " |")


if __name__ == "__main__":
    main()
