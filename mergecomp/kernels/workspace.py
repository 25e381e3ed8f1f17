"""Scratch tensors recycled from one step to the next.

On CPU every fresh tensor above glibc's mmap threshold (at most 32 MiB) is handed out as new
pages, so each full-size decode output of a merged group costs a page fault per 4 KiB: about
35 ms per 100 MB on the 2-core benchmark machine, 4-5x the memcpy of the same bytes.  A
:class:`Workspace` hands such buffers out again on the next step instead.

Contract: a tensor from :meth:`Workspace.empty` stays valid until the step after the one it was
taken in (:meth:`advance` to a new step frees the previous step's tensors for reuse); its
contents are undefined.  Buffers not reused during a whole step are dropped, so the pool never
holds more than two steps' worth.

:meth:`serving` lends a caller's own tensor for one request, so a codec's full-size output can
land straight in the caller's buffer (the merged group's gradients) instead of a pool tensor
that would then be copied there; lent as holding zeros (zeroed by the encode that read it), a
sparse decode scatters into it without zeroing it again.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["Workspace", "fresh"]

Key = Tuple[int, torch.dtype, torch.device]


def fresh(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new uninitialized flat tensor, not pooled: the default of the helpers that take an
    ``empty(numel, dtype, device)`` allocator, and what a dry pool hands out."""
    return torch.empty(numel, dtype=dtype, device=device)


class Workspace:
    """A pool of flat tensors keyed by (numel, dtype, device), recycled step by step."""

    def __init__(self) -> None:
        self.step = 0
        self._free: Dict[Key, List[torch.Tensor]] = {}
        self._taken: Dict[Key, List[torch.Tensor]] = {}
        self._lent: Optional[torch.Tensor] = None
        self._zeros: Optional[torch.Tensor] = None

    def advance(self, step: int) -> None:
        """Start ``step``: the tensors taken before it become reusable."""
        if step != self.step:
            self._free, self._taken = self._taken, {}
            self.step = step

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat tensor, valid until the next step is over."""
        key = (int(numel), dtype, torch.device(device))
        lent = self._lent
        if lent is not None and (lent.numel(), lent.dtype, lent.device) == key:
            self._lent = None  # served once, and never pooled: it is the caller's
            return lent
        free = self._free.get(key)
        tensor = free.pop() if free else fresh(numel, dtype, device)
        self._taken.setdefault(key, []).append(tensor)
        return tensor

    @contextlib.contextmanager
    def serving(self, tensor: torch.Tensor, zeroed: bool = False) -> Iterator[None]:
        """Inside the block, the first :meth:`empty` request for ``tensor``'s numel, dtype and
        device returns ``tensor`` itself (flat, contiguous; its contents are then undefined,
        unless ``zeroed``: it holds zeros, which :meth:`holds_zeros` tells)."""
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"Workspace.serving needs a flat contiguous tensor, got shape {tuple(tensor.shape)}")
        self._lent = tensor
        self._zeros = tensor if zeroed else None
        try:
            yield
        finally:
            self._lent = self._zeros = None

    def holds_zeros(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the one :meth:`serving` lends as holding zeros, inside its block."""
        return tensor is self._zeros
