"""Products of low-rank factors: PowerSGD's decode ``P @ Q^T`` and the residual it leaves."""
from __future__ import annotations

from typing import Optional

import torch

from mergecomp.kernels import native

__all__ = ["low_rank"]


def low_rank(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, minuend: Optional[torch.Tensor] = None,
             stream: bool = False) -> torch.Tensor:
    """``out = minuend - p @ q^T`` (``minuend`` None: ``p @ q^T``), ``p`` (m, r), ``q`` (n, r),
    ``out`` and ``minuend`` (m, n; ``out`` may be ``minuend``).  The kernel writes ``out`` once,
    past the cache with ``stream`` (``out`` is part of a large output read only later), reading
    ``minuend`` once; the torch path writes the product, then subtracts.  With r = 1 both round
    alike (each product, then the difference).  An ``out`` of another dtype than the factors
    (fp16/bf16 groups, fp32 factors) gets the product rounded to its dtype."""
    operands = (out,) if minuend is None else (out, minuend)
    if native.usable(*operands) and p.dtype == q.dtype == torch.float32:
        return native.low_rank(p.contiguous(), q.t().contiguous(), minuend, out, stream)
    if out.dtype == p.dtype:
        torch.mm(p, q.t(), out=out)
    else:
        out.copy_(p @ q.t())
    return out if minuend is None else torch.sub(minuend, out, out=out)
