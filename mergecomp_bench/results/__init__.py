"""The docs' rendered tables: result tables from the benchmark records in ``docs/img/data``, and the
compatibility tables from the library's own declarations.

A table in a Markdown file sits between two marker lines::

    <!-- rendered: NAME -->
    | ... the table :data:`TABLES` [NAME] makes from the records ... |
    <!-- end rendered -->

:func:`render_file` rewrites every such block (``scripts/render_results.py``); with ``check`` it
only reports the blocks that differ, which the test suite does, so a number in those tables
cannot drift from its record.  Each table names its records; a row whose record is missing
raises (``LookupError``) instead of rendering a blank.

    data             reading the records
    markdown         tables and cells as the docs write them
    step_time        step time against DDP and its hooks, every compressor, 4 workers
    schemes          the exchange schemes and the scheduler against a sweep
    accuracy         convergence with compressed gradients, the error-feedback memories
    adam             Adam and AdamW: the momentum exchanged
    time_to_target   time to accuracy
    elastic          a Horovod elastic job losing and regaining workers
    fsdp2            FSDP2's compressed reduce-scatter and all-gather
    gpu              the GPU checks
    host_work        mergecomp's own work per step, the codecs' work
    decision         the decision table quoting the others
    compatibility    what combines with what, from the library's declarations
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List

from mergecomp_bench.results import adam, compatibility
from mergecomp_bench.results.accuracy import (DIGITS, DIGITS_VARIANTS, LM, LM_VARIANTS, by_compressor, convergence,
                                              memories)
from mergecomp_bench.results.adam import adam_auto, adam_momentum_exchange
from mergecomp_bench.results.decision import summary
from mergecomp_bench.results.elastic import TORCHRUN_RESTARTS, elastic_runs
from mergecomp_bench.results.fsdp2 import fsdp2_accuracy, fsdp2_bytes, fsdp2_step
from mergecomp_bench.results.gpu import gpu_runs, gpu_training
from mergecomp_bench.results.host_work import HEADLINE_ROWS, RESNET50, RESNET50_ROWS, codec_work, own_work
from mergecomp_bench.results.schemes import plans, scheduler_summary, schemes_by_ranks, schemes_fixed_vs_auto
from mergecomp_bench.results.step_time import every_compressor, scaling, throughput_anchors, throughput_repeats
from mergecomp_bench.results.time_to_target import (DILOCO, DILOCO_LABELS, HEADLINE, HEADLINE_LABELS, TARGET,
                                                    TRAINER_ROUTE, TRAINER_ROUTE_LABELS, TTA, TTA_LABELS,
                                                    diloco_four_hosts, diloco_fragment_count, diloco_slow_links,
                                                    diloco_staleness,
                                                    headline, time_to,
                                                    time_to_accuracy, time_to_accuracy_recipes)

__all__ = ["TABLES", "TARGET", "render_file", "summary", "throughput_anchors", "throughput_repeats",
           "every_compressor", "scaling", "schemes_by_ranks", "schemes_fixed_vs_auto", "plans", "scheduler_summary",
           "convergence", "memories", "own_work", "adam_auto", "adam_momentum_exchange", "time_to_accuracy",
           "time_to_accuracy_recipes", "time_to", "fsdp2_step", "fsdp2_bytes", "fsdp2_accuracy", "gpu_runs",
           "gpu_training", "codec_work"]

_BLOCK = re.compile(r"(<!-- rendered: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end rendered -->)", re.S)

#: every table a doc may hold, by the name its markers give (``readme-``: the README's shorter variant of
#: a table, or its opening sentence)
TABLES: Dict[str, Callable[[], str]] = {
    "summary": summary,
    "readme-headline": headline,
    "throughput-anchors": throughput_anchors,
    "readme-throughput-anchors": partial(throughput_anchors, links=("1gbit",)),
    "throughput-repeats": throughput_repeats,
    "every-compressor": every_compressor,
    "scaling": scaling,
    "schemes-by-ranks": schemes_by_ranks,
    "schemes-4-hosts": schemes_fixed_vs_auto,
    "schemes-2x2-hosts": plans,
    "scheduler-vs-sweep": scheduler_summary,
    "convergence-digits": partial(convergence, DIGITS, DIGITS_VARIANTS),
    "convergence-lm": partial(convergence, LM, LM_VARIANTS),
    "memories": memories,
    "accuracy-by-compressor": by_compressor,
    "own-work": own_work,
    "readme-own-work": partial(own_work, rows=HEADLINE_ROWS),
    "own-work-resnet50": partial(own_work, RESNET50, ("resnet50",), RESNET50_ROWS),
    "compatibility-routes": compatibility.routes,
    "front-end-options": compatibility.front_end_options,
    "adam-auto": adam_auto,
    "adam-momentum-exchange": adam_momentum_exchange,
    "adam-by-compressor": partial(adam_momentum_exchange, adam.BY_COMPRESSOR),
    "adam-warm-ups": partial(adam_momentum_exchange, adam.WARM_UPS, adam.SHORT_RUN, 600, adam.SHORT_RUN_RECORDS),
    "adam-beta2-095": partial(adam_momentum_exchange, adam.BETA2_095_ROWS, adam.BETA2_095, 600,
                              (adam.BETA2_095_RECORD,)),
    "adam-without-variance-floor": partial(adam_momentum_exchange, adam.WITHOUT_FLOOR_ROWS, adam.BETA2_095, 600,
                                           (adam.WITHOUT_FLOOR_RECORD,)),
    "time-to-accuracy": partial(time_to_accuracy, TTA, TTA_LABELS, bold=(HEADLINE,)),
    "readme-time-to-accuracy": partial(time_to_accuracy, TTA, HEADLINE_LABELS, bold=(HEADLINE,)),
    "time-to-accuracy-trainer-route": partial(time_to_accuracy, TRAINER_ROUTE, TRAINER_ROUTE_LABELS,
                                              bold=("hook:onebit@auto",)),
    "time-to-accuracy-recipes": time_to_accuracy_recipes,
    "time-to-accuracy-diloco": partial(time_to_accuracy, DILOCO, DILOCO_LABELS),
    "diloco-slow-links": diloco_slow_links,
    "diloco-four-hosts": diloco_four_hosts,
    "diloco-staleness": diloco_staleness,
    "diloco-fragment-count": diloco_fragment_count,
    "elastic": elastic_runs,
    "elastic-torchrun": partial(elastic_runs, TORCHRUN_RESTARTS),
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
