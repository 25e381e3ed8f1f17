"""The exchange schemes (``scripts/bench_schemes.py``, ``bench_throughput.py --plan ...@scheme``) and
the scheduler against an exhaustive sweep (``scripts/bench_scheduler.py``)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from mergecomp_bench.results.data import finished, records
from mergecomp_bench.results.markdown import compressor_name, groups_label, signed, span, table, times
from mergecomp_bench.results.step_time import LINKS, rounds

__all__ = ["schemes_by_ranks", "schemes_fixed_vs_auto", "plans", "scheduler_summary"]


def schemes_by_ranks(record: str = "schemes_bytes_vs_ranks_resnet50_loopback.jsonl") -> str:
    """MB each rank sent and the exchange's seconds, allgather / two-phase, per compressor and
    number of ranks (bench_schemes.py)."""
    by = {(r["ranks"], r["compressor"], r["scheme"]): r for r in records(record)}
    compressors = dict.fromkeys(key[1] for key in by)

    def cell(ranks: int, compressor: str) -> str:
        both = [by[(ranks, compressor, scheme)] for scheme in ("allgather", "two-phase")]
        mb = " / ".join(f"{r['bytes_per_rank'] / 2 ** 20:.1f}" for r in both)
        seconds = " / ".join(f"{r['exchange_s']:.2f}" for r in both)
        return f"{mb} MB, {seconds} s"

    rows = ([str(n)] + [cell(n, c) for c in compressors] for n in sorted({key[0] for key in by}))
    return table(["ranks", *(compressor_name(c) for c in compressors)], ["---:"] + ["---"] * len(compressors), rows)


#: the plans :func:`schemes_fixed_vs_auto` compares: the default plan by allgather, by two-phase; ``auto``
_PLANS_COMPARED = ("default", "default@two-phase", "auto")


def schemes_fixed_vs_auto(record: str = "schemes_4hosts_1gbit_resnet50.jsonl") -> str:
    """Per compressor (and run, where it ran twice): the steps of its default plan sent by
    allgather and by the two-phase scheme, and ``auto``'s step, groups and difference from the
    better of the two (− = faster)."""
    runs = [(key, round_) for round_ in rounds(record) for key in round_ if key[2] == "auto"]
    runs_of, seen = Counter(key[1] for key, _ in runs), Counter()
    rows = []
    for (rate, compressor, _), round_ in runs:
        seen[compressor] += 1
        allgather, two_phase, auto = (round_[(rate, compressor, plan)]["step_s"] for plan in _PLANS_COMPARED)
        rows.append([compressor_name(compressor) + (f", run {seen[compressor]}" if runs_of[compressor] > 1 else ""),
                     f"{allgather:.3f}", f"{two_phase:.3f}", times(allgather / two_phase), f"{auto:.3f}",
                     groups_label(round_[(rate, compressor, "auto")]),
                     signed(100 * (auto / min(allgather, two_phase) - 1), 1)])
    header = ["compressor", "allgather s", "two-phase s", "two-phase speed-up", "`auto` s", "`auto`'s groups",
              "`auto` vs the better"]
    return table(header, ["---", "---:", "---:", "---:", "---:", "---", "---:"], rows)


#: what the plans of bench_throughput.py --plan are
_PLANS = {"fp32": "`fp32` (one fused group, plain allreduce)", "default": "`default` (4 groups, allgather)"}


def plans(record: str = "schemes_2hosts_x2_1gbit_resnet50.jsonl") -> str:
    """Each plan's step and its speed-up over the fused fp32 allreduce (plan ``fp32``)."""
    runs = {run["plan"]: run for run in finished(record)}
    base = runs["fp32"]["step_s"]
    rows = ([_PLANS.get(plan, f"`{plan}`"), f"{run['step_s']:.3f}", times(base / run["step_s"])]
            for plan, run in runs.items())
    return table(["plan", "step s", "vs fused fp32"], ["---", "---:", "---:"], rows)


_SWEEPS = ("scheduler_vs_sweep_1gbit_resnet50_batch4.jsonl", "scheduler_vs_sweep_loopback_resnet50_batch8.jsonl")
#: how close to the sweep's best counts as found
_WITHIN = 1.05


def _rerun(run: dict) -> float:
    """``auto`` over the sweep's best, re-run alternately."""
    return run["confirm"]["auto_s"] / run["confirm"]["best_s"]


def scheduler_summary(sweeps: Sequence[str] = _SWEEPS) -> str:
    """Per bench_scheduler.py record: how many compressors' ``auto`` came within 5 % of the sweep's
    best on the re-run, the search's steps, how many ran 1.5x layer-wise or faster, and ``auto``'s
    speed-up over the fused fp32 allreduce."""
    rows = []
    for record in sweeps:
        runs = finished(record)
        within = sum(_rerun(run) <= _WITHIN for run in runs)
        faster = sum(run["step_s"]["layerwise"] / run["step_s"]["auto"] >= 1.5 for run in runs)
        rows.append([LINKS.get(runs[0]["rate"], runs[0]["rate"]), f"{within} of {len(runs)}",
                     span((run["search_steps_total"] for run in runs), str), f"{faster} of {len(runs)}",
                     span((run["step_s"]["fp32"] / run["step_s"]["auto"] for run in runs), times), f"`{record}`"])
    header = ["link", "`auto` within 5 % of the sweep's best", "search steps", "`auto` >= 1.5x layer-wise",
              "`auto` vs fused fp32", "record (`docs/img/data/`)"]
    return table(header, ["---", "---:", "---:", "---:", "---:", "---"], rows)
