"""mergecomp.tensorflow as a Horovod drop-in, on two gloo ranks: broadcast_variables of any
shape (0-d included) eagerly and inside tf.function; Compression; the Keras callbacks of
mergecomp.tensorflow.keras with model.fit."""
import importlib.util

import numpy as np
import pytest

from distributed import run_workers
from test_tensorflow import ENV, _setup, loss_fn, make_data, make_model, shard, weights

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


def _callbacks_worker(rank):
    import keras

    import mergecomp.registry
    import mergecomp.tensorflow.keras as mck
    import mergecomp.torch

    _setup()
    out = {"compression": (mck.Compression is mergecomp.registry.Compression is mergecomp.torch.Compression,
                           mck.Compression.none, mck.Compression.fp16, mck.Compression.topk,
                           mck.GradientReducer(compression=mck.Compression.topk).compressor.__class__.__name__)}
    x, y = make_data()
    model = make_model(seed=rank)  # the ranks start from different weights
    out["start"] = weights(model)
    raw = []

    class Raw(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raw.append(dict(logs))

    model.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     compression=mck.Compression.fp16, groups=2),
                  loss=loss_fn(), metrics=["accuracy"])
    history = model.fit(shard(x, rank), shard(y, rank), batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[mck.callbacks.BroadcastGlobalVariablesCallback(0), Raw(),
                                   mck.callbacks.MetricAverageCallback()])
    out["end"] = weights(model)
    out["optimizer"] = [np.asarray(v.numpy()) for v in model.optimizer.variables]
    out["raw"], out["logged"] = raw, history.history

    # A model without an input shape is unbuilt at on_train_begin (Keras 3.15): broadcast after batch 1.
    keras.utils.set_random_seed(rank)
    lazy = keras.Sequential([keras.layers.Dense(4)])
    lazy.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=loss_fn())
    callback = mck.callbacks.BroadcastGlobalVariablesCallback(0)
    lazy.fit(shard(x, rank), shard(y, rank), batch_size=8, epochs=2, shuffle=False, verbose=0,
             callbacks=[callback])
    out["lazy"] = (weights(lazy), callback.broadcast_done)
    return out


def test_keras_callbacks_and_compression_on_two_ranks():
    r0, r1 = run_workers(_callbacks_worker, 2, env=ENV, timeout=170)
    assert r0["compression"] == (True, "none", "fp16", "topk", "TopKCompressor")
    assert not np.allclose(r0["start"], r1["start"])
    np.testing.assert_array_equal(r0["end"], r1["end"])  # broadcast at the start, same averaged steps
    assert not np.allclose(r0["end"], r0["start"])
    for a, b in zip(r0["optimizer"], r1["optimizer"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(r0["logged"]) == {"loss", "accuracy"}
    for name in ("loss", "accuracy"):
        assert r0["logged"][name] == r1["logged"][name]
        mean = [(a[name] + b[name]) / 2 for a, b in zip(r0["raw"], r1["raw"])]
        np.testing.assert_allclose(r0["logged"][name], mean, rtol=1e-12)
    assert [e["loss"] for e in r0["raw"]] != [e["loss"] for e in r1["raw"]]  # the ranks' own values differ
    assert r0["lazy"][1] and r1["lazy"][1]
    np.testing.assert_array_equal(r0["lazy"][0], r1["lazy"][0])
