"""Compression with Adam and AdamW by exchanging the momentum (``scripts/bench_adam.py``): what
``exchange_momentum_after="auto"`` gives against uncompressed AdamW, and what the exchange needs."""
from __future__ import annotations

import functools
import statistics
from typing import Dict, List, Optional, Sequence, Set, Tuple

from mergecomp_bench.results.data import named, records
from mergecomp_bench.results.markdown import median_span, seed_list, signed, table

__all__ = ["BY_COMPRESSOR", "NOISE_CONFIG", "SHORT_RUN", "SHORT_RUN_RECORDS", "WARM_UPS", "BETA2_095",
           "BETA2_095_RECORD", "BETA2_095_ROWS", "WITHOUT_FLOOR_RECORD", "WITHOUT_FLOOR_ROWS", "adam_auto",
           "adam_momentum_exchange", "recipes_on_their_own_run"]

#: bench_adam.py's defaults, which records made before it wrote its setting leave out
_ADAM_DEFAULTS = {"frontend": "optimizer", "model": "gpt2", "corpus": "stdlib", "layers": 4, "lr": 1e-3,
                  "beta2": 0.999, "clip": None, "batch": 8, "workers": 2}
#: AdamW's gradients rounded to fp16 (DDP's fp16 hook), no exchange: the column of :func:`adam_auto`
#: that shows how far a change of the numerics too small to matter moves a setting's final loss
NOISE_CONFIG = "fp16@grad"
#: the compressors of :func:`adam_auto`'s columns
_AUTO_COMPRESSORS = ("onebit", "efsignsgd", "topk", "powersgd", "terngrad")
#: what a cell calls a warm-up codec (``compression_warmup_codec``) other than today's recipe's
_CODEC_NAMES = {"none": "lossless", "fp16": "fp16", "qsgd": "8-bit QSGD", "qsgd4": "4-bit QSGD"}
#: its rows: label, the setting (what differs from the defaults), updates, the record of its runs
_AUTO_SETTINGS: Tuple[Tuple[str, Dict[str, object], int, str], ...] = (
    ("GPT-2 4 x 256, lr 1e-3, 2,000 updates (the recipes' own)", {}, 2000, "adam_gpt2_4x256_auto_2workers.jsonl"),
    ("3 x 256, lr 1.5e-3 (AdamW's best here of 1e-3, 1.5e-3 and 3e-3), clip 1.0, 600 updates "
     "(`--layers 3 --lr 1.5e-3 --clip 1.0 --steps 600`)",
     {"layers": 3, "lr": 1.5e-3, "clip": 1.0}, 600, "adam_gpt2_3x256_tuned_lr_auto_2workers.jsonl"),
    ("the same, half as long (`--steps 300`: K = 75)",
     {"layers": 3, "lr": 1.5e-3, "clip": 1.0}, 300, "adam_gpt2_3x256_300_updates_tuned_lr_auto_2workers.jsonl"),
    ("the same, twice as long (`--steps 1200`: K = 150)",
     {"layers": 3, "lr": 1.5e-3, "clip": 1.0}, 1200, "adam_gpt2_3x256_1200_updates_tuned_lr_auto_2workers.jsonl"),
    ("3 x 256 at lr 3e-3, past AdamW's best, 600 updates (`--layers 3 --lr 3e-3 --clip 1.0 --steps 600`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0}, 600, "adam_gpt2_3x256_auto_2workers.jsonl"),
    ("the same on 4 ranks x batch 4 (`--workers 4 --batch 4`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "workers": 4, "batch": 4}, 600, "adam_gpt2_3x256_auto_4workers.jsonl"),
    ("the same with beta2 = 0.95 (`--beta2 0.95`, R = 8)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "beta2": 0.95}, 600, "adam_gpt2_3x256_beta2_095_2workers.jsonl"),
    ("the same with a Llama (rotary positions, RMSNorm, SwiGLU, untied embeddings; `--model llama`)",
     {"model": "llama", "layers": 3, "lr": 3e-3, "clip": 1.0}, 600, "adam_llama_3x256_auto_2workers.jsonl"),
    ("the same with a convolutional ResNet, no attention (dilated causal convolutions in residual blocks; "
     "`--model convnet`)",
     {"model": "convnet", "layers": 3, "lr": 3e-3, "clip": 1.0}, 600, "adam_convnet_3x256_auto_2workers.jsonl"),
    ("the same GPT-2 on English prose (the Python reference's text; `--corpus prose`)",
     {"corpus": "prose", "layers": 3, "lr": 3e-3, "clip": 1.0}, 600, "adam_gpt2_3x256_prose_auto_2workers.jsonl"),
    ("the same GPT-2 on twice the batch (`--batch 16`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "batch": 16}, 600, "adam_gpt2_3x256_batch16_auto_2workers.jsonl"),
    ("the same GPT-2 on four times the batch (`--batch 32`)",
     {"layers": 3, "lr": 3e-3, "clip": 1.0, "batch": 32}, 600, "adam_gpt2_3x256_batch32_auto_2workers.jsonl"),
    ("GPT-2 3 x 256, lr 1e-3, clip 1.0, 1,500 updates through `mc.DistributedOptimizer`, this script's loop "
     "(`--layers 3 --steps 1500 --clip 1.0`)",
     {"layers": 3, "clip": 1.0}, 1500, "adam_gpt2_3x256_1500_updates_auto_2workers.jsonl"),
    ("the same GPT-2 through the transformers `Trainer`: its AdamW, schedule and clipping "
     "at 1.0, `register(trainer, \"onebit\")` (its default, `\"auto\"`) against plain DDP "
     "(`--frontend trainer --layers 3 --steps 1500`)",
     {"frontend": "trainer", "layers": 3, "clip": 1.0}, 1500, "adam_trainer_gpt2_3x256_2workers.jsonl"),
    ("the same GPT-2 through Accelerate: `prepare`, `backward`, `clip_grad_norm_(1.0)`, "
     "`register(accelerator, model, \"onebit\", optimizer=opt)` (its default, `\"auto\"`) against plain DDP, "
     "this script's windows and schedule (`--frontend accelerate --layers 3 --steps 1500 --clip 1.0`)",
     {"frontend": "accelerate", "layers": 3, "clip": 1.0}, 1500, "adam_accelerate_gpt2_3x256_2workers.jsonl"),
    ("the same through Lightning: a `LightningModule`, `gradient_clip_val=1.0`, "
     "`strategy=MergecompDDPStrategy(\"onebit\")` (its default, `\"auto\"`) against its `DDPStrategy` "
     "(`--frontend lightning --layers 3 --steps 1500 --clip 1.0`)",
     {"frontend": "lightning", "layers": 3, "clip": 1.0}, 1500, "adam_lightning_gpt2_3x256_2workers.jsonl"),
)


def _setting(record: dict) -> Dict[str, object]:
    return {**_ADAM_DEFAULTS, **(record.get("setting") or {})}


def _adam_records(names: Sequence[str] = ()) -> List[dict]:
    """The finished runs of the records ``names``, else of every bench_adam.py record."""
    return [r for name in names or named("adam_*.jsonl") for r in records(name) if r.get("status") == "ok"]


def _auto_now(compressor: str, setting: Dict[str, object], steps: int) -> Tuple[int, Optional[int], str]:
    """The warm-up K, refresh interval R and warm-up codec ``"auto"`` gives ``compressor`` today
    on a bench_adam.py run of ``steps`` updates with ``setting``: a record made with another K or
    R measured another recipe."""
    from mergecomp.torch.momentum_exchange import refresh_limit
    from mergecomp.torch.momentum_recipes import RECIPES, choose

    lr_warmup = max(1, steps // 20)  # bench_adam.py's LR warm-up
    _, options, _ = choose(compressor, {"exchange_momentum_after": "auto", "lr_warmup_steps": lr_warmup,
                                        "total_steps": steps}, "render")
    refresh = RECIPES[compressor].refresh_every
    return (options["exchange_momentum_after"], None if refresh is None else min(refresh, refresh_limit(setting["beta2"])),
            options["compression_warmup_codec"])


@functools.lru_cache(maxsize=None)
def _codecs_by_record() -> Dict[str, str]:
    """Each ``compression_warmup_codec`` by what bench_adam.py records of it (its compressor's repr)."""
    from mergecomp.exchange.plan import UNFED
    from mergecomp.pipeline.options import WARMUP_CODECS
    from mergecomp.registry import get_compressor

    return {repr(get_compressor(UNFED[route][0], **UNFED[route][1])): codec for codec, route in WARMUP_CODECS.items()}


def _codec_of(run: dict) -> str:
    """The ``compression_warmup_codec`` of a bench_adam.py ``@auto`` run (which records the codec's
    compressor; runs recorded before it did were made when every recipe's was 8-bit QSGD)."""
    return _codecs_by_record()[run["warmup_codec"]] if "warmup_codec" in run else "qsgd"


def adam_auto() -> str:
    """``exchange_momentum_after="auto"`` against uncompressed AdamW on each setting of
    :data:`_AUTO_SETTINGS`: the validation loss's difference on the same seed (median over the
    seeds, the worst seed beside it where there are several) and bits per element over the run,
    from the runs of today's recipe (its K and R; a warm-up codec other than today's named) in
    the setting's record."""
    every = _adam_records()
    rows = []
    for label, differs, steps, record in _AUTO_SETTINGS:
        setting = {**_ADAM_DEFAULTS, **differs}
        runs = _auto_runs(setting, steps, record)
        seeds_of_row = {r["seed"] for measured, _ in runs.values() for r in measured}
        if not seeds_of_row:
            raise LookupError(f"{record}: no run of today's recipes")
        baseline = _adamw(every, setting, steps)
        cells = [_auto_cell(measured, baseline, record, seeds_of_row) if measured else "–"
                 for measured, _ in runs.values()]
        seeds = seed_list(seeds_of_row) if len(seeds_of_row) == 1 else f"median of {seed_list(seeds_of_row)}"
        rows.append([f"{label}, {seeds}{_other_codecs(runs)}", *cells, _noise_cell(setting, steps, record, baseline),
                     f"`{record}`"])
    header = ["setting (`bench_adam.py` flags)", *(f"`{c}`" for c in _AUTO_COMPRESSORS),
              f"fp16 gradients, no exchange (`{NOISE_CONFIG}`): the noise", "record (`docs/img/data/`)"]
    return table(header, ["---", *["---:"] * (len(_AUTO_COMPRESSORS) + 1), "---"], rows)


def _other_codecs(runs: Dict[str, Tuple[List[dict], str]]) -> str:
    """``", measured with the 8-bit QSGD warm-up ("auto"'s today: 4-bit QSGD)"`` where a row's
    runs (:func:`_auto_runs`) used a warm-up codec other than the one ``"auto"`` gives today."""
    other = {(_codec_of(r), codec) for measured, codec in runs.values() for r in measured} - {
        (codec, codec) for _, codec in runs.values()}
    return "".join(f", measured with the {_CODEC_NAMES[was]} warm-up (`\"auto\"`'s today: {_CODEC_NAMES[now]})"
                   for was, now in sorted(other))


def _noise_cell(setting: Dict[str, object], steps: int, record: str, baseline: Dict[int, float]) -> str:
    """The setting's noise: :data:`NOISE_CONFIG`'s runs in ``record`` against uncompressed AdamW
    on their seeds, ``median (lo to hi)`` in per cent ("–" without such runs)."""
    runs = _runs(records(record), NOISE_CONFIG, setting, steps)
    if not runs:
        return "–"
    cell = median_span(_vs_adamw(runs, baseline, record), signed)
    seeds = {r["seed"] for r in runs}
    return cell if len(seeds) > 1 else f"{cell} ({seed_list(seeds)})"


def recipes_on_their_own_run() -> List[Tuple[float, float]]:
    """Per compressor measured with today's recipe on the recipes' own setting (the first row of
    :func:`adam_auto`): the median difference from uncompressed AdamW (per cent) and the median
    bits per element."""
    _, differs, steps, record = _AUTO_SETTINGS[0]
    setting = {**_ADAM_DEFAULTS, **differs}
    baseline = _adamw(_adam_records(), setting, steps)
    return [(statistics.median(_vs_adamw(measured, baseline, record)),
             statistics.median(r["bits_per_element"] for r in measured))
            for measured, _ in _auto_runs(setting, steps, record).values() if measured]


def _adamw(every: List[dict], setting: Dict[str, object], steps: int) -> Dict[int, float]:
    """Uncompressed AdamW's final validation loss per seed, in one setting."""
    return {r["seed"]: r["final_test_loss"] for r in _runs(every, "none@grad", setting, steps)}


def _runs(rows: List[dict], config: str, setting: Dict[str, object], steps: int) -> List[dict]:
    """The runs of ``config`` among ``rows`` made with ``setting`` over ``steps`` updates."""
    return [r for r in rows if r["config"] == config and _setting(r) == setting and r["steps"] == steps]


def _auto_runs(setting: Dict[str, object], steps: int, record: str) -> Dict[str, Tuple[List[dict], str]]:
    """Each compressor's runs in ``record`` of the K and R ``"auto"`` gives it today, and the
    warm-up codec it gives today: the runs with that codec where there are some, else those with
    another."""
    measured = records(record)
    runs = {}
    for compressor in _AUTO_COMPRESSORS:
        after, refresh, codec = _auto_now(compressor, setting, steps)
        recipe = [r for r in _runs(measured, f"{compressor}@auto", setting, steps)
                  if r["after"] == after and r.get("refresh") == refresh]
        runs[compressor] = ([r for r in recipe if _codec_of(r) == codec] or recipe), codec
    return runs


def _vs_adamw(runs: List[dict], baseline: Dict[int, float], record: str) -> List[float]:
    """Each run's validation loss against uncompressed AdamW's on its seed, in per cent."""
    missing = sorted({r["seed"] for r in runs} - set(baseline))
    if missing:
        raise LookupError(f"{record}: no uncompressed AdamW run with seed {missing[0]} of its setting")
    return [100 * (r["final_test_loss"] / baseline[r["seed"]] - 1) for r in runs]


def _auto_cell(runs: List[dict], baseline: Dict[int, float], record: str, row_seeds: Set[int]) -> str:
    """``**+0.83 %** (worst +1.01 %; 1.93 bits)``: bold where the median is within 1 %; the
    cell's seeds named where they are fewer than its row's (``row_seeds``)."""
    deltas = _vs_adamw(runs, baseline, record)
    middle = signed(statistics.median(deltas))
    bits = f"{statistics.median(r['bits_per_element'] for r in runs):.2f} bits"
    worst = f"worst {signed(max(deltas))}; " if len(runs) > 1 else ""
    seeds = {r["seed"] for r in runs}
    only = f"{seed_list(seeds)} only; " if seeds != row_seeds else ""
    return f"{f'**{middle}**' if statistics.median(deltas) <= 1.0 else middle} ({only}{worst}{bits})"


#: a row of :func:`adam_momentum_exchange`: label, bench_adam.py configuration, warm-up K
Row = Tuple[str, str, Optional[int]]
#: what the exchange needs, on bench_adam.py's defaults
_EXCHANGE_ROWS: Tuple[Row, ...] = (
    ("AdamW's gradients through 1-bit SGD", "onebit@grad", None),
    ("momentum exchanged losslessly, variance frozen for good", "none@momentum", 60),
    ("the same, a longer warm-up", "none@momentum", 200),
    ("the same, the variance refreshed (R = 64)", "none@momentum/64", 30),
    ("4-bit QSGD, no memory", "qsgd:levels=7@momentum+none/64", 30),
    ("4-bit QSGD, residual memory, fp16 warm-up", "qsgd:levels=7@momentum+residual/64^fp16", 30),
    ("top-k 1 %", "topk@momentum/64", 30),
    ("PowerSGD rank 1", "powersgd@momentum/64", 30),
)
#: each compressor with the momentum exchanged, on bench_adam.py's defaults
BY_COMPRESSOR: Tuple[Row, ...] = (
    ("lossless", "none@momentum/64", 30),
    ("fp16", "fp16@momentum/64", 30),
    ("4-bit QSGD, residual memory, fp16 warm-up", "qsgd:levels=7@momentum+residual/64^fp16", 30),
    ("4-bit QSGD, no memory", "qsgd:levels=7@momentum+none/64", 30),
    ("TernGrad, residual memory, fp16 warm-up", "terngrad@momentum+residual/64^fp16", 30),
    ("TernGrad base 3, residual memory, 8-bit QSGD warm-up", "terngrad:packing=base3@momentum+residual/40^qsgd", 60),
    ("TernGrad, no memory", "terngrad@momentum+none/64", 30),
    ("top-k 1 %", "topk@momentum/64", 30),
    ("top-k 1 %, averaged memory", "topk@momentum+averaged/64", 30),
    ("top-k 1 %, fp16 warm-up", "topk@momentum/32^fp16", 60),
    ("the same, a longer warm-up", "topk@momentum/32^fp16", 100),
    ("top-k 2 %, 8-bit QSGD warm-up", "topk:ratio=0.02@momentum/32^qsgd", 150),
    ("the same, the increment sent", "topk:ratio=0.02@increment/32^qsgd", 150),
    ("top-k 2.5 % in fp16 (the recipe)", "topk:ratio=0.025;value_dtype=fp16@momentum/32^qsgd", 150),
    ("rand-k 1 %", "randk@momentum/64", 30),
    ("EF-signSGD", "efsignsgd@momentum/64", 30),
    ("EF-signSGD, fp16 warm-up", "efsignsgd@momentum/32^fp16", 30),
    ("the same, a longer warm-up", "efsignsgd@momentum/32^fp16", 60),
    ("1-bit SGD", "onebit@momentum/64", 30),
    ("1-bit SGD, R = 80", "onebit@momentum/80", 30),
    ("1-bit SGD, fp16 warm-up", "onebit@momentum/32^fp16", 60),
    ("1-bit SGD, 4-bit QSGD warm-up", "onebit@momentum/32^qsgd4", 150),
    ("PowerSGD rank 1", "powersgd@momentum/64", 30),
    ("PowerSGD rank 4", "powersgd:rank=4@momentum/64", 30),
    ("the same, fp16 warm-up", "powersgd:rank=4@momentum/32^fp16", 60),
    ("PowerSGD rank 4, the increment sent", "powersgd:rank=4@increment/32^qsgd", 60),
    ("PowerSGD rank 8, the increment sent", "powersgd:rank=8@increment/32^qsgd", 60),
    ("PowerSGD rank 16 in bf16, the increment sent", "powersgd:rank=16;factor_dtype=bf16@increment/32^qsgd", 60),
    ("the same, R = 48 (the recipe)", "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd", 120),
    ("ACP-SGD rank 32 in bf16, the increment sent", "acpsgd:rank=32;factor_dtype=bf16@increment/32^qsgd", 60),
)
#: the short run (``--layers 3 --lr 3e-3 --clip 1.0 --steps 600``) and its records of warm-ups
SHORT_RUN = {"layers": 3, "lr": 3e-3, "clip": 1.0}
SHORT_RUN_RECORDS = ("adam_gpt2_3x256_warmup_length_2workers.jsonl", "adam_gpt2_qsgd4_warmup_2workers.jsonl")
#: its rows: the recipes' warm-up K before its floor of 150 updates, and the warm-up's codec
WARM_UPS: Tuple[Row, ...] = (
    ("1-bit SGD, K before the floor", "onebit@momentum/32^qsgd", 18),
    ("1-bit SGD, fp16 warm-up", "onebit@momentum/32^fp16", 60),
    ("the same, a longer warm-up", "onebit@momentum/32^fp16", 150),
    ("1-bit SGD, 8-bit QSGD warm-up (the recipe)", "onebit@momentum/32^qsgd", 150),
    ("1-bit SGD, 4-bit QSGD warm-up", "onebit@momentum/32^qsgd4", 150),
    ("PowerSGD rank 16 in bf16, the increment sent, K before the floor",
     "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd", 36),
    ("the same, K = 120", "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd", 120),
    ("the same, 4-bit QSGD warm-up", "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd4", 150),
    ("top-k 2.5 % in fp16, K before the floor", "topk:ratio=0.025;value_dtype=fp16@momentum/32^qsgd", 45),
    ("the same, 4-bit QSGD warm-up", "topk:ratio=0.025;value_dtype=fp16@momentum/32^qsgd4", 150),
    ("TernGrad base 3, K before the floor", "terngrad:packing=base3@momentum/40^qsgd", 18),
    ("the same, 4-bit QSGD warm-up", "terngrad:packing=base3@momentum/40^qsgd4", 150),
)
#: the short run with beta2 = 0.95, and its record
BETA2_095 = {**SHORT_RUN, "beta2": 0.95}
BETA2_095_RECORD = "adam_gpt2_3x256_beta2_095_2workers.jsonl"
#: its rows: warm-up and refresh interval against a variance that follows the last 20 gradients
BETA2_095_ROWS: Tuple[Row, ...] = (
    ("lossless momentum exchange", "none@momentum/32", 60),
    ("the same, a longer warm-up", "none@momentum/32", 150),
    ("1-bit SGD, fp16 warm-up", "onebit@momentum/32^fp16", 60),
    ("the same, R = 8", "onebit@momentum/8^fp16", 60),
    ("1-bit SGD, fp16 warm-up", "onebit@momentum/32^fp16", 150),
    ("the same, R = 8", "onebit@momentum/8^fp16", 150),
    ("1-bit SGD, R = 8, K before the floor", "onebit@momentum/8^qsgd", 18),
    ("top-k 2.5 % in fp16, R = 8, K before the floor", "topk:ratio=0.025;value_dtype=fp16@momentum/8^qsgd", 45),
    ("top-k 2.5 % in fp16, R = 32", "topk:ratio=0.025;value_dtype=fp16@momentum/32^qsgd", 150),
    ("PowerSGD rank 16 in bf16, R = 8, K before the floor", "powersgd:rank=16;factor_dtype=bf16@increment/8^qsgd", 36),
    ("PowerSGD rank 16 in bf16, R = 48", "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd", 120),
    ("TernGrad base 3, R = 8, K before the floor", "terngrad:packing=base3@momentum/8^qsgd", 18),
    ("the same, a longer warm-up", "terngrad:packing=base3@momentum/8^qsgd", 60),
    ("the same, the warm-up `\"auto\"` would give it", "terngrad:packing=base3@momentum/8^qsgd", 150),
)
#: the record of the same run before the update's variance floor, and its rows
WITHOUT_FLOOR_RECORD = "adam_gpt2_3x256_beta2_095_without_variance_floor_2workers.jsonl"
WITHOUT_FLOOR_ROWS: Tuple[Row, ...] = (
    ("1-bit SGD, fp16 warm-up", "onebit@momentum/32^fp16", 60),
    ("top-k 2.5 % in fp16, R = 32", "topk:ratio=0.025;value_dtype=fp16@momentum/32^qsgd", 150),
    ("PowerSGD rank 16 in bf16, R = 48", "powersgd:rank=16;factor_dtype=bf16@increment/48^qsgd", 120),
)


def adam_momentum_exchange(rows: Sequence[Row] = _EXCHANGE_ROWS, differs: Optional[Dict[str, object]] = None,
                           steps: int = 2000, records_of: Sequence[str] = ()) -> str:
    """What exchanging AdamW's momentum needs: per configuration and warm-up K of ``rows``, on
    bench_adam.py's defaults but for ``differs`` and runs of ``steps`` updates (``records_of``:
    only those records' runs, else every bench_adam.py record's), its seeds, bits per element over
    the run (median) and validation loss against uncompressed AdamW on the same seed (median, and
    the range where several seeds ran)."""
    setting = {**_ADAM_DEFAULTS, **(differs or {})}
    every = _adam_records()
    baseline = _adamw(every, setting, steps)
    measured = [r for r in (_adam_records(records_of) if records_of else every)
                if _setting(r) == setting and r["steps"] == steps]
    found = []
    for label, config, after in rows:
        runs = [r for r in measured if r["config"] == config and r["after"] == after]
        if not runs:
            raise LookupError(f"no bench_adam.py run of {config} with K = {after}")
        bits = statistics.median(r["bits_per_element"] for r in runs)
        found.append([label, f"`{config}`", "–" if after is None else str(after),
                      ", ".join(str(r["seed"]) for r in runs), f"{bits:.2f}",
                      median_span(_vs_adamw(runs, baseline, config), signed)])
    header = ["configuration", "`bench_adam.py --configs`", "K", "seeds", "bits per element", "vs AdamW"]
    return table(header, ["---", "---", "---:", "---", "---:", "---:"], found)
