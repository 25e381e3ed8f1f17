"""Elastic training: a Horovod elastic job that loses and regains workers against the same job
uninterrupted (``scripts/bench_elastic.py``)."""
from __future__ import annotations

from mergecomp_bench.results.data import finished
from mergecomp_bench.results.markdown import compressor_name, signed, table

__all__ = ["ELASTIC", "elastic_runs"]

ELASTIC = "elastic_gpt2_4_2_4_workers.jsonl"


def elastic_runs() -> str:
    """Per compressor (its AdamW recipe): the steady run and the 4 -> 2 -> 4 run, the final
    loss of each and the difference, whether every rank's parameters were equal at every sync
    and at the end, and how long the job took to train again after the loss and the addition."""
    runs = finished(ELASTIC)
    steady = {run["config"]: run["final_test_loss"] for run in runs if run["scenario"] == "steady"}
    rows = []
    for run in runs:
        changed = run["scenario"] != "steady"
        rows.append([compressor_name(run["config"]), " -> ".join(map(str, run["worlds"])),
                     f"{run['final_test_loss']:.4f}",
                     signed(100 * (run["final_test_loss"] / steady[run["config"]] - 1)) if changed else "–",
                     "yes" if run["ranks_identical"] else "**no**",
                     f"{run['lose_at']} -> {run['resumed_at']}" if changed else "–",
                     f"{run['kill_to_sync_s']:.1f} / {run['kill_to_step_s']:.1f}" if changed else "–",
                     f"{run['add_to_step_s']:.1f}" if changed else "–", f"{run['wall_s']:.0f}", f"{run['load']:.1f}"])
    header = ["compressor (AdamW, `exchange_momentum_after=\"auto\"`)", "workers", "final loss", "vs uninterrupted",
              "ranks equal at every sync", "lost at step -> resumed at", "loss to sync / to a step (s)",
              "addition to a step (s)", "job (s)", "load"]
    return table(header, ["---", "---", "---:", "---:", "---", "---", "---:", "---:", "---:", "---:"], rows)
