"""Small helpers shared by the quantizing compressors (QSGD, TernGrad, 1-bit, EF-SignSGD) and the
int8 parameter all-gather (blockwise, round to nearest)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from mergecomp.kernels.workspace import fresh

__all__ = ["work_dtype", "stochastic_round_", "bucket_norms", "per_bucket_scale", "RANDOM_BITS",
           "int8_blocks_nbytes", "int8_blocks", "from_int8_blocks"]

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


def int8_blocks_nbytes(numel: int, block: int) -> int:
    """Bytes :func:`int8_blocks` writes for ``numel`` elements: a code per element of the
    ``ceil(numel / block)`` whole blocks, then an fp32 scale per block."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def int8_blocks(flat: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 codes of the floating 1-D ``flat`` in blocks of ``block`` elements (a
    multiple of 4), written to the uint8 ``out`` of :func:`int8_blocks_nbytes` bytes: first every
    block's codes ``round(x / scale)`` in ``[-127, 127]`` (the last block zero-padded), then every
    block's fp32 ``scale = max |x| / 127``.  Deterministic; each element decodes within
    ``scale / 2`` of ``flat``; a block holding NaN or Inf decodes to NaN.  Returns ``out``."""
    numel = flat.numel()
    blocks = -(-numel // block)
    work = torch.empty(blocks, block, dtype=work_dtype(flat.dtype), device=flat.device)
    work.view(-1)[:numel].copy_(flat)
    work.view(-1)[numel:].zero_()
    scale = work.abs().amax(dim=1).div_(127).float()
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))  # NaN stays NaN
    work.mul_(inverse.unsqueeze(1).to(work.dtype)).round_()
    out[:blocks * block].view(torch.int8).view(blocks, block).copy_(work)
    out[blocks * block:].view(torch.float32).copy_(scale)
    return out


def from_int8_blocks(raw: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Decode :func:`int8_blocks`: ``raw`` holds one encoding per row (uint8, ``(rows, nbytes)``)
    of ``out.shape[1]`` elements; ``out`` (``(rows, numel)``, floating, rows of stride ``numel``)
    gets ``code * scale`` in its own dtype.  Returns ``out``."""
    rows, numel = out.shape
    if numel == 0:
        return out
    blocks, full = -(-numel // block), numel // block
    codes = raw[:, :blocks * block].view(torch.int8).view(rows, blocks, block)
    scale = raw[:, blocks * block:].view(torch.float32).view(rows, blocks, 1)
    # widening to fp32 first, then scaling in place, then narrowing: mixed-dtype arithmetic
    # (int8 x fp32, bf16 x fp32) is 5-10x slower on CPU than these passes
    work = out if out.dtype == torch.float32 else torch.empty(rows, numel, dtype=torch.float32, device=out.device)
    if full:
        work[:, :full * block].view(rows, full, block).copy_(codes[:, :full]).mul_(scale[:, :full])
    if numel > full * block:
        work[:, full * block:].copy_(codes[:, full, :numel - full * block]).mul_(scale[:, full])
    return out if work is out else out.copy_(work)
