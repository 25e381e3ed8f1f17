"""mergecomp.tensorflow on real processes (gloo over loopback): Keras ``model.fit`` in graph mode
and ``DistributedGradientTape`` against single-process training, compressors, sparse gradients,
errors.  TensorFlow is imported only in the spawned workers (slow import: several checks each)."""
import importlib.util
import math

import numpy as np
import pytest
from distributed import run_workers

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow / keras 3 not installed (pip install -e '.[tf]')")

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
BATCH = 32


def make_data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 16)).astype("float32")
    y = (x @ rng.standard_normal((16, 4))).argmax(axis=1).astype("int32")
    return x, y


def shard(array, rank, world=2):
    per = array.shape[0] // world
    return array[rank * per:(rank + 1) * per]


def _setup():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def make_model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4)])


def make_embedding_model():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(50, 8),
                             keras.layers.Flatten(), keras.layers.Dense(4)])


def weights(model):
    return np.concatenate([np.asarray(w).reshape(-1) for w in model.trainable_weights])


def loss_fn():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit(model, optimizer, x, y, epochs, **compile_args):
    model.compile(optimizer=optimizer, loss=loss_fn(), **compile_args)
    history = model.fit(x, y, batch_size=x.shape[0], epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"]


# -- training on two ranks ---------------------------------------------------------------------
def _training_worker(rank):
    import warnings

    import keras
    import tensorflow as tf

    import mergecomp.tensorflow as mct

    _setup()
    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)
    out = {}

    # Reference: one process on the joined batch.
    reference = make_model()
    fit(reference, keras.optimizers.SGD(0.1, momentum=0.9), x, y, epochs=8)

    # model.fit, graph mode; rank 1 starts from other weights and gets rank 0's by broadcast.
    model = make_model(seed=rank)
    model.compile(optimizer=mct.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     compression="none", groups=2), loss=loss_fn())
    mct.broadcast_variables(model.variables, root_rank=0)
    model.fit(*mine, batch_size=mine[0].shape[0], epochs=8, shuffle=False, verbose=0)
    out["fit_none"] = (np.abs(weights(model) - weights(reference)).max(), model.run_eagerly,
                       len(model.optimizer.mergecomp_reducer.groups))

    # DistributedGradientTape in a tf.function, wrapper re-created every step (Horovod's pattern).
    model = make_model()
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    loss = loss_fn()

    @tf.function
    def step(features, labels):
        with tf.GradientTape() as tape:
            value = loss(labels, model(features, training=True))
        tape = mct.DistributedGradientTape(tape, compression="none", groups="layerwise")
        grads = tape.gradient(value, model.trainable_variables)
        sgd.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(8):
        step(*mine)
    out["tape_none"] = np.abs(weights(model) - weights(reference)).max()

    # Warm-up and exemptions (eager tape): 2 exact averages, then only the exempt variables (the
    # biases by name, the 32x4 kernel by size) stay exact while the other kernels are compressed.
    model = make_model()

    def local_gradients(r):
        with tf.GradientTape() as tape:
            value = loss(shard(y, r), model(shard(x, r), training=True))
        return tape, value

    exact = []
    for _ in range(3):
        both = [tape.gradient(value, model.trainable_variables) for tape, value in map(local_gradients, (0, 1))]
        tape, value = local_gradients(rank)
        tape = mct.DistributedGradientTape(tape, compression="topk", groups=1, compression_warmup_steps=2,
                                           uncompressed=["*bias"], min_compress_numel=200)
        grads = tape.gradient(value, model.trainable_variables)
        exact.append({v.path for v, g, a, b in zip(model.trainable_variables, grads, *both)
                      if np.array_equal(g.numpy(), ((a + b) / 2).numpy())})
    out["safety"] = exact, [v.path for v in model.trainable_variables]

    # Compressors learn and keep the ranks identical.
    for name, lr in (("topk", 0.2), ("signsgd", 0.02), ("qsgd", 0.2)):
        model = make_model()
        losses = fit(model, mct.DistributedOptimizer(keras.optimizers.SGD(lr), compression=name, groups=2),
                     *mine, epochs=30)
        full = float(loss(y, model(x)))
        out[name] = (weights(model), losses[0], full)

    # Sparse gradients (embedding): densified with a warning, exact with `none`.
    ids = np.random.default_rng(2).integers(0, 50, size=(BATCH, 3)).astype("int32")
    reference = make_embedding_model()
    fit(reference, keras.optimizers.SGD(0.5), ids, y, epochs=3)
    model = make_embedding_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, mct.DistributedOptimizer(keras.optimizers.SGD(0.5), compression="none", groups=1),
            shard(ids, rank), shard(y, rank), epochs=3)
    out["sparse"] = (np.abs(weights(model) - weights(reference)).max(),
                     [str(w.message) for w in caught if "sparse gradient" in str(w.message)])

    # Ranks built differently raise on every rank, naming what differs.
    try:
        fit(make_model(), mct.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="topk" if rank == 0
                                                   else "qsgd", groups=1), *mine, epochs=1)
        out["mismatch"] = None
    except Exception as err:  # noqa: BLE001 - Keras may wrap the ValueError
        out["mismatch"] = str(err)
    return out


def test_keras_and_tape_on_two_ranks():
    r0, r1 = run_workers(_training_worker, 2, env=ENV, timeout=170)
    for r in (r0, r1):
        assert r["mismatch"] is not None and "rank 1 differs from rank 0 in its compressor" in r["mismatch"]
    for result in (r0, r1):
        diff, eager, groups = result["fit_none"]
        assert not eager and groups == 2
        assert diff < 1e-5, f"model.fit with none differs from single-process training by {diff}"
        assert result["tape_none"] < 1e-5
        diff, messages = result["sparse"]
        assert diff < 1e-5
        assert messages and "embedding" in messages[0] and "densely" in messages[0]
    for result in (r0, r1):
        exact, paths = result["safety"]
        small = {p for p in paths if p.endswith("bias")} | {paths[-2]}  # the last kernel: 128 elements
        assert exact == [set(paths), set(paths), small]
    x, y = make_data()
    for name in ("topk", "signsgd", "qsgd"):
        params0, first, full = r0[name]
        assert np.array_equal(params0, r1[name][0]), f"{name}: ranks diverged"
        assert math.isfinite(full) and full < 0.9 * first, f"{name}: loss {first:.3f} -> {full:.3f}"


def _mixed_precision_worker(rank):
    import keras

    import mergecomp.tensorflow as mct

    _setup()
    out = {}
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        try:
            mct.DistributedOptimizer(keras.optimizers.SGD(0.05))
        except ValueError as err:
            out["plain"] = str(err)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4),
                                  keras.layers.Activation("linear", dtype="float32")])
        opt = mct.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
                                       compression="topk")
        model.compile(optimizer=opt, loss="mse")
        rng = np.random.default_rng(rank)
        x = rng.standard_normal((64, 16)).astype("float32")
        y = rng.standard_normal((64, 4)).astype("float32")
        if rank == 1:
            y[:8] *= 1e4  # this rank's first batch overflows fp16 at the initial loss scale
        mct.broadcast_variables(model.variables, root_rank=0)
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        out["weights"] = weights(model)
        out["scale"] = float(model.optimizer.dynamic_scale.numpy())
        out["wrapped"] = type(model.optimizer).__name__
        out["tape"] = _loss_scaled_tape_loop(x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return out


def _loss_scaled_tape_loop(x, y):
    """A custom loop under mixed_float16: the loss scaled by a LossScaleOptimizer, the gradients
    exchanged by a DistributedGradientTape with its defaults; (weights, final scale)."""
    import keras
    import tensorflow as tf

    import mergecomp.tensorflow as mct

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(4),
                              keras.layers.Activation("linear", dtype="float32")])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    mct.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_mean((model(xb, training=True) - yb) ** 2))
        grads = mct.DistributedGradientTape(tape, compression="topk").gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    for start in range(0, len(x), 8):
        step(x[start:start + 8], y[start:start + 8])
    return weights(model), float(opt.dynamic_scale.numpy())


def test_mixed_float16_with_a_loss_scale_optimizer_skips_overflows_on_every_rank():
    """Keras' mixed precision: the DistributedOptimizer wraps the LossScaleOptimizer, exchanges
    before its overflow check, and (nonfinite='propagate', the default) gives every rank NaN
    when one rank's fp16 gradients overflow: both ranks skip the same steps and keep equal weights.
    A plain optimizer, which Keras would wrap itself, is refused with the way to do it.  A custom
    loop's DistributedGradientTape does the same under that policy by default."""
    r0, r1 = run_workers(_mixed_precision_worker, 2, env=ENV, timeout=170)
    for r in (r0, r1):
        assert "wrap the LossScaleOptimizer instead" in r["plain"]
        assert r["wrapped"] == "LossScaleOptimizer" and r["scale"] < 32768.0  # lowered from Keras' initial scale
        assert np.isfinite(r["weights"]).all()
    assert r0["scale"] == r1["scale"] and np.array_equal(r0["weights"], r1["weights"])
    (w0, scale0), (w1, scale1) = r0["tape"], r1["tape"]  # the custom loop's tape, its defaults
    assert scale0 == scale1 < 32768.0 and np.isfinite(w0).all() and np.array_equal(w0, w1)


# -- one process: scheduler, errors ---------------------------------------------------------------
def _single_worker(rank):
    import keras
    import tensorflow as tf

    import mergecomp.tensorflow as mct
    from mergecomp.scheduler.online import SchedulerConfig

    _setup()
    x, y = make_data()
    out = {}

    model = make_model()
    config = SchedulerConfig(warmup_steps=2, probe_steps=2, settle_steps=0, candidates=2)
    opt = mct.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="topk", scheduler=config,
                                   compression_warmup_steps=3)
    losses = fit(model, opt, x, y, epochs=23)
    report = opt.mergecomp_reducer.schedule_report()
    out["auto"] = (report["phase"], report["chosen"] is not None, losses[0], losses[-1], report["steps"])

    def error(build):
        try:
            build()
        except Exception as err:  # noqa: BLE001 - the message is what is checked
            return f"{type(err).__name__}: {err}"
        return "no error"

    model = make_model()
    out["xla"] = error(lambda: fit(model, mct.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="none"),
                                   x, y, epochs=1, jit_compile=True))
    used = keras.optimizers.SGD(0.1)
    used.build(model.trainable_variables)
    out["built"] = error(lambda: mct.DistributedOptimizer(used))
    out["type"] = error(lambda: mct.DistributedOptimizer(tf.Variable(1.0)))
    out["compressor"] = error(lambda: mct.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="nope"))
    out["momentum"] = error(lambda: mct.DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression="onebit",
                                                             exchange_momentum_after=30))
    reducer = mct.GradientReducer("none", groups=1)
    other = make_model()
    out["other_model"] = error(lambda: [mct.allreduce_gradients(reducer, [tf.zeros_like(v) for v in m.trainable_variables],
                                                                m.trainable_variables) for m in (model, other)])
    return out


def test_scheduler_and_errors_in_one_process():
    out = run_workers(_single_worker, 1, env=ENV, timeout=170)[0]
    phase, chosen, first, last, searched = out["auto"]
    assert phase == "monitor" and chosen, out["auto"]
    assert searched == 23 - 3  # the 3 warm-up steps are no samples
    assert last < first
    assert "jit_compile=False" in out["xla"]
    assert "ValueError" in out["built"] and "before it is used" in out["built"]
    assert "TypeError" in out["type"] and "keras.optimizers.Optimizer" in out["type"]
    assert "unknown compressor 'nope'" in out["compressor"]
    assert "NotImplementedError" in out["momentum"] and "exchange_momentum_after" in out["momentum"]
    assert "ValueError" in out["other_model"] and "one reducer per model" in out["other_model"]


# -- hvd.elastic's state, without Horovod's driver ----------------------------------------------
def _elastic_state_worker(rank):
    """``TensorFlowState`` on two ranks of one world: what commit, restore, reset and sync do to
    variables, attributes and a tape's reducer (its error-feedback memory)."""
    import tensorflow as tf

    import mergecomp.tensorflow as mct
    from mergecomp.tensorflow.elastic import TensorFlowState

    _setup()
    mct.init()
    variable = tf.Variable(tf.fill([6], float(rank)))
    reducer = mct.GradientReducer("topk", memory="residual", groups=1, compression_warmup_steps=0)

    def step(seed):
        grads = [tf.constant(np.random.default_rng(10 * seed + rank).standard_normal(6).astype("float32"))]
        return mct.allreduce_gradients(reducer, grads, [variable])[0].numpy()

    step(0)  # the reducer binds: a memory of its own on each rank
    state = TensorFlowState([variable], epoch=rank)  # commits at once
    out = {"after_sync": None}
    variable.assign(tf.fill([6], 10.0 + rank))
    state.epoch = 5
    step(1)
    state.commit()
    committed = reducer.state_dict()["memory"]
    variable.assign(tf.fill([6], 20.0))
    state.epoch = 7
    step(2)  # the memory moves on past the commit
    state.restore()
    out["restored"] = (variable.numpy().tolist(), state.epoch)
    state.reset()  # as after a lost worker: the reducer carries the committed state into its next exchange
    out["carried"] = all(np.array_equal(reducer.state_dict()["memory"][g]["residual"].numpy(),
                                        committed[g]["residual"].numpy()) for g in committed)
    state.sync()  # rank 0's variables and attributes; the reducer rejoins at its next exchange
    out["synced"] = (variable.numpy().tolist(), state.epoch)
    step(3)
    merged = reducer.state_dict()
    out["step"], out["memory"] = merged["step"], float(sum(f["residual"].abs().sum() for f in merged["memory"].values()))
    try:
        TensorFlowState()
    except NotImplementedError as err:
        out["refused"] = str(err)
    out["lost_worker"] = _lost_worker_errors()
    return out


def _lost_worker_errors():
    """Which errors raised inside a ``tf.function``'s ``py_function`` :func:`run` takes for a
    lost worker: a failed wait and Horovod's refusal to start a collective, not any other."""
    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    from mergecomp.engines.communicator import CommunicationError
    from mergecomp.tensorflow.elastic import _lost_worker

    seen = {}
    for kind in (CommunicationError, HorovodInternalError, ValueError):
        def fail(x, kind=kind):
            raise kind("a collective")

        @tf.function
        def step(x):
            return tf.py_function(fail, [x], Tout=tf.float32)

        try:
            step(tf.constant(1.0))
        except tf.errors.OpError as err:
            seen[kind.__name__] = _lost_worker(err)
    return seen


def test_elastic_state_commits_restores_carries_the_reducer_and_syncs():
    r0, r1 = run_workers(_elastic_state_worker, 2, env=ENV, timeout=170)
    for rank, r in enumerate((r0, r1)):
        assert r["restored"] == ([10.0 + rank] * 6, 5)
        assert r["carried"]
        assert r["synced"] == ([10.0] * 6, 5)  # rank 0's
        assert r["step"] == r0["step"]
        assert "TensorFlow 1" in r["refused"]
        assert r["lost_worker"] == {"CommunicationError": True, "HorovodInternalError": True, "ValueError": False}
    assert r0["memory"] != r1["memory"]  # each rank its own residual
