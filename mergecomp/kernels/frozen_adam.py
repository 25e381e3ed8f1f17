"""The elementwise steps of Adam with its variance frozen between refreshes, as the momentum
exchange (``frameworks/torch/momentum_exchange.py``) runs them every step: the momentum onto
the wire, back from it, and the update.

Each runs the one-pass kernel of :mod:`mergecomp.kernels.native` where it serves the tensors
(contiguous fp32 CPU) and the same sequence of torch operations otherwise (three to six passes,
the torch path and the reference).  The kernel rounds each operation on its own and its square
root correctly; torch's CPU square root is not correctly rounded (about one result in six is
an ulp off) and its multiply-adds may fuse, so the paths agree to an ulp or so, not bit for bit;
every rank takes the same path.  ``v`` is Adam's ``exp_avg_sq``, ``m`` its ``exp_avg``; the
denominator ``sqrt(v) + eps`` is computed where it is used, never kept.
"""
from __future__ import annotations

import torch

from mergecomp.kernels import native

__all__ = ["momentum_to_wire", "momentum_from_wire", "frozen_update"]


def momentum_to_wire(grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor, mix: float,
                     weight: float, eps: float, coefficient: float) -> torch.Tensor:
    """This rank's momentum as it goes on the wire, written over ``grad``:
    ``(grad * mix + momentum * weight) / (sqrt(variance) + eps) * coefficient``.  Returns ``grad``."""
    if native.usable(grad, momentum, variance):
        return native.momentum_to_wire(grad, momentum, variance, mix, weight, eps, coefficient)
    grad.mul_(mix).add_(momentum, alpha=weight)
    return grad.div_(variance.sqrt().add_(eps)).mul_(coefficient)


def momentum_from_wire(wire: torch.Tensor, variance: torch.Tensor, eps: float, coefficient: float) -> torch.Tensor:
    """The averaged momentum from the average of what :func:`momentum_to_wire` sent, in place:
    ``wire / coefficient * (sqrt(variance) + eps)``.  Returns ``wire``."""
    if native.usable(wire, variance):
        return native.momentum_from_wire(wire, variance, eps, coefficient)
    return wire.div_(coefficient).mul_(variance.sqrt().add_(eps))


def frozen_update(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor,
                  keep: float, correction: float, eps: float, step: float) -> None:
    """Adam's update with the variance as it stands: ``momentum = grad`` (the averaged
    momentum), ``param = param * keep + step * momentum / (sqrt(variance) / correction + eps)``
    (``keep``: AdamW's ``1 - lr * weight_decay``, else 1; ``correction``: the square root of the
    variance's bias correction; ``step``: ``-lr`` over the momentum's)."""
    if native.usable(param, grad, momentum, variance):
        return native.frozen_adam_update(param, grad, momentum, variance, keep, correction, eps, step)
    momentum.copy_(grad)
    if keep != 1:
        param.mul_(keep)
    param.addcdiv_(momentum, (variance.sqrt() / correction).add_(eps), value=step)
