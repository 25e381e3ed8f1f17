"""The options of a merged step, in one place for the three front ends.

:class:`StepOptions` holds what a user may set on ``DistributedOptimizer``, ``ddp_comm_hook``
and the TensorFlow ``GradientReducer`` beyond Horovod's own arguments, with one default each;
:data:`FRONT_ENDS` declares which of them, and which values, each front end takes.  Each front
end passes its keyword arguments through :meth:`StepOptions.create`, which rejects an unknown,
inapplicable or refused one by name.  :class:`FrontEnd` holds what a front end tells the step
about itself.  What the compressor can travel by is :mod:`mergecomp.exchange.compatibility`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.exchange.compatibility import check
from mergecomp.exchange.plan import EXEMPT, WARMUP_FP16, WARMUP_QSGD, WARMUP_QSGD4, Exemptions, PlanSpec
from mergecomp.exchange.schemes import OPTIONS
from mergecomp.pipeline.nonfinite import NONFINITE_POLICIES
from mergecomp.scheduler.online import SchedulerConfig

__all__ = ["StepOptions", "FrontEnd", "Accepts", "FRONT_ENDS", "WARMUP_CODECS"]

#: ``compression_warmup_codec``'s values, by the route the warm-up's groups then take
WARMUP_CODECS = {"none": EXEMPT, "fp16": WARMUP_FP16, "qsgd": WARMUP_QSGD, "qsgd4": WARMUP_QSGD4}


@dataclass(frozen=True)
class Accepts:
    """What one front end takes of :class:`StepOptions`: all but those it sets from its own
    arguments (``fixed``: option -> those arguments) or has no use for (``without``), each with
    every valid value but those of ``values`` (option -> (the values it takes, why only those)),
    and the default of :class:`StepOptions` but where ``defaults`` (option -> value) refuses it."""

    fixed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    without: Tuple[str, ...] = ()
    values: Mapping[str, Tuple[Tuple[Any, ...], str]] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_HOROVOD_ARGUMENTS = {"groups": "groups, num_groups", "average": "op", "prescale": "op, gradient_predivide_factor",
                      "postscale": "op, gradient_predivide_factor"}
_NO_SKIP = (("propagate", "raise", "ignore"), "it hands the gradients back and cannot skip the optimizer's step")
#: each front end's options, by the name it gives in errors
FRONT_ENDS: Dict[str, Accepts] = {
    "DistributedOptimizer": Accepts(fixed=_HOROVOD_ARGUMENTS),
    "ddp_comm_hook": Accepts(without=("groups", "scheduler", "average", "prescale", "postscale"),
                             values={"nonfinite": _NO_SKIP}),
    "GradientReducer": Accepts(fixed=_HOROVOD_ARGUMENTS, values={"nonfinite": _NO_SKIP}),
    "DiLoCo": Accepts(without=("average", "prescale", "postscale"),
                      values={"nonfinite": (("skip", "raise", "ignore"), "no loss scaler sees the outer step: a NaN "
                                            "would reach the global parameters")},
                      defaults={"nonfinite": "skip"}),
}


@dataclass(frozen=True)
class StepOptions:
    """How a merged step exchanges its gradients.  ValueError naming the option for a bad value.

    Args:
        groups: ``"auto"`` (the online scheduler searches the groups and each group's codec),
            ``"layerwise"``, an int ``k`` (k groups of about equal bytes), a list of lists of
            names, a :class:`~mergecomp.exchange.plan.GroupPlan`, or None (groups of about
            25 MB, at most 4).
        nonfinite: what NaN/Inf in any rank's gradients does; one small allreduce per step
            agrees on it, and it never enters the error-feedback memory (unless ``"ignore"``).
            ``"propagate"`` (the default, as Horovod and DDP): every rank's results are NaN (so a
            ``GradScaler`` on every rank skips the same step and lowers its scale) and the error-feedback memory and
            compressor state are put back as they were before the step; a step whose every
            group travels as a plain sum (lossless, by allreduce) is not checked: the sum
            carries the NaN/Inf into its group's result on every rank; ``"raise"``:
            FloatingPointError on every rank naming the ranks and tensors; ``"skip"``: the step
            is skipped on every rank (counted in ``skipped_steps``); ``"ignore"``: no check.
        scheduler: :class:`~mergecomp.scheduler.online.SchedulerConfig` for ``groups="auto"``.
        compression_warmup_steps: the first this many steps (counted with the checkpointed
            step, so a resumed run continues the count) send every group with the codec
            ``"exempt"``: the plain average, which neither the error-feedback memory nor the
            compressor state sees, so both start clean when compression begins.  The scheduler
            takes no sample until then.
        compression_warmup_codec: what those steps send: ``"none"`` (the gradients as they are,
            the default), ``"fp16"`` (cast to fp16, half the bytes; a value beyond fp16's range
            is a non-finite step under ``nonfinite``), ``"qsgd"`` (QSGD's unbiased 8-bit
            codes at 127 levels with one norm per 512 elements, about a quarter of the bytes,
            allgathered) or ``"qsgd4"`` (its 4-bit codes, ``levels=7``: an eighth); all
            outside error feedback and compressor state.  It applies
            to every group but those of ``uncompressed`` and ``min_compress_numel`` tensors, and
            to the momentum exchange's variance refreshes.
        uncompressed, min_compress_numel: tensors whose name matches one of these patterns
            (fnmatch, e.g. ``"*.bias"``), or with fewer elements, are exempt from compression:
            they travel in groups of their own sent with the codec ``"exempt"``.
        scheme: how a group sent with the configured compressor travels
            (:mod:`mergecomp.exchange.schemes`): ``"allgather"`` (each rank's payload of the whole group to
            every rank), ``"two-phase"`` (compressed shards by all-to-all, then each rank's
            compressed aggregate of its shard by allgather: bytes per rank flat in the number of
            ranks), ``"hierarchical"`` (summed uncompressed inside each host, each rank's shard
            of the host's sum compressed across hosts only) or ``"hierarchical-two-phase"`` (the
            same, two-phase across hosts), or None: allgather, unless the scheduler
            (``groups="auto"``) picks two-phase or, with several processes on each of several
            hosts, a hierarchical scheme for a group.  Compressors whose payloads are summed
            travel by allreduce unless another scheme is asked for.  The hierarchical schemes
            need the same number of processes on every host; on one host, or with one process
            per host, they are allgather and two-phase.
        average: divide the sum over ranks by the number of ranks; prescale, postscale:
            multiply each gradient by ``prescale`` before the exchange and each result by
            ``postscale`` after it.  Front ends set these three from Horovod's ``op`` and
            ``gradient_predivide_factor``.
    """

    groups: PlanSpec = "auto"
    nonfinite: str = "propagate"
    scheduler: Optional[SchedulerConfig] = None
    compression_warmup_steps: int = 0
    compression_warmup_codec: str = "none"
    uncompressed: Sequence[str] = ()
    min_compress_numel: int = 0
    scheme: Optional[str] = None
    average: bool = True
    prescale: float = 1.0
    postscale: float = 1.0

    def __post_init__(self) -> None:
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        warmup = self.compression_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"compression_warmup_steps must be an int >= 0, got {warmup!r}")
        if self.compression_warmup_codec not in WARMUP_CODECS:
            raise ValueError(f"compression_warmup_codec must be one of {tuple(WARMUP_CODECS)}, got "
                             f"{self.compression_warmup_codec!r}")
        if self.scheme is not None and self.scheme not in OPTIONS:
            raise ValueError(f"scheme must be one of {OPTIONS} or None, got {self.scheme!r}")
        object.__setattr__(self, "scheduler", self.scheduler or SchedulerConfig())
        object.__setattr__(self, "prescale", float(self.prescale))
        object.__setattr__(self, "postscale", float(self.postscale))
        self.exemptions  # validates uncompressed and min_compress_numel

    @classmethod
    def create(cls, who: str, options: Mapping[str, Any], defaults: Mapping[str, Any] = (),
               fixed: Mapping[str, Any] = ()) -> "StepOptions":
        """The options front end ``who`` (a name in :data:`FRONT_ENDS`) was given as keywords
        (``options``) over ``defaults`` (where a setting of its own changes one) and its
        :attr:`Accepts.defaults`, with the values its own arguments set (``fixed``: those
        :attr:`Accepts.fixed`); TypeError naming a keyword that is not an option of ``who``,
        ValueError naming a value it refuses."""
        accepts = FRONT_ENDS[who]
        accepted = [f.name for f in dataclasses.fields(cls) if f.name not in (*accepts.fixed, *accepts.without)]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TypeError(f"{who}() got unexpected keyword argument(s) {unknown}; its mergecomp options are "
                            f"{accepted}")
        made = cls(**{**accepts.defaults, **dict(defaults), **options, **dict(fixed)})
        for option, (values, why) in accepts.values.items():
            if getattr(made, option) not in values:
                raise ValueError(f"{who}: {option} must be one of {values} ({why}), got {getattr(made, option)!r}")
        return made

    @property
    def exemptions(self) -> Exemptions:
        """Which tensors are sent uncompressed."""
        return Exemptions.create(self.uncompressed, self.min_compress_numel)

    def check(self, compressor: Compressor) -> None:
        """ValueError where the ``scheme`` asked for cannot carry ``compressor``
        (:mod:`~mergecomp.exchange.compatibility`)."""
        if self.scheme is not None:
            check(compressor, self.scheme, f"scheme={self.scheme!r}")

    def described(self) -> Dict[str, Any]:
        """What every rank must share, for :func:`~mergecomp.pipeline.agreement.check_ranks_agree`."""
        return {"groups": repr(("auto", self.scheduler) if self.groups == "auto" else self.groups),
                "nonfinite": self.nonfinite, "scaling": (self.prescale, self.postscale),
                "compression_warmup_steps": self.compression_warmup_steps,
                "compression_warmup_codec": self.compression_warmup_codec, "scheme": self.scheme,
                "uncompressed and min_compress_numel": repr(self.exemptions)}


@dataclass(frozen=True)
class FrontEnd:
    """What a front end tells its step about itself.

    Args:
        who: its name, in errors; ``tensor_kind``: what the tensors are to the user
            (``"parameters"``, ``"variables"``), in errors.
        observe_order: the first step runs in reverse tensor order; then the plan is rebuilt
            along the order in which rank 0's tensors arrived (the backward order).  False:
            the reverse tensor order is final.
        timed: tensors arrive during the backward pass, so their arrival times tell the
            scheduler how communication can overlap it (False: all arrive at once).
        hand_out: results leave the step (the caller may keep them): a buffer that became a
            result is not written again.  False: results live in the group buffers until the
            next ``finish``.
        in_place: a gradient given to ``add`` may be overwritten by its result, which the front
            end then takes where the gradient was: a group of one tensor is sent from its
            gradient, with no buffer and no copy (the PyTorch optimizer's ``p.grad``).
        agree: more settings (description -> value) every rank must share, checked with the
            others at construction.
        cache_tag: words prefixed to the plan-cache signature.
    """

    who: str = "mergecomp"
    tensor_kind: str = "tensors"
    observe_order: bool = True
    timed: bool = True
    hand_out: bool = False
    in_place: bool = False
    agree: Tuple[Tuple[str, Any], ...] = ()
    cache_tag: Tuple[str, ...] = ()
