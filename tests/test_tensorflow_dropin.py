"""mergecomp.tensorflow as a Horovod drop-in, on two gloo ranks: broadcast_variables of any
shape (0-d included) eagerly and inside tf.function."""
import importlib.util

import numpy as np
import pytest

from distributed import run_workers
from test_tensorflow import ENV, _setup

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow / keras 3 not installed (pip install -e '.[tf]')")


def _variables(tf, keras, rank):
    base = 10 * (rank + 1)
    return [tf.Variable(np.float32(base + 0.5)),
            tf.Variable(np.int64(base)),
            tf.Variable(np.arange(3, dtype="float32") + base),
            tf.Variable(np.arange(6, dtype="int64").reshape(2, 3) + base),
            keras.Variable(np.int64(base), dtype="int64", trainable=False),  # like optimizer.iterations
            keras.Variable(np.ones((2, 2), "float32") * base)]


def _broadcast_worker(rank):
    import keras
    import tensorflow as tf

    import mergecomp.tensorflow as mct

    _setup()
    out = {}
    eager = _variables(tf, keras, rank)
    mct.broadcast_variables(eager, root_rank=0)
    out["eager"] = [np.asarray(v.numpy()) for v in eager]

    graph = _variables(tf, keras, rank)

    @tf.function
    def first_step():
        mct.broadcast_variables(graph, root_rank=0)

    first_step()
    out["graph"] = [np.asarray(v.numpy()) for v in graph]
    out["expected"] = [np.asarray(v.numpy()) for v in _variables(tf, keras, 0)]
    return out


def test_broadcast_variables_any_shape_eager_and_in_tf_function():
    for result in run_workers(_broadcast_worker, 2, env=ENV, timeout=170):
        for mode in ("eager", "graph"):
            for got, want in zip(result[mode], result["expected"], strict=True):
                assert got.shape == want.shape and got.dtype == want.dtype, mode
                np.testing.assert_array_equal(got, want)
