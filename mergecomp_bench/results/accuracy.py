"""How close each compressor trains to fp32 with its gradients exchanged
(``scripts/bench_convergence.py``): digits with SGD, a byte-level GPT-2 with Adam, the
error-feedback memories."""
from __future__ import annotations

import math
import statistics
from typing import Dict, Sequence, Tuple

from mergecomp_bench.results.data import finished
from mergecomp_bench.results.markdown import compressor_name, median_span, signed, table

__all__ = ["DIGITS", "LM", "FP32", "DIGITS_VARIANTS", "LM_VARIANTS", "MEMORIES", "Runs", "runs_by_compressor",
           "vs_fp32", "vs_fp32_text", "default_memory", "convergence", "memories", "by_compressor"]

DIGITS = "convergence_digits_mlp_2workers.jsonl"
LM = "convergence_stdlib_bytes_gpt2_2workers.jsonl"
FP32 = ("none", "none")
#: a column of :func:`convergence` beside the record's own: header, record, what its runs have
Variant = Tuple[str, str, Dict[str, object]]
#: the digits table's further columns: with a warm-up, with the biases and the output layer exempt
DIGITS_VARIANTS: Tuple[Variant, ...] = (
    ("`compression_warmup_steps=100`", "convergence_digits_warmup_exempt_2workers.jsonl", {"warmup_steps": 100}),
    ('`uncompressed=["*.bias", "fc3.*"]`', "convergence_digits_warmup_exempt_2workers.jsonl",
     {"uncompressed": "*.bias,fc3.*"}))
#: the language model's: with a warm-up
LM_VARIANTS: Tuple[Variant, ...] = (
    ("`compression_warmup_steps=100`", "convergence_stdlib_bytes_topk_warmup_ratio_2workers.jsonl",
     {"warmup_steps": 100}),)
#: the records of :func:`memories`, by the label of their rows
MEMORIES = {"Adam (GPT-2)": "convergence_stdlib_bytes_gpt2_memories_2workers.jsonl",
            "SGD (digits)": "convergence_digits_averaged_memory_2workers.jsonl"}
#: (compressor, memory) -> seed -> run
Runs = Dict[Tuple[str, str], Dict[int, dict]]


def runs_by_compressor(record: str, **where: object) -> Runs:
    """A bench_convergence.py record's runs by (compressor, memory), then seed; ``where``: what
    they must have besides (``warmup_steps``, ``uncompressed``; by default neither)."""
    where = {"warmup_steps": 0, "uncompressed": "", **where}
    runs: Runs = {}
    for run in finished(record):
        if all(run[field] == value for field, value in where.items()):
            runs.setdefault((run["compressor"], run["memory"]), {})[run["seed"]] = run
    return runs


def vs_fp32(seeds: Dict[int, dict], fp32: Dict[int, dict]) -> float:
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


def vs_fp32_text(seeds: Dict[int, dict], fp32: Dict[int, dict]) -> str:
    """:func:`vs_fp32` in points (``pp``, digits) or per cent (language model)."""
    task = next(iter(seeds.values()))["task"]
    return signed(vs_fp32(seeds, fp32), 2, "pp" if task == "digits" else "%")


def default_memory(runs: Runs, compressor: str) -> Dict[int, dict]:
    """The seeds of ``compressor`` with the one memory it ran with."""
    return next(seeds for (name, _), seeds in runs.items() if name == compressor)


def _lr_note(seeds: Dict[int, dict], fp32: Dict[int, dict]) -> str:
    """`` (lr 0.002)`` where the runs had another learning rate than fp32's."""
    lr = next(iter(seeds.values()))["lr"]
    return "" if lr == next(iter(fp32.values()))["lr"] else f" (lr {lr:g})"


def _metric(seeds: Dict[int, dict]) -> str:
    """Test accuracy % (digits) or validation loss: median (range) over the seeds."""
    runs = list(seeds.values())
    if any(math.isnan(run["final_test_loss"]) for run in runs):
        return "diverged"
    if runs[0]["task"] == "digits":
        return median_span([100 * run["final_acc"] for run in runs], lambda v: f"{v:.2f}")
    return median_span([run["final_test_loss"] for run in runs], lambda v: f"{v:.4f}")


def convergence(record: str, variants: Sequence[Variant] = ()) -> str:
    """Each compressor of a bench_convergence.py record with its default memory: the metric over the
    seeds and its difference from fp32 on the same seed (median); ``variants``: further columns
    (header, record, what its runs have) of the same difference in other runs, against their own
    fp32 runs where they have them."""
    runs = runs_by_compressor(record)
    fp32 = runs[FP32]
    columns = [(header, runs_by_compressor(other, **where)) for header, other, where in variants]
    rows = []
    for (compressor, memory), seeds in runs.items():
        cells = [compressor_name(compressor) + _lr_note(seeds, fp32), memory, _metric(seeds),
                 "–" if seeds is fp32 else vs_fp32_text(seeds, fp32)]
        cells += [vs_fp32_text(other[(compressor, memory)], other.get(FP32, fp32))
                  if (compressor, memory) in other and seeds is not fp32 else "" for _, other in columns]
        rows.append(cells)
    digits = next(iter(fp32.values()))["task"] == "digits"
    header = ["compressor", "memory", "test accuracy %" if digits else "validation loss (nats/byte)",
              "vs fp32, same seed", *(header for header, _ in columns)]
    return table(header, ["---", "---", "---:", "---:", *["---:"] * len(columns)], rows)


def memories(records: Dict[str, str] = MEMORIES) -> str:
    """Each compressor under each error-feedback memory of each bench_convergence.py record (the
    row's label beside it): the median over seeds of its difference from fp32 on the same seed."""
    runs = {label: runs_by_compressor(record) for label, record in records.items()}
    kinds = dict.fromkeys(memory for by in runs.values() for compressor, memory in by if compressor != "none")
    rows = []
    for label, by in runs.items():
        fp32 = by[FP32]
        for compressor in dict.fromkeys(c for c, _ in by if c != "none"):
            rows.append([f"{compressor_name(compressor)}, {label}"] + [
                vs_fp32_text(by[(compressor, m)], fp32) if (compressor, m) in by else "–" for m in kinds])
    return table(["compressor", *(f"`{m}`" for m in kinds)], ["---"] + ["---:"] * len(kinds), rows)


#: the rows of :func:`by_compressor`: the compressors of a row (their cells joined by " / "), when to use them
_ADVICE: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("none",), "the default: lossless"),
    (("fp16", "bf16"), "safe"),
    (("qsgd",), "safe with SGD; close with Adam"),
    (("terngrad",), "SGD; with Adam: exchange the momentum"),
    (("topk",), "SGD; with Adam: exchange the momentum"),
    (("dgc",), "SGD with momentum; **not with Adam**"),
    (("randk",), "only with the biases and the output layer exempt; **not with Adam**"),
    (("efsignsgd",), "SGD; with Adam: exchange the momentum"),
    (("onebit",), "SGD; with Adam: exchange the momentum"),
    (("powersgd",), "SGD; with Adam: exchange the momentum increment"),
    (("acpsgd",), "SGD; **not with Adam**"),
    (("signsgd", "signum"), "small learning rates only; **not with Adam**"),
)


def by_compressor(advice: Sequence[Tuple[Tuple[str, ...], str]] = _ADVICE) -> str:
    """Each compressor with its default memory in both convergence benchmarks, digits with SGD
    and the byte-level GPT-2 with Adam: the difference from fp32 on the same seed (median), and
    when to use it."""
    benchmarks = [runs_by_compressor(DIGITS), runs_by_compressor(LM)]

    def cell(runs: Runs, compressors: Sequence[str]) -> str:
        if (compressors[0], "none") == FP32:
            return "–"
        return " / ".join(vs_fp32_text(seeds, runs[FP32]) + _lr_note(seeds, runs[FP32])
                          for seeds in (default_memory(runs, c) for c in compressors))

    rows = ([" / ".join(f"`{c}`" for c in compressors), *(cell(runs, compressors) for runs in benchmarks), use]
            for compressors, use in advice)
    header = ["compressor", "digits (SGD): accuracy vs fp32", "byte GPT-2 (Adam): validation loss vs fp32", "use"]
    return table(header, ["---", "---:", "---:", "---"], rows)
