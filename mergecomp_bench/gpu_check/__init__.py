"""The GPU check: one command that gives a GPU a verdict in minutes (``bash scripts/gpu_check.sh OUT``).

    run           the stages in turn, each within its time budget; ``summary.json``,
                  ``summary.md`` and one verdict line last (:func:`run.main`)
    cuda_tests    stage 1: the CUDA tests (``tests/cuda``), their JUnit result read back
    codec_times   stage 2: every compressor's exchange of ResNet-50's and GPT-2 small's gradients,
                  merged against layer-wise, timed by CUDA events
    step_times    stage 3: training step times on one GPU, plain torch against mergecomp
    timing        CUDA-event timing shared by stages 2 and 3
    report        the summary files and the verdict line

Without a CUDA device stage 1 runs (every CUDA test skips) and the others are skipped: the
verdict says so and the command exits 0, in seconds.
"""
