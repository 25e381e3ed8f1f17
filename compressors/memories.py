"""The built-in error-feedback memories: none, the residual, its moving average, and DGC's
momentum correction.

Each registers its class with ``@register_memory("name")``; the interface is
:class:`~mergecomp.compressors.base.memory.Memory`.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional

import torch

from mergecomp.compressors.base.memory import Memory, Momentum, Residual
from mergecomp.compressors.base.passes import MemoryPasses
from mergecomp.kernels.codecs import sign_remainder
from mergecomp.registry import register_memory

__all__ = ["NoMemory", "ResidualMemory", "AveragedMemory", "DGCMemory", "warn_double_momentum"]


@register_memory("none")
class NoMemory(Memory):
    """No error feedback."""


@register_memory("residual")
class ResidualMemory(Memory):
    """Residual error feedback: ``x = gamma * grad + beta * residual``; ``residual = x - sent``.

    After a sign code's fused encode (:meth:`fused_residual` with ``carried``) a group holds
    its compensated gradient and the two values its sign bits decoded to (field ``"sides"``),
    and the residual is worked out where it is read: the next fused encode folds it into its
    one pass; :meth:`compensate`, :meth:`fused_residual` for other codecs and
    :meth:`state_dict` first write it out (one pass)."""

    writes_fresh = True
    buffers = ("residual",)

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)
        self.gamma = float(gamma)
        # compensate: adding the residual, and scaling by ``gamma`` unless it is 1; update: one
        # subtraction; sparse: one copy (the k entries aside)
        self._passes = MemoryPasses(compensate=1 if self.gamma == 1.0 else 2, update=1, update_sparse=1)

    @property
    def passes(self) -> MemoryPasses:
        return self._passes

    def compensate_passes_of(self, name: str) -> float:
        """Adding the residual where the group has one (and writing a carried one out first),
        and scaling unless ``gamma`` is 1."""
        fields = self.state.get(name, {})
        return ("residual" in fields) + ("sides" in fields) + (self.gamma != 1.0)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        residual = self._residual(name)
        if self.gamma != 1.0:
            tensor.mul_(self.gamma)
        if residual is not None and residual.numel() == tensor.numel():
            tensor.add_(residual, alpha=self.beta)
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        torch.sub(compensated, transmitted, out=self._target(name, compensated))

    def residual_writer(self, name: str, like: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
        """The buffer of group ``name``'s new residual, unless a subclass overrides :meth:`update`."""
        if type(self).update is not ResidualMemory.update:
            return None
        return lambda: self._target(name, like)

    def sent_whole(self, name: str) -> bool:
        """The residual is zero: dropped, so the next :meth:`compensate` adds nothing (a kept
        group gets it back on :meth:`restore`).  Not where a subclass overrides :meth:`update`."""
        if type(self).update is not ResidualMemory.update:
            return False
        self.state.pop(name, None)
        self._written(name)
        return True

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        # one copy instead of a dense decode and a subtraction
        residual = self._target(name, compensated).copy_(compensated)
        residual.index_put_((indices,), compensated[indices] - values)

    def fused_residual(self, tensor: torch.Tensor, name: str, carried: bool = False) -> Optional[Residual]:
        """With ``beta = gamma = 1``, unless a subclass overrides :meth:`compensate` or
        :meth:`update`."""
        cls = type(self)
        if ((self.beta, self.gamma) != (1.0, 1.0) or cls.compensate is not ResidualMemory.compensate
                or cls.update is not ResidualMemory.update):
            return None
        fields = self.state.get(name, {})
        old, sides = (fields.get("residual"), fields.get("sides")) if carried else (self._residual(name), None)
        if old is not None and old.numel() != tensor.numel():
            old, sides = None, None  # as compensate ignores it
        return Residual(old, (0.0, 0.0) if sides is None else tuple(sides.tolist()), lambda: self._target(name, tensor),
                        lambda negative, positive: self._carry(name, negative, positive))

    def state_dict(self):
        """Copies of the residuals (carried ones written out)."""
        return {name: {"residual": self._written_out(fields, torch.empty_like(fields["residual"]))}
                if "sides" in fields else {k: v.clone() for k, v in fields.items()}
                for name, fields in self.state.items()}

    def _residual(self, name: str) -> Optional[torch.Tensor]:
        """Group ``name``'s residual (None: none), a carried one written out first: in place, or
        for a kept group into a new buffer (the kept one stays as it was)."""
        fields = self.state.get(name)
        if not fields or "sides" not in fields:
            return None if fields is None else fields.get("residual")
        carried = fields["residual"]
        residual = self._written_out(fields, torch.empty_like(carried) if name in self._kept else carried)
        self.state[name] = {"residual": residual}  # a new dict: a kept one holds the old fields
        return residual

    @staticmethod
    def _written_out(fields, out: torch.Tensor) -> torch.Tensor:
        """The residual of a carried group's ``fields`` written into ``out``."""
        return sign_remainder(fields["residual"], *fields["sides"].tolist(), out=out)

    def _carry(self, name: str, negative: float, positive: float) -> None:
        """Group ``name``'s buffer holds its compensated gradient, whose sign bits decoded to
        ``negative`` and ``positive``: the residual is that less its sign decode."""
        self.state[name]["sides"] = torch.tensor([negative, positive], dtype=torch.float32)

    def _target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer group ``name``'s new residual goes into (every element), its state from now on."""
        residual = self._fresh(name, "residual", like)
        self.state[name].pop("sides", None)
        self._written(name)
        return residual


@register_memory("averaged")
class AveragedMemory(Memory):
    """Error feedback through a moving average of the compression errors, cleared periodically
    (after LoCo, Xie et al., 2024): ``x = grad + error``; ``error = decay * error + (1 - decay)
    * (x - sent)``; every ``reset_every`` updates of a group (0: never) its next step starts
    from ``error = 0``.

    The residual memory hands the optimizer, one step late, everything it held back; with Adam,
    whose per-element normalisation turns such bursts into full-size steps, that degrades the
    model.  The average feeds back a smoothed share of the error instead.  ``decay = 0`` and
    ``reset_every = 0`` is the residual memory.  State per group: field ``"error"`` (like the
    group) and ``"updates"`` (0-d int64, the updates since the last clearing)."""

    writes_fresh = True
    buffers = ("error",)
    #: compensate: adding the error; update: scaling it, adding and subtracting the group's
    #: tensors; sparse: the same with the k entries aside
    passes = MemoryPasses(compensate=1, update=3, update_sparse=2)

    def __init__(self, decay: float = 0.8, reset_every: int = 512) -> None:
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"averaged memory: decay must be in [0, 1), got {decay}")
        if int(reset_every) != reset_every or reset_every < 0:
            raise ValueError(f"averaged memory: reset_every must be an int >= 0, got {reset_every!r}")
        self.decay = float(decay)
        self.reset_every = int(reset_every)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        error = self._error(name, tensor)
        if error is not None:
            tensor.add_(error)
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        self._decayed(name, compensated).add_(compensated, alpha=1 - self.decay).sub_(transmitted,
                                                                                   alpha=1 - self.decay)

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        error = self._decayed(name, compensated).add_(compensated, alpha=1 - self.decay)
        error.index_put_((indices,), error[indices].sub_(values, alpha=1 - self.decay))  # a put: indices may repeat

    def sent_whole(self, name: str) -> bool:
        """Nothing was lost this step: the error only decays."""
        fields = self.state.get(name)
        if fields is not None and "error" in fields:
            self._decayed(name, fields["error"])
        return True

    def _error(self, name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """Group ``name``'s error to add this step: None where it has none, where it was kept for
        another layout, or where this step clears it."""
        fields = self.state.get(name)
        if not fields or "error" not in fields or fields["error"].numel() != like.numel():
            return None
        if self.reset_every and self._updates(fields) >= self.reset_every:
            return None
        return fields["error"]

    @staticmethod
    def _updates(fields: Dict[str, torch.Tensor]) -> int:
        """The updates since the group's error was last cleared (none recorded, as after a plan
        change moved the error onto new groups: 0)."""
        updates = fields.get("updates")
        return 0 if updates is None else int(updates)

    def _decayed(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Group ``name``'s new error buffer holding ``decay * error`` (zero where
        :meth:`_error` gives none), its update counted."""
        old = self._error(name, like)
        updates = 1 if old is None else self._updates(self.state[name]) + 1
        error = self._fresh(name, "error", like)
        if old is None:
            error.zero_()
        else:
            torch.mul(old, self.decay, out=error)
        self.state[name]["updates"] = torch.tensor(updates, dtype=torch.int64)
        self._written(name)
        return error


@register_memory("dgc")
class DGCMemory(Memory):
    """Deep Gradient Compression memory: momentum correction and momentum factor masking.

    ``u = m * u + grad``; ``v = v + u``; ``v`` is compressed.  Elements that were sent are
    cleared from both ``v`` and ``u`` (masking).  Use it with a momentum-free optimizer step:
    the momentum is applied here, before compression (Lin et al., 2018).
    """

    writes_fresh = True
    buffers = ("momentum", "velocity")
    #: compensate: scale u, add the gradient, add u to v, copy v; update: the kept mask, the
    #: subtraction, the masking; sparse: one copy (the k entries aside)
    passes = MemoryPasses(compensate=4, update=3, update_sparse=1)

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"dgc memory momentum must be in [0, 1), got {momentum}")
        self.momentum = float(momentum)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        u = self._buffer(name, "momentum", tensor)
        v = self._buffer(name, "velocity", tensor)
        if name in self._kept:  # out of place: the old u, v stay as they were
            u_old, v_old = u, v
            u, v = self._fresh(name, "momentum", tensor), self._fresh(name, "velocity", tensor)
            torch.mul(u_old, self.momentum, out=u)
            torch.add(v_old, u.add_(tensor), out=v)
            self._written(name)
        else:
            u.mul_(self.momentum).add_(tensor)
            v.add_(u)
        tensor.copy_(v)
        return tensor

    def fused_residual(self, tensor: torch.Tensor, name: str, carried: bool = False) -> Optional[Residual]:
        """The velocity as the residual and the momentum correction (:class:`Momentum`), unless
        a subclass overrides :meth:`compensate` or :meth:`update_sparse`; never ``carried``."""
        cls = type(self)
        if carried or cls.compensate is not DGCMemory.compensate or cls.update_sparse is not DGCMemory.update_sparse:
            return None
        u, v = self._buffer(name, "momentum", tensor), self._buffer(name, "velocity", tensor)

        def velocity() -> torch.Tensor:
            target = self._fresh(name, "velocity", tensor)
            self._written(name)
            return target

        return Residual(v, (0.0, 0.0), velocity, None,
                        Momentum(self.momentum, u, lambda: self._fresh(name, "momentum", tensor)))

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        kept = transmitted == 0
        fields = self.state[name]
        torch.sub(compensated, transmitted, out=fields["velocity"])
        fields["momentum"].mul_(kept)

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        # one copy instead of a dense decode and a subtraction (``compensated`` need not be what
        # compensate() returned: the hierarchical exchange updates with the host's sum)
        fields = self.state[name]
        fields["velocity"].copy_(compensated).index_put_((indices,), compensated[indices] - values)
        momentum = fields["momentum"]  # cleared where a nonzero value went out, by a put of every
        # sent entry (selecting the nonzero ones by a mask would wait for a CUDA device)
        momentum.index_put_((indices,), torch.where(values != 0, 0, momentum[indices]))


def warn_double_momentum(memory: Memory, optimizer_momentum: float) -> None:
    """Warn when the ``dgc`` memory (which applies momentum itself) wraps an optimizer that
    applies momentum too."""
    if memory.name == "dgc" and optimizer_momentum:
        warnings.warn("the 'dgc' memory applies momentum correction itself; the wrapped optimizer's "
                      "momentum is applied on top of it. Use momentum=0 in the optimizer, or "
                      "memory='residual'.", stacklevel=3)
