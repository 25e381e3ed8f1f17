"""A DDP communication hook: DDP's gradient buckets go through mergecomp's compressors.

Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    state, hook = mc.ddp_comm_hook(compression="powersgd",
                                   named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, hook)
    ...
    torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)   # per rank

When it binds.  The state's collectives need the process group: built while torch.distributed
is initialized, ``ddp_comm_hook`` binds to it at once (the ranks check that they were built the
same way); built before (a Lightning or Accelerate script that makes the hook before the
framework starts the group), it binds at DDP's first bucket, or at :meth:`DDPHookState.bind`,
which every rank calls.  State loaded before that is applied when it binds.

Each bucket is one merged group of a :class:`mergecomp.pipeline.buckets.BucketStep`, the merged
step whose groups DDP defines (check finite -> error feedback -> compress -> collective ->
decode); nothing is re-implemented here.

When collectives are issued.  DDP calls the hook once per bucket, in bucket order, from the
backward pass.  The hook starts the bucket's first round (async) and returns a pending
``torch.futures.Future``; the call for the last bucket (``bucket.is_last()``) then finishes every
bucket in order on the same thread — waits, further rounds (PowerSGD's second allreduce),
decode, average over ranks — and sets the futures' results.  So every rank issues every
collective from one thread in one order.  PyTorch's own ``powerSGD_hook`` issues its later
rounds from completion callbacks on gloo's thread while the next bucket starts from the backward
thread, and crashed in 10 of 10 runs on gloo (docs/frontends.md).

Error feedback across bucket rebuilds.  A bucket's state (residuals, momenta) is keyed by the
parameters it holds (a :class:`~mergecomp.exchange.plan.Group` with their offsets), not by the bucket's
index.  When DDP rebuilds its buckets after the first iteration (or after a restart), each new
bucket's per-element state is assembled from the old buckets' pieces
(:class:`mergecomp.pipeline.buckets.BucketStep`); low-rank state (PowerSGD's Q) is re-drawn.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations with the real types.
import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.exchange.exchange import resolve
from mergecomp.exchange.plan import Group
from mergecomp.pipeline.buckets import BucketStep
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.resharding import EVERY_RANK, to_fold
from mergecomp.pipeline.step import HoldsMergedStep

from .momentum_exchange import OPTION as MOMENTUM_OPTION
from .momentum_exchange import STATE_KEY as MOMENTUM_STATE
from .momentum_exchange import MomentumSettings
from .momentum_recipes import settings_of
from .momentum_hook import HookMomentum

__all__ = ["ddp_comm_hook", "DDPHookState", "mergecomp_hook", "check_settings"]


class DDPHookState(HoldsMergedStep):
    """Settings and state of :func:`mergecomp_hook`: a :class:`~mergecomp.pipeline.buckets.BucketStep`
    whose groups are DDP's buckets, and the futures of the step's buckets.

    Args:
        build: makes the bucket step (its collectives need the process group; see :meth:`bind`).
        params: ``id(parameter) -> index`` of the named parameters; without them parameters
            are numbered in the order the first backward pass hands them over (the same on
            every rank, as DDP builds the same buckets everywhere): register the hook before
            the first backward pass.
        nonfinite: the ``nonfinite`` option ``build`` uses.
    """

    def __init__(self, build: Callable[[], BucketStep], params: Optional[Dict[int, int]] = None,
                 nonfinite: str = "propagate", momentum: Optional[HookMomentum] = None) -> None:
        self._build = build
        #: the momentum exchange (``exchange_momentum_after``), or None
        self.momentum = momentum
        self._optimizer: Optional[Tuple[Any, Any]] = None  # given before binding: attached by bind()
        self._merged: Optional[BucketStep] = None
        self._loaded: Optional[Dict[str, Any]] = None  # loaded before binding: applied by bind()
        self._nonfinite = nonfinite
        self._index: Dict[int, int] = dict(params or {})
        self._named = params is not None
        self._futures: List[Tuple[torch.futures.Future, torch.Tensor]] = []  # future, bucket buffer

    @property
    def merged(self) -> BucketStep:
        """The bucket step; RuntimeError before :meth:`bind`."""
        if self._merged is None:
            raise RuntimeError("the DDP hook's state is not bound to a process group yet: it binds at DDP's "
                               "first bucket, or call state.bind() on every rank once torch.distributed is "
                               "initialized")
        return self._merged

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has run."""
        return self._merged is not None

    def bind(self) -> "DDPHookState":
        """Bind to the process group (idempotent).  Collective the first time: every rank calls
        it, or DDP's first bucket does; raises ValueError on every rank if the ranks were built
        differently, RuntimeError if torch.distributed is not initialized."""
        if self._merged is None:
            if not dist.is_initialized():
                raise RuntimeError("the DDP hook binds to its process group, but torch.distributed is not "
                                   "initialized (it must be before DDP's first backward pass)")
            merged = self._build()
            if self._loaded:
                merged.load_state_dict(self._loaded)
            self._merged, self._loaded = merged, None
            if self._optimizer is not None:
                self.set_optimizer(*self._optimizer)
        return self

    def set_optimizer(self, optimizer: Any, grad_scaler: Any = None) -> "DDPHookState":
        """With ``exchange_momentum_after``: exchange ``optimizer``'s momentum (a
        ``torch.optim.Adam`` or ``AdamW`` holding the DDP model's parameters, or a framework's
        wrapper of one), ``grad_scaler`` scaling the loss (``torch.amp.GradScaler``; None: none).
        Every rank calls it before the first backward pass (before binding, it is applied by
        :meth:`bind`).  ValueError without the option or with an optimizer it cannot serve."""
        if self.momentum is None:
            raise ValueError("set_optimizer: the hook was made without exchange_momentum_after, so it exchanges "
                             "gradients and needs no optimizer")
        if self._merged is None:
            self._optimizer = (optimizer, grad_scaler)
        else:
            self.momentum.attach(optimizer, self._merged.exchange, grad_scaler)
            self._optimizer = None
        return self

    def train_with(self, optimizer: Any, grad_scaler: Any = None) -> None:
        """The optimizer a framework steps with this hook (its wrapper of one too): with
        ``exchange_momentum_after`` its momentum is exchanged (:meth:`set_optimizer`); without,
        nothing to do (a front end that knows it decides the default before building the hook:
        :func:`~frameworks.torch.momentum_recipes.momentum_by_default`)."""
        if self.momentum is not None:
            self.set_optimizer(optimizer, grad_scaler)

    @property
    def nonfinite(self) -> str:
        return self._nonfinite

    @property
    def step(self) -> int:
        """Steps finished so far (those of a checkpoint loaded before binding included)."""
        if self._merged is None:
            loaded = self._loaded or {}
            return int((loaded[EVERY_RANK][0] if EVERY_RANK in loaded else loaded).get("step", 0))
        return self.merged.step

    @property
    def layout(self) -> List[Group]:
        """The buckets of the last completed step, as groups (none before binding)."""
        return self.merged.groups if self.bound else []

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None:
            if self._named:
                raise ValueError(f"DDP bucket holds a parameter of shape {tuple(p.shape)} that is not among "
                                 f"the named_parameters given to ddp_comm_hook")
            i = self._index[id(p)] = len(self._index)
            if i == len(self.merged.names):
                self.merged.add_tensor(f"param.{i}", p.shape, p.dtype)
        return i

    # -- one step ----------------------------------------------------------------------------
    def start(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self.bind()
        if bucket.index() == 0 and self._futures:
            self._fail(RuntimeError("the previous step's buckets were never finished (its backward pass "
                                    "was interrupted); the ranks' collectives are out of step"))
        if bucket.index() == 0 and self.momentum is not None:
            self.momentum.begin(self.merged)
        indices = [self._param_index(p) for p in bucket.parameters()]
        # compressed in place in DDP's bucket buffer; finish decodes the result back into it,
        # which DDP then takes as the future's value
        buffer = bucket.buffer()
        self.merged.start_group(indices, buffer)
        future: torch.futures.Future = torch.futures.Future()
        self._futures.append((future, buffer))
        return future

    def finish(self) -> None:
        """Finish every pending bucket in bucket order and complete their futures."""
        try:
            reduced = self.merged.finish()
            if self.momentum is not None:  # bound to an optimizer: begin() saw to it
                self.momentum.exchange.finished(reduced)
            self.merged.copy_back()
        except BaseException as error:
            self._fail(error)
        for future, buffer in self._futures:
            future.set_result(buffer)
        self._futures = []

    def _fail(self, error: BaseException) -> None:
        for future, _ in self._futures:
            if not future.done():
                future.set_exception(error)
        self._futures = []
        self.merged.abort()
        raise error

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's step, compressor state, error-feedback memory and bucket layout, and with
        ``exchange_momentum_after`` the momentum exchange's state (``"mergecomp_momentum"``; Adam's
        own is in the optimizer's checkpoint); before binding, the state loaded into it, or
        ``{}`` (nothing to restore)."""
        state = dict(self._loaded or {}) if self._merged is None else self.merged.state_dict()
        momentum = None if self.momentum is None else self.momentum.state_dict()
        if momentum is not None:
            state[MOMENTUM_STATE] = momentum
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (between steps, after the optimizer's own state; before
        binding it is kept and applied by :meth:`bind`; ``{}`` restores nothing), or every rank's
        of a job of another size (:func:`~mergecomp.pipeline.resharding.to_fold`: the momentum
        exchange's state is replicated, rank 0's; the rest folded where the step loads it).  If
        DDP's buckets differ from the saved layout (a fresh DDP starts with its initial buckets),
        the state is remapped on use."""
        if not state:
            return
        if EVERY_RANK in state:
            momentum = state.get(MOMENTUM_STATE, state[EVERY_RANK][0].get(MOMENTUM_STATE))  # saved again unbound
            state = to_fold([{key: value for key, value in each.items() if key != MOMENTUM_STATE}
                             for each in state[EVERY_RANK]], state["residuals"])
        else:
            state = dict(state)
            momentum = state.pop(MOMENTUM_STATE, None)
        if self.momentum is not None:
            self.momentum.load_state_dict(momentum)
        if self._merged is None:
            self._loaded = state
        else:
            self.merged.load_state_dict(state)

    def __repr__(self) -> str:
        if self._merged is None:
            return f"DDPHookState(not bound yet, step={self.step})"
        return (f"DDPHookState(compressor={self.compressor!r}, memory={self.memory!r}, "
                f"buckets={len(self.layout)}, step={self.step})")


def mergecomp_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook; see the module docstring.  Register with ``state``."""
    try:
        future = state.start(bucket)
        if bucket.is_last():
            state.finish()
    except BaseException as error:
        if state._futures:
            state._fail(error)
        raise
    return future


def ddp_comm_hook(
    compression: Union[str, Compressor] = "none",
    memory: Union[str, Memory, None] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
    timeout: Optional[float] = None,
    *,
    exchange_momentum_after: Union[int, str, None] = None,
    variance_refresh_every: Optional[int] = None,
    exchange_momentum_as: Optional[str] = None,
    optimizer: Any = None,
    grad_scaler: Any = None,
    **options,
) -> Tuple[DDPHookState, Any]:
    """Make ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        compression: compressor name (``mergecomp.compressor_names()``, ``mc.Compression.<name>``)
            or instance, e.g. ``mergecomp.get_compressor("powersgd", rank=4)``; default
            ``"none"`` (lossless: a plain average, like DDP's own allreduce).
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        process_group: the DDP model's process group (default: the world, as it is when the
            state binds).  The hook's collectives run on it through
            :class:`~mergecomp.engines.torch_dist.TorchCommunicator`.
        named_parameters: ``model.named_parameters()`` (recommended: stable indices across
            restarts, names in errors).
        timeout: seconds any one collective may take (default ``MERGECOMP_TIMEOUT`` or 300).
        options: mergecomp's options by keyword (:class:`~mergecomp.pipeline.options.StepOptions`,
            as for :class:`~mergecomp.torch.DistributedOptimizer`; DDP's buckets are the
            groups): ``nonfinite`` (default ``"propagate"``: every bucket's result is NaN on
            every rank, or with a lossless compressor the bucket whose sum carries the NaN/Inf,
            unchecked, so a ``GradScaler`` skips the step everywhere and lowers its scale, as
            with DDP's own allreduce; a hook cannot skip the optimizer step, so no ``"skip"``),
            ``compression_warmup_steps``, ``compression_warmup_codec``, ``uncompressed`` (needs ``named_parameters``),
            ``min_compress_numel``, ``scheme``.  A bucket holding exempt parameters is split in
            two groups (its exempt parameters, the others), copied out of the bucket and back.
        exchange_momentum_after, variance_refresh_every, exchange_momentum_as: Adam's momentum
            exchanged instead of its gradients after this many updates, as
            :class:`~mergecomp.torch.DistributedOptimizer` does (:mod:`frameworks.torch.momentum_hook`;
            needs ``named_parameters``); the optimizer (``torch.optim.Adam`` or ``AdamW`` over
            the DDP model's parameters) given here as ``optimizer``, or later by
            :meth:`DDPHookState.set_optimizer`, before the first backward pass.
            ``"auto"``: the compressor's recipe, scaled to ``total_steps=N`` or
            ``lr_warmup_steps=W``, else following the learning rate
            (:mod:`frameworks.torch.momentum_recipes`).
        grad_scaler: with ``exchange_momentum_after``, the ``torch.amp.GradScaler`` that scales
            the loss.

    The hook returns each bucket's gradient averaged over ranks, in the bucket's dtype.  Settings
    are checked here (ValueError/TypeError naming the option); the state binds to the process
    group here if torch.distributed is initialized, else at DDP's first bucket (module docstring).
    """
    compressor, memory, step_options, settings = check_settings(
        compression, memory, named_parameters is not None, exchange_momentum_after=exchange_momentum_after,
        variance_refresh_every=variance_refresh_every, exchange_momentum_as=exchange_momentum_as,
        optimizer=optimizer, grad_scaler=grad_scaler, **options)
    named = None if named_parameters is None else [(n, p) for n, p in named_parameters if p.requires_grad]
    build = functools.partial(_bucket_step, compressor, memory, process_group, timeout, named or (), step_options,
                              settings)
    momentum = None if settings is None else HookMomentum(settings, [p for _, p in named])
    state = DDPHookState(build, None if named is None else {id(p): i for i, (_, p) in enumerate(named)},
                         step_options.nonfinite, momentum)
    if optimizer is not None:
        state.set_optimizer(optimizer, grad_scaler)
    if dist.is_initialized():
        state.bind()
    return state, mergecomp_hook


def check_settings(compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                   named: bool = True, *, exchange_momentum_after: Union[int, str, None] = None,
                   variance_refresh_every: Optional[int] = None, exchange_momentum_as: Optional[str] = None,
                   optimizer: Any = None, grad_scaler: Any = None,
                   **options) -> Tuple[Compressor, Memory, StepOptions, Optional[MomentumSettings]]:
    """:func:`ddp_comm_hook`'s settings checked and resolved, without building anything
    (``named``: whether parameter names will be given): the compressor, the memory, the step
    options and the momentum exchange's settings (None without ``exchange_momentum_after``;
    ``"auto"``: the compressor's recipe, :func:`~frameworks.torch.momentum_recipes.settings_of`);
    ValueError/TypeError naming the option."""
    compression, options, momentum = settings_of(compression, options, exchange_momentum_after,
                                                 variance_refresh_every, exchange_momentum_as, grad_scaler,
                                                 "ddp_comm_hook")
    if optimizer is not None and momentum is None:
        raise ValueError(f"optimizer is only used with {MOMENTUM_OPTION} (the hook exchanges gradients without it)")
    defaults = {}
    if momentum is not None:
        changed, memory = momentum.defaults(compression, memory)
        defaults["compression_warmup_steps"] = changed["compression_warmup_steps"]  # no search in a hook
        if not named:
            raise ValueError(f"ddp_comm_hook: {MOMENTUM_OPTION} finds Adam's state by parameter: pass "
                             f"named_parameters too")
    step_options = StepOptions.create("ddp_comm_hook", options, defaults=defaults)
    if step_options.uncompressed and not named:
        raise ValueError("ddp_comm_hook: uncompressed matches parameter names: pass named_parameters too")
    compressor, memory = resolve(compression, memory)
    step_options.check(compressor)
    return compressor, memory, step_options, momentum


def _bucket_step(compressor: Compressor, memory: Memory, process_group: Optional[dist.ProcessGroup],
                 timeout: Optional[float], named: Sequence[Tuple[str, torch.nn.Parameter]],
                 step_options: StepOptions, momentum: Optional[MomentumSettings]) -> BucketStep:
    """The hook's bucket step on ``process_group`` (default: the world as it is now); the
    parameters' shapes and dtypes as they are now (after the framework moved or cast them)."""
    from mergecomp.engines.torch_dist import TorchCommunicator

    comm = TorchCommunicator(process_group, timeout=timeout)
    agree = momentum.agreed() if momentum else ((MOMENTUM_OPTION, None),)
    return BucketStep(compressor, memory, comm, [n for n, _ in named], [p.shape for _, p in named],
                      [p.dtype for _, p in named], comm.device, step_options,
                      FrontEnd("ddp_comm_hook", "parameters", agree=agree))
