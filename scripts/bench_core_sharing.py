"""Where a worker's training step goes on the core: its own CPU, waiting for the core, blocked.

Each rank trains two copies of one model on one fixed batch, in interleaved rounds: a plain
single-worker SGD step (no exchange), and the same step through ``mergecomp.torch``'s
DistributedOptimizer (``--compressor``, ``--groups``). For forward + backward (where the hooks
encode and start each group's collective, and the step end waits and decodes) and for the
optimizer step apart, it reads the main thread's scheduler statistics
(``/proc/thread-self/schedstat``, Linux) and splits the wall time into

* ``cpu``: the main thread ran;
* ``runq``: it could run but waited for the core (other threads had it: gloo's, the other
  worker's, the kernel's);
* ``blocked``: it slept, waiting on a collective (wall - cpu - runq).

Prints per rank the mean ms per step of each (so the parts add up), for both copies, and the
difference; and the CPU the process's other threads took per step meanwhile, by thread name
(gloo's socket loop ``gloo_tcp_loop``, the threads that run its collectives ``pt_gloo_runloop``).
Run it under the namespace cluster (root) or torchrun::

    python -m mergecomp_bench.cluster --hosts 2 --rate 1gbit -- python scripts/bench_core_sharing.py
"""
import argparse
import glob
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

import mergecomp.torch as mc
from mergecomp_bench.models import build_model, loss

SCHEDSTAT = "/proc/thread-self/schedstat"
TASKS = "/proc/self/task/*"


def thread_times():
    """(seconds this thread ran, seconds it waited on a run queue) so far."""
    try:
        with open(SCHEDSTAT) as f:
            ran, waited, _ = f.read().split()
    except OSError as e:
        raise SystemExit(f"bench_core_sharing: needs {SCHEDSTAT} (Linux with schedstats): {e}")
    return int(ran) / 1e9, int(waited) / 1e9


def other_threads():
    """{thread id: (name, seconds it ran)} of this process's threads other than the caller."""
    me, out = str(threading.get_native_id()), {}
    for task in glob.glob(TASKS):
        if os.path.basename(task) == me:
            continue
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                out[task] = (name, int(f.read().split()[0]) / 1e9)
        except OSError:
            pass  # the thread ended
    return out


def per_name(before, after, steps):
    """ms per step each thread name ran between two :func:`other_threads` snapshots."""
    ms = {}
    for task, (name, ran) in after.items():
        ms[name] = ms.get(name, 0.0) + 1e3 * (ran - before.get(task, (name, 0.0))[1]) / steps
    return ms


def split(start, end):
    """(wall, cpu, runq, blocked) seconds between two (perf_counter, thread_times) stamps."""
    wall = end[0] - start[0]
    cpu, runq = end[1][0] - start[1][0], end[1][1] - start[1][1]
    return wall, cpu, runq, wall - cpu - runq


def stamp():
    return time.perf_counter(), thread_times()


def timed_steps(model, optimizer, data, target, steps):
    """Per step: forward + backward's and the optimizer step's (wall, cpu, runq, blocked)."""
    rows = []
    for _ in range(steps):
        began = stamp()
        optimizer.zero_grad()
        loss(model(data), target).backward()
        backward = stamp()
        optimizer.step()
        rows.append(split(began, backward) + split(backward, stamp()))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--compressor", default="signsgd")
    parser.add_argument("--groups", default="auto", help="merge plan: 'auto' (the scheduler's search first) or an int")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per copy per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    mc.init()  # torch.distributed from the launcher's environment
    rank = dist.get_rank()
    plain, make_batch = build_model(args.model, 1.0, None, 0)
    merged, _ = build_model(args.model, 1.0, None, 0)
    data, target = make_batch(args.batch_size, torch.Generator().manual_seed(1 + rank))
    groups = args.groups if args.groups == "auto" else int(args.groups)
    copies = {
        "single": (plain, torch.optim.SGD(plain.parameters(), lr=0.0, momentum=0.9)),
        "mergecomp": (merged, mc.DistributedOptimizer(torch.optim.SGD(merged.parameters(), lr=0.0, momentum=0.9),
                                                      named_parameters=merged.named_parameters(),
                                                      compression=args.compressor, groups=groups)),
    }
    if groups == "auto":
        optimizer = copies["mergecomp"][1]
        while optimizer.scheduler is None or optimizer.scheduler.phase != "monitor":
            timed_steps(merged, optimizer, data, target, 1)
    rows = {name: [] for name in copies}
    threads = {name: {} for name in copies}
    for _ in range(args.rounds):
        for name, (model, optimizer) in copies.items():
            timed_steps(model, optimizer, data, target, 5)  # settle
            dist.barrier()
            before = other_threads()
            rows[name] += timed_steps(model, optimizer, data, target, args.steps)
            for thread, ms in per_name(before, other_threads(), args.steps * args.rounds).items():
                threads[name][thread] = threads[name].get(thread, 0.0) + ms
    means = {name: [1e3 * statistics.fmean(column) for column in zip(*r)] for name, r in rows.items()}
    lines = []
    for name, m in means.items():
        lines.append(f"rank {rank} {name:9s}: forward+backward wall {m[0]:6.1f} = cpu {m[1]:6.1f} + runq {m[2]:4.1f} "
                     f"+ blocked {m[3]:4.1f} | optimizer step wall {m[4]:5.1f} = cpu {m[5]:5.1f} + runq {m[6]:4.1f} "
                     f"+ blocked {m[7]:4.1f}")
        busy = ", ".join(f"{thread} {ms:.1f}" for thread, ms in sorted(threads[name].items()) if ms >= 0.05)
        lines.append(f"rank {rank} {name:9s}: other threads' cpu {busy or 'none'}")
    d = [a - b for a, b in zip(means["mergecomp"], means["single"])]
    lines.append(f"rank {rank} difference: forward+backward wall {d[0]:+6.1f} = cpu {d[1]:+6.1f} + runq {d[2]:+4.1f} "
                 f"+ blocked {d[3]:+4.1f} | optimizer step wall {d[4]:+5.1f}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        print(f"{args.model}, {args.compressor}, groups={args.groups}; ms per step (mean of "
              f"{args.rounds} x {args.steps} steps)")
        for rank_lines in gathered:
            print("\n".join(rank_lines))
    mc.shutdown()


if __name__ == "__main__":
    main()
