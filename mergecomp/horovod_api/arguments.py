"""Horovod's arguments that both front ends take and map onto mergecomp's own options: the ops
(``Average``, ``Sum``, ``Adasum``), ``gradient_predivide_factor``, ``process_set``,
``num_groups``, and ``groups`` given as lists of tensors or variables."""
from __future__ import annotations

from typing import Any, Callable

from mergecomp.horovod_api.operations import REDUCTIONS, Average, Max, Min, Product, Sum
from mergecomp.horovod_api.process_sets import global_process_set

__all__ = ["Average", "Sum", "Min", "Max", "Product", "REDUCTIONS", "OPS", "Adasum", "global_process_set",
           "check_horovod_args", "check_process_set", "resolve_groups", "scaling"]

#: the ops of gradient exchanges (DistributedOptimizer)
OPS = (Average, Sum)


class _Adasum:
    def __repr__(self) -> str:
        return "mc.Adasum"


#: Horovod's Adasum reduction: not implemented; passing it as ``op`` raises NotImplementedError.
Adasum = _Adasum()




def check_horovod_args(op: Any, gradient_predivide_factor: float) -> float:
    """Check a gradient exchange's ``op`` and ``gradient_predivide_factor``; returns the factor."""
    if op is Adasum:
        raise NotImplementedError("op=mc.Adasum is not implemented in mergecomp; use op=mc.Average "
                                  "(optionally with a compressor, e.g. compression=mc.Compression.topk)")
    if op not in OPS:
        raise ValueError(f"op must be mc.Average or mc.Sum, got {op!r}")
    factor = float(gradient_predivide_factor)
    if factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != mc.Average")
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    return factor


def scaling(op: str, gradient_predivide_factor: float, size: int) -> dict:
    """``average``, ``prescale`` and ``postscale`` for :class:`mergecomp.pipeline.step.MergedStep`: with a
    predivide factor f, Horovod sums gradient / f and multiplies the sum by f / size."""
    if gradient_predivide_factor == 1.0:
        return dict(average=op == Average, prescale=1.0, postscale=1.0)
    return dict(average=False, prescale=1.0 / gradient_predivide_factor,
                postscale=gradient_predivide_factor / size)


def check_process_set(process_set: Any) -> None:
    """For what runs among all ranks only (the TensorFlow front end): a process set other than
    the global one raises NotImplementedError."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("this runs among all ranks only: process_set must be None or "
                                  "global_process_set")


def resolve_groups(groups: Any, num_groups: int, name_of: Callable[[Any], str]) -> Any:
    """Our ``groups`` spec from Horovod's ``num_groups`` and ``groups``: lists of tensors or
    variables become lists of their names (``name_of(item)``; KeyError/ValueError for an item
    that is not exchanged)."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, got {num_groups!r}")
    if num_groups:
        if groups not in ("auto", None):
            raise ValueError("give either num_groups or groups, not both")
        return num_groups
    if isinstance(groups, (list, tuple)) and any(not isinstance(t, str) for g in groups for t in g):
        try:
            return [[t if isinstance(t, str) else name_of(t) for t in g] for g in groups]
        except (KeyError, ValueError):
            raise ValueError("groups lists a tensor that is not one of the exchanged ones") from None
    return groups
