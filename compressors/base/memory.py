"""The error-feedback memory interface, kept per merged group.

A memory sits around the compressor of each group::

    x = memory.compensate(grad, name)            # fold in what earlier steps did not send
    payload, ctx = compressor.compress(x, name)
    memory.update(x, name, transmitted)          # transmitted = decode of this rank's payload

The pipeline (:mod:`mergecomp.exchange.encoder`) makes those calls, and works out what was
transmitted: ``update_sparse`` where the codec's decode is a few entries, nothing where a
lossless payload went out whole (:meth:`Memory.sent_whole`), a residual written by the codec
itself where the memory lends the buffer (:meth:`Memory.residual_writer`).  ``update`` keeps what
of its ``compensated`` argument was not transmitted; that tensor may differ from what
``compensate`` returned (the hierarchical exchange passes this rank's shard of the host's sum,
zero elsewhere: what it holds after the reduce-scatter inside the host).

All state is per-element (same numel as the group), stored in ``self.state[name]`` as a dict of
flat tensors, so it can be checkpointed and remapped onto a new merge plan (through
:meth:`state_dict`; the residual memory's live state may hold a carried residual).

A compressor may instead compensate, compress and update in fewer passes of its own
(:class:`~mergecomp.compressors.base.capabilities.FusedEncode`) from what
:meth:`Memory.fused_residual` gives.  The built-in memories are in
:mod:`mergecomp.compressors.memories`.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Set, Tuple

import torch

from mergecomp.compressors.base.passes import MemoryPasses
from mergecomp.compressors.base.stateful import GroupStateful

__all__ = ["Memory", "Residual", "Momentum"]


class Residual(NamedTuple):
    """One group's residual error feedback, for a compressor that compensates and updates in its
    own passes (:meth:`Memory.fused_residual`).  The residual is ``old`` less its two-valued sign
    decode by ``sides``: ``old - (positive where old >= 0, else negative)`` for ``sides =
    (negative, positive)``; ``(0.0, 0.0)`` (always, unless the compressor asked for ``carried``):
    ``old`` itself; ``old`` None: none.  The compressor compresses ``grad + residual`` and writes
    every element of ``target()``, called once, when it writes: the new residual, ``grad +
    residual - sent``; or the compensated gradient ``grad + residual`` itself, when it then calls
    ``carry(negative, positive)`` with the two values its sign bits decode to (the new residual
    is that less its sign decode, worked out where it is read).  ``target()`` may be ``old``
    itself (each element read before it is written); for a kept group it is a spare one
    (:meth:`Memory.keep`)."""

    old: Optional[torch.Tensor]
    sides: Tuple[float, float]
    target: Callable[[], torch.Tensor]
    carry: Optional[Callable[[float, float], None]]
    #: DGC's momentum correction (:class:`Momentum`): the compensated gradient is ``old + u'``
    #: with ``u' = factor * u + grad``; None: ``grad + residual`` as above
    momentum: Optional["Momentum"] = None


class Momentum(NamedTuple):
    """The momentum of :class:`Residual` (DGC, :meth:`DGCMemory.fused_residual`): the compressor
    writes ``u' = factor * old + grad`` (each step rounded) into every element of ``target()``
    (called once, before :class:`Residual`'s ``target()``; may be ``old``) and clears it where it
    sent a nonzero value (momentum factor masking)."""

    factor: float
    old: torch.Tensor
    target: Callable[[], torch.Tensor]


class Memory(GroupStateful):
    """Base class: no error feedback (``compensate`` and ``update`` are identities)."""

    name = ""
    #: the passes over the group its operations make (:mod:`mergecomp.exchange.breakdown`)
    passes: MemoryPasses = MemoryPasses()

    def __init__(self) -> None:
        super().__init__()
        self._kept: Set[str] = set()  # kept groups whose next writes go to a spare buffer
        self._spares: Dict[Tuple[str, str], torch.Tensor] = {}  # (group, field) -> spare buffer

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor to compress for group ``name`` (may modify ``tensor`` in place)."""
        return tensor

    def update(self, compensated: torch.Tensor, name: str, transmitted: torch.Tensor) -> None:
        """Remember what of ``compensated`` was not transmitted."""

    def update_sparse(self, compensated: torch.Tensor, name: str, indices: torch.Tensor,
                      values: torch.Tensor) -> None:
        """:meth:`update` for a transmitted tensor that is zero except
        ``transmitted[indices] = values`` (see
        :class:`~mergecomp.compressors.base.capabilities.SparseEntries`)."""
        transmitted = torch.zeros_like(compensated).index_put_((indices,), values)
        self.update(compensated, name, transmitted)

    def compensate_passes_of(self, name: str) -> float:
        """The passes :meth:`compensate` makes over group ``name`` now, which may depend on its
        state (here: always ``passes.compensate``)."""
        return self.passes.compensate

    def sent_whole(self, name: str) -> bool:
        """Group ``name``'s compensated tensor went out whole and exactly (a lossless codec):
        whether this memory took note without an :meth:`update` (this base class: no)."""
        return False

    def residual_writer(self, name: str, like: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
        """Where this memory's update of group ``name`` is ``compensated - transmitted`` written
        into a buffer of its own: a function that returns that buffer (like ``like``), for a
        codec that writes the difference itself, after which the memory is updated; else None
        (this base class: always)."""
        return None

    def fused_residual(self, tensor: torch.Tensor, name: str, carried: bool = False) -> Optional[Residual]:
        """Group ``name``'s :class:`Residual` when this memory's :meth:`compensate` of ``tensor``
        is ``tensor + residual`` (or DGC's momentum correction, :class:`Momentum`) and its update
        ``compensated - sent`` (a compressor may then do both in its own passes); else None (this
        base class: always).  ``carried``: the caller takes the residual as a sign code's
        carried remainder (:class:`Residual`'s ``sides``)."""
        return None

    @property
    def feeds_back(self) -> bool:
        """Whether this memory does error feedback (overrides :meth:`update`)."""
        return type(self).update is not Memory.update

    @property
    def passthrough(self) -> bool:
        """Whether :meth:`compensate` and :meth:`update` are both identities (no error feedback
        at all), so a compressor may encode the gradients as they arrive."""
        return not self.feeds_back and type(self).compensate is Memory.compensate

    #: every write of a kept group's state goes through :meth:`_fresh` (see :meth:`keep`)
    writes_fresh = False
    #: the per-element fields written through :meth:`_fresh`
    buffers: Tuple[str, ...] = ()

    # -- keep()/restore() without copies ------------------------------------------------------
    # With ``writes_fresh``, a kept group's next write of a field goes into a second buffer
    # (:meth:`_fresh`), so the buffer it replaces stays intact until the step is committed or
    # rolled back; the one left over becomes the spare for the next step.  Other memories
    # keep a copy (GroupStateful.keep).
    def keep(self, name: str) -> Dict[str, torch.Tensor]:
        if not self.writes_fresh:
            return super().keep(name)
        self._kept.add(name)
        return dict(self.state.get(name, {}))  # the tensors themselves

    def restore(self, name: str, kept: Dict[str, torch.Tensor]) -> None:
        self._kept.discard(name)
        spares = self._spares
        for field, tensor in self.state.get(name, {}).items():
            if field in self.buffers and kept.get(field) is not tensor:
                spares[(name, field)] = tensor
        if kept:
            self.state[name] = dict(kept)
        else:
            self.state.pop(name, None)

    def _fresh(self, name: str, field: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer to write every element of ``field`` into (uninitialized when new): the
        live one, or for a kept group a spare one, which becomes the live one."""
        if name not in self._kept:
            return self._buffer(name, field, like)
        spares = self._spares
        spare = spares.pop((name, field), None)
        if spare is None or spare.numel() != like.numel() or spare.dtype != like.dtype or spare.device != like.device:
            spare = torch.empty_like(like)
        fields = self.state.setdefault(name, {})
        if fields.get(field) is not None:
            spares[(name, field)] = fields[field]
        fields[field] = spare
        return spare

    def _written(self, name: str) -> None:
        """Every field of a kept group has been written this step (through :meth:`_fresh`)."""
        self._kept.discard(name)

    def _buffer(self, name: str, field: str, like: torch.Tensor) -> torch.Tensor:
        fields = self.state.setdefault(name, {})
        buf = fields.get(field)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype:
            buf = fields[field] = torch.zeros_like(like)
        return buf
