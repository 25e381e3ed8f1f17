"""Benchmark tooling, kept apart from the core (unlike the core, it may use ``mergecomp.torch``).

    mergecomp.bench.runner   the throughput benchmark: ``mergecomp bench``, ``python -m mergecomp.bench``
    mergecomp.bench.cluster  a bandwidth-limited multi-host cluster from network namespaces
    mergecomp.bench.models   ResNet-50/18 and GPT-2 small (transformers' classes, from configs) and VGG-16
    mergecomp.bench.zoo      those models' parameter shapes, without torch (also for ``mergecomp plan``)
    mergecomp.bench.gpu_check  the GPU check behind ``scripts/gpu_check.sh`` (CUDA tests, codec and step times)
"""
