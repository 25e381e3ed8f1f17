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
  a lossless one ``c = d = 1``.  Divided by ``d``, a value beyond :func:`wire_bound` (32 x
  Adam's own bound on ``|m| / sqrt(v)``, in units of ``c * S``) is brought back to it, its sign
  kept: an element whose variance decayed towards zero would otherwise set its group's codec
  scale for every other element.  ``x`` goes through the merged groups like any gradient:
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
  that last wrote ``v``, after ``v = max(v, (m / B)**2)``: Adam's own state keeps ``|m| <= B
  sqrt(v)`` (``B = (1 - beta1) / sqrt((1 - beta2) (1 - beta1**2 / beta2))``, Cauchy-Schwarz
  over the two averages of the same gradients), which a frozen variance the gradients have
  outgrown breaks (the updates then grow to thousands of times Adam's and the run diverges);
  raised to it, no element moves further in one update than Adam's would.  The optimizer's
  step pre/post hooks run around it as around the class's own step.
* **Refresh** (``variance_refresh_every=R``): on a growing interval (:func:`next_write`: the
  momentum phase's updates 1, 2, 4, ... below ``R``, then every ``R``-th) a step sends
  the plain gradient as the warm-up does (exactly, or as fp16, 8-bit or 4-bit QSGD under
  ``compression_warmup_codec="fp16"``, ``"qsgd"`` or ``"qsgd4"``; no coefficient, no error feedback) and
  updates ``m = beta1 m + (1 - beta1) g`` and ``v = beta2**k v + (1 - beta2**k) g**2``, the one
  sample standing for the ``k`` updates since the last write, so that ``v`` keeps the weights
  Adam's would have (``1 - beta2**t`` in all).  It costs about 32 / R bits per element, and
  32 bits for each of the log2(R) early refreshes (half of that as fp16, a quarter as QSGD).
  Where the gradients outgrow the frozen variance between two refreshes (Adam's bound below
  raised its total more than 1.5x), the interval halves, down to every update (each step's
  gradients then travel as the warm-up's), and doubles back to ``R`` once the variance holds
  (:meth:`MomentumExchange._watch`; logged).

Beyond Adam's two buffers per parameter this keeps one float per tensor (the coefficients) and
the compressor's error-feedback memory; ``d`` is computed where it is used, never kept.  The
elementwise work of each step (``x`` onto the wire, ``m_avg`` back from it, the update) is one
pass each of a fused kernel on contiguous fp32 CPU tensors (:mod:`mergecomp.kernels.frozen_adam`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.exchange.compatibility import MOMENTUM, refusal
from mergecomp.exchange.exchange import Exchange, resolve
from mergecomp.exchange.plan import Group
from mergecomp.kernels import frozen_adam
from mergecomp.kernels.frozen_adam import Segments
from mergecomp.pipeline.step import MergedStep, Reduced
from mergecomp.scheduler.online import SEARCHED, SchedulerConfig

from .momentum_state import GroupState

__all__ = ["LrWarmup", "MomentumExchange", "MomentumSettings", "SEARCH", "check_optimizer", "default_memory",
           "refusal_of", "refresh_limit", "scaler_skips", "sends_adam_gradients", "smallest_beta2",
           "warn_adam_gradients"]

logger = logging.getLogger("mergecomp")

OPTION = "exchange_momentum_after"
REFRESH_OPTION = "variance_refresh_every"
SEND_OPTION = "exchange_momentum_as"
#: the momentum exchange's options, as every front end names them
OPTIONS = (OPTION, REFRESH_OPTION, SEND_OPTION)
#: the key of the momentum exchange's state in a front end's state dict (the same on every rank)
STATE_KEY = "mergecomp_momentum"
#: what each rank puts on the wire in the momentum phase (:class:`MomentumExchange`'s ``send``)
SENDS = ("momentum", "increment")
#: Adam options the frozen-variance update does not implement, with the values it accepts
_UNSUPPORTED = {"amsgrad": (False,), "capturable": (False,), "differentiable": (False,)}


#: ``groups="auto"``'s search with the momentum exchange, unless the user gives ``scheduler=``:
#: the configured compressor (by any scheme) on every group, never fp16 or uncompressed.  A group
#: sent exactly for a probe hands the momentum its whole error-feedback residual at once (with
#: a sign code several times the momentum's norm) and its memory starts again from zero when it
#: returns to the codec; on GPT-2 4x256 (batch 2, 2,000 steps) such probes left 1-bit SGD 25 %
#: behind the same search without them.
SEARCH = SchedulerConfig(codecs=tuple(c for c in SEARCHED if c not in ("fp16", "none")))


#: :meth:`MomentumExchange._watch`: how far the bound may raise the variance's total between
#: refreshes before the refresh interval halves, and how little for it to double back (at most to
#: ``variance_refresh_every``).  On the 3-layer GPT-2 at lr 3e-3, clipped, 600 updates (1-bit SGD,
#: top-k and PowerSGD by their recipes) it raised it at most 1.0005x between any two refreshes.
STALE, CALM = 1.5, 1.1


#: :func:`wire_bound`: how many times Adam's own bound a value preconditioned for the wire may be.
#: Per rank it exceeds the bound where this rank's gradient is noisier than the average the
#: variance follows, or the variance is stale; on the 3-layer GPT-2 at lr 3e-3 (600 updates, 1-bit
#: SGD and top-k by their recipes) at most 13.3x with beta2 = 0.999, and up to 1e5x with
#: beta2 = 0.95, where a variance refreshed from gradients that carried next to nothing for an
#: element (a byte not seen for hundreds of updates) has decayed to 1e-20.
WIRE_BOUND = 32.0


#: the longest refresh interval, in time constants of Adam's variance (:func:`refresh_limit`): on
#: a 3-layer GPT-2 with beta2 = 0.95 (time constant 20 updates), 1-bit SGD's recipe with K = 150
#: ended 1.9 % behind AdamW refreshing every 32 updates and 1.2 % every 8 (seed 0; 6.8 % and 2.8 %
#: with K = 60)
REFRESH_SHARE = 0.4


def smallest_beta2(optimizer: Any) -> float:
    """The smallest ``beta2`` of ``optimizer``'s parameter groups (the fastest-moving variance);
    1.0 for None or an optimizer without betas."""
    return min((group["betas"][1] for group in getattr(optimizer, "param_groups", ()) if "betas" in group),
               default=1.0)


def refresh_limit(beta2: float) -> int:
    """The longest variance refresh interval that follows Adam's variance with ``beta2``:
    :data:`REFRESH_SHARE` of its time constant ``1 / (1 - beta2)`` (8 for 0.95, 400 for 0.999)."""
    return max(1, math.ceil(REFRESH_SHARE / (1 - beta2))) if beta2 < 1 else 1 << 30


def wire_bound(beta1: float, beta2: float, increment: bool) -> float:
    """The largest ``|x| / (c * S)`` a preconditioned wire value keeps (beyond it, it is brought
    back to it, its sign kept): :data:`WIRE_BOUND` x what Adam's own state never exceeds, ``|m|
    <= B sqrt(v)`` (:func:`~mergecomp.kernels.frozen_adam.inv_bound2`), or for the increment
    ``(1 - beta1) |g| <= (1 - beta1) sqrt(v / (1 - beta2))``; +Inf where Adam has no such bound.
    Beyond it a value would set the shared scale of its group's codec (a sign code's mean,
    TernGrad's maximum, top-k's fp16 range) for every other element, where the update itself
    could not use it: Adam's bound caps that element's update at ``B`` either way."""
    if increment:
        bound = (1 - beta1) / math.sqrt(1 - beta2) if beta2 < 1 else math.inf
    else:
        inverse = frozen_adam.inv_bound2(beta1, beta2)
        bound = 1 / math.sqrt(inverse) if inverse else math.inf
    return WIRE_BOUND * bound


def next_write(written: int, every: Optional[int]) -> Optional[int]:
    """The momentum-phase update (numbered from 1) that next writes the variance after update
    ``written`` (0: the freeze), refreshing every ``every`` updates (None: never).  The interval
    grows: updates 1, 2, 4, 8, ... (doubling while below ``every``), then every ``every``-th:
    densely while the gradients still change fast after the warm-up, at ``every`` after that
    (0/1 Adam's observation that the variance settles)."""
    if every is None:
        return None
    return max(1, min(2 * written, every)) if written < every else written + every


def _every(interval: int) -> str:
    return "every update" if interval == 1 else f"every {interval} updates"


def scheduled_write(n: int, every: Optional[int]) -> int:
    """The last of :func:`next_write`'s updates at or before ``n`` (0: the freeze), the interval
    left at ``every`` throughout (a checkpoint that did not record its last write)."""
    written = 0
    while every is not None and next_write(written, every) <= n:
        written = next_write(written, every)
    return written


def default_memory(compression: Any) -> Optional[str]:
    """The error-feedback memory ``memory=None`` means with this option: the compressor's default,
    but ``"residual"`` for a lossy compressor whose default is none (the unbiased quantizers
    ``qsgd`` and ``terngrad``, the casts).  Each step's averaged momentum, codec noise included,
    is the next step's starting point, so noise that no error feedback cancels accumulates: on
    GPT-2 4x256 (AdamW, 2,000 steps) 4-bit QSGD ended 84 % behind AdamW without a memory and
    0.66 % with the residual one, TernGrad 45 % and 1.15 %."""
    compressor, _ = resolve(compression, "none")
    return "residual" if compressor.default_memory == "none" and not compressor.lossless else None


def _without(state: GroupState, absent: Set[int]) -> Segments:
    """``state``'s segments with the tensors ``absent`` (indices) inactive for one update."""
    keep = [i not in absent for i in state.group.indices]
    active = state.segments.active * torch.tensor(keep, dtype=torch.uint8)
    bundles = [[s for s in bundle if keep[s]] for bundle in state.segments.bundles]
    return Segments(state.segments.offsets, state.segments.lengths, active, [b for b in bundles if b])


def check_after(after: Any, option: str = OPTION) -> int:
    """``after``, a number of updates, when an int >= 1; ValueError naming ``option`` otherwise."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 1:
        raise ValueError(f"{option} must be an int >= 1, got {after!r}")
    return after


#: the compression warm-up of the merged step while :class:`LrWarmup` has not decided: until the
#: freeze ends it (:meth:`MomentumExchange.begin_step`)
UNTIL_FROZEN = 1 << 62


@dataclasses.dataclass(frozen=True)
class LrWarmup:
    """``K`` decided as the run goes, from the learning rate the optimizer's steps use: the
    warm-up ends at the first update after every parameter group's lr stopped rising (an update
    whose lr is nowhere above the one before), and lasts at least ``shortest`` updates and
    ``share`` x the LR warm-up (the last update whose lr rose).  Every rank decides the same:
    from ``shortest`` on, each update takes the largest ``K`` any rank wants
    (:meth:`MomentumExchange.counted`).  A warm-up of steps (an lr held for a few updates, then
    raised) ends at its first hold."""

    share: float
    shortest: int

    def __post_init__(self) -> None:
        check_after(self.shortest, "LrWarmup.shortest")
        if not self.share >= 0:
            raise ValueError(f"LrWarmup.share must be >= 0, got {self.share!r}")

    def warmup(self, rose: int) -> int:
        """``K`` for an LR warm-up whose lr last rose at update ``rose`` (0: never)."""
        return max(self.shortest, math.ceil(self.share * rose))


@dataclasses.dataclass(frozen=True)
class MomentumSettings:
    """The momentum exchange's options, as every front end takes them (checked in one place:
    :meth:`create`): ``after`` (``exchange_momentum_after``: ``K``, or :class:`LrWarmup` to
    decide it from the learning rate), ``refresh_every`` (``variance_refresh_every``), ``send``
    (``exchange_momentum_as``)."""

    after: Union[int, LrWarmup]
    refresh_every: Optional[int] = None
    send: str = "momentum"
    #: the options ``exchange_momentum_after="auto"`` chose, not the user
    #: (:func:`~frameworks.torch.momentum_recipes.adapt` sets them to the optimizer)
    chosen: Tuple[str, ...] = ()
    #: the compressor whose recipe chose them (None: none did)
    recipe: Optional[str] = None

    @classmethod
    def create(cls, after: Any = None, refresh_every: Any = None, send: Any = None,
               grad_scaler: Any = None, chosen: Tuple[str, ...] = (),
               recipe: Optional[str] = None) -> Optional["MomentumSettings"]:
        """The settings, or None without ``after`` (then the others must be left unset; ``send``
        None: ``"momentum"``); ``chosen``: the options ``recipe``'s recipe chose.
        ValueError/TypeError naming the option."""
        if after is None:
            given = [name for name, value in (("grad_scaler", grad_scaler), (REFRESH_OPTION, refresh_every),
                                              (SEND_OPTION, send)) if value is not None]
            if given:
                raise ValueError(f"{given[0]} is only used with {OPTION} (it configures the momentum exchange)")
            return None
        if not isinstance(after, LrWarmup):
            check_after(after)
        if refresh_every is not None:
            check_after(refresh_every, REFRESH_OPTION)
        send = "momentum" if send is None else send
        if send not in SENDS:
            raise ValueError(f"{SEND_OPTION} must be one of {SENDS}, got {send!r}")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        return cls(after, refresh_every, send, tuple(chosen), recipe)

    def agreed(self) -> Tuple[Tuple[str, Any], ...]:
        """The options every rank must give alike, by name."""
        return ((OPTION, self.after), (REFRESH_OPTION, self.refresh_every), (SEND_OPTION, self.send))

    def defaults(self, compression: Any, memory: Any) -> Tuple[Dict[str, Any], Any]:
        """The step options this exchange changes the defaults of (a lossless warm-up of
        ``after`` steps, the search of :data:`SEARCH`), and the memory ``memory`` None means
        (:func:`default_memory`)."""
        warmup = UNTIL_FROZEN if isinstance(self.after, LrWarmup) else self.after
        return ({"compression_warmup_steps": warmup, "scheduler": SEARCH},
                default_memory(compression) if memory is None else memory)


def sends_adam_gradients(optimizer: Any, compressor: Compressor, memory: Memory) -> bool:
    """Whether ``optimizer`` is an Adam or AdamW whose gradients ``compressor`` would send lossily
    with ``memory``'s error feedback: Adam's division by its second moment turns the feedback's
    late bursts into full-size steps, and such runs end far behind uncompressed Adam (README:
    1-bit SGD +48 %, top-k +28 % on the byte-level GPT-2)."""
    return isinstance(optimizer, torch.optim.Adam) and not compressor.lossless and memory.feeds_back


def warn_adam_gradients(optimizer: Any, compressor: Compressor, memory: Memory, who: str) -> None:
    """Warn (``UserWarning``, naming ``who`` and the line to add) where :func:`sends_adam_gradients`.
    Not an error and no silent change: the user's choice stands."""
    if sends_adam_gradients(optimizer, compressor, memory):
        warnings.warn(f"{who}: {compressor.name!r} with error feedback on {type(optimizer).__name__}'s gradients "
                      f"ends far behind uncompressed {type(optimizer).__name__}; exchange its momentum instead: add "
                      f"{OPTION}='auto' (the compressor's recipe) or {OPTION}=K (K: at least the LR warm-up's "
                      f"updates)", UserWarning, stacklevel=3)


def refusal_of(optimizer: Any, compressor: Compressor, memory: Memory) -> Optional[str]:
    """Why the momentum exchange cannot serve ``optimizer`` (an Adam or AdamW without the options
    it does not implement) with ``compressor`` and ``memory``, naming the option; None if it can."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
        return f"{OPTION} needs a torch.optim.Adam or AdamW, got {type(optimizer).__name__}"
    why = refusal(compressor, MOMENTUM, memory.name)
    if why is not None:
        return f"{OPTION}: {MOMENTUM} cannot carry {why}"
    for g, group in enumerate(optimizer.param_groups):
        for key, allowed in _UNSUPPORTED.items():
            if group.get(key, False) not in allowed:
                return (f"{OPTION} does not support {type(optimizer).__name__}({key}={group[key]!r}) "
                        f"(parameter group {g})")
    return None


def scaler_skips(optimizer: Any, grad_scaler: Any) -> bool:
    """Whether the ``torch.amp.GradScaler`` stepping ``optimizer`` found Inf/NaN in this step's
    gradients.  Only an optimizer that unscales its gradients itself (a fused Adam) is stepped
    through then: the scaler hands it ``grad_scale`` and ``found_inf`` as attributes and its
    step leaves every parameter as it was.  One host read where ``found_inf`` is set (the
    scaler reads it too when it skips the step of any other optimizer).  ValueError where a
    scaler hands them but the momentum exchange's ``grad_scaler`` is None: the momentum would
    go on the wire out of the gradients' loss scale."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return False
    if grad_scaler is None:
        raise ValueError(f"{OPTION}: a torch.amp.GradScaler steps this {type(optimizer).__name__}, but the momentum "
                         f"exchange was not given it: pass grad_scaler=scaler (the momentum goes on the wire in the "
                         f"gradients' loss scale)")
    return bool(found_inf)


def check_optimizer(optimizer: torch.optim.Optimizer, exchange: Exchange) -> None:
    """ValueError with :func:`refusal_of`'s reason where the momentum exchange cannot serve
    ``optimizer`` with ``exchange``'s compressor and memory."""
    why = refusal_of(optimizer, exchange.compressor, exchange.memory)
    if why is not None:
        raise ValueError(why)


class MomentumExchange:
    """The momentum phase of one :class:`~frameworks.torch.optimizer.DistributedOptimizer`
    (see the module docstring).

    Args:
        optimizer: the Adam or AdamW whose ``param_groups`` and ``state`` it reads and writes
            (at each use: ``load_state_dict`` may replace them).
        params: the exchanged parameters, by tensor index.
        settings: :class:`MomentumSettings` (``K``, the number of warm-up updates; the refresh
            interval; ``send``: ``"momentum"``, this rank's whole momentum ``x``, or
            ``"increment"``, only its gradient's share, ``beta1 * m``, the same on every rank,
            added after the exchange).
        exchange: the front end's (its compressor and memory, :func:`check_optimizer`; its
            memories start afresh when the variance freezes).
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, or None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: List[torch.nn.Parameter],
                 settings: MomentumSettings, exchange: Exchange, grad_scaler: Any = None) -> None:
        check_optimizer(optimizer, exchange)
        self.optimizer = optimizer
        self.params = params
        self.exchange = exchange
        #: ``K``, the warm-up's updates (None while :attr:`follow` has not decided it)
        self.after: Optional[int] = None if isinstance(settings.after, LrWarmup) else settings.after
        #: how ``K`` is decided from the learning rate (None: given)
        self.follow: Optional[LrWarmup] = settings.after if isinstance(settings.after, LrWarmup) else None
        #: the LR warm-up as seen so far (:meth:`_lr_warmup`): each parameter group's last lr, the
        #: last update whose lr rose, whether it stopped rising
        self._lrs: Optional[List[float]] = None
        self._rose, self._lr_warmup_over = 0, False
        #: ``variance_refresh_every`` as given (None: never refreshed), and the interval now: halved
        #: while the gradients outgrow the frozen variance, doubled back once they stop (:meth:`_watch`)
        self.refresh_every = self.refresh_interval = settings.refresh_every
        #: the momentum-phase update that last wrote the variance (0: the freeze), and the
        #: refreshes sent so far (each one step's gradients at the refreshes' codec)
        self.written_at, self.refreshes = 0, 0
        self.grad_scaler = grad_scaler
        send = settings.send
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
        self._step: Optional[Dict[str, Any]] = None  # this step's settings, from its first group
        #: the momentum phase's state, flat per merged group, by group name
        self._groups: Dict[str, GroupState] = {}
        self._result: Optional[Reduced] = None  # the last exchange's result, for the update
        self._nonfinite = False  # the last exchange held NaN/Inf: its update is skipped
        #: the variance's total when a refresh last wrote it, and that update (:meth:`_watch`)
        self._written: Optional[Tuple[float, int]] = None
        self._warned_stale = False

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
        """Whether this step refreshes the variance (:func:`next_write`), its gradients
        travelling exactly."""
        return self.active and self._phase_update == next_write(self.written_at, self.refresh_interval)

    # -- a group about to start: its gradients become this rank's momentum ----------------------
    def _settings(self) -> Dict[str, Any]:
        """This step's loss scale and each parameter group's constants (read at its first group)."""
        if self._step is None:
            scaler = self.grad_scaler
            groups = self.optimizer.param_groups
            self._step = {"scale": scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0,
                          "beta1": [g["betas"][0] for g in groups], "eps": [g["eps"] for g in groups],
                          "sign": [-1.0 if g["maximize"] else 1.0 for g in groups],
                          "decay": [g["weight_decay"] for g in groups],
                          "l2": [bool(g["weight_decay"]) and not self._decoupled(g) for g in groups],
                          "wire_bound": [wire_bound(*g["betas"], self.increment) if self.preconditioned else math.inf
                                         for g in groups]}
        return self._step

    def _state(self, group: Group) -> GroupState:
        """``group``'s :class:`GroupState`, taken over from the optimizer's state when the group
        is new (a plan changed, or the state was loaded)."""
        held = self._groups.get(group.name)
        if held is None or held.group != group:
            group_of = {id(p): j for j, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
            held = self._groups[group.name] = GroupState(group, self.params, self.optimizer.state, group_of,
                                                         self.coefficients)
        return held

    def begin_step(self, merged: MergedStep) -> None:
        """A step's first gradient is final: in the momentum phase ``merged``'s groups become this
        rank's momentum before they start (:meth:`to_wire`), and a refresh sends them exactly;
        a compression warm-up left running by an undecided ``K`` ends (:data:`UNTIL_FROZEN`)."""
        if self.active and merged.warmup_steps > merged.step:
            merged.end_warmup()
        merged.exact = self.active and self.refreshing
        merged.before_start = self.to_wire if self.active else None

    def to_wire(self, g: int, group: Group, flat: torch.Tensor, missing: Sequence[int]) -> Optional[bool]:
        """Before ``group`` starts (:attr:`PlannedStep.before_start`): its gradients in ``flat``
        (zeros for the tensors ``missing`` a gradient) become this rank's momentum as it goes on
        the wire, ``x`` (module docstring), in one pass, which tells whether every value is
        finite (None where it cannot); on a refresh, the plain gradient (its sign flipped under
        ``maximize``, Adam's L2 term added)."""
        state, settings = self._state(group), self._settings()
        scale, refreshing = settings["scale"], self.refreshing
        mix = [sign * (1.0 if refreshing else 1 - beta1) for sign, beta1 in zip(settings["sign"], settings["beta1"])]
        if any(settings["l2"]):  # Adam's L2 term joins the gradients that arrived (torch's order: g * mix + p * ...)
            self._add_l2(state, flat, mix, scale, missing)
            mix = [1.0 if l2 else m for l2, m in zip(settings["l2"], mix)]
        if refreshing:
            if all(m == 1.0 for m in mix):
                return None
            return frozen_adam.momentum_to_wire(flat, state.momentum, state.variance, state.segments,
                                                state.per_group(mix), state.per_group([0.0] * len(mix)),
                                                state.per_group(settings["eps"]), state.per_group([1.0] * len(mix)),
                                                state.per_group([math.inf] * len(mix)), divide=False)
        weight = [0.0 if self.increment else beta1 * scale for beta1 in settings["beta1"]]
        limit = state.coefficient * state.per_group([scale * bound for bound in settings["wire_bound"]])
        return frozen_adam.momentum_to_wire(flat, state.momentum, state.variance, state.segments, state.per_group(mix),
                                            state.per_group(weight), state.per_group(settings["eps"]),
                                            state.coefficient, limit, divide=self.preconditioned)

    def _add_l2(self, state: GroupState, flat: torch.Tensor, mix: List[float], scale: float,
                missing: Sequence[int]) -> None:
        """``g = g * mix + p * mix * S * wd`` for the active tensors of parameter groups with
        Adam's L2 decay that got a gradient."""
        settings, absent = self._settings(), set(missing)
        views = state.segments.views(flat)
        for bundle in state.segments.bundles:
            pg = int(state.pg[bundle[0]])
            if not settings["l2"][pg]:
                continue
            chosen = [s for s in bundle if state.group.indices[s] not in absent]
            grads = [views[s] for s in chosen]
            torch._foreach_mul_(grads, mix[pg])
            torch._foreach_add_(grads, [state.params[s].detach().view(-1) for s in chosen],
                                alpha=mix[pg] * scale * settings["decay"][pg])

    def _decoupled(self, group: Dict[str, Any]) -> bool:
        """Whether ``group``'s weight decay is AdamW's (decoupled), not Adam's L2 term."""
        return group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))

    def finished(self, reduced: Optional[Reduced]) -> None:
        """The step's exchange finished (``reduced`` None: a step skipped for NaN/Inf): in the
        momentum phase each group's result, ``c * S * m_avg / d`` (as sent, :meth:`to_wire`),
        becomes ``S * m_avg`` in place, in one pass; with ``send="increment"`` the results hold
        the increments' average, to which ``S * beta1 * m`` is added.  Outside it, nothing."""
        if not self.active:
            return
        self.refreshes += self.refreshing
        self._result = None
        self._nonfinite = reduced is not None and reduced.nonfinite
        if reduced is not None and not self._nonfinite:
            self._groups = {group.name: self._state(group) for group in reduced.groups}
            self._result = reduced
            if not self.lossless and not self.refreshing:
                settings = self._settings()
                weight = [beta1 * settings["scale"] if self.increment else 0.0 for beta1 in settings["beta1"]]
                for group, flat in zip(reduced.groups, reduced.flats):
                    state = self._groups[group.name]
                    frozen_adam.momentum_from_wire(flat, state.momentum, state.variance, state.segments,
                                                   state.coefficient, state.per_group(settings["eps"]),
                                                   state.per_group(weight), divide=self.preconditioned)
        self._step = None

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, grad_scale: Optional[torch.Tensor] = None) -> bool:
        """The frozen-variance Adam update from ``p.grad`` (the averaged momentum), for every
        exchanged parameter with Adam state and a gradient, one pass per group; ``grad_scale``:
        the loss scale ``p.grad`` is still in (what a ``GradScaler`` hands a fused Adam's step,
        :func:`scaler_skips`), divided out first.  Returns whether
        it ran: an exchange that held NaN/Inf on any rank (:attr:`Reduced.nonfinite`, the same on
        every rank) is not applied, whether the gradients or the exchange made it (a warning
        says so): the frozen variance and the momentum would keep the damage for good, where a
        ``GradScaler`` is not there to skip the step."""
        reduced, self._result = self._result, None
        if self._nonfinite:
            self._nonfinite = False
            logger.warning("%s: the momentum exchanged for update %d held NaN/Inf (the step's non-finite "
                           "gradient line names where): the update is skipped on every rank, Adam's state and "
                           "the parameters stay as they were", OPTION, self.updates + 1)
            return False
        if reduced is None:
            return False
        n, refreshing = self._phase_update, self.refreshing
        gap = n - self.written_at  # on a refresh: the updates it stands for
        stale = 0 if refreshing else gap  # updates since the variance was last written
        groups = self.optimizer.param_groups
        views = reduced.tensors(len(self.params))
        replaced = [i for i, (p, view) in enumerate(zip(self.params, views)) if p.grad is not view]
        copied = [i for i in replaced if self.params[i].grad is not None]
        if copied:  # p.grad replaced since the exchange (or a copy of it, DDP's): its values
            torch._foreach_copy_([views[i] for i in copied], [self.params[i].grad for i in copied])
        if grad_scale is not None:
            for flat in reduced.flats:
                flat.div_(grad_scale)
        if refreshing:
            self._watch(n)
        for group, flat in zip(reduced.groups, reduced.flats):
            state = self._groups[group.name]
            segments = state.segments
            if any(self.params[i].grad is None for i in replaced if i in group.indices):
                segments = _without(state, {i for i in replaced if self.params[i].grad is None})
            averaged = flat
            if refreshing:  # p.grad: the averaged gradient, standing for the last `gap` updates
                self._refresh(state, segments, flat, gap)
                averaged = state.momentum
            state.count_update(segments)
            keep = [1 - g["lr"] * g["weight_decay"] if g["weight_decay"] and self._decoupled(g) else 1.0
                    for g in groups]
            frozen_adam.frozen_update(
                state.params, averaged, state.momentum, state.variance, segments, state.per_group(keep),
                state.per_step(lambda pg, t: math.sqrt(1 - groups[pg]["betas"][1] ** (t - stale))),
                state.per_group([g["eps"] for g in groups]),
                state.per_step(lambda pg, t: -groups[pg]["lr"] / (1 - groups[pg]["betas"][0] ** t)),
                state.per_group([frozen_adam.inv_bound2(*g["betas"]) for g in groups]))
        if refreshing:
            self._written, self.written_at = (self._variance_total(), n), n
        return True

    def _variance_total(self) -> float:
        return sum(float(state.variance.sum(dtype=torch.float64)) for state in self._groups.values())

    def _watch(self, n: int) -> None:
        """Before the refresh of phase update ``n``: where, since the last refresh, the floor of
        Adam's bound (:func:`~mergecomp.kernels.frozen_adam.inv_bound2`) raised the variance's
        total by more than :data:`STALE` (the gradients outgrew it between refreshes), the
        refresh interval halves, down to every update; where by at most :data:`CALM`, a halved
        one doubles back, up to ``variance_refresh_every``.  Each change is logged, the first
        halving as a warning.  The same on every rank: the variance is."""
        written, self._written = self._written, None
        if written is None or not written[0]:
            return
        raised, interval = self._variance_total() / written[0], self.refresh_interval
        between = f"between updates {written[1] + self.after} and {n + self.after}"
        if raised > STALE and interval > 1:
            self.refresh_interval = interval // 2
            (logger.info if self._warned_stale else logger.warning)(
                "%s: the gradients outgrew the frozen variance %s: Adam's bound on the update raised it %.1fx; "
                "refreshed now, and %s from here (was %d) while they keep outgrowing it", OPTION, between, raised,
                _every(self.refresh_interval), interval)
            self._warned_stale = True
        elif raised <= CALM and interval < self.refresh_every:
            self.refresh_interval = min(2 * interval, self.refresh_every)
            logger.info("%s: the frozen variance held %s: refreshed %s from here (was %d)", OPTION, between,
                        _every(self.refresh_interval), interval)

    def _refresh(self, state: GroupState, segments: Segments, grad: torch.Tensor, gap: int) -> None:
        """``v = beta2**gap v + (1 - beta2**gap) g**2`` and ``m = m + (1 - beta1) (g - m)``, the
        averaged gradient ``g`` standing for ``gap`` updates, over the active segments."""
        g, m, v = segments.views(grad), segments.views(state.momentum), segments.views(state.variance)
        for bundle in segments.bundles:
            beta1, beta2 = self.optimizer.param_groups[int(state.pg[bundle[0]])]["betas"]
            gs, vs = [g[s] for s in bundle], [v[s] for s in bundle]
            torch._foreach_mul_(vs, beta2 ** gap)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2 ** gap)
            torch._foreach_lerp_([m[s] for s in bundle], gs, 1 - beta1)

    def counted(self) -> None:
        """An update was applied (warm-up or momentum phase); the one that ends the warm-up
        freezes the variance."""
        self.updates += 1
        if self.after is None:
            self.after = self._lr_warmup()
        if self.updates == self.after:
            self._freeze()

    def _lr_warmup(self) -> Optional[int]:
        """:attr:`follow`'s ``K`` once decided (at least this update: a later one would be the
        past), else None.  Reads each parameter group's lr (that of the update just applied);
        from :attr:`LrWarmup.shortest` on, one allgather of an int per update until every rank
        wants a ``K``, the largest then taken on every rank."""
        if not self._lr_warmup_over:
            lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
            if self._lrs is not None:
                if any(new > old for new, old in zip(lrs, self._lrs)):
                    self._rose = self.updates
                else:
                    self._lr_warmup_over = True
            self._lrs = lrs
        if self.updates < self.follow.shortest:
            return None
        wanted = self.follow.warmup(self._rose) if self._lr_warmup_over else UNTIL_FROZEN
        comm = self.exchange.comm
        agreed = int(comm.allgather(torch.tensor([wanted], dtype=torch.int64, device=comm.device),
                                    f"{OPTION}='auto': the LR warm-up's end").max())
        if agreed == UNTIL_FROZEN:
            return None
        after = max(agreed, self.updates)
        logger.info("%s: the learning rate last rose at update %d; the warm-up ends after update %d (at least %d "
                    "updates, %.1f x the LR warm-up)", OPTION, self._rose, after, self.follow.shortest,
                    self.follow.share)
        return after

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
        self._groups, self._step = {}, None
        self._warn_refresh()
        variances = [state["exp_avg_sq"] for state in map(self.optimizer.state.get, self.params) if state]
        overall = sum(v.double().sum() for v in variances) / max(1, sum(v.numel() for v in variances))
        for variance in variances:  # an element without a gradient in the warm-up
            mean = variance.mean()
            variance.masked_fill_(variance == 0, torch.where(mean > 0, mean, overall.to(variance.dtype)))
        if self.lossless:
            self.coefficients = [1.0] * len(self.params)
            return
        squares, sizes = [], []
        eps = {id(p): g["eps"] for g in self.optimizer.param_groups for p in g["params"]}
        for p in self.params:
            state = self.optimizer.state.get(p)
            if not state:
                squares.append(torch.zeros((), dtype=torch.float64, device=p.device))
                sizes.append(0)
                continue
            momentum = state["exp_avg"]
            wire = momentum / state["exp_avg_sq"].sqrt().add_(eps[id(p)]) if self.preconditioned else momentum
            squares.append(wire.double().square().sum())
            sizes.append(p.numel())
        squares = torch.stack(squares).cpu()
        sizes = torch.tensor(sizes, dtype=torch.float64)
        overall = (squares.sum() / sizes.sum().clamp(min=1)).sqrt()
        own = (squares / sizes.clamp(min=1)).sqrt()
        self.coefficients = torch.where(own > 0, overall / own, torch.ones_like(own)).tolist()

    def _warn_refresh(self) -> None:
        """At the freeze: a logged warning when the variance is refreshed less often than
        :func:`refresh_limit` of the smallest ``beta2`` (or never): Adam's own follows the
        gradients faster than that."""
        beta2 = smallest_beta2(self.optimizer)
        limit = refresh_limit(beta2)
        if self.refresh_every is None or self.refresh_every > limit:
            every = "never refreshed" if self.refresh_every is None else f"refreshed every {self.refresh_every} updates"
            logger.warning("%s: Adam's variance with beta2=%s follows about the last %.0f gradients; %s, the frozen "
                           "one falls behind it and costs accuracy: %s=%d or less follows it (docs/compressors.md)",
                           OPTION, beta2, 1 / (1 - beta2), every, REFRESH_OPTION, limit)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The same on every rank: the warm-up length (None while undecided), updates so far, the
        coefficients, the refresh interval now, the variance's last write (and its total, which
        the next refresh compares with) and the refreshes sent; with :attr:`follow`, the LR
        warm-up as seen so far."""
        state = {OPTION: self.after, REFRESH_OPTION: self.refresh_every, "updates": self.updates,
                 "coefficients": self.coefficients, "refresh_interval": self.refresh_interval,
                 "variance_written": self.written_at, "refreshes": self.refreshes,
                 "variance_total_written": None if self._written is None else self._written[0]}
        if self.follow is not None:
            state["lr_warmup"] = {"lrs": self._lrs, "rose": self._rose, "over": self._lr_warmup_over}
        return state

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint saved without the option): the updates
        are Adam's step count, and a checkpoint past the warm-up freezes the variance now (with
        :attr:`follow`, ``K`` is decided afresh from the learning rate from here on).  The
        optimizer's state was loaded before: each group takes it over at its next use."""
        self._step, self._groups, self._result, self._written = None, {}, None, None
        if self.follow is not None:
            self.after = None if state is None else state[OPTION]
            seen = {} if state is None else state.get("lr_warmup") or {}
            self._lrs, self._rose, self._lr_warmup_over = seen.get("lrs"), seen.get("rose", 0), seen.get("over", False)
        self.refresh_interval, self.written_at, self.refreshes = self.refresh_every, 0, 0
        if state is None:
            steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
            self.updates, self.coefficients = int(max(steps, default=0)), None
            if self.after is not None and self.updates >= self.after:
                self._freeze()
                self.written_at = self.updates - self.after
            return
        self.updates = int(state["updates"])
        self.coefficients = None if state["coefficients"] is None else [float(c) for c in state["coefficients"]]
        if "variance_written" in state:
            self.refresh_interval, self.written_at = state["refresh_interval"], int(state["variance_written"])
            self.refreshes = int(state["refreshes"])
            total = state["variance_total_written"]
            self._written = None if total is None else (float(total), self.written_at)
        elif self.coefficients is not None:  # saved before these were kept: the interval never changed
            self.written_at = scheduled_write(self.updates - self.after, self.refresh_every)
