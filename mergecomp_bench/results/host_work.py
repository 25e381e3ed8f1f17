"""mergecomp's own work where the network takes no time: per training step in one process
(``scripts/bench_host_overhead.py``) and per codec, layer-wise against merged
(``scripts/bench_compressors.py``)."""
from __future__ import annotations

import re
from typing import List, Sequence, Tuple

from mergecomp_bench.results.data import document, records
from mergecomp_bench.results.markdown import compressor_name, table, times

__all__ = ["OWN_WORK", "NARROW", "HEADLINE_ROWS", "RESNET50", "RESNET50_ROWS", "own_work", "codec_work"]

OWN_WORK = "host_overhead_cpu.jsonl"
#: the models of :func:`own_work`: two GPT-2s of about the same size, one with twice the tensors
NARROW = ("gpt2-12x64", "gpt2-24x56")
#: a row of :func:`own_work`: label, the configurations shown in it (joined by " / "), bold
Row = Tuple[str, Tuple[str, ...], bool]
_OWN_WORK_ROWS: Tuple[Row, ...] = (
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
    ("**the same through the DDP hook** (`gradient_as_bucket_view=True`)", ("hook onebit momentum",), True),
)
#: the rows the README quotes: plain torch, DDP, mergecomp `none` and top-k with SGD, 1-bit SGD with AdamW
HEADLINE_ROWS = tuple(row for row in _OWN_WORK_ROWS if set(row[1]) <= {
    "torch sgd", "ddp sgd", "none", "topk", "torch adamw", "ddp adamw", "onebit momentum", "hook onebit momentum"})
#: ResNet-50's record: few large tensors, where the codecs' passes over 25.6 M elements weigh most
RESNET50 = "host_overhead_resnet50_cpu.jsonl"
#: its rows: SGD only, 1-bit SGD (the sign codes encode each gradient where it lies) added
RESNET50_ROWS: Tuple[Row, ...] = (*(row for row in _OWN_WORK_ROWS if set(row[1]) <= {"torch sgd", "ddp sgd", "none",
                                                                                      "fp16", "topk"}),
                                  ("mergecomp `onebit` (1-bit SGD)", ("onebit",), False))


def own_work(record: str = OWN_WORK, models: Sequence[str] = NARROW, rows: Sequence[Row] = _OWN_WORK_ROWS) -> str:
    """ms per step, its ratio to plain torch with the same optimizer (``x``) and aten operators
    per step, of each configuration of ``rows`` on each model, from one ``bench_host_overhead.py``
    record."""
    by = {(r["model"], r["config"]): r for r in records(record)}

    def cells(model: str, configs: Sequence[str], bold: bool) -> List[str]:
        measured = []
        for config in configs:
            if (model, config) not in by:
                raise LookupError(f"{record}: no row for {model} / {config}")
            measured.append(by[(model, config)])
        x = " / ".join(f"{r['x']:.2f}x" for r in measured)
        return [" / ".join(f"{r['median_ms']:.1f}" for r in measured), f"**{x}**" if bold else x,
                " / ".join(f"{r['aten_ops']:.0f}" for r in measured)]

    header = ["configuration"] + [f"{_model_label(m)}: {c}" if c == "ms" else c for m in models
                                  for c in ("ms", "x torch", "aten ops")]
    body = ([label] + [cell for model in models for cell in cells(model, configs, bold)]
            for label, configs, bold in rows)
    return table(header, ["---"] + ["---:"] * 3 * len(models), body)


def _model_label(model: str) -> str:
    """``gpt2-12x64`` -> ``12 x 64``; ``resnet50`` -> ``ResNet-50``."""
    narrow = re.fullmatch(r"gpt2-(\d+)x(\d+)", model)
    return f"{narrow.group(1)} x {narrow.group(2)}" if narrow else {"resnet50": "ResNet-50"}.get(model, model)


def codec_work(record: str = "codec_encode_decode_resnet50_memory.json") -> str:
    """One rank's encode, error-feedback memory and decode of ResNet-50's gradients per compressor:
    a memcpy of the same floats timed beside it, layer-wise and merged into 1, 2 and 4 groups (ms,
    the median of the runs), the best merged plan over the memcpy, layer-wise over the best merged,
    and the target the best merged plan was held to."""
    rows = []
    for row in document(record)["results"]:
        ms = row["ms"]
        target = row.get("target_x_memcpy")
        rows.append([compressor_name(row["compressor"]), row["memory"], f"{row['memcpy_ms']:.1f}",
                     *(f"{ms[plan]:.1f}" for plan in ("layerwise", "merged1", "merged2", "merged4")),
                     times(row["best_x_memcpy"]), times(row["layerwise_x_best"]),
                     f"<= {target:g}x: {'met' if row['pass_target'] else 'missed'}" if target else "–"])
    header = ["compressor", "memory", "memcpy ms", "layer-wise ms", "1 group ms", "2 groups ms", "4 groups ms",
              "best merged / memcpy", "layer-wise / best merged", "target"]
    return table(header, ["---", "---", *["---:"] * 7, "---"], rows)
