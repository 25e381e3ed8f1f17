"""Benchmark tooling: a package of its own beside the library, which it uses (the torch front
end included) and which never imports it.

    mergecomp_bench.runner         the throughput benchmark: ``mergecomp-bench``, ``python -m mergecomp_bench``
    mergecomp_bench.cluster        a bandwidth-limited multi-host cluster from network namespaces
    mergecomp_bench.models         ResNet-50/18 and GPT-2 small (transformers' classes, from configs) and VGG-16
                                   (their parameter shapes without torch: :mod:`mergecomp.scheduler.zoo`)
    mergecomp_bench.host_overhead  our own work per step with no network (``scripts/bench_host_overhead.py``)
    mergecomp_bench.gpu_check      the GPU check behind ``scripts/gpu_check.sh`` (CUDA tests, codec and step times)
"""
