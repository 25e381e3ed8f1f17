"""Small helpers shared by the quantizing compressors (QSGD, TernGrad, 1-bit, EF-SignSGD)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from mergecomp.kernels.workspace import fresh

__all__ = ["work_dtype", "stochastic_round_", "bucket_norms", "per_bucket_scale", "RANDOM_BITS"]

#: resolution of the uniform draws behind stochastic rounding: each element's rounding
#: probability is exact to within ``2 ** -(RANDOM_BITS + 1)``
RANDOM_BITS = 16


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute scales and norms in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stochastic_round_(a: torch.Tensor, shift: int = 0, empty: Optional[Callable] = None) -> torch.Tensor:
    """Round the floating tensor ``a`` in place to a neighbouring integer, unbiased, plus the
    integer ``shift``: ``floor(a + u) + shift`` with ``u`` uniform in ``(0, 1)``, so
    ``E[result] = a + shift`` (to ``2 ** -17``) and ``|result - shift| <= ceil(|a|)``.
    Returns ``a``.  ``empty(numel, dtype, device)`` allocates the temporaries (e.g. a
    compressor's :meth:`~mergecomp.Compressor.scratch`); default ``torch.empty``.

    ``u = (k + 0.5) / 2**16`` with ``k`` uniform in ``[0, 2**16)``: every generated 64-bit word
    feeds four elements.  torch's CPU generator costs the same per word whatever its width, so
    this is 4x cheaper than ``rand_like`` (25.6 M elements on 2 cores: 27 ms instead of 90 ms);
    the rest is four passes over ``a`` without mixed-dtype arithmetic.
    """
    n = a.numel()
    empty = empty or fresh
    words = empty((n + 3) // 4, torch.int64, a.device)
    k = words.random_(-2 ** 63, None).view(torch.int16)[:n].view(a.shape)  # signed 16 bits
    u = empty(n, a.dtype, a.device).view(a.shape).copy_(k)
    u.add_(2 ** (RANDOM_BITS - 1) + 0.5 + shift * 2 ** RANDOM_BITS)
    return a.add_(u, alpha=2.0 ** -RANDOM_BITS).floor_()


def _buckets(flat: torch.Tensor, size: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``flat`` cut into buckets of ``size`` elements, as views: the full buckets as a
    ``(rows, size)`` matrix and the shorter last bucket (None where there is none)."""
    numel = flat.numel()
    full = numel // size if size else 0
    body = flat[:full * size].view(full, size) if full else None
    tail = flat[full * size:] if numel > full * size else None
    return body, tail


def bucket_norms(flat: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """The L2 norm (in ``dtype``) of each bucket of ``size`` elements of ``flat`` (the last one
    may be shorter): ``ceil(numel / size)`` values, without a padded copy of ``flat``."""
    body, tail = _buckets(flat, size)
    parts = [torch.linalg.vector_norm(body, dim=1, dtype=dtype)] if body is not None else []
    if tail is not None:
        parts.append(torch.linalg.vector_norm(tail, dtype=dtype).reshape(1))
    return torch.cat(parts) if parts else flat.new_empty(0, dtype=dtype)


def per_bucket_scale(flat: torch.Tensor, scale: torch.Tensor, size: int,
                     out: torch.Tensor) -> torch.Tensor:
    """``out = flat * scale[bucket]`` elementwise for buckets of ``size`` elements (the last one
    may be shorter), in one pass; ``out`` has ``flat``'s numel and may be of another dtype.
    Returns ``out``."""
    body, tail = _buckets(flat, size)
    out_body, out_tail = _buckets(out, size)
    if body is not None:
        torch.mul(body, scale[:body.shape[0]].unsqueeze(1), out=out_body)
    if tail is not None:
        torch.mul(tail, scale[-1:], out=out_tail)
    return out
