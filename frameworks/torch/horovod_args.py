"""The parts of Horovod's ``DistributedOptimizer`` signature that map onto mergecomp's own
options: ``Compression``, ``Adasum``, ``process_set``, ``num_groups``, ``groups`` given as
lists of tensors, and ``named_parameters`` that name more than the optimizer holds."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch

from mergecomp.registry import Compression

__all__ = ["Adasum", "Compression", "global_process_set", "collect_parameters", "resolve_groups",
           "check_horovod_args", "check_process_set"]


class _Adasum:
    def __repr__(self) -> str:
        return "mc.Adasum"


#: Horovod's Adasum reduction: not implemented; passing it as ``op`` raises NotImplementedError.
Adasum = _Adasum()


class _GlobalProcessSet:
    def __repr__(self) -> str:
        return "mc.global_process_set"


#: every rank (the only process set mergecomp supports)
global_process_set = _GlobalProcessSet()


def check_horovod_args(op: Any, ops: Tuple[str, ...], gradient_predivide_factor: float, process_set: Any) -> float:
    """Check ``op``, ``gradient_predivide_factor`` and ``process_set``; returns the factor."""
    if op is Adasum:
        raise NotImplementedError("op=mc.Adasum is not implemented in mergecomp; use op=mc.Average "
                                  "(optionally with a compressor, e.g. compression=mc.Compression.topk)")
    if op not in ops:
        raise ValueError(f"op must be mc.Average or mc.Sum, got {op!r}")
    factor = float(gradient_predivide_factor)
    if factor != 1.0 and op != "average":
        raise ValueError("gradient_predivide_factor not supported with op != mc.Average")
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    check_process_set(process_set)
    return factor


def check_process_set(process_set: Any) -> None:
    """Only the global process set exists: anything else raises NotImplementedError."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("mergecomp runs collectives among all ranks only: process_set must be "
                                  "None or mc.global_process_set")


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


def resolve_groups(groups: Any, num_groups: int, params: List[torch.nn.Parameter], names: List[str]) -> Any:
    """Our ``groups`` spec from Horovod's ``num_groups`` and ``groups`` (lists of parameters
    become lists of their names)."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, got {num_groups!r}")
    if num_groups:
        if groups != "auto":
            raise ValueError("give either num_groups or groups, not both")
        return num_groups
    if isinstance(groups, (list, tuple)) and any(isinstance(t, torch.Tensor) for g in groups for t in g):
        name_of = {id(p): n for p, n in zip(params, names)}
        try:
            return [[t if isinstance(t, str) else name_of[id(t)] for t in g] for g in groups]
        except KeyError:
            raise ValueError("groups lists a tensor that is not one of the optimizer's parameters") from None
    return groups
