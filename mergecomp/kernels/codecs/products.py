"""Products of low-rank factors: PowerSGD's decode ``P @ Q^T`` and the residual it leaves."""
from __future__ import annotations

from typing import Optional

import torch

from mergecomp.kernels import native

__all__ = ["low_rank"]


def low_rank(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, minuend: Optional[torch.Tensor] = None,
             stream: bool = False) -> torch.Tensor:
    """``out = minuend - p @ q^T`` (``minuend`` None: ``p @ q^T``) for a batch of matrices: ``p``
    (k, m, r), ``q`` (k, n, r), ``out`` and ``minuend`` (k, m, n) at any strides (``out`` may be
    ``minuend``; the equally spaced matrices of one shape in a group are a strided view).  The
    kernel writes ``out`` once, past the cache with ``stream`` (``out`` is part of a large output
    read only later), reading ``minuend`` once; the torch path writes the products (straight into
    ``out`` where nothing is subtracted and the dtypes agree), then subtracts.  With r = 1 both
    round alike (each product, then the difference).  An ``out`` of another dtype than the
    factors (fp16/bf16 groups, fp32 factors) gets the products rounded to its dtype."""
    if p.dtype == q.dtype == torch.float32 and native.matrices_usable(out, minuend) \
            and (minuend is None or minuend.stride() == out.stride()):
        return native.low_rank(p.contiguous(), q.transpose(1, 2).contiguous(), minuend, out, stream)
    if minuend is None and out.dtype == p.dtype:
        return torch.bmm(p, q.transpose(1, 2), out=out)
    products = torch.bmm(p, q.transpose(1, 2))
    return out.copy_(products) if minuend is None else torch.sub(minuend, products, out=out)
