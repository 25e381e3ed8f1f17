"""Scratch tensors recycled from one step to the next.

On CPU every fresh tensor above glibc's mmap threshold (at most 32 MiB) is handed out as new
pages, so each full-size decode output of a merged group costs a page fault per 4 KiB: about
35 ms per 100 MB on the 2-core benchmark machine, 4-5x the memcpy of the same bytes.  A
:class:`Workspace` hands such buffers out again on the next step instead.

Contract: a tensor from :meth:`Workspace.empty` stays valid until the step after the one it was
taken in (:meth:`advance` to a new step frees the previous step's tensors for reuse); its
contents are undefined.  Buffers not reused during a whole step are dropped, so the pool never
holds more than two steps' worth.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

__all__ = ["Workspace"]

Key = Tuple[int, torch.dtype, torch.device]


class Workspace:
    """A pool of flat tensors keyed by (numel, dtype, device), recycled step by step."""

    def __init__(self) -> None:
        self.step = 0
        self._free: Dict[Key, List[torch.Tensor]] = {}
        self._taken: Dict[Key, List[torch.Tensor]] = {}

    def advance(self, step: int) -> None:
        """Start ``step``: the tensors taken before it become reusable."""
        if step != self.step:
            self._free, self._taken = self._taken, {}
            self.step = step

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat tensor, valid until the next step is over."""
        key = (int(numel), dtype, torch.device(device))
        free = self._free.get(key)
        tensor = free.pop() if free else torch.empty(numel, dtype=dtype, device=device)
        self._taken.setdefault(key, []).append(tensor)
        return tensor

