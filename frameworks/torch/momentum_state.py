"""Adam's momentum and variance held flat per merged group, for the momentum exchange
(:mod:`frameworks.torch.momentum_exchange`): each group's elementwise work is then one kernel
call (:mod:`mergecomp.kernels.frozen_adam`), not one per tensor.

:class:`GroupState` takes a group's tensors' ``exp_avg`` and ``exp_avg_sq`` into two flat
buffers laid out as the group's gradients (the same offsets), and the optimizer's state holds
views of them from then on, so Adam's state, its checkpoints and ``load_state_dict`` see the
tensors they expect (``torch.save`` writes a buffer its views share once).  A tensor without
Adam state (one Adam never stepped) is an inactive segment: it sends zeros and is not updated.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from mergecomp.exchange.plan import Group
from mergecomp.kernels.frozen_adam import Segments

__all__ = ["GroupState"]


class GroupState:
    """One merged group's share of the momentum phase.

    Args:
        group: the group (its tensors, offsets and shapes).
        params: every exchanged parameter, by tensor index.
        state: the optimizer's per-parameter state (``exp_avg``, ``exp_avg_sq`` and ``step`` of
            those that have it).
        group_of: the index of each parameter's parameter group, by ``id``.
        coefficients: each tensor's coefficient on the wire, by tensor index.
    """

    def __init__(self, group: Group, params: Sequence[torch.nn.Parameter], state: Dict,
                 group_of: Dict[int, int], coefficients: Sequence[float]) -> None:
        self.group = group
        self.params = [params[i] for i in group.indices]
        states = [state.get(p) for p in self.params]
        first = self.params[0]
        #: Adam's momentum and variance of the group's tensors, flat (inactive segments: 0 and 1)
        self.momentum = torch.zeros(group.numel, dtype=first.dtype, device=first.device)
        self.variance = torch.ones(group.numel, dtype=first.dtype, device=first.device)
        for s, offset, numel, shape in zip(states, group.offsets, group.numels(), group.shapes):
            if s:
                for key, flat in (("exp_avg", self.momentum), ("exp_avg_sq", self.variance)):
                    view = flat[offset:offset + numel].view(shape)
                    view.copy_(s[key])
                    s[key] = view
        active = [bool(s) for s in states]
        self.pg = torch.tensor([group_of[id(p)] for p in self.params], dtype=torch.int64)
        self._per_group: Dict[Tuple[float, ...], torch.Tensor] = {}
        #: Adam's step count of each segment (0 where inactive), as Adam's own ``state["step"]``
        self.steps = torch.tensor([float(s["step"]) if s else 0.0 for s in states], dtype=torch.float64)
        self._step_tensors = [s["step"] if s else None for s in states]  # Adam's, by segment
        self.coefficient = torch.tensor([coefficients[i] for i in group.indices], dtype=torch.float64)
        bundles: Dict[int, List[int]] = {}
        for s, (pg, on) in enumerate(zip(self.pg.tolist(), active)):
            if on:
                bundles.setdefault(pg, []).append(s)
        self.segments = Segments(torch.tensor([*group.offsets, group.numel], dtype=torch.int64), list(group.numels()),
                                 torch.tensor(active, dtype=torch.uint8), list(bundles.values()))
        #: the segments last counted, and their step tensors (one list for the usual segments)
        self._counted: Tuple[Segments, List[torch.Tensor]] = (
            self.segments, [t for t in self._step_tensors if t is not None])

    def per_group(self, values: Sequence[float]) -> torch.Tensor:
        """fp64, per segment: ``values[j]`` of its parameter group ``j`` (made once for each
        list of values, which step after step are mostly the same)."""
        key = tuple(values)
        made = self._per_group.get(key)
        if made is None:
            if len(self._per_group) > 64:
                self._per_group.clear()
            made = self._per_group[key] = torch.tensor(values, dtype=torch.float64)[self.pg]
        return made

    def per_step(self, value: Callable[[int, int], float]) -> torch.Tensor:
        """fp64, per segment: ``value(parameter group, Adam's step count)``, computed once for
        each pair that occurs (in Python floats, as Adam computes its own constants)."""
        key = self.pg.to(torch.float64) * 2.0 ** 40 + self.steps
        pairs, where = torch.unique(key, return_inverse=True)
        return torch.tensor([value(int(k // 2.0 ** 40), int(k % 2.0 ** 40)) for k in pairs.tolist()],
                            dtype=torch.float64)[where]

    def count_update(self, segments: Segments) -> None:
        """One more Adam update of ``segments``' active tensors (these segments, or some of them
        left out of one update), here and in Adam's own ``state["step"]``."""
        self.steps += segments.active.to(torch.float64)
        if segments is not self._counted[0]:
            self._counted = segments, [t for t, on in zip(self._step_tensors, segments.active.tolist()) if on]
        if self._counted[1]:
            torch._foreach_add_(self._counted[1], 1.0)
