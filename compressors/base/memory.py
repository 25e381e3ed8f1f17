"""Error-feedback memories, kept per merged group.

A memory sits around the compressor of each group::

    x = memory.compensate(grad, name)            # fold in what earlier steps did not send
    payload, ctx = compressor.compress(x, name)
    memory.update(x, name, transmitted)          # transmitted = decode of this rank's payload

``update`` keeps what of its ``compensated`` argument was not transmitted; that tensor may differ
from what ``compensate`` returned (the hierarchical exchange passes this rank's shard of the host's
sum, zero elsewhere: what it holds after the reduce-scatter inside the host).

All state is per-element (same numel as the group), stored in ``self.state[name]`` as a dict of
flat tensors, so it can be checkpointed and remapped onto a new merge plan (through
:meth:`state_dict`; the residual memory's live state may hold a carried residual, see
:class:`ResidualMemory`).

A compressor may instead compensate, compress and update in fewer passes of its own
(:meth:`~mergecomp.compressors.base.compressor.Compressor.compress_fused`) from what :meth:`Memory.fused_residual`
gives it.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, NamedTuple, Optional, Set, Tuple

import torch

from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.kernels.codecs import sign_remainder
from mergecomp.registry import register_memory

__all__ = ["Memory", "NoMemory", "ResidualMemory", "DGCMemory", "Residual", "Momentum", "warn_double_momentum"]


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
    #: passes over the group :meth:`compensate`, :meth:`update` and :meth:`update_sparse` make
    #: (:mod:`mergecomp.pipeline.breakdown` counts them)
    compensate_passes: float = 0
    update_passes: float = 0

    @property
    def update_sparse_passes(self) -> float:
        """Here: a dense zero tensor, then :meth:`update`."""
        return 1 + self.update_passes

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
        ``transmitted[indices] = values`` (see :meth:`Compressor.sent_entries`)."""
        transmitted = torch.zeros_like(compensated).index_put_((indices,), values)
        self.update(compensated, name, transmitted)

    def compensate_passes_of(self, name: str) -> float:
        """The passes :meth:`compensate` makes over group ``name`` now (here: always
        :attr:`compensate_passes`)."""
        return self.compensate_passes

    def sent_whole(self, name: str) -> bool:
        """Group ``name``'s compensated tensor went out whole and exactly (a lossless codec):
        whether this memory took note without a :meth:`feed` (this base class: no)."""
        return False

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

    def feed(self, codec, compensated: torch.Tensor, name: str, payload, ctx, start: int = 0) -> float:
        """Tell the memory what of ``compensated`` the ``codec`` (a
        :class:`~mergecomp.compressors.base.compressor.Compressor`) sent as ``payload``, which encodes the
        elements from ``start`` on (as many as it decodes to) and nothing else
        (:meth:`feed_parts` of one part).  Returns the passes made over ``compensated``."""
        return self.feed_parts(codec, compensated, name, [(payload, ctx, start)])

    def feed_parts(self, codec, compensated: torch.Tensor, name: str, parts) -> float:
        """Tell the memory what of ``compensated`` the ``codec`` sent in ``parts``, each
        ``(payload, ctx, start)``: payloads of consecutive ranges of ``compensated``, each from
        its ``start`` on (as many elements as it decodes to), and nothing else was sent.  Their
        entries when the codec gives them for every part (:meth:`update_sparse`), else their
        decodes side by side, zero elsewhere (:meth:`update`); a lossless codec's one payload of
        the whole group, where :meth:`sent_whole` takes note, needs no update.  Returns the
        passes made over ``compensated`` (:mod:`mergecomp.pipeline.breakdown`)."""
        entries = [codec.sent_entries(payload, ctx) for payload, ctx, _ in parts]
        if all(e is not None for e in entries):
            indices = [i + start if start else i for (i, _), (_, _, start) in zip(entries, parts)]
            values = [v for _, v in entries]
            self.update_sparse(compensated, name, *(torch.cat(t) if len(t) > 1 else t[0] for t in (indices, values)))
            return self.update_sparse_passes
        first = codec.decompress(*parts[0][:2])
        if len(parts) == 1 and first.numel() == compensated.numel():
            if codec.lossless and self.sent_whole(name):
                return 0  # nothing left behind: no residual to write
            self.update(compensated, name, first)
            return codec.decompress_passes + self.update_passes
        sent = codec.scratch(compensated.numel(), first.dtype, first.device)
        sent[:parts[0][2]].zero_()
        stop = decoded = 0
        for g, (payload, ctx, start) in enumerate(parts):
            part = first if g == 0 else codec.decompress(payload, ctx)
            stop = start + part.numel()
            sent[start:stop] = part
            decoded += part.numel()
        sent[stop:].zero_()
        self.update(compensated, name, sent)
        # the decodes, the copies into `sent` and the zeros around them, the update
        return codec.decompress_passes * decoded / max(compensated.numel(), 1) + 1 + self.update_passes

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
    #: one subtraction; sparse: one copy (the k entries aside)
    update_passes = update_sparse_passes = 1

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        super().__init__()
        self.beta = float(beta)
        self.gamma = float(gamma)

    @property
    def compensate_passes(self) -> float:
        """Adding the residual, and scaling by ``gamma`` unless it is 1."""
        return 1 if self.gamma == 1.0 else 2

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

    def feed_parts(self, codec, compensated: torch.Tensor, name: str, parts) -> float:
        """A codec that subtracts its decode as it writes it (:meth:`Compressor.subtract_decoded`)
        writes the residual of a whole-group payload in its own pass; else as :class:`Memory`."""
        if len(parts) == 1 and parts[0][2] == 0 and type(self).update is ResidualMemory.update:
            payload, ctx, _ = parts[0]
            if codec.subtract_decoded(payload, ctx, compensated, lambda: self._target(name, compensated)):
                return codec.subtract_decoded_passes
        return super().feed_parts(codec, compensated, name, parts)

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
        return Residual(old, (0.0, 0.0) if sides is None else tuple(sides.tolist()),
                        lambda: self._target(name, tensor), lambda negative, positive: self._carry(name, negative, positive))

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
    compensate_passes, update_passes, update_sparse_passes = 4, 3, 1

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
        fields["momentum"].index_fill_(0, indices[values != 0], 0)


def warn_double_momentum(memory: Memory, optimizer_momentum: float) -> None:
    """Warn when the ``dgc`` memory (which applies momentum itself) wraps an optimizer that
    applies momentum too."""
    if memory.name == "dgc" and optimizer_momentum:
        warnings.warn("the 'dgc' memory applies momentum correction itself; the wrapped optimizer's "
                      "momentum is applied on top of it. Use momentum=0 in the optimizer, or "
                      "memory='residual'.", stacklevel=3)
