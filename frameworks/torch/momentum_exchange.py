"""Adam's momentum exchanged instead of its gradients, with the variance frozen (after 1-bit Adam).

``DistributedOptimizer(torch.optim.Adam(...) or AdamW(...), ..., exchange_momentum_after=K)``:

* **Warm-up** (the first ``K`` updates): gradients are exchanged as without the option and the
  wrapped class's own ``step()`` updates the parameters.  They are exchanged losslessly
  (``compression_warmup_steps`` defaults to ``K``): the variance frozen next is estimated from
  them, and a sparsifier's gradients (zeros where nothing was sent) would leave it near zero
  where an element was not sent.  A smaller ``compression_warmup_steps`` compresses the rest of
  the warm-up (for dense codecs: signs, quantizers, casts).
* **Freeze**, after the ``K``-th update: Adam's second moment ``exp_avg_sq`` stops changing
  (an element that got no gradient in the warm-up takes its tensor's mean, or the mean of all);
  each tensor gets a coefficient ``c`` (the RMS of the whole wire momentum ``m / d`` below over
  the RMS of its own; 1 for a lossless compressor), so that one codec scale shared by a merged
  group does not drown small tensors in large ones (1-bit LAMB's scaling); the error-feedback
  memories start afresh.
* **Momentum phase**: as tensor ``p``'s gradient ``g`` arrives (the backward hook) it is
  overwritten by this rank's momentum, in the gradient's loss scale ``S`` (the ``grad_scaler``'s
  scale, else 1), as it goes on the wire::

      x = c * ((1 - beta1) * (±g + S * wd * p) + beta1 * S * m) / d     (wd * p: Adam's L2 decay only)

  ``d = sqrt(v) + eps``, Adam's denominator (the same on every rank while ``v`` is frozen): the
  codec sees the update's own scale, where Adam has made the elements comparable, so its
  shared scales (a sign code's mean, top-k's threshold, TernGrad's maximum) and its error
  feedback weigh each element by what it will move the parameter.  A low-rank codec
  (PowerSGD) gets ``d = 1``: the division would break the matrix structure it approximates;
  a lossless one ``c = d = 1``.  ``x`` goes through the merged groups like any gradient:
  compressed by the chosen compressor with its error feedback, overlapping the backward pass.
  A tensor without a gradient this step sends ``c * beta1 * S * m / d``.  After the exchange
  ``p.grad = S * m_avg`` (``c`` and ``d`` multiplied out), which a ``GradScaler`` unscales and
  clipping may clip.
* **Increment** (``exchange_momentum_as="increment"``): ``beta1 * S * m``, the averaged momentum
  of the last update and the same on every rank, is left out of ``x`` and added after the
  exchange: each rank sends only its gradient's share ``c * (1 - beta1) * (±g + S * wd * p) / d``
  (zeros for a tensor without a gradient), and the compressor's error feedback then holds what
  the gradients lost, as PowerSGD's own recipe (error feedback on the gradient, momentum on the
  average) has it.  The default, ``"momentum"``, sends all of ``x`` (1-bit Adam's choice).
* **Update** (``step()``), per parameter with Adam state, with the group's current lr, betas,
  eps and weight decay: ``m = p.grad``; ``p *= 1 - lr * wd`` (AdamW); ``t += 1``;
  ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t_v) + eps)``, ``t_v`` the update
  that last wrote ``v``.  The optimizer's step pre/post hooks run around it as around the
  class's own step.
* **Refresh** (``variance_refresh_every=R``): on a growing interval (:func:`last_write`: the
  momentum phase's updates 1, 2, 4, ... below ``R``, then every ``R``-th) a step sends
  the plain gradient as the warm-up does (exactly, or as fp16 or 8-bit QSGD under
  ``compression_warmup_codec="fp16"`` or ``"qsgd"``; no coefficient, no error feedback) and
  updates ``m = beta1 m + (1 - beta1) g`` and ``v = beta2**k v + (1 - beta2**k) g**2``, the one
  sample standing for the ``k`` updates since the last write, so that ``v`` keeps the weights
  Adam's would have (``1 - beta2**t`` in all).  It costs about 32 / R bits per element, and
  32 bits for each of the log2(R) early refreshes (half of that as fp16, a quarter as QSGD).

Beyond Adam's two buffers per parameter this keeps one float per tensor (the coefficients) and
the compressor's error-feedback memory; ``d`` is computed where it is used, never kept.  The
elementwise work of each step (``x`` onto the wire, ``m_avg`` back from it, the update) is one
pass each of a fused kernel on contiguous fp32 CPU tensors (:mod:`mergecomp.kernels.frozen_adam`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from mergecomp.exchange.exchange import Exchange, resolve
from mergecomp.kernels import frozen_adam
from mergecomp.scheduler.online import SEARCHED, SchedulerConfig

__all__ = ["MomentumExchange", "SEARCH", "default_memory"]

OPTION = "exchange_momentum_after"
REFRESH_OPTION = "variance_refresh_every"
SEND_OPTION = "exchange_momentum_as"
#: what each rank puts on the wire in the momentum phase (:class:`MomentumExchange`'s ``send``)
SENDS = ("momentum", "increment")
#: Adam options the frozen-variance update does not implement, with the values it accepts
_UNSUPPORTED = {"amsgrad": (False,), "fused": (None, False), "capturable": (False,), "differentiable": (False,)}


#: ``groups="auto"``'s search with the momentum exchange, unless the user gives ``scheduler=``:
#: the configured compressor (by any scheme) on every group, never fp16 or uncompressed.  A group
#: sent exactly for a probe hands the momentum its whole error-feedback residual at once (with
#: a sign code several times the momentum's norm) and its memory starts again from zero when it
#: returns to the codec; on GPT-2 4x256 (batch 2, 2,000 steps) such probes left 1-bit SGD 25 %
#: behind the same search without them.
SEARCH = SchedulerConfig(codecs=tuple(c for c in SEARCHED if c not in ("fp16", "none")))


def last_write(n: int, every: Optional[int]) -> int:
    """The momentum-phase update (numbered from 1) that last wrote the variance at or before
    update ``n``; 0: the freeze.  With a refresh interval ``every`` the variance is refreshed on
    a growing interval, at updates 1, 2, 4, 8, ... (doubling while below ``every``), then at
    every multiple of ``every``: densely while the gradients still change fast after the
    warm-up, at ``every`` after that (0/1 Adam's observation that the variance settles)."""
    if every is None or n < 1:
        return 0
    return every * (n // every) if n >= every else 1 << (n.bit_length() - 1)


def refreshes(n: int, every: Optional[int]) -> int:
    """How many of the momentum phase's first ``n`` updates refresh the variance."""
    if every is None or n < 1:
        return 0
    return (min(n, every - 1).bit_length()) + n // every


def default_memory(compression: Any) -> Optional[str]:
    """The error-feedback memory ``memory=None`` means with this option: the compressor's default,
    but ``"residual"`` for a lossy compressor whose default is none (the unbiased quantizers
    ``qsgd`` and ``terngrad``, the casts).  Each step's averaged momentum, codec noise included,
    is the next step's starting point, so noise that no error feedback cancels accumulates: on
    GPT-2 4x256 (AdamW, 2,000 steps) 4-bit QSGD ended 84 % behind AdamW without a memory and
    0.66 % with the residual one, TernGrad 45 % and 1.15 %."""
    compressor, _ = resolve(compression, "none")
    return "residual" if compressor.default_memory == "none" and not compressor.lossless else None


def check_after(after: Any, option: str = OPTION) -> int:
    """``after``, a number of updates, when an int >= 1; ValueError naming ``option`` otherwise."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 1:
        raise ValueError(f"{option} must be an int >= 1, got {after!r}")
    return after


class MomentumExchange:
    """The momentum phase of one :class:`~frameworks.torch.optimizer.DistributedOptimizer`
    (see the module docstring).

    Args:
        optimizer: the Adam or AdamW being wrapped (its ``param_groups`` and ``state`` are read
            at each use: ``load_state_dict`` may replace them).
        params: the exchanged parameters, by tensor index.
        after: ``K``, the number of warm-up updates.
        exchange: the optimizer's (its compressor and memory: a majority vote cannot carry an
            average momentum, DGC's memory would apply momentum to it again; its memories start
            afresh when the variance freezes).
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, or None.
        send: ``"momentum"`` (this rank's whole momentum ``x``) or ``"increment"`` (only its
            gradient's share; ``beta1 * m``, the same on every rank, added after the exchange).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: List[torch.nn.Parameter], after: Any,
                 exchange: Exchange, grad_scaler: Any = None,
                 refresh_every: Optional[int] = None, send: str = "momentum") -> None:
        if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
            raise ValueError(f"{OPTION} needs a torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
        check_after(after)
        if refresh_every is not None:
            check_after(refresh_every, REFRESH_OPTION)
        if send not in SENDS:
            raise ValueError(f"{SEND_OPTION} must be one of {SENDS}, got {send!r}")
        if exchange.compressor.votes:
            raise ValueError(f"{OPTION}: compressor {exchange.compressor.name!r} returns a majority vote, not the "
                             f"average the momentum needs; use 'efsignsgd' or 'onebit' for signs")
        if exchange.memory.name == "dgc":
            raise ValueError(f"{OPTION}: memory 'dgc' applies momentum to what it is given, which is Adam's "
                             f"momentum already; use memory='residual' or 'averaged'")
        for g, group in enumerate(optimizer.param_groups):
            for key, allowed in _UNSUPPORTED.items():
                if group.get(key, False) not in allowed:
                    raise ValueError(f"{OPTION} does not support {type(optimizer).__name__}({key}="
                                     f"{group[key]!r}) (parameter group {g})")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.optimizer = optimizer
        self.params = params
        self._exchanged = {id(p) for p in params}
        self.exchange = exchange
        self.after = after
        self.refresh_every = refresh_every
        self.grad_scaler = grad_scaler
        self.lossless = exchange.compressor.lossless
        #: the momentum goes on the wire divided by Adam's denominator (lossy codecs that are not
        #: low-rank: the update's own scale, in which one codec scale fits every element)
        self.preconditioned = not self.lossless and not exchange.compressor.low_rank
        #: only the gradient's share goes on the wire (a lossless exchange sends the momentum:
        #: the same average either way)
        self.increment = send == "increment" and not self.lossless
        #: updates applied so far (warm-up and momentum phase; skipped steps not counted)
        self.updates = 0
        #: per tensor index, once frozen (None before): the momentum's scaling for the wire
        self.coefficients: Optional[List[float]] = None
        self._step: Optional[Dict[str, Any]] = None  # this step's settings, from its first gradient

    @property
    def active(self) -> bool:
        """Whether the momentum phase is on (the variance frozen, or refreshed now and then)."""
        return self.coefficients is not None

    @property
    def _phase_update(self) -> int:
        """This update's number in the momentum phase (from 1; 0 or less during the warm-up)."""
        return self.updates - self.after + 1

    @property
    def refreshing(self) -> bool:
        """Whether this step refreshes the variance (:func:`last_write`), its gradients
        travelling exactly."""
        n = self._phase_update
        return self.active and n >= 1 and last_write(n, self.refresh_every) == n

    # -- backward: the gradient becomes this rank's momentum ---------------------------------
    def _settings(self) -> Dict[str, Any]:
        """This step's loss scale and each tensor's parameter group (read at its first gradient)."""
        if self._step is None:
            scaler = self.grad_scaler
            group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
            self._step = {"scale": scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0,
                          "groups": [group_of[id(p)] for p in self.params]}
        return self._step

    def local_momentum(self, i: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Tensor ``i``'s momentum on this rank, ``x`` (module docstring), written over ``grad``
        (None: the tensor got no gradient this step; a new tensor).  None for a parameter without
        Adam state (one Adam never stepped): it sends zeros and is not updated."""
        p = self.params[i]
        state = self.optimizer.state.get(p)
        if not state:
            return None
        settings = self._settings()
        group, scale = settings["groups"][i], settings["scale"]
        beta1 = group["betas"][0]
        momentum = state["exp_avg"]
        refreshing = self.refreshing  # the plain gradient: beta1, m and the wire scaling left out
        weight = 0.0 if self.increment else beta1 * scale  # of m in x
        if grad is None:
            if refreshing:
                return None
            return torch.zeros_like(momentum) if self.increment else self._to_wire(i, momentum * weight)
        mix = 1.0 if refreshing else 1 - beta1
        mix = -mix if group["maximize"] else mix
        if group["weight_decay"] and not self._decoupled(group):  # Adam's L2 term joins the gradient
            grad.mul_(mix).add_(p.detach(), alpha=mix * scale * group["weight_decay"])
            mix = 1.0
        if refreshing:
            return grad if mix == 1.0 else grad.mul_(mix)
        if self.preconditioned:
            return frozen_adam.momentum_to_wire(grad, momentum, state["exp_avg_sq"], mix, weight, group["eps"],
                                                self.coefficients[i])
        return self._to_wire(i, grad.mul_(mix) if self.increment else grad.mul_(mix).add_(momentum, alpha=weight))

    def _to_wire(self, i: int, momentum: torch.Tensor) -> torch.Tensor:
        """Tensor ``i``'s momentum as it goes on the wire, in place: ``c * m / d`` (``d`` Adam's
        denominator ``sqrt(v) + eps``); ``c * m`` for a low-rank codec; ``m`` for a lossless one."""
        if self.preconditioned:
            state, eps = self.optimizer.state[self.params[i]], self._settings()["groups"][i]["eps"]
            return frozen_adam.momentum_to_wire(momentum, momentum, state["exp_avg_sq"], 0.0, 1.0, eps,
                                                self.coefficients[i])
        return momentum if self.lossless else momentum.mul_(self.coefficients[i])

    def _denominator(self, i: int) -> torch.Tensor:
        """``d = sqrt(v) + eps`` of tensor ``i`` (a new tensor): the same on every rank while the
        variance is frozen, so dividing by it before the codec and multiplying after is exact."""
        group = self._settings()["groups"][i]
        return self.optimizer.state[self.params[i]]["exp_avg_sq"].sqrt().add_(group["eps"])

    def _decoupled(self, group: Dict[str, Any]) -> bool:
        """Whether ``group``'s weight decay is AdamW's (decoupled), not Adam's L2 term."""
        return group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))

    def finished(self, views: Optional[List[torch.Tensor]]) -> None:
        """The step's exchange finished: its results, ``views[i] = c * S * m_avg / d`` (as sent,
        :meth:`_to_wire`), become ``S * m_avg`` in place (None: a step skipped for NaN/Inf); with
        ``send="increment"`` the views hold the increments' average, to which ``S * beta1 * m``
        is added."""
        if views is not None and not self.lossless and not self.refreshing:
            settings = self._settings()
            for i, view in enumerate(views):
                state = self.optimizer.state.get(self.params[i])
                group = settings["groups"][i]
                if self.preconditioned and state:
                    frozen_adam.momentum_from_wire(view, state["exp_avg_sq"], group["eps"], self.coefficients[i])
                else:
                    view.div_(self.coefficients[i])
                if self.increment and state:
                    view.add_(state["exp_avg"], alpha=group["betas"][0] * settings["scale"])
        self._step = None

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self) -> None:
        """The frozen-variance Adam update from ``p.grad`` (the averaged momentum), for every
        exchanged parameter with Adam state and a gradient."""
        n, every, refreshing = self._phase_update, self.refresh_every, self.refreshing
        gap = n - last_write(n - 1, every)  # on a refresh: the updates it stands for
        stale = n - last_write(n, every)  # updates since the variance was last written: 0 on a refresh
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.optimizer.state.get(p)
                if not state or p.grad is None or id(p) not in self._exchanged:
                    continue
                momentum, variance = state["exp_avg"], state["exp_avg_sq"]
                averaged = p.grad
                if refreshing:  # p.grad: the averaged gradient, standing for the last `gap` updates
                    variance.mul_(beta2 ** gap).addcmul_(p.grad, p.grad, value=1 - beta2 ** gap)
                    averaged = momentum.lerp_(p.grad, 1 - beta1)
                step = float(state["step"]) + 1
                state["step"] += 1
                keep = 1 - lr * decay if decay and self._decoupled(group) else 1.0
                frozen_adam.frozen_update(p.detach(), averaged, momentum, variance, keep,
                                          math.sqrt(1 - beta2 ** (step - stale)), eps, -lr / (1 - beta1 ** step))

    def counted(self) -> None:
        """An update was applied (warm-up or momentum phase); the one that ends the warm-up
        freezes the variance."""
        self.updates += 1
        if self.updates == self.after:
            self._freeze()

    def _freeze(self) -> None:
        """The variance of an element that got no gradient in the warm-up (e.g. the embedding of
        a token not seen yet) becomes its tensor's mean (the mean over all tensors where its
        tensor's is zero), so that a later gradient, or a codec's error (a sign codec cannot send
        a zero), does not meet a denominator of ``eps``.  Each tensor's coefficient: the RMS of
        the whole momentum as it goes on the wire (``m / d``; ``m`` for a low-rank codec) over
        the RMS of its own (1 for a tensor without state or with a zero momentum, and for a
        lossless compressor).  Every rank computes the same: Adam's state is
        the same on every rank.  The error-feedback memories start afresh: their residuals are
        the gradients', not the momentum's."""
        self.exchange.clear_memories()
        variances = [state["exp_avg_sq"] for state in map(self.optimizer.state.get, self.params) if state]
        overall = sum(v.double().sum() for v in variances) / max(1, sum(v.numel() for v in variances))
        for variance in variances:  # an element without a gradient in the warm-up
            mean = variance.mean()
            variance.masked_fill_(variance == 0, torch.where(mean > 0, mean, overall.to(variance.dtype)))
        if self.lossless:
            self.coefficients = [1.0] * len(self.params)
            return
        squares, sizes = [], []
        for i, p in enumerate(self.params):
            state = self.optimizer.state.get(p)
            if not state:
                squares.append(torch.zeros((), dtype=torch.float64, device=p.device))
                sizes.append(0)
                continue
            wire = state["exp_avg"] / self._denominator(i) if self.preconditioned else state["exp_avg"]
            squares.append(wire.double().square().sum())
            sizes.append(p.numel())
        self._step = None
        squares = torch.stack(squares).cpu()
        sizes = torch.tensor(sizes, dtype=torch.float64)
        overall = (squares.sum() / sizes.sum().clamp(min=1)).sqrt()
        own = (squares / sizes.clamp(min=1)).sqrt()
        self.coefficients = torch.where(own > 0, overall / own, torch.ones_like(own)).tolist()

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The same on every rank: the warm-up length, updates so far, the coefficients."""
        return {OPTION: self.after, REFRESH_OPTION: self.refresh_every, "updates": self.updates,
                "coefficients": self.coefficients}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint saved without the option): the updates
        are Adam's step count, and a checkpoint past the warm-up freezes the variance now."""
        self._step = None
        if state is None:
            steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
            self.updates, self.coefficients = int(max(steps, default=0)), None
            if self.updates >= self.after:
                self._freeze()
            return
        self.updates = int(state["updates"])
        self.coefficients = None if state["coefficients"] is None else [float(c) for c in state["coefficients"]]
