"""mergecomp's DDP communication hook in a Hugging Face ``transformers.Trainer``::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    register(trainer, "topk")
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)

With AdamW (or Adam), ``register(trainer, "onebit", exchange_momentum_after=K)`` exchanges its
momentum instead of its gradients after ``K`` updates (:mod:`mergecomp.torch.momentum_hook`): the
callback hands the Trainer's optimizer (and, under fp16, its ``GradScaler``) to the hook.
``exchange_momentum_after="auto"`` takes the compressor's recipe, ``K`` scaled to the run's LR
warm-up (:func:`run_length`).

The callback registers the hook on ``trainer.model_wrapped`` when training begins (the Trainer
wraps the model in DDP just before), writes every rank's hook state into each checkpoint folder
(``mergecomp_ddp_hook.pt``, from rank 0) and, when the Trainer resumes, gives each rank its own
back.  The folder it resumes from is the one given to ``trainer.train(resume_from_checkpoint=...)``
(``register`` records it), else ``TrainingArguments.resume_from_checkpoint`` when that is set,
else ``<output_dir>/checkpoint-<global step>``, where the Trainer writes and
``train(resume_from_checkpoint=True)`` finds its checkpoints; a resumed run whose folder holds no
such file (a checkpoint saved without mergecomp) logs a warning and starts the error feedback
afresh.
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
from mergecomp.torch.ddp_hook import DDPHookState, check_settings
from mergecomp.torch.momentum_exchange import OPTION as MOMENTUM_OPTION
from mergecomp.torch.momentum_recipes import AUTO, TOTAL_OPTION, WARMUP_OPTION

from ._hook import attach
from ._ranks import AllRanks

__all__ = ["MergecompCallback", "register", "run_length", "STATE_FILE"]

logger = logging.getLogger("mergecomp")

#: the file in each checkpoint folder holding every rank's hook state
STATE_FILE = "mergecomp_ddp_hook.pt"


def run_length(args: Any, max_steps: int) -> Dict[str, int]:
    """``exchange_momentum_after="auto"``'s view of the run (:mod:`mergecomp.torch.momentum_recipes`):
    its updates and its LR warm-up's (``TrainingArguments.get_warmup_steps``; 0: none, then 5 %
    of the updates stands for it)."""
    return {TOTAL_OPTION: max_steps, WARMUP_OPTION: int(args.get_warmup_steps(max_steps))}


class MergecompCallback(TrainerCallback):
    """The callback :func:`register` adds to ``trainer`` (see the module docstring).

    ``hook_state`` is the hook's :class:`~mergecomp.torch.ddp_hook.DDPHookState` once training
    has begun on several processes; None on one process (the Trainer does not use DDP there).
    """

    def __init__(self, trainer: Any, compression: Union[str, Compressor] = "none",
                 memory: Union[str, Memory, None] = None, **options: Any) -> None:
        #: ``exchange_momentum_after="auto"``: the run's length is known when training begins
        self.auto = options.get(MOMENTUM_OPTION) == AUTO
        check_settings(compression, memory, True,  # "auto": any run stands in for the one to come
                       **({TOTAL_OPTION: 1, **options} if self.auto else options))
        self.trainer = trainer
        self.settings = (compression, memory, options)
        self.hook_state: Optional[DDPHookState] = None
        #: the folder given to the last ``trainer.train(resume_from_checkpoint=...)`` (:func:`register`)
        self.resume_from: Any = None
        self._ranks: Optional[AllRanks] = None
        self._wrapped = None  # the DDP model the hook is on

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            if args.world_size > 1:
                raise TypeError(f"mergecomp: the Trainer wrapped the model in {type(wrapped).__name__}, not "
                                f"DistributedDataParallel; the mergecomp hook needs DDP (FSDP and DeepSpeed are "
                                f"not supported)")
            return
        if wrapped is not self._wrapped:  # a second train() on the same DDP keeps its hook
            compression, memory, options = self.settings
            if self.auto:
                options = {**run_length(args, state.max_steps), **options}
            self.hook_state = attach(wrapped, compression, memory, options, who="MergecompCallback")
            self._ranks, self._wrapped = AllRanks(self.hook_state, args.device), wrapped
        scaler = getattr(self.trainer.accelerator, "scaler", None)  # the optimizer's state loaded when it resumes
        self.hook_state.train_with(kwargs["optimizer"], scaler if scaler is not None and scaler.is_enabled() else None,
                                   "MergecompCallback")
        if state.global_step > 0:  # the Trainer resumed from a checkpoint
            self._resume(args, state.global_step)

    def _resume(self, args, step: int) -> None:
        folder = next((f for f in (self.resume_from, args.resume_from_checkpoint)
                       if isinstance(f, str) and os.path.isdir(f)), None)
        if folder is None:
            folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            logger.warning("MergecompCallback: resuming at step %d, but %s does not exist: the hook's "
                           "error feedback starts afresh (set TrainingArguments.resume_from_checkpoint to the "
                           "checkpoint folder if the Trainer resumed from another one)", step, path)
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
            raise RuntimeError(f"MergecompCallback: the Trainer's checkpoint folder {folder} does not exist "
                               f"(hyperparameter search saves to per-trial folders: not supported)")
        torch.save(record, os.path.join(folder, STATE_FILE))


def register(trainer: Any, compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
             **options: Any) -> MergecompCallback:
    """Add :class:`MergecompCallback` to ``trainer`` (before ``trainer.train()``); arguments as
    :func:`mergecomp.torch.ddp_comm_hook`'s (``exchange_momentum_after=K`` with the Trainer's
    AdamW: its momentum exchanged).  ``trainer.train`` then records the checkpoint folder it is
    given, where the callback finds the hook's state.  Returns the callback."""
    callback = MergecompCallback(trainer, compression, memory, **options)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_recording_resume(*args: Any, **kwargs: Any) -> Any:
        given = inspect.signature(train).bind_partial(*args, **kwargs).arguments
        callback.resume_from = given.get("resume_from_checkpoint")
        return train(*args, **kwargs)

    trainer.train = train_recording_resume
    return callback
