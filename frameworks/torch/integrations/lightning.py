"""Lightning strategies that exchange gradients through mergecomp (``lightning`` 2.x; the
standalone ``pytorch_lightning`` package when ``lightning`` is not installed).

* :class:`MergecompDDPStrategy`: DDP with mergecomp's communication hook on every device, CPU
  included (Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only)::

      Trainer(accelerator="cpu", devices=2, strategy=MergecompDDPStrategy("topk"))

* :class:`MergecompStrategy`: no DDP; ``configure_optimizers`` returns
  ``mc.DistributedOptimizer(...)``, which exchanges the gradients (once: DDP's allreduce does
  not run).  The strategy starts mergecomp on Lightning's process group, so the script calls no
  ``mc.init()``.

* :class:`MergecompDiLoCoStrategy`: DiLoCo for slow links (:class:`mergecomp.torch.DiLoCo`):
  DDP whose hook sends nothing, the optimizer of ``configure_optimizers`` taking the inner steps,
  and every ``sync_every`` of its steps the pseudo-gradient exchanged with any compressor::

      Trainer(accelerator="cpu", devices=2, strategy=MergecompDiLoCoStrategy(100, compression="topk"))

All three keep every rank's mergecomp state (error-feedback memories, compressor state, step;
under DiLoCo also each rank's local parameters and inner optimizer state, which differ between
synchronizations) in Lightning's checkpoint under ``"mergecomp"`` (:mod:`._ranks`), and
``fit(ckpt_path=...)`` gives each rank its own back, so a resumed run continues as the
uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Union

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    from pytorch_lightning.strategies import DDPStrategy

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.pipeline.options import StepOptions
from mergecomp.pipeline.resharding import to_fold
from mergecomp.torch.ddp_hook import DDPHookState, check_settings
from mergecomp.torch.momentum_exchange import OPTION as MOMENTUM_OPTION
from mergecomp.torch.momentum_exchange import OPTIONS as MOMENTUM_OPTIONS
from mergecomp.torch.momentum_recipes import AUTO, RUN_OPTIONS, TOTAL_OPTION, momentum_by_default

from ._hook import BUCKET_VIEWS, attach, attach_diloco
from ._ranks import DiLoCoRank, collect, own

__all__ = ["MergecompDDPStrategy", "MergecompStrategy", "MergecompDiLoCoStrategy", "CHECKPOINT_KEY"]

#: the checkpoint's entry holding every rank's mergecomp state
CHECKPOINT_KEY = "mergecomp"

#: the entry of mc.DistributedOptimizer.state_dict() holding this rank's mergecomp state
_OPTIMIZER_KEY = "mergecomp"

#: DDPStrategy arguments that would bring a second gradient exchange or hook
_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _refuse(who: str, given: Dict[str, Any], names, why: str) -> None:
    refused = sorted(set(given) & set(names))
    if refused:
        raise ValueError(f"{who}: {', '.join(refused)} cannot be used: {why}")


class _RanksInCheckpoint:
    """Lightning checkpoint hooks of a strategy: every rank's mergecomp state is gathered into
    rank 0's checkpoint, and each rank takes its own part back when a checkpoint is loaded."""

    def _local_state(self, checkpoint: Dict[str, Any]) -> Any:
        """This rank's mergecomp state for ``checkpoint``."""
        raise NotImplementedError

    def _restore(self, mine: Any, checkpoint: Dict[str, Any]) -> None:
        """Take this rank's saved state back (``checkpoint`` is the loaded one)."""
        raise NotImplementedError

    def _reshard(self, ranks: List[Any]) -> Any:
        """This rank's state from every rank's of a job of another size (folded on load)."""
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        # Lightning calls this on every rank (rank 0 writes): the gather is collective.
        checkpoint[CHECKPOINT_KEY] = collect(self._local_state(checkpoint))
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        if CHECKPOINT_KEY in checkpoint:
            self._restore(own(checkpoint[CHECKPOINT_KEY], self.root_device, self._reshard), checkpoint)
        return checkpoint


class MergecompDDPStrategy(_RanksInCheckpoint, DDPStrategy):
    """Lightning's DDP strategy with mergecomp's DDP communication hook, on any device.

    Args:
        compression: compressor name or instance (as :func:`mergecomp.torch.ddp_comm_hook`);
            default ``"none"``, lossless.
        memory: error-feedback memory name or instance; None: the compressor's default.
        kwargs: mergecomp's options (``nonfinite``, ``compression_warmup_steps``,
            ``uncompressed``, ``min_compress_numel``, ``scheme``, and ``exchange_momentum_after``,
            ``variance_refresh_every``, ``exchange_momentum_as`` to exchange the momentum of the
            one Adam or AdamW ``configure_optimizers`` returns; ``"auto"``, the compressor's
            recipe, is the default where a lossy compressor with error feedback would send its
            gradients, None sends them; with ``"auto"`` the run's length is fit's
            ``estimated_stepping_batches`` unless ``total_steps`` or ``lr_warmup_steps`` is
            given) go to the hook; the rest to
            Lightning's ``DDPStrategy`` (``find_unused_parameters``, ``bucket_cap_mb``, ...; DDP's
            ``gradient_as_bucket_view`` is True unless given).
            Bad settings raise here, naming the option.  ``ddp_comm_hook``, ``ddp_comm_state``,
            ``ddp_comm_wrapper`` and ``model_averaging_period`` raise ValueError.

    ``hook_state`` is the hook's :class:`~mergecomp.torch.ddp_hook.DDPHookState` once ``fit``
    has set up the optimizers (``step``, ``step_breakdown()``, ``state_dict()``); a later ``fit``
    with the same strategy continues from it.
    """

    def __init__(self, compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                 **kwargs: Any) -> None:
        who = type(self).__name__
        _refuse(who, kwargs, _HOOK_ARGUMENTS, "the strategy registers mergecomp's hook (name the compressor with "
                                              "compression=; fp16 is compression='fp16')")
        options = {name: kwargs.pop(name) for name in [*(f.name for f in dataclasses.fields(StepOptions)),
                                                         *MOMENTUM_OPTIONS, *RUN_OPTIONS] if name in kwargs}
        check_settings(compression, memory, True, **options)
        super().__init__(**{**BUCKET_VIEWS, **kwargs})
        self._hook_settings = (compression, memory, options)
        self.hook_state: Optional[DDPHookState] = None
        self._resumed: Optional[Dict[str, Any]] = None

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's, then mergecomp's hook on the DDP model (which ``configure_ddp`` made just
        before), registered on any device (Lightning's own ``ddp_comm_hook`` argument registers
        hooks on CUDA only).  With ``exchange_momentum_after`` (by default for one Adam or AdamW
        a lossy compressor with error feedback would send the gradients of:
        :func:`~mergecomp.torch.momentum_recipes.momentum_by_default`) the optimizer and the precision
        plugin's ``GradScaler`` go to the hook.  Lightning loads the optimizer's state after
        this, when it resumes."""
        super().setup_optimizers(trainer)
        who = type(self).__name__
        compression, memory, options = self._hook_settings
        options = momentum_by_default(compression, memory, self.optimizers, options, who)
        if options.get(MOMENTUM_OPTION) == AUTO and not any(options.get(name) for name in RUN_OPTIONS):
            options = {**options, TOTAL_OPTION: int(trainer.estimated_stepping_batches)}
        # the state of the checkpoint fit() resumes from, else that of an earlier fit with this strategy
        carried = self._resumed if self._resumed is not None else self._local_state({})
        self.hook_state = attach(self.model, compression, memory, options, who=who)
        self.hook_state.load_state_dict(carried)
        self._resumed = None
        if self.hook_state.momentum is not None:
            if len(self.optimizers) != 1:
                raise ValueError(f"{who}: exchange_momentum_after needs exactly one optimizer from "
                                 f"configure_optimizers, got {len(self.optimizers)}")
            self.hook_state.train_with(self.optimizers[0], getattr(self.precision_plugin, "scaler", None))

    def _local_state(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        return self.hook_state.state_dict() if self.hook_state is not None else {}

    def _restore(self, mine: Dict[str, Any], checkpoint: Dict[str, Any]) -> None:
        self._resumed = mine  # fit() restores the checkpoint before it wraps the model

    def _reshard(self, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
        return to_fold(ranks)


class MergecompDiLoCoStrategy(_RanksInCheckpoint, DDPStrategy):
    """Lightning's DDP strategy training with DiLoCo (:class:`mergecomp.torch.DiLoCo`): the DDP
    model gets a hook that sends nothing, the one optimizer ``configure_optimizers`` returns
    takes the inner steps, and every ``sync_every`` of its steps the pseudo-gradient goes
    through ``compression`` and the outer optimizer.  When ``fit`` ends every fragment
    synchronizes once more, so every rank holds the global model.

    Args:
        sync_every, compression, memory: as :class:`~mergecomp.torch.DiLoCo`'s.
        kwargs: DiLoCo's options (``outer_optimizer``, ``fragments``, ``fragment_sync_delay``,
            ``fragment_update_alpha``, ``fragment_codecs``, ``nonfinite``, ``uncompressed`` ...); the rest go to
            Lightning's ``DDPStrategy`` (``find_unused_parameters``, ``bucket_cap_mb``, ...; DDP's
            ``gradient_as_bucket_view`` is True unless given).
            ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper`` and
            ``model_averaging_period`` raise ValueError.

    Under ``precision="16-mixed"`` the precision plugin's ``GradScaler`` counts the inner steps
    (a step it skips is skipped on that rank alone).  ``diloco`` is the
    :class:`~mergecomp.torch.DiLoCo` once ``fit`` has set up the optimizer; a checkpoint of
    another number of ranks folds the memories (:meth:`._ranks.DiLoCoRank.reshard`).
    """

    _DILOCO_OPTIONS = ("outer_optimizer", "fragments", "fragment_sync_delay", "fragment_update_alpha", "fragment_codecs",
                       *(f.name for f in dataclasses.fields(StepOptions)))

    def __init__(self, sync_every: int, compression: Union[str, Compressor] = "none",
                 memory: Union[str, Memory, None] = None, **kwargs: Any) -> None:
        who = type(self).__name__
        _refuse(who, kwargs, _HOOK_ARGUMENTS, "the strategy registers a hook that sends nothing in the inner steps")
        options = {name: kwargs.pop(name) for name in self._DILOCO_OPTIONS if name in kwargs}
        super().__init__(**{**BUCKET_VIEWS, **kwargs})
        self._diloco_settings = (sync_every, compression, memory, options)
        self.diloco = None
        self._resumed: Optional[Dict[str, Any]] = None

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's, then DiLoCo around the one optimizer on the DDP model (every rank starts
        from rank 0's parameters)."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__}: DiLoCo takes the inner steps of exactly one optimizer from "
                             f"configure_optimizers, got {len(self.optimizers)}")
        if self.diloco is not None:
            self.diloco.close()  # an earlier fit's
        sync_every, compression, memory, options = self._diloco_settings
        self.diloco = attach_diloco(self.model, self.optimizers[0], sync_every, compression, memory, options,
                                    getattr(self.precision_plugin, "scaler", None), type(self).__name__)

    def on_train_start(self) -> None:
        """A resumed fit: each rank's own DiLoCo state, local parameters and inner optimizer
        state, over the rank 0's that Lightning restored."""
        super().on_train_start()
        if self._resumed is not None:
            DiLoCoRank(self.diloco).load_state_dict(self._resumed)
            self._resumed = None

    def on_train_end(self) -> None:
        self.diloco.sync()
        super().on_train_end()

    def _local_state(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        return DiLoCoRank(self.diloco).state_dict()

    def _restore(self, mine: Dict[str, Any], checkpoint: Dict[str, Any]) -> None:
        self._resumed = mine  # loaded when training starts, after Lightning restored rank 0's model and optimizer

    def _reshard(self, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
        return DiLoCoRank.reshard(ranks)


class MergecompStrategy(_RanksInCheckpoint, DDPStrategy):
    """Data parallel without DDP: each optimizer from ``configure_optimizers`` must be a
    :class:`mergecomp.torch.DistributedOptimizer`, which averages the gradients during
    ``backward`` (any compressor, ``groups="auto"``, momentum exchange, ...)::

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return mc.DistributedOptimizer(opt, named_parameters=self.named_parameters(),
                                           compression="topk")

        Trainer(accelerator="cpu", devices=2, strategy=MergecompStrategy())

    Once Lightning has started its process group, the strategy starts mergecomp on it (so
    ``mc.size()``, ``mc.rank()`` and the optimizer work from ``configure_optimizers`` on) and
    broadcasts rank 0's parameters and buffers, as DDP does.  A script must not call
    ``mc.init()`` under Lightning's own launcher: the processes it launches fail there
    (``RuntimeError``: ``RANK`` is not set); rank 0's, started as one process, is replaced
    (under ``torchrun`` an ``mc.init()`` is harmless).

    Args:
        kwargs: Lightning's ``DDPStrategy`` arguments that do not concern DDP itself
            (``process_group_backend``, ``timeout``, ``start_method``, ``accelerator``,
            ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin``); DDP's own arguments and the hook arguments raise ValueError.

    ``Trainer(accumulate_grad_batches=k)`` needs ``DistributedOptimizer(...,
    backward_passes_per_step=k)`` (ValueError otherwise): one exchange per optimizer step.
    """

    _STRATEGY_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                           "precision_plugin", "process_group_backend", "timeout", "start_method")

    def __init__(self, **kwargs: Any) -> None:
        who = type(self).__name__
        _refuse(who, kwargs, set(kwargs) - set(self._STRATEGY_ARGUMENTS),
                "the model is not wrapped in DDP (mc.DistributedOptimizer exchanges the gradients); for DDP "
                "with mergecomp's hook use MergecompDDPStrategy")
        super().__init__(**kwargs)

    # -- processes ------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's process group
        _start_mergecomp(self.world_size, type(self).__name__)

    def configure_ddp(self) -> None:
        """No DDP wrapper: rank 0's parameters and buffers go to every rank, as DDP's would."""
        import mergecomp.torch as mc

        mc.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def setup_optimizers(self, trainer) -> None:
        """Lightning's, then each optimizer checked; one exchanging Adam's momentum without a
        ``GradScaler`` gets the precision plugin's (``"16-mixed"``), which scales the loss."""
        super().setup_optimizers(trainer)
        optimizers = _check_optimizers(self.optimizers, trainer.accumulate_grad_batches, type(self).__name__)
        scaler = getattr(self.precision_plugin, "scaler", None)
        for optimizer in optimizers if scaler is not None else ():
            momentum = optimizer.momentum_exchange
            if momentum is not None and momentum.grad_scaler is None:
                optimizer.set_grad_scaler(scaler)

    # -- checkpoints ----------------------------------------------------------------------------
    def _local_state(self, checkpoint: Dict[str, Any]) -> List[Any]:
        return [state.get(_OPTIMIZER_KEY) for state in checkpoint.get("optimizer_states", [])]

    def _restore(self, mine: List[Any], checkpoint: Dict[str, Any]) -> None:
        """Each optimizer's state dict gets this rank's mergecomp part back (Lightning loads them
        after ``setup``)."""
        for state, ours in zip(checkpoint.get("optimizer_states", []), mine):
            if ours is not None:
                state[_OPTIMIZER_KEY] = ours

    def _reshard(self, ranks: List[List[Any]]) -> List[Any]:
        """Per optimizer, every rank's mergecomp state (folded when the optimizer loads it)."""
        return [None if states[0] is None else to_fold(states) for states in zip(*ranks)]


def _start_mergecomp(world_size: int, who: str) -> None:
    """mergecomp's runtime on Lightning's (initialized) default process group."""
    import mergecomp.torch as mc

    if mc.is_initialized():
        if mc.size() == world_size:
            return
        if mc.communicator().engine != "local":
            raise RuntimeError(f"{who}: mergecomp was initialized with {mc.size()} ranks, but Lightning runs "
                               f"{world_size}: do not call mc.init() under Lightning")
        mc.shutdown()  # mc.init() ran as one process before Lightning's launcher started the others
    mc.init(engine="torch")


def _check_optimizers(optimizers, accumulate: int, who: str) -> List[Any]:
    """The ``mc.DistributedOptimizer`` of each of ``optimizers`` (a ``LightningOptimizer``'s
    too); TypeError for another optimizer, ValueError for other gradient accumulation."""
    from mergecomp.torch import DistributedOptimizer

    checked = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"{who}: configure_optimizers returned a {type(optimizer).__name__}, not a "
                            f"mc.DistributedOptimizer; without DDP nothing would average its gradients. Return "
                            f"mc.DistributedOptimizer(opt, named_parameters=self.named_parameters(), ...)")
        if optimizer.backward_passes_per_step != accumulate:
            raise ValueError(f"{who}: Trainer(accumulate_grad_batches={accumulate}) needs "
                             f"mc.DistributedOptimizer(..., backward_passes_per_step={accumulate}), got "
                             f"backward_passes_per_step={optimizer.backward_passes_per_step}")
        checked.append(optimizer)
    return checked
