"""FSDP2 with a compressed reduce-scatter and parameter all-gather (``scripts/bench_fsdp.py``):
step time at 1 Gbit/s, bytes per rank, accuracy with AdamW."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from mergecomp_bench.results.data import finished
from mergecomp_bench.results.markdown import signed, table, times

__all__ = ["STEP", "ACCURACY", "BASELINES", "runs", "speed_up", "fsdp2_step", "fsdp2_bytes", "fsdp2_accuracy"]

STEP = "fsdp2_step_time_gpt2_4x256_1gbit_2hosts_int8_all_gather.jsonl"
_BF16_PARAMS = "fsdp2_step_time_gpt2_4x256_1gbit_2hosts_bf16_params_int8_all_gather.jsonl"
ACCURACY = "fsdp2_adamw_convergence_gpt2_4x256_2workers.jsonl"
#: FSDP2's own reductions, as the tables name them
BASELINES = {"fsdp": "FSDP2, fp32", "fsdp-bf16": "FSDP2, bf16 `reduce_dtype`",
             "fsdp-a2a": "FSDP2, fp32 at NCCL's bytes", "fsdp-bf16-a2a": "FSDP2, bf16 at NCCL's bytes"}


def _parts(config: str) -> Tuple[str, str]:
    """(reduce-scatter, parameter all-gather) of a bench_fsdp.py configuration."""
    reduce_scatter, _, all_gather = config.partition("@")
    return BASELINES.get(reduce_scatter, f"`{reduce_scatter}`"), all_gather or "FSDP2's"


def runs(record: str, batch: Optional[int] = None) -> List[Dict[str, dict]]:
    """A bench_fsdp.py record as its runs (each starts with FSDP2 fp32, ``fsdp``), by configuration;
    ``batch``: only the runs of that batch."""
    found: List[Dict[str, dict]] = []
    for row in finished(record):
        if row["config"] == "fsdp" or not found:
            found.append({})
        found[-1][row["config"]] = row
    return [run for run in found if batch is None or run["fsdp"].get("batch") == batch]


def speed_up(measured: List[Dict[str, dict]], config: str, base: str) -> Optional[float]:
    """The median over the runs holding both of ``base``'s step over ``config``'s."""
    ratios = [run[base]["step_s"] / run[config]["step_s"] for run in measured if config in run and base in run]
    return statistics.median(ratios) if ratios else None


def fsdp2_step(record: str = STEP, bf16_params: str = _BF16_PARAMS, batch: int = 2) -> str:
    """FSDP2's step at 1 Gbit/s per reduce-scatter and parameter all-gather: the median step over the
    runs of ``batch``, the speed-up over FSDP2's fp32 and bf16 reductions (medians of the runs'
    ratios), over reduce-scatters sending NCCL's bytes (the runs that have them) and, with bf16
    parameters, over fp32 / bf16 (its own record); bytes sent per step and parameter; MB of
    error-feedback memory per rank."""
    measured, with_bf16_params = runs(record, batch), runs(bf16_params, batch)

    def speed_ups(source: List[Dict[str, dict]], config: str, bases: Sequence[str]) -> str:
        ratios = [speed_up(source, config, base) for base in bases]
        return " / ".join("–" if r is None else times(r) for r in ratios)

    rows = []
    for config in dict.fromkeys(c for run in measured for c in run):
        of_config = [run[config] for run in measured if config in run]
        reduce_scatter, all_gather = _parts(config)
        rows.append([reduce_scatter, all_gather, f"{statistics.median(r['step_s'] for r in of_config):.3f}",
                     speed_ups(measured, config, ("fsdp", "fsdp-bf16")),
                     speed_ups(measured, config, ("fsdp-a2a", "fsdp-bf16-a2a")),
                     speed_ups(with_bf16_params, config, ("fsdp", "fsdp-bf16")),
                     f"{statistics.median(statistics.mean(r['sent_bytes_per_param']) for r in of_config):.2f}",
                     f"{max(max(r['memory_mb']) for r in of_config):.1f}"])
    header = ["reduce-scatter", "all-gather", f"step s (batch {batch}, median of {len(measured)} runs)",
              "vs FSDP2 fp32 / bf16", "vs fp32 / bf16 at NCCL's bytes", "bf16 parameters: vs fp32 / bf16",
              "bytes per step and parameter", "memory MB"]
    return table(header, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


def fsdp2_bytes(record: str = "fsdp2_bytes_per_rank_gpt2_4x256_2_4_8_hosts.jsonl") -> str:
    """Bytes each rank sent per step and parameter (headers included) per reduce-scatter,
    all-gather and number of ranks."""
    by = {(row["config"], row["world"]): statistics.mean(row["sent_bytes_per_param"]) for row in finished(record)}
    worlds = sorted({world for _, world in by})
    rows = (list(_parts(config)) + [f"{by[(config, w)]:.2f}" if (config, w) in by else "–" for w in worlds]
            for config in dict.fromkeys(config for config, _ in by))
    return table(["reduce-scatter", "all-gather", *(f"{w} ranks" for w in worlds)],
                 ["---", "---", *["---:"] * len(worlds)], rows)


#: the configurations of :func:`fsdp2_accuracy`, in its order
_ACCURACY_ROWS = ("fsdp", "fsdp-bf16", "none@int8", "qsgd@int8", "qsgd:levels=7", "qsgd:levels=7@int8",
                  "qsgd:levels=7+residual", "topk@int8", "topk+averaged@int8")


def fsdp2_accuracy(record: str = ACCURACY, configs: Sequence[str] = _ACCURACY_ROWS) -> str:
    """Final validation loss of GPT-2 under FSDP2 with AdamW per reduce-scatter and all-gather,
    against FSDP2 fp32's (one seed)."""
    by = {row["config"]: row for row in finished(record)}
    base = by["fsdp"]["final_test_loss"]
    rows = (list(_parts(c)) + [f"{by[c]['final_test_loss']:.4f}",
                               "–" if c == "fsdp" else signed(100 * (by[c]["final_test_loss"] / base - 1))]
            for c in configs)
    return table(["reduce-scatter", "all-gather", "validation loss", "vs FSDP2 fp32"],
                 ["---", "---", "---:", "---:"], rows)
