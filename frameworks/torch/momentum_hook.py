"""The momentum exchange (:mod:`frameworks.torch.momentum_exchange`) where the gradients travel
through DDP's buckets (:mod:`frameworks.torch.ddp_hook`).

The hook turns each bucket's gradients into this rank's momentum as the bucket starts and the
averaged result back into the averaged momentum, which DDP hands to ``p.grad`` (where a
``GradScaler`` may unscale it and clipping clip it).  The optimizer's own ``step()``, whoever
calls it (the user, a ``GradScaler``, the ``Trainer``, Accelerate, Lightning), then runs the
frozen-variance update from ``p.grad`` in a step pre-hook, and Adam's own step sees only the
parameters the hook does not exchange (each parameter group's ``params`` hold just those until
its post-hook puts them back).  In the warm-up Adam's step runs as it is.  The post-hook counts
the update; a step a ``GradScaler`` skips never calls the optimizer, so it is not counted.  A
``step(closure)`` (Lightning runs the forward and backward pass in the closure) runs the update
after the closure, inside the step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from mergecomp.exchange.exchange import Exchange
from mergecomp.pipeline.step import MergedStep

from .momentum_exchange import OPTION, MomentumExchange, MomentumSettings, scaler_skips
from .momentum_recipes import adapt
from .named_parameters import inner_optimizer

__all__ = ["HookMomentum"]


class HookMomentum:
    """The momentum exchange of one DDP hook.

    Args:
        settings: the options (:class:`~frameworks.torch.momentum_exchange.MomentumSettings`).
        params: the parameters the hook exchanges, by tensor index.
    """

    def __init__(self, settings: MomentumSettings, params: List[torch.nn.Parameter]) -> None:
        self.settings = settings
        self.params = params
        #: the exchange once an optimizer is attached (:meth:`attach`)
        self.exchange: Optional[MomentumExchange] = None
        self._loaded: Optional[Dict[str, Any]] = None  # loaded before attach: applied by it
        self._handles: List[Any] = []
        self._exchanged = {id(p) for p in params}
        #: per parameter group: its ``params`` list as last seen, and those of them not exchanged
        self._others: List[Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]] = []
        self._hidden: List[List[torch.nn.Parameter]] = []  # each group's params while Adam's step runs
        self._applied = True  # whether this step's update ran (or Adam's, in the warm-up)

    def attach(self, optimizer: Any, exchange: Exchange, grad_scaler: Any = None) -> None:
        """Exchange ``optimizer``'s momentum (an Adam or AdamW, or a wrapper holding one) from now
        on, with ``grad_scaler`` scaling the loss (None: none).  Every exchanged parameter must
        be in it; ValueError otherwise.  Called again with the same optimizer, keeps the state
        (takes the new ``grad_scaler``); with another, moves to it.
        Without a state loaded (:meth:`load_state_dict`), the updates so far are Adam's step
        count, as :meth:`MomentumExchange.load_state_dict` of None has it: load the optimizer's
        own state first when resuming from a checkpoint without the hook's."""
        optimizer = inner_optimizer(optimizer)
        if self.exchange is not None and self.exchange.optimizer is optimizer:  # again (a second train())
            self.exchange.grad_scaler = grad_scaler
            return
        momentum = MomentumExchange(optimizer, self.params, adapt(self.settings, optimizer, "ddp_comm_hook"), exchange,
                                    grad_scaler)  # checks it
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in held]
        if missing:
            raise ValueError(f"{OPTION}: the optimizer does not hold {len(missing)} of the parameters the DDP hook "
                             f"exchanges (tensor indices {missing[:8]}); give it the DDP model's parameters")
        self.detach()
        self.exchange = momentum
        momentum.load_state_dict(self._loaded)  # None: the updates so far are Adam's step count
        self._loaded = None
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    def detach(self) -> None:
        """Stop updating through the optimizer's step hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._others = [], []

    @property
    def _phase(self) -> Optional[MomentumExchange]:
        exchange = self.exchange
        return exchange if exchange is not None and exchange.active else None

    def begin(self, merged: MergedStep) -> None:
        """At a step's first bucket (:meth:`MomentumExchange.begin_step`); RuntimeError without
        an optimizer."""
        if self.exchange is None:
            raise RuntimeError(f"{OPTION}: the DDP hook has no optimizer to exchange the momentum of: call "
                               f"state.set_optimizer(optimizer) on every rank before the first backward pass")
        self.exchange.begin_step(merged)

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> Optional[Tuple[tuple, dict]]:
        """In the momentum phase: the frozen-variance update, then Adam's step sees only the
        parameters not exchanged.  A step given a ``closure`` (Lightning's: the forward and
        backward pass run inside ``step``) gets one that runs it first."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            self._update(optimizer)
            return None

        def closure_then_update():
            loss = closure()
            self._update(optimizer)
            return loss

        return args[:1], {**kwargs, "closure": closure_then_update}

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        if scaler_skips(optimizer, self.exchange.grad_scaler):  # a fused Adam's step that moves nothing: not counted
            self._applied = False
            return
        momentum = self._phase
        if momentum is None:
            return
        # not applied: Adam's step must not touch them either
        self._applied = momentum.update(getattr(optimizer, "grad_scale", None))
        groups = optimizer.param_groups
        self._hidden = [group["params"] for group in groups]
        if len(self._others) != len(groups) or any(seen is not params for (seen, _), params in
                                                    zip(self._others, self._hidden)):  # new lists (a load)
            self._others = [(params, [p for p in params if id(p) not in self._exchanged]) for params in self._hidden]
        for group, (_, others) in zip(groups, self._others):
            group["params"] = others

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """Each parameter group's ``params`` back; the update counted."""
        for group, params in zip(optimizer.param_groups, self._hidden):
            group["params"] = params
        self._hidden = []
        if self._applied:
            self.exchange.counted()
        self._applied = True

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Optional[Dict[str, Any]]:
        """:meth:`MomentumExchange.state_dict` (the same on every rank); None before :meth:`attach`
        (what was loaded, if anything)."""
        return self._loaded if self.exchange is None else self.exchange.state_dict()

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (the optimizer's own state loaded before, by the caller or
        its framework); before :meth:`attach` it is kept and applied by it."""
        if self.exchange is None:
            self._loaded = state
        else:
            self.exchange.load_state_dict(state)
