"""Reductions of one tensor that a fused kernel computes in the pass it makes anyway.

On the native path they come with that pass; on the torch path each is reduced when the caller
reads it (again at each read), so a caller pays only for the sums it uses.  Those
read the tensor then: read them before it changes.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from mergecomp.kernels import native
from mergecomp.kernels.quantize import work_dtype

__all__ = ["SignStats", "Moments", "moments", "side_sums", "exact_where_overflowed"]


class _Reductions:
    """0-d tensors in ``work_dtype(x.dtype)`` (fp64 with :attr:`wide`): slots of ``fused`` (a
    kernel's fp64 results) when given, else reduced from ``x`` on demand."""

    #: reduce in fp64 whatever the input's dtype
    wide = False

    def __init__(self, x: torch.Tensor, fused: Optional[torch.Tensor] = None) -> None:
        self._x = x
        self._work = torch.float64 if self.wide else work_dtype(x.dtype)
        self._fused = None if fused is None else fused.to(self._work)


class SignStats(_Reductions):
    """What :func:`mergecomp.kernels.codecs.pack_signs` learns about ``x`` besides its sign bits:
    :meth:`nonnegative_sum`, :meth:`negative_sum`, :meth:`magnitude` and :meth:`nonnegative`.  Each side
    is summed on its own, so a side of a few small elements keeps its digits beside a large
    one (``sum x`` and ``sum |x|`` would cancel).  In fp64: a side of fp32 values near fp32's
    largest (a gradient under a large loss scale) sums past it, and a scale or mean taken from
    it in fp32 would be infinite where the values are not."""

    wide = True

    def __init__(self, x: torch.Tensor, fused: Optional[torch.Tensor] = None,
                 positive: Optional[torch.Tensor] = None) -> None:
        """``fused``: the kernel's fp64 ``[sum of the x >= 0, sum of the x < 0, count(x >= 0)]``;
        else ``positive``: the bool mask ``x >= 0`` the bits were packed from."""
        super().__init__(x, fused)
        self._positive = positive

    def nonnegative_sum(self) -> torch.Tensor:
        """The sum of the elements ``>= 0``."""
        if self._fused is not None:
            return self._fused[0]
        return torch.clamp_min(self._x, 0).sum(dtype=self._work)

    def negative_sum(self) -> torch.Tensor:
        """The sum of the elements ``< 0``."""
        if self._fused is not None:
            return self._fused[1]
        return torch.clamp_max(self._x, 0).sum(dtype=self._work)

    def magnitude(self) -> torch.Tensor:
        """``sum |x|``."""
        if self._fused is not None:
            return self._fused[0] - self._fused[1]
        return torch.linalg.vector_norm(self._x, 1, dtype=self._work)

    def nonnegative(self) -> torch.Tensor:
        """``count(x >= 0)``."""
        if self._fused is not None:
            return self._fused[2]
        return torch.count_nonzero(self._positive).to(self._work)


class Moments(_Reductions):
    """:meth:`extremes` and :meth:`deviations` of a non-empty ``x``."""

    def extremes(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(min x, max x)``."""
        if self._fused is not None:
            return self._fused[0], self._fused[1]
        low, high = torch.aminmax(self._x)
        return low.to(self._work), high.to(self._work)

    def deviations(self) -> torch.Tensor:
        """``sum (x - mean x)^2``, without the cancellation of ``sum x^2 - (sum x)^2 / n`` when
        the mean is large beside the spread (torch's ``var``, a stable reduction, on the torch
        path)."""
        if self._fused is not None:
            return self._fused[2]
        return torch.var(self._x.to(self._work), correction=0) * self._x.numel()


def moments(x: torch.Tensor) -> Moments:
    """The :class:`Moments` of the non-empty ``x`` (any shape): all from one pass over memory on
    the native path, each reduced when read on the torch path."""
    return Moments(x, native.moments(x) if native.usable(x) else None)


def side_sums(v: torch.Tensor) -> torch.Tensor:
    """fp64 ``[sum of the v >= 0, sum of the v < 0, count(v >= 0)]`` of ``v`` (read flat), as
    the sign kernels return them, reduced in fp64 by torch."""
    v = v.reshape(-1)
    return torch.stack([torch.clamp_min(v, 0).sum(dtype=torch.float64), torch.clamp_max(v, 0).sum(dtype=torch.float64),
                        torch.count_nonzero(v >= 0).to(torch.float64)])


def exact_where_overflowed(fused: torch.Tensor, values) -> torch.Tensor:
    """A sign kernel's ``fused`` side sums, or, where they are not finite although the values
    summed (``values()``, called then) are, :func:`side_sums` of those: a kernel adds runs of 8
    terms per lane in fp32, which overflow from about 4e37 (a gradient under a huge loss scale)."""
    if bool(torch.isfinite(fused[:2]).all()):
        return fused
    v = values()
    return side_sums(v) if bool(torch.isfinite(v).all()) else fused
