"""Per-collective cost of the engine this process was launched with (compare launches side by side).

Times ``allreduce`` (fp32, in place) and ``allgather`` (uint8, what compressed payloads use) of a
small (4 KB: latency) and a large (25 MB: throughput) tensor through mergecomp's communicator,
start to end of ``wait()``: the engine's overhead included.  Prints a markdown table on rank 0:
median and p90 over ranks' iterations (the slowest rank counts), and MB/s = bytes / median, where
bytes is the allreduced tensor or the gathered output (each rank contributes bytes / world).

    torchrun --nproc_per_node 2 scripts/bench_engines.py
    mpirun -np 2 python scripts/bench_engines.py                      # as root: --allow-run-as-root
    horovodrun -np 2 --gloo python scripts/bench_engines.py
    horovodrun -np 2 --mpi python scripts/bench_engines.py            # needs the system mpirun first on PATH
"""
import argparse
import statistics
import sys
import time

import torch

import mergecomp.torch as mc

SIZES = {"4 KB": 4 * 2**10, "25 MB": 25 * 2**20}


def engine_description(comm) -> str:
    if comm.engine == "mpi":
        return f"mpi ({comm.library.split(',')[0]}; native fp16 sum: {comm.native_fp16})"
    if comm.engine == "horovod":
        import horovod

        return f"horovod {horovod.__version__} ({comm.controller} controller)"
    if comm.engine == "torch":
        import torch.distributed as dist

        return f"torch {torch.__version__} ({dist.get_backend()})"
    return comm.engine


def time_collective(comm, op: str, nbytes: int, iters: int, warmup: int):
    """Per-iteration seconds on this rank."""
    if op == "allreduce":
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        start = comm.allreduce_async
    else:
        tensor = torch.ones(nbytes // comm.size, dtype=torch.uint8)
        start = comm.allgather_async
    sync = torch.zeros(1)
    times = []
    for i in range(warmup + iters):
        comm.allreduce_(sync, "benchmark barrier")  # start together
        t0 = time.perf_counter()
        start(tensor).wait(f"benchmark {op} of {nbytes} bytes")
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="auto")
    p.add_argument("--iters-small", type=int, default=300)
    p.add_argument("--iters-large", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    comm = mc.init(engine=args.engine)
    if comm.rank == 0:
        print(f"engine: {engine_description(comm)}, world size {comm.size}, threads per worker {args.threads}",
              flush=True)
        print("| engine | collective | size | median | p90 | MB/s |")
        print("|---|---|---|---|---|---|")
    for op in ("allreduce", "allgather"):
        for label, nbytes in SIZES.items():
            small = nbytes < 2**20
            iters = args.iters_small if small else args.iters_large
            times = time_collective(comm, op, nbytes, iters, warmup=max(2, iters // 10))
            times.sort()
            # The slowest rank's median and p90.
            stats = torch.tensor([statistics.median(times), times[int(0.9 * (len(times) - 1))]],
                                 dtype=torch.float64)
            gathered = comm.allgather(stats, "benchmark statistics").view(comm.size, 2)
            median, p90 = gathered.max(dim=0).values.tolist()
            if comm.rank == 0:
                unit, scale = ("us", 1e6) if small else ("ms", 1e3)
                print(f"| {comm.engine} | {op} | {label} | {median * scale:.1f} {unit} | {p90 * scale:.1f} {unit} "
                      f"| {nbytes / median / 1e6:.0f} |", flush=True)
    mc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
