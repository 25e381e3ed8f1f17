"""Which parameters a :class:`~.optimizer.DistributedOptimizer` exchanges, and under which names:
Horovod's ``named_parameters`` may name more parameters than the optimizer holds; and the torch
optimizer inside a framework's wrapper of one."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch

__all__ = ["collect_parameters", "inner_optimizer"]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``: each holds it as ``.optimizer``), or ``optimizer``."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def collect_parameters(optimizer: torch.optim.Optimizer,
                       named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]]
                       ) -> Tuple[List[torch.nn.Parameter], List[str]]:
    """The optimizer's parameters that require a gradient, and their names.  ``named_parameters``
    must name every one of them and may name more (only the optimizer's are exchanged)."""
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    names = [n for n, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    by_id = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(in_optimizer) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"named_parameters does not match the optimizer: {len(unnamed)} of the optimizer's "
                         f"parameters (positions {unnamed[:8]}) are missing from named_parameters")
    params = [p for p in in_optimizer if p.requires_grad]  # frozen ones never get a gradient
    if not params:
        raise ValueError("the optimizer has no parameter that requires a gradient")
    return params, [by_id[id(p)] for p in params]
