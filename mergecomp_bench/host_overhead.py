"""What mergecomp's own work adds to a training step when no byte crosses a network.

One process: mergecomp on its local engine (every collective is the identity) and DDP on a
process group of one rank, so a configuration's step time beside plain torch's is the host and
device work of its hooks, copies, codecs and bookkeeping: what a user pays on links so fast that
the gradients cross in no time.  Every configuration trains its own copy of one model on one
fixed synthetic batch; the configurations run interleaved, round after round, so the machine's
load falls on all of them alike, and each row's ratio is against plain torch with the same
optimizer (:data:`ANCHORS`) timed right before it (:func:`compare`).

Models (:func:`build`): ``gpt2-<layers>x<width>``, a ``transformers`` GPT-2 with that many
layers that wide (4 heads, GPT-2's vocabulary and positions) on 2 sequences of 8 tokens: many
small tensors and little compute, where per-tensor work shows; and the benchmark models of
:mod:`mergecomp_bench.models` (``resnet50``, ``gpt2-small``).

Used by ``scripts/bench_host_overhead.py`` (the CPU) and stage 3 of ``scripts/gpu_check.sh``
(one GPU, :mod:`mergecomp_bench.gpu_check.step_times`).
"""
from __future__ import annotations

import copy
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mergecomp_bench.models import build_model, loss as loss_of

__all__ = ["Config", "CONFIGS", "ANCHORS", "MOMENTUM_AFTER", "Model", "build", "aten_ops", "compare", "cpu_ms",
           "cuda_ms"]

#: AdamW's updates before its momentum is exchanged (``exchange_momentum_after``): inside the warm-up
MOMENTUM_AFTER = 2


@dataclass(frozen=True)
class Config:
    """One way of training the model.

    ``optimizer``: ``"sgd"`` or ``"adamw"`` (torch's default implementation: foreach on CUDA,
    a loop over the tensors on the CPU), or either with ``"-foreach"`` or ``"-fused"``;
    ``wrapper``: None (plain torch), ``"ddp"`` (DDP on one rank, default options),
    ``"mergecomp"`` (``DistributedOptimizer`` with ``compression`` and ``groups``) or
    ``"hook"`` (DDP on one rank built as the integrations build it, ``gradient_as_bucket_view=True``,
    with mergecomp's communication hook and ``compression``; its buckets are the groups);
    ``momentum``: AdamW's momentum exchanged from update :data:`MOMENTUM_AFTER`."""

    label: str
    optimizer: str = "sgd"
    wrapper: Optional[str] = None
    compression: Optional[str] = None
    groups: object = None
    momentum: bool = False

    @property
    def family(self) -> str:
        """The optimizer without its implementation: what :data:`ANCHORS` keys."""
        return self.optimizer.split("-")[0]


#: every configuration; mergecomp's take the run's ``groups`` (None: the default plan)
CONFIGS: Tuple[Config, ...] = (
    Config("torch sgd", "sgd"), Config("torch sgd foreach", "sgd-foreach"), Config("torch sgd fused", "sgd-fused"),
    Config("torch adamw", "adamw"), Config("torch adamw foreach", "adamw-foreach"),
    Config("torch adamw fused", "adamw-fused"),
    Config("ddp sgd", "sgd", "ddp"), Config("ddp adamw", "adamw", "ddp"),
    Config("none", "sgd", "mergecomp", "none"), Config("fp16", "sgd", "mergecomp", "fp16"),
    Config("topk", "sgd", "mergecomp", "topk"), Config("powersgd", "sgd", "mergecomp", "powersgd"),
    Config("onebit", "sgd", "mergecomp", "onebit"),
    Config("onebit momentum", "adamw", "mergecomp", "onebit", momentum=True),
    Config("hook onebit momentum", "adamw", "hook", "onebit", momentum=True),
)
#: the configuration each optimizer family's ratios are against: torch's default implementation
ANCHORS = {"sgd": "torch sgd", "adamw": "torch adamw"}


@dataclass
class Model:
    """A model to time: ``module`` on ``device``, one fixed ``batch`` and what it is called."""

    name: str
    module: torch.nn.Module
    batch: Tuple[torch.Tensor, torch.Tensor]

    @property
    def tensors(self) -> int:
        return sum(1 for _ in self.module.parameters())

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def build(name: str, device: torch.device, batch_size: Optional[int] = None) -> Model:
    """``gpt2-<layers>x<width>`` (2 sequences of 8 tokens unless ``batch_size``), or a model of
    :mod:`mergecomp_bench.models` (``resnet50``: 8 images; ``gpt2-small``: 2 sequences of 64
    tokens unless ``batch_size``), seeded, on ``device``."""
    narrow = re.fullmatch(r"gpt2-(\d+)x(\d+)", name)
    generator = torch.Generator().manual_seed(0)
    if narrow:
        import transformers

        layers, width = map(int, narrow.groups())
        if width % 4:
            raise ValueError(f"{name}: the width must be a multiple of the 4 heads, got {width}")
        torch.manual_seed(0)
        module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False))
        tokens = torch.randint(module.config.vocab_size, (batch_size or 2, 9), generator=generator)
        batch = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        module, make_batch = build_model(name)
        batch = make_batch(batch_size or {"resnet50": 8, "gpt2-small": 2}.get(name, 8), generator)
    return Model(name, module.to(device), tuple(t.to(device) for t in batch))


def _optimizer(config: Config, params) -> torch.optim.Optimizer:
    implementation = config.optimizer.partition("-")[2]
    kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[config.family]
    lr = 1e-3 if config.family == "sgd" else 1e-4
    return kind(params, lr=lr, **({implementation: True} if implementation else {}))


def _ddp_group(device: torch.device) -> None:
    """A process group of this one process, for DDP (made once)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


class _Run:
    """One configuration training its own copy of the model: ``step()``; ``close()`` detaches it."""

    def __init__(self, model: Model, config: Config, groups: object) -> None:
        self.module = module = copy.deepcopy(model.module)
        self.batch = model.batch
        self.optimizer = _optimizer(config, module.parameters())
        self.mergecomp = None
        self.forward = module
        if config.wrapper in ("ddp", "hook"):
            from torch.nn.parallel import DistributedDataParallel

            device = next(module.parameters()).device
            _ddp_group(device)
            from mergecomp.torch.integrations._hook import BUCKET_VIEWS

            views = BUCKET_VIEWS if config.wrapper == "hook" else {}  # the hook's DDP as the integrations build it
            self.forward = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                                   **views)
            if config.wrapper == "hook":
                import mergecomp.torch as mc

                options = {"exchange_momentum_after": MOMENTUM_AFTER, "optimizer": self.optimizer} if config.momentum else {}
                self.forward.register_comm_hook(*mc.ddp_comm_hook(config.compression,
                                                                  named_parameters=module.named_parameters(), **options))
        elif config.wrapper == "mergecomp":
            import mergecomp.torch as mc

            if not mc.is_initialized():
                mc.init(engine="local")
            options = {"exchange_momentum_after": MOMENTUM_AFTER if config.momentum else None}
            self.optimizer = self.mergecomp = mc.DistributedOptimizer(
                self.optimizer, module.named_parameters(), compression=config.compression,
                groups=config.groups if config.groups is not None else groups, **options)

    def step(self) -> torch.Tensor:
        data, target = self.batch
        self.optimizer.zero_grad()
        loss = loss_of(self.forward(data), target)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def close(self) -> None:
        if self.mergecomp is not None:
            self.mergecomp.remove_hooks()


def cpu_ms(step: Callable[[], object], steps: int) -> Dict[str, float]:
    """Milliseconds per call of ``step`` over ``steps`` calls: ``ms``, the process's CPU time (all
    its threads; what other processes on a shared machine take from it is left out), and
    ``wall_ms``, the host's clock."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return {"ms": (time.process_time() - cpu) * 1e3 / steps, "wall_ms": (time.perf_counter() - wall) * 1e3 / steps}


def cuda_ms(step: Callable[[], object], steps: int) -> Dict[str, float]:
    """Milliseconds per call of ``step`` over ``steps`` calls, between two CUDA events (``ms``)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return {"ms": start.elapsed_time(end) / steps}


def aten_ops(step: Callable[[], object], steps: int = 2) -> float:
    """aten operators per call of ``step`` (every one torch's profiler records, nested ones too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return sum(1 for event in prof.events() if event.name.startswith("aten::")) / steps


def _prepared(model: Model, config: Config, warmup: int, groups: object, search_steps: int) -> Tuple[_Run, Dict]:
    """A run of ``config`` after ``warmup`` untimed steps (and, under ``groups="auto"``, up to
    ``search_steps`` more until the scheduler has chosen: ``chosen``)."""
    run = _Run(model, config, groups)
    info: Dict[str, object] = {}
    try:
        for _ in range(warmup):
            run.step()
        scheduler = run.mergecomp.scheduler if run.mergecomp is not None else None
        if scheduler is not None:
            for _ in range(search_steps):
                if scheduler.phase == "monitor":
                    break
                run.step()
            chosen = run.mergecomp.schedule_report()["chosen"]
            info["chosen"] = None if chosen is None else {k: chosen[k] for k in ("groups", "codecs")}
        if run.mergecomp is not None:
            info["groups"] = len(run.mergecomp.groups)
    except BaseException:
        run.close()
        raise
    return run, info


def _timed(runs: Dict[str, "_Run"], model: Model, config: Config, row: Dict[str, Any], count_ops: bool,
           timer: Callable[[Callable[[], object], int], Dict[str, float]], steps: int, warmup: int, groups: object,
           search_steps: int) -> Dict[str, float]:
    """One round of ``config``: its resident run in ``runs``, else one built for the round and
    closed after it; ``row`` gets its aten operators (``count_ops``) and its last loss."""
    run = runs.get(config.label)
    built = run is None
    if built:
        run, info = _prepared(model, config, warmup, groups, search_steps)
        row.update(info)
    try:
        if count_ops:
            row["aten_ops"] = aten_ops(run.step)
        timed = timer(run.step, steps)
        row["loss"] = float(run.step())
        return timed
    finally:
        if built:
            run.close()


def compare(model: Model, configs: Sequence[Config], rounds: int, steps: int, warmup: int, groups: object = None,
            log: Callable[[str], None] = print, search_steps: int = 60, resident: bool = True,
            count_ops: bool = True, deadline: Optional[float] = None) -> List[Dict[str, object]]:
    """Every configuration on ``model``, interleaved over ``rounds`` rounds of ``steps`` timed
    steps each (:func:`cpu_ms` or :func:`cuda_ms`).  ``resident``: every configuration's run is
    built and warmed up once and kept, and its anchor (:data:`ANCHORS`) is timed again right
    before it in every round (short pairs, many of them, fit a noisy machine: its speed drifts
    over seconds); else each round builds and warms up its own (a model too large to train in
    many copies at once).

    One row per configuration: ``ms`` (each round's; ``wall_ms`` too on the CPU), ``median_ms``,
    ``aten_ops`` per step (with ``count_ops``), ``loss`` (its last step's), and ``x``: the
    median over the rounds of its time over its anchor's (timed right before it where resident,
    else in the same round; ``anchor_ms``: those times; None without an anchor); on a CUDA
    device ``peak_gib``, the most memory allocated while it ran.
    A configuration due after ``deadline`` (``time.perf_counter()``) is not run: its row has no
    ``median_ms`` and ``skipped`` True.  Where runs are built per round (not ``resident``), a
    configuration that raises gets ``error`` (its exception, one line) and the others go on."""
    rows = {config.label: {"model": model.name, "tensors": model.tensors, "parameters": model.parameters,
                           "config": config.label, "optimizer": config.optimizer, "ms": []} for config in configs}
    timer = cuda_ms if model.batch[0].device.type == "cuda" else cpu_ms
    runs: Dict[str, _Run] = {}
    try:
        if resident:
            for config in configs:
                runs[config.label], info = _prepared(model, config, warmup, groups, search_steps)
                rows[config.label].update(info)
        else:
            run, _ = _prepared(model, configs[0], warmup, groups, search_steps)  # the process's first steps are slow
            run.close()
        cuda = timer is cuda_ms
        for r in range(rounds):
            for config in configs:
                row = rows[config.label]
                if deadline is not None and time.perf_counter() > deadline:
                    row["skipped"] = True
                    continue
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                anchor = runs.get(ANCHORS[config.family]) if config.label != ANCHORS[config.family] else None
                if anchor is not None:
                    row.setdefault("anchor_ms", []).append(timer(anchor.step, steps)["ms"])
                try:
                    timed = _timed(runs, model, config, row, r == 0 and count_ops, timer, steps, warmup, groups,
                                   search_steps)
                except Exception as error:  # a run built per round: the other configurations go on
                    if resident:
                        raise
                    row["error"] = f"{type(error).__name__}: {error}"
                    log(f"  round {r + 1} {model.name} {config.label:20s} failed: {row['error']}")
                    continue
                if cuda:
                    row["peak_gib"] = max(row.get("peak_gib", 0.0), torch.cuda.max_memory_allocated() / 2**30)
                row["ms"].append(timed["ms"])
                if "wall_ms" in timed:
                    row.setdefault("wall_ms", []).append(timed["wall_ms"])
                log(f"  round {r + 1} {model.name} {config.label:20s} {timed['ms']:8.2f} ms/step")
    finally:
        for run in runs.values():
            run.close()
    for row, config in zip(rows.values(), configs):
        if not row["ms"]:
            continue
        row["median_ms"] = statistics.median(row["ms"])
        if "wall_ms" in row:
            row["median_wall_ms"] = statistics.median(row["wall_ms"])
        anchor = rows.get(ANCHORS[config.family])
        theirs = row.get("anchor_ms") or (anchor or {}).get("ms")
        row["x"] = statistics.median(mine / other for mine, other in zip(row["ms"], theirs)) if theirs else None
    return list(rows.values())
