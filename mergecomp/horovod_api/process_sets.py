"""Horovod's process sets: sub-groups of the ranks whose tensor collectives (and
``DistributedOptimizer(process_set=...)``) run among their members only.

A set has two communicators made by the engine (:meth:`Communicator.subgroup`): ``communicator``
for the training path and a duplicate for its :class:`~mergecomp.horovod_api.negotiation.Coordinator`
(whose thread issues the tensor collectives).  ``global_process_set`` (every rank) is set up by
``init`` and torn down by ``shutdown``; ``add_process_set`` and ``remove_process_set`` are
collectives of every rank, which must pass the same ranks (ValueError on every rank otherwise).
Engines: torch (``dist.new_group``), mpi (``Split``), horovod (``hvd.add_process_set``, which
needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``), local (the set ``[0]``).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence, Union

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "start", "stop",
           "resolve"]


class ProcessSet:
    """Ranks ``ranks`` (ascending; None: every rank) and, once added, their collectives.

    ``included()``, ``rank()`` (this process's index in the set) and ``size()`` as in Horovod;
    ``process_set_id`` is None until :func:`add_process_set` (0 for the global set)."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks: Optional[List[int]] = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: Optional[int] = None
        self.communicator = None  # the engine's communicator of the set; None outside it
        self.coordinator = None   # negotiation of its tensor collectives; None outside it

    def _world_rank(self) -> int:
        return _world().rank

    def included(self) -> bool:
        return self.ranks is None or self._world_rank() in self.ranks

    def rank(self) -> int:
        if not self.included():
            raise ValueError(f"rank {self._world_rank()} is not in {self}")
        return self._world_rank() if self.ranks is None else self.ranks.index(self._world_rank())

    def size(self) -> int:
        return _world().size if self.ranks is None else len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: every rank
global_process_set = ProcessSet()
_sets: Dict[int, ProcessSet] = {}
_ids = itertools.count(1)
_world_comm = None  # the communicator of init(), set by start()


def _attach(process_set: ProcessSet, comm, timeout: float, set_id: int) -> None:
    from mergecomp.horovod_api.negotiation import Coordinator

    process_set.process_set_id = set_id
    process_set.communicator = comm
    process_set.coordinator = None if comm is None else Coordinator(comm.duplicate(), timeout, f" of set {set_id}")
    _sets[set_id] = process_set


def start(comm) -> None:
    """Set up the global process set on ``comm`` (at ``init``)."""
    global _ids, _world_comm
    _ids = itertools.count(1)
    _world_comm = comm
    global_process_set.ranks = list(range(comm.size))
    _attach(global_process_set, comm, comm.timeout, 0)


def _release(process_set: ProcessSet, own_comm: bool) -> None:
    if process_set.coordinator is not None:
        process_set.coordinator.close()
        process_set.coordinator.comm.close()
    if own_comm and process_set.communicator is not None:
        process_set.communicator.close()
    process_set.process_set_id = process_set.communicator = process_set.coordinator = None


def stop() -> None:
    """Fail what is still waiting and release every set's communicators (at ``shutdown``)."""
    for set_id, process_set in sorted(_sets.items(), reverse=True):
        _release(process_set, own_comm=set_id != 0)
    _sets.clear()
    global_process_set.ranks = None
    global _world_comm
    _world_comm = None


def _world():
    """The communicator of every rank; RuntimeError before ``init``."""
    if _world_comm is None:
        raise RuntimeError("mergecomp is not initialized: call init() first (mergecomp.torch.init() or "
                           "mergecomp.tensorflow.init())")
    return _world_comm


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a set of ranks (a :class:`ProcessSet` or a list of ranks); every rank calls it
    with the same ranks.  ValueError (on every rank) for ranks that differ between ranks, fall
    outside the job, or equal an existing set's."""
    comm = _world()
    target = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ranks = target.ranks
    if not ranks or any(not 0 <= r < comm.size for r in ranks):
        raise ValueError(f"add_process_set: ranks {ranks} must be a non-empty list of ranks in [0, {comm.size})")
    if target.process_set_id is not None:
        raise ValueError(f"add_process_set: {target} was added already")
    everyone = comm.allgather_object(ranks, "add_process_set (the ranks every rank asks for)")
    if any(other != ranks for other in everyone):
        raise ValueError(f"add_process_set: the ranks disagree: {dict(enumerate(everyone))} (rank: ranks it asked for)")
    if any(existing.ranks == ranks for existing in _sets.values()):
        raise ValueError(f"add_process_set: a process set with ranks {ranks} exists already")
    _attach(target, comm.subgroup(ranks), comm.timeout, next(_ids))
    return target


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank calls it); False for the global set or one that was
    not added."""
    if process_set is global_process_set or process_set.process_set_id not in _sets:
        return False
    everyone = _world().allgather_object(process_set.process_set_id, "remove_process_set")
    if any(other != process_set.process_set_id for other in everyone):
        raise ValueError(f"remove_process_set: the ranks remove different sets: {dict(enumerate(everyone))}")
    del _sets[process_set.process_set_id]
    _release(process_set, own_comm=True)
    return True


def resolve(process_set: Optional[ProcessSet], what: str, member: bool = True) -> ProcessSet:
    """The set ``what`` runs in (None: the global one); ValueError naming ``what`` if it was not
    added or, when ``member``, if this rank is not in it."""
    comm = _world()  # RuntimeError before init
    target = global_process_set if process_set is None else process_set
    if not isinstance(target, ProcessSet):
        raise ValueError(f"{what}: process_set must be a ProcessSet from add_process_set, got {target!r}")
    if target.process_set_id not in _sets:
        raise ValueError(f"{what}: {target} has not been added (hvd.add_process_set) or was removed")
    if member and target.coordinator is None:
        raise ValueError(f"{what}: rank {comm.rank} is not in {target}")
    return target
