"""Horovod's elastic API, ``hvd.elastic``: training that goes on when workers are lost or
added, launched as Horovod users launch it::

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py

    import mergecomp.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.topk)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                                  # the steps
            state.commit()                       # a point to come back to

    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    state.register_reset_callbacks([lambda: scale_lr(hvd.size())])
    train(state)

Horovod's driver and worker notifications run the membership; mergecomp runs the training
state.  On a change (the horovod engine, under horovodrun's elastic mode):

* **a worker lost**: the collectives in flight fail (:class:`CommunicationError`, raised as
  Horovod's ``HorovodInternalError``); every remaining rank goes back to its last ``commit()``
  (model, optimizer, mergecomp's state, the attributes), then resets;
* **workers added or hosts removed** (the discovery script): every rank raises
  ``HostsUpdatedInterrupt`` at the same ``commit()``, then resets;
* **reset**: ``mc.shutdown()`` and ``mc.init()`` join the new world; every
  :class:`~mergecomp.torch.DistributedOptimizer` in the state is built again on it
  (:meth:`~mergecomp.torch.DistributedOptimizer.rebuild`, with the collectives a joining
  worker's construction runs), carrying this rank's own state; the reset callbacks run;
* **sync** (at the start, and after a reset unless only hosts were removed): parameters, the
  optimizer class's state and the attributes from rank 0; mergecomp's state by
  :meth:`~mergecomp.pipeline.step.MergedStep.rejoin`: rank 0's plan, step and replicated
  compressor state, each rank that stayed keeps its own error-feedback memory, a joining rank
  starts with none, the scheduler searches again on a world of another size.

A rank that leaves takes its residual (its share of what was not yet sent) with it.  Every
``DistributedOptimizer`` must be in the state: one left out keeps the old world's
communicator.  The sharded schemes' memories (two-phase, hierarchical) start afresh at every
reset, and an optimizer over a process set cannot be rebuilt (NotImplementedError).

Other engines: under ``torchrun`` or ``mpirun`` :func:`run` syncs once and runs the function; a
lost worker ends the job as without it (torchrun's ``--max-restarts`` restarts it from the
checkpoints: :meth:`~mergecomp.torch.DistributedOptimizer.load_every_rank`).

Needs Horovod (``bash scripts/install_horovod.sh``): its driver, its worker notification service
and its ``State`` classes.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import torch

from mergecomp.engines.communicator import CommunicationError
from mergecomp.horovod_api import elastic  # first: its ImportError says how to install Horovod
from mergecomp.horovod_api.collectives import broadcast_object
from mergecomp.horovod_api.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState
from mergecomp.horovod_api.runtime import rank

from horovod.torch.elastic.sampler import ElasticSampler  # isort: skip - after that clear error

from .functions import broadcast_class_state, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer

__all__ = ["run", "TorchState", "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt"]


def run(func: Callable) -> Callable:
    """Decorate the training function ``func(state, ...)``: it runs after ``state.sync()``,
    and again after every reset (module docstring) until it returns.  Collectives belong
    inside ``func``, not before it: a joining worker's would meet the others' sync."""
    return elastic.run(func, lambda err: isinstance(err, CommunicationError))


class _Handler:
    """How one object of a :class:`TorchState` is committed, restored, reset and synced; the
    committed copy is its ``state_dict()``, deep-copied."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def reset(self) -> None:
        """After ``mc.init()`` joined the new world, before the sync."""

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _DistributedOptimizerHandler(_Handler):
    """A :class:`~mergecomp.torch.DistributedOptimizer`: the optimizer class's state restored at
    once, mergecomp's carried into the step :meth:`reset` builds on the new world."""

    def restore(self) -> None:
        with self.value.skip_synchronize():  # a step whose collectives failed is not finished: reset drops it
            self.value.load_state_dict({key: value for key, value in self.saved.items() if key != "mergecomp"})

    def reset(self) -> None:
        self.value.rebuild(self.saved)

    def sync(self) -> None:
        broadcast_class_state(self.value, root_rank=0)
        self.value.merged.rejoin(0)


def _handler(value: Any) -> Optional[_Handler]:
    if isinstance(value, DistributedOptimizer):
        return _DistributedOptimizerHandler(value)
    for kind, handler in ((torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
                          (ElasticSampler, _Handler)):
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state an elastic job commits, restores and syncs (Horovod's ``TorchState``): a
    ``model``, an ``optimizer`` (a :class:`~mergecomp.torch.DistributedOptimizer` with its
    mergecomp state, or any torch optimizer) and further keyword arguments; modules,
    optimizers and :class:`ElasticSampler` are handled by kind, anything else is a plain
    attribute broadcast from rank 0.  ``commit()`` copies them to host memory (and checks for
    host changes: a collective, every rank at the same point); ``restore()`` returns to the
    last commit; ``register_reset_callbacks`` adds functions run after every reset."""

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        for name in list(kwargs):
            handler = _handler(kwargs[name])
            if handler is not None:
                handlers[name] = handler
                del kwargs[name]
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and handlers[name].value is not value:
            handlers[name] = _handler(value)  # a new object: committed as it is now
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
