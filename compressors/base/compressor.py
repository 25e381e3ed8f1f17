"""The one interface every compression algorithm implements.

Contract (what the pipeline in :mod:`mergecomp.pipeline.exchange` relies on):

* ``compress(tensor, name, shapes)`` takes a flat, contiguous 1-D floating tensor (one merged
  group's gradients, already error-compensated) and returns ``(payload, ctx)``.
  ``payload`` is a tuple of tensors: the only thing that goes on the wire.  ``ctx`` is whatever
  ``decompress`` needs besides the payload, and it must be *the same on every rank* (numel, dtype,
  shapes, a step seed...): it is used to decode the payloads the other ranks sent.  Anything
  rank-specific (norms, means, indices) belongs in the payload.
* Payload sizes depend only on ``tensor.numel()``, its dtype and the compressor's settings, never
  on the values, so every rank sends the same number of bytes (gloo cannot gather unequal sizes).
* ``decompress(payload, ctx)`` returns a flat tensor with ``tensor``'s numel, dtype and device.
* ``summable = True`` means the payload tensors can be added elementwise across ranks by an
  allreduce and the sum decompresses to the sum of the inputs (fp16, rand-k with shared indices,
  PowerSGD factors).  Otherwise payloads are allgathered and each rank's is decoded separately.
* ``aggregate(payloads, ctx, world_size, average)`` turns what arrived (one summed payload, or one
  payload per rank) into the final gradient: the mean or sum by default, the majority vote for the
  sign methods.
* A compressor that needs several communication rounds (PowerSGD) sets ``rounds > 1`` and
  implements ``next_round``: after round ``r``'s payload was summed over ranks, it produces round
  ``r + 1``'s payload.  Compressors never communicate themselves.
* Per-group state (momentum, PowerSGD factors) lives in ``self.state[name]``, a dict of tensors,
  so it can be checkpointed and carried over when the merge plan changes.
* The two-phase scheme (:mod:`mergecomp.schemes.two_phase`) compresses a group in shards: each
  ``compress_shard`` call encodes one contiguous slice on its own (shards start at multiples of
  ``shard_alignment`` elements), and each rank's aggregate of one shard is sent again with the
  codec :meth:`second_phase` returns, whose ``ctx`` and payload sizes must depend only on the
  shard's numel and dtype.
* ``compress_fused(tensor, name, shapes, memory)`` may do the error-feedback ``memory``'s
  ``compensate``, ``compress`` and the memory's update in fewer passes; it returns None where it
  does not (the default), and the pipeline then runs the three.  ``compress_fused_parts``
  may do the same work tensor by tensor as a merged group's gradients arrive (:class:`FusedParts`),
  so that no pass copies them into the group's buffer first.
* Full-size outputs and temporaries come from :meth:`Compressor.scratch`.  When the pipeline
  attached a :class:`~mergecomp.kernels.workspace.Workspace` (on CPU), they are recycled step by step:
  what ``decompress``/``aggregate`` return is then valid until the pipeline's next step, and a
  caller that keeps it longer must copy it.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.kernels.wire import Payload
from mergecomp.kernels.workspace import Workspace, fresh

if TYPE_CHECKING:
    from mergecomp.compressors.base.memory import Memory

__all__ = ["Compressor", "FusedParts", "SummedDecode", "Payload", "check_ratio"]


def check_ratio(ratio: float, option: str = "ratio") -> float:
    """Validate a compression ratio in (0, 1]; raise ValueError naming ``option`` otherwise."""
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{option} must be in (0, 1], got {ratio}")
    return ratio


class Compressor(GroupStateful, abc.ABC):
    """Base class of all compressors; see the module docstring for the contract."""

    #: registry name, set by :func:`mergecomp.register_compressor`
    name: str = ""
    #: payloads may be summed by allreduce (else: allgathered)
    summable: bool = False
    #: number of communication rounds per step
    rounds: int = 1
    #: name of the error-feedback memory used when the user does not choose one
    default_memory: str = "none"
    #: every payload decodes to exactly what was compressed, so an error-feedback memory has no
    #: residual to keep (:meth:`mergecomp.compressors.base.memory.Memory.feed_parts`)
    lossless: bool = False
    #: payloads are combined by a majority vote: the result is the sign of the sum of the ranks'
    #: signs (with or without op=Average), on another scale than a mean, so every group must use
    #: this compressor and none is offered the fp16 or uncompressed codec instead
    #: (:func:`mergecomp.pipeline.plan.has_codec_choice`)
    votes: bool = False
    #: a payload may hold Inf where the tensor compressed is finite (a cast to a narrower float:
    #: fp16 beyond 65504): after an error-feedback memory compensated the tensor, the exchange
    #: then checks the payload (:meth:`mergecomp.pipeline.exchange.Exchange.start`)
    may_overflow: bool = False
    #: two-phase shards start at multiples of this many elements (whole bytes of packed bits,
    #: whole quantization buckets), so each shard is encoded as it would be inside the group
    shard_alignment: int = 1
    #: step-scoped buffer pool attached by the pipeline; None: plain allocations
    workspace: Optional[Workspace] = None
    #: passes over its input :meth:`compress` makes, over its output :meth:`decompress` makes,
    #: and over the group :meth:`next_round` makes (:mod:`mergecomp.pipeline.breakdown` counts them)
    compress_passes: float = 1
    decompress_passes: float = 1
    next_round_passes: float = 0
    #: passes over the group :meth:`subtract_decoded` makes, where it does
    subtract_decoded_passes: float = 1
    #: passes over the group :meth:`compress_fused`'s encode makes (counted as ``encode``, the
    #: compensation folded into it) and its ``update`` makes (counted as ``memory``)
    fused_compress_passes: float = 1
    fused_update_passes: float = 1

    # -- the pipeline ------------------------------------------------------------------------
    @abc.abstractmethod
    def compress(
        self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]] = None
    ) -> Tuple[Payload, Any]:
        """Encode the flat 1-D ``tensor`` of group ``name``.

        ``shapes`` lists the shapes of the parameters concatenated in ``tensor`` (in order);
        ``None`` means a single 1-D tensor.  Returns ``(payload, ctx)``.
        """
        raise NotImplementedError

    def compress_checked(self, tensor: torch.Tensor, name: str,
                         shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any, Optional[bool]]:
        """:meth:`compress`, and whether the payload holds no NaN/Inf where the encode's own
        pass could tell; None: the caller checks (see :attr:`may_overflow`)."""
        payload, ctx = self.compress(tensor, name, shapes)
        return payload, ctx, None

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode one payload (or the elementwise sum of several) into a flat tensor."""
        raise NotImplementedError

    def compress_fused(self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]],
                       memory: "Memory") -> Optional[Tuple[Payload, Any, Callable[[], None]]]:
        """``memory.compensate``, :meth:`compress` and ``memory.feed`` of group ``name`` in fewer
        passes over the group, where this compressor can for ``memory`` and ``tensor``:
        ``(payload, ctx, update)``, the payload and ctx :meth:`compress` gives the compensated
        ``tensor``, bit for bit, and ``update()``, which leaves ``memory`` as ``feed`` would; the
        caller runs it once, after the payload is sent or copied and before ``tensor`` changes.
        ``tensor`` itself stays as given.  None (this base class: always): the caller compensates,
        compresses and feeds."""
        return None

    def compress_fused_parts(self, like: torch.Tensor, name: str, parts: int,
                             memory: "Memory") -> Optional["FusedParts"]:
        """:meth:`compress_fused` of group ``name`` (``like``: a flat tensor of its numel, dtype and
        device, not read) done part by part as its ``parts`` tensors arrive, where this compressor
        can for ``memory``: a :class:`FusedParts`.  None (this base class: always): the caller
        gathers the group and calls :meth:`compress_fused`."""
        return None

    def compress_shard(self, tensor: torch.Tensor, name: str, start: int, total: int) -> Tuple[Payload, Any]:
        """Encode ``tensor``, elements ``[start, start + numel)`` of group ``name``'s flat buffer
        of ``total`` elements, as a payload of its own (the two-phase scheme's first phase).
        Default: :meth:`compress`; a compressor with per-element state of the group overrides
        it to use the slice of that state."""
        return self.compress(tensor, name)

    def second_phase(self) -> "Compressor":
        """The codec each rank sends its aggregated shard with in the two-phase scheme: this
        compressor (majority votes: the exact vote)."""
        return self

    def sent_entries(self, payload: Payload, ctx: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``decompress(payload, ctx)`` as sparse entries ``(indices, values)`` when it is zero
        except ``decoded[indices] = values`` (int64 indices; a repeated index carries equal
        values), else None.  Lets the error-feedback memory skip the dense decode."""
        return None

    def subtract_decoded(self, payload: Payload, ctx: Any, minuend: torch.Tensor,
                         out: Callable[[], torch.Tensor]) -> bool:
        """Write ``minuend - decompress(payload, ctx)`` (every element of the group) into the
        tensor ``out()`` returns, with no full-size decode in between, where this codec can
        (:attr:`subtract_decoded_passes` passes); returns whether it did, else the caller
        decodes and subtracts.  Lets the residual memory keep what a dense decode left behind
        in one pass.  This base class: never."""
        return False

    def next_round(self, summed: Payload, ctx: Any) -> Tuple[Payload, Any]:
        """Multi-round compressors: build the next round's payload from the summed one."""
        raise NotImplementedError(f"compressor {self.name!r} has a single round")

    def aggregate(
        self, payloads: Sequence[Payload], ctx: Any, world_size: int, average: bool
    ) -> torch.Tensor:
        """Combine what arrived: one summed payload or one payload per rank.

        Returns the mean over ranks if ``average`` else the sum.
        """
        total = self.decompress(payloads[0], ctx)
        for payload in payloads[1:]:
            total.add_(self.decompress(payload, ctx))
        if average:
            total.div_(world_size)
        return total

    def aggregate_passes(self, payloads: int, average: bool) -> float:
        """Passes :meth:`aggregate` makes over the group for ``payloads`` payloads: here one
        decode each, one add for each after the first and one division when averaging."""
        return payloads * self.decompress_passes + payloads - 1 + (1 if average else 0)

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat tensor: from the attached workspace (valid until the next
        step), or freshly allocated when there is none."""
        if self.workspace is None:
            return fresh(numel, dtype, device)
        return self.workspace.empty(numel, dtype, device)

    # -- bookkeeping -------------------------------------------------------------------------
    def bits_per_element(self, numel: int, dtype: torch.dtype = torch.float32) -> float:
        """Bits one rank puts on the wire per input element (first round only)."""
        payload, _ = self.compress(torch.zeros(numel, dtype=dtype), "__probe__")
        self.state.pop("__probe__", None)
        return 8.0 * sum(t.numel() * t.element_size() for t in payload) / numel


class FusedParts(abc.ABC):
    """One group's :meth:`Compressor.compress_fused`, encoded tensor by tensor as the group's
    gradients arrive (:meth:`Compressor.compress_fused_parts`).  The caller calls :meth:`add`
    once per tensor, in any order, then :meth:`finish` once, or, when a part was not finite,
    puts back the state of the holders in :attr:`kept` (which it filled) and starts over with the
    whole group.  The memory's state the parts write goes to a spare buffer of a kept group
    (:meth:`~mergecomp.compressors.base.memory.Memory.keep`), so putting it back costs no copy.  The payload's
    tensors are its own: nothing writes them before the next step, and a one-tensor payload
    starts on an 8-byte boundary of its storage with zeros after it to the next one (it goes on
    the wire as it lies, :func:`~mergecomp.kernels.wire.pack_payload`)."""

    #: ``(holder, group name, what it kept)`` to restore if the step cannot use the parts
    kept: list

    @abc.abstractmethod
    def add(self, part: int, start: int, tensor: torch.Tensor) -> bool:
        """Encode the group's elements ``[start, start + tensor.numel())`` from ``tensor``
        (contiguous, read flat, not written), the group's tensor number ``part``.  Returns whether
        they are finite (no NaN or Inf)."""

    @abc.abstractmethod
    def finish(self) -> Tuple[Payload, Any, Callable[[], None]]:
        """After every part was added and found finite: ``(payload, ctx, update)`` as
        :meth:`Compressor.compress_fused` returns them for the whole group (where the payload
        holds sums over the group, they are added part by part: equal to the whole group's to
        rounding)."""


class SummedDecode(Compressor):
    """A compressor whose decode of several ranks' payloads is one pass (:meth:`decode_sum`):
    :meth:`decompress` decodes one payload with it and :meth:`aggregate` all of them, without a
    full-size decode per rank."""

    def decode_sum(self, payloads: Sequence[Payload], ctx: Any, divisor: int) -> torch.Tensor:
        """The sum of the ``payloads``' decodes, added in order and divided by ``divisor``."""
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.decode_sum([payload], ctx, 1)

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, world_size: int, average: bool) -> torch.Tensor:
        return self.decode_sum(payloads, ctx, world_size if average else 1)

    def aggregate_passes(self, payloads: int, average: bool) -> float:
        return 1  # every rank's payload decoded, summed and divided in one pass
