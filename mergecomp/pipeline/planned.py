"""A merged step whose groups a merge plan cuts, filled as the gradients arrive.

A :class:`PlannedStep` owns the merge plan and its layout, and one flat buffer per group:
:meth:`~PlannedStep.add` copies tensor ``i``'s gradient into its slot (prescaled and checked
for NaN/Inf in the same pass where it can), or, where the compressor encodes a group's gradients
where they lie (:meth:`~mergecomp.exchange.exchange.Exchange.begin`), encodes it as a part;
every group whose last tensor has arrived is then started, in plan order.  ``finish`` starts
the rest (missing tensors count as zeros).  After the first step, the plan follows the order in
which rank 0's gradients arrived (the backward order); with ``groups="auto"`` the online
scheduler (:class:`~mergecomp.scheduler.feed.PlanSearch`) then searches the plan.  The PyTorch
optimizer and the TensorFlow front end adapt it.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import FusedParts
from mergecomp.exchange.breakdown import ENCODE, SCHEDULER
from mergecomp.exchange.job import Job
from mergecomp.exchange.plan import EXEMPT, Group, GroupPlan, PlanSpec, build_plan, layout
from mergecomp.kernels import codecs, native
from mergecomp.pipeline.step import MergedStep, Reduced
from mergecomp.scheduler.clock import Arrivals
from mergecomp.scheduler.feed import PlanSearch

__all__ = ["PlannedStep", "DEFAULT_GROUP_BYTES", "DEFAULT_MAX_GROUPS"]

#: ``groups=None``: groups of about this many bytes (like DDP's ``bucket_cap_mb=25``) ...
DEFAULT_GROUP_BYTES = 25 * 2**20
#: ... and at most this many
DEFAULT_MAX_GROUPS = 4


def _holds(tensor: Optional[torch.Tensor], flat: torch.Tensor, offset: int) -> bool:
    """Whether ``tensor`` already lives at element ``offset`` of ``flat`` (a view handed out by
    an earlier step that backward accumulated into)."""
    return (tensor is not None and not tensor.is_sparse
            and tensor.data_ptr() == flat.data_ptr() + offset * flat.element_size())


class PlannedStep(MergedStep):
    """See the module docstring; the arguments are :class:`~mergecomp.pipeline.step.MergedStep`'s."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        groups, front_end = self.options.groups, self.front_end
        if not self.names:
            raise ValueError(f"{front_end.who}: no {front_end.tensor_kind} to exchange gradients for")
        self.warn_sparse = True  # a sparse gradient warns that it is exchanged densely
        self._spec = None if groups == "auto" else groups
        #: the online search (``groups="auto"``), started once the order is final
        self.search = PlanSearch(self, self.options.scheduler, front_end.cache_tag) if groups == "auto" else None
        self._order_final = not front_end.observe_order or isinstance(groups, (list, tuple, GroupPlan))
        self._last_reduced: Optional[Reduced] = None  # the last step's result (its views are reused)
        self._install(self.make_plan(list(reversed(range(len(self.names))))))
        if self.search is not None and self._order_final:
            self.search.start()

    @property
    def scheduler(self):
        """The online scheduler (``groups="auto"``), once started."""
        return self.search.scheduler if self.search is not None else None

    @property
    def buffers(self) -> List[torch.Tensor]:
        """The groups' flat buffers, in plan order."""
        return [self._buffer(g) for g in range(len(self._groups))]

    @property
    def in_flight(self) -> bool:
        """Whether a step has begun (a tensor added or a group started) and not finished."""
        return any(self._arrived) or bool(self._started)

    @property
    def exempt_flags(self) -> List[bool]:
        """Per tensor: whether it is sent uncompressed."""
        return list(self._exempt)

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
        flat = self._buffers[g]
        if flat is None:
            flat = self._buffers[g] = torch.empty(self._groups[g].numel, dtype=self.dtypes[self._groups[g].indices[0]],
                                                  device=self.device)
        return flat

    # -- gradients arrive --------------------------------------------------------------------
    def _reset(self) -> None:
        super()._reset()
        self._arrived = [False] * len(self.names)
        self._count = [0] * len(self._groups)
        #: per group: True while every gradient copied in was found finite, False once one was
        #: not, None when one was copied without a check (the exchange then checks the group)
        self._finite: List[Optional[bool]] = [True] * len(self._groups)
        #: this step's arrival times (made at its first arrival: :meth:`_arrivals_clock`)
        self._arrival_times: Optional[Arrivals] = None
        self._order_seen: List[int] = []
        #: per group: elements written into its buffer by this step's copy-in, pass by pass
        self._copied = [0] * len(self._groups)
        #: per group whose first tensor arrived: its FusedParts when its tensors are encoded as
        #: they arrive (Exchange.begin), else None
        self._arriving: Dict[int, Optional[FusedParts]] = {}

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
            raise RuntimeError(f"{self.front_end.who}: the gradient of {self.names[i]!r} arrived twice in one step")
        g, offset = self._where[i]
        with self.exchange.clock(ENCODE, self._groups[g].name):
            self._arrivals_clock().arrived(i)  # our own hook work is left out (own_work)
            self._order_seen.append(i)
            self._put(i, grad, g, offset)
            self._arrived[i] = True
            self._start_ready()

    def _put(self, i: int, grad: Optional[torch.Tensor], g: int, offset: int) -> None:
        """Tensor ``i``'s gradient into group ``g`` at ``offset``: encoded as a part, or copied in."""
        parts = self._parts(g)
        if parts is None:
            self._copied[g] += self._copy_in(i, grad, g, offset) * self.shapes[i].numel()
        else:
            with self._arrivals_clock().own_work():
                finite = parts.add(self._position[i], offset, self._part(i, grad, g, offset))  # checked by the kernel
            self._finite[g] = finite and self._finite[g] is not False
        self._count[g] += 1

    def _arrivals_clock(self) -> Arrivals:
        """This step's :class:`~mergecomp.scheduler.clock.Arrivals`: CUDA events in the step
        the scheduler profiles on a CUDA device, host seconds otherwise."""
        if self._arrival_times is None:
            profiled = self.search is not None and self.search.profiles_next()
            self._arrival_times = Arrivals(len(self.names), self.device, events=profiled)
        return self._arrival_times

    def launch(self, *args, **kwargs) -> Job:
        """:meth:`MergedStep.launch`, its seconds left out of the arrival times that follow."""
        with self._arrivals_clock().own_work():
            return super().launch(*args, **kwargs)

    def _parts(self, g: int) -> Optional[FusedParts]:
        """Group ``g``'s :class:`~mergecomp.compressors.base.compressor.FusedParts` this step,
        when its gradients are encoded as they arrive (:meth:`Exchange.begin`; no prescaling),
        else None: they are copied into its buffer."""
        if g not in self._arriving:
            self._arriving[g] = None if self.options.prescale != 1.0 else \
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
        prescale = self.options.prescale
        passes = 1
        if grad is None:
            slot.zero_()
        elif _holds(grad, flat, offset):
            self._unchecked(g)
            passes = 0
            if prescale != 1.0:
                slot.mul_(prescale)
                passes = 1
        else:
            if grad.is_sparse:
                if self.warn_sparse:
                    warnings.warn(f"{self.names[i]!r} has a sparse gradient; mergecomp exchanges it densely "
                                  f"(use nn.Embedding(sparse=False) to silence this)", stacklevel=6)
                grad = grad.to_dense()
                passes = 2  # the dense gradient written, then copied
            # the copy, prescale and check: one pass; a large group's buffer is read only once it is complete
            finite = codecs.copy_finite(grad, slot, prescale, stream=later and flat.numel() >= native.STREAM_MIN)
            if finite is None:
                self._unchecked(g)
            elif not finite:
                self._finite[g] = False
        return passes

    def _unchecked(self, g: int) -> None:
        if self._finite[g]:
            self._finite[g] = None

    def _start_ready(self) -> None:
        while (len(self._started) < len(self._groups)
               and self._count[len(self._started)] == len(self._groups[len(self._started)].indices)):
            g = len(self._started)
            self.launch(self._groups[g], self._buffer(g), self._plan.codec(g), self._finite[g], self._copied[g],
                        self._arriving.get(g))

    # -- the step's end ------------------------------------------------------------------------
    def _start_rest(self) -> None:
        """Missing tensors count as zeros."""
        self._timed_step = self.front_end.timed and all(self._arrived)
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                g, offset = self._where[i]
                with self.exchange.clock(ENCODE, self._groups[g].name):
                    self._put(i, None, g, offset)
        self._start_ready()

    def _decoded(self, jobs: List[Job], flats: List[torch.Tensor]) -> None:
        if self.front_end.hand_out:  # a buffer that is now a result must not be written again
            handed = {flat.untyped_storage().data_ptr() for flat in flats}
            self._buffers = [None if b is not None and b.untyped_storage().data_ptr() in handed else b
                             for b in self._buffers]

    def _end_step(self, bad: bool) -> None:
        self._arrivals = (self._arrival_times if self._timed_step else None), self._order_seen
        if (bad or self.exact) and self.search is not None:  # an exact step times no codec
            self.search.skip_sample()
        super()._end_step(bad)

    def _reduced(self, groups: List[Group], flats: List[torch.Tensor]) -> Reduced:
        """This step's result, with the last step's views where it holds the same groups and
        buffers (the group buffers, reused step after step unless handed out); the observed
        order adopted and the scheduler fed, which may switch plans for the next step."""
        arrivals, order_seen = self._arrivals
        with self.exchange.clock(SCHEDULER):
            self._adopt_order(order_seen)
            if self.search is not None:
                self.search.observe(arrivals)
        reduced, last = Reduced(groups, flats), self._last_reduced
        if last is not None and reduced.same_groups_and_buffers(last):
            reduced.views = last.views
        if not self.front_end.hand_out:
            self._last_reduced = reduced
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
