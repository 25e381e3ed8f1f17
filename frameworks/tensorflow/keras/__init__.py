"""``mergecomp.tensorflow.keras``: the TensorFlow front end under the module path Horovod's Keras
users type (``hvd.keras`` -> ``mergecomp.tensorflow.keras``), plus Keras callbacks.

Example::

    import mergecomp.tensorflow.keras as mck

    mck.init()
    model.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=...)
    model.fit(x, y, callbacks=[mck.callbacks.BroadcastGlobalVariablesCallback(0),
                               mck.callbacks.MetricAverageCallback()])
"""
from mergecomp.tensorflow import *  # noqa: F401,F403 - the same API, re-exported
from mergecomp.tensorflow import __all__ as _api

from . import callbacks

__all__ = [*_api, "callbacks"]
