"""The elementwise steps of Adam with its variance frozen between refreshes, as the momentum
exchange (``frameworks/torch/momentum_exchange.py``) runs them every step over each merged
group at once: the momentum onto the wire, back from it, and the update.

A group's tensors are the :class:`Segments` of its flat buffers (the gradient, Adam's momentum
``m`` and variance ``v``, laid out alike); each segment has its own constants, given as fp64 CPU
tensors of one value per segment.  Each step runs the one-pass kernel of
:mod:`mergecomp.kernels.native` where it serves the buffers (contiguous fp32 CPU): one call per
group.  Elsewhere (CUDA, fp16, bf16, fp64) the same sequence of torch operations as on one
tensor runs as ``torch._foreach_*`` operations over the segments, one call per bundle of
segments sharing their scalar constants (a parameter group).  The kernel rounds each operation
on its own and its square root correctly; torch's CPU square root is not correctly rounded
(about one result in six is an ulp off), so the paths agree to an ulp or so, not bit for bit;
every rank takes the same path.  The denominator ``sqrt(v) + eps`` is computed where it is
used, never kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from mergecomp.kernels import native

__all__ = ["Segments", "momentum_to_wire", "momentum_from_wire", "frozen_update", "inv_bound2"]


@dataclass(frozen=True)
class Segments:
    """A merged group's tensors as segments of its flat buffers.

    ``offsets``: int64 CPU, segment ``s`` is the elements ``[offsets[s], offsets[s + 1])``;
    ``lengths``: the same as a list; ``active``: uint8 CPU, 1 for a tensor with Adam state (the
    others send zeros and are not updated); ``bundles``: the active segments grouped by what
    shares their scalar constants (their parameter group)."""

    offsets: torch.Tensor
    lengths: List[int]
    active: torch.Tensor
    bundles: List[List[int]]

    @property
    def inactive(self) -> List[int]:
        return [s for s, on in enumerate(self.active.tolist()) if not on]

    def views(self, flat: torch.Tensor) -> Sequence[torch.Tensor]:
        """Each segment of ``flat`` (flat views)."""
        return flat.split(self.lengths)


def _f32(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float32)


def momentum_to_wire(grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor, segments: Segments,
                     mix: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, coefficient: torch.Tensor,
                     limit: torch.Tensor, divide: bool) -> Optional[bool]:
    """This rank's momentum as it goes on the wire, written over the flat ``grad``: per active
    segment ``(grad * mix + momentum * weight) / (sqrt(variance) + eps) * coefficient`` (with
    ``divide``; without it the division is left out), a value beyond the segment's ``limit``
    (+Inf: none) brought back to it, its sign kept; zeros elsewhere.  Returns whether every
    value written is finite where the same pass tells (the kernel), else None (a NaN or Inf
    stays one)."""
    if native.usable(grad, momentum, variance):
        return native.momentum_to_wire_segments(grad, momentum, variance, segments.offsets, _f32(mix), _f32(weight),
                                                _f32(eps), _f32(coefficient), _f32(limit), segments.active, divide)
    g, m, v = segments.views(grad), segments.views(momentum), segments.views(variance)
    if segments.inactive:
        torch._foreach_zero_([g[s] for s in segments.inactive])
    mix, weight, eps, coefficient, limit = mix.tolist(), weight.tolist(), eps.tolist(), coefficient.tolist(), \
        limit.tolist()
    for bundle in segments.bundles:
        gs, first = [g[s] for s in bundle], bundle[0]
        torch._foreach_mul_(gs, mix[first])
        torch._foreach_add_(gs, [m[s] for s in bundle], alpha=weight[first])
        if divide:
            d = torch._foreach_sqrt([v[s] for s in bundle])
            torch._foreach_add_(d, eps[first])
            torch._foreach_div_(gs, d)
        torch._foreach_mul_(gs, [coefficient[s] for s in bundle])
        limited = [s for s in bundle if math.isfinite(limit[s])]
        if limited:  # x * min(1, limit / |x|): Inf becomes NaN, NaN stays, for the step's check
            shrink = torch._foreach_abs([g[s] for s in limited])
            torch._foreach_reciprocal_(shrink)
            torch._foreach_mul_(shrink, [limit[s] for s in limited])
            torch._foreach_clamp_max_(shrink, 1.0)
            torch._foreach_mul_([g[s] for s in limited], shrink)
    return None


def momentum_from_wire(wire: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor, segments: Segments,
                       coefficient: torch.Tensor, eps: torch.Tensor, weight: torch.Tensor, divide: bool) -> None:
    """The averaged momentum from the average of what :func:`momentum_to_wire` sent, in place
    over the flat ``wire``: ``wire / coefficient * (sqrt(variance) + eps)`` per active segment
    (with ``divide``; else, and for the others, ``wire / coefficient``), then ``momentum *
    weight`` added per active segment where ``weight`` is not 0."""
    if native.usable(wire, momentum, variance):
        native.momentum_from_wire_segments(wire, momentum, variance, segments.offsets, _f32(coefficient), _f32(eps),
                                           _f32(weight), segments.active, divide)
        return
    x, m, v = segments.views(wire), segments.views(momentum), segments.views(variance)
    coefficient, eps, weight = coefficient.tolist(), eps.tolist(), weight.tolist()
    plain = segments.inactive if divide else range(len(x))
    if plain:
        torch._foreach_div_([x[s] for s in plain], [coefficient[s] for s in plain])
    for bundle in segments.bundles:
        xs, first = [x[s] for s in bundle], bundle[0]
        if divide:
            torch._foreach_div_(xs, [coefficient[s] for s in bundle])
            d = torch._foreach_sqrt([v[s] for s in bundle])
            torch._foreach_add_(d, eps[first])
            torch._foreach_mul_(xs, d)
        if weight[first]:
            torch._foreach_add_(xs, [m[s] for s in bundle], alpha=weight[first])


def frozen_update(params: Sequence[torch.Tensor], grad: torch.Tensor, momentum: torch.Tensor,
                  variance: torch.Tensor, segments: Segments, keep: torch.Tensor, correction: torch.Tensor,
                  eps: torch.Tensor, step: torch.Tensor, inv_bound2: torch.Tensor) -> None:
    """Adam's update with the variance as it stands, per active segment ``s`` (``params[s]``
    its parameter, in the segment's shape or any other of its numel): ``momentum = grad`` (the
    averaged momentum; nothing to copy where they are one tensor), ``variance = max(variance,
    momentum * momentum * inv_bound2)`` (:func:`inv_bound2`: what Adam's own variance never
    falls below; 0: no floor), ``param = param * keep + step * momentum / (sqrt(variance) /
    correction + eps)`` (``keep``: AdamW's ``1 - lr * weight_decay``, else 1; ``correction``:
    the square root of the variance's bias correction; ``step``: ``-lr`` over the momentum's)."""
    if native.usable(grad, momentum, variance, *params):
        native.frozen_adam_segments(params, grad, momentum, variance, segments.offsets, _f32(keep), _f32(correction),
                                    _f32(eps), _f32(step), _f32(inv_bound2), segments.active)
        return
    g, m, v = segments.views(grad), segments.views(momentum), segments.views(variance)
    keep, correction, eps, step = keep.tolist(), correction.tolist(), eps.tolist(), step.tolist()
    inv_bound2 = inv_bound2.tolist()
    for bundle in segments.bundles:
        ps, ms, first = [params[s] for s in bundle], [m[s].view_as(params[s]) for s in bundle], bundle[0]
        vs = [v[s].view_as(params[s]) for s in bundle]
        if grad is not momentum:
            torch._foreach_copy_(ms, [g[s].view_as(params[s]) for s in bundle])
        if inv_bound2[first]:
            floor = torch._foreach_mul(ms, ms)
            torch._foreach_mul_(floor, inv_bound2[first])
            torch._foreach_maximum_(vs, floor)
        if keep[first] != 1:
            torch._foreach_mul_(ps, keep[first])
        d = torch._foreach_sqrt(vs)
        torch._foreach_div_(d, [correction[s] for s in bundle])
        torch._foreach_add_(d, eps[first])
        torch._foreach_addcdiv_(ps, ms, d, [step[s] for s in bundle])


def inv_bound2(beta1: float, beta2: float) -> float:
    """``1 / B**2``, ``B`` the bound Adam's own state keeps to: ``|m| <= B * sqrt(v)`` for every
    element at every step (Cauchy-Schwarz over the two moving averages of the same gradients,
    ``B = (1 - beta1) / sqrt((1 - beta2) * (1 - beta1**2 / beta2))``); 0 where ``beta1**2 >=
    beta2`` (no bound).  A frozen variance that the gradients have outgrown breaks it: the
    floor ``v >= (m / B)**2`` restores it, an update never larger per element than Adam's."""
    if beta2 <= 0 or beta1 * beta1 >= beta2 or beta2 >= 1:
        return 0.0
    return (1 - beta2) * (1 - beta1 * beta1 / beta2) / (1 - beta1) ** 2
