"""DistributedOptimizer: merged, compressed gradient exchange around any torch optimizer.

Lifecycle of one step (``backward_passes_per_step=1``)::

    loss.backward()
      └─ per parameter, when its gradient is accumulated (post-accumulate-grad hook):
         MergedStep.add: copy it into its group's flat buffer (fp32 on CPU: checked for NaN/Inf
         in the same pass); a group whose last gradient arrived starts, in plan order:
         compensate -> compress -> async collective
    optimizer.step()
      └─ synchronize(): MergedStep.finish (parameters without a gradient count as zeros; the
         ranks agree on non-finite gradients; each group is decoded and averaged into its
         buffer); each p.grad becomes a view of its slot there
      └─ the wrapped optimizer's own step()

Like DDP's ``gradient_as_bucket_view=True``, ``p.grad`` aliases the merged buffer after a step:
``zero_grad(set_to_none=True)`` (the default) drops the view, and with ``set_to_none=False``
the next backward accumulates straight into the buffer, so nothing is copied in either.
Plans, the observed backward order, the scheduler and checkpoints are
:class:`mergecomp.step.MergedStep`'s.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from mergecomp.compressor import Compressor
from mergecomp.memory import Memory, warn_double_momentum
from mergecomp.runtime import communicator
from mergecomp.scheduler import SchedulerConfig
from mergecomp.step import HoldsMergedStep, MergedStep

__all__ = ["DistributedOptimizer", "Average", "Sum"]

Average = "average"
Sum = "sum"
_OPS = (Average, Sum)


def _wrapped(name: str) -> property:
    """The wrapped optimizer's attribute ``name``, read and written through."""
    return property(lambda self: getattr(self._optimizer, name),
                    lambda self, value: setattr(self._optimizer, name, value))

class DistributedOptimizer(HoldsMergedStep, torch.optim.Optimizer):
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
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
        self._optimizer = optimizer
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):  # torch.optim.Optimizer's hook registries
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())

        self._params, self.param_names = self._collect(named_parameters)
        first = self._params[0]
        self.merged = MergedStep(
            compression, memory, communicator(), self.param_names, [p.shape for p in self._params],
            [p.dtype for p in self._params], first.device, groups=groups, average=op == Average,
            nonfinite=nonfinite, scheduler=scheduler, who="DistributedOptimizer", tensor_kind="parameters",
            agree={"backward_passes_per_step": backward_passes_per_step})
        warn_double_momentum(self.memory, any(g.get("momentum", 0) for g in optimizer.param_groups))
        self.backward_passes_per_step = backward_passes_per_step
        self._index = {p: i for i, p in enumerate(self._params)}
        self._passes = [0] * len(self._params)
        self._synchronized = False
        self._step_skipped = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    # -- the wrapped optimizer's attributes ---------------------------------------------------
    @property
    def wrapped_optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    param_groups = _wrapped("param_groups")
    state = _wrapped("state")
    defaults = _wrapped("defaults")

    # -- the merged step (exchange, compressor, memory, plan, groups, scheduler, skipped_steps) --
    def set_plan(self, plan) -> None:
        """Replace the merge plan between steps (a :class:`~mergecomp.plan.GroupPlan` or any
        ``groups`` spec); error-feedback and per-element compressor state move to the new
        groups.  Every rank must call it with the same plan at the same step."""
        self.merged.set_plan(plan)

    def schedule_report(self) -> Dict[str, Any]:
        """What the scheduler did: candidates with predicted and measured seconds per step, the
        chosen plan, search cost in steps.  Fixed plans report ``{"phase": "fixed"}``."""
        return self.merged.schedule_report()

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
        params = [p for p in in_optimizer if p.requires_grad]  # frozen ones never get a gradient
        if not params:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        return params, [by_id[id(p)] for p in params]

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
            self.merged.add(i, p.grad)

    # -- step ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the exchange of this step's gradients and write the result into ``p.grad``.

        Parameters that got no gradient this step contribute zeros.
        """
        if self._synchronized:
            return
        self._passes = [0] * len(self._params)
        reduced = self.merged.finish()  # raises under nonfinite="raise"
        self._synchronized = True
        self._step_skipped = reduced is None
        if reduced is not None:
            for p, view in zip(self._params, reduced.tensors(len(self._params))):
                if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view

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
        if self.merged.in_flight:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(); the gradients being "
                               "exchanged would be lost")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"mergecomp"``: plan, step, compressor
        state, error-feedback memory (this rank's) and the scheduler's choice."""
        state = self._optimizer.state_dict()
        state["mergecomp"] = self.merged.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or a plain one of the wrapped optimizer).
        Call it between steps, on every rank, with each rank's own checkpoint."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("mergecomp", None)
        self._optimizer.load_state_dict(state_dict)
        if ours is not None:
            self.merged.load_state_dict(ours)

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
                f"memory={self.memory!r}, groups={len(self.groups)})")
