"""``mergecomp.tensorflow.keras``: the TensorFlow front end under the module path Horovod's Keras
users type (``hvd.keras`` -> ``mergecomp.tensorflow.keras``), with ``horovod.tensorflow.keras``'s
signatures where they differ from ``horovod.tensorflow``'s: ``DistributedOptimizer``'s
positional order, ``allreduce``/``allgather``/``broadcast`` taking and returning plain values,
``load_model``, and the Keras callbacks.

Example::

    import mergecomp.tensorflow.keras as mck

    mck.init()
    model.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=...)
    model.fit(x, y, callbacks=[mck.callbacks.BroadcastGlobalVariablesCallback(0),
                               mck.callbacks.MetricAverageCallback()])
"""
from typing import Any, Optional

import numpy as np

from mergecomp.horovod_api import elastic_on_first_use
from mergecomp.horovod_api.arguments import Average
from mergecomp.registry import Compression
from mergecomp.tensorflow import *  # noqa: F401,F403 - the same API, re-exported
from mergecomp.tensorflow import __all__ as _api
from mergecomp.tensorflow import collectives as _tensors
from mergecomp.tensorflow import optimizer as _optimizer

from . import callbacks

__all__ = [*_api, "callbacks", "load_model"]


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = "auto", process_set: Any = None,
                         scale_local_gradients: bool = True, **options):
    """:func:`mergecomp.tensorflow.DistributedOptimizer` with ``horovod.tensorflow.keras``'s
    positional order; mergecomp's own options (``memory``, ``nonfinite``, ``scheduler``,
    ``compression_warmup_steps``, ``compression_warmup_codec``, ``uncompressed``, ``min_compress_numel``,
    ``scheme``) as keywords."""
    return _optimizer.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients, **options)


def allreduce(value, name: Optional[str] = None, average: Optional[bool] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none
              ) -> np.ndarray:
    """The reduction over ranks of ``value`` (anything ``tf.convert_to_tensor`` takes), as a
    numpy value; see :func:`mergecomp.tensorflow.allreduce`."""
    return _tensors.allreduce(value, average, compression=compression, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, name=name).numpy()


def allgather(value, name: Optional[str] = None) -> np.ndarray:
    """Every rank's ``value`` concatenated along dimension 0, as a numpy value."""
    return _tensors.allgather(value, name).numpy()


def broadcast(value, root_rank: int, name: Optional[str] = None) -> np.ndarray:
    """Rank ``root_rank``'s ``value`` on every rank, as a numpy value."""
    return _tensors.broadcast(value, root_rank, name).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression: Any = Compression.none, **options):
    """Load a Keras model saved with its optimizer and make that optimizer distributed, its
    state (iterations, slots) kept: training resumes where the saved model stopped.

    ``custom_optimizers``: optimizer classes that are not Keras' own; ``custom_objects`` as in
    ``keras.models.load_model``; ``compression`` and mergecomp's options (``groups``,
    ``memory`` ...) as in :func:`DistributedOptimizer`.  The model must have been saved
    compiled (``model.save("x.keras")`` after ``compile``).
    """
    import keras

    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"load_model: {filepath!r} holds no optimizer (was the model compiled when it was saved?)")
    _optimizer.make_distributed(model.optimizer, compression=compression, **options)
    return model


#: ``mck.elastic`` (Horovod's elastic API), imported on first use: it needs Horovod
__getattr__ = elastic_on_first_use(__name__)
