"""GPU checks (``bash scripts/gpu_check.sh``): each run's verdict and CUDA tests, and its
training steps against plain torch."""
from __future__ import annotations

from typing import Sequence

from mergecomp_bench.results.data import document
from mergecomp_bench.results.markdown import span, table, times

__all__ = ["gpu_runs", "gpu_training"]

_GPU_RUNS = ("gpu_check_h200_torch2.11.json", "gpu_check_h100_torch2.11.json")
#: the rows of :func:`gpu_training`: label, gpu_check's configuration
_GPU_ROWS = (("torch SGD", "torch"), ("mergecomp `none`", "none"), ("mergecomp `fp16`", "fp16"),
             ("mergecomp `topk`", "topk"), ("mergecomp `powersgd`", "powersgd"),
             ("mergecomp `topk`, `groups=\"auto\"`", "topk auto"), ("torch AdamW", "torch adamw"),
             ("mergecomp 1-bit SGD, AdamW's momentum exchanged", "onebit momentum"))


def gpu_runs(records: Sequence[str] = _GPU_RUNS) -> str:
    """Per gpu_check run: the GPU, torch, the verdict, the CUDA tests (passed / failed / skipped of
    those run within the budget) and merging's speed-up of the codec work (layer-wise over the best
    merged plan, the range over compressors and models)."""
    rows = []
    for record in records:
        run = document(record)
        tests = run["stages"]["tests"]
        counts = f"{tests['passed']} / {tests['failed']} / {tests['skipped']}"
        ratios = [row["ratio"] for model in run["stages"]["codecs"]["models"].values() for row in model["rows"]]
        rows.append([run["device"]["name"], run["device"]["torch"], run["status"],
                     counts + (f" ({tests['problem']})" if tests.get("problem") else ""),
                     span(ratios, lambda r: f"{r:.0f}x"), f"`{record}`"])
    header = ["GPU", "torch", "verdict", "CUDA tests passed / failed / skipped", "merged vs layer-wise, codec work",
              "record (`docs/img/data/`)"]
    return table(header, ["---", "---", "---", "---", "---:", "---"], rows)


def gpu_training(records: Sequence[str] = _GPU_RUNS) -> str:
    """Stage 3 of each gpu_check run: ms per training step on one GPU (the local engine, every
    collective the identity) and its ratio to plain torch with the same optimizer, per model."""
    runs = [document(record) for record in records]
    columns = [(run["device"]["name"].replace("NVIDIA ", ""), model, {row["config"]: row for row in rows["rows"]})
               for run in runs for model, rows in run["stages"]["training"]["models"].items()]
    rows = ([label] + [f"{by[config]['ms_per_step']:.1f} ({times(by[config]['x_torch'])})" for _, _, by in columns]
            for label, config in _GPU_ROWS)
    return table(["configuration", *(f"{gpu}, {model}: ms (x torch)" for gpu, model, _ in columns)],
                 ["---"] + ["---:"] * len(columns), rows)
