"""Horovod's elastic API for TensorFlow, ``hvd.elastic``: training that goes on when workers are
lost or added, launched as Horovod users launch it::

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py

    import mergecomp.tensorflow as hvd
    hvd.init()
    model.build(input_shape)
    optimizer = keras.optimizers.SGD(0.01 * hvd.size())

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.topk)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        while state.batch < batches:
            step(*next_batch())
            state.batch += 1
            state.commit()                       # a point to come back to

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(0.01 * hvd.size())])
    train(state)

The loop is the torch front end's (:mod:`mergecomp.horovod_api.elastic`; Horovod's driver and
notifications run the membership); what a state holds:

* **the model's and the optimizer's variables**: ``commit()`` copies them (``tf.identity``),
  ``restore()`` assigns the copies back, ``sync()`` gives every rank rank 0's (one broadcast).
  The optimizer is built at construction (Keras 3 builds it at its first step, and a joining
  worker's must have the same variables as the others' to receive them);
* **mergecomp's exchange state**, of every :class:`~.reducer.GradientReducer` of the process (a
  ``DistributedOptimizer``'s and every ``DistributedGradientTape``'s: TensorFlow's tapes hold no
  state of their own, so no state object can name them): ``commit()`` copies each one's
  ``state_dict()`` (plan, step, compressor state, this rank's error-feedback memory); at a reset
  each is built again on the new world carrying this rank's committed state
  (:meth:`~.reducer.GradientReducer.rebuild`: the average over the new number of ranks), and
  after the sync each one rejoins the others at its next exchange: rank 0's plan, step and
  replicated compressor state (PowerSGD's ``Q``), this rank's own memory where it stayed, none
  where it joined; the scheduler searches again on a world of another size;
* further keyword arguments: plain attributes, from rank 0 at the sync.

A lost worker's collectives fail with :class:`~mergecomp.engines.communicator.CommunicationError`
(or, started after Horovod's background loop stopped, with Horovod's ``HorovodInternalError``),
which TensorFlow re-raises inside a ``tf.function`` as its own ``OpError``; each is Horovod's
``HorovodInternalError`` here.  Under ``torchrun`` or ``mpirun`` the function runs once after
the sync.  TensorFlow 1's graphs and sessions (Horovod's ``session``/``backend`` arguments) are
not supported: Keras 3 and eager TensorFlow 2 only.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

import tensorflow as tf

from mergecomp.engines.communicator import CommunicationError
from mergecomp.horovod_api import elastic  # first: its ImportError says how to install Horovod
from mergecomp.horovod_api.collectives import broadcast_object
from mergecomp.horovod_api.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState
from mergecomp.horovod_api.runtime import rank

from .functions import broadcast_variables
from .reducer import GradientReducer, live, rejoin_at_next_exchange

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "HorovodInternalError", "HostsUpdatedInterrupt"]

#: how the errors of a lost worker's collectives show in TensorFlow's message when raised inside
#: a ``tf.py_function``: a wait that failed, and Horovod's refusal to start one once its
#: background loop has stopped
_RAISED_AS = tuple(f"{kind.__module__}.{kind.__qualname__}" for kind in (CommunicationError, HorovodInternalError))


def _lost_worker(err: BaseException) -> bool:
    return isinstance(err, CommunicationError) or (
        isinstance(err, tf.errors.OpError) and any(name in err.message for name in _RAISED_AS))


def run(func: Callable) -> Callable:
    """Decorate the training function ``func(state, ...)``: it runs after ``state.sync()``,
    and again after every reset (module docstring) until it returns.  Collectives belong
    inside ``func``, not before it: a joining worker's would meet the others' sync."""
    return elastic.run(func, _lost_worker)


class TensorFlowState(ObjectState):
    """The state an elastic job commits, restores and syncs (Horovod's ``TensorFlowState``):
    ``variables`` (a list of ``tf.Variable``; Horovod's default, TF1's global variables, does
    not exist in TensorFlow 2), mergecomp's exchange state (module docstring) and further
    keyword arguments as attributes.  ``commit()`` copies them (and checks for host changes: a
    collective, every rank at the same point); ``restore()`` returns to the last commit;
    ``register_reset_callbacks`` adds functions run after every reset."""

    def __init__(self, variables: Optional[List[tf.Variable]] = None, session: Any = None, **kwargs: Any) -> None:
        if variables is None or session is not None:
            raise NotImplementedError("TensorFlowState needs its variables as a list (TensorFlow 2, eager): "
                                      "TensorFlow 1's global variables and sessions are not supported")
        self.variables = list(variables)
        self._values: List[tf.Tensor] = []
        self._reducers: Dict[GradientReducer, Dict[str, Any]] = {}
        self._copy()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _copy(self) -> None:
        """Copies of the variables and of every bound reducer's state, to come back to."""
        self._values = [tf.identity(v) for v in self.variables]
        self._reducers = {reducer: copy.deepcopy(reducer.state_dict()) for reducer in live() if reducer.bound}

    def save(self) -> None:
        self._copy()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._values):
            variable.assign(value)
        super().restore()

    def reset(self) -> None:
        """After ``init()`` joined the new world, before the sync: every reducer built on it,
        carrying this rank's state of the last commit (afresh where it had none then)."""
        for reducer in live():
            reducer.rebuild(self._reducers.get(reducer))
        super().reset()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        rejoin_at_next_exchange()
        self._copy()
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """:class:`TensorFlowState` of a Keras ``model`` (built) and its ``optimizer`` (default: the
    one it was compiled with; built here if it was not), as Horovod's ``TensorFlowKerasState``;
    further keyword arguments are attributes."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if backend is not None:
            raise NotImplementedError("TensorFlowKerasState: the backend argument is TensorFlow 1's (sessions); "
                                      "Keras 3 and eager TensorFlow 2 need none")
        if not model.built:
            raise ValueError("TensorFlowKerasState: build the model first (model.build(input_shape))")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        super().__init__([*model.variables, *(self.optimizer.variables if self.optimizer is not None else ())],
                         **kwargs)
