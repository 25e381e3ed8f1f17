"""The TensorFlow twin of tests/elastic_train.py (``mergecomp.tensorflow``'s ``hvd.elastic``),
run by tests/test_elastic.py under ``horovodrun --min-np 1 --max-np 3 --host-discovery-script``.

    python elastic_train_tf.py OUT HOSTS --compression powersgd --steps 16 --grow-at 4 --fail-at 10

Horovod's TensorFlow 2 pattern: a ``tf.function`` step that wraps its tape in
``DistributedGradientTape`` every call, a Keras SGD optimizer whose learning rate a reset
callback scales, and ``TensorFlowKerasState``.  ``--fit``: ``model.fit`` with a compiled
``DistributedOptimizer`` and the Keras callbacks of ``mergecomp.tensorflow.keras.elastic``
(one batch per epoch, so that the epochs count the steps).  Rank 0 adds a host at
``--grow-at``; the worker that joined exits at ``--fail-at``; each process appends JSON lines
to ``OUT/<pid>.jsonl`` as the torch script does.
"""
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from elastic_schedule import digest, grow, options as elastic_options, parser, write  # noqa: E402

import mergecomp.tensorflow.keras as hvd  # noqa: E402
from mergecomp.tensorflow.reducer import live  # noqa: E402

parser = parser()
parser.add_argument("--fit", action="store_true", help="model.fit with the Keras callbacks")
args = parser.parse_args()

hvd.init()
joined = hvd.size() == 3  # the third worker starts in a world of three
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(4)])
BASE_LR = 0.1
options = elastic_options(args.compression)
if args.fit:
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(BASE_LR * hvd.size(), momentum=0.9), **options)
    model.compile(optimizer=optimizer, loss="mse")
else:
    optimizer = keras.optimizers.SGD(BASE_LR * hvd.size(), momentum=0.9)


def batch(step):
    x = np.random.default_rng(1000 * step + hvd.rank()).standard_normal((8, 16)).astype(np.float32)
    return x, x[:, :4]


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    tape = hvd.DistributedGradientTape(tape, **options)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def record(state, at: str) -> None:
    [reducer] = [r for r in live() if r.bound] or [None]
    merged = (reducer.state_dict() if reducer is not None else None) or {"memory": {}, "compressor": {}, "step": 0}
    line = {"at": at, "pid": os.getpid(), "joined": joined, "step": step_of(state), "rank": hvd.rank(),
            "size": hvd.size(), "params": float(sum(np.asarray(v, dtype=np.float64).sum() for v in model.weights)),
            "memory": digest(merged["memory"]), "compressor": digest(merged["compressor"]),
            "merged_step": merged["step"], "lr": float(optimizer.learning_rate.numpy())}
    write(args.out, line)


def step_of(state) -> int:
    return state.epoch if args.fit else state.step


def after_step(state) -> None:
    """What follows each step: the host added or the worker that joined lost, as scheduled."""
    if args.grow_at and step_of(state) == args.grow_at and hvd.rank() == 0:
        grow(state, args.hosts)


class Schedule(keras.callbacks.Callback):
    """--fit: the schedule and the records at each epoch's end, before the commit callback's."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        if args.fail_at and self.state.epoch == args.fail_at and joined:
            os._exit(1)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch += 1  # what UpdateEpochStateCallback will write, for the schedule and the record
        after_step(self.state)
        record(self.state, "commit")
        self.state.epoch -= 1


@hvd.elastic.run
def train(state):
    record(state, "sync")
    if args.fit:
        x, y = batch(step_of(state))
        model.fit(x, y, batch_size=8, epochs=args.steps - state.epoch, verbose=0, shuffle=False,
                  callbacks=[Schedule(state), hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.CommitStateCallback(state)])
        return
    while state.step < args.steps:
        if args.fail_at and state.step == args.fail_at and joined:
            os._exit(1)
        train_step(*batch(state.step))
        state.step += 1
        after_step(state)
        record(state, "commit")
        state.commit()


def on_reset():
    optimizer.learning_rate.assign(BASE_LR * hvd.size())


counters = {"epoch": 0, "batch": 0} if args.fit else {"step": 0}
state = hvd.elastic.KerasState(model, optimizer, **counters)
state.register_reset_callbacks([on_reset])
train(state)
