"""Elastic training: jobs that lose (and regain) workers against the same jobs uninterrupted,
under Horovod's elastic API and torchrun's restarts (``scripts/bench_elastic.py``)."""
from __future__ import annotations

from mergecomp_bench.results.data import records
from mergecomp_bench.results.markdown import compressor_name, signed, table

__all__ = ["HOROVOD_ELASTIC", "TORCHRUN_RESTARTS", "elastic_runs"]

HOROVOD_ELASTIC = "elastic_gpt2_4_2_4_workers.jsonl"
TORCHRUN_RESTARTS = "elastic_gpt2_torchrun_4_3_workers.jsonl"


def elastic_runs(record: str = HOROVOD_ELASTIC) -> str:
    """Per compressor (its AdamW recipe): the run on 4 workers throughout and the one whose
    workers changed, the final loss of each and the difference, whether every rank's parameters
    were equal at every sync and at the end, and how long the job took to train again after the
    loss (and the addition).  A run that never trained again after the loss says so."""
    runs = records(record)
    steady = {(run["config"], run.get("seed", 0)): run["final_test_loss"] for run in runs
              if len(run["worlds"]) == 1 and run.get("status", "ok") == "ok"}
    rows = []
    for run in runs:
        label = (f" (`residuals=\"{run['residuals']}\"`)" if "residuals" in run else "") \
            + (" (global batch kept)" if run.get("global_batch") == "kept" else "")
        if run.get("status", "ok") != "ok":
            rows.append([compressor_name(run["config"]), str(run.get("seed", 0)), " -> ".join(map(str, run["worlds"]))
                         + label, "–", "–", "–",
                         f"{run['lose_at']} -> **{run['status']}**", "–", "–", f"{run['wall_s']:.0f}",
                         f"{run['load']:.1f}"])
            continue
        changed = len(run["worlds"]) > 1
        workers = " -> ".join(map(str, run["worlds"])) + (label if changed else "")
        rows.append([compressor_name(run["config"]), str(run.get("seed", 0)), workers,
                     f"{run['final_test_loss']:.4f}",
                     signed(100 * (run["final_test_loss"] / steady[run["config"], run.get("seed", 0)] - 1))
                     if changed else "–",
                     "yes" if run["ranks_identical"] else "**no**",
                     f"{run['lose_at']} -> {run['resumed_at']}" if changed else "–",
                     f"{run['kill_to_sync_s']:.1f} / {run['kill_to_step_s']:.1f}" if changed else "–",
                     f"{run['add_to_step_s']:.1f}" if "add_to_step_s" in run else "–", f"{run['wall_s']:.0f}",
                     f"{run['load']:.1f}"])
    header = ["compressor (AdamW, `exchange_momentum_after=\"auto\"`)", "seed", "workers", "final loss",
              "vs uninterrupted", "ranks equal at every sync", "lost at step -> resumed at",
              "loss to sync / to a step (s)", "addition to a step (s)", "job (s)", "load"]
    return table(header, ["---", "---:", "---", "---:", "---:", "---", "---", "---:", "---:", "---:", "---:"], rows)
