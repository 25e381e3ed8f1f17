"""Scans of a flat buffer: the finite check, the gradient copy with its prescale and finite check,
the cast to fp16 with its finite check, the indices of the elements above a threshold, and zeroing
a dense output."""
from __future__ import annotations

from typing import Optional

import torch

from mergecomp.kernels import native

__all__ = ["all_finite", "cast_finite", "copy_finite", "indices_above", "zero_"]

#: elements per chunk when the torch path takes magnitudes (4 MiB of fp32)
_CHUNK = 1 << 20


def all_finite(flat: torch.Tensor) -> torch.Tensor:
    """0-d bool: no NaN/Inf in ``flat``.  NaN propagates through min and max and an Inf is an
    extreme, so one fused min/max pass decides (many times faster than ``isfinite(flat).all()``,
    which writes a mask)."""
    if flat.numel() == 0:
        return flat.new_ones((), dtype=torch.bool)
    low, high = torch.aminmax(flat)
    return torch.isfinite(low) & torch.isfinite(high)


def copy_finite(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0, stream: bool = False) -> Optional[bool]:
    """Copy ``src`` (any shape, read flat) times ``scale`` into the flat ``dst`` of the same
    numel (``scale`` 1: copied as it is).  Returns whether every element written is finite (no
    NaN or Inf) where the same pass could tell (the native kernel: contiguous fp32 CPU tensors),
    else None: the caller checks.  ``stream``: the kernel writes ``dst`` past the cache (for a
    destination read again only later)."""
    if src.numel() != dst.numel():
        raise ValueError(f"copy_finite: src has {src.numel()} elements, dst {dst.numel()}")
    if native.usable(src, dst):
        return native.copy_finite(src, dst, scale, stream)
    dst.copy_(src.reshape(-1))
    if scale != 1.0:
        dst.mul_(scale)
    return None


def cast_finite(src: torch.Tensor, dst: torch.Tensor) -> Optional[bool]:
    """Cast ``src`` (any shape, read flat) into the flat ``dst`` of the same numel and another
    floating dtype.  Returns whether every element written is finite (no NaN or Inf: a finite
    value beyond ``dst``'s range becomes Inf) where the same pass could tell (the native kernel:
    contiguous fp32 into fp16 on the CPU), else None: the caller checks."""
    if src.numel() != dst.numel():
        raise ValueError(f"cast_finite: src has {src.numel()} elements, dst {dst.numel()}")
    if dst.dtype == torch.float16 and dst.is_contiguous() and dst.device.type == "cpu" and native.usable(src):
        finite = native.cast_half_finite(src, dst)
        if finite is not None:
            return finite
    dst.copy_(src.reshape(-1))
    return None


def indices_above(values: torch.Tensor, threshold: torch.Tensor, absolute: bool,
                  capacity: int) -> torch.Tensor:
    """int64 indices, ascending, of the elements of the 1-D ``values`` with ``|x| >= threshold``
    (``absolute``) or ``x >= threshold``.  ``threshold``: a 0-d tensor; ``capacity``: a guess of
    how many there are (the native kernel's first output size; a second pass fixes a low guess).

    The native path (``absolute`` only) tests and compacts in one pass without a mask; the torch
    path takes magnitudes chunk by chunk, while still in cache, and never materializes ``|x|``.
    """
    if absolute and native.usable(values):
        return native.indices_above(values, float(threshold), capacity)
    n = values.numel()
    above = torch.empty(n, dtype=torch.bool, device=values.device)
    if absolute:
        for start in range(0, n, _CHUNK):
            chunk = values[start:start + _CHUNK]
            torch.ge(chunk.abs(), threshold, out=above[start:start + _CHUNK])
    else:
        torch.ge(values, threshold, out=above)
    return _flat_nonzero(above)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nonzero(mask).view(-1)`` for a contiguous 1-D bool ``mask``, faster when sparse
    on the CPU: find the non-zero 8-byte words first, then the set bytes inside those words only
    (on a CUDA device one ``nonzero``: each waits for the device)."""
    n = mask.numel()
    body = n - n % 8
    if body == 0 or mask.storage_offset() % 8 or mask.device.type != "cpu":
        return torch.nonzero(mask).view(-1)
    words = mask[:body].view(torch.uint8).view(torch.int64)
    word_index = torch.nonzero(words).view(-1)
    set_bytes = torch.nonzero(words.index_select(0, word_index).view(torch.uint8).view(-1, 8))
    index = word_index.index_select(0, set_bytes[:, 0]).mul_(8).add_(set_bytes[:, 1])
    if body < n:
        index = torch.cat([index, torch.nonzero(mask[body:]).view(-1).add_(body)])
    return index


def zero_(out: torch.Tensor) -> torch.Tensor:
    """``out`` set to zeros: the dense output a sparse decode scatters into, or a group buffer
    backward accumulates into.  An output of :data:`mergecomp.kernels.native.STREAM_MIN`
    elements or more (contiguous fp32 CPU) gets the zeros by non-temporal stores, its lines
    written without being read first (25.6 M elements: 4.6 ms against 12.2 ms for ``zero_()`` on
    one thread); a smaller one ``zero_()``, which leaves it in the cache for what writes it next.
    Returns ``out``."""
    if out.numel() >= native.STREAM_MIN and native.usable(out):
        return native.zero_fill(out)
    return out.zero_()
