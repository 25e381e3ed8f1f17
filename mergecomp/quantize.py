"""Small helpers shared by the quantizing compressors (QSGD, TernGrad, 1-bit, EF-SignSGD)."""
from __future__ import annotations

import torch

__all__ = ["work_dtype", "stochastic_round"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute scales and norms in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stochastic_round(r: torch.Tensor) -> torch.Tensor:
    """Unbiased rounding of the non-negative ``r`` to an integer-valued tensor of its dtype:
    ``floor(r) + Bernoulli(r - floor(r))``, so that ``E[result] = r``."""
    low = r.floor()
    return low.add_(torch.rand_like(r) < r - low)
