"""Keras 3 ``DistributedOptimizer``, ``DistributedGradientTape`` and
``PartialDistributedGradientTape``: the same exchange as ``mergecomp.torch``, reached through
:func:`~.ops.exchange_gradients`, with Horovod's arguments in Horovod's order.

The optimizer is the wrapped optimizer's own class with one method overridden: ``apply``
(which Keras' ``apply_gradients`` and ``model.fit`` call) averages the gradients over ranks and
then runs the original ``apply`` (loss-scale unscaling, clipping, weight decay, the update).
With ``backward_passes_per_step`` N > 1 the gradients are summed locally and the update runs
on every N-th call only; the calls in between only count ``iterations`` (as Horovod's do).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import tensorflow as tf

from mergecomp.compressors.memories import warn_double_momentum
from mergecomp.horovod_api.arguments import Average, check_horovod_args, check_process_set, resolve_groups
from mergecomp.registry import Compression

from .collectives import check_devices
from .ops import exchange_gradients, variable_name
from .reducer import GradientReducer

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape", "make_distributed"]

_CLASSES: Dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """``base`` with ``apply`` exchanging gradients first; same name and module as ``base``, so a
    saved model's config reloads as the plain optimizer."""
    if base not in _CLASSES:
        class Distributed(base):
            def apply(self, grads, trainable_variables=None):
                variables = (list(trainable_variables) if trainable_variables is not None
                             else list(self._trainable_variables))
                reducer = self.mergecomp_reducer
                local = [id(v) in self.mergecomp_local for v in variables]
                grads, ready = exchange_gradients(reducer, list(grads), variables, local)
                update = super().apply
                if reducer.passes == 1:
                    return update(grads, trainable_variables)
                if not self.built:  # the slots must exist before the branch that updates them
                    self.build(variables)

                def apply_now():
                    update(grads, trainable_variables)

                def count_only():
                    self.iterations.assign_add(1)

                tf.cond(ready, apply_now, count_only)

            def register_local_var(self, var) -> None:
                """Keep this rank's own gradient for ``var`` (not exchanged; divided by the number
                of ranks unless ``scale_local_gradients=False``).  Call before the first step."""
                if self.mergecomp_reducer.bound:
                    raise RuntimeError("register_local_var() must be called before the first training step")
                self.mergecomp_local.add(id(var))

        Distributed.__name__ = Distributed.__qualname__ = base.__name__
        Distributed.__module__ = base.__module__
        _CLASSES[base] = Distributed
    return _CLASSES[base]


def DistributedOptimizer(optimizer, name: Optional[str] = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = "auto",
                         process_set: Any = None, scale_local_gradients: bool = True, **options):
    """Wrap a Keras 3 optimizer so that gradients are merged, (optionally) compressed and
    averaged across ranks.  Positional arguments in ``horovod.tensorflow``'s order
    (``mergecomp.tensorflow.keras.DistributedOptimizer`` takes ``horovod.tensorflow.keras``'s).

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` that has not been used yet (it is rebuilt
            from its config, like Horovod does).
        name: a new name for the optimizer (default: its own).
        use_locking, device_dense, device_sparse: Horovod's TF1 and device options: only their
            defaults are accepted (NotImplementedError otherwise).
        compression: ``Compression.none`` (default: lossless), ``Compression.fp16`` or any
            mergecomp compressor (name or ``Compression.<name>``).
        sparse_as_dense: ``tf.IndexedSlices`` gradients are exchanged densely either way;
            True does so without a warning.
        backward_passes_per_step: sum the gradients of this many ``apply`` calls locally and
            exchange and apply them on the last one.
        op: ``Average`` (default) or ``Sum`` (``Adasum`` raises NotImplementedError).
        gradient_predivide_factor: with ``Average``: divide by it before the sum, multiply the
            sum by ``factor / size`` (Horovod's formula).
        average_aggregated_gradients: divide the locally summed gradients by
            ``backward_passes_per_step`` (Horovod's default, False, sums them).
        num_groups, groups: Horovod's grouping: an int, lists of variables or of their names;
            mergecomp's own ``groups`` specs too (default ``"auto"``: the online scheduler).
        process_set: only the global one (None or ``global_process_set``).
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the number of ranks.
        options: mergecomp's own, as keywords, as in :class:`~.reducer.GradientReducer`:
            ``memory``, ``nonfinite`` (``"propagate"``, the default: NaN/Inf on any rank makes
            every rank's gradients NaN, which a ``LossScaleOptimizer`` skips; ``"raise"``;
            ``"ignore"``),
            ``scheduler``, ``compression_warmup_steps``, ``compression_warmup_codec``, ``uncompressed``,
            ``min_compress_numel``, ``scheme``.

    Mixed precision (``mixed_float16``): wrap the ``LossScaleOptimizer``, as in
    ``DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))``; the gradients are then
    exchanged before its overflow check, and under ``"propagate"`` an overflow on any rank gives
    every rank NaN, so every rank skips the step and lowers its scale.  An optimizer Keras would
    wrap itself (any other under that policy) raises ValueError saying so.

    Returns an optimizer of the same class; ``optimizer.mergecomp_reducer`` holds the groups,
    the error-feedback state (``state_dict()``) and the scheduler's report.

    Example::

        opt = mct.DistributedOptimizer(keras.optimizers.SGD(0.01 * mct.size()),
                                       compression=mct.Compression.topk)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
        model.fit(x, y)            # graph mode (tf.function); jit_compile must stay False
    """
    _check_keras_optimizer(optimizer)
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is used: DistributedOptimizer rebuilds it from its "
                         "config, which would drop its state (slots, iterations)")
    if use_locking:
        raise NotImplementedError("use_locking applies to TF1 optimizers; Keras 3 optimizers have no such option")
    check_devices(device_dense, device_sparse, "DistributedOptimizer")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return make_distributed(type(optimizer).from_config(config), compression=compression,
                            sparse_as_dense=sparse_as_dense, op=op, backward_passes_per_step=backward_passes_per_step,
                            gradient_predivide_factor=gradient_predivide_factor,
                            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
                            **options)


def _check_keras_optimizer(optimizer) -> None:
    import keras

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"mergecomp.tensorflow needs Keras on the TensorFlow backend, not "
                         f"{keras.backend.backend()!r} (set KERAS_BACKEND=tensorflow; for PyTorch use mergecomp.torch)")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if _mixed_float16() and not _loss_scaled(optimizer):
        raise ValueError(
            "under the mixed_float16 policy Keras wraps the optimizer in a LossScaleOptimizer, whose overflow "
            "check runs on each rank before the exchange and would skip it on some ranks only; wrap the "
            "LossScaleOptimizer instead: DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer))")


def _refuse_momentum_exchange(options: Dict[str, Any]) -> None:
    """NotImplementedError naming the option for the torch front end's momentum exchange: it
    reads and writes Adam's two moments every step, and Keras 3's Adam keeps them in private
    lists with no public accessor."""
    for option in ("exchange_momentum_after", "variance_refresh_every"):
        if option in options:
            raise NotImplementedError(
                f"{option} is mergecomp.torch's (torch.optim.Adam/AdamW): Keras 3's Adam keeps its moments "
                f"private, so mergecomp.tensorflow exchanges gradients only")


def _loss_scaled(optimizer) -> bool:
    import keras

    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _mixed_float16() -> bool:
    """Keras' global dtype policy is ``mixed_float16`` (losses are scaled, gradients overflow)."""
    import keras

    return keras.mixed_precision.global_policy().name == "mixed_float16"


def make_distributed(optimizer, compression: Any = Compression.none, sparse_as_dense: bool = False,
                     op: Any = Average, backward_passes_per_step: int = 1, gradient_predivide_factor: float = 1.0,
                     average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = "auto",
                     process_set: Any = None, scale_local_gradients: bool = True, **options):
    """Turn ``optimizer`` itself, state included, into its distributed class (what
    :func:`DistributedOptimizer` returns) and give it its reducer; returns it.  ``options``:
    :class:`~.reducer.GradientReducer`'s keywords (``memory``, ``nonfinite``, ``scheduler`` ...)."""
    _check_keras_optimizer(optimizer)
    _refuse_momentum_exchange(options)
    if hasattr(optimizer, "mergecomp_reducer"):
        raise TypeError("the optimizer is already a mergecomp DistributedOptimizer")
    check_process_set(process_set)
    reducer = GradientReducer(compression, groups=resolve_groups(groups, num_groups, variable_name), op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              backward_passes_per_step=backward_passes_per_step,
                              average_aggregated_gradients=average_aggregated_gradients,
                              scale_local_gradients=scale_local_gradients, **options)
    reducer.warn_sparse = not sparse_as_dense
    warn_double_momentum(reducer.memory, getattr(optimizer, "momentum", 0))
    optimizer.__class__ = _distributed_class(type(optimizer))  # adds methods only: the state stays as it is
    optimizer.mergecomp_reducer = reducer
    optimizer.mergecomp_local = set()
    return optimizer


_TAPE_REDUCERS: Dict[tuple, GradientReducer] = {}


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``: ``gradient()`` returns the gradients averaged over ranks.
    Positional arguments in Horovod's order; the options mean what they mean for
    :func:`DistributedOptimizer`.

    Horovod's pattern, creating the wrapper every step, keeps error-feedback state: the reducer
    is shared by every tape with the same settings, variables and local sources (or pass
    ``reducer``).  Under the ``mixed_float16`` policy the loop's ``LossScaleOptimizer`` sees an
    overflow on any rank as NaN on every rank (``nonfinite="propagate"``, the default) and skips
    the step everywhere.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = mct.DistributedGradientTape(tape, compression=mct.Compression.topk, groups=2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = "auto",
                 process_set: Any = None, scale_local_gradients: bool = True, *,
                 reducer: Optional[GradientReducer] = None, **options) -> None:
        check_devices(device_dense, device_sparse, "DistributedGradientTape")
        check_horovod_args(op, gradient_predivide_factor)
        _refuse_momentum_exchange(options)
        check_process_set(process_set)
        self._tape = gradtape
        self._reducer = reducer
        self._options = dict(compression=compression, groups=resolve_groups(groups, num_groups, variable_name),
                             op=op, gradient_predivide_factor=gradient_predivide_factor,
                             scale_local_gradients=scale_local_gradients, **options)
        self._sparse_as_dense = sparse_as_dense
        self._local: set = set()

    def register_local_source(self, source) -> None:
        """Return this rank's own gradient for ``source`` (not exchanged; divided by the number
        of ranks unless ``scale_local_gradients=False``)."""
        self._local.add(id(source))

    def _reducer_for(self, variables) -> GradientReducer:
        if self._reducer is None:
            key = (repr(sorted(self._options.items())), tuple(id(v) for v in variables), frozenset(self._local))
            if key not in _TAPE_REDUCERS:
                _TAPE_REDUCERS[key] = GradientReducer(**self._options)
            self._reducer = _TAPE_REDUCERS[key]
        self._reducer.warn_sparse = not self._sparse_as_dense
        return self._reducer

    @property
    def reducer(self) -> Optional[GradientReducer]:
        return self._reducer

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        local = [id(s) in self._local for s in flat_sources]
        reduced, _ = exchange_gradients(self._reducer_for(flat_sources), flat_grads, flat_sources, local)
        return tf.nest.pack_sequence_as(sources, reduced)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = "auto", process_set: Any = None, local_layers: Sequence = None,
                                   scale_local_gradients: bool = True, **options) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` that keeps the gradients of ``local_layers``' trainable
    weights on each rank (a Keras layer or a list of layers; divided by the number of ranks
    unless ``scale_local_gradients=False``)."""
    import keras

    layers = [] if local_layers is None else [local_layers] if isinstance(local_layers, keras.layers.Layer) \
        else list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError("local_layers must be Keras layers (keras.layers.Layer)")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
                                   **options)
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
