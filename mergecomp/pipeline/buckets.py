"""A merged step whose groups the caller gives each step: DDP's gradient buckets (the DDP hook).

The caller starts each bucket with :meth:`BucketStep.start_group` (tensors in the bucket's
order, laid out in its flat buffer, compressed in place) and ends the step with ``finish``,
which writes every bucket's result back into its buffer.  A bucket holding exempt tensors is
cut in two groups (its exempt tensors, the others), each copied out of the bucket into a buffer
of its own (and transformed there by ``before_start``); the caller copies their results back
with :meth:`BucketStep.copy_back` once it has done with them.  When the buckets differ from the
last step's (DDP rebuilt them), each new group takes over its tensors' state from the old groups
(per element; other state, such as PowerSGD's Q, starts afresh), and the step's groups become
the layout.
Tensors may be registered as they come (:meth:`BucketStep.add_tensor`).
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from mergecomp.exchange.breakdown import ENCODE
from mergecomp.exchange.job import Job
from mergecomp.exchange.plan import COMPRESSED, EXEMPT, Group, GroupPlan, layout, remap_state
from mergecomp.pipeline.step import MergedStep, Reduced

__all__ = ["BucketStep"]


class BucketStep(MergedStep):
    """See the module docstring; the arguments are :class:`~mergecomp.pipeline.step.MergedStep`'s
    (the ``groups`` option does not apply)."""

    groups_agreed = "caller's"

    def __init__(self, *args, **kwargs) -> None:
        self._parts: Dict[str, torch.Tensor] = {}  # split buckets' buffers, by group name
        self._before: Optional[List[Dict]] = None  # the state before this step's new groups took theirs
        #: the last step's split buckets: their slices and the result that goes back into them
        self._results: List[Tuple[List[torch.Tensor], torch.Tensor]] = []
        super().__init__(*args, **kwargs)

    def add_tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Register one more tensor; returns its index."""
        self.names.append(name)
        self.shapes.append(torch.Size(shape))
        self.dtypes.append(dtype)
        self._exempt.append(self._exemptions.exempt(name, self.shapes[-1].numel()))
        return len(self.names) - 1

    def _reset(self) -> None:
        super()._reset()
        self._given: List[Group] = []  # the groups started this step
        self._given_codecs: List[str] = []
        #: split buckets: (the bucket's slices, index of the job whose result goes back into them)
        self._copy_back: List[Tuple[List[torch.Tensor], int]] = []

    def start_group(self, indices: Sequence[int], flat: torch.Tensor) -> None:
        """Start the bucket of tensors ``indices`` laid out in ``flat`` in that order, compressed
        in place (see the module docstring)."""
        with self.exchange.clock(ENCODE):
            group = layout(GroupPlan((tuple(indices),)), self.shapes)[0]
            if group.numel != flat.numel():
                raise RuntimeError(f"{self.front_end.who}: a group of {flat.numel()} elements holds tensors "
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
        """Start ``group``, transformed first by :attr:`before_start`; a group new to the layout
        first takes its tensors' state over."""
        if codec != EXEMPT and group not in self._groups and self._groups:
            holders = self._holders()
            if self._before is None:  # later groups of this step remap from the same snapshot
                self._fold()
                self._before = [holder.state_dict() for holder in holders]
            for holder, before in zip(holders, self._before):
                holder.state.pop(group.name, None)
                holder.state.update(remap_state(before, self._groups, [group]))
        finite = None if self.before_start is None else self.before_start(len(self._given), group, flat, ())
        self._given.append(group)
        self._given_codecs.append(codec)
        self.launch(group, flat, codec, finite, copied)

    def _decoded(self, jobs: List[Job], flats: List[torch.Tensor]) -> Reduced:
        """Split buckets' results are to go back into their slices (:meth:`copy_back`)."""
        for _, j in self._copy_back:
            jobs[j].count("copy-out", 1)
        self._results = [(slices, flats[j]) for slices, j in self._copy_back]
        return super()._decoded(jobs, flats)

    def copy_back(self) -> None:
        """After ``finish`` (and whatever the caller does to its results in place): each split
        bucket's results go back into the bucket's slices, where DDP takes them."""
        for slices, result in self._results:
            for dst, src in zip(slices, result.split([t.numel() for t in slices])):
                dst.copy_(src)
        self._results = []

    def _end_step(self, bad: bool) -> None:
        """The groups started this step become the layout; state of groups gone is dropped."""
        if self._given != self._groups:
            keep = {group.name for group in self._given}
            for holder in self._holders():
                holder.state = {name: fields for name, fields in holder.state.items() if name in keep}
            self._parts = {name: buffer for name, buffer in self._parts.items() if name in keep}
            self._groups = self._given
            self._plan = GroupPlan(tuple(group.indices for group in self._groups), tuple(self._given_codecs))
        self._before = None
        super()._end_step(bad)

    def abort(self) -> None:
        self._before, self._results = None, []
        super().abort()

    def _load_layout(self, plan: GroupPlan, shapes: List[torch.Size], state: Dict[str, Any]) -> None:
        """The saved groups; the caller's are remapped from them on use."""
        self._groups, self._plan, self._before = layout(plan, shapes), plan, None
        self._reset()
