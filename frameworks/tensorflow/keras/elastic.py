"""Horovod's elastic API for Keras, ``hvd.elastic`` of ``horovod.tensorflow.keras``: the state of
a model trained with ``model.fit`` and the callbacks that keep it::

    import mergecomp.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss=...)
    model.build(input_shape)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])

    train(hvd.elastic.KerasState(model, batch=0, epoch=0))

What a state holds and how a reset treats it: :mod:`mergecomp.tensorflow.elastic`.
"""
from __future__ import annotations

from typing import Any

import keras

from mergecomp.tensorflow.elastic import HorovodInternalError, HostsUpdatedInterrupt, TensorFlowKerasState, run

__all__ = ["run", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "HorovodInternalError", "HostsUpdatedInterrupt"]


class KerasState(TensorFlowKerasState):
    """A Keras ``model`` (built), its ``optimizer`` (default: the compiled one) and further
    keyword arguments (``batch``, ``epoch`` for the callbacks below) as attributes."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` after every ``batches_per_commit`` batches and at each epoch's end
    (the count starts again whenever training does, after every reset, on every rank alike)."""

    def __init__(self, state: TensorFlowKerasState, batches_per_commit: int = 1) -> None:
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive int, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._batches = 0

    def on_train_begin(self, logs=None):
        self._batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches == self.batches_per_commit:
            self._batches = 0
            self.state.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """``state.batch``: the batch of the epoch finished last (0 at an epoch's end).  Horovod's
    shortens an epoch entered again after a reset to its remaining batches through
    ``params["steps"]``, which Keras 3's ``fit`` does not read again: here such an epoch runs
    as many batches as its data gives (read ``state.batch`` to skip them in the data)."""

    def __init__(self, state: TensorFlowKerasState) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """``state.epoch``: epochs finished over every ``fit`` since the job began (Keras counts
    from 0 in each ``fit``, and a reset starts a new one)."""

    def __init__(self, state: TensorFlowKerasState) -> None:
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs=None):
        self._first = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first + epoch + 1
