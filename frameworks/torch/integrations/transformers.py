"""mergecomp's DDP communication hook in a Hugging Face ``transformers.Trainer``::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    register(trainer, "topk")
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)

With AdamW (or Adam) and a lossy compressor with error feedback, ``register(trainer, "onebit")``
exchanges the optimizer's momentum instead of its gradients (:mod:`mergecomp.torch.momentum_hook`)
by the compressor's recipe, ``exchange_momentum_after="auto"``, its warm-up scaled to the run's LR
warm-up (:func:`run_length`; the default where a recipe serves the optimizer:
:func:`~mergecomp.torch.momentum_recipes.momentum_by_default`); ``exchange_momentum_after=K`` gives the
warm-up, ``exchange_momentum_after=None`` exchanges the gradients.  The callback hands the
Trainer's optimizer (and, under fp16, its ``GradScaler``) to the hook.

The callback registers the hook on ``trainer.model_wrapped`` when training begins (the Trainer
wraps the model in DDP just before, with ``gradient_as_bucket_view=True``, which ``register`` sets:
each gradient is written where the hook reads it, no copy in and out), writes every rank's hook
state into each checkpoint folder (``mergecomp_ddp_hook.pt``, from rank 0) and, when the Trainer
resumes, gives each rank its own back.  The folder it resumes from is the one given to
``trainer.train(resume_from_checkpoint=...)`` (``register`` records it), else
``TrainingArguments.resume_from_checkpoint`` when that is set, else
``<output_dir>/checkpoint-<global step>``, where the Trainer writes and
``train(resume_from_checkpoint=True)`` finds its checkpoints; a resumed run whose folder holds no
such file (a checkpoint saved without mergecomp) logs a warning and starts the error feedback
afresh.

For links too slow for an exchange per step, ``register_diloco(trainer, sync_every=100,
compression="topk")`` trains with DiLoCo (:class:`mergecomp.torch.DiLoCo`) instead: the DDP model
gets a hook that sends nothing, the Trainer's optimizer takes the inner steps, and every
``sync_every`` of its updates the pseudo-gradient is exchanged.  Its checkpoint file
(``mergecomp_diloco.pt``) holds every rank's DiLoCo state, local parameters and inner optimizer
state (the Trainer saves rank 0's model and optimizer only, and under DiLoCo they differ between
synchronizations); at the end of training every fragment synchronizes once more, so that every
rank holds the same model.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Dict, Optional, Union

import torch
from transformers import TrainerCallback

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.pipeline.resharding import to_fold
from mergecomp.torch.ddp_hook import DDPHookState, check_settings
from mergecomp.torch.diloco import DiLoCo
from mergecomp.torch.momentum_exchange import OPTION as MOMENTUM_OPTION
from mergecomp.torch.momentum_recipes import AUTO, TOTAL_OPTION, WARMUP_OPTION, momentum_by_default

from ._hook import BUCKET_VIEWS, attach, attach_diloco
from ._ranks import AllRanks, DiLoCoRank

__all__ = ["MergecompCallback", "DiLoCoCallback", "register", "register_diloco", "run_length", "STATE_FILE",
           "DILOCO_STATE_FILE"]

logger = logging.getLogger("mergecomp")

#: the file in each checkpoint folder holding every rank's hook state
STATE_FILE = "mergecomp_ddp_hook.pt"
#: the same for :func:`register_diloco`'s
DILOCO_STATE_FILE = "mergecomp_diloco.pt"


def run_length(args: Any, max_steps: int) -> Dict[str, int]:
    """``exchange_momentum_after="auto"``'s view of the run (:mod:`mergecomp.torch.momentum_recipes`):
    its updates and its LR warm-up's (``TrainingArguments.get_warmup_steps``; 0: none, then 5 %
    of the updates stands for it)."""
    return {TOTAL_OPTION: max_steps, WARMUP_OPTION: int(args.get_warmup_steps(max_steps))}


class _EveryRankCallback(TrainerCallback):
    """Every rank's state of ``self._ranks``'s target in each checkpoint folder (:attr:`state_file`,
    written by rank 0), and back to each rank when the Trainer resumes (:meth:`_resume`)."""

    #: the file in each checkpoint folder
    state_file: str = ""
    #: what starts afresh when a resumed run finds no such file
    afresh: str = ""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        #: the folder given to the last ``trainer.train(resume_from_checkpoint=...)`` (:func:`register`)
        self.resume_from: Any = None
        self._ranks: Optional[AllRanks] = None
        self._wrapped = None  # the DDP model the callback set up

    def _ddp(self, args: Any) -> Optional[torch.nn.parallel.DistributedDataParallel]:
        """The Trainer's DDP model; None on one process; TypeError under another wrapper."""
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            return wrapped
        if args.world_size > 1:
            raise TypeError(f"mergecomp: the Trainer wrapped the model in {type(wrapped).__name__}, not "
                            f"DistributedDataParallel; {type(self).__name__} needs DDP (FSDP and DeepSpeed are "
                            f"not supported)")
        return None

    def _resume(self, args, step: int) -> None:
        folder = next((f for f in (self.resume_from, args.resume_from_checkpoint)
                       if isinstance(f, str) and os.path.isdir(f)), None)
        if folder is None:
            folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        path = os.path.join(folder, self.state_file)
        if not os.path.isfile(path):
            logger.warning("%s: resuming at step %d, but %s does not exist: %s (set "
                           "TrainingArguments.resume_from_checkpoint to the checkpoint folder if the Trainer resumed "
                           "from another one)", type(self).__name__, step, path, self.afresh)
            return
        self._ranks.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        if self._ranks is None:
            return
        record = self._ranks.state_dict()  # every rank takes part
        if record["ranks"] is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            raise RuntimeError(f"{type(self).__name__}: the Trainer's checkpoint folder {folder} does not exist "
                               f"(hyperparameter search saves to per-trial folders: not supported)")
        torch.save(record, os.path.join(folder, self.state_file))


class MergecompCallback(_EveryRankCallback):
    """The callback :func:`register` adds to ``trainer`` (see the module docstring).

    ``hook_state`` is the hook's :class:`~mergecomp.torch.ddp_hook.DDPHookState` once training
    has begun on several processes; None on one process (the Trainer does not use DDP there).
    """

    state_file = STATE_FILE
    afresh = "the hook's error feedback starts afresh"

    def __init__(self, trainer: Any, compression: Union[str, Compressor] = "none",
                 memory: Union[str, Memory, None] = None, **options: Any) -> None:
        super().__init__(trainer)
        check_settings(compression, memory, True, **options)
        self.settings = (compression, memory, options)
        self.hook_state: Optional[DDPHookState] = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self._ddp(args)
        if wrapped is None:
            return
        optimizer = kwargs["optimizer"]
        if wrapped is not self._wrapped:  # a second train() on the same DDP keeps its hook
            compression, memory, options = self.settings
            options = momentum_by_default(compression, memory, [optimizer], options, "MergecompCallback")
            if options.get(MOMENTUM_OPTION) == AUTO:  # the recipe's warm-up scaled to the Trainer's schedule
                options = {**run_length(args, state.max_steps), **options}
            self.hook_state = attach(wrapped, compression, memory, options, who="MergecompCallback")
            self._ranks, self._wrapped = AllRanks(self.hook_state, args.device, to_fold), wrapped
        scaler = getattr(self.trainer.accelerator, "scaler", None)  # the optimizer's state loaded when it resumes
        self.hook_state.train_with(optimizer, scaler if scaler is not None and scaler.is_enabled() else None)
        if state.global_step > 0:  # the Trainer resumed from a checkpoint
            self._resume(args, state.global_step)


class DiLoCoCallback(_EveryRankCallback):
    """The callback :func:`register_diloco` adds to ``trainer`` (see the module docstring);
    ``diloco`` is its :class:`~mergecomp.torch.DiLoCo` once training has begun on several
    processes."""

    state_file = DILOCO_STATE_FILE
    afresh = ("every rank continues from rank 0's parameters and inner optimizer state, which become the global "
              "ones, with fresh outer optimizers and memories")

    def __init__(self, trainer: Any, sync_every: int, compression: Union[str, Compressor] = "none",
                 memory: Union[str, Memory, None] = None, **options: Any) -> None:
        super().__init__(trainer)
        self.settings = (sync_every, compression, memory, options)
        self.diloco: Optional[DiLoCo] = None

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self._ddp(args)
        if wrapped is None:
            return
        if wrapped is not self._wrapped:  # a second train() on the same DDP keeps its DiLoCo
            sync_every, compression, memory, options = self.settings
            scaler = getattr(self.trainer.accelerator, "scaler", None)  # fp16: it skips steps rank by rank
            self.diloco = attach_diloco(wrapped, kwargs["optimizer"], sync_every, compression, memory, options,
                                        scaler, type(self).__name__)
            self._ranks = AllRanks(DiLoCoRank(self.diloco), args.device, DiLoCoRank.reshard)
            self._wrapped = wrapped
        if state.global_step > 0:  # the Trainer resumed from a checkpoint
            self._resume(args, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.diloco is not None:
            self.diloco.sync()


def _install(trainer: Any, callback: _EveryRankCallback) -> None:
    """Add ``callback`` to ``trainer`` and make ``trainer.train`` record the checkpoint folder it
    is given, where the callback finds its state.  The DDP the Trainer wraps the model in then gets
    :data:`~._hook.BUCKET_VIEWS` (``TrainingArguments`` has no field for it): through its
    Accelerator's DDP arguments."""
    from accelerate.utils import DistributedDataParallelKwargs

    accelerator = trainer.accelerator
    if accelerator.ddp_handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs()
    for name, value in BUCKET_VIEWS.items():
        setattr(accelerator.ddp_handler, name, value)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_recording_resume(*args: Any, **kwargs: Any) -> Any:
        given = inspect.signature(train).bind_partial(*args, **kwargs).arguments
        callback.resume_from = given.get("resume_from_checkpoint")
        return train(*args, **kwargs)

    trainer.train = train_recording_resume


def register(trainer: Any, compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
             **options: Any) -> MergecompCallback:
    """Add :class:`MergecompCallback` to ``trainer`` (before ``trainer.train()``); arguments as
    :func:`mergecomp.torch.ddp_comm_hook`'s; with the Trainer's AdamW, its momentum exchanged by
    default (the module docstring).  Returns the callback."""
    callback = MergecompCallback(trainer, compression, memory, **options)
    _install(trainer, callback)
    return callback


def register_diloco(trainer: Any, sync_every: int, compression: Union[str, Compressor] = "none",
                    memory: Union[str, Memory, None] = None, **options: Any) -> DiLoCoCallback:
    """Add :class:`DiLoCoCallback` to ``trainer`` (before ``trainer.train()``): DiLoCo around the
    Trainer's optimizer; arguments as :class:`mergecomp.torch.DiLoCo`'s (``fragments``,
    ``fragment_sync_delay``, ``outer_optimizer``, ...).  Returns the callback."""
    callback = DiLoCoCallback(trainer, sync_every, compression, memory, **options)
    _install(trainer, callback)
    return callback
