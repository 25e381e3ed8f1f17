"""A merged step whose groups a merge plan cuts, filled as the gradients arrive.

A :class:`PlannedStep` owns the merge plan and its layout, and one flat buffer per group of
several tensors, each tensor's *slot* a view of it (:attr:`~PlannedStep.slots`).  A front end
that hands those views out as the gradients (the PyTorch optimizer's ``p.grad``, as DDP's
``gradient_as_bucket_view``) has backward accumulate straight into the groups: :meth:`~PlannedStep.add`
of a gradient that is its slot copies nothing, and its work is a few counters.  Any other
gradient is copied into its slot (checked for NaN/Inf in the same pass where it can; counted
as ``copy-in``) and is then among :attr:`Reduced.moved`; where the compressor encodes a group's
gradients where they lie (:meth:`~mergecomp.exchange.exchange.Exchange.begin`), it is encoded as
a part.  A group of one tensor has no buffer where the front end takes results in place
(``FrontEnd.in_place``): its gradient itself is sent and receives the result.  Every group whose
last tensor has arrived is then started, in plan order; a ``prescale`` is one pass over each
group as it starts.  ``finish`` starts the rest (missing tensors count as zeros).  After the
first step, the plan follows the order in which rank 0's gradients arrived (the backward
order); with ``groups="auto"`` the online scheduler (:class:`~mergecomp.scheduler.feed.PlanSearch`) then searches the plan.  The PyTorch
optimizer and the TensorFlow front end adapt it.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

from mergecomp.compressors.base.capabilities import FusedParts
from mergecomp.exchange.breakdown import ENCODE, SCHEDULER
from mergecomp.exchange.job import Job
from mergecomp.exchange.plan import EXEMPT, GroupPlan, PlanSpec, build_plan, layout
from mergecomp.kernels import codecs, native
from mergecomp.pipeline.step import MergedStep, Reduced
from mergecomp.scheduler.clock import Arrivals
from mergecomp.scheduler.feed import PlanSearch

__all__ = ["PlannedStep", "DEFAULT_GROUP_BYTES", "DEFAULT_MAX_GROUPS"]

#: ``groups=None``: groups of about this many bytes (like DDP's ``bucket_cap_mb=25``) ...
DEFAULT_GROUP_BYTES = 25 * 2**20
#: ... and at most this many
DEFAULT_MAX_GROUPS = 4


def _sendable(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``grad`` can be sent where it lies as a group of its own: dense, contiguous, of
    the tensor's shape, dtype and device, and outside any autograd graph."""
    return (grad.layout == torch.strided and not grad.requires_grad and grad.dtype == dtype
            and grad.shape == shape and grad.device == device and grad.is_contiguous())


class PlannedStep(MergedStep):
    """See the module docstring; the arguments are :class:`~mergecomp.pipeline.step.MergedStep`'s."""

    #: the online search (``groups="auto"``), started once the order is final
    search: Optional[PlanSearch] = None
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        groups, front_end = self.options.groups, self.front_end
        if not self.names:
            raise ValueError(f"{front_end.who}: no {front_end.tensor_kind} to exchange gradients for")
        self.warn_sparse = True  # a sparse gradient warns that it is exchanged densely
        self._spec = None if groups == "auto" else groups
        self.search = PlanSearch(self, self.options.scheduler, front_end.cache_tag) if groups == "auto" else None
        self._order_final = not front_end.observe_order or isinstance(groups, (list, tuple, GroupPlan))
        self._install(self.make_plan(list(reversed(range(len(self.names))))))
        if self.search is not None and self._order_final:
            self.search.start()

    @property
    def scheduler(self):
        """The online scheduler (``groups="auto"``), once started."""
        return self.search.scheduler if self.search is not None else None

    @property
    def buffers(self) -> List[torch.Tensor]:
        """The flat buffers of the groups that have one (several tensors, or a gradient that could
        not be sent where it lay), in plan order."""
        return [b for b in self._buffers if b is not None]

    @property
    def slots(self) -> List[Optional[torch.Tensor]]:
        """Per tensor: its slot in its group's buffer, in its shape (where a gradient that is its
        slot is taken without a copy), or None where its group has no buffer (one tensor whose
        gradient is sent where it lies).  The views stay the same from step to step until the
        plan changes."""
        for g, direct in enumerate(self._direct):
            if not direct:
                self._buffer(g)
        return list(self._slots)

    def zero_buffers(self, spare_parts: bool = False) -> List[int]:
        """Zero every group buffer, one fill per group (a large one by non-temporal stores,
        :func:`mergecomp.kernels.codecs.zero_`): the slots (:attr:`slots`) handed out as
        gradients are zeroed together.  With ``spare_parts``, a group whose gradients the last
        step encoded where they lay (part by part, :meth:`Exchange.begin`) is not filled, and
        its tensors' indices are returned: the front end drops those gradients (``p.grad =
        None``), so that the next backward's are encoded where autograd leaves them, with
        neither this fill nor an accumulation into the slots (a group not encoded so after all
        copies them in)."""
        if self.in_flight:
            raise RuntimeError(f"{self.front_end.who}: the group buffers can only be zeroed between steps")
        spared: List[int] = []
        for flat, group, parted in zip(self._buffers, self._groups, self._parted):
            if flat is None:
                continue
            if spare_parts and parted:
                spared += group.indices
            else:
                codecs.zero_(flat)
        return spared

    @property
    def in_flight(self) -> bool:
        """Whether a step has begun (a tensor added or a group started) and not finished."""
        return self._arrivals_count > 0 or bool(self._started)

    @property
    def exempt_flags(self) -> List[bool]:
        """Per tensor: whether it is sent uncompressed."""
        return list(self._exempt)

    def group_of(self, i: int) -> int:
        """The index of tensor ``i``'s group in the current plan."""
        return self._group_of[i]

    # -- plans -----------------------------------------------------------------------------
    def nbytes(self) -> List[int]:
        """Each tensor's gradient bytes."""
        return [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(self.shapes, self.dtypes)]

    def make_plan(self, order: Sequence[int], spec: PlanSpec = None) -> GroupPlan:
        """The plan ``spec`` gives (default: the ``groups`` option's) over ``order``, the exempt
        tensors in groups of their own."""
        nbytes = self.nbytes()
        spec = self._spec if spec is None else spec
        if spec is None:
            sent = sum(nbytes[i] for i in order if not self._exempt[i])
            spec = max(1, min(DEFAULT_MAX_GROUPS, math.ceil(sent / DEFAULT_GROUP_BYTES)))
        return build_plan(spec, order, self.names, nbytes, self.dtypes, self._exempt)

    def _install(self, plan: GroupPlan) -> None:
        self._plan = plan
        self._groups = layout(plan, self.shapes)
        count = len(self.names)
        self._group_of, self._offset_of, self._position = [0] * count, [0] * count, [0] * count
        for g, group in enumerate(self._groups):
            for k, (i, offset) in enumerate(zip(group.indices, group.offsets)):
                self._group_of[i], self._offset_of[i], self._position[i] = g, offset, k
        self._sizes = [len(group.indices) for group in self._groups]
        #: per group: a single tensor whose gradient is sent where it lies (no buffer of its own)
        self._direct = [self.front_end.in_place and size == 1 for size in self._sizes]
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self._groups)
        self._slots: List[Optional[torch.Tensor]] = [None] * count
        #: per group: whether the last step encoded its gradients where they lay (part by part)
        self._parted = [False] * len(self._groups)
        self._reset()

    def set_plan(self, plan: PlanSpec) -> None:
        """Replace the plan between steps (every rank, same step, same plan); error-feedback and
        per-element compressor state move to the new groups."""
        if self.in_flight:
            raise RuntimeError(f"{self.front_end.who}: the merge plan can only change between steps, not while "
                               f"a step's gradients are being exchanged")
        plan = self.make_plan(self._plan.order, plan)  # exempt tensors keep their own groups
        new = layout(plan, self.shapes)
        self._remap([g for g, codec in zip(new, plan.codec_names()) if codec != EXEMPT])
        self._install(plan)

    def stop_scheduler(self) -> None:
        """Keep the current plan from now on: no further search or re-tuning (every rank, same
        step)."""
        if self.search is not None:
            self.search.stop()

    def schedule_report(self) -> Dict[str, Any]:
        """What the scheduler tried and chose (see :meth:`MergeScheduler.report`); a fixed plan
        reports ``{"phase": "fixed", "groups": n}``.  Under ``"breakdown"``: :meth:`step_breakdown`."""
        report = self.search.report() if self.search is not None else {"phase": "fixed", "groups": len(self._groups)}
        return {**report, "breakdown": self.step_breakdown()}

    def _buffer(self, g: int) -> torch.Tensor:
        """Group ``g``'s buffer, made (with its tensors' slots) on first use."""
        flat = self._buffers[g]
        if flat is None:
            group = self._groups[g]
            flat = self._buffers[g] = torch.empty(group.numel, dtype=self.dtypes[group.indices[0]], device=self.device)
            for i, offset, n, shape in zip(group.indices, group.offsets, group.numels(), group.shapes):
                self._slots[i] = flat[offset:offset + n].view(shape)
        return flat

    def _flat(self, g: int) -> torch.Tensor:
        """What group ``g`` is sent from this step: its gradient where it lies, or its buffer."""
        flat = self._sent[g]
        if flat is None:
            flat = self._sent[g] = self._buffer(g)
        return flat

    # -- gradients arrive --------------------------------------------------------------------
    def _reset(self) -> None:
        super()._reset()
        self._arrived = [False] * len(self.names)
        self._arrivals_count = 0
        self._count = [0] * len(self._groups)
        #: per group: True while every gradient copied in was found finite, False once one was
        #: not, None when one arrived unchecked (the exchange then checks the group)
        self._finite: List[Optional[bool]] = [True] * len(self._groups)
        #: whether a group's gradients may be encoded as they arrive (:meth:`_parts`; decided at
        #: the step's first arrival)
        self._parting = False
        #: per group: its tensors that got no gradient this step
        self._missing: Dict[int, List[int]] = {}
        #: this step's arrival times, where the scheduler reads them (:meth:`_arm`, at its first arrival)
        self._arrival_times: Optional[Arrivals] = None
        self._order_seen: List[int] = []
        #: per group: elements written into its buffer by this step's copy-in, pass by pass
        self._copied = [0] * len(self._groups)
        #: per group whose first tensor arrived: its FusedParts when its tensors are encoded as
        #: they arrive (Exchange.begin), else None
        self._arriving: Dict[int, Optional[FusedParts]] = {}
        #: per group: what it is sent from this step (None: not decided yet)
        self._sent: List[Optional[torch.Tensor]] = [None] * len(self._groups)
        #: per group sent where its one gradient lies: that gradient (its result is written there)
        self._lying: Dict[int, torch.Tensor] = {}
        #: tensors whose gradient was not where their result will be (copied in, or missing)
        self._moved: List[int] = []

    def slot(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s slot in its group's buffer, in its shape (where :meth:`add` copies)."""
        self._buffer(self._group_of[i])
        return self._slots[i]

    def add(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """Tensor ``i``'s gradient is final for this step (None: zeros).  Nothing is copied when
        ``grad`` is its slot (:attr:`slots`), or, for a group of one tensor whose front end
        takes results in place, when it can be sent where it lies; else it is copied into its
        slot.  Every group whose tensors have all arrived is then started, in plan order."""
        if torch.is_grad_enabled():  # e.g. a hook of backward(create_graph=True): record nothing
            with torch.no_grad():
                return self.add(i, grad)
        if self._arrived[i]:
            raise RuntimeError(f"{self.front_end.who}: the gradient of {self.names[i]!r} arrived twice in one step")
        if not self._arrivals_count:
            self._arm()
        self._arrived[i] = True
        self._arrivals_count += 1
        self._order_seen.append(i)
        if self._arrival_times is not None:
            self._arrival_times.arrived(i)  # our own hook work is left out (own_work)
        g = self._group_of[i]
        if grad is None or grad is not self._slots[i] or (self._parting and self._parts(g) is not None):
            with self.exchange.clock(ENCODE, self._groups[g].name):
                self._put(i, grad, g)
        else:  # backward accumulated into the slot: nothing to copy, nothing checked yet
            self._finite[g] = self._finite[g] and None
        self._count[g] += 1
        if g == len(self._started) and self._count[g] == self._sizes[g]:
            with self.exchange.clock(ENCODE, self._groups[g].name):
                self._start_ready()

    def _put(self, i: int, grad: Optional[torch.Tensor], g: int) -> None:
        """Tensor ``i``'s gradient into group ``g``: sent where it lies (a group of one tensor),
        encoded as a part, or copied in."""
        lying = self._direct[g] and grad is not None and _sendable(grad, self.shapes[i], self.dtypes[i], self.device)
        if lying:
            self._sent[g], self._lying[g] = grad.view(-1), grad
        parts = self._parts(g) if self._parting else None
        if parts is not None:
            with self._own_work():  # checked by the kernel
                finite = parts.add(self._position[i], self._offset_of[i], grad if lying else self._part(i, grad, g))
            self._finite[g] = finite and self._finite[g] is not False
        elif lying:
            self._finite[g] = self._finite[g] and None
        else:
            self._copied[g] += self._copy_in(i, grad, g) * self.shapes[i].numel()

    def _arm(self) -> None:
        """At a step's first arrival: its arrival times are stamped where the scheduler profiles
        it (CUDA events on a CUDA device, host seconds otherwise), and nowhere else; groups are
        encoded part by part where they can be and nothing transforms them first
        (:attr:`~mergecomp.pipeline.step.MergedStep.before_start` unset)."""
        self._parting = self.exchange.encodes_parts and self.options.prescale == 1.0 and self.before_start is None
        profiled = self.search is not None and self.search.profiles_next()
        self._arrival_times = Arrivals(len(self.names), self.device, events=True) if profiled else None

    def _own_work(self):
        """Our own work in a hook, left out of the arrival times that follow."""
        stamps = self._arrival_times
        return stamps.own_work() if stamps is not None else contextlib.nullcontext()

    def launch(self, *args, **kwargs) -> Job:
        """:meth:`MergedStep.launch`, its seconds left out of the arrival times that follow."""
        with self._own_work():
            return super().launch(*args, **kwargs)

    def _parts(self, g: int) -> Optional[FusedParts]:
        """Group ``g``'s :class:`~mergecomp.compressors.base.capabilities.FusedParts` this step,
        when its gradients are encoded as they arrive (:meth:`Exchange.begin`; asked only while
        :meth:`_arm` allows it), else None: they are copied into its buffer."""
        if g not in self._arriving:
            self._arriving[g] = self.exchange.begin(self._groups[g], self._flat(g), self.route(self._plan.codec(g)))
        return self._arriving[g]

    def _part(self, i: int, grad: Optional[torch.Tensor], g: int) -> torch.Tensor:
        """Tensor ``i``'s gradient as its part is encoded from: itself where the kernel reads
        it as it is (dense, contiguous fp32), else copied into its slot first."""
        if (grad is not None and grad.layout == torch.strided and grad.dtype == torch.float32
                and grad.is_contiguous() and grad.numel() == self.shapes[i].numel()):
            if grad is not self._slots[i]:
                self._moved.append(i)
            return grad  # on the group's device (the CPU, where parts are encoded)
        self._copied[g] += self._copy_in(i, grad, g, later=False) * self.shapes[i].numel()
        return self._slots[i]

    def _copy_in(self, i: int, grad: Optional[torch.Tensor], g: int, later: bool = True) -> int:
        """Write tensor ``i``'s gradient (None: zeros) into its slot of group ``g``'s buffer,
        checking NaN/Inf where the copy can; returns the passes over the slot.  ``later``: the
        slot is read only once the group is complete (a large group's is then written past the
        cache)."""
        flat = self._flat(g)
        slot = self._slots[i]
        self._moved.append(i)
        if grad is None:
            slot.zero_()
            return 1
        passes = 1
        if grad.is_sparse:
            if self.warn_sparse:
                warnings.warn(f"{self.names[i]!r} has a sparse gradient; mergecomp exchanges it densely "
                              f"(use nn.Embedding(sparse=False) to silence this)", stacklevel=6)
            grad = grad.to_dense()
            passes = 2  # the dense gradient written, then copied
        # the copy and check: one pass; a large group's buffer is read only once it is complete
        finite = codecs.copy_finite(grad, slot.view(-1), 1.0, stream=later and flat.numel() >= native.STREAM_MIN)
        if finite is None:
            self._finite[g] = self._finite[g] and None
        elif not finite:
            self._finite[g] = False
        return passes

    def _start_ready(self) -> None:
        prescale = self.options.prescale
        while (len(self._started) < len(self._groups)
               and self._count[len(self._started)] == self._sizes[len(self._started)]):
            g = len(self._started)
            flat, finite = self._flat(g), self._finite[g]
            if prescale != 1.0:  # one pass over the group, copied in or not: scaled, then checked where it can be
                scaled = codecs.copy_finite(flat, flat, prescale)
                finite = False if finite is False else scaled
            if self.before_start is not None:  # what it wrote is what the step checks
                wrote = self.before_start(g, self._groups[g], flat, self._missing.get(g, ()))
                finite = (finite and None) if wrote is None else wrote
            self.launch(self._groups[g], flat, self._plan.codec(g), finite, self._copied[g], self._arriving.get(g))

    # -- the step's end ------------------------------------------------------------------------
    def _start_rest(self) -> None:
        """Missing tensors count as zeros."""
        self._timed_step = self.front_end.timed and self._arrivals_count == len(self.names)
        if self._arrivals_count < len(self.names):
            if not self._arrivals_count:
                self._arm()
            for i, arrived in enumerate(self._arrived):
                if not arrived:
                    g = self._group_of[i]
                    with self.exchange.clock(ENCODE, self._groups[g].name):
                        self._put(i, None, g)
                    self._count[g] += 1
                    self._missing.setdefault(g, []).append(i)
        self._start_ready()

    def _decoded(self, jobs: List[Job], flats: List[torch.Tensor]) -> Reduced:
        """The step's result; unless results are handed out, its tensors are their slots, or the
        gradients sent where they lay, and :attr:`Reduced.moved` names those whose gradient was
        elsewhere."""
        groups = [job.group for job in jobs]
        if self.front_end.hand_out:  # a buffer that is now a result must not be written again
            handed = {flat.untyped_storage().data_ptr() for flat in flats}
            self._buffers = [None if b is not None and b.untyped_storage().data_ptr() in handed else b
                             for b in self._buffers]
            self._slots = [None if self._buffers[g] is None else s for g, s in zip(self._group_of, self._slots)]
            return Reduced(groups, flats)
        views = list(self._slots)
        for g, grad in self._lying.items():
            views[self._groups[g].indices[0]] = grad
        return Reduced(groups, flats, views, self._moved)

    def _end_step(self, bad: bool) -> None:
        self._arrivals = (self._arrival_times if self._timed_step else None), self._order_seen
        self._parted = [self._arriving.get(g) is not None for g in range(len(self._groups))]
        if (bad or self.exact) and self.search is not None:  # an exact step times no codec
            self.search.skip_sample()
        super()._end_step(bad)

    def _reduced(self, reduced: Reduced) -> Reduced:
        """This step's result; the observed order adopted and the scheduler fed, which may
        switch plans for the next step."""
        arrivals, order_seen = self._arrivals
        with self.exchange.clock(SCHEDULER):
            self._adopt_order(order_seen)
            if self.search is not None:
                self.search.observe(arrivals)
        return reduced

    def _adopt_order(self, seen: List[int]) -> None:
        """After the first step: rebuild the plan along rank 0's arrival order."""
        if self._order_final:
            return
        self._order_final = True
        arrived = set(seen)
        order = seen + [i for i in reversed(range(len(self.names))) if i not in arrived]
        order = self.comm.broadcast_(torch.tensor(order, dtype=torch.int64, device=self.comm.device), 0).tolist()
        plan = self.make_plan(order)
        if plan != self._plan:
            self.set_plan(plan)
        if self.search is not None:
            self.search.start()

    def abort(self) -> None:
        for g, parts in self._arriving.items():
            if parts is not None and g >= len(self._started):
                self.exchange.cancel(parts)
        super().abort()

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """:meth:`MergedStep.state_dict`, whether the observed order was adopted, and the
        scheduler's choice."""
        scheduler = self.scheduler
        return {**super().state_dict(), "order_final": self._order_final,
                "scheduler": scheduler.state_dict() if scheduler else None}

    def _load_layout(self, plan: GroupPlan, shapes: List[torch.Size], state: Dict[str, Any]) -> None:
        self._install(self.make_plan(self._plan.order, plan))
        self._order_final = bool(state["order_final"])

    def _loaded(self, state: Dict[str, Any]) -> None:
        if self.search is not None:
            self.search.load_state_dict(state.get("scheduler"), started=self._order_final)
