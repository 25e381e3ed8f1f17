"""Stage 3: training step times on one GPU, the rows of ``scripts/bench_host_overhead.py``.

A benchmark model (:mod:`mergecomp_bench.models`: ResNet-50 on 32x32 images, GPT-2 small on
64 tokens; ``transformers``' classes from configs) trains on one fixed synthetic batch in every
configuration of :data:`mergecomp_bench.host_overhead.CONFIGS` (plain torch SGD and AdamW,
default, foreach and fused; DDP on a process group of one rank; ``DistributedOptimizer`` on the
local engine with ``none``, ``fp16``, ``topk``, ``powersgd``, ``onebit`` in groups of about
25 MB and 1-bit SGD exchanging AdamW's momentum) and with top-k under ``groups="auto"`` (the
scheduler's search runs first, untimed; its choice is reported).  No byte crosses a network, so what a row adds to
plain torch's step is mergecomp's own work on the GPU.  Each configuration runs ``warmup``
untimed steps, then ``steps`` steps between two CUDA events; ``x`` is against plain torch with
the same optimizer (default implementation: foreach on CUDA).
"""
from __future__ import annotations

import importlib.util
import time
from typing import Callable, Dict, Sequence

import torch

from mergecomp_bench.host_overhead import CONFIGS, Config, build, compare

__all__ = ["MODELS", "STAGE_CONFIGS", "run"]

#: model -> batch size
MODELS = {"resnet50": 64, "gpt2-small": 8}
#: the host-overhead rows, and top-k with the scheduler's plan
STAGE_CONFIGS: Sequence[Config] = (*CONFIGS, Config("topk auto", "sgd", "mergecomp", "topk", groups="auto"))
WARMUP, STEPS = 5, 15
#: steps the scheduler may take to choose a plan before the timed steps
SEARCH_STEPS = 60


def run(device: torch.device, budget_s: float, models: Dict[str, int] = MODELS,
        configs: Sequence[Config] = STAGE_CONFIGS, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Every configuration on every model until ``budget_s`` seconds have passed (those not
    started by then are listed as skipped); ``{"skipped_stage": why}`` without ``transformers``."""
    if importlib.util.find_spec("transformers") is None:
        return {"skipped_stage": 'transformers is not installed (pip install -e ".[bench]", as the README says)'}
    deadline = time.perf_counter() + budget_s
    result: Dict[str, object] = {"models": {}, "skipped": [], "steps": STEPS, "warmup": WARMUP}
    for name, batch_size in models.items():
        if time.perf_counter() > deadline:
            result["skipped"] += [f"{name}/{config.label}" for config in configs]
            continue
        model = build(name, device, batch_size)
        log(f"  {name}: batch {batch_size}, {model.parameters:,} parameters in {model.tensors} tensors")
        rows = compare(model, configs, rounds=1, steps=STEPS, warmup=WARMUP, log=lambda line: log(f"  {line}"),
                       search_steps=SEARCH_STEPS, resident=False, deadline=deadline)
        result["skipped"] += [f"{name}/{row['config']}" for row in rows if row.get("skipped")]
        result["models"][name] = {"batch": batch_size, "rows": [row for row in rows if not row.get("skipped")]}
        del model
        torch.cuda.empty_cache()
    return result
