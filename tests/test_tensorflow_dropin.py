"""mergecomp.tensorflow as a Horovod drop-in, on two gloo ranks: broadcast_variables of any
shape (0-d included) eagerly and inside tf.function; Compression; the Keras callbacks of
mergecomp.tensorflow.keras with model.fit; the tensor collectives; the optimizer's and tapes'
Horovod arguments; load_model; the learning-rate callbacks.

TensorFlow's import dominates a launch, so one launch of two ranks runs every part (a module
fixture) and each test checks its part of the results."""
import importlib.util

import numpy as np
import pytest

from distributed import run_workers
from test_tensorflow import ENV, _setup, loss_fn, make_data, make_model, shard, weights

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow / keras 3 not installed (pip install -e '.[tf]')")


def _all_parts(rank, path):
    return {"broadcast": _broadcast_worker(rank), "callbacks": _callbacks_worker(rank),
            "collectives": _collectives_worker(rank), "optimizer": _optimizer_worker(rank),
            "resume": _resume_and_schedule_worker(rank, path)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("keras") / "model.keras")
    return run_workers(_all_parts, 2, path, env=ENV, timeout=300)


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


def test_broadcast_variables_any_shape_eager_and_in_tf_function(ranks):
    for result in (r["broadcast"] for r in ranks):
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


def test_keras_callbacks_and_compression_on_two_ranks(ranks):
    r0, r1 = (r["callbacks"] for r in ranks)
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


def _error(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares types and messages
        return type(err).__name__, str(err)
    return None


def _collectives_worker(rank):
    import tensorflow as tf

    import mergecomp.tensorflow as mct
    import mergecomp.tensorflow.keras as mck

    _setup()
    x = tf.constant([rank + 1.0, 2.0])
    out = {
        "average": mct.allreduce(x).numpy(),
        "sum": mct.allreduce(x, op=mct.Sum).numpy(),
        "average_false": mct.allreduce(x, average=False).numpy(),
        "scaled": mct.allreduce(x, op=mct.Sum, prescale_factor=2.0, postscale_factor=0.25).numpy(),
        "int": mct.allreduce(tf.constant([rank, 10], dtype=tf.int64), op=mct.Sum).numpy(),
        "fp16": mct.allreduce(tf.constant([1.0 / 3 + rank]), compression=mct.Compression.fp16),
        "gather": mct.allgather(tf.fill([rank + 1, 2], float(rank))).numpy(),
        "broadcast": mct.broadcast(x, root_rank=1).numpy(),
        "object": mct.broadcast_object({"from": rank}, root_rank=1),
        "objects": mct.allgather_object(("rank", rank)),
        "keras": (mck.allreduce([1.0, rank]), mck.broadcast(rank, 0)),
    }
    out["fp16"] = (out["fp16"].dtype.name, out["fp16"].numpy())

    @tf.function
    def in_graph(t):
        return mct.allreduce(t, op=mct.Sum), mct.allgather(t), mct.broadcast(t, 0)

    summed, gathered, broadcast = in_graph(x)
    out["graph"] = (summed.numpy(), gathered.numpy(), broadcast.numpy(), summed.shape.as_list())
    out["errors"] = [_error(lambda: mct.allreduce(x, op=mct.Adasum)),
                     _error(lambda: mct.allreduce(x, process_set=object())),
                     _error(lambda: mct.allreduce(x, device_dense="/gpu:0")),
                     _error(lambda: mct.broadcast(x, root_rank=2))]
    return out


def test_tensor_collectives_on_two_ranks(ranks):
    r0, r1 = (r["collectives"] for r in ranks)
    for r in (r0, r1):
        np.testing.assert_array_equal(r["average"], [1.5, 2.0])
        np.testing.assert_array_equal(r["sum"], [3.0, 4.0])
        np.testing.assert_array_equal(r["average_false"], [3.0, 4.0])
        np.testing.assert_array_equal(r["scaled"], [1.5, 2.0])  # (2x0 + 2x1) / 4
        np.testing.assert_array_equal(r["int"], [1, 20])
        assert r["fp16"][0] == "float32"
        np.testing.assert_allclose(r["fp16"][1], [1.0 / 3 + 0.5], rtol=1e-3)
        np.testing.assert_array_equal(r["gather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(r["broadcast"], [2.0, 2.0])
        assert r["object"] == {"from": 1} and r["objects"] == [("rank", 0), ("rank", 1)]
        np.testing.assert_array_equal(r["keras"][0], [1.0, 0.5])
        assert int(r["keras"][1]) == 0
        summed, gathered, broadcast, shape = r["graph"]
        np.testing.assert_array_equal(summed, [3.0, 4.0])
        np.testing.assert_array_equal(gathered, [1.0, 2.0, 2.0, 2.0])
        np.testing.assert_array_equal(broadcast, [1.0, 2.0])
        assert shape == [2]
        adasum, process_set, device, root = r["errors"]
        assert adasum[0] == "NotImplementedError" and "Adasum" in adasum[1]
        assert process_set[0] == "ValueError" and "process_set" in process_set[1]
        assert device[0] == "NotImplementedError" and "device_dense" in device[1]
        assert root[0] == "ValueError" and "root_rank 2" in root[1]


def _sgd_reference(model, batches, lr):
    """Plain SGD on one process: one step per list of micro-batches, on their mean loss."""
    import tensorflow as tf

    for group in batches:
        x = np.concatenate([b[0] for b in group])
        y = np.concatenate([b[1] for b in group])
        with tf.GradientTape() as tape:
            loss = loss_fn()(y, model(x, training=True))
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            v.assign_sub(lr * g)
    return weights(model)


def _optimizer_worker(rank):
    import keras
    import tensorflow as tf

    import mergecomp.tensorflow as mct
    import mergecomp.tensorflow.keras as mck

    _setup()
    out = {}
    x, y = make_data()
    micro = 4  # 16 rows per rank: 4 micro-batches, 2 updates with 2 passes each
    for average in (True, False):
        model = make_model()
        opt = mck.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                       average_aggregated_gradients=average)
        model.compile(optimizer=opt, loss=loss_fn())
        model.fit(shard(x, rank), shard(y, rank), batch_size=micro, epochs=1, shuffle=False, verbose=0)
        mine = [(shard(x, r)[i:i + micro], shard(y, r)[i:i + micro]) for r in (0, 1) for i in range(0, 16, micro)]
        # update k: micro-batches 2k and 2k+1 of both ranks; the sum over passes doubles the step
        updates = [[mine[2 * k], mine[2 * k + 1], mine[4 + 2 * k], mine[5 + 2 * k]] for k in (0, 1)]
        out[f"passes_average={average}"] = (weights(model), int(opt.iterations.numpy()),
                                            _sgd_reference(make_model(), updates, 0.1 if average else 0.2))

    # Horovod's gradient_predivide_factor gives the plain average; local variables keep their own.
    model = make_model()
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_fn()(shard(y, rank), model(shard(x, rank), training=True))
    own = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    plain = mct.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    predivided = mct.DistributedGradientTape(tape, gradient_predivide_factor=4.0).gradient(
        loss, model.trainable_variables)
    last = model.layers[-1]
    partial = mct.PartialDistributedGradientTape(tape, local_layers=last).gradient(loss, model.trainable_variables)
    unscaled = mct.PartialDistributedGradientTape(tape, local_layers=[last], scale_local_gradients=False).gradient(
        loss, model.trainable_variables)
    out["tapes"] = (own, [g.numpy() for g in plain], [g.numpy() for g in predivided],
                    [g.numpy() for g in partial], [g.numpy() for g in unscaled], len(last.trainable_weights))
    out["tape_errors"] = [_error(lambda: mct.PartialDistributedGradientTape(tape, local_layers=[tf.Variable(1.0)])),
                          _error(lambda: mct.DistributedGradientTape(tape, op=mct.Adasum))]

    # register_local_var on the optimizer: that layer trains on each rank's own gradient.
    model = make_model()
    opt = mct.DistributedOptimizer(keras.optimizers.SGD(0.1))
    for v in model.layers[0].trainable_weights:
        opt.register_local_var(v)
    model.compile(optimizer=opt, loss=loss_fn())
    model.fit(shard(x, rank), shard(y, rank), batch_size=8, epochs=1, shuffle=False, verbose=0)
    out["local_var"] = ([np.asarray(w) for w in model.layers[0].trainable_weights],
                        [np.asarray(w) for w in model.layers[-1].trainable_weights])
    return out


def test_keras_optimizer_horovod_arguments_and_partial_tape(ranks):
    r0, r1 = (r["optimizer"] for r in ranks)
    for key in ("passes_average=True", "passes_average=False"):
        for r in (r0, r1):
            got, iterations, reference = r[key]
            assert iterations == 4, key  # every apply counts, 2 of them update
            np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(r0[key][0], r1[key][0])
    own = [r0["tapes"][0], r1["tapes"][0]]
    n_local = r0["tapes"][5]
    for rank, r in enumerate((r0, r1)):
        _, plain, predivided, partial, unscaled, _ = r["tapes"]
        for i, (a, b) in enumerate(zip(own[0], own[1], strict=True)):
            np.testing.assert_allclose(plain[i], (a + b) / 2, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(predivided[i], plain[i], rtol=1e-5, atol=1e-7)
            is_local = i >= len(own[0]) - n_local  # the last layer's kernel and bias
            np.testing.assert_allclose(partial[i], own[rank][i] / 2 if is_local else plain[i], rtol=1e-6, atol=1e-8)
            np.testing.assert_array_equal(unscaled[i], own[rank][i] if is_local else partial[i])
        wrong_layer, adasum = r["tape_errors"]
        assert wrong_layer[0] == "ValueError" and "Keras layers" in wrong_layer[1]
        assert adasum[0] == "NotImplementedError"
    local0, shared0 = r0["local_var"]
    local1, shared1 = r1["local_var"]
    assert not np.allclose(local0[0], local1[0])  # each rank's own gradient
    for a, b in zip(shared0, shared1, strict=True):
        np.testing.assert_array_equal(a, b)


def _resume_and_schedule_worker(rank, path):
    import warnings

    import keras

    import mergecomp.tensorflow.keras as mck

    _setup()
    x, y = make_data()
    xs, ys = shard(x, rank), shard(y, rank)
    model = make_model()
    model.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss=loss_fn())
    model.fit(xs, ys, batch_size=4, epochs=1, shuffle=False, verbose=0)
    if rank == 0:
        model.save(path)
    mck.barrier()
    loaded = mck.load_model(path)
    out = {"loaded_iterations": int(loaded.optimizer.iterations.numpy()),
           "distributed": hasattr(loaded.optimizer, "mergecomp_reducer")}
    model.fit(xs, ys, batch_size=4, epochs=1, shuffle=False, verbose=0)  # the original, continued
    loaded.fit(xs, ys, batch_size=4, epochs=1, shuffle=False, verbose=0)
    out["continued"], out["resumed"] = weights(model), weights(loaded)

    model = make_model()
    model.compile(optimizer=mck.DistributedOptimizer(keras.optimizers.SGD(0.4, momentum=0.9)), loss=loss_fn())
    seen = []

    class Rates(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(np.asarray(self.model.optimizer.learning_rate)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(xs, ys, batch_size=4, epochs=3, shuffle=False, verbose=0,
                            callbacks=[mck.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2), Rates()])
    out["warmup"] = (list(seen), history.history["lr"], [str(w.message) for w in caught])
    seen.clear()
    model.fit(xs, ys, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[
        mck.callbacks.LearningRateScheduleCallback(0.4, 0.5, momentum_correction=False), Rates()])
    out["staircase"] = list(seen)
    return out


def test_load_model_resumes_and_learning_rate_callbacks(ranks):
    r0, r1 = (r["resume"] for r in ranks)
    for r in (r0, r1):
        assert r["loaded_iterations"] == 4 and r["distributed"]
        np.testing.assert_array_equal(r["resumed"], r["continued"])  # momentum and counters came along
        seen, logged, warned = r["warmup"]
        # size 2, 4 steps per epoch: batch b of epoch e runs at 0.4 * (1 + (e + (b + 1) / 4) / 2) / 2
        expected = [0.4 * (1 + (e + (b + 1) / 4) / 2) / 2 for e in (0, 1) for b in range(4)] + [0.4] * 4
        np.testing.assert_allclose(seen, expected, rtol=1e-6)
        np.testing.assert_allclose(logged, [0.3, 0.4, 0.4], rtol=1e-6)
        assert any("momentum_correction is not applied" in w for w in warned)
        np.testing.assert_allclose(r["staircase"], [0.4] * 4 + [0.2] * 4 + [0.1] * 4, rtol=1e-6)
    np.testing.assert_array_equal(r0["resumed"], r1["resumed"])
