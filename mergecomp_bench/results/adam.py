"""Compression with Adam and AdamW by exchanging the momentum (``scripts/bench_adam.py``): what
``exchange_momentum_after="auto"`` gives against uncompressed AdamW, and what the exchange needs."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Tuple

from mergecomp_bench.results.data import named, records
from mergecomp_bench.results.markdown import signed, table

__all__ = ["adam_auto", "adam_momentum_exchange", "recipes_on_their_own_run"]

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
    return [r for name in named("adam_*.jsonl") for r in records(name) if r.get("status") == "ok"]


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
    every = _adam_records()
    rows = []
    for label, differs, steps, record in _AUTO_SETTINGS:
        setting = {**_ADAM_DEFAULTS, **differs}
        runs = _auto_runs(setting, steps, record)
        seeds_of_row = {r["seed"] for measured in runs.values() for r in measured}
        if not seeds_of_row:
            raise LookupError(f"{record}: no run of today's recipes")
        baseline = _adamw(every, setting, steps)
        cells = [_auto_cell(measured, baseline, record) if measured else "–" for measured in runs.values()]
        seeds = (f"seed {min(seeds_of_row)}" if len(seeds_of_row) == 1
                 else f"median of seeds {', '.join(map(str, sorted(seeds_of_row)))}")
        rows.append([f"{label}, {seeds}", *cells, f"`{record}`"])
    header = ["setting (`bench_adam.py` flags)", *(f"`{c}`" for c in _AUTO_COMPRESSORS), "record (`docs/img/data/`)"]
    return table(header, ["---", *["---:"] * len(_AUTO_COMPRESSORS), "---"], rows)


def recipes_on_their_own_run() -> List[Tuple[float, float]]:
    """Per compressor measured with today's recipe on the recipes' own setting (the first row of
    :func:`adam_auto`): the median difference from uncompressed AdamW (per cent) and the median
    bits per element."""
    _, differs, steps, record = _AUTO_SETTINGS[0]
    setting = {**_ADAM_DEFAULTS, **differs}
    baseline = _adamw(_adam_records(), setting, steps)
    return [(statistics.median(_vs_adamw(measured, baseline, record)),
             statistics.median(r["bits_per_element"] for r in measured))
            for measured in _auto_runs(setting, steps, record).values() if measured]


def _adamw(every: List[dict], setting: Dict[str, object], steps: int) -> Dict[int, float]:
    """Uncompressed AdamW's final validation loss per seed, in one setting."""
    return {r["seed"]: r["final_test_loss"] for r in every
            if r["config"] == "none@grad" and _setting(r) == setting and r["steps"] == steps}


def _auto_runs(setting: Dict[str, object], steps: int, record: str) -> Dict[str, List[dict]]:
    """Each compressor's runs in ``record`` of the recipe ``"auto"`` gives it today."""
    measured = records(record)
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
    middle = signed(statistics.median(deltas))
    bits = f"{statistics.median(r['bits_per_element'] for r in runs):.2f} bits"
    worst = f"worst {signed(max(deltas))}; " if len(runs) > 1 else ""
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
    runs_of = [r for r in _adam_records() if _setting(r) == _ADAM_DEFAULTS and r["steps"] == steps]
    baseline = _adamw(runs_of, _ADAM_DEFAULTS, steps)
    rows = []
    for label, config, after in _EXCHANGE_ROWS:
        runs = [r for r in runs_of if r["config"] == config and r["after"] == after]
        if not runs:
            raise LookupError(f"no bench_adam.py run of {config} with K = {after}")
        bits = statistics.median(r["bits_per_element"] for r in runs)
        rows.append([label, f"`{config}`", "–" if after is None else str(after),
                     ", ".join(str(r["seed"]) for r in runs), f"{bits:.2f}",
                     signed(statistics.median(_vs_adamw(runs, baseline, config)))])
    header = ["configuration", "`bench_adam.py --configs`", "K", "seeds", "bits per element", "vs AdamW"]
    return table(header, ["---", "---", "---:", "---", "---:", "---:"], rows)
