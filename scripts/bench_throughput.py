"""Throughput benchmark, Horovod-synthetic style: samples/s per worker and in total, for a
model, a compressor and merge plans, with PyTorch DDP anchors in the same script (``--mode``).

A thin wrapper: the logic lives in :mod:`mergecomp_bench.runner` (also ``mergecomp-bench``), so
the installed console script and this file take the same options (``--help``).

    # 2 namespace hosts, 1 Gbit/s links (root), ResNet-50 shapes, 32x32 inputs, batch 8, 1 thread
    python scripts/bench_throughput.py --hosts 2 --rate 1gbit --repeats 3 --mode local
    python scripts/bench_throughput.py --hosts 2 --rate 1gbit --repeats 3 --mode ddp
    python scripts/bench_throughput.py --hosts 2 --rate 1gbit --repeats 3 --mode ddp-fp16
    python scripts/bench_throughput.py --hosts 2 --rate 1gbit --repeats 3 --mode ddp-powersgd --powersgd-rank 1
    python scripts/bench_throughput.py --hosts 2 --rate 1gbit --repeats 3 --compressor randk --plan auto,fp32
    # any other launcher
    torchrun --nproc_per_node 2 scripts/bench_throughput.py --compressor topk --plan auto,layerwise,2
"""
import sys

from mergecomp_bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
