"""Top-k selection: the k largest of a set of candidates, and top-k's fused scan of the
compensated gradient (a kernel only), which sets the candidates above a threshold aside."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from mergecomp.kernels import native

__all__ = ["largest", "compensated_above", "keep_largest", "with_first_zeros", "fused_scan_served",
           "sampled_threshold"]


def largest(candidates: torch.Tensor, values: torch.Tensor, k: int, absolute: bool) -> torch.Tensor:
    """Of ``candidates`` (int64 indices, ascending) with their ``values`` (written: a scratch
    copy; ``0 < k <= len``), the ``k`` largest (in magnitude with ``absolute``): on fp32 CPU by
    the kernel, in ascending order, of equal ones the first, as top-k's fused encode finds them;
    else by ``torch.topk``."""
    if native.usable(values):
        return native.keep_largest(candidates, values, k)[0]
    if absolute:
        values.abs_()
    return candidates.index_select(0, values.topk(k, sorted=False).indices)


def fused_scan_served(*tensors: torch.Tensor) -> bool:
    """Whether the kernels of top-k's fused encode serve these tensors (contiguous fp32 CPU,
    kernels on); there is no torch path for it."""
    return native.usable(*tensors)


def compensated_above(x: torch.Tensor, residual: Optional[torch.Tensor], threshold: float, out: torch.Tensor,
                      capacity: int, momentum: Optional[Tuple[float, torch.Tensor, torch.Tensor]] = None,
                      clear: bool = False) -> Tuple[torch.Tensor, torch.Tensor, int, Optional[torch.Tensor], bool]:
    """Top-k's one-pass scan of ``x + residual``, which also tells whether ``x`` is finite and
    with ``clear`` zeroes ``x`` (:func:`mergecomp.kernels.native.compensated_above`)."""
    return native.compensated_above(x, residual, threshold, out, capacity, momentum, clear)


def keep_largest(indices: torch.Tensor, values: torch.Tensor, k: int, out: Optional[torch.Tensor] = None,
                 momentum: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest candidates of :func:`compensated_above`, the others put back
    (:func:`mergecomp.kernels.native.keep_largest`)."""
    return native.keep_largest(indices, values, k, out, momentum)


def with_first_zeros(indices: torch.Tensor, values: torch.Tensor, k: int,
                     out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k where :func:`compensated_above` found fewer than ``k`` nonzero elements: those and
    the first zeros (:func:`mergecomp.kernels.native.with_first_zeros`)."""
    return native.with_first_zeros(indices, values, k, out)


def sampled_threshold(x: torch.Tensor, residual: Optional[torch.Tensor], stride: int, rank: int) -> float:
    """The ``rank``-th largest (1: the largest) of ``|residual + x|`` (``residual`` None: ``|x|``)
    over every ``stride``-th element from the first: by the kernel without materializing the
    sample where it serves the tensors, else by ``topk`` of the sample; the same float."""
    if native.usable(*(t for t in (x, residual) if t is not None)):
        return native.sampled_threshold(x, residual, stride, rank)
    sample = x[::stride] if residual is None else residual[::stride] + x[::stride]
    return float(sample.abs().topk(rank, sorted=False).values.min())
