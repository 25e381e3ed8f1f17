"""The one interface every compression algorithm implements.

Contract (what the pipeline, :mod:`mergecomp.exchange.exchange` and :mod:`mergecomp.exchange.schemes`,
relies on):

* ``compress(tensor, name, shapes)`` takes a flat, contiguous 1-D floating tensor (one merged
  group's gradients, already error-compensated) and returns ``(payload, ctx)``.
  ``payload`` is a tuple of tensors: the only thing that goes on the wire.  ``ctx`` is whatever
  ``decompress`` needs besides the payload, and it must be *the same on every rank* (numel, dtype,
  shapes, a step seed...): it is used to decode the payloads the other ranks sent.  Anything
  rank-specific (norms, means, indices) belongs in the payload.
* Payload sizes depend only on ``tensor.numel()``, its dtype and the compressor's settings, never
  on the values, so every rank sends the same number of bytes (gloo cannot gather unequal sizes).
* ``decompress(payload, ctx)`` returns a flat tensor with ``tensor``'s numel, dtype and device.
* ``aggregate(payloads, ctx, world_size, average)`` turns what arrived (one summed payload, or one
  payload per rank) into the final gradient: the mean or sum by default, the majority vote for the
  sign methods.
* What it declares: ``summable`` (the payload tensors can be added elementwise across ranks by an
  allreduce and the sum decompresses to the sum of the inputs: fp16, rand-k with shared indices,
  PowerSGD factors; otherwise payloads are allgathered and each rank's is decoded), ``rounds``
  (more than one: ``next_round`` makes round ``r + 1``'s payload from round ``r``'s summed over
  ranks; compressors never communicate themselves), ``default_memory``, ``lossless``, ``votes``,
  ``may_overflow``, and ``passes`` (:class:`~mergecomp.compressors.base.passes.CodecPasses`).
* Per-group state (momentum, PowerSGD factors) lives in ``self.state[name]``, a dict of tensors,
  so it can be checkpointed and carried over when the merge plan changes.
* Full-size outputs and temporaries come from :meth:`Compressor.scratch`.  When the pipeline
  attached a :class:`~mergecomp.kernels.workspace.Workspace` (on CPU), they are recycled step by
  step: what ``decompress``/``aggregate`` return is then valid until the pipeline's next step,
  and a caller that keeps it longer must copy it.
* Anything more is an opt-in capability the compressor declares
  (:mod:`mergecomp.compressors.base.capabilities`): encoding in shards, fused with the memory,
  part by part, and cheaper memory updates.  Compressors reach the native kernels only through
  :mod:`mergecomp.kernels.codecs`.
"""
from __future__ import annotations

import abc
from typing import Any, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.kernels.wire import Payload
from mergecomp.kernels.workspace import Workspace, fresh

__all__ = ["Compressor", "SummedDecode", "Payload", "bits_per_element", "check_ratio"]


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
    #: steps after which the payloads' sizes repeat (ACP-SGD alternates two factors)
    period: int = 1
    #: name of the error-feedback memory used when the user does not choose one
    default_memory: str = "none"
    #: every payload decodes to exactly what was compressed, so an error-feedback memory has no
    #: residual to keep
    lossless: bool = False
    #: payloads are combined by a majority vote: the result is the sign of the sum of the ranks'
    #: signs (with or without op=Average), on another scale than a mean, so every group must use
    #: this compressor and none is offered the fp16 or uncompressed codec instead
    #: (:func:`mergecomp.exchange.plan.has_codec_choice`)
    votes: bool = False
    #: a payload may hold Inf where the tensor compressed is finite (a cast to a narrower float:
    #: fp16 beyond 65504): after an error-feedback memory compensated the tensor, the exchange
    #: then checks the payload
    may_overflow: bool = False
    #: approximates each tensor as a low-rank matrix (PowerSGD, ACP-SGD), so a per-element
    #: rescaling before it (the momentum exchange's division by Adam's denominator) would break
    #: the structure it relies on, and a shard of a group (two-phase, hierarchical, FSDP) cuts
    #: its matrices
    low_rank: bool = False
    #: the passes over the group its operations make (:mod:`mergecomp.exchange.breakdown`)
    passes: CodecPasses = CodecPasses()
    #: step-scoped buffer pool attached by the pipeline; None: plain allocations
    workspace: Optional[Workspace] = None

    @abc.abstractmethod
    def compress(
        self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]] = None
    ) -> Tuple[Payload, Any]:
        """Encode the flat 1-D ``tensor`` of group ``name``.

        ``shapes`` lists the shapes of the parameters concatenated in ``tensor`` (in order);
        ``None`` means a single 1-D tensor.  Returns ``(payload, ctx)``.
        """
        raise NotImplementedError

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode one payload (or the elementwise sum of several) into a flat tensor."""
        raise NotImplementedError

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

    def next_round(self, summed: Payload, ctx: Any) -> Tuple[Payload, Any]:
        """Compressors of several rounds: the next round's payload from the summed one."""
        raise NotImplementedError(f"compressor {self.name!r} has a single round")

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat tensor: from the attached workspace (valid until the next
        step), or freshly allocated when there is none."""
        if self.workspace is None:
            return fresh(numel, dtype, device)
        return self.workspace.empty(numel, dtype, device)


class SummedDecode(Compressor):
    """A compressor whose decode of several ranks' payloads is one pass (:meth:`decode_sum`):
    :meth:`decompress` decodes one payload with it and :meth:`aggregate` all of them, without a
    full-size decode per rank."""

    passes = CodecPasses(aggregate=1)  # every rank's payload decoded, summed and divided in one pass

    def decode_sum(self, payloads: Sequence[Payload], ctx: Any, divisor: int) -> torch.Tensor:
        """The sum of the ``payloads``' decodes, added in order and divided by ``divisor``."""
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.decode_sum([payload], ctx, 1)

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, world_size: int, average: bool) -> torch.Tensor:
        return self.decode_sum(payloads, ctx, world_size if average else 1)


def bits_per_element(compressor: Compressor, numel: int, dtype: torch.dtype = torch.float32,
                     shapes: Optional[Sequence[torch.Size]] = None) -> float:
    """Bits one rank puts on the wire per input element with ``compressor``, every round of it
    counted (averaged over the steps of its :attr:`~Compressor.period`), for a group of
    ``numel`` elements (of tensors ``shapes``, for codecs that use them: PowerSGD's factors)."""
    sent = 0
    for _ in range(compressor.period):
        payload, ctx = compressor.compress(torch.zeros(numel, dtype=dtype), "__probe__", shapes)
        sent += sum(t.numel() * t.element_size() for t in payload)
        for _ in range(1, compressor.rounds):
            payload, ctx = compressor.next_round(payload, ctx)
            sent += sum(t.numel() * t.element_size() for t in payload)
        if compressor.period > 1:  # the next step's payload follows from this one's
            compressor.aggregate([payload], ctx, 1, True)
    compressor.state.pop("__probe__", None)
    return 8.0 * sent / numel / compressor.period
