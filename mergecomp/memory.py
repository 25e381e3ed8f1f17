"""Error-feedback memories, kept per merged group.

A memory sits around the compressor of each group::

    x = memory.compensate(grad, name)            # fold in what earlier steps did not send
    payload, ctx = compressor.compress(x, name)
    memory.update(x, name, transmitted)          # transmitted = decode of this rank's payload

All state is per-element (same numel as the group), stored in ``self.state[name]`` as a dict of
flat tensors, so it can be checkpointed and remapped onto a new merge plan.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Set

import torch

from .registry import register_memory
from .stateful import GroupStateful

__all__ = ["Memory", "NoMemory", "ResidualMemory", "DGCMemory", "warn_double_momentum"]


class Memory(GroupStateful):
    """Base class: no error feedback (``compensate`` and ``update`` are identities)."""

    name = ""

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor to compress for group ``name`` (may modify ``tensor`` in place)."""
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        """Remember what of ``compensated`` was not transmitted."""

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        """:meth:`update` for a transmitted tensor that is zero except
        ``transmitted[indices] = values`` (see :meth:`Compressor.sent_entries`)."""
        transmitted = torch.zeros_like(compensated).index_put_((indices,), values)
        self.update(compensated, name, transmitted)

    def _buffer(self, name: str, field: str, like: torch.Tensor) -> torch.Tensor:
        fields = self.state.setdefault(name, {})
        buf = fields.get(field)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = fields[field] = torch.zeros_like(like)
        return buf


@register_memory("none")
class NoMemory(Memory):
    """No error feedback."""


@register_memory("residual")
class ResidualMemory(Memory):
    """Residual error feedback: ``x = gamma * grad + beta * residual``; ``residual = x - sent``."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)
        self.gamma = float(gamma)
        # keep()/restore() without a copy: a kept group's next update writes into a second
        # buffer, so the residual it replaces stays intact until the step is known to be good
        self._spare: Dict[str, torch.Tensor] = {}
        self._kept: Set[str] = set()

    def keep(self, name: str) -> Optional[torch.Tensor]:
        self._kept.add(name)
        return self.state.get(name, {}).get("residual")

    def restore(self, name: str, kept: Optional[torch.Tensor]) -> None:
        self._kept.discard(name)
        current = self.state.get(name, {}).get("residual")
        if kept is None:
            self.state.pop(name, None)
        else:
            self.state.setdefault(name, {})["residual"] = kept
        if current is not None and current is not kept:
            self._spare[name] = current

    def _target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Where this update writes the residual (every element of it)."""
        if name not in self._kept:
            return self._buffer(name, "residual", like)
        self._kept.discard(name)
        spare = self._spare.pop(name, None)
        if spare is None or spare.numel() != like.numel() or spare.dtype != like.dtype or spare.device != like.device:
            spare = torch.empty_like(like)
        fields = self.state.setdefault(name, {})
        if fields.get("residual") is not None:
            self._spare[name] = fields["residual"]
        fields["residual"] = spare
        return spare

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        residual = self.state.get(name, {}).get("residual")
        if self.gamma != 1.0:
            tensor.mul_(self.gamma)
        if residual is not None and residual.numel() == tensor.numel():
            tensor.add_(residual, alpha=self.beta)
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        torch.sub(compensated, transmitted, out=self._target(name, compensated))

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        # one copy instead of a dense decode and a subtraction
        residual = self._target(name, compensated).copy_(compensated)
        residual.index_put_((indices,), compensated[indices] - values)


@register_memory("dgc")
class DGCMemory(Memory):
    """Deep Gradient Compression memory: momentum correction and momentum factor masking.

    ``u = m * u + grad``; ``v = v + u``; ``v`` is compressed.  Elements that were sent are
    cleared from both ``v`` and ``u`` (masking).  Use it with a momentum-free optimizer step:
    the momentum is applied here, before compression (Lin et al., 2018).
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"dgc memory momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        u = self._buffer(name, "momentum", tensor)
        v = self._buffer(name, "velocity", tensor)
        u.mul_(self.momentum).add_(tensor)
        v.add_(u)
        tensor.copy_(v)
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        kept = transmitted == 0
        fields = self.state[name]
        torch.sub(compensated, transmitted, out=fields["velocity"])
        fields["momentum"].mul_(kept)

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        # compensate() left velocity == compensated, so only the sent entries change: O(k)
        fields = self.state[name]
        fields["velocity"].index_put_((indices,), compensated[indices] - values)
        fields["momentum"].index_fill_(0, indices[values != 0], 0)


def warn_double_momentum(memory: Memory, optimizer_momentum: float) -> None:
    """Warn when the ``dgc`` memory (which applies momentum itself) wraps an optimizer that
    applies momentum too."""
    if memory.name == "dgc" and optimizer_momentum:
        warnings.warn("the 'dgc' memory applies momentum correction itself; the wrapped optimizer's "
                      "momentum is applied on top of it. Use momentum=0 in the optimizer, or "
                      "memory='residual'.", stacklevel=3)
