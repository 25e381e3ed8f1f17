"""DistributedOptimizer: merged, compressed gradient exchange around any torch optimizer.

Lifecycle of one step (``backward_passes_per_step=1``)::

    loss.backward()
      └─ per parameter, when its gradient is accumulated (post-accumulate-grad hook):
         PlannedStep.add: nothing to copy where p.grad is its slot in its group's flat buffer
         (backward accumulated into the group), or, for a group of one tensor, where p.grad is
         sent as it lies; any other gradient is copied in (fp32 on CPU: checked for NaN/Inf in
         the same pass); a group whose last gradient arrived starts, in plan order:
         compensate -> compress -> async collective
      └─ the last parameter's hook: the exchange finishes (below), so when backward() returns
         p.grad holds the averaged gradients, as under DDP (clipping, logging, GradScaler)
    optimizer.step()
      └─ synchronize(), unless backward() finished the exchange: PlannedStep.finish (parameters
         without a gradient count as zeros; the ranks agree on non-finite gradients; each group
         is decoded and averaged where it was sent from); a p.grad that was copied in becomes a
         view of its slot
      └─ the wrapped optimizer class's own step() (timed: ``step_breakdown()``)
    optimizer.zero_grad()
      └─ one fill per group buffer: the slots stay p.grad (either ``set_to_none``), so the next
         backward accumulates into them again; a group encoded part by part (the sign codes on
         the CPU) is not filled and, under ``set_to_none=True``, its gradients are dropped: the
         next backward's are encoded where they lie

A step in which some parameter gets no gradient cannot know when backward ends (a gradient
may still come): its exchange finishes when ``step()``, ``synchronize()`` or a read of
``param_groups`` (a GradScaler's) needs it.

The result is an instance of a subclass of the wrapped optimizer's class (as Horovod builds it),
sharing that optimizer's ``param_groups``, ``state`` and hooks, so ``isinstance`` checks, LR
schedulers and torch's optimizer hooks see the optimizer they expect; mergecomp touches no
private attribute of torch's.

As under DDP's ``gradient_as_bucket_view=True``, ``p.grad`` is a view of the merged buffer
after the first step, and stays one across ``zero_grad()``: ``set_to_none=True`` zeroes it
instead of dropping it (the other parameters' gradients are set to None as usual), so a
parameter that gets no gradient in a step holds zeros, not None, until the exchange gives it
the other ranks' average.  A group whose gradients the compressor encodes where they lie (the
sign codes on the CPU: no pass writes them into the group) is the exception: there
``set_to_none=True`` drops them as torch does, sparing the fill and backward's accumulation
into the slots, and the result is a view of the buffer again after the exchange.  A gradient
replaced by the user's code (``p.grad = t``, or a module's ``zero_grad()`` setting it to None)
is copied in at its next step and counted (``copy-in``, :meth:`step_breakdown`), then a view
again.  Plans, the backward order, the
scheduler and checkpoints are :class:`mergecomp.pipeline.planned.PlannedStep`'s.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.compressors.memories import warn_double_momentum
from mergecomp.horovod_api.arguments import Average, check_horovod_args, resolve_groups, scaling
from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.exchange import resolve as resolve_compression
from mergecomp.horovod_api.process_sets import resolve as resolve_process_set
from mergecomp.horovod_api.runtime import communicator
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.planned import PlannedStep
from mergecomp.pipeline.step import HoldsMergedStep
from mergecomp.registry import Compression

from .loss_scale_check import UnscaleCheck
from .momentum_exchange import OPTION as MOMENTUM_OPTION
from .momentum_exchange import STATE_KEY as MOMENTUM_STATE
from .momentum_exchange import MomentumExchange, MomentumSettings, scaler_skips, warn_adam_gradients
from .momentum_recipes import adapt, momentum_by_default, settings_of
from .named_parameters import collect_parameters

__all__ = ["BY_DEFAULT", "DistributedOptimizer"]


class _ByDefault:
    """``exchange_momentum_after`` not given: :func:`~.momentum_recipes.momentum_by_default` decides."""

    def __repr__(self) -> str:
        return "<'auto' for an Adam whose gradients a lossy compressor with error feedback would send, else None>"


BY_DEFAULT = _ByDefault()


_CLASSES: Dict[type, type] = {}


def _inherited(cls: type, name: str) -> Any:
    """The attribute ``name`` as ``cls`` defines or inherits it (from its class dictionaries)."""
    return next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__)


def _distributed_class(base: type) -> type:
    """``base`` with :class:`DistributedOptimizer`'s methods first; same name and module."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (DistributedOptimizer, base), {"__module__": base.__module__})
    return _CLASSES[base]


class _Construction(NamedTuple):
    """What a :class:`DistributedOptimizer` builds its merged step from (:meth:`DistributedOptimizer.rebuild`)."""
    compression: Any
    memory: Any
    process_set: Any
    options: Dict[str, Any]
    groups: Any
    op: str
    factor: float
    momentum: Optional[MomentumSettings]
    grad_scaler: Any
    #: the momentum exchange was switched on by default, without ``grad_scaler``: :class:`UnscaleCheck`
    checks_scale: bool


class DistributedOptimizer(HoldsMergedStep):
    """Wrap ``optimizer`` so that gradients are merged, (optionally) compressed and averaged
    across ranks.  The positional arguments are Horovod's, in Horovod's order.

    The wrapped optimizer class's own ``step()`` does the update, so SGD with momentum, Adam,
    AdamW (weight decay) and LR schedulers behave as they do on one process (except in the
    momentum phase of ``exchange_momentum_after``, whose update is Adam's with the variance
    frozen or refreshed, :mod:`frameworks.torch.momentum_exchange`).  The object
    returned is an instance of the optimizer's class too (``isinstance(opt, torch.optim.SGD)``).

    Args:
        optimizer: any ``torch.optim.Optimizer``; its ``param_groups``, ``state`` and hooks are
            shared (use the returned optimizer from now on).
        named_parameters: ``model.named_parameters()``: names key the merge plan and error
            messages; it may name more parameters than the optimizer holds (only the
            optimizer's are exchanged).  Default: ``param.<i>`` in the optimizer's order.
        compression: ``mc.Compression.none`` (default: lossless), ``mc.Compression.fp16``, any
            compressor name (``mergecomp.compressor_names()``, ``mc.Compression.<name>``) or
            instance.
        backward_passes_per_step: gradients are accumulated locally over this many backward
            passes and exchanged once (see :meth:`set_backward_passes_per_step`).
        op: ``mc.Average`` (default) or ``mc.Sum`` over ranks (``mc.Adasum`` is not implemented).
        gradient_predivide_factor: with ``op=mc.Average``, gradients are divided by this factor
            before the sum and the sum is multiplied by ``factor / size``.
        num_groups: Horovod's older spelling of ``groups=<int>``.
        groups: merge plan: ``"auto"`` (default: the online scheduler searches the partition
            and each group's codec, see :mod:`mergecomp.scheduler.online`), ``"layerwise"``, an int
            ``k`` (k groups of about equal bytes), a list of lists of parameters or of their
            names, a :class:`~mergecomp.exchange.plan.GroupPlan`, or ``None`` (groups of about 25 MB,
            at most 4).
        sparse_as_dense: sparse gradients are always exchanged densely (and handed back to the
            optimizer sparse); True silences the warning.
        process_set: the ranks that exchange (a set from ``mc.add_process_set``; default all); a
            rank outside it steps on its own gradients, as under Horovod.
        memory: error-feedback memory name or instance; ``None`` = the compressor's default (with
            ``exchange_momentum_after``, ``"residual"`` where that default is none for a lossy
            compressor: ``momentum_exchange.default_memory``).
        exchange_momentum_after: for ``torch.optim.Adam`` or ``AdamW`` only (not given: ``"auto"``
            where the compressor is lossy with error feedback and has a recipe, with a logged
            warning; None: the gradients are exchanged): after this many
            updates (the warm-up, gradients exchanged as without it) Adam's variance freezes and
            each rank exchanges its momentum, not its gradient, through the same merged groups
            and compressor; ``p.grad`` then holds the averaged momentum, and the update is
            Adam's with the frozen variance (:mod:`frameworks.torch.momentum_exchange`; for
            compressed exchange with Adam, see docs/compressors.md).  With ``groups="auto"``
            the search then sends every group with the compressor (``momentum_exchange.SEARCH``)
            unless ``scheduler=`` says otherwise.  ``"auto"``: the compressor's recipe chooses
            K from the run (``total_steps=N``, its updates, or ``lr_warmup_steps=W``, its LR
            warm-up's; neither: from the learning rate, once it stops rising), the options below
            and the compressor's own settings when it is given by name (an option given stands;
            :mod:`frameworks.torch.momentum_recipes`).
        variance_refresh_every: with ``exchange_momentum_after``: every this many updates of the
            momentum phase, the gradients travel as in the warm-up (exactly, or as
            ``compression_warmup_codec`` says) and refresh the variance (as the last
            that many steps of Adam would have moved it); None: frozen for good.
        exchange_momentum_as: with ``exchange_momentum_after``: ``"momentum"`` (default: each
            rank sends its whole momentum, as 1-bit Adam does) or ``"increment"`` (only its
            gradient's share; the momentum's common part, the same on every rank, is added
            after the exchange: for PowerSGD, docs/compressors.md).
        grad_scaler: with ``exchange_momentum_after``, the ``torch.amp.GradScaler`` that scales
            the loss (the momentum is sent in the gradient's loss scale).  Switched on by default
            without it, the exchange raises ValueError at the first update where ``p.grad`` was
            divided before ``step()`` as a scaler's ``unscale_`` divides it
            (:mod:`frameworks.torch.loss_scale_check`).
        options: mergecomp's options by keyword (:class:`~mergecomp.pipeline.options.StepOptions`):
            ``nonfinite`` (default ``"propagate"``: when any rank's gradient holds NaN/Inf, every
            rank's averaged gradients become NaN, so ``torch.amp.GradScaler`` skips the same
            step everywhere, and error-feedback and compressor state are left as before the
            step; in a step of plain sums (a lossless compressor) nothing is checked: the sum
            carries the NaN/Inf to every rank; ``"skip"`` skips the step on every rank, counted
            in :attr:`skipped_steps`),
            ``scheduler``, ``compression_warmup_steps``, ``compression_warmup_codec``, ``uncompressed``,
            ``min_compress_numel``, ``scheme`` (see docs/compressors.md).

    After ``loss.backward()`` in which every parameter got its gradient, ``p.grad`` holds the
    averaged gradients (clip them, log them, or hand them to a ``GradScaler``'s plain recipe).
    Horovod's pattern (``opt.synchronize()``, clipping or ``scaler.unscale_(opt)``, then
    ``with opt.skip_synchronize(): opt.step()``) works too, and is the one to use when some
    parameters may get no gradient in a step.
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args, **kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already a mergecomp DistributedOptimizer")
        return object.__new__(_distributed_class(type(optimizer)) if cls is DistributedOptimizer else cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        compression: Union[str, Compressor] = Compression.none,
        backward_passes_per_step: int = 1,
        op: str = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups="auto",
        sparse_as_dense: bool = False,
        process_set: Any = None,
        *,
        memory: Union[str, Memory, None] = None,
        exchange_momentum_after: Union[int, str, None] = BY_DEFAULT,
        variance_refresh_every: Optional[int] = None,
        exchange_momentum_as: Optional[str] = None,
        grad_scaler: Any = None,
        **options,
    ) -> None:
        factor = check_horovod_args(op, gradient_predivide_factor)
        by_default = exchange_momentum_after is BY_DEFAULT
        if by_default:
            exchange_momentum_after = self._momentum_by_default(optimizer, compression, memory, op, grad_scaler)
        compression, options, momentum = settings_of(compression, options, exchange_momentum_after,
                                                     variance_refresh_every, exchange_momentum_as, grad_scaler,
                                                     "DistributedOptimizer")
        if momentum is not None:
            momentum = adapt(momentum, optimizer, "DistributedOptimizer")
        if momentum is not None and op != Average:
            raise ValueError(f"{MOMENTUM_OPTION} needs op=mc.Average (the momentum is averaged), got op={op!r}")
        self._check_passes(backward_passes_per_step)
        # The optimizer as torch built it (param_groups, state, defaults, hook registries), shared.
        self.__dict__.update(vars(optimizer))
        self._given = optimizer
        self._exchanged, self.param_names = collect_parameters(optimizer, named_parameters)
        name_by_id = {id(p): n for p, n in zip(self._exchanged, self.param_names)}
        groups = resolve_groups(groups, num_groups, lambda t: name_by_id[id(t)])
        self.backward_passes_per_step = backward_passes_per_step
        #: what builds the merged step, kept to build it again on another world (:meth:`rebuild`)
        self._construction = _Construction(compression, memory, process_set, dict(options), groups, op, factor,
                                           momentum, grad_scaler,
                                           by_default and momentum is not None and grad_scaler is None)
        self._build()
        self.merged.warn_sparse = not sparse_as_dense  # densified either way; True: silently
        warn_double_momentum(self.memory, any(g.get("momentum", 0) for g in optimizer.param_groups))
        self._index = {id(p): i for i, p in enumerate(self._exchanged)}  # the hooks' lookup, by identity
        #: the optimizer's parameters that are not exchanged (frozen ones), for zero_grad
        self._frozen = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in self._index]
        #: zero_grad() keeps the slots as gradients unless the optimizer class has its own
        self._keeps_views = _inherited(type(optimizer), "zero_grad") is _inherited(torch.optim.Optimizer, "zero_grad")
        self._warned_step = False
        self._should_synchronize = True
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._exchanged]

    @staticmethod
    def _momentum_by_default(optimizer: torch.optim.Optimizer, compression: Any, memory: Any, op: str,
                             grad_scaler: Any) -> Optional[str]:
        """``exchange_momentum_after`` where it was not given: ``"auto"`` or None
        (:func:`~.momentum_recipes.momentum_by_default`; the gradients, with its warning, under
        ``op=mc.Sum``, which the exchange refuses)."""
        who = "DistributedOptimizer"
        if op != Average:
            compressor, memory = resolve_compression(compression, memory)
            warn_adam_gradients(optimizer, compressor, memory, who)
            return None
        note = "" if grad_scaler is not None else "; with a torch.amp.GradScaler pass grad_scaler=scaler"
        return momentum_by_default(compression, memory, [optimizer], {}, who, note).get(MOMENTUM_OPTION)

    def set_grad_scaler(self, grad_scaler: Any) -> None:
        """Give the momentum exchange the ``torch.amp.GradScaler`` that scales the loss after
        construction (a framework's own, e.g. Lightning's precision plugin's), as ``grad_scaler=``
        would have, before the first step.  ValueError without the momentum exchange."""
        if self.momentum_exchange is None:
            raise ValueError(f"DistributedOptimizer: grad_scaler is for {MOMENTUM_OPTION}; the gradients are "
                             f"exchanged here and a GradScaler unscales them as they are")
        self._construction = self._construction._replace(grad_scaler=grad_scaler, checks_scale=False)
        self.momentum_exchange.grad_scaler = grad_scaler
        self._unscale_check = None

    def _build(self) -> None:
        """The merged step and the momentum phase on the world as it is now, no step begun."""
        how = self._construction
        # A rank outside the process set trains on its own gradients, as under Horovod.
        comm = resolve_process_set(how.process_set, "DistributedOptimizer", member=False).communicator \
            or LocalCommunicator(communicator().timeout)
        defaults, memory = {}, how.memory
        if how.momentum is not None:
            changed, memory = how.momentum.defaults(how.compression, memory)
            defaults.update(changed)
        step_options = StepOptions.create("DistributedOptimizer", dict(how.options), defaults=defaults,
                                          fixed={"groups": how.groups, **scaling(how.op, how.factor, comm.size)})
        momentum = how.momentum
        self.merged = PlannedStep(
            how.compression, memory, comm, self.param_names, [p.shape for p in self._exchanged],
            [p.dtype for p in self._exchanged], self._exchanged[0].device, step_options,
            FrontEnd("DistributedOptimizer", "parameters", in_place=True,
                     agree=(("backward_passes_per_step", self.backward_passes_per_step),
                            *(momentum.agreed() if momentum else ((MOMENTUM_OPTION, None),)))))
        #: the momentum phase (``exchange_momentum_after``), or None
        self.momentum_exchange = None if momentum is None else MomentumExchange(
            self._given, self._exchanged, momentum, self.merged.exchange, how.grad_scaler)
        self._unscale_check = UnscaleCheck("DistributedOptimizer", MOMENTUM_OPTION) if how.checks_scale else None
        self._passes = [0] * len(self._exchanged)
        self._final = 0  # parameters whose gradient is final for this step
        self._synchronized = self._step_skipped = self._called_synchronize = False
        #: backward() finished this step's exchange and nothing has taken its gradients yet
        self._unapplied = False

    def rebuild(self, state: Optional[Dict[str, Any]] = None) -> None:
        """Build the merged step again on the world as it is now, after ``mc.init()`` joined a
        world of other ranks (an elastic reset, :mod:`mergecomp.torch.elastic`), with the
        settings and the collectives of the construction (a worker that joins builds its
        optimizer then).  The step in progress, if any, is dropped with its gradients.
        ``state``: this optimizer's :meth:`state_dict` from before the reset (its last commit),
        carried over as this rank's own (:meth:`~mergecomp.pipeline.step.MergedStep.carry_over`;
        None: afresh); then every rank calls
        :meth:`~mergecomp.pipeline.step.MergedStep.rejoin`.  A process set other than the
        global one does not outlive its world: NotImplementedError."""
        if self._construction.process_set is not None:
            raise NotImplementedError("DistributedOptimizer.rebuild(): the optimizer exchanges over a process set, "
                                      "which ended with its world; elastic training exchanges over every rank")
        warn_sparse = self.merged.warn_sparse
        for p in self._exchanged:  # views of the old groups, or half a step's gradients
            p.grad = None
        self._build()
        self.merged.warn_sparse = warn_sparse
        if state is not None:
            self.load_state_dict({key: value for key, value in state.items() if key != "mergecomp"})
            self.merged.carry_over(state["mergecomp"])

    @staticmethod
    def _check_passes(n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {n!r}")

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Each exchanged parameter's name (:attr:`param_names`), under the attribute Horovod's
        optimizer keeps it in, which Horovod scripts read."""
        return dict(zip(self._exchanged, self.param_names))

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated per exchange (between steps, on every rank)."""
        self._check_passes(passes)
        if self.merged.in_flight or any(self._passes):
            raise RuntimeError("set_backward_passes_per_step() must be called between steps")
        self.backward_passes_per_step = passes

    # -- the merged step (exchange, compressor, memory, plan, groups, scheduler, skipped_steps) --
    def set_plan(self, plan) -> None:
        """Replace the merge plan between steps (a :class:`~mergecomp.exchange.plan.GroupPlan` or any
        ``groups`` spec); error-feedback and per-element compressor state move to the new
        groups.  Every rank must call it with the same plan at the same step."""
        self.merged.set_plan(plan)

    def schedule_report(self) -> Dict[str, Any]:
        """What the scheduler did: candidates with predicted and measured seconds per step, the
        chosen plan, search cost in steps.  Fixed plans report ``{"phase": "fixed"}``.  Under
        ``"breakdown"``: :meth:`step_breakdown`."""
        return self.merged.schedule_report()

    # -- backward -----------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._synchronized:  # the first gradient of a new step, whether or not step() ran
            self._synchronized = self._step_skipped = self._called_synchronize = self._unapplied = False
        i = self._index[id(p)]
        self._passes[i] += 1
        if self._passes[i] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradient of {self.param_names[i]!r} was computed {self._passes[i]} times before step(); "
                f"backward_passes_per_step={self.backward_passes_per_step}. Call optimizer.step() (or "
                f"synchronize()) after every {self.backward_passes_per_step} backward pass(es)")
        if self._passes[i] == self.backward_passes_per_step:
            if not self._final:
                self._begin_exchange()
            self.merged.add(i, p.grad)
            self._final += 1
            if self._final == len(self._exchanged):  # the step's last gradient: backward is over
                self._finish_exchange()
                self._unapplied = True

    # -- step ---------------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's ``param_groups``.  Read after ``backward()`` while this
        step's exchange is still in flight (some parameter got no gradient), they are returned
        once the exchange has finished, so whoever walks them to reach ``p.grad`` sees the
        averaged gradients: ``torch.amp.GradScaler``'s ``unscale_`` and ``step`` (the plain
        recipe unscales and checks for inf/NaN what is about to be applied, as under DDP).  Not
        to be read from inside the backward pass (an autograd hook)."""
        groups = self.__dict__["param_groups"]
        self.__dict__["_unapplied"] = False  # whoever reads them after backward() takes the gradients
        merged = self.__dict__.get("merged")
        if merged is not None and self._should_synchronize and not self._synchronized and merged.in_flight:
            self._finish_exchange()
        return groups

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups

    def synchronize(self) -> None:
        """Finish the exchange of this step's gradients and write the result into ``p.grad``
        (``backward()`` already did when every parameter got a gradient).

        Parameters that got no gradient this step contribute zeros.  Calling it again before
        the next backward pass does nothing; the next backward pass starts a new step whether
        or not :meth:`step` ran (e.g. when a ``GradScaler`` skipped it).  Then call ``step()``
        inside :meth:`skip_synchronize` (outside it, ``step()`` warns once).
        """
        self._finish_exchange()
        self._called_synchronize, self._unapplied = True, False

    def _begin_exchange(self) -> None:
        """This step's first gradient is final (:meth:`MomentumExchange.begin_step`)."""
        if self.momentum_exchange is not None:
            self.momentum_exchange.begin_step(self.merged)

    def _finish_exchange(self) -> None:
        if self._synchronized:
            return
        if not self._final:  # no gradient arrived: every tensor sends zeros (its decayed momentum)
            self._begin_exchange()
        self._passes = [0] * len(self._exchanged)
        self._final = 0
        reduced = self.merged.finish()  # raises under nonfinite="raise"
        self._synchronized = True
        self._step_skipped = reduced is None
        if self.momentum_exchange is not None:
            self.momentum_exchange.finished(reduced)
        if self._unscale_check is not None:
            self._unscale_check.finished(None if reduced is None or reduced.nonfinite else reduced.flats)
        views = None if reduced is None else reduced.tensors(len(self._exchanged))
        if views is not None:  # the results are in place but for the gradients that were moved
            for i in range(len(views)) if reduced.moved is None else reduced.moved:
                p, view = self._exchanged[i], views[i]
                if p.grad is not None and p.grad.is_sparse:  # exchanged densely, handed back as it came
                    p.grad = view.to_sparse()                # (SparseAdam refuses dense gradients)
                elif p.grad is not view:
                    p.grad = view

    @property
    def _momentum_phase(self) -> Optional[MomentumExchange]:
        """The momentum exchange while its phase is on (the variance frozen), else None."""
        momentum = self.momentum_exchange
        return momentum if momentum is not None and momentum.active else None

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`) and run the optimizer class's step.

        A ``closure`` is evaluated once, before the exchange, so its ``backward()`` is the one
        reduced (LBFGS-style repeated evaluation is not supported).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            if self._called_synchronize and not self._warned_step:
                self._warned_step = True
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(); the gradients are not exchanged again. Wrap step() in "
                              "skip_synchronize() after an explicit synchronize()", UserWarning, stacklevel=2)
            self._finish_exchange()
        self._synchronized = self._called_synchronize = self._unapplied = False
        if self._step_skipped:
            self._step_skipped = False
            return loss
        # a fused Adam's step under a GradScaler that found Inf/NaN moves nothing: not counted
        applied = self.momentum_exchange is None or not scaler_skips(self, self.momentum_exchange.grad_scaler)
        if self._unscale_check is not None and self._unscale_check.verify():
            self._unscale_check = None
        with self.merged.time_update():
            if self._momentum_phase:
                applied = applied and self._frozen_variance_step()
            else:
                super().step()
        if self.momentum_exchange is not None and applied:
            self.momentum_exchange.counted()
        return loss

    @torch.optim.Optimizer.profile_hook_step
    def _frozen_variance_step(self) -> bool:
        """:meth:`MomentumExchange.update`, between the optimizer's step pre- and post-hooks;
        whether it was applied."""
        return self.momentum_exchange.update(getattr(self, "grad_scale", None))

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
        """Zero the gradients: the slots of the group buffers that are the parameters'
        ``p.grad`` stay their gradients, zeroed by one fill per group whatever ``set_to_none``
        says (backward then accumulates into the groups, as under DDP's
        ``gradient_as_bucket_view``), but for the groups whose gradients are encoded where
        they lie (the sign codes on the CPU), whose gradients ``set_to_none=True`` drops: the
        next backward's are read where autograd leaves them, without being accumulated
        anywhere.  Every other gradient is set to None (``set_to_none=True``) or zeroed, as
        torch does.  An optimizer class with a ``zero_grad`` of its own runs it instead.
        AssertionError, as Horovod's, between a ``backward()`` and the ``step()``,
        ``synchronize()`` or read of :attr:`param_groups` (``GradScaler.unscale_``) that takes
        its averaged gradients."""
        if self.merged.in_flight or self._unapplied:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(): the gradients this step "
                                 "exchanged would be lost (Horovod refuses this too)")
        if not self._keeps_views:
            super().zero_grad(set_to_none=set_to_none)
            return
        with torch.autograd.profiler.record_function(f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"):
            slots = self.merged.slots
            for i in self.merged.zero_buffers(spare_parts=set_to_none):  # dropped below, as torch drops them
                slots[i] = None
            others = [p for p, slot in zip(self._exchanged, slots) if p.grad is not None and p.grad is not slot]
            for p in others + [p for p in self._frozen if p.grad is not None]:
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state dict plus ``"mergecomp"``: plan, step, compressor state,
        error-feedback memory (this rank's) and the scheduler's choice."""
        state = super().state_dict()
        state["mergecomp"] = self.merged.state_dict()
        if self.momentum_exchange is not None:
            state[MOMENTUM_STATE] = self.momentum_exchange.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or a plain one of the optimizer's class).
        Call it between steps, on every rank, with each rank's own checkpoint."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("mergecomp", None)
        momentum = state_dict.pop(MOMENTUM_STATE, None)
        super().load_state_dict(state_dict)  # replaces state and param_groups: share them again
        vars(self._given).update(state=self.state, param_groups=self.param_groups)
        if ours is not None:
            self.merged.load_state_dict(ours)
        if self.momentum_exchange is not None:
            self.momentum_exchange.load_state_dict(momentum)

    def load_every_rank(self, states: Sequence[Dict[str, Any]], residuals: str = "fold") -> None:
        """Resume from every rank's :meth:`state_dict` of the job that saved them (in rank
        order), on this world whatever its size (a torchrun elastic restart): the optimizer's
        own state from rank 0's (the ranks' are equal), this rank's mergecomp state where the
        world kept its size, else each per-rank memory the mean of the old ranks'
        (``residuals="fold"``) or fresh (``"drop"``)
        (:meth:`~mergecomp.pipeline.step.MergedStep.load_ranks`).  Every rank calls it."""
        self.load_state_dict({key: value for key, value in states[0].items() if key != "mergecomp"})
        self.merged.load_ranks([state["mergecomp"] for state in states], residuals)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """The optimizer class's own ``__setstate__`` (``load_state_dict`` and unpickling call
        it), without the ``step`` that torch then sets on this subclass: the wrapped class's
        ``step`` already runs the step hooks, and a second wrapper here would run each twice."""
        super().__setstate__(state)
        if "step" in vars(type(self)):
            delattr(type(self), "step")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("add_param_group() after wrapping is not supported: add the parameters "
                                  "to the optimizer before creating the DistributedOptimizer")

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper stops exchanging gradients)."""
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({super().__repr__()}, compression={self.compressor!r}, "
                f"memory={self.memory!r}, groups={len(self.groups)})")
