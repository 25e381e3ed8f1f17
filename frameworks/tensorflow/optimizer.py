"""Keras 3 ``DistributedOptimizer`` and ``DistributedGradientTape``: the same exchange as
``mergecomp.torch``, reached through :func:`~.ops.allreduce_gradients`.

The optimizer is the wrapped optimizer's own class with one method overridden: ``apply``
(which Keras' ``apply_gradients`` and ``model.fit`` call) averages the gradients over ranks and
then runs the original ``apply`` (loss-scale unscaling, clipping, weight decay, the update).
"""
from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf

from mergecomp.memory import warn_double_momentum
from mergecomp.scheduler import SchedulerConfig

from .ops import allreduce_gradients
from .reducer import GradientReducer

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "Average", "Sum"]

Average = "average"
Sum = "sum"

_CLASSES: Dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """``base`` with ``apply`` exchanging gradients first; same name and module as ``base``, so a
    saved model's config reloads as the plain optimizer."""
    if base not in _CLASSES:
        class Distributed(base):
            def apply(self, grads, trainable_variables=None):
                variables = (list(trainable_variables) if trainable_variables is not None
                             else list(self._trainable_variables))
                grads = allreduce_gradients(self.mergecomp_reducer, list(grads), variables)
                return super().apply(grads, trainable_variables)

        Distributed.__name__ = Distributed.__qualname__ = base.__name__
        Distributed.__module__ = base.__module__
        _CLASSES[base] = Distributed
    return _CLASSES[base]


def DistributedOptimizer(optimizer, compression="none", memory=None, groups="auto", op: str = Average,
                         nonfinite: str = "raise", scheduler: Optional[SchedulerConfig] = None):
    """Wrap a Keras 3 optimizer so that gradients are merged, compressed and averaged across ranks.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` that has not been used yet (it is rebuilt
            from its config, like Horovod does).
        compression, memory, groups, op, nonfinite, scheduler: as in
            :class:`~.reducer.GradientReducer` (and ``mergecomp.torch.DistributedOptimizer``);
            ``nonfinite`` is ``"raise"`` or ``"ignore"``.

    Returns an optimizer of the same class; ``optimizer.mergecomp_reducer`` holds the groups,
    the error-feedback state (``state_dict()``) and the scheduler's report.

    Example::

        opt = mct.DistributedOptimizer(keras.optimizers.SGD(0.01 * mct.size()), compression="topk")
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y)            # graph mode (tf.function); jit_compile must stay False
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"mergecomp.tensorflow needs Keras on the TensorFlow backend, not "
                         f"{keras.backend.backend()!r} (set KERAS_BACKEND=tensorflow; for PyTorch use mergecomp.torch)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is used: DistributedOptimizer rebuilds it from its "
                         "config, which would drop its state (slots, iterations)")
    reducer = GradientReducer(compression, memory, groups, op, nonfinite, scheduler)
    warn_double_momentum(reducer.memory, getattr(optimizer, "momentum", 0))
    wrapped = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped.mergecomp_reducer = reducer
    return wrapped


_TAPE_REDUCERS: Dict[tuple, GradientReducer] = {}


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``: ``gradient()`` returns the gradients averaged over ranks.

    Horovod's pattern, creating the wrapper every step, keeps error-feedback state: the reducer
    is shared by every tape with the same settings and the same variables (or pass ``reducer``).

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = mct.DistributedGradientTape(tape, compression="topk", groups=2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape: tf.GradientTape, compression="none", memory=None, groups="auto",
                 op: str = Average, nonfinite: str = "raise", scheduler: Optional[SchedulerConfig] = None,
                 reducer: Optional[GradientReducer] = None) -> None:
        self._tape = gradtape
        self._reducer = reducer
        self._settings = (compression, memory, groups, op, nonfinite, scheduler)

    def _reducer_for(self, variables) -> GradientReducer:
        if self._reducer is None:
            key = (repr(self._settings), tuple(id(v) for v in variables))
            if key not in _TAPE_REDUCERS:
                _TAPE_REDUCERS[key] = GradientReducer(*self._settings)
            self._reducer = _TAPE_REDUCERS[key]
        return self._reducer

    @property
    def reducer(self) -> Optional[GradientReducer]:
        return self._reducer

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = allreduce_gradients(self._reducer_for(flat_sources), flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(sources, reduced)

    def __getattr__(self, name):
        return getattr(self._tape, name)
