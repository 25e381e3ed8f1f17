"""Keras callbacks for data-parallel ``model.fit``: one rank's starting state for every rank,
and epoch metrics averaged over ranks (put these two first in ``callbacks=``)."""
from __future__ import annotations

import numbers

import keras
import numpy as np
import torch

from mergecomp.runtime import communicator

from ..functions import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]


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
