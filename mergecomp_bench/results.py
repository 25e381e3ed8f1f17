"""The docs' result tables, rendered from the benchmark records in ``docs/img/data``.

A table in a Markdown file sits between two marker lines::

    <!-- rendered: NAME -->
    | ... the table :data:`TABLES` [NAME] makes from the records ... |
    <!-- end rendered -->

:func:`render_file` rewrites every such block from the records (``scripts/render_results.py``);
with ``check`` it only reports the blocks that differ, which the test suite does, so a number in
those tables cannot drift from its record.  Each table names its records; a row whose record is
missing raises (``LookupError``) instead of rendering a blank.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from mergecomp_bench import compatibility

__all__ = ["DATA", "TABLES", "TARGET", "render_file", "summary", "throughput_anchors", "throughput_repeats",
           "every_compressor", "scaling", "schemes_by_ranks", "schemes_fixed_vs_auto", "plans", "scheduler_summary",
           "convergence", "memories", "own_work", "adam_auto", "adam_momentum_exchange", "time_to_accuracy",
           "time_to_accuracy_recipes", "time_to", "fsdp2_step", "fsdp2_bytes", "fsdp2_accuracy", "gpu_runs",
           "gpu_training", "codec_work"]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "img" / "data"
_BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S)


def _read(name: str) -> str:
    path = DATA / name
    if not path.exists():
        raise LookupError(f"record {path} does not exist")
    return path.read_text()


def _records(name: str) -> List[dict]:
    return [json.loads(line) for line in _read(name).splitlines() if line.strip()]


def _ok(name: str) -> List[dict]:
    """The runs of a record that finished (``status`` ok, or none given)."""
    return [run for run in _records(name) if run.get("status", "ok") == "ok"]


def _json(name: str) -> dict:
    """A record written as one JSON document (``gpu_check_*.json``)."""
    return json.loads(_read(name))


def _signed(value: float, digits: int = 2, unit: str = "%") -> str:
    """``+0.65 %`` / ``−0.33 pp`` (a minus sign, as the docs write it); ``diverged`` for NaN."""
    if math.isnan(value):
        return "diverged"
    text = f"{abs(value):.{digits}f}"
    return ("−" if value < 0 and float(text) else "+") + f"{text} {unit}"


def _x(ratio: float) -> str:
    """A speed-up: ``1.67x``."""
    return f"{ratio:.2f}x"


def _span(values: Iterable[float], write: Callable[[float], str]) -> str:
    """``lo to hi`` of ``values`` as ``write`` writes them; one value where the two agree."""
    ordered = sorted(values)
    lo, hi = write(ordered[0]), write(ordered[-1])
    return lo if lo == hi else f"{lo} to {hi}"


def _median_span(values: Sequence[float], write: Callable[[float], str]) -> str:
    """``median (lo to hi)``, or the one value."""
    if len(values) == 1:
        return write(values[0])
    return f"{write(statistics.median(values))} ({_span(values, write)})"


#: how the tables name a compressor
_NAMES = {"none": "fp32 (`none`)", "fp16": "fp16", "bf16": "bf16", "qsgd": "QSGD", "terngrad": "TernGrad",
          "signsgd": "signSGD", "signum": "Signum", "efsignsgd": "EF-signSGD", "onebit": "1-bit SGD",
          "topk": "top-k", "randk": "rand-k", "dgc": "DGC", "powersgd": "PowerSGD", "acpsgd": "ACP-SGD"}


def _name(compressor: str) -> str:
    return _NAMES.get(compressor, f"`{compressor}`")


def _groups_label(plan: dict) -> str:
    """A plan's groups in MB, with the route each takes where it is not the compressor's own."""
    codecs = plan["codecs"]
    if len(set(codecs)) == 1:
        route = "" if codecs[0] == "compressed" else f", {codecs[0]}"
        return " + ".join(f"{mb:.1f}" for mb in plan["group_mb"]) + " MB" + route
    return " + ".join(f"{mb:.1f}" + ("" if codec == "compressed" else f" {codec}")
                      for mb, codec in zip(plan["group_mb"], codecs)) + " MB"


def _table(header: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- step time on the namespace cluster (scripts/bench_throughput.py) ------------------------------
_ANCHORS = "anchors_resnet50_2workers.jsonl"
_TEN_GBIT = "auto_every_compressor_vs_ddp_fp32_resnet50_10gbit_2workers.jsonl"
#: bench_throughput.py's modes other than mergecomp, as the tables name them
_MODES = {"local": "single worker", "ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook",
          "ddp-powersgd-serial": "DDP + PowerSGD hook (rank 1, serialized)"}
_LINKS = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "unlimited": "unlimited", "launcher": "–"}
#: (link, compressor or mode, plan): one configuration of a bench_throughput.py record
Key = Tuple[str, str, str]
_SINGLE: Key = ("launcher", "local", "local")


def _key(run: dict) -> Key:
    return run["rate"], run["compressor"] if run["mode"] == "mergecomp" else run["mode"], run["plan"]


def _anchor(rate: str) -> Key:
    return rate, "ddp-powersgd-serial", "ddp"


def _ddp(rate: str) -> Key:
    return rate, "ddp", "ddp"


def _rounds(record: str) -> List[Dict[Key, dict]]:
    """A record's runs as its interleaved rounds: a round ends where a configuration it holds comes
    again.  Runs labelled ``before`` (code since replaced) are left out."""
    rounds: List[Dict[Key, dict]] = [{}]
    for run in _ok(record):
        if "before" in (run.get("label") or ""):
            continue
        if _key(run) in rounds[-1]:
            rounds.append({})
        rounds[-1][_key(run)] = run
    return rounds


def _steps(record: str) -> Dict[Key, List[float]]:
    """Each configuration's step seconds, round by round, in the record's order."""
    steps: Dict[Key, List[float]] = {}
    for round_ in _rounds(record):
        for key, run in round_.items():
            steps.setdefault(key, []).append(run["step_s"])
    return steps


def _means(record: str) -> Dict[Key, float]:
    return {key: statistics.mean(values) for key, values in _steps(record).items()}


def _label(key: Key) -> str:
    rate, config, plan = key
    if config == "local" and rate != "launcher":
        return "two single workers at once (a host each), no exchange"
    return _MODES.get(config) or f"mergecomp {_name(config)} `{plan}`"


def throughput_anchors(record: str = _ANCHORS) -> str:
    """Each configuration of a bench_throughput.py anchor run: its step (mean of its rounds, each
    beside it), scaling factor (the single worker's step over it) and speed-up over DDP with the
    PowerSGD hook and DDP fp32 on the same link (ratios of the means)."""
    steps, mean = _steps(record), _means(record)

    def speed_up(base: Key, key: Key) -> str:
        return _x(mean[base] / mean[key]) if base in mean and key[1] != "local" else ""

    rows = []
    for key, values in steps.items():
        rounds = f" ({', '.join(f'{v:.3f}' for v in values)})" if len(values) > 1 else ""
        rows.append([_LINKS[key[0]], _label(key), f"{mean[key]:.3f}{rounds}",
                     f"{100 * mean[_SINGLE] / mean[key]:.1f} %", speed_up(_anchor(key[0]), key),
                     speed_up(_ddp(key[0]), key)])
    header = ["link", "configuration", "step s (rounds)", "scaling", "vs PowerSGD hook", "vs DDP fp32"]
    return _table(header, ["---", "---", "---:", "---:", "---:", "---:"], rows)


#: records of rounds interleaved with DDP's PowerSGD hook at 1 Gbit/s
_REPEATS = ("anchor_pairs_powersgd_hook_vs_mergecomp_powersgd_resnet50_1gbit_2workers.jsonl",
            "anchor_pairs_powersgd_signsgd_resnet50_1gbit_2workers.jsonl", "anchors_resnet50_2workers_epyc.jsonl")


def throughput_repeats(records: Sequence[str] = _REPEATS) -> str:
    """Each mergecomp configuration of each record against the PowerSGD hook timed in the same
    round: speed-up and scaling factor, median and range over the rounds, and the record's CPU."""
    rows = []
    for record in records:
        rounds = _rounds(record)
        keys = dict.fromkeys(key for round_ in rounds for key in round_ if key[1] not in _MODES)
        for key in keys:
            paired = [round_ for round_ in rounds if key in round_ and _anchor(key[0]) in round_]
            speed = [r[_anchor(key[0])]["step_s"] / r[key]["step_s"] for r in paired]
            scaling = [100 * r[_SINGLE]["step_s"] / r[key]["step_s"] for r in paired if _SINGLE in r]
            rows.append([paired[0][key]["cpu"], _label(key), str(len(paired)), _median_span(speed, _x),
                         _median_span(scaling, lambda v: f"{v:.1f} %") if scaling else "–", f"`{record}`"])
    header = ["CPU", "configuration", "rounds", "vs PowerSGD hook", "scaling", "record (`docs/img/data/`)"]
    return _table(header, ["---", "---", "---:", "---:", "---:", "---"], rows)


def _auto_vs_ddp(record: str) -> Tuple[List[float], List[Tuple[str, dict]]]:
    """DDP fp32's steps and each compressor's ``auto`` run, of a record that times them in turn."""
    runs = [(key[1], run) for round_ in _rounds(record) for key, run in round_.items()]
    return [run["step_s"] for config, run in runs if config == "ddp"], [(c, run) for c, run in runs if c != "ddp"]


def every_compressor(record: str = _TEN_GBIT) -> str:
    """Each compressor's ``auto`` step, its speed-up over DDP fp32 (the mean of DDP's runs between
    them) and the groups ``auto`` chose, from one bench_throughput.py record."""
    ddp, runs = _auto_vs_ddp(record)
    rows = ([_name(c), f"{run['step_s']:.3f}", _x(statistics.mean(ddp) / run["step_s"]), _groups_label(run)]
            for c, run in runs)
    header = ["compressor", "`auto` step s", f"vs DDP fp32 ({statistics.mean(ddp):.3f} s, mean of {len(ddp)} runs)",
              "`auto`'s groups"]
    return _table(header, ["---", "---:", "---:", "---"], rows)


def scaling(record: str = "scaling_4workers_resnet50.jsonl", rates: Sequence[str] = ("1gbit", "unlimited")) -> str:
    """4 workers: each compressor's ``auto`` and layer-wise steps on each link, layer-wise over
    ``auto``, and ``auto``'s speed-up over DDP fp32 on the same link (DDP's step in the header)."""
    mean = _means(record)
    compressors = dict.fromkeys(key[1] for key in mean if key[2] == "auto")

    def cells(rate: str, compressor: str) -> List[str]:
        auto, layerwise = mean[(rate, compressor, "auto")], mean[(rate, compressor, "layerwise")]
        return [f"{auto:.3f}", f"{layerwise:.3f}", _x(layerwise / auto), _x(mean[_ddp(rate)] / auto)]

    header = ["compressor"] + [cell for rate in rates for cell in (
        f"{_LINKS[rate]}: `auto` s", "layer-wise s", "layer-wise / `auto`", f"vs DDP fp32 ({mean[_ddp(rate)]:.3f} s)")]
    rows = ([_name(c)] + [cell for rate in rates for cell in cells(rate, c)] for c in compressors)
    return _table(header, ["---"] + ["---:"] * 4 * len(rates), rows)


# -- exchange schemes (scripts/bench_schemes.py, bench_throughput.py --plan ...@scheme) ----------
def schemes_by_ranks(record: str = "schemes_bytes_vs_ranks_resnet50_loopback.jsonl") -> str:
    """MB each rank sent and the exchange's seconds, allgather / two-phase, per compressor and
    number of ranks (bench_schemes.py)."""
    by = {(r["ranks"], r["compressor"], r["scheme"]): r for r in _records(record)}
    compressors = dict.fromkeys(key[1] for key in by)

    def cell(ranks: int, compressor: str) -> str:
        both = [by[(ranks, compressor, scheme)] for scheme in ("allgather", "two-phase")]
        mb = " / ".join(f"{r['bytes_per_rank'] / 2 ** 20:.1f}" for r in both)
        seconds = " / ".join(f"{r['exchange_s']:.2f}" for r in both)
        return f"{mb} MB, {seconds} s"

    rows = ([str(n)] + [cell(n, c) for c in compressors] for n in sorted({key[0] for key in by}))
    return _table(["ranks", *(_name(c) for c in compressors)], ["---:"] + ["---"] * len(compressors), rows)


#: the plans :func:`schemes_fixed_vs_auto` compares: the default plan by allgather, by two-phase; ``auto``
_PLANS_COMPARED = ("default", "default@two-phase", "auto")


def schemes_fixed_vs_auto(record: str = "schemes_4hosts_1gbit_resnet50.jsonl") -> str:
    """Per compressor (and run, where it ran twice): the steps of its default plan sent by
    allgather and by the two-phase scheme, and ``auto``'s step, groups and difference from the
    better of the two (− = faster)."""
    runs = [(key, round_) for round_ in _rounds(record) for key in round_ if key[2] == "auto"]
    times, seen = Counter(key[1] for key, _ in runs), Counter()
    rows = []
    for (rate, compressor, _), round_ in runs:
        seen[compressor] += 1
        allgather, two_phase, auto = (round_[(rate, compressor, plan)]["step_s"] for plan in _PLANS_COMPARED)
        rows.append([_name(compressor) + (f", run {seen[compressor]}" if times[compressor] > 1 else ""),
                     f"{allgather:.3f}", f"{two_phase:.3f}", _x(allgather / two_phase), f"{auto:.3f}",
                     _groups_label(round_[(rate, compressor, "auto")]),
                     _signed(100 * (auto / min(allgather, two_phase) - 1), 1)])
    header = ["compressor", "allgather s", "two-phase s", "two-phase speed-up", "`auto` s", "`auto`'s groups",
              "`auto` vs the better"]
    return _table(header, ["---", "---:", "---:", "---:", "---:", "---", "---:"], rows)


#: what the plans of bench_throughput.py --plan are
_PLANS = {"fp32": "`fp32` (one fused group, plain allreduce)", "default": "`default` (4 groups, allgather)"}


def plans(record: str = "schemes_2hosts_x2_1gbit_resnet50.jsonl") -> str:
    """Each plan's step and its speed-up over the fused fp32 allreduce (plan ``fp32``)."""
    runs = {run["plan"]: run for run in _ok(record)}
    base = runs["fp32"]["step_s"]
    rows = ([_PLANS.get(plan, f"`{plan}`"), f"{run['step_s']:.3f}", _x(base / run["step_s"])]
            for plan, run in runs.items())
    return _table(["plan", "step s", "vs fused fp32"], ["---", "---:", "---:"], rows)


# -- the scheduler against a sweep (scripts/bench_scheduler.py) ----------------------------------
_SWEEPS = ("scheduler_vs_sweep_1gbit_resnet50_batch4.jsonl", "scheduler_vs_sweep_loopback_resnet50_batch8.jsonl")
#: how close to the sweep's best counts as found
_WITHIN = 1.05


def _rerun(run: dict) -> float:
    """``auto`` over the sweep's best, re-run alternately."""
    return run["confirm"]["auto_s"] / run["confirm"]["best_s"]


def scheduler_summary(records: Sequence[str] = _SWEEPS) -> str:
    """Per bench_scheduler.py record: how many compressors' ``auto`` came within 5 % of the sweep's
    best on the re-run, the search's steps, how many ran 1.5x layer-wise or faster, and ``auto``'s
    speed-up over the fused fp32 allreduce."""
    rows = []
    for record in records:
        runs = _ok(record)
        within = sum(_rerun(run) <= _WITHIN for run in runs)
        faster = sum(run["step_s"]["layerwise"] / run["step_s"]["auto"] >= 1.5 for run in runs)
        rows.append([_LINKS.get(runs[0]["rate"], runs[0]["rate"]), f"{within} of {len(runs)}",
                     _span((run["search_steps_total"] for run in runs), str), f"{faster} of {len(runs)}",
                     _span((run["step_s"]["fp32"] / run["step_s"]["auto"] for run in runs), _x), f"`{record}`"])
    header = ["link", "`auto` within 5 % of the sweep's best", "search steps", "`auto` >= 1.5x layer-wise",
              "`auto` vs fused fp32", "record (`docs/img/data/`)"]
    return _table(header, ["---", "---:", "---:", "---:", "---:", "---"], rows)


# -- convergence (scripts/bench_convergence.py) ---------------------------------------------------
_DIGITS = "convergence_digits_mlp_2workers.jsonl"
_LM = "convergence_stdlib_bytes_gpt2_2workers.jsonl"
_FP32 = ("none", "none")
#: (compressor, memory) -> seed -> run
Runs = Dict[Tuple[str, str], Dict[int, dict]]


def _convergence_runs(record: str, **where: object) -> Runs:
    """A bench_convergence.py record's runs by (compressor, memory), then seed; ``where``: what
    they must have besides (``warmup_steps``, ``uncompressed``; by default neither)."""
    where = {"warmup_steps": 0, "uncompressed": "", **where}
    runs: Runs = {}
    for run in _ok(record):
        if all(run[field] == value for field, value in where.items()):
            runs.setdefault((run["compressor"], run["memory"]), {})[run["seed"]] = run
    return runs


def _vs_fp32(seeds: Dict[int, dict], fp32: Dict[int, dict]) -> float:
    """The median over seeds of a run's difference from fp32's on its seed: points of test
    accuracy (digits), per cent of validation loss (language model); NaN where one diverged."""
    def delta(run: dict, base: dict) -> float:
        if run["task"] == "digits":
            return 100 * (run["final_acc"] - base["final_acc"])
        return 100 * (run["final_test_loss"] / base["final_test_loss"] - 1)

    if any(math.isnan(run["final_test_loss"]) for run in seeds.values()):
        return math.nan
    missing = sorted(set(seeds) - set(fp32))
    if missing:
        raise LookupError(f"no fp32 run with seed {missing[0]}")
    return statistics.median(delta(run, fp32[seed]) for seed, run in seeds.items())


def _vs_fp32_text(seeds: Dict[int, dict], fp32: Dict[int, dict]) -> str:
    task = next(iter(seeds.values()))["task"]
    return _signed(_vs_fp32(seeds, fp32), 2, "pp" if task == "digits" else "%")


def _default_memory(runs: Runs, compressor: str) -> Dict[int, dict]:
    """The seeds of ``compressor`` with the one memory it ran with."""
    return next(seeds for (name, _), seeds in runs.items() if name == compressor)


def _metric(seeds: Dict[int, dict]) -> str:
    """Test accuracy % (digits) or validation loss: median (range) over the seeds."""
    runs = list(seeds.values())
    if any(math.isnan(run["final_test_loss"]) for run in runs):
        return "diverged"
    if runs[0]["task"] == "digits":
        return _median_span([100 * run["final_acc"] for run in runs], lambda v: f"{v:.2f}")
    return _median_span([run["final_test_loss"] for run in runs], lambda v: f"{v:.4f}")


def convergence(record: str, variants: Sequence[Tuple[str, str, Dict[str, object]]] = ()) -> str:
    """Each compressor of a bench_convergence.py record with its default memory: the metric over the
    seeds and its difference from fp32 on the same seed (median); ``variants``: further columns
    (header, record, what its runs have) of the same difference in other runs, against their own
    fp32 runs where they have them."""
    runs = _convergence_runs(record)
    fp32 = runs[_FP32]
    columns = [(header, _convergence_runs(other, **where)) for header, other, where in variants]
    rows = []
    for (compressor, memory), seeds in runs.items():
        lr = next(iter(seeds.values()))["lr"]
        name = _name(compressor) + ("" if lr == next(iter(fp32.values()))["lr"] else f" (lr {lr:g})")
        cells = [name, memory, _metric(seeds), "–" if seeds is fp32 else _vs_fp32_text(seeds, fp32)]
        cells += [_vs_fp32_text(other[(compressor, memory)], other.get(_FP32, fp32))
                  if (compressor, memory) in other and seeds is not fp32 else "" for _, other in columns]
        rows.append(cells)
    digits = next(iter(fp32.values()))["task"] == "digits"
    header = ["compressor", "memory", "test accuracy %" if digits else "validation loss (nats/byte)",
              "vs fp32, same seed", *(header for header, _ in columns)]
    return _table(header, ["---", "---", "---:", "---:", *["---:"] * len(columns)], rows)


def memories(records: Dict[str, str]) -> str:
    """Each compressor under each error-feedback memory of each bench_convergence.py record (the
    row's label beside it): the median over seeds of its difference from fp32 on the same seed."""
    runs = {label: _convergence_runs(record) for label, record in records.items()}
    kinds = dict.fromkeys(memory for by in runs.values() for compressor, memory in by if compressor != "none")
    rows = []
    for label, by in runs.items():
        fp32 = by[_FP32]
        for compressor in dict.fromkeys(c for c, _ in by if c != "none"):
            rows.append([f"{_name(compressor)}, {label}"] + [_vs_fp32_text(by[(compressor, m)], fp32)
                                                            if (compressor, m) in by else "–" for m in kinds])
    return _table(["compressor", *(f"`{m}`" for m in kinds)], ["---"] + ["---:"] * len(kinds), rows)


# -- our own work per step (scripts/bench_host_overhead.py) --------------------------------------
_OWN_WORK = "host_overhead_cpu.jsonl"
#: the models of :func:`own_work`: two GPT-2s of about the same size, one with twice the tensors
_NARROW = ("gpt2-12x64", "gpt2-24x56")
#: the rows of :func:`own_work`: label, the configurations shown in it (joined by " / "), bold
_OWN_WORK_ROWS: Tuple[Tuple[str, Tuple[str, ...], bool], ...] = (
    ("torch SGD (default)", ("torch sgd",), False),
    ("torch SGD foreach / fused", ("torch sgd foreach", "torch sgd fused"), False),
    ("DDP on one rank, SGD", ("ddp sgd",), False),
    ("**mergecomp `none`**", ("none",), True),
    ("mergecomp `fp16`", ("fp16",), False),
    ("mergecomp `topk`", ("topk",), False),
    ("mergecomp `powersgd`", ("powersgd",), False),
    ("torch AdamW (default)", ("torch adamw",), False),
    ("torch AdamW foreach / fused", ("torch adamw foreach", "torch adamw fused"), False),
    ("DDP on one rank, AdamW", ("ddp adamw",), False),
    ("**mergecomp 1-bit SGD, AdamW's momentum exchanged**", ("onebit momentum",), True),
    ("**the same through the DDP hook**", ("hook onebit momentum",), True),
)


def own_work(record: str = _OWN_WORK, models: Sequence[str] = _NARROW) -> str:
    """ms per step, its ratio to plain torch with the same optimizer (``x``) and aten operators
    per step, of each configuration on each model, from one ``bench_host_overhead.py`` record."""
    by = {(r["model"], r["config"]): r for r in _records(record)}

    def cells(model: str, configs: Sequence[str], bold: bool) -> List[str]:
        rows = []
        for config in configs:
            if (model, config) not in by:
                raise LookupError(f"{record}: no row for {model} / {config}")
            rows.append(by[(model, config)])
        x = " / ".join(f"{r['x']:.2f}x" for r in rows)
        return [" / ".join(f"{r['median_ms']:.1f}" for r in rows), f"**{x}**" if bold else x,
                " / ".join(f"{r['aten_ops']:.0f}" for r in rows)]

    header = ["configuration"] + [f"{_model_label(m)}: {c}" if c == "ms" else c for m in models
                                  for c in ("ms", "x torch", "aten ops")]
    body = ([label] + [cell for model in models for cell in cells(model, configs, bold)]
            for label, configs, bold in _OWN_WORK_ROWS)
    return _table(header, ["---"] + ["---:"] * 3 * len(models), body)


def _model_label(model: str) -> str:
    """``gpt2-12x64`` -> ``12 x 64``."""
    narrow = re.fullmatch(r"gpt2-(\d+)x(\d+)", model)
    return f"{narrow.group(1)} x {narrow.group(2)}" if narrow else model


# -- "auto" with AdamW (scripts/bench_adam.py) ---------------------------------------------------
#: bench_adam.py's defaults, which records made before it wrote its setting leave out
_ADAM_DEFAULTS = {"layers": 4, "lr": 1e-3, "beta2": 0.999, "clip": None, "batch": 8, "workers": 2}
#: the compressors of :func:`adam_auto`'s columns
_AUTO_COMPRESSORS = ("onebit", "topk", "powersgd", "terngrad")
#: its rows: label, the setting (what differs from the defaults), updates, the record of its runs
_AUTO_SETTINGS: Tuple[Tuple[str, Dict[str, object], int, str], ...] = (
    ("GPT-2 4 x 256, lr 1e-3, 2,000 updates (the recipes' own)", {}, 2000, "adam_gpt2_4x256_auto_2workers.jsonl"),
    ("3 x 256, lr 3e-3, clip 1.0, 600 updates (`--layers 3 --lr 3e-3 --clip 1.0 --steps 600`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0}, 600, "adam_gpt2_3x256_auto_2workers.jsonl"),
    ("the same on 4 ranks x batch 4 (`--workers 4 --batch 4`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "workers": 4, "batch": 4}, 600, "adam_gpt2_3x256_auto_4workers.jsonl"),
    ("the same with beta2 = 0.95 (`--beta2 0.95`, R = 8)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "beta2": 0.95}, 600, "adam_gpt2_3x256_beta2_095_2workers.jsonl"),
)


def _setting(record: dict) -> Dict[str, object]:
    return {**_ADAM_DEFAULTS, **(record.get("setting") or {})}


def _adam_records() -> List[dict]:
    return [r for path in sorted(DATA.glob("adam_*.jsonl")) for r in _records(path.name) if r.get("status") == "ok"]


def _auto_now(compressor: str, setting: Dict[str, object], steps: int) -> Tuple[int, Optional[int]]:
    """The warm-up K and refresh interval R ``"auto"`` gives ``compressor`` today on a
    bench_adam.py run of ``steps`` updates with ``setting``: a record made with other ones
    measured another recipe."""
    from mergecomp.torch.momentum_exchange import refresh_limit
    from mergecomp.torch.momentum_recipes import RECIPES, choose

    lr_warmup = max(1, steps // 20)  # bench_adam.py's LR warm-up
    _, options, _ = choose(compressor, {"exchange_momentum_after": "auto", "lr_warmup_steps": lr_warmup,
                                        "total_steps": steps}, "render")
    refresh = RECIPES[compressor].refresh_every
    return options["exchange_momentum_after"], None if refresh is None else min(refresh, refresh_limit(setting["beta2"]))


def adam_auto() -> str:
    """``exchange_momentum_after="auto"`` against uncompressed AdamW on each setting of
    :data:`_AUTO_SETTINGS`: the validation loss's difference on the same seed (median over the
    seeds, the worst seed beside it where there are several) and bits per element over the run,
    from the runs of today's recipe (its K and R) in the setting's record."""
    records = _adam_records()
    rows = []
    for label, differs, steps, record in _AUTO_SETTINGS:
        setting = {**_ADAM_DEFAULTS, **differs}
        runs = _auto_runs(setting, steps, record)
        seeds_of_row = {r["seed"] for measured in runs.values() for r in measured}
        if not seeds_of_row:
            raise LookupError(f"{record}: no run of today's recipes")
        baseline = _adamw(records, setting, steps)
        cells = [_auto_cell(measured, baseline, record) if measured else "–" for measured in runs.values()]
        seeds = (f"seed {min(seeds_of_row)}" if len(seeds_of_row) == 1
                 else f"median of seeds {', '.join(map(str, sorted(seeds_of_row)))}")
        rows.append([f"{label}, {seeds}", *cells, f"`{record}`"])
    header = ["setting (`bench_adam.py` flags)", *(f"`{c}`" for c in _AUTO_COMPRESSORS), "record (`docs/img/data/`)"]
    return _table(header, ["---", *["---:"] * len(_AUTO_COMPRESSORS), "---"], rows)


def _adamw(records: List[dict], setting: Dict[str, object], steps: int) -> Dict[int, float]:
    """Uncompressed AdamW's final validation loss per seed, in one setting."""
    return {r["seed"]: r["final_test_loss"] for r in records
            if r["config"] == "none@grad" and _setting(r) == setting and r["steps"] == steps}


def _auto_runs(setting: Dict[str, object], steps: int, record: str) -> Dict[str, List[dict]]:
    """Each compressor's runs in ``record`` of the recipe ``"auto"`` gives it today."""
    measured = _records(record)
    runs = {}
    for compressor in _AUTO_COMPRESSORS:
        after, refresh = _auto_now(compressor, setting, steps)
        runs[compressor] = [r for r in measured if r["config"] == f"{compressor}@auto" and _setting(r) == setting
                            and r["steps"] == steps and r["after"] == after and r.get("refresh") == refresh]
    return runs


def _vs_adamw(runs: List[dict], baseline: Dict[int, float], record: str) -> List[float]:
    """Each run's validation loss against uncompressed AdamW's on its seed, in per cent."""
    missing = sorted({r["seed"] for r in runs} - set(baseline))
    if missing:
        raise LookupError(f"{record}: no uncompressed AdamW run with seed {missing[0]} of its setting")
    return [100 * (r["final_test_loss"] / baseline[r["seed"]] - 1) for r in runs]


def _auto_cell(runs: List[dict], baseline: Dict[int, float], record: str) -> str:
    """``**+0.83 %** (worst +1.01 %; 1.93 bits)``: bold where the median is within 1 %."""
    deltas = _vs_adamw(runs, baseline, record)
    middle = _signed(statistics.median(deltas))
    bits = f"{statistics.median(r['bits_per_element'] for r in runs):.2f} bits"
    worst = f"worst {_signed(max(deltas))}; " if len(runs) > 1 else ""
    return f"{f'**{middle}**' if statistics.median(deltas) <= 1.0 else middle} ({worst}{bits})"


#: the rows of :func:`adam_momentum_exchange`: label, bench_adam.py configuration, warm-up K
_EXCHANGE_ROWS: Tuple[Tuple[str, str, Optional[int]], ...] = (
    ("AdamW's gradients through 1-bit SGD", "onebit@grad", None),
    ("momentum exchanged losslessly, variance frozen for good", "none@momentum", 60),
    ("the same, a longer warm-up", "none@momentum", 200),
    ("the same, the variance refreshed (R = 64)", "none@momentum/64", 30),
    ("4-bit QSGD, no memory", "qsgd:levels=7@momentum+none/64", 30),
    ("4-bit QSGD, residual memory, fp16 warm-up", "qsgd:levels=7@momentum+residual/64^fp16", 30),
    ("top-k 1 %", "topk@momentum/64", 30),
    ("PowerSGD rank 1", "powersgd@momentum/64", 30),
)


def adam_momentum_exchange(steps: int = 2000) -> str:
    """What exchanging AdamW's momentum needs, on bench_adam.py's defaults: per configuration and
    warm-up K of :data:`_EXCHANGE_ROWS`, its seeds, bits per element over the run and validation
    loss against uncompressed AdamW on the same seed (medians over the seeds)."""
    records = [r for r in _adam_records() if _setting(r) == _ADAM_DEFAULTS and r["steps"] == steps]
    baseline = _adamw(records, _ADAM_DEFAULTS, steps)
    rows = []
    for label, config, after in _EXCHANGE_ROWS:
        runs = [r for r in records if r["config"] == config and r["after"] == after]
        if not runs:
            raise LookupError(f"no bench_adam.py run of {config} with K = {after}")
        bits = statistics.median(r["bits_per_element"] for r in runs)
        rows.append([label, f"`{config}`", "–" if after is None else str(after),
                     ", ".join(str(r["seed"]) for r in runs), f"{bits:.2f}",
                     _signed(statistics.median(_vs_adamw(runs, baseline, config)))])
    header = ["configuration", "`bench_adam.py --configs`", "K", "seeds", "bits per element", "vs AdamW"]
    return _table(header, ["---", "---", "---:", "---", "---:", "---:"], rows)


# -- time to accuracy (scripts/bench_time_to_accuracy.py) ----------------------------------------
#: the target of time to accuracy: DDP fp32's final validation loss plus this share
TARGET = 0.01
_DDP_LABELS = {"ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook"}
_TTA = "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_warmup.jsonl"


def time_to(record: dict, target: float) -> Optional[float]:
    """Training seconds of ``record``'s first evaluation at or below ``target``, or None."""
    return next((point["seconds"] for point in record["curve"] if point["test_loss"] <= target), None)


def _tta_seeds(record: str) -> Dict[int, Dict[str, dict]]:
    """A bench_time_to_accuracy.py record's finished runs by seed, then configuration; every seed
    has its DDP fp32 run."""
    seeds: Dict[int, Dict[str, dict]] = {}
    for run in _ok(record):
        seeds.setdefault(run["seed"], {})[run["config"]] = run
    for seed, by in seeds.items():
        if "ddp" not in by:
            raise LookupError(f"{record}: no DDP fp32 run for seed {seed}")
    return dict(sorted(seeds.items()))


def _speed_ups(by: Dict[str, dict], config: str) -> Tuple[Optional[float], List[Optional[float]]]:
    """``config``'s time to DDP fp32's final loss + :data:`TARGET` of the same seed, and DDP fp32's
    and the fp16 hook's times over it (None where one is missing or never reached it)."""
    target = by["ddp"]["final_test_loss"] * (1 + TARGET)
    reached = time_to(by[config], target)
    anchors = [time_to(by[c], target) if c in by else None for c in _DDP_LABELS]
    return reached, [None if reached is None or anchor is None else anchor / reached for anchor in anchors]


def time_to_accuracy(record: str, labels: Dict[str, str], bold: Sequence[str] = ()) -> str:
    """Each seed's runs of one ``bench_time_to_accuracy.py`` record (those ``labels`` names, in the
    record's order): step time, the share of it above the step without exchange, bits per
    element, final validation loss, and the time to DDP fp32's final loss + 1 % of the same seed,
    against DDP fp32's and the fp16 hook's; ``bold``: configurations whose times are bold."""
    names = {**_DDP_LABELS, **labels}
    rows = []
    for seed, by in _tta_seeds(record).items():
        base = by["ddp"]["final_test_loss"]
        for config, run in by.items():
            if config not in names:
                continue
            reached, ratios = _speed_ups(by, config)
            times = ["not reached" if reached is None else f"{reached:.0f} s",
                     *("–" if ratio is None else _x(ratio) for ratio in ratios)]
            if config in bold:
                times = [f"**{t}**" if reached is not None else t for t in times]
            bits = {"ddp": "32", "ddp-fp16": "16"}.get(config) or f"{run['bits_per_element']:.2f}"
            loss = run["final_test_loss"]
            rows.append([str(seed), names[config], f"{run['step_s']:.3f}",
                         f"{round(100 * (1 - run['compute_s'] / run['step_s']))} %", bits, f"{loss:.4f}",
                         "–" if config == "ddp" else _signed(100 * (loss / base - 1)), *times])
    header = ["seed", "configuration", "step (s)", "exchange share", "bits per element (run)", "validation loss",
              "vs DDP fp32", "time to target", "vs DDP fp32", "vs DDP fp16 hook"]
    return _table(header, ["---", "---", *["---:"] * 8], rows)


#: the rows of :func:`time_to_accuracy_recipes`: label, record, configuration
_TTA_RECIPES: Tuple[Tuple[str, str, str], ...] = (
    ("1-bit SGD, fp16 warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_fp16_warmup.jsonl",
     "onebit@momentum/64^fp16"),
    ("1-bit SGD, exact warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_fp16_warmup.jsonl", "onebit@momentum/64"),
    ("1-bit SGD, fp16 warm-up, R = 32", "time_to_accuracy_gpt2_4x256_batch2_1gbit_onebit_refresh32.jsonl",
     "onebit@momentum/32^fp16"),
    ("EF-signSGD, fp16 warm-up, R = 32", "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_efsignsgd.jsonl",
     "efsignsgd@momentum/32^fp16"),
    ("4-bit QSGD, fp16 warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_efsignsgd.jsonl",
     "qsgd:levels=7@momentum/64^fp16"),
    ("1-bit SGD, exact warm-up shorter than the LR warm-up",
     "time_to_accuracy_gpt2_4x256_batch2_1gbit_momentum_search.jsonl", "onebit@momentum/64"),
    ("the same with `groups=2`", "time_to_accuracy_gpt2_4x256_batch2_1gbit_groups_2.jsonl", "onebit@momentum/64"),
)


def _median_or_dash(values: Iterable[Optional[float]]) -> str:
    known = [v for v in values if v is not None]
    return _x(statistics.median(known)) if known else "–"


def time_to_accuracy_recipes(rows: Sequence[Tuple[str, str, str]] = _TTA_RECIPES) -> str:
    """Further recipes on the time-to-accuracy benchmark, each from its record: seeds, warm-up K,
    bits per element, final loss against DDP fp32 (median), the time to DDP fp32's loss + 1 %
    against DDP fp32's and the fp16 hook's (medians of the seeds that reached it), and the seeds
    that did not."""
    table = []
    for label, record, config in rows:
        seeds = {seed: by for seed, by in _tta_seeds(record).items() if config in by}
        if not seeds:
            raise LookupError(f"{record}: no run of {config}")
        results = {seed: _speed_ups(by, config) for seed, by in seeds.items()}
        losses = [100 * (by[config]["final_test_loss"] / by["ddp"]["final_test_loss"] - 1) for by in seeds.values()]
        run = next(iter(seeds.values()))[config]
        missed = ", ".join(str(seed) for seed, (reached, _) in results.items() if reached is None)
        table.append([label, f"`{config}`", ", ".join(map(str, seeds)), str(run["after"]),
                      f"{run['bits_per_element']:.2f}", _signed(statistics.median(losses)),
                      *(_median_or_dash(ratios[i] for _, ratios in results.values()) for i in range(len(_DDP_LABELS))),
                      missed or "–", f"`{record}`"])
    header = ["recipe", "`--configs`", "seeds", "K", "bits per element", "vs DDP fp32's loss", "time: vs DDP fp32",
              "vs DDP fp16 hook", "target missed on seed", "record (`docs/img/data/`)"]
    return _table(header, ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---", "---"], table)



# -- FSDP2 (scripts/bench_fsdp.py) ----------------------------------------------------------------
_FSDP_STEP = "fsdp2_step_time_gpt2_4x256_1gbit_2hosts_int8_all_gather.jsonl"
_FSDP_BF16_PARAMS = "fsdp2_step_time_gpt2_4x256_1gbit_2hosts_bf16_params_int8_all_gather.jsonl"
_FSDP_ACCURACY = "fsdp2_adamw_convergence_gpt2_4x256_2workers.jsonl"
#: FSDP2's own reductions, as the tables name them
_FSDP = {"fsdp": "FSDP2, fp32", "fsdp-bf16": "FSDP2, bf16 `reduce_dtype`",
         "fsdp-a2a": "FSDP2, fp32 at NCCL's bytes", "fsdp-bf16-a2a": "FSDP2, bf16 at NCCL's bytes"}


def _fsdp_parts(config: str) -> Tuple[str, str]:
    """(reduce-scatter, parameter all-gather) of a bench_fsdp.py configuration."""
    reduce_scatter, _, all_gather = config.partition("@")
    return _FSDP.get(reduce_scatter, f"`{reduce_scatter}`"), all_gather or "FSDP2's"


def _fsdp_runs(record: str, batch: Optional[int] = None) -> List[Dict[str, dict]]:
    """A bench_fsdp.py record as its runs (each starts with FSDP2 fp32, ``fsdp``), by configuration;
    ``batch``: only the runs of that batch."""
    runs: List[Dict[str, dict]] = []
    for row in _ok(record):
        if row["config"] == "fsdp" or not runs:
            runs.append({})
        runs[-1][row["config"]] = row
    return [run for run in runs if batch is None or run["fsdp"].get("batch") == batch]


def _fsdp_speed_up(runs: List[Dict[str, dict]], config: str, base: str) -> Optional[float]:
    """The median over the runs holding both of ``base``'s step over ``config``'s."""
    ratios = [run[base]["step_s"] / run[config]["step_s"] for run in runs if config in run and base in run]
    return statistics.median(ratios) if ratios else None


def fsdp2_step(record: str = _FSDP_STEP, bf16_params: str = _FSDP_BF16_PARAMS, batch: int = 2) -> str:
    """FSDP2's step at 1 Gbit/s per reduce-scatter and parameter all-gather: the median step over the
    runs of ``batch``, the speed-up over FSDP2's fp32 and bf16 reductions (medians of the runs'
    ratios), over reduce-scatters sending NCCL's bytes (the runs that have them) and, with bf16
    parameters, over fp32 / bf16 (its own record); bytes sent per step and parameter; MB of
    error-feedback memory per rank."""
    runs, with_bf16_params = _fsdp_runs(record, batch), _fsdp_runs(bf16_params, batch)

    def speed_ups(source: List[Dict[str, dict]], config: str, bases: Sequence[str]) -> str:
        ratios = [_fsdp_speed_up(source, config, base) for base in bases]
        return " / ".join("–" if r is None else _x(r) for r in ratios)

    rows = []
    for config in dict.fromkeys(c for run in runs for c in run):
        measured = [run[config] for run in runs if config in run]
        reduce_scatter, all_gather = _fsdp_parts(config)
        rows.append([reduce_scatter, all_gather, f"{statistics.median(r['step_s'] for r in measured):.3f}",
                     speed_ups(runs, config, ("fsdp", "fsdp-bf16")),
                     speed_ups(runs, config, ("fsdp-a2a", "fsdp-bf16-a2a")),
                     speed_ups(with_bf16_params, config, ("fsdp", "fsdp-bf16")),
                     f"{statistics.median(statistics.mean(r['sent_bytes_per_param']) for r in measured):.2f}",
                     f"{max(max(r['memory_mb']) for r in measured):.1f}"])
    header = ["reduce-scatter", "all-gather", f"step s (batch {batch}, median of {len(runs)} runs)",
              "vs FSDP2 fp32 / bf16", "vs fp32 / bf16 at NCCL's bytes", "bf16 parameters: vs fp32 / bf16",
              "bytes per step and parameter", "memory MB"]
    return _table(header, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


def fsdp2_bytes(record: str = "fsdp2_bytes_per_rank_gpt2_4x256_2_4_8_hosts.jsonl") -> str:
    """Bytes each rank sent per step and parameter (headers included) per reduce-scatter,
    all-gather and number of ranks."""
    by = {(row["config"], row["world"]): statistics.mean(row["sent_bytes_per_param"]) for row in _ok(record)}
    worlds = sorted({world for _, world in by})
    rows = (list(_fsdp_parts(config)) + [f"{by[(config, w)]:.2f}" if (config, w) in by else "–" for w in worlds]
            for config in dict.fromkeys(config for config, _ in by))
    return _table(["reduce-scatter", "all-gather", *(f"{w} ranks" for w in worlds)],
                  ["---", "---", *["---:"] * len(worlds)], rows)


#: the configurations of :func:`fsdp2_accuracy`, in its order
_FSDP_ACCURACY_ROWS = ("fsdp", "fsdp-bf16", "none@int8", "qsgd@int8", "qsgd:levels=7", "qsgd:levels=7@int8",
                       "qsgd:levels=7+residual", "topk@int8", "topk+averaged@int8")


def fsdp2_accuracy(record: str = _FSDP_ACCURACY, configs: Sequence[str] = _FSDP_ACCURACY_ROWS) -> str:
    """Final validation loss of GPT-2 under FSDP2 with AdamW per reduce-scatter and all-gather,
    against FSDP2 fp32's (one seed)."""
    by = {row["config"]: row for row in _ok(record)}
    base = by["fsdp"]["final_test_loss"]
    rows = (list(_fsdp_parts(c)) + [f"{by[c]['final_test_loss']:.4f}",
                                    "–" if c == "fsdp" else _signed(100 * (by[c]["final_test_loss"] / base - 1))]
            for c in configs)
    return _table(["reduce-scatter", "all-gather", "validation loss", "vs FSDP2 fp32"],
                  ["---", "---", "---:", "---:"], rows)


# -- GPU (bash scripts/gpu_check.sh) --------------------------------------------------------------
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
        run = _json(record)
        tests = run["stages"]["tests"]
        counts = f"{tests['passed']} / {tests['failed']} / {tests['skipped']}"
        ratios = [row["ratio"] for model in run["stages"]["codecs"]["models"].values() for row in model["rows"]]
        rows.append([run["device"]["name"], run["device"]["torch"], run["status"],
                     counts + (f" ({tests['problem']})" if tests.get("problem") else ""),
                     _span(ratios, lambda r: f"{r:.0f}x"), f"`{record}`"])
    header = ["GPU", "torch", "verdict", "CUDA tests passed / failed / skipped", "merged vs layer-wise, codec work",
              "record (`docs/img/data/`)"]
    return _table(header, ["---", "---", "---", "---", "---:", "---"], rows)


def gpu_training(records: Sequence[str] = _GPU_RUNS) -> str:
    """Stage 3 of each gpu_check run: ms per training step on one GPU (the local engine, every
    collective the identity) and its ratio to plain torch with the same optimizer, per model."""
    runs = [_json(record) for record in records]
    columns = [(run["device"]["name"].replace("NVIDIA ", ""), model, {row["config"]: row for row in rows["rows"]})
               for run in runs for model, rows in run["stages"]["training"]["models"].items()]
    rows = ([label] + [f"{by[config]['ms_per_step']:.1f} ({_x(by[config]['x_torch'])})" for _, _, by in columns]
            for label, config in _GPU_ROWS)
    return _table(["configuration", *(f"{gpu}, {model}: ms (x torch)" for gpu, model, _ in columns)],
                  ["---"] + ["---:"] * len(columns), rows)


# -- the codecs' own work (scripts/bench_compressors.py) ------------------------------------------
def codec_work(record: str = "codec_encode_decode_resnet50_memory.json") -> str:
    """One rank's encode, error-feedback memory and decode of ResNet-50's gradients per compressor:
    a memcpy of the same floats timed beside it, layer-wise and merged into 1, 2 and 4 groups (ms,
    the median of the runs), the best merged plan over the memcpy, layer-wise over the best merged,
    and the target the best merged plan was held to."""
    rows = []
    for row in _json(record)["results"]:
        ms = row["ms"]
        target = row.get("target_x_memcpy")
        rows.append([_name(row["compressor"]), row["memory"], f"{row['memcpy_ms']:.1f}",
                     *(f"{ms[plan]:.1f}" for plan in ("layerwise", "merged1", "merged2", "merged4")),
                     _x(row["best_x_memcpy"]), _x(row["layerwise_x_best"]),
                     f"<= {target:g}x: {'met' if row['pass_target'] else 'missed'}" if target else "–"])
    header = ["compressor", "memory", "memcpy ms", "layer-wise ms", "1 group ms", "2 groups ms", "4 groups ms",
              "best merged / memcpy", "layer-wise / best merged", "target"]
    return _table(header, ["---", "---", *["---:"] * 7, "---"], rows)


# -- the summary: which configuration for which optimizer and link --------------------------------
#: the time-to-accuracy configuration the summary quotes
_HEADLINE = "onebit@momentum/64^qsgd"


def _gave_sgd_slow() -> str:
    mean = _means(_ANCHORS)
    fast = [("1gbit", c, "auto") for c in ("signsgd", "onebit", "efsignsgd")]
    digits = _convergence_runs(_DIGITS)
    vs = {c: _vs_fp32_text(_default_memory(digits, c), digits[_FP32]) for c in ("onebit", "efsignsgd", "signsgd")}
    return (f"ResNet-50, 2 workers: {_span((mean[_ddp('1gbit')] / mean[k] for k in fast), _x)} DDP fp32's step, "
            f"up to {_x(max(mean[_anchor('1gbit')] / mean[k] for k in fast))} DDP with PyTorch's PowerSGD hook "
            f"([throughput](#throughput-against-the-ddp-anchors)); on digits 1-bit SGD {vs['onebit']} and EF-signSGD "
            f"{vs['efsignsgd']} from fp32's accuracy, signSGD {vs['signsgd']} ([convergence](#convergence))")


def _gave_sgd_fast() -> str:
    ddp, runs = _auto_vs_ddp(_TEN_GBIT)
    ratios = {c: statistics.mean(ddp) / run["step_s"] for c, run in runs}
    slow, fast = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    return (f"{_x(ratios[slow])} ({_name(slow)}) to {_x(ratios[fast])} ({_name(fast)}) DDP fp32's step "
            f"([every compressor](#every-compressor-at-10-gbits))")


def _gave_adam() -> str:
    _, differs, steps, record = _AUTO_SETTINGS[0]
    setting = {**_ADAM_DEFAULTS, **differs}
    runs = [measured for measured in _auto_runs(setting, steps, record).values() if measured]
    baseline = _adamw(_adam_records(), setting, steps)
    deltas = [statistics.median(_vs_adamw(measured, baseline, record)) for measured in runs]
    bits = [statistics.median(r["bits_per_element"] for r in measured) for measured in runs]
    seeds = [_speed_ups(by, _HEADLINE)[1] for by in _tta_seeds(_TTA).values()]
    vs_ddp, vs_fp16 = (_median_or_dash(s[i] for s in seeds) for i in range(2))
    return (f"{_span(deltas, _signed)} from AdamW's loss at {_span(bits, lambda b: f'{b:.2f}')} bits per element "
            f"([Adam](#adam-and-adamw-exchanging-the-momentum)); exchanging the momentum, 1-bit SGD reached DDP "
            f"fp32's loss {vs_ddp} sooner than DDP fp32 and {vs_fp16} sooner than its fp16 hook at 1 Gbit/s "
            f"([time to accuracy](#time-to-accuracy-adamw-on-the-1-gbits-cluster))")


def _gave_adam_gradients() -> str:
    runs = _convergence_runs(_LM)
    fp32 = runs[_FP32]
    vs = [_vs_fp32_text(_default_memory(runs, c), fp32) for c in ("fp16", "bf16", "qsgd")]
    feedback = [_vs_fp32(seeds, fp32) for (c, memory), seeds in runs.items() if memory != "none"]
    return (f"{' / '.join(vs)} from fp32's loss; error feedback on Adam's gradients ends {_span(feedback, _signed)} "
            f"([convergence](#byte-level-gpt-2-on-cpythons-standard-library-transformers-adam))")


def _gave_fsdp() -> str:
    runs = _fsdp_runs(_FSDP_STEP, 2)
    ratios = [_x(_fsdp_speed_up(runs, "qsgd@int8", base)) for base in _FSDP]
    loss = {row["config"]: row["final_test_loss"] for row in _ok(_FSDP_ACCURACY)}
    vs_fp32 = _signed(100 * (loss["qsgd@int8"] / loss["fsdp"] - 1))
    return (f"{ratios[0]} FSDP2 fp32's step and {ratios[1]} its bf16 reduction's ({ratios[2]} / {ratios[3]} against "
            f"reduce-scatters sending NCCL's bytes), {vs_fp32} validation loss "
            f"([FSDP2](#fsdp2-compressed-reduce-scatter-at-1-gbits))")


def _gave_none() -> str:
    rows = _records(_OWN_WORK)
    x = {config: [r["x"] for r in rows if r["config"] == config and r["model"] in _NARROW]
         for config in ("none", "ddp sgd")}
    return (f"our own work {_span(x['none'], _x)} torch's step, DDP's {_span(x['ddp sgd'], _x)} "
            f"([own work](#mergecomps-own-work-per-step-one-process-no-network))")


#: the decision table's rows: optimizer, link, what to use, what it gave
_SUMMARY: Tuple[Tuple[str, str, str, Callable[[], str]], ...] = (
    ("SGD (momentum)", "1 Gbit/s or slower",
     '`compression="signsgd"`, `"onebit"` or `"efsignsgd"`, `groups="auto"` (the default)', _gave_sgd_slow),
    ("SGD", "10 Gbit/s or faster", 'any compressor, `groups="auto"`', _gave_sgd_fast),
    ("Adam / AdamW", "any", '`exchange_momentum_after="auto"` with `onebit`, `topk` or `powersgd`', _gave_adam),
    ("Adam / AdamW, gradients exchanged", "any", "only `fp16`, `bf16` or `qsgd`", _gave_adam_gradients),
    ("FSDP2 with AdamW", "1 Gbit/s", '`mc.fsdp.compress(model, compression="qsgd", all_gather="int8")`', _gave_fsdp),
    ("anything", "a fast link, no compression wanted", '`compression="none"`', _gave_none),
)


def summary() -> str:
    """The decision table: which configuration for which optimizer and link, and what it gave in
    the tables of docs/benchmarks.md, computed from their records."""
    rows = ([optimizer, link, use, gave()] for optimizer, link, use, gave in _SUMMARY)
    return _table(["you train with", "over", "use", "what it gave here"], ["---", "---", "---", "---"], rows)


#: every table a doc may hold, by the name its markers give
TABLES: Dict[str, Callable[[], str]] = {
    "summary": summary,
    "throughput-anchors": throughput_anchors,
    "throughput-repeats": throughput_repeats,
    "every-compressor": every_compressor,
    "scaling": scaling,
    "schemes-by-ranks": schemes_by_ranks,
    "schemes-4-hosts": schemes_fixed_vs_auto,
    "schemes-2x2-hosts": plans,
    "scheduler-vs-sweep": scheduler_summary,
    "convergence-digits": lambda: convergence(_DIGITS, (
        ("`compression_warmup_steps=100`", "convergence_digits_warmup_exempt_2workers.jsonl", {"warmup_steps": 100}),
        ('`uncompressed=["*.bias", "fc3.*"]`', "convergence_digits_warmup_exempt_2workers.jsonl",
         {"uncompressed": "*.bias,fc3.*"}))),
    "convergence-lm": lambda: convergence(_LM, (
        ("`compression_warmup_steps=100`", "convergence_stdlib_bytes_topk_warmup_ratio_2workers.jsonl",
         {"warmup_steps": 100}),)),
    "memories": lambda: memories({"Adam (GPT-2)": "convergence_stdlib_bytes_gpt2_memories_2workers.jsonl",
                                  "SGD (digits)": "convergence_digits_averaged_memory_2workers.jsonl"}),
    "own-work": own_work,
    "compatibility-routes": compatibility.routes,
    "front-end-options": compatibility.front_end_options,
    "adam-auto": adam_auto,
    "adam-momentum-exchange": adam_momentum_exchange,
    "time-to-accuracy": lambda: time_to_accuracy(
        _TTA,
        {_HEADLINE: "mergecomp 1-bit SGD, momentum exchanged",
         "terngrad:packing=base3@momentum+residual/40^qsgd": "mergecomp TernGrad (base 3), momentum exchanged"},
        bold=(_HEADLINE,)),
    "time-to-accuracy-trainer-route": lambda: time_to_accuracy(
        "time_to_accuracy_gpt2_4x256_batch2_1gbit_trainer_route.jsonl",
        {"hook:onebit@auto": "1-bit SGD `\"auto\"` through the DDP hook",
         "onebit@auto": "1-bit SGD `\"auto\"` through `DistributedOptimizer`"},
        bold=("hook:onebit@auto",)),
    "time-to-accuracy-recipes": time_to_accuracy_recipes,
    "codec-work": codec_work,
    "fsdp2-step": fsdp2_step,
    "fsdp2-bytes": fsdp2_bytes,
    "fsdp2-accuracy": fsdp2_accuracy,
    "gpu-runs": gpu_runs,
    "gpu-training": gpu_training,
}


def render_file(path: Path, check: bool = False) -> List[str]:
    """Every rendered block of the Markdown file ``path`` from today's records: written back
    unless ``check``; returns the names of the blocks that differed (unknown names raise)."""
    text = path.read_text()
    stale: List[str] = []

    def fill(match: "re.Match[str]") -> str:
        name = match.group("name")
        if name not in TABLES:
            raise LookupError(f"{path.name}: no table named {name!r}; known: {sorted(TABLES)}")
        body = TABLES[name]()
        if body != match.group("body"):
            stale.append(name)
        return match.group(1) + body + match.group(4)

    rendered = _BLOCK.sub(fill, text)
    if not check and rendered != text:
        path.write_text(rendered)
    return stale
