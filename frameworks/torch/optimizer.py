"""DistributedOptimizer: merged, compressed gradient exchange around any torch optimizer.

Lifecycle of one step (``backward_passes_per_step=1``)::

    loss.backward()
      └─ per parameter, when its gradient is accumulated (post-accumulate-grad hook):
         copy it into its group's flat buffer (fp32 on CPU: checked for NaN/Inf in the same
         pass); when a group is complete and every earlier group has been started, start it:
         compensate -> compress -> async collective
    optimizer.step()
      └─ synchronize(): start the groups still waiting (parameters without a gradient count as
         zeros), agree on non-finite gradients, wait for each group in plan order, decode and
         average into the group's buffer; each p.grad becomes a view of its slot there
      └─ the wrapped optimizer's own step()

Like DDP's ``gradient_as_bucket_view=True``, ``p.grad`` aliases the merged buffer after a step:
``zero_grad(set_to_none=True)`` (the default) drops the view, and with ``set_to_none=False``
the next backward accumulates straight into the buffer, so nothing is copied in either.

Groups are contiguous runs of the backward order.  The first step uses the reverse registration
order (like DDP's first buckets); after it, rank 0's observed gradient-ready order is broadcast
and the plan rebuilt once, carrying error-feedback state over (:func:`mergecomp.plan.remap_state`).
:meth:`DistributedOptimizer.set_plan` replaces the plan between steps (the scheduler's hook).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from mergecomp import native
from mergecomp.agreement import check_ranks_agree
from mergecomp.compressor import Compressor
from mergecomp.exchange import NONFINITE_POLICIES, Exchange, InFlight, NonfiniteCheck
from mergecomp.memory import Memory
from mergecomp.plan import Group, GroupPlan, build_plan, layout, remap_state
from mergecomp.scheduler import MergeScheduler, SchedulerConfig, exchange_scheduler

from .runtime import communicator

__all__ = ["DistributedOptimizer", "Average", "Sum"]

logger = logging.getLogger("mergecomp")

Average = "average"
Sum = "sum"
_OPS = (Average, Sum)
#: Bytes per group of the default plan, like DDP's ``bucket_cap_mb=25``.
_DEFAULT_GROUP_BYTES = 25 * 2**20
_DEFAULT_MAX_GROUPS = 4


def _in_slot(grad: Optional[torch.Tensor], buffer: torch.Tensor, offset: int) -> bool:
    """Whether ``grad`` already lives at element ``offset`` of ``buffer`` (it is the view
    :meth:`DistributedOptimizer._point_grads` made and backward accumulated into it)."""
    return (grad is not None and not grad.is_sparse
            and grad.data_ptr() == buffer.data_ptr() + offset * buffer.element_size())


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that gradients are merged, compressed and averaged across ranks.

    The wrapped optimizer's own ``step()`` does the update, so SGD with momentum, Adam, AdamW
    (weight decay) and LR schedulers behave as they do on one process.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its ``param_groups`` and ``state`` are shared.
        named_parameters: ``model.named_parameters()``; names key the merge plan and error
            messages.  Default: ``param.<i>`` in the optimizer's order.
        compression: compressor name (see ``mergecomp.compressor_names()``) or instance.
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        groups: merge plan: ``"auto"`` (default: the online scheduler searches the partition
            and each group's codec, see :mod:`mergecomp.scheduler`), ``"layerwise"``, an int
            ``k`` (k groups of about equal bytes), a list of lists of parameter names, a
            :class:`~mergecomp.plan.GroupPlan`, or ``None`` (groups of about 25 MB, at most 4).
        scheduler: :class:`~mergecomp.scheduler.SchedulerConfig` for ``groups="auto"``
            (warm-up and probe steps, maximum groups, plan cache path...).
        backward_passes_per_step: gradients are accumulated locally over this many backward
            passes and exchanged once.
        op: ``mc.Average`` (default) or ``mc.Sum`` over ranks.
        nonfinite: what a NaN/Inf gradient does: ``"raise"`` FloatingPointError on every rank
            naming the rank and group, ``"skip"`` the step on all ranks (counted in
            :attr:`skipped_steps`), or ``"ignore"`` (no check).  NaN/Inf never enters the
            error-feedback memory unless ``"ignore"``.

    Example::

        opt = mc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), 1e-3),
                                      named_parameters=model.named_parameters(),
                                      compression="topk", groups=2)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        compression: Union[str, Compressor] = "dgc",
        memory: Union[str, Memory, None] = None,
        groups="auto",
        backward_passes_per_step: int = 1,
        op: str = Average,
        nonfinite: str = "raise",
        scheduler: Optional[SchedulerConfig] = None,
    ) -> None:
        # Deliberately not calling Optimizer.__init__: param_groups, state and defaults are the
        # wrapped optimizer's own (properties below), so nothing is copied or re-created.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if op not in _OPS:
            raise ValueError(f"op must be mc.Average or mc.Sum, got {op!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
        self._optimizer = optimizer
        self._optimizer_step_pre_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Any] = OrderedDict()

        self.comm = communicator()
        self.exchange = Exchange.create(compression, memory, self.comm, average=op == Average,
                                        check_finite=nonfinite != "ignore")
        self._warn_double_momentum(self.exchange.memory)
        self.nonfinite = nonfinite
        self.backward_passes_per_step = backward_passes_per_step
        self.skipped_steps = 0

        self._params, self.param_names = self._collect(named_parameters)
        self._index = {p: i for i, p in enumerate(self._params)}
        self._auto = groups == "auto"
        self._groups_spec = None if self._auto else groups
        self._scheduler_config = scheduler or SchedulerConfig()
        self.scheduler: Optional[MergeScheduler] = None
        self._order_final = isinstance(groups, (list, tuple, GroupPlan))
        initial_order = list(reversed(range(len(self._params))))
        self._install(self._make_plan(initial_order))

        self._passes = [0] * len(self._params)
        self._observed: List[int] = []
        self._ready_at = [0.0] * len(self._params)
        self._encode_spent = 0.0
        self._last_step_end: Optional[float] = None
        self._synchronized = False
        self._step_skipped = False
        self._should_synchronize = True
        self._check_ranks_agree()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    # -- the wrapped optimizer's attributes ---------------------------------------------------
    @property
    def wrapped_optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._optimizer.param_groups = value

    @property
    def state(self):
        return self._optimizer.state

    @state.setter
    def state(self, value):
        self._optimizer.state = value

    @property
    def defaults(self):
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self._optimizer.defaults = value

    @property
    def compressor(self) -> Compressor:
        return self.exchange.compressor

    @property
    def memory(self) -> Memory:
        return self.exchange.memory

    @property
    def plan(self) -> GroupPlan:
        return self._plan

    @property
    def groups(self) -> List[Group]:
        """The current merged groups with their parameters' offsets."""
        return list(self._groups)

    # -- construction -------------------------------------------------------------------------
    def _collect(self, named_parameters) -> Tuple[List[torch.nn.Parameter], List[str]]:
        in_optimizer = [p for g in self._optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        by_id = {id(p): n for n, p in named}
        unnamed = [i for i, p in enumerate(in_optimizer) if id(p) not in by_id]
        if unnamed:
            raise ValueError(f"named_parameters does not match the optimizer: {len(unnamed)} of the optimizer's "
                             f"parameters (positions {unnamed[:8]}) are missing from named_parameters")
        optimized = {id(p) for p in in_optimizer}
        stray = [n for n, p in named if id(p) not in optimized and p.requires_grad]
        if stray:
            raise ValueError(f"named_parameters does not match the optimizer: {stray[:8]} are not optimized by it")
        params, param_names = [], []
        for p in in_optimizer:
            if p.requires_grad:  # frozen parameters never get a gradient: nothing to exchange
                params.append(p)
                param_names.append(by_id[id(p)])
        if not params:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        return params, param_names

    def _check_ranks_agree(self) -> None:
        """Raise on every rank if the ranks built different models, compressors, memories or
        settings: mismatched collectives would otherwise hang or silently mix gradients."""
        check_ranks_agree(self.exchange, {
            "parameters (names, shapes, dtypes)": [(n, tuple(p.shape), str(p.dtype))
                                                   for n, p in zip(self.param_names, self._params)],
            "groups": repr(self._groups_spec if not self._auto else ("auto", self._scheduler_config)),
            "backward_passes_per_step, nonfinite": (self.backward_passes_per_step, self.nonfinite),
        }, "DistributedOptimizer")

    def _warn_double_momentum(self, memory: Memory) -> None:
        if memory.name == "dgc" and any(g.get("momentum", 0) for g in self._optimizer.param_groups):
            warnings.warn("the 'dgc' memory applies momentum correction itself; the wrapped optimizer's "
                          "momentum is applied on top of it. Use momentum=0 in the optimizer, or "
                          "memory='residual'.", stacklevel=3)

    def _make_plan(self, order: Sequence[int], spec=None) -> GroupPlan:
        nbytes = [p.numel() * p.element_size() for p in self._params]
        kinds = [(p.dtype, p.device) for p in self._params]
        spec = self._groups_spec if spec is None else spec
        if spec is None:
            spec = max(1, min(_DEFAULT_MAX_GROUPS, math.ceil(sum(nbytes) / _DEFAULT_GROUP_BYTES)))
        return build_plan(spec, order, self.param_names, nbytes, kinds)

    def _install(self, plan: GroupPlan) -> None:
        shapes = [p.shape for p in self._params]
        self._plan = plan
        self._groups = layout(plan, shapes)
        self._group_of: Dict[int, Tuple[int, int, int]] = {}
        for g, group in enumerate(self._groups):
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                self._group_of[i] = (g, offset, n)
        first = [self._params[group.indices[0]] for group in self._groups]
        self._buffers = [torch.empty(group.numel, dtype=p.dtype, device=p.device)
                         for group, p in zip(self._groups, first)]
        self._reset_step()

    def _reset_step(self) -> None:
        self._ready = [0] * len(self._groups)
        self._filled = [False] * len(self._params)
        #: per group: True while every gradient copied in was found finite, False once one was
        #: not, None when one was not checked (see _fill)
        self._finite: List[Optional[bool]] = [True] * len(self._groups)
        self._jobs: List[Optional[InFlight]] = [None] * len(self._groups)
        self._next_group = 0

    def set_plan(self, plan: Union[GroupPlan, Any]) -> None:
        """Replace the merge plan between steps; error-feedback and per-element compressor
        state move to the new groups.  Every rank must call it with the same plan at the same step."""
        if any(self._passes) or any(job is not None for job in self._jobs):
            raise RuntimeError("set_plan() must be called between steps, not after backward() and before step()")
        if not isinstance(plan, GroupPlan):
            plan = self._make_plan(self._plan.order, plan)
        old = self._groups
        new = layout(plan, [p.shape for p in self._params])
        for holder in (self.exchange.memory, self.exchange.compressor):
            holder.load_state_dict(remap_state(holder.state_dict(), old, new))
        self._install(plan)

    # -- backward -----------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        i = self._index[p]
        self._passes[i] += 1
        if self._passes[i] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradient of {self.param_names[i]!r} was computed {self._passes[i]} times before step(); "
                f"backward_passes_per_step={self.backward_passes_per_step}. Call optimizer.step() (or "
                f"synchronize()) after every {self.backward_passes_per_step} backward pass(es)")
        if self._passes[i] == self.backward_passes_per_step:
            # Compute time only: what our own hook work delayed the backward pass by is removed.
            self._ready_at[i] = time.perf_counter() - self._encode_spent
            if not self._order_final:
                self._observed.append(i)
            self._fill(i)
            self._launch_ready()

    @torch.no_grad()
    def _fill(self, i: int) -> None:
        g, offset, n = self._group_of[i]
        p = self._params[i]
        slot = self._buffers[g][offset:offset + n]
        grad = p.grad
        if grad is None:
            slot.zero_()
        elif grad.is_sparse:
            self._warn_sparse(i)
            slot.copy_(grad.to_dense().reshape(-1))
            self._unchecked(g)
        elif _in_slot(grad, self._buffers[g], offset):
            self._unchecked(g)  # accumulated in place: p.grad is already this slot
        elif self.exchange.check_finite and native.usable(grad, slot):
            if not native.copy_finite(grad, slot):
                self._finite[g] = False
        else:
            slot.copy_(grad.reshape(-1))
            self._unchecked(g)
        self._filled[i] = True
        self._ready[g] += 1

    def _unchecked(self, g: int) -> None:
        """Group ``g`` holds a gradient not checked for NaN/Inf while filling: the exchange
        checks the whole group (unless one already failed)."""
        if self._finite[g]:
            self._finite[g] = None

    def _warn_sparse(self, i: int) -> None:
        warnings.warn(f"parameter {self.param_names[i]!r} has a sparse gradient; mergecomp exchanges it "
                      f"densely (use nn.Embedding(sparse=False) to silence this)", stacklevel=4)

    def _launch_ready(self) -> None:
        while (self._next_group < len(self._groups)
               and self._ready[self._next_group] == len(self._groups[self._next_group].indices)):
            g = self._next_group
            job = self.exchange.start(self._groups[g], self._buffers[g], self._plan.codec(g), self._finite[g])
            self._encode_spent += job.encode_seconds
            self._jobs[g] = job
            self._next_group += 1

    # -- step ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the exchange of this step's gradients and write the result into ``p.grad``.

        Parameters that got no gradient this step contribute zeros.
        """
        if self._synchronized:
            return
        for i, filled in enumerate(self._filled):
            if not filled:
                self._fill(i)
        self._launch_ready()
        check = None
        if self.nonfinite != "ignore":
            check = NonfiniteCheck(self.comm, [job.finite for job in self._jobs], self.exchange.step)
        for job, buffer in zip(self._jobs, self._buffers):
            self.exchange.finish(job, out=buffer)
        bad = check.culprits([group.name for group in self._groups]) if check else []
        self._synchronized = True
        self._step_skipped = bool(bad)
        if not bad:
            self._point_grads()
        step = self.exchange.step
        self.exchange.step += 1
        filled_in_backward = all(self._passes)
        self._passes = [0] * len(self._params)
        self._reset_step()
        self._adopt_observed_order()
        self._schedule(filled_in_backward)
        if bad:
            self._handle_nonfinite(bad, step)

    def _handle_nonfinite(self, bad: List[Tuple[int, str]], step: int) -> None:
        where = "; ".join(f"rank {rank}, group {name!r}" for rank, name in bad)
        if self.nonfinite == "raise":
            self._synchronized = self._step_skipped = False
            names = {group.name: group for group in self._groups}
            params = sorted({self.param_names[i] for _, name in bad for i in names[name].indices})
            raise FloatingPointError(
                f"non-finite gradient at step {step} ({where}); parameters in those groups: "
                f"{params[:8]}{' ...' if len(params) > 8 else ''}. Pass nonfinite='skip' to skip such steps")
        self.skipped_steps += 1
        logger.warning("skipping step %d: non-finite gradient (%s)", step, where)

    def _point_grads(self) -> None:
        """Make each ``p.grad`` a view of its slot in the group buffer, which now holds the
        reduced gradients (DDP's ``gradient_as_bucket_view``): no copy, and a gradient
        accumulated in place (``zero_grad(set_to_none=False)``) needs no copy into the buffer."""
        for group, buffer in zip(self._groups, self._buffers):
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                p = self._params[i]
                if not _in_slot(p.grad, buffer, offset):
                    p.grad = buffer[offset:offset + n].view(p.shape)

    def _adopt_observed_order(self) -> None:
        """After the first step: rebuild the plan along rank 0's gradient-ready order."""
        if self._order_final:
            return
        self._order_final = True
        seen = set(self._observed)
        order = self._observed + [i for i in reversed(range(len(self._params))) if i not in seen]
        order_tensor = self.comm.broadcast_(torch.tensor(order, dtype=torch.int64, device=self.comm.device), 0)
        self._observed = []
        plan = self._make_plan(order_tensor.tolist())
        if plan != self._plan:
            self.set_plan(plan)
        if self._auto:
            self._start_scheduler()

    def _schedule(self, timed: bool) -> None:
        """Feed the finished step to the scheduler; switch plans when it says so."""
        now = time.perf_counter()
        previous, self._last_step_end = self._last_step_end, now
        if self.scheduler is None or previous is None:
            return
        order = self._plan.order
        first = min(self._ready_at[i] for i in order) if timed else 0.0
        ready = [self._ready_at[i] - first if timed else 0.0 for i in order]
        plan = self.scheduler.observe(now - previous, ready, self._plan)
        if plan is not None and plan != self._plan:
            self.set_plan(plan)

    def schedule_report(self) -> Dict[str, Any]:
        """What the scheduler did: candidates with predicted and measured seconds per step, the
        chosen plan, search cost in steps.  Fixed plans report ``{"phase": "fixed"}``."""
        if self.scheduler is None:
            return {"phase": "fixed" if not self._auto else "starting", "groups": len(self._groups)}
        return self.scheduler.report()

    def _start_scheduler(self) -> None:
        order = list(self._plan.order)
        first = self._params[order[0]]
        self.scheduler = exchange_scheduler(
            self.exchange, self._scheduler_config, order, [p.numel() * p.element_size() for p in self._params],
            [p.shape for p in self._params], first.dtype, first.device, lambda plan: self._make_plan(order, plan),
            [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(self.param_names, self._params)])
        cached = self.scheduler.initial_plan()
        if cached is not None:
            self.set_plan(cached)

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`) and run the wrapped optimizer's step.

        A ``closure`` is evaluated once, before the exchange, so its ``backward()`` is the one
        reduced (LBFGS-style repeated evaluation is not supported).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        if self._step_skipped:
            self._step_skipped = False
            return loss
        self._optimizer.step()
        return loss

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context ``step()`` does not synchronize (call :meth:`synchronize` before,
        e.g. to unscale or clip the averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(self._passes) and not self._synchronized:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(); the gradients being "
                               "exchanged would be lost")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"mergecomp"``: plan, step, compressor
        state, error-feedback memory (this rank's) and the scheduler's choice."""
        state = self._optimizer.state_dict()
        state["mergecomp"] = {"plan": self._plan.to_json(), "order_final": self._order_final,
                              "skipped_steps": self.skipped_steps, **self.exchange.state_dict(),
                              "scheduler": self.scheduler.state_dict() if self.scheduler else None}
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or a plain one of the wrapped optimizer).
        Call it between steps, on every rank, with each rank's own checkpoint."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("mergecomp", None)
        self._optimizer.load_state_dict(state_dict)
        if ours is None:
            return
        self._install(self._make_plan(self._plan.order, GroupPlan.from_json(ours["plan"])))
        self._order_final = bool(ours["order_final"])
        self.skipped_steps = int(ours["skipped_steps"])
        self.exchange.load_state_dict(ours)
        self._last_step_end = None
        if self._auto and self._order_final:
            if self.scheduler is None:
                self._start_scheduler()
            if ours.get("scheduler"):
                self.scheduler.load_state_dict(ours["scheduler"])

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("add_param_group() after wrapping is not supported: add the parameters "
                                  "to the optimizer before creating the DistributedOptimizer")

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper stops exchanging gradients)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self._optimizer!r}, compression={self.compressor!r}, "
                f"memory={self.memory!r}, groups={len(self._groups)})")
