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
import re
import statistics
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["DATA", "TABLES", "TARGET", "render_file", "own_work", "adam_auto", "time_to_accuracy", "time_to"]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "img" / "data"
_BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S)


def _records(name: str) -> List[dict]:
    path = DATA / name
    if not path.exists():
        raise LookupError(f"record {path} does not exist")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _signed(value: float, digits: int = 2) -> str:
    """``+0.65 %`` / ``−0.33 %`` (a minus sign, as the docs write it)."""
    text = f"{abs(value):.{digits}f} %"
    return ("−" if value < 0 else "+") + text


def _table(header: Sequence[str], align: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- our own work per step (scripts/bench_host_overhead.py) --------------------------------------
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


def own_work(record: str = "host_overhead_cpu.jsonl", models: Sequence[str] = ("gpt2-12x64", "gpt2-24x56")) -> str:
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
        baseline = {r["seed"]: r["final_test_loss"] for r in records
                    if r["config"] == "none@grad" and _setting(r) == setting and r["steps"] == steps}
        seeds_of_row: set = set()  # the seeds of the row's runs
        cells = []
        measured = _records(record)
        for compressor in _AUTO_COMPRESSORS:
            after, refresh = _auto_now(compressor, setting, steps)
            runs = [r for r in measured if r["config"] == f"{compressor}@auto" and _setting(r) == setting
                    and r["steps"] == steps and r["after"] == after and r.get("refresh") == refresh]
            if not runs:
                cells.append("–")
                continue
            missing = sorted({r["seed"] for r in runs} - set(baseline))
            if missing:
                raise LookupError(f"{record}: no uncompressed AdamW run with seed {missing[0]} of its setting")
            deltas = [100 * (r["final_test_loss"] / baseline[r["seed"]] - 1) for r in runs]
            seeds_of_row.update(r["seed"] for r in runs)
            middle = _signed(statistics.median(deltas))
            bits = f"{statistics.median(r['bits_per_element'] for r in runs):.2f} bits"
            worst = f"worst {_signed(max(deltas))}; " if len(runs) > 1 else ""
            cells.append(f"{f'**{middle}**' if statistics.median(deltas) <= 1.0 else middle} ({worst}{bits})")
        if not seeds_of_row:
            raise LookupError(f"{record}: no run of today's recipes")
        seeds = (f"seed {min(seeds_of_row)}" if len(seeds_of_row) == 1
                 else f"median of seeds {', '.join(map(str, sorted(seeds_of_row)))}")
        rows.append([f"{label}, {seeds}", *cells, f"`{record}`"])
    header = ["setting (`bench_adam.py` flags)", *(f"`{c}`" for c in _AUTO_COMPRESSORS), "record (`docs/img/data/`)"]
    return _table(header, ["---", *["---:"] * len(_AUTO_COMPRESSORS), "---"], rows)


# -- time to accuracy (scripts/bench_time_to_accuracy.py) ----------------------------------------
#: the target of time to accuracy: DDP fp32's final validation loss plus this share
TARGET = 0.01
_DDP_LABELS = {"ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook"}


def time_to(record: dict, target: float) -> Optional[float]:
    """Training seconds of ``record``'s first evaluation at or below ``target``, or None."""
    return next((point["seconds"] for point in record["curve"] if point["test_loss"] <= target), None)


def time_to_accuracy(record: str, labels: Dict[str, str], bold: Sequence[str] = ()) -> str:
    """Each seed's runs of one ``bench_time_to_accuracy.py`` record (those ``labels`` names, in the
    record's order): step time, the share of it above the step without exchange, bits per
    element, final validation loss, and the time to DDP fp32's final loss + 1 % of the same seed,
    against DDP fp32's and the fp16 hook's; ``bold``: configurations whose times are bold."""
    seeds: Dict[int, List[dict]] = {}
    for run in _records(record):
        if run.get("status") == "ok":
            seeds.setdefault(run["seed"], []).append(run)
    rows = []
    for seed, runs in sorted(seeds.items()):
        by = {run["config"]: run for run in runs}
        if "ddp" not in by:
            raise LookupError(f"{record}: no DDP fp32 run for seed {seed}")
        base = by["ddp"]
        target = base["final_test_loss"] * (1 + TARGET)
        anchors = [time_to(by[c], target) if c in by else None for c in ("ddp", "ddp-fp16")]
        for run in runs:
            config = run["config"]
            if config not in {**_DDP_LABELS, **labels}:
                continue
            reached = time_to(run, target)
            ratios = ["–" if reached is None or anchor is None else f"{anchor / reached:.2f}x" for anchor in anchors]
            times = ["not reached" if reached is None else f"{reached:.0f} s", *ratios]
            if config in bold:
                times = [f"**{t}**" if reached is not None else t for t in times]
            bits = {"ddp": "32", "ddp-fp16": "16"}.get(config) or f"{run['bits_per_element']:.2f}"
            loss = run["final_test_loss"]
            rows.append([str(seed), {**_DDP_LABELS, **labels}[config], f"{run['step_s']:.3f}",
                         f"{round(100 * (1 - run['compute_s'] / run['step_s']))} %", bits, f"{loss:.4f}",
                         "–" if config == "ddp" else _signed(100 * (loss / base["final_test_loss"] - 1)), *times])
    header = ["seed", "configuration", "step (s)", "exchange share", "bits per element (run)", "validation loss",
              "vs DDP fp32", "time to target", "vs DDP fp32", "vs DDP fp16 hook"]
    return _table(header, ["---", "---", *["---:"] * 8], rows)


#: every table a doc may hold, by the name its markers give
TABLES: Dict[str, Callable[[], str]] = {
    "own-work": own_work,
    "adam-auto": adam_auto,
    "time-to-accuracy": lambda: time_to_accuracy(
        "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_warmup.jsonl",
        {"onebit@momentum/64^qsgd": "mergecomp 1-bit SGD, momentum exchanged",
         "terngrad:packing=base3@momentum+residual/40^qsgd": "mergecomp TernGrad (base 3), momentum exchanged"},
        bold=("onebit@momentum/64^qsgd",)),
    "time-to-accuracy-trainer-route": lambda: time_to_accuracy(
        "time_to_accuracy_gpt2_4x256_batch2_1gbit_trainer_route.jsonl",
        {"hook:onebit@auto": "1-bit SGD `\"auto\"` through the DDP hook",
         "onebit@auto": "1-bit SGD `\"auto\"` through `DistributedOptimizer`"},
        bold=("hook:onebit@auto",)),
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
