"""One training step of merged groups, for a fixed list of named tensors: the core every front
end adapts.

A :class:`MergedStep` owns, for tensors ``0..n-1`` (names, shapes, dtypes):

* the merge plan and its layout, and one flat buffer per group;
* the step's lifecycle: :meth:`~MergedStep.add` copies tensor ``i``'s gradient into its slot
  (checking NaN/Inf in the same pass where it can) and starts, in plan order, every group whose
  last tensor has arrived; :meth:`~MergedStep.finish` starts the rest (missing tensors count as
  zeros), agrees across ranks on non-finite groups, waits for and decodes every group into its
  buffer, and returns the reduced tensors;
* the non-finite policy (``"propagate"``, ``"raise"``, ``"skip"`` or ``"ignore"``), the step counter, the first
  step's observed gradient order (rank 0's, broadcast), plan switches that carry error-feedback
  and compressor state over (:func:`~mergecomp.pipeline.plan.remap_state`), the online scheduler's feed
  (``groups="auto"``), and checkpoints (:meth:`~MergedStep.state_dict`);
* convergence safety: the compression warm-up (the first steps go uncompressed) and the
  tensors exempt from compression (:class:`~mergecomp.pipeline.plan.Exemptions`), both sent with the
  codec :data:`~mergecomp.pipeline.plan.EXEMPT`;
* where each step's time went (:meth:`~MergedStep.step_breakdown`, :mod:`mergecomp.pipeline.breakdown`).

Front ends only adapt their framework's objects to it: ``p.grad`` views and hooks for the
PyTorch optimizer, DDP's buckets for the DDP hook (groups given by the caller through
:meth:`~MergedStep.start_group`), DLPack tensors for TensorFlow.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, FusedParts
from mergecomp.engines.communicator import Communicator
from mergecomp.kernels import codecs, native
from mergecomp.pipeline.agreement import check_ranks_agree
from mergecomp.pipeline.breakdown import DECODE, ENCODE, SCHEDULER, WAIT, Breakdown
from mergecomp.pipeline.exchange import Exchange
from mergecomp.pipeline.job import Job
from mergecomp.pipeline.nonfinite import NONFINITE_POLICIES, OVERFLOWED, NonfiniteCheck
from mergecomp.pipeline.plan import (COMPRESSED, EXEMPT, Exemptions, Group, GroupPlan, PlanSpec, build_plan, layout,
                                     remap_state)
from mergecomp.scheduler.online import MergeScheduler, SchedulerConfig, exchange_scheduler
from mergecomp.schemes import OPTIONS, SHARDED

__all__ = ["MergedStep", "Reduced", "HoldsMergedStep", "DEFAULT_GROUP_BYTES", "DEFAULT_MAX_GROUPS",
           "check_safety_options", "check_scheme"]

logger = logging.getLogger("mergecomp")

#: ``groups=None``: groups of about this many bytes (like DDP's ``bucket_cap_mb=25``) ...
DEFAULT_GROUP_BYTES = 25 * 2**20
#: ... and at most this many
DEFAULT_MAX_GROUPS = 4


def check_safety_options(compression_warmup_steps: int, uncompressed: Sequence[str],
                         min_compress_numel: int) -> Exemptions:
    """Validate the convergence-safety options (ValueError naming the option); returns the
    exemptions.  Front ends that build their :class:`MergedStep` late call it up front."""
    if (isinstance(compression_warmup_steps, bool) or not isinstance(compression_warmup_steps, int)
            or compression_warmup_steps < 0):
        raise ValueError(f"compression_warmup_steps must be an int >= 0, got {compression_warmup_steps!r}")
    return Exemptions.create(uncompressed, min_compress_numel)


def check_scheme(scheme: Optional[str], compressor: Compressor) -> Optional[str]:
    """Validate the ``scheme`` option against ``compressor`` (ValueError naming both)."""
    if scheme is not None and scheme not in OPTIONS:
        raise ValueError(f"scheme must be one of {OPTIONS} or None, got {scheme!r}")
    if scheme in SHARDED and compressor.rounds > 1:
        raise ValueError(f"scheme={scheme!r} needs a single-round compressor; {compressor.name!r} "
                         f"takes {compressor.rounds} rounds")
    return scheme


@dataclass
class Reduced:
    """One step's result: ``flats[g]`` is group ``groups[g]``'s reduced flat gradient."""

    groups: List[Group]
    flats: List[torch.Tensor]
    #: what :meth:`tensors` returns, once made (a later step's result with the same groups and
    #: buffers takes them over: :meth:`MergedStep.finish`)
    views: Optional[List[Optional[torch.Tensor]]] = None

    def tensors(self, count: int) -> List[torch.Tensor]:
        """Views of the ``count`` tensors' reduced gradients, by tensor index, in their shapes."""
        if self.views is None or len(self.views) != count:
            self.views = [None] * count
            for group, flat in zip(self.groups, self.flats):
                for i, offset, n, shape in zip(group.indices, group.offsets, group.numels(), group.shapes):
                    self.views[i] = flat[offset:offset + n].view(shape)
        return list(self.views)

    def same_groups_and_buffers(self, other: "Reduced") -> bool:
        """Whether ``other`` is made of the same group and buffer objects."""
        return (len(self.groups) == len(other.groups) == len(self.flats) == len(other.flats)
                and all(a is b for a, b in zip(self.groups, other.groups))
                and all(a is b for a, b in zip(self.flats, other.flats)))


class HoldsMergedStep:
    """What every front end that holds a :class:`MergedStep` as ``self.merged`` shows of it."""

    merged: "MergedStep"
    exchange = property(lambda self: self.merged.exchange, doc="the :class:`~mergecomp.pipeline.exchange.Exchange`")
    compressor = property(lambda self: self.merged.exchange.compressor, doc="the configured compressor")
    memory = property(lambda self: self.merged.exchange.memory, doc="the error-feedback memory")
    plan = property(lambda self: self.merged.plan, doc="the current :class:`~mergecomp.pipeline.plan.GroupPlan`")
    groups = property(lambda self: self.merged.groups, doc="the current groups, with their tensors' offsets")
    scheduler = property(lambda self: self.merged.scheduler, doc="the online scheduler (``groups='auto'``)")
    skipped_steps = property(lambda self: self.merged.skipped_steps, doc="steps skipped for NaN/Inf")
    breakdown_window = property(lambda self: self.merged.timings.window,
                                lambda self, steps: setattr(self.merged.timings, "window", steps),
                                doc="how many steps :meth:`step_breakdown` keeps (settable; default 20)")

    def step_breakdown(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Where the last ``steps`` steps' time went, averaged (default: the steps kept, see
        :attr:`breakdown_window`): :meth:`MergedStep.step_breakdown`."""
        return self.merged.step_breakdown(steps)


def _holds(tensor: Optional[torch.Tensor], flat: torch.Tensor, offset: int) -> bool:
    """Whether ``tensor`` already lives at element ``offset`` of ``flat`` (a view handed out by
    an earlier step that backward accumulated into)."""
    return (tensor is not None and not tensor.is_sparse
            and tensor.data_ptr() == flat.data_ptr() + offset * flat.element_size())


class MergedStep:
    """Merged, compressed reduction of one step's gradients of a fixed list of tensors.

    Args:
        compression: compressor name (``mergecomp.compressor_names()``) or instance.
        memory: error-feedback memory name or instance; None: the compressor's default.
        comm: the engine.
        names: one unique name per tensor (plan specs and errors use them).
        shapes, dtypes: of each tensor's gradient.
        device: where the gradients live.
        groups: ``"auto"`` (the online scheduler), ``"layerwise"``, an int ``k`` (k groups of
            about equal bytes), a list of lists of names, a :class:`~mergecomp.pipeline.plan.GroupPlan`,
            or None (groups of :data:`DEFAULT_GROUP_BYTES`, at most :data:`DEFAULT_MAX_GROUPS`).
        average: divide the sum over ranks by the number of ranks.
        prescale, postscale: multiply each gradient by ``prescale`` before the exchange and each
            result by ``postscale`` after it (Horovod's ``gradient_predivide_factor``).
        nonfinite: ``"propagate"``: when any rank's gradient held NaN/Inf, every rank's results
            are NaN (so a ``GradScaler`` on every rank skips the same step) and the
            error-feedback memory and compressor state are put back as they were before the
            step; ``"raise"``: FloatingPointError on every rank naming the ranks and tensors;
            ``"skip"``: :meth:`finish` returns None on every rank (:attr:`skipped_steps` counts
            them); ``"ignore"``: no check.  NaN/Inf never enters the error-feedback memory
            unless ``"ignore"``.
        scheduler: :class:`~mergecomp.scheduler.online.SchedulerConfig` for ``groups="auto"``.
        observe_order: the first step runs in reverse tensor order; then the plan is rebuilt
            along the order in which rank 0's tensors arrived (the backward order).  False:
            the reverse tensor order is final.
        timed: tensors arrive during the backward pass, so their arrival times tell the
            scheduler how communication can overlap it (False: all arrive at once).
        hand_out: results leave the step (the caller may keep them): a buffer that became a
            result is not written again.  False: results live in the group buffers until the
            next :meth:`finish`.
        tensor_kind: what the tensors are to the user (``"parameters"``, ``"variables"``), in errors.
        caller_groups: the caller defines each step's groups with :meth:`start_group` (DDP's
            buckets) instead of a plan; ``groups`` is then ignored, and tensors may also be
            registered as they come (:meth:`add_tensor`).
        who: the front end's name, for errors; ``agree``: more settings (description -> value)
            every rank must share, checked with the others at construction.
        cache_tag: words prefixed to the plan-cache signature.
        compression_warmup_steps: the first this many steps (by :attr:`step`, so a resumed
            run continues the count) send every group with the codec ``"exempt"``: the plain
            average, which neither the error-feedback memory nor the compressor state sees, so
            both start clean when compression begins.  The scheduler takes no sample until then.
        uncompressed, min_compress_numel: tensors whose name matches one of these patterns
            (fnmatch, e.g. ``"*.bias"``), or with fewer elements, are exempt from compression:
            they leave their groups for trailing groups of their own sent with the codec
            ``"exempt"`` (with caller-given groups, each group's exempt tensors are copied out
            into a group of their own and the results copied back).
        scheme: how a group sent with the configured compressor travels: ``"allgather"`` (each
            rank's payload of the whole group to every rank), ``"two-phase"`` (compressed shards
            by all-to-all, then each rank's compressed aggregate of its shard by allgather:
            bytes per rank flat in the number of ranks; :mod:`mergecomp.schemes.two_phase`),
            ``"hierarchical"`` (a reduce-scatter inside each host, each rank's shard of the
            host's sum compressed and allgathered among the ranks of its local rank on every
            host, an allgather inside the host: compressed bytes cross hosts only) or
            ``"hierarchical-two-phase"`` (the same, with the two-phase scheme across hosts), or
            None: allgather, unless the scheduler (``groups="auto"``) chooses two-phase or, with
            several processes on each of several hosts, a hierarchical scheme for a group.  Compressors whose payloads are summed travel by allreduce unless another
            scheme is asked for.  The hierarchical schemes need the same number of processes on
            every host; on one host, or with one process per host, they are allgather and
            two-phase.
    """

    def __init__(self, compression, memory, comm: Communicator, names: Sequence[str],
                 shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], device: torch.device,
                 groups: PlanSpec = "auto", average: bool = True, nonfinite: str = "raise",
                 prescale: float = 1.0, postscale: float = 1.0,
                 scheduler: Optional[SchedulerConfig] = None, observe_order: bool = True, timed: bool = True,
                 hand_out: bool = False, caller_groups: bool = False, who: str = "mergecomp",
                 tensor_kind: str = "tensors",
                 agree: Optional[Dict[str, Any]] = None, cache_tag: Sequence[str] = (),
                 compression_warmup_steps: int = 0, uncompressed: Sequence[str] = (),
                 min_compress_numel: int = 0, scheme: Optional[str] = None) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        duplicates = sorted({n for n in names if list(names).count(n) > 1})
        if duplicates:
            raise ValueError(f"{who}: tensor names must be unique, got duplicates {duplicates}")
        self.exchange = Exchange.create(compression, memory, comm, average=average,
                                        check_finite=nonfinite != "ignore", recycle=not hand_out,
                                        keep_state=nonfinite == "propagate")
        self.comm = comm
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.device = torch.device(device)
        self.nonfinite = nonfinite
        self.prescale, self.postscale = float(prescale), float(postscale)
        self.warn_sparse = True  # a sparse gradient warns that it is exchanged densely
        self.skipped_steps = 0
        self.scheduler: Optional[MergeScheduler] = None
        self._caller_groups = caller_groups
        self._auto = groups == "auto" and not caller_groups
        self._spec = None if self._auto else groups
        self._scheduler_config = scheduler or SchedulerConfig()
        self._order_final = caller_groups or not observe_order or isinstance(groups, (list, tuple, GroupPlan))
        self._timed = timed
        self._hand_out = hand_out
        self._who = who
        self._kind = tensor_kind
        self._cache_tag = list(cache_tag)
        self._last_end: Optional[float] = None
        self._last_reduced: Optional[Reduced] = None  # the last step's result (its views are reused)
        self._before: Optional[List[Dict]] = None  # state snapshot while caller-given groups change
        self._exemptions = check_safety_options(compression_warmup_steps, uncompressed, min_compress_numel)
        self.scheme = check_scheme(scheme, self.exchange.compressor)
        self.warmup_steps = compression_warmup_steps
        self._exempt = self._exemptions.flags(self.names, [s.numel() for s in self.shapes])
        self._search_order: List[int] = []  # the tensors the scheduler cuts: the exempt ones left out
        #: the last steps' timings (:meth:`step_breakdown`)
        self.timings = Breakdown()
        check_ranks_agree(self.exchange, {
            f"{tensor_kind} (names, shapes, dtypes)": [(n, tuple(s), str(d)) for n, s, d in
                                                zip(self.names, self.shapes, self.dtypes)],
            "groups": "caller's" if caller_groups else repr(self._spec if not self._auto
                                                            else ("auto", self._scheduler_config)),
            "nonfinite": nonfinite, "scaling": (self.prescale, self.postscale),
            "compression_warmup_steps": compression_warmup_steps, "scheme": scheme,
            "uncompressed and min_compress_numel": repr(self._exemptions), **(agree or {})}, who)
        if caller_groups:
            self._plan, self._groups, self._where, self._buffers = GroupPlan(()), [], {}, []
            self._parts: Dict[str, torch.Tensor] = {}  # split groups' buffers, by group name
            self._reset()
            return
        if not self.names:
            raise ValueError(f"{who}: no {tensor_kind} to exchange gradients for")
        self._install(self._make_plan(list(reversed(range(len(self.names))))))
        if self._auto and self._order_final:
            self._start_scheduler()

    # -- what it holds ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps finished so far (checkpointed)."""
        return self.exchange.step

    @property
    def plan(self) -> GroupPlan:
        return self._plan

    @property
    def groups(self) -> List[Group]:
        """The current groups with their tensors' offsets."""
        return list(self._groups)

    @property
    def buffers(self) -> List[torch.Tensor]:
        """The groups' flat buffers, in plan order (none with caller-given groups: the caller's)."""
        return [] if self._caller_groups else [self._buffer(g) for g in range(len(self._groups))]

    @property
    def in_flight(self) -> bool:
        """Whether a step has begun (a tensor added or a group started) and not finished."""
        return any(self._arrived) or bool(self._started)

    def tensor_names(self, group: Group) -> List[str]:
        return [self.names[i] for i in group.indices]

    def add_tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Register one more tensor (caller-given groups only); returns its index."""
        if not self._caller_groups:
            raise RuntimeError(f"{self._who}: add_tensor() needs caller_groups=True")
        self.names.append(name)
        self.shapes.append(torch.Size(shape))
        self.dtypes.append(dtype)
        self._exempt.append(self._exemptions.exempt(name, self.shapes[-1].numel()))
        self._arrived.append(False)
        return len(self.names) - 1

    @property
    def exempt(self) -> List[str]:
        """Names of the tensors sent uncompressed (``uncompressed``, ``min_compress_numel``)."""
        return [n for n, e in zip(self.names, self._exempt) if e]

    @property
    def compressing(self) -> bool:
        """Whether the compression warm-up is over (from this step on, groups are compressed)."""
        return self.step >= self.warmup_steps

    # -- plans -----------------------------------------------------------------------------
    def _nbytes(self) -> List[int]:
        return [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes)]

    def _make_plan(self, order: Sequence[int], spec: PlanSpec = None) -> GroupPlan:
        nbytes = self._nbytes()
        spec = self._spec if spec is None else spec
        if spec is None:
            sent = sum(nbytes[i] for i in order if not self._exempt[i])
            spec = max(1, min(DEFAULT_MAX_GROUPS, math.ceil(sent / DEFAULT_GROUP_BYTES)))
        return build_plan(spec, order, self.names, nbytes, self.dtypes, self._exempt)

    def _install(self, plan: GroupPlan) -> None:
        self._plan = plan
        self._groups = layout(plan, self.shapes)
        self._where: Dict[int, Tuple[int, int]] = {}  # tensor -> (group, offset)
        self._position: Dict[int, int] = {}  # tensor -> its place among its group's tensors
        for g, group in enumerate(self._groups):
            for k, (i, offset) in enumerate(zip(group.indices, group.offsets)):
                self._where[i] = (g, offset)
                self._position[i] = k
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self._groups)
        self._last_reduced = None  # its buffers are the old plan's: let them go
        self._reset()

    def set_plan(self, plan: PlanSpec) -> None:
        """Replace the plan between steps (every rank, same step, same plan); error-feedback and
        per-element compressor state move to the new groups."""
        if self.in_flight:
            raise RuntimeError(f"{self._who}: the merge plan can only change between steps, not while "
                               f"a step's gradients are being exchanged")
        plan = self._make_plan(self._plan.order, plan)  # exempt tensors keep their own groups
        new = layout(plan, self.shapes)
        self._remap([g for g, codec in zip(new, plan.codec_names()) if codec != EXEMPT])
        self._install(plan)

    def _remap(self, new: Sequence[Group]) -> None:
        """Move the state of the current groups onto ``new``."""
        old = self._groups
        self._fold()
        for holder in self._holders():
            holder.load_state_dict(remap_state(holder.state_dict(), old, new))

    def _fold(self) -> None:
        """Turn the current groups' second-stage residuals into per-element carries."""
        self.exchange.fold(self._groups, [self._sent_as(codec) for codec in self._plan.codec_names()])

    def _holders(self) -> tuple:
        """What holds per-group state that follows the tensors when groups change."""
        return tuple(self.exchange.holders().values())

    def _buffer(self, g: int) -> torch.Tensor:
        flat = self._buffers[g]
        if flat is None:
            flat = self._buffers[g] = torch.empty(self._groups[g].numel, dtype=self.dtypes[self._groups[g].indices[0]],
                                                  device=self.device)
        return flat

    # -- one step ----------------------------------------------------------------------------
    def _reset(self) -> None:
        self._arrived = [False] * len(self.names)
        self._count = [0] * len(self._groups)
        #: per group: True while every gradient copied in was found finite, False once one was
        #: not, None when one was copied without a check (the exchange then checks the group)
        self._finite: List[Optional[bool]] = [True] * len(self._groups)
        self._started: List[Job] = []
        self._outs: List[torch.Tensor] = []
        self._given: List[Group] = []  # caller-given groups started this step
        self._given_codecs: List[str] = []
        self._ready_at = [0.0] * len(self.names)
        self._order_seen: List[int] = []
        self._encode_spent = 0.0
        #: per group: elements written into its buffer by this step's copy-in, pass by pass
        self._copied = [0] * len(self._groups)
        #: per group whose first tensor arrived: its FusedParts when its tensors are encoded as
        #: they arrive (Exchange.begin), else None
        self._arriving: Dict[int, Optional[FusedParts]] = {}
        #: caller-given groups split by exemption: (the group's slices, index of the job whose
        #: result goes back into them)
        self._copy_back: List[Tuple[List[torch.Tensor], int]] = []

    def slot(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s slot in its group's buffer, in its shape (where :meth:`add` copies)."""
        g, offset = self._where[i]
        return self._buffer(g)[offset:offset + self.shapes[i].numel()].view(self.shapes[i])

    def add(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Tensor ``i``'s gradient is final for this step (None: zeros).  It is copied into its
        slot (nothing is copied when ``grad`` is that slot); every group whose tensors have all
        arrived is then started, in plan order."""
        if torch.is_grad_enabled():  # e.g. a hook of backward(create_graph=True): record nothing
            with torch.no_grad():
                return self.add(i, grad)
        if self._arrived[i]:
            raise RuntimeError(f"{self._who}: the gradient of {self.names[i]!r} arrived twice in one step")
        g, offset = self._where[i]
        with self.exchange.clock(ENCODE, self._groups[g].name):
            self._ready_at[i] = time.perf_counter() - self._encode_spent  # our own hook work excluded
            self._order_seen.append(i)
            self._put(i, grad, g, offset)
            self._arrived[i] = True
            self._start_ready()

    def _fill(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """:meth:`_put` on the group's clock."""
        g, offset = self._where[i]
        with self.exchange.clock(ENCODE, self._groups[g].name):
            self._put(i, grad, g, offset)

    def _put(self, i: int, grad: Optional[torch.Tensor], g: int, offset: int) -> None:
        """Tensor ``i``'s gradient into group ``g`` at ``offset``: encoded as a part, or copied in."""
        parts = self._parts(g)
        if parts is None:
            self._copied[g] += self._copy_in(i, grad, g, offset) * self.shapes[i].numel()
        else:
            began = time.perf_counter()
            finite = parts.add(self._position[i], offset, self._part(i, grad, g, offset))  # checked by the kernel
            self._finite[g] = finite and self._finite[g] is not False
            self._encode_spent += time.perf_counter() - began
        self._count[g] += 1

    def _parts(self, g: int) -> Optional[FusedParts]:
        """Group ``g``'s :class:`~mergecomp.compressors.base.compressor.FusedParts` this step, when its gradients
        are encoded as they arrive (:meth:`Exchange.begin`; no prescaling, no caller-given
        groups), else None: they are copied into its buffer."""
        if g not in self._arriving:
            self._arriving[g] = None if self._caller_groups or self.prescale != 1.0 else \
                self.exchange.begin(self._groups[g], self._buffer(g), self._started_as(self._plan.codec(g)))
        return self._arriving[g]

    def _part(self, i: int, grad: Optional[torch.Tensor], g: int, offset: int) -> torch.Tensor:
        """Tensor ``i``'s gradient as its part is encoded from: itself where the kernel reads
        it as it is (dense, contiguous fp32), else copied into its slot first."""
        if (grad is not None and grad.layout == torch.strided and grad.dtype == torch.float32
                and grad.is_contiguous() and grad.numel() == self.shapes[i].numel()):
            return grad  # on the group's device (the CPU, where parts are encoded)
        self._copied[g] += self._copy_in(i, grad, g, offset, later=False) * self.shapes[i].numel()
        return self.slot(i)

    def _copy_in(self, i: int, grad: Optional[torch.Tensor], g: int, offset: int, later: bool = True) -> int:
        """Write tensor ``i``'s gradient (None: zeros), prescaled, into its slot at ``offset`` of
        group ``g``'s buffer, checking NaN/Inf where the copy can; returns the passes over the slot.
        ``later``: the slot is read only once the group is complete (a large group's is then
        written past the cache)."""
        flat = self._buffer(g)
        slot = flat[offset:offset + self.shapes[i].numel()]
        passes = 1
        if grad is None:
            slot.zero_()
        elif _holds(grad, flat, offset):
            self._unchecked(g)
            passes = 0
            if self.prescale != 1.0:
                slot.mul_(self.prescale)
                passes = 1
        else:
            if grad.is_sparse:
                if self.warn_sparse:
                    warnings.warn(f"{self.names[i]!r} has a sparse gradient; mergecomp exchanges it densely "
                                  f"(use nn.Embedding(sparse=False) to silence this)", stacklevel=6)
                grad = grad.to_dense()
                passes = 2  # the dense gradient written, then copied
            # the copy, prescale and check: one pass; a large group's buffer is read only once it is complete
            finite = codecs.copy_finite(grad, slot, self.prescale,
                                        stream=later and flat.numel() >= native.STREAM_MIN)
            if finite is None:
                self._unchecked(g)
            elif not finite:
                self._finite[g] = False
        return passes

    def _unchecked(self, g: int) -> None:
        if self._finite[g]:
            self._finite[g] = None

    def _start_ready(self) -> None:
        while (not self._caller_groups and len(self._started) < len(self._groups)
               and self._count[len(self._started)] == len(self._groups[len(self._started)].indices)):
            g = len(self._started)
            self._launch(self._groups[g], self._buffer(g), self._plan.codec(g), self._finite[g], self._copied[g],
                         self._arriving.get(g))

    def _launch(self, group: Group, flat: torch.Tensor, codec: str, finite: Optional[bool], copied: int,
                parts: Optional[FusedParts] = None) -> None:
        """Start ``group`` from ``flat``, into which ``copied`` elements were written (pass by
        pass) this step, or from its ``parts`` (:meth:`Exchange.start`)."""
        began = time.perf_counter()
        job = self.exchange.start(group, flat, self._started_as(codec), finite, parts)
        self._encode_spent += time.perf_counter() - began
        job.count("copy-in", 1, copied)
        self._started.append(job)
        self._outs.append(flat)

    def _started_as(self, codec: str) -> str:
        """The codec a group of the plan's ``codec`` is started with this step."""
        return self._sent_as(codec) if self.compressing else EXEMPT

    def _sent_as(self, codec: str) -> str:
        """The codec a group of the plan's ``codec`` is started with: ``"compressed"`` travels by
        the ``scheme`` option's scheme."""
        return self.scheme if codec == COMPRESSED and self.scheme in SHARDED else codec

    def start_group(self, indices: Sequence[int], flat: torch.Tensor) -> None:
        """Start a group the caller defines (DDP's bucket): tensors ``indices`` laid out in
        ``flat`` in that order, compressed in place (its exempt tensors, if any, are copied out
        into a group of their own, the others into another, and :meth:`finish` copies the
        results back).  When the groups differ from the last step's (DDP rebuilt its buckets),
        each new group takes over its tensors' state."""
        if not self._caller_groups:
            raise RuntimeError(f"{self._who}: start_group() needs caller_groups=True")
        with self.exchange.clock(ENCODE):
            self._start_bucket(indices, flat)

    def _start_bucket(self, indices: Sequence[int], flat: torch.Tensor) -> None:
        group = layout(GroupPlan((tuple(indices),)), self.shapes)[0]
        if group.numel != flat.numel():
            raise RuntimeError(f"{self._who}: a group of {flat.numel()} elements holds tensors "
                               f"{self.tensor_names(group)[:4]} of {group.numel} elements in all")
        exempt = [self._exempt[i] for i in group.indices]
        if not any(exempt):
            self._start_given(group, flat, COMPRESSED, 0)
            return
        bounds = [*group.offsets, group.numel]
        slices: Dict[bool, List[torch.Tensor]] = {False: [], True: []}
        for part, run in itertools.groupby(range(len(exempt)), key=exempt.__getitem__):
            run = list(run)  # neighbouring tensors of one kind: one copy each way
            slices[part].append(flat[bounds[run[0]]:bounds[run[-1] + 1]])
        for part, codec in ((False, COMPRESSED), (True, EXEMPT)):
            if slices[part]:
                sub = layout(GroupPlan((tuple(i for i, e in zip(group.indices, exempt) if e == part),)),
                             self.shapes)[0]
                buffer = self._parts.get(sub.name)
                if buffer is None or buffer.numel() != sub.numel or buffer.dtype != flat.dtype:
                    buffer = self._parts[sub.name] = flat.new_empty(sub.numel)
                torch.cat(slices[part], out=buffer)
                self._copy_back.append((slices[part], len(self._started)))
                self._start_given(sub, buffer, codec, sub.numel)

    def _start_given(self, group: Group, flat: torch.Tensor, codec: str, copied: int) -> None:
        if codec != EXEMPT and group not in self._groups and self._groups:
            holders = self._holders()
            if self._before is None:  # later groups of this step remap from the same snapshot
                self._fold()
                self._before = [holder.state_dict() for holder in holders]
            for holder, before in zip(holders, self._before):
                holder.state.pop(group.name, None)
                holder.state.update(remap_state(before, self._groups, [group]))
        self._given.append(group)
        self._given_codecs.append(codec)
        self._launch(group, flat, codec, None, copied)

    def finish(self) -> Optional[Reduced]:
        """Finish the step: start what is left (missing tensors count as zeros), wait, decode,
        average; then advance the step, adopt the observed order and feed the scheduler (which
        may switch plans).  Returns the reduced gradients, or None for a step skipped under
        ``nonfinite="skip"``; raises FloatingPointError under ``"raise"``.  A step that does not
        raise joins :meth:`step_breakdown`."""
        clock = self.exchange.clock
        jobs = self._started  # this step's groups: _finish starts the rest into this list
        try:
            with clock(DECODE):
                reduced = self._finish()
        except BaseException:
            clock.take()
            self.timings.forget()
            raise
        self.timings.end_step(clock.take(), [job.describe() for job in jobs])
        return reduced

    def _finish(self) -> Optional[Reduced]:
        """:meth:`finish`, its parts on the exchange's clock."""
        clock = self.exchange.clock
        timed = self._timed and all(self._arrived)
        with clock(ENCODE):
            for i, arrived in enumerate(self._arrived):
                if not arrived and not self._caller_groups:
                    self._fill(i, None)
            self._start_ready()
        jobs, outs = self._started, self._outs
        groups = [job.group for job in jobs]
        check = NonfiniteCheck(self.comm, jobs, self.step) if self.nonfinite != "ignore" else None
        hand_out = self._hand_out
        pending = jobs  # the groups' later collectives, stage by stage, in plan order
        while pending:
            pending = [job for job in pending if self.exchange.advance(job)]
        flats = [self.exchange.finish(job, out=None if hand_out else out) for job, out in zip(jobs, outs)]
        bad = []
        if check:
            with clock(WAIT):
                bad = check.culprits([group.name for group in groups])
        if bad and self.nonfinite == "propagate":  # every rank's result is NaN: GradScaler skips the step
            for flat in flats:
                flat.fill_(float("nan"))
        for slices, j in self._copy_back:
            for dst, src in zip(slices, flats[j].split([t.numel() for t in slices])):
                dst.copy_(src)
            jobs[j].count("copy-out", 1)
        step = self.exchange.end_step()
        if self.step == self.warmup_steps > 0:
            logger.info("%s: compression warm-up over after %d steps; %r compresses from now on",
                        self._who, self.step, self.exchange.compressor)
        if hand_out:  # a buffer that is now a result must not be written again
            handed = {flat.untyped_storage().data_ptr() for flat in flats}
            self._buffers = [None if b is not None and b.untyped_storage().data_ptr() in handed else b
                             for b in self._buffers]
        ready, order_seen = self._ready_at, self._order_seen
        if self._caller_groups:
            self._end_caller_groups()
        self._reset()
        if bad:
            self._last_end = None  # a step with NaN/Inf is no timing sample
            return self._nonfinite(bad, Reduced(groups, flats), step)
        self.exchange.commit()
        if self.postscale != 1.0:
            for flat in flats:
                flat.mul_(self.postscale)
        with clock(SCHEDULER):
            self._adopt_order(order_seen)
            self._feed_scheduler(ready if timed else None)
        return self._reduced(groups, flats)

    def _reduced(self, groups: List[Group], flats: List[torch.Tensor]) -> Reduced:
        """This step's result, with the last step's views where it holds the same groups and
        buffers (the group buffers, reused step after step unless handed out or the caller's)."""
        reduced, last = Reduced(groups, flats), self._last_reduced
        if last is not None and reduced.same_groups_and_buffers(last):
            reduced.views = last.views
        if not (self._hand_out or self._caller_groups):
            self._last_reduced = reduced
        return reduced

    def abort(self) -> None:
        """Forget a step that cannot finish (an interrupted backward pass): its collectives are
        out of step with the other ranks', so the caller must fail the step on every rank."""
        self.exchange.rollback()
        for g, parts in self._arriving.items():
            if parts is not None and g >= len(self._started):
                self.exchange.cancel(parts)
        self.exchange.clock.take()
        self.timings.forget()
        self._before = None
        self._reset()

    def _end_caller_groups(self) -> None:
        """The groups started this step become the layout; state of groups gone is dropped."""
        if self._given != self._groups:
            keep = {group.name for group in self._given}
            for holder in self._holders():
                holder.state = {name: fields for name, fields in holder.state.items() if name in keep}
            self._parts = {name: buffer for name, buffer in self._parts.items() if name in keep}
            self._groups = self._given
            self._plan = GroupPlan(tuple(group.indices for group in self._groups), tuple(self._given_codecs))
        self._before = None

    def _nonfinite(self, bad: List[Tuple[int, str, int]], reduced: Reduced, step: int) -> Optional[Reduced]:
        """Apply the policy to a step in which ``bad`` (rank, group name, why: the bits of
        :class:`~mergecomp.pipeline.exchange.NonfiniteCheck`) held NaN/Inf.  A group whose payload
        overflowed here starts its error feedback afresh, under every policy."""
        if self.nonfinite == "propagate":
            self.exchange.rollback()
        self.exchange.forget([name for rank, name, why in bad if rank == self.comm.rank and why & OVERFLOWED])
        where = "; ".join(f"rank {rank}, group {name!r}" + (
            ": its values, finite, overflowed the 16-bit cast for the wire (error feedback included), so its "
            "memory starts afresh"
            if why & OVERFLOWED else "") for rank, name, why in bad)
        if self.nonfinite == "propagate":  # its results are NaN (_finish): every rank's GradScaler skips it
            logger.info("%s: non-finite gradient at step %d (%s); every rank's result is NaN", self._who,
                        step, where)
            return reduced
        if self.nonfinite == "raise":
            by_name = {group.name: group for group in reduced.groups}
            names = sorted({n for _, name, _ in bad for n in self.tensor_names(by_name[name])})
            raise FloatingPointError(f"{self._who}: non-finite gradient at step {step} ({where}); {self._kind} "
                                     f"in those groups: {names[:8]}{' ...' if len(names) > 8 else ''}")
        self.skipped_steps += 1
        logger.warning("%s: skipping step %d: non-finite gradient (%s)", self._who, step, where)
        return None

    def _adopt_order(self, seen: List[int]) -> None:
        """After the first step: rebuild the plan along rank 0's arrival order."""
        if self._order_final:
            return
        self._order_final = True
        arrived = set(seen)
        order = seen + [i for i in reversed(range(len(self.names))) if i not in arrived]
        order = self.comm.broadcast_(torch.tensor(order, dtype=torch.int64, device=self.comm.device), 0).tolist()
        plan = self._make_plan(order)
        if plan != self._plan:
            self.set_plan(plan)
        if self._auto:
            self._start_scheduler()

    def _start_scheduler(self) -> None:
        """The search covers the tensors that are not exempt: its plans leave out the exempt
        groups, which :meth:`set_plan` appends again."""
        order = [i for i in self._plan.order if not self._exempt[i]]
        if not order:  # every tensor is exempt: nothing to search
            self._auto = False
            return
        self._search_order = order
        exempt = [f"exempt:{self.exempt}"] if any(self._exempt) else []
        self.scheduler = exchange_scheduler(
            self.exchange, self._scheduler_config, order, self._nbytes(), self.shapes, self.dtypes[order[0]],
            self.device, lambda plan: self._make_plan(order, plan),
            self._cache_tag + exempt + [f"{n}:{tuple(s)}:{d}" for n, s, d in zip(self.names, self.shapes, self.dtypes)],
            self.scheme)
        cached = self.scheduler.initial_plan()
        if cached is not None:
            self.set_plan(cached)

    def _searched(self) -> GroupPlan:
        """The current plan without its exempt groups (what the scheduler's plans look like)."""
        kept = [g for g, codec in enumerate(self._plan.codec_names()) if codec != EXEMPT]
        return GroupPlan(tuple(self._plan.groups[g] for g in kept), tuple(self._plan.codec(g) for g in kept))

    def _feed_scheduler(self, ready: Optional[List[float]]) -> None:
        """Give the finished step's wall time (and arrival times, when ``ready``) to the
        scheduler; switch plans when it says so.  Warm-up steps are no samples: the search
        starts once compression has begun."""
        now = time.perf_counter()
        previous, self._last_end = self._last_end, now
        if self.scheduler is None or previous is None or self.step <= self.warmup_steps:
            return
        order = self._search_order
        if ready is None:
            since_first = [0.0] * len(order)
        else:
            first = min(ready[i] for i in order)
            since_first = [ready[i] - first for i in order]
        current = self._searched()
        plan = self.scheduler.observe(now - previous, since_first, current)
        if plan is not None and plan != current:
            self.set_plan(plan)

    def stop_scheduler(self) -> None:
        """Keep the current plan from now on: no further search or re-tuning (every rank, same
        step)."""
        self.scheduler, self._auto = None, False

    def schedule_report(self) -> Dict[str, Any]:
        """What the scheduler tried and chose (see :meth:`MergeScheduler.report`); a fixed plan
        reports ``{"phase": "fixed", "groups": n}``.  Under ``"breakdown"``: :meth:`step_breakdown`."""
        if self.scheduler is None:
            report = {"phase": "starting" if self._auto else "fixed", "groups": len(self._groups)}
        else:
            report = self.scheduler.report()
        return {**report, "breakdown": self.step_breakdown()}

    def step_breakdown(self, steps: Optional[int] = None) -> Dict[str, Any]:
        """Where this process's time went in the last ``steps`` steps, averaged (default: every
        step kept, ``timings.window``): the parts of a step and each group's seconds, bytes and
        passes over its elements (:mod:`mergecomp.pipeline.breakdown`)."""
        return self.timings.summary(steps)

    @contextlib.contextmanager
    def time_update(self) -> Iterator[None]:
        """Time the optimizer update a front end runs after :meth:`finish`: it joins that
        step's breakdown as its ``optimizer`` part."""
        began = time.perf_counter()
        yield
        self.timings.end_update(began, time.perf_counter())

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's plan, tensor shapes, rank and world size, step, skipped steps, compressor
        state, error-feedback memory and the scheduler's choice."""
        return {"plan": self._plan.to_json(), "shapes": [list(s) for s in self.shapes],
                "rank": self.comm.rank, "world_size": self.comm.size,
                "order_final": self._order_final, "skipped_steps": self.skipped_steps,
                **self.exchange.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` between steps (each rank its own)."""
        if self.in_flight:
            raise RuntimeError(f"{self._who}: load_state_dict() must be called between steps")
        shapes = [torch.Size(s) for s in state["shapes"]]
        if self.names and shapes != self.shapes:
            raise ValueError(f"{self._who}: the checkpoint holds {len(shapes)} tensors of other shapes than "
                             f"the {len(self.shapes)} here; it was saved for another model")
        plan = GroupPlan.from_json(state["plan"])
        if self._caller_groups:  # the saved groups; the caller's are remapped from them on use
            self._groups, self._plan, self._before = layout(plan, shapes), plan, None
            self._reset()
        else:
            self._install(self._make_plan(self._plan.order, plan))
        self._order_final = bool(state["order_final"])
        self.skipped_steps = int(state["skipped_steps"])
        saved_size = state.get("world_size", self.comm.size)
        if saved_size != self.comm.size:  # per-rank residuals and measured timings do not carry over
            logger.warning("%s: the checkpoint was saved with %d ranks and runs on %d: error-feedback "
                           "residuals and compressor state start afresh, and the scheduler searches again",
                           self._who, saved_size, self.comm.size)
            state = {**state, **self._fresh_state(), "scheduler": None}
        elif state.get("rank", self.comm.rank) != self.comm.rank:  # another rank's residuals
            logger.warning("%s: the checkpoint holds rank %d's error-feedback residuals and compressor state, "
                           "which start afresh here (save and load one checkpoint per rank to keep them)",
                           self._who, state["rank"])
            state = {**state, **self._fresh_state()}
        self.exchange.load_state_dict(state)
        self._last_end = None
        self.timings.forget()
        if self._auto and self._order_final:
            if self.scheduler is None:
                self._start_scheduler()
            if state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])

    def agree_with(self, root: int) -> None:
        """Take rank ``root``'s plan, order, step counter, skipped steps and scheduler state on
        every rank (after a checkpoint was loaded on some ranks only; every rank calls it).
        Error-feedback memory and compressor state stay where every rank is at ``root``'s step
        and holds such state or none does; otherwise they start afresh on every rank (logged)."""
        if self.in_flight:
            raise RuntimeError(f"{self._who}: ranks can only agree between steps")
        holders = self.exchange.holders()
        has_state = any(holder.state for holder in holders.values())
        seen = self.comm.allgather(torch.tensor([self.step, int(has_state)], dtype=torch.int64,
                                                device=self.comm.device), "the resume agreement").cpu()
        shared = self.comm.broadcast_object(
            {k: v for k, v in self.state_dict().items() if k not in holders}, root)
        keep = bool((seen == seen[root]).all())
        if not keep and seen[:, 1].any():
            logger.warning("%s: ranks resumed from different steps or not all of them loaded a checkpoint "
                           "(steps %s): error-feedback residuals and compressor state start afresh on every "
                           "rank", self._who, seen[:, 0].tolist())
        self.load_state_dict({**shared, "rank": self.comm.rank,
                              **{key: holder.state_dict() if keep else {} for key, holder in holders.items()}})

    def _fresh_state(self) -> Dict[str, Dict]:
        """Checkpoint fields that leave every per-group state holder empty."""
        return {key: {} for key in self.exchange.holders()}

    def __repr__(self) -> str:
        return (f"MergedStep(compressor={self.exchange.compressor!r}, memory={self.exchange.memory!r}, "
                f"groups={len(self._groups)}, step={self.step})")
