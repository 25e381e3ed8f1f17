"""CPU time one worker spends on a step's collectives: gloo's allgather against plain sends.

Each rank repeats one "step" of exchanges: every payload size in ``--bytes`` (default: the
three signSGD groups of ResNet-50's auto plan) allgathered with ``all_gather_single``, started
together and then waited for, as mergecomp starts its groups; and the same bytes moved with
``isend``/``irecv`` to every other rank. Between steps each rank sleeps, so the CPU time counted
(``getrusage`` of the process: the main thread, gloo's threads, and the kernel's network work
done on their behalf) is the exchange's alone. Prints, per rank, CPU ms per step (user, sys)
and wall ms per step for both ways, twice, interleaved.

Run it under the namespace cluster (root) or torchrun::

    python -m mergecomp_bench.cluster --hosts 2 --rate 1gbit -- python scripts/bench_collective_cpu.py
    torchrun --nproc_per_node 2 scripts/bench_collective_cpu.py --bytes 4000000
"""
import argparse
import datetime
import resource
import time

import torch
import torch.distributed as dist

#: the bytes of signSGD's three groups on ResNet-50 (its auto plan at 1 Gbit/s, 2 workers)
SIGNSGD_RESNET50_GROUPS = "1372000,1453000,370000"


def allgather(payloads, rank, size):
    outs = [torch.empty(size * p.numel(), dtype=p.dtype) for p in payloads]
    works = [dist.all_gather_single(out, p, async_op=True) for out, p in zip(outs, payloads)]
    for work in works:
        work.wait()


def sends(payloads, rank, size):
    works = []
    for p in payloads:
        out = torch.empty(size, p.numel(), dtype=p.dtype)
        out[rank].copy_(p)
        for peer in range(size):
            if peer != rank:
                works += [dist.isend(p, peer), dist.irecv(out[peer], peer)]
    for work in works:
        work.wait()


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default=SIGNSGD_RESNET50_GROUPS, help="payload sizes of one step, comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pause", type=float, default=0.03, help="seconds each rank sleeps between steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    payloads = [torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=generator)
                for n in args.bytes.split(",")]
    for name, exchange in (("allgather", allgather), ("isend/irecv", sends)) * 2:
        for _ in range(5):
            exchange(payloads, rank, size)
        dist.barrier()
        (user, system), began = cpu_seconds(), time.perf_counter()
        for _ in range(args.steps):
            exchange(payloads, rank, size)
            time.sleep(args.pause)
        wall = (time.perf_counter() - began) / args.steps - args.pause
        user_after, system_after = cpu_seconds()
        per_step = [(after - before) / args.steps * 1e3 for before, after in ((user, user_after), (system, system_after))]
        print(f"rank {rank} {name:11s}: CPU {sum(per_step):.2f} ms per step (user {per_step[0]:.2f}, "
              f"sys {per_step[1]:.2f}), wall {wall * 1e3:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
