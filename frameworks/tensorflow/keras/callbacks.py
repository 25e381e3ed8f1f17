"""Keras callbacks for data-parallel ``model.fit``: one rank's starting state for every rank,
epoch metrics averaged over ranks (put these two first in ``callbacks=``), and Horovod's
learning-rate schedule and warm-up."""
from __future__ import annotations

import numbers
import warnings
from typing import Callable, Optional, Union

import keras
import numpy as np
import torch

from mergecomp.horovod_api.runtime import communicator, rank, size

from ..functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Copy rank ``root_rank``'s model and optimizer variables to every rank once, before the
    first training step (so all ranks start identical, whatever their initial weights).

    The optimizer is built first if Keras has not built it yet, so its slots and iteration
    counter are broadcast too.  A model not yet built when training begins (a subclassed model
    without an input shape) is broadcast after its first batch instead.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace every number in the epoch-end ``logs`` (loss, metrics, validation metrics) by its
    mean over ranks, so the History, checkpoints and early stopping agree on every rank.

    Every rank must log the same names.  Put it before callbacks that read ``logs``.
    """

    def on_epoch_end(self, epoch, logs=None):
        comm = communicator()
        if logs is None or comm.size == 1:
            return
        names = sorted(k for k, v in logs.items() if isinstance(v, numbers.Number) or np.ndim(v) == 0)
        if not names:
            return
        values = torch.tensor([float(logs[k]) for k in names], dtype=torch.float64, device=comm.device)
        totals = comm.allreduce_(values, "metric average").tolist()
        for name, total in zip(names, totals):
            logs[name] = total / comm.size


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the optimizer's learning rate to ``initial_lr * multiplier(epoch)`` during epochs
    ``start_epoch`` <= epoch < ``end_epoch`` (``end_epoch`` None: to the end of training).

    ``multiplier``: a function of the epoch, or a number ``m`` meaning ``m ** (epoch -
    start_epoch)``.  ``staircase=True`` sets it at the first batch of each epoch with the whole
    epoch; ``False`` at every batch with the fractional epoch ``epoch + batch /
    steps_per_epoch`` (``steps_per_epoch`` None: Keras' ``steps`` for this ``fit``).

    ``momentum_correction`` (Goyal et al., 2017) scales the momentum by new/old learning rate
    for the batch where the rate changes.  Keras 3 compiles an optimizer's momentum into the
    training step as a constant, so it cannot be changed during ``fit``: a warning says so when
    the optimizer has a momentum, and nothing else happens.  The rate itself is a variable and
    changes as asked.  The epoch's rate is logged as ``lr``.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]], start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required (the learning rate the multiplier scales)")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _learning_rate(self) -> float:
        return float(np.asarray(self.model.optimizer.learning_rate))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: Keras does not know the number of steps per epoch "
                                 f"for this fit(); pass steps_per_epoch=")
        if self.momentum_correction and getattr(self.model.optimizer, "momentum", 0):
            warnings.warn(f"{type(self).__name__}: momentum_correction is not applied: Keras 3 compiles the "
                          f"optimizer's momentum into the training step as a constant (pass "
                          f"momentum_correction=False to silence this)", stacklevel=2)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            self._set(epoch + batch / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._learning_rate()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raise the learning rate linearly from ``initial_lr / size()`` to ``initial_lr`` over the
    first ``warmup_epochs`` epochs, batch by batch (Goyal et al., 2017: start a large-batch job
    at the single-worker rate).  ``initial_lr`` is the rate scaled for all ranks (e.g.
    ``0.01 * size()``); the rate reached at the end of each epoch is a round fraction of it.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0):
        super().__init__(initial_lr, self._ramp, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _ramp(self, epoch: float) -> float:
        done = epoch + 1.0 / self.steps_per_epoch  # batch b of epoch e ends at e + (b + 1) / steps
        n = size()
        return (1.0 + done * (n - 1) / self.warmup_epochs) / n

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._learning_rate():g}.")
