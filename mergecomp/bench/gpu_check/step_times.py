"""Stage 3: training step times on one GPU.

A benchmark model (:mod:`mergecomp.bench.models`: ResNet-50 on 32x32 images, GPT-2 small on
64 tokens; ``transformers``' classes from configs) trains on one fixed synthetic batch with SGD,
first plain (``torch``: no mergecomp), then wrapped in ``mergecomp.torch.DistributedOptimizer``
on one process (the local engine: every collective is the identity, so what is measured is
mergecomp's own work on the GPU: copies into the groups, encode, memory, decode) with fixed
groups of about 25 MB for ``none`` and a few compressors, and with ``groups="auto"`` (the
online scheduler's search runs first, untimed, and its choice is reported); then with AdamW,
plain (``torch adamw``) and with 1-bit SGD exchanging Adam's momentum from update
:data:`MOMENTUM_AFTER` on (the timed steps are all in that phase).  Each configuration runs
``warmup`` untimed steps, then ``steps`` steps between two CUDA events; ``x_torch`` is against
plain torch with the same optimizer.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["MODELS", "CONFIGS", "run"]

#: model -> batch size
MODELS = {"resnet50": 64, "gpt2-small": 8}
#: (label, compressor or None for plain torch, groups, optimizer: "sgd" or "adamw")
CONFIGS: Sequence[Tuple[str, Optional[str], object, str]] = (
    ("torch", None, None, "sgd"), ("none", "none", None, "sgd"), ("fp16", "fp16", None, "sgd"),
    ("topk", "topk", None, "sgd"), ("powersgd", "powersgd", None, "sgd"), ("topk auto", "topk", "auto", "sgd"),
    ("torch adamw", None, None, "adamw"), ("onebit momentum", "onebit", None, "adamw"))
WARMUP, STEPS = 5, 15
#: AdamW's updates before its momentum is exchanged (``exchange_momentum_after``): inside the warm-up
MOMENTUM_AFTER = 2
#: steps the scheduler may take to choose a plan before the timed steps
SEARCH_STEPS = 60


def _train(step: Callable[[], torch.Tensor], count: int) -> torch.Tensor:
    """``count`` calls of ``step``; the last one's loss."""
    loss = None
    for _ in range(count):
        loss = step()
    return loss


def time_config(model: torch.nn.Module, batch, compression: Optional[str], groups, optimizer: str = "sgd",
                steps: int = STEPS, warmup: int = WARMUP) -> Dict[str, object]:
    """ms per step of ``model`` on ``batch`` (plain SGD or AdamW, or under a DistributedOptimizer
    with ``compression`` and ``groups``; AdamW's momentum exchanged), its final loss, peak memory
    and, with ``groups="auto"``, the scheduler's choice."""
    import mergecomp.torch as mc
    from mergecomp.bench.models import loss as loss_of

    data, target = batch
    if optimizer == "adamw":
        opt, options = torch.optim.AdamW(model.parameters(), lr=1e-4), {"exchange_momentum_after": MOMENTUM_AFTER}
    else:
        opt, options = torch.optim.SGD(model.parameters(), lr=1e-3), {}
    if compression is not None:
        opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=compression, groups=groups,
                                      **options)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model(data), target)
        loss.backward()
        opt.step()
        return loss.detach()

    out: Dict[str, object] = {}
    try:
        _train(step, warmup)
        if groups == "auto":
            for searched in range(1, SEARCH_STEPS + 1):
                step()
                if opt.scheduler is not None and opt.scheduler.phase == "monitor":
                    break
            chosen = opt.schedule_report()["chosen"]
            out["search_steps"] = searched
            out["chosen"] = None if chosen is None else {k: chosen[k] for k in ("groups", "codecs", "measured_s")}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = _train(step, steps)
        end.record()
        end.synchronize()
        out.update(ms_per_step=start.elapsed_time(end) / steps, loss=float(loss),
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   groups=len(opt.groups) if compression is not None else None)
    finally:
        if compression is not None:
            opt.remove_hooks()
    return out


def run(device: torch.device, budget_s: float, models: Dict[str, int] = MODELS,
        configs: Sequence[Tuple[str, Optional[str], object, str]] = CONFIGS,
        log: Callable[[str], None] = print) -> Dict[str, object]:
    """Every configuration on every model until ``budget_s`` seconds have passed (those not
    started by then are listed as skipped); ``{"skipped_stage": why}`` without ``transformers``."""
    if importlib.util.find_spec("transformers") is None:
        return {"skipped_stage": 'transformers is not installed (pip install -e ".[bench]", as the README says)'}
    import mergecomp.torch as mc
    from mergecomp.bench.models import build_model

    began = time.perf_counter()
    owned = not mc.is_initialized()
    if owned:
        mc.init(engine="local")
    result: Dict[str, object] = {"models": {}, "skipped": [], "steps": STEPS, "warmup": WARMUP}
    try:
        for name, batch_size in models.items():
            model, make_batch = build_model(name)
            model.to(device)
            initial = {k: v.clone() for k, v in model.state_dict().items()}
            batch = tuple(t.to(device) for t in make_batch(batch_size, torch.Generator().manual_seed(0)))
            rows: List[Dict[str, object]] = []
            log(f"  {name}: batch {batch_size}, {sum(p.numel() for p in model.parameters()):,} parameters")
            for label, compression, groups, optimizer in configs:
                if time.perf_counter() - began > budget_s:
                    result["skipped"].append(f"{name}/{label}")
                    continue
                model.load_state_dict(initial)
                row = {"config": label, "compression": compression, "optimizer": optimizer,
                       **time_config(model, batch, compression, groups, optimizer)}
                rows.append(row)
                log(f"    {label:15s} {row['ms_per_step']:8.2f} ms/step  loss {row['loss']:.3f}  "
                    f"peak {row['peak_gib']:.1f} GiB" + (f"  chose {row['chosen']}" if "chosen" in row else ""))
            plain = {r["optimizer"]: r["ms_per_step"] for r in rows if r["compression"] is None}
            for row in rows:
                base = plain.get(row["optimizer"])
                row["x_torch"] = None if not base else row["ms_per_step"] / base
            result["models"][name] = {"batch": batch_size, "rows": rows}
            del model, initial, batch
            torch.cuda.empty_cache()
    finally:
        if owned:
            mc.shutdown()
    return result
