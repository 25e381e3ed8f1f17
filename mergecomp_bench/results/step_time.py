"""Step time on the namespace cluster (``scripts/bench_throughput.py``): against DDP and its hooks,
every compressor's ``auto``, scaling to 4 workers."""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence, Tuple

from mergecomp_bench.results.data import finished
from mergecomp_bench.results.markdown import compressor_name, groups_label, median_span, table, times

__all__ = ["ANCHORS", "TEN_GBIT", "LINKS", "Key", "rounds", "steps", "means", "ddp_key", "anchor_key", "auto_vs_ddp",
           "throughput_anchors", "throughput_repeats", "every_compressor", "scaling"]

ANCHORS = "anchors_resnet50_2workers.jsonl"
TEN_GBIT = "auto_every_compressor_vs_ddp_fp32_resnet50_10gbit_2workers.jsonl"
#: bench_throughput.py's modes other than mergecomp, as the tables name them
_MODES = {"local": "single worker", "ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook",
          "ddp-powersgd-serial": "DDP + PowerSGD hook (rank 1, serialized)"}
LINKS = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "unlimited": "unlimited", "launcher": "–"}
#: (link, compressor or mode, plan): one configuration of a bench_throughput.py record
Key = Tuple[str, str, str]
_SINGLE: Key = ("launcher", "local", "local")


def _key(run: dict) -> Key:
    return run["rate"], run["compressor"] if run["mode"] == "mergecomp" else run["mode"], run["plan"]


def anchor_key(rate: str) -> Key:
    """DDP with PyTorch's PowerSGD hook on the link ``rate``."""
    return rate, "ddp-powersgd-serial", "ddp"


def ddp_key(rate: str) -> Key:
    """DDP fp32 on the link ``rate``."""
    return rate, "ddp", "ddp"


def rounds(record: str) -> List[Dict[Key, dict]]:
    """A record's runs as its interleaved rounds: a round ends where a configuration it holds comes
    again.  Runs labelled ``before`` (code since replaced) are left out."""
    found: List[Dict[Key, dict]] = [{}]
    for run in finished(record):
        if "before" in (run.get("label") or ""):
            continue
        if _key(run) in found[-1]:
            found.append({})
        found[-1][_key(run)] = run
    return found


def steps(record: str) -> Dict[Key, List[float]]:
    """Each configuration's step seconds, round by round, in the record's order."""
    found: Dict[Key, List[float]] = {}
    for round_ in rounds(record):
        for key, run in round_.items():
            found.setdefault(key, []).append(run["step_s"])
    return found


def means(record: str) -> Dict[Key, float]:
    """Each configuration's mean step over its rounds."""
    return {key: statistics.mean(values) for key, values in steps(record).items()}


def _label(key: Key) -> str:
    rate, config, plan = key
    if config == "local" and rate != "launcher":
        return "two single workers at once (a host each), no exchange"
    return _MODES.get(config) or f"mergecomp {compressor_name(config)} `{plan}`"


def throughput_anchors(record: str = ANCHORS, links: Sequence[str] = tuple(LINKS)) -> str:
    """Each configuration of a bench_throughput.py anchor run on ``links`` (and the single worker):
    its step (mean of its rounds, each beside it), scaling factor (the single worker's step over
    it) and speed-up over DDP with the PowerSGD hook and DDP fp32 on the same link (ratios of the
    means)."""
    found, mean = steps(record), means(record)

    def speed_up(base: Key, key: Key) -> str:
        return times(mean[base] / mean[key]) if base in mean and key[1] != "local" else ""

    rows = []
    for key, values in found.items():
        if key[0] not in links and key != _SINGLE:
            continue
        each = f" ({', '.join(f'{v:.3f}' for v in values)})" if len(values) > 1 else ""
        rows.append([LINKS[key[0]], _label(key), f"{mean[key]:.3f}{each}",
                     f"{100 * mean[_SINGLE] / mean[key]:.1f} %", speed_up(anchor_key(key[0]), key),
                     speed_up(ddp_key(key[0]), key)])
    header = ["link", "configuration", "step s (rounds)", "scaling", "vs PowerSGD hook", "vs DDP fp32"]
    return table(header, ["---", "---", "---:", "---:", "---:", "---:"], rows)


#: records of rounds interleaved with DDP's PowerSGD hook at 1 Gbit/s
_REPEATS = ("anchor_pairs_powersgd_hook_vs_mergecomp_powersgd_resnet50_1gbit_2workers.jsonl",
            "anchor_pairs_powersgd_signsgd_resnet50_1gbit_2workers.jsonl", "anchors_resnet50_2workers_epyc.jsonl")


def throughput_repeats(records: Sequence[str] = _REPEATS) -> str:
    """Each mergecomp configuration of each record against the PowerSGD hook timed in the same
    round: speed-up and scaling factor, median and range over the rounds, and the record's CPU."""
    rows = []
    for record in records:
        found = rounds(record)
        keys = dict.fromkeys(key for round_ in found for key in round_ if key[1] not in _MODES)
        for key in keys:
            paired = [round_ for round_ in found if key in round_ and anchor_key(key[0]) in round_]
            speed = [r[anchor_key(key[0])]["step_s"] / r[key]["step_s"] for r in paired]
            scale = [100 * r[_SINGLE]["step_s"] / r[key]["step_s"] for r in paired if _SINGLE in r]
            rows.append([paired[0][key]["cpu"], _label(key), str(len(paired)), median_span(speed, times),
                         median_span(scale, lambda v: f"{v:.1f} %") if scale else "–", f"`{record}`"])
    header = ["CPU", "configuration", "rounds", "vs PowerSGD hook", "scaling", "record (`docs/img/data/`)"]
    return table(header, ["---", "---", "---:", "---:", "---:", "---"], rows)


def auto_vs_ddp(record: str) -> Tuple[List[float], List[Tuple[str, dict]]]:
    """DDP fp32's steps and each compressor's ``auto`` run, of a record that times them in turn."""
    runs = [(key[1], run) for round_ in rounds(record) for key, run in round_.items()]
    return [run["step_s"] for config, run in runs if config == "ddp"], [(c, run) for c, run in runs if c != "ddp"]


def every_compressor(record: str = TEN_GBIT) -> str:
    """Each compressor's ``auto`` step, its speed-up over DDP fp32 (the mean of DDP's runs between
    them) and the groups ``auto`` chose, from one bench_throughput.py record."""
    ddp, runs = auto_vs_ddp(record)
    rows = ([compressor_name(c), f"{run['step_s']:.3f}", times(statistics.mean(ddp) / run["step_s"]),
             groups_label(run)] for c, run in runs)
    header = ["compressor", "`auto` step s", f"vs DDP fp32 ({statistics.mean(ddp):.3f} s, mean of {len(ddp)} runs)",
              "`auto`'s groups"]
    return table(header, ["---", "---:", "---:", "---"], rows)


def scaling(record: str = "scaling_4workers_resnet50.jsonl", rates: Sequence[str] = ("1gbit", "unlimited")) -> str:
    """4 workers: each compressor's ``auto`` and layer-wise steps on each link, layer-wise over
    ``auto``, and ``auto``'s speed-up over DDP fp32 on the same link (DDP's step in the header)."""
    mean = means(record)
    compressors = dict.fromkeys(key[1] for key in mean if key[2] == "auto")

    def cells(rate: str, compressor: str) -> List[str]:
        auto, layerwise = mean[(rate, compressor, "auto")], mean[(rate, compressor, "layerwise")]
        return [f"{auto:.3f}", f"{layerwise:.3f}", times(layerwise / auto), times(mean[ddp_key(rate)] / auto)]

    header = ["compressor"] + [cell for rate in rates for cell in (
        f"{LINKS[rate]}: `auto` s", "layer-wise s", "layer-wise / `auto`",
        f"vs DDP fp32 ({mean[ddp_key(rate)]:.3f} s)")]
    rows = ([compressor_name(c)] + [cell for rate in rates for cell in cells(rate, c)] for c in compressors)
    return table(header, ["---"] + ["---:"] * 4 * len(rates), rows)
