"""What a compressor may do beyond compress, decompress and aggregate: opt-in capabilities.

A compressor declares a capability by inheriting its class; the pipeline checks with
``isinstance`` and takes the plain path otherwise (the functions at the end give that path):

* :class:`CheckedEncode`: the encode tells from its own pass whether the payload is finite (a
  cast to fp16);
* :class:`FusedEncode`: the encode folds the error-feedback memory's compensation and update
  into its own passes, given the memory's :class:`~mergecomp.compressors.base.memory.Residual`;
* :class:`PartsEncode`: the same, tensor by tensor as a merged group's gradients arrive
  (:class:`FusedParts`), so that no pass copies them into the group's buffer first;
* :class:`ShardedEncode`: shards of a group encoded each on its own for the sharded schemes
  (shard boundaries, per-element state, the codec of each rank's aggregated shard);
* :class:`SparseEntries`: a decode that is zero except at a few entries, which the memory can
  take without a dense decode;
* :class:`SubtractsDecode`: a decode the residual memory can have subtracted as it is written.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple, Union

import torch

from mergecomp.kernels.wire import Payload

if TYPE_CHECKING:
    from mergecomp.compressors.base.compressor import Compressor
    from mergecomp.compressors.base.memory import Residual

__all__ = ["CheckedEncode", "FusedEncode", "NOT_FINITE", "NotFinite", "PartsEncode", "FusedParts", "ShardedEncode", "SparseEntries",
           "SubtractsDecode", "encode_checked", "encode_shard", "shard_alignment", "second_phase"]

#: a fused encode's result: the payload and ctx ``compress`` gives the compensated gradient, and
#: the memory's update, to run once the payload is sent or copied
Fused = Tuple[Payload, Any, Callable[[], None]]


class CheckedEncode(abc.ABC):
    """An encode whose payload may hold Inf where the tensor is finite (a cast to a narrower
    float) and that can tell so from its own pass."""

    @abc.abstractmethod
    def compress_checked(self, tensor: torch.Tensor, name: str,
                         shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any, Optional[bool]]:
        """``compress``, and whether the payload holds no NaN/Inf where the encode's own pass
        could tell; None: the caller checks."""


class NotFinite:
    """What :meth:`FusedEncode.compress_fused` returns for a gradient holding NaN/Inf, where the
    compressor :attr:`~FusedEncode.checks_finite` (one object: :data:`NOT_FINITE`)."""

    def __repr__(self) -> str:
        return "NOT_FINITE"


NOT_FINITE = NotFinite()


class FusedEncode(abc.ABC):
    """An encode that compensates, compresses and updates the memory in fewer passes."""

    #: asks for the residual as the sign codes carry it (:class:`Residual`'s ``sides``)
    carries_residual: bool = False
    #: :meth:`compress_fused` can check the gradient for NaN/Inf in its own pass (``check``)
    checks_finite: bool = False
    #: :meth:`compress_fused` zeroes ``tensor`` in its own pass where asked (``clear``)
    clears: bool = False

    @abc.abstractmethod
    def compress_fused(self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]],
                       residual: "Residual", check: bool = False, clear: bool = False
                       ) -> Union[None, Fused, NotFinite]:
        """``compensate``, ``compress`` and the memory's update of group ``name`` whose memory
        gives ``residual`` (:meth:`Memory.fused_residual`), where this compressor can for
        ``tensor``: ``(payload, ctx, update)``, the payload and ctx ``compress`` gives the
        compensated ``tensor``, bit for bit, and ``update()``, which leaves the memory as its
        update would; the caller runs it once, after the payload is sent or copied and before
        ``tensor`` changes.  ``tensor`` itself stays as given, but with ``clear`` (asked only
        of a compressor that :attr:`clears`, by a caller that reads ``tensor`` no more): every
        element is then 0, the payload or NOT_FINITE returned.  None: the caller compensates,
        compresses and updates.  ``check`` (asked only of a compressor that
        :attr:`checks_finite`): for a ``tensor`` holding NaN/Inf, returns :data:`NOT_FINITE`,
        having written the memory's target with what it read (the caller puts the memory back
        as :meth:`~mergecomp.compressors.base.memory.Memory.keep` had it)."""


class PartsEncode(abc.ABC):
    """A fused encode done tensor by tensor as a merged group's gradients arrive."""

    #: asks for the residual as the sign codes carry it (:class:`Residual`'s ``sides``)
    carries_residual: bool = False
    #: encodes parts with the memory's residual; False: only where the memory does no error
    #: feedback at all
    takes_residual: bool = True

    @abc.abstractmethod
    def compress_fused_parts(self, like: torch.Tensor, name: str, parts: int,
                             residual: Optional["Residual"]) -> Optional["FusedParts"]:
        """The fused encode of group ``name`` (``like``: a flat tensor of its numel, dtype and
        device, not read) done part by part as its ``parts`` tensors arrive, with the memory's
        ``residual`` (None: the memory does no error feedback at all), where this compressor
        can: a :class:`FusedParts`; else None."""


class FusedParts(abc.ABC):
    """One group's fused encode, tensor by tensor as the group's gradients arrive
    (:meth:`PartsEncode.compress_fused_parts`).  The caller calls :meth:`add` once per tensor,
    in any order, then :meth:`finish` once, or, when a part was not finite, puts back the state
    of the holders in :attr:`kept` (which it filled) and starts over with the whole group.  The
    memory's state the parts write goes to a spare buffer of a kept group
    (:meth:`~mergecomp.compressors.base.memory.Memory.keep`), so putting it back costs no copy.
    The payload's tensors are its own: nothing writes them before the next step, and a
    one-tensor payload starts on an 8-byte boundary of its storage with zeros after it to the
    next one (it goes on the wire as it lies, :func:`~mergecomp.kernels.wire.pack_payload`)."""

    #: ``(holder, group name, what it kept)`` to restore if the step cannot use the parts
    kept: list

    @abc.abstractmethod
    def add(self, part: int, start: int, tensor: torch.Tensor) -> bool:
        """Encode the group's elements ``[start, start + tensor.numel())`` from ``tensor``
        (contiguous, read flat, not written), the group's tensor number ``part``.  Returns whether
        they are finite (no NaN or Inf)."""

    @abc.abstractmethod
    def finish(self) -> Fused:
        """After every part was added and found finite: ``(payload, ctx, update)`` as the fused
        encode of the whole group gives them (where the payload holds sums over the group, they
        are added part by part: equal to the whole group's to rounding)."""


class ShardedEncode:
    """Shards of a group, each encoded as a payload of its own (the sharded schemes,
    :mod:`mergecomp.exchange.schemes.two_phase`).  Without it, a shard is encoded by ``compress``, shards
    may start anywhere, and each rank's aggregated shard is sent with the compressor itself."""

    #: shards start at multiples of this many elements (whole bytes of packed bits, whole
    #: quantization buckets), so each shard is encoded as it would be inside the group
    shard_alignment: int = 1

    def compress_shard(self, tensor: torch.Tensor, name: str, start: int, total: int) -> Tuple[Payload, Any]:
        """Encode ``tensor``, elements ``[start, start + numel)`` of group ``name``'s flat buffer
        of ``total`` elements (a compressor with per-element state of the group uses that slice
        of it).  Here: ``compress``."""
        return self.compress(tensor, name)

    def second_phase(self) -> "Compressor":
        """The codec each rank sends its aggregated shard with, whose ``ctx`` and payload sizes
        depend only on the shard's numel and dtype.  Here: this compressor."""
        return self


class SparseEntries(abc.ABC):
    """A decode that is zero but for a few entries."""

    @abc.abstractmethod
    def sent_entries(self, payload: Payload, ctx: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``decompress(payload, ctx)`` as ``(indices, values)`` where it is zero except
        ``decoded[indices] = values`` (int64 indices; a repeated index carries equal values);
        None where it is not."""


class SubtractsDecode(abc.ABC):
    """A decode that can be subtracted from a tensor as it is written."""

    @abc.abstractmethod
    def subtract_decoded(self, payload: Payload, ctx: Any, minuend: torch.Tensor,
                         out: Callable[[], torch.Tensor]) -> bool:
        """Write ``minuend - decompress(payload, ctx)`` (every element of the group) into the
        tensor ``out()`` returns, with no full-size decode in between, where this codec can;
        returns whether it did, else the caller decodes and subtracts."""


# -- the pipeline's view: each capability, or the plain path ------------------------------------
def encode_checked(compressor: "Compressor", tensor: torch.Tensor, name: str,
                   shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any, Optional[bool]]:
    """``compress``, and whether its payload is finite where the encode could tell (else None)."""
    if isinstance(compressor, CheckedEncode):
        return compressor.compress_checked(tensor, name, shapes)
    payload, ctx = compressor.compress(tensor, name, shapes)
    return payload, ctx, None


def encode_shard(compressor: "Compressor", tensor: torch.Tensor, name: str, start: int,
                 total: int) -> Tuple[Payload, Any]:
    """A shard's payload (:meth:`ShardedEncode.compress_shard`)."""
    if isinstance(compressor, ShardedEncode):
        return compressor.compress_shard(tensor, name, start, total)
    return compressor.compress(tensor, name)


def shard_alignment(compressor: "Compressor") -> int:
    """Where shards may start (:attr:`ShardedEncode.shard_alignment`)."""
    return compressor.shard_alignment if isinstance(compressor, ShardedEncode) else 1


def second_phase(compressor: "Compressor") -> "Compressor":
    """The codec of each rank's aggregated shard (:meth:`ShardedEncode.second_phase`)."""
    return compressor.second_phase() if isinstance(compressor, ShardedEncode) else compressor
