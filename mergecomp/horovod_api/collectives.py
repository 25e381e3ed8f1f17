"""Horovod's tensor collectives (``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter``, their ``_async``, in-place and ``grouped_`` forms, ``barrier``, ``join``) on
whatever engine :func:`mergecomp.torch.init` picked.

As in Horovod, each collective is matched across the ranks of its process set by name (its kind
and ``name``, or the n-th unnamed one of its kind), not by call order, and runs on a background
thread once every rank asked for it (:mod:`mergecomp.horovod_api.negotiation`): asynchronous
collectives may be started in any order, ``poll`` does not block, and a rank in :func:`join`
contributes zeros to the others' reductions.  Arguments that differ between ranks (dtype,
shape, root, op) fail with :class:`~mergecomp.horovod_api.negotiation.MismatchError` (a
RuntimeError and ValueError) on every rank; a name in flight twice raises ValueError; a
collective not every rank asks for within ``MERGECOMP_TIMEOUT`` fails on the ranks that did.
Results come back on the input's device.  These functions are not differentiable; the torch
front end's are (:mod:`mergecomp.torch.differentiable`).

Differences from Horovod: ``alltoall`` pads each destination's rows to the largest block any rank
sends; ``Min``/``Max``/``Product`` gather every rank's tensor and reduce locally; ``Adasum`` is
not implemented.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from mergecomp.engines.communicator import load_object, object_bytes
from mergecomp.horovod_api.arguments import REDUCTIONS, Adasum, Average, Sum
from mergecomp.horovod_api.negotiation import JOIN, Coordinator, Request, register
from mergecomp.horovod_api.operations import (Allgather, Allreduce, Alltoall, Barrier, Broadcast, BroadcastObject,
                                              Operation, Reducescatter)
from mergecomp.horovod_api.process_sets import ProcessSet, resolve
from mergecomp.horovod_api.runtime import communicator, importable, is_initialized

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
           "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "broadcast_object", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
           "allgather_object", "synchronize", "poll", "barrier", "join", "CollectiveHandle", "cross_rank",
           "cross_size", "mpi_threads_supported", "nccl_built", "mpi_built", "gloo_built", "ccl_built",
           "ddl_built", "mpi_enabled", "gloo_enabled", "cuda_built", "rocm_built"]

register(Allreduce, Allgather, Broadcast, BroadcastObject, Alltoall, Reducescatter, Barrier)


def _what(op: str, name: Optional[str]) -> str:
    return f"{op} of {name!r}" if name else op


class CollectiveHandle:
    """Collectives started by an ``*_async`` function: :func:`synchronize` returns the result
    (again on later calls), :func:`poll` says whether they finished."""

    def __init__(self, coordinator: Coordinator, requests: List[Request], finish: Callable[[List[Any]], Any]) -> None:
        self._coordinator, self._requests, self._finish = coordinator, requests, finish
        self._done = False
        self._result: Any = None

    def done(self) -> bool:
        return self._done or all(r.done() for r in self._requests)

    def first(self) -> "CollectiveHandle":
        """The same collectives, whose result is the first one's (a grouped call of one tensor)."""
        return CollectiveHandle(self._coordinator, self._requests, _first)

    def result(self) -> Any:
        if not self._done:
            self._result = self._finish([self._coordinator.wait(r) for r in self._requests])
            self._done = True
            self._requests, self._finish = [], None
        return self._result


def synchronize(handle: CollectiveHandle) -> Any:
    """Wait for the collective ``handle`` stands for and return its result."""
    return handle.result()


def poll(handle: CollectiveHandle) -> bool:
    """True once the collective has finished (never blocks)."""
    return handle.done()


def _start(kind: str, operations: Sequence[Operation], names: Sequence[Optional[str]], process_set: Any,
           finish: Callable[[List[Any]], Any]) -> CollectiveHandle:
    coordinator = resolve(process_set, _what(kind, names[0] if names else None)).coordinator
    requests = [coordinator.submit(kind, op, name) for op, name in zip(operations, names)]
    return CollectiveHandle(coordinator, requests, finish)


def _names(name: Optional[str], count: int) -> List[Optional[str]]:
    """The names of a grouped collective's members: ``name`` for one, ``name.i`` for several, or unnamed."""
    if name is None or count == 1:
        return [name] * count
    return [f"{name}.{i}" for i in range(count)]


def _reduction(average: Optional[bool], op: Any, what: str) -> str:
    """The reduction of ``op=`` or the older ``average=`` (not both)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: give op= or the older average=, not both")
        op = Average if average else Sum
    op = Average if op is None else op
    if op is Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not implemented in mergecomp; use Average or Sum")
    if op not in REDUCTIONS:
        raise ValueError(f"{what}: op must be one of Average, Sum, Min, Max, Product, got {op!r}")
    return op


def _scalable(tensor: torch.Tensor, op: str, prescale: float, postscale: float, what: str) -> None:
    if (prescale != 1.0 or postscale != 1.0) and op not in (Sum, Average):
        raise ValueError(f"{what}: prescale_factor/postscale_factor apply to Sum and Average only")
    if tensor.dtype == torch.bool:
        raise ValueError(f"{what}: cannot reduce bool tensors")


def _first(results: List[Any]) -> Any:
    return results[0]


# -- allreduce ---------------------------------------------------------------------------------
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None
                             ) -> CollectiveHandle:
    """Start an in-place reduction of each tensor of ``tensors`` over ranks; :func:`synchronize`
    returns ``tensors``.

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product`` (``average=True/False``
    is the older spelling); ``Adasum`` raises NotImplementedError.  ``prescale_factor`` multiplies
    each rank's tensor before the reduction, ``postscale_factor`` the result after it (and after
    the division by the number of ranks); integer tensors are scaled in float64 and truncated.
    """
    what = _what("allreduce", name)
    op = _reduction(average, op, what)
    for tensor in tensors:
        _scalable(tensor, op, prescale_factor, postscale_factor, what)
    operations = [Allreduce(t.detach(), t, op, prescale_factor, postscale_factor) for t in tensors]
    return _start("allreduce", operations, _names(name, len(tensors)), process_set, lambda out: list(out))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None
                            ) -> CollectiveHandle:
    """Like :func:`grouped_allreduce_async_`, into new tensors (``tensors`` are left as they are)."""
    return grouped_allreduce_async_([t.detach().clone(memory_format=torch.contiguous_format) for t in tensors],
                                    average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Optional[ProcessSet] = None) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None) -> List[torch.Tensor]:
    """The reduction of each tensor over ranks, as new tensors (see :func:`grouped_allreduce_async_`);
    ``compression``: see :func:`allreduce`."""
    packed = [horovod_compress(compression, t, _what("grouped_allreduce", name)) for t in tensors]
    out = synchronize(grouped_allreduce_async([p for p, _ in packed], average, name, op, prescale_factor,
                                              postscale_factor, process_set))
    return [horovod_decompress(compression, t, ctx) for t, (_, ctx) in zip(out, packed)]


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Start an in-place reduction of ``tensor`` over ranks (see :func:`grouped_allreduce_async_`);
    :func:`synchronize` returns ``tensor``."""
    return grouped_allreduce_async_([tensor], average, name, op, prescale_factor, postscale_factor,
                                    process_set).first()


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Like :func:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
    return allreduce_async_(tensor.detach().clone(memory_format=torch.contiguous_format), average, name, op,
                            prescale_factor, postscale_factor, process_set)


def horovod_compress(compression: Any, tensor: torch.Tensor, what: str) -> Tuple[torch.Tensor, Any]:
    """``compression.compress(tensor)``: Horovod's compressor contract, ``(tensor, ctx)``; None: as it is."""
    if compression is None:
        return tensor, None
    if not hasattr(compression, "compress"):
        raise ValueError(f"{what}: compression must be a Horovod-style compressor with compress/decompress "
                         f"(mc.Compression.none, mc.Compression.fp16, or your own), got {compression!r}; "
                         f"mergecomp's compressors work on gradients through DistributedOptimizer")
    return compression.compress(tensor)


def horovod_decompress(compression: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    return tensor if compression is None else compression.decompress(tensor, ctx)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """The reduction of ``tensor`` over ranks, as a new tensor (see :func:`grouped_allreduce_async_`).

    ``compression`` (Horovod's fourth argument): an object with Horovod's ``compress(tensor) ->
    (tensor, ctx)`` and ``decompress(tensor, ctx)``, such as ``mc.Compression.fp16`` (floating
    tensors travel as float16) or a compressor written for Horovod.
    """
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------------------
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Start :func:`grouped_allgather`."""
    operations = [Allgather(t.detach().reshape(1) if t.dim() == 0 else t.detach()) for t in tensors]
    return _start("allgather", operations, _names(name, len(tensors)), process_set, lambda out: list(out))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Optional[ProcessSet] = None) -> List[torch.Tensor]:
    """:func:`allgather` of each tensor."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Start :func:`allgather`."""
    return grouped_allgather_async([tensor], name, process_set).first()


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Optional[ProcessSet] = None
              ) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order.  The first
    dimension may differ between ranks; the others and the dtype must match.  A 0-d tensor counts
    as one row."""
    return synchronize(allgather_async(tensor, name, process_set))


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> List[Any]:
    """A list of every rank's ``obj`` in rank order (pickled with ``torch.save``); unnamed, it is
    named after ``obj``'s type, as in Horovod."""
    name = type(obj).__name__ if name is None else name
    payload = object_bytes(obj)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), f"{name}.sizes", process_set)
    rows = allgather(payload, name, process_set)
    return [load_object(part) for part in rows.split(sizes.tolist())]


# -- broadcast ---------------------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Start overwriting ``tensor`` on every rank with rank ``root_rank``'s (a rank of the job, in
    the process set, as in Horovod); :func:`synchronize` returns ``tensor``."""
    ranks = resolve(process_set, _what("broadcast", name)).ranks
    return _start("broadcast", [Broadcast(tensor, int(root_rank), ranks)], [name], process_set, _first)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Like :func:`broadcast_async_`, into a new tensor (``tensor`` is left as it is)."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name,
                            process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``root_rank``'s, in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Optional[ProcessSet] = None) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank, as a new tensor (``tensor`` is unchanged)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank (pickled with ``torch.save``; the other ranks'
    ``obj`` is not used and may be None)."""
    target = resolve(process_set, _what("broadcast_object", name))
    payload = object_bytes(obj) if communicator().rank == root_rank else torch.empty(0, dtype=torch.uint8)
    handle = _start("broadcast_object", [BroadcastObject(payload, int(root_rank), target.ranks)], [name], target,
                    _first)
    return load_object(synchronize(handle))


# -- alltoall ----------------------------------------------------------------------------------
def _send_splits(rows: int, splits: Optional[Union[Sequence[int], torch.Tensor]], size: int,
                 what: str) -> List[int]:
    """The rows for each destination: ``splits`` checked, or equal parts of ``rows``."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{what}: the first dimension {rows} does not divide into {size} equal splits; "
                             f"pass splits=")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor) and (splits.dtype.is_floating_point or splits.dim() != 1):
        raise ValueError(f"{what}: splits must be a 1-D integer tensor or a list, got {splits.dtype} "
                         f"of shape {list(splits.shape)}")
    send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(send) != size or any(s < 0 for s in send) or sum(send) != rows:
        raise ValueError(f"{what}: splits {send} must be {size} non-negative counts summing to the "
                         f"first dimension {rows}")
    return send


def alltoall_async(tensor: torch.Tensor, splits: Optional[Union[Sequence[int], torch.Tensor]] = None,
                   name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> CollectiveHandle:
    """Start :func:`alltoall`; :func:`synchronize` returns ``(tensor, received_splits)``."""
    what = _what("alltoall", name)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor of at least one dimension")
    target = resolve(process_set, what)
    send = _send_splits(tensor.shape[0], splits, target.coordinator.comm.size, what)
    return _start("alltoall", [Alltoall(tensor.detach(), send)], [name], target, _first)


def alltoall(tensor: torch.Tensor, splits: Optional[Union[Sequence[int], torch.Tensor]] = None,
             name: Optional[str] = None, process_set: Optional[ProcessSet] = None):
    """Rank ``r`` sends the ``splits[d]`` rows of ``tensor`` after the first ``sum(splits[:d])``
    to rank ``d``; each rank returns the rows it received, concatenated in sender order.

    ``splits`` None: equal parts (the first dimension must divide by the number of ranks), and
    the result is the tensor; else ``(tensor, received_splits)`` where ``received_splits[s]``
    (int64) is how many rows came from rank ``s``.  The dtype and all dimensions but the first
    must match across ranks.  Each destination's rows are padded to the most any rank sends
    anyone: O(tensor) per rank when the splits are even.
    """
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


# -- reducescatter -----------------------------------------------------------------------------
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: Any = Average,
                                process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> CollectiveHandle:
    """Start :func:`grouped_reducescatter`."""
    what = _what("reducescatter", name)
    op = _reduction(None, op, what)
    if op not in (Sum, Average):
        raise ValueError(f"{what}: op must be Average or Sum, got {op!r}")
    for tensor in tensors:
        _scalable(tensor, op, prescale_factor, postscale_factor, what)
        if tensor.dim() == 0:
            raise ValueError(f"{what}: needs a tensor of at least one dimension (its rows are scattered)")
    operations = [Reducescatter(t.detach(), op, prescale_factor, postscale_factor) for t in tensors]
    return _start("reducescatter", operations, _names(name, len(tensors)), process_set, lambda out: list(out))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None, compression: Any = None,
                          op: Any = Average, process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """:func:`reducescatter` of each tensor."""
    packed = [horovod_compress(compression, t, _what("grouped_reducescatter", name)) for t in tensors]
    out = synchronize(grouped_reducescatter_async([p for p, _ in packed], name, op, process_set, prescale_factor,
                                                  postscale_factor))
    return [horovod_decompress(compression, t, ctx) for t, (_, ctx) in zip(out, packed)]


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> CollectiveHandle:
    """Start :func:`reducescatter`."""
    return grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor, postscale_factor).first()


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = None, op: Any = Average,
                  process_set: Optional[ProcessSet] = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``op`` (``Average`` or ``Sum``) over ranks of ``tensor`` (same dtype and shape on every
    rank), of which each rank keeps its rows: ``rows // size``, one more on the first
    ``rows % size`` ranks, in rank order.  One all-to-all (each rank sends ``(size - 1) / size``
    of the tensor, padded to the longest part) and a local sum; ``compression`` as in
    :func:`allreduce`."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                           process_set: Optional[ProcessSet] = None) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values; returns a
    function that waits and returns the coalesced sparse sum (divided by the ranks for Average)."""
    what = _what("sparse_allreduce", name)
    op = _reduction(None, op, what)
    if op not in (Sum, Average):
        raise ValueError(f"{what}: op must be Average or Sum, got {op!r}")
    tensor = tensor.coalesce()
    handle = grouped_allgather_async([tensor.indices().t().contiguous(), tensor.values()],
                                     f"{name}.sparse" if name is not None else None, process_set)

    def finish() -> torch.Tensor:
        indices, values = synchronize(handle)
        if op == Average:
            values = values / resolve(process_set, what).size()
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape).coalesce()

    return finish


# -- barrier, join ----------------------------------------------------------------------------
def barrier(process_set: Optional[ProcessSet] = None) -> None:
    """Return once every rank of the process set has called ``barrier``."""
    synchronize(_start("barrier", [Barrier()], [None], process_set, _first))


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``, standing in meanwhile for this rank in the
    others' collectives (zeros in ``Sum``/``Average`` reductions; the others' allgathers,
    broadcasts and alltoalls fail with MismatchError).  Returns the rank that joined last, the
    same on every rank.  ``device`` is accepted for Horovod compatibility."""
    coordinator = resolve(None, "join").coordinator
    return coordinator.wait(coordinator.submit(JOIN, None))


# -- topology and build information --------------------------------------------------------------
def cross_rank() -> int:
    """This host's index: ``rank // local_size``, assuming every host runs ``local_size``
    processes with consecutive ranks (as torchrun, horovodrun and mpirun by default place them)."""
    comm = communicator()
    _check_even(comm)
    return comm.rank // comm.local_size


def cross_size() -> int:
    """The number of hosts: ``size // local_size`` (same assumption as :func:`cross_rank`)."""
    comm = communicator()
    _check_even(comm)
    return comm.size // comm.local_size


def _check_even(comm) -> None:
    if comm.local_size <= 0 or comm.size % comm.local_size:
        raise RuntimeError(f"cross_rank/cross_size: local_size {comm.local_size} does not divide size "
                           f"{comm.size}, so the hosts cannot be numbered from the ranks alone")


def _horovod(name: str) -> Optional[bool]:
    """Horovod's own answer when it is the engine, else None."""
    if is_initialized() and communicator().engine == "horovod":
        return bool(getattr(communicator().hvd, name)())
    return None


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``: asked of MPI on the mpi engine, of Horovod
    on the horovod engine; False otherwise."""
    if not is_initialized():
        return False
    engine = communicator().engine
    if engine == "mpi":
        from mpi4py import MPI

        return MPI.Query_thread() == MPI.THREAD_MULTIPLE
    return bool(_horovod("mpi_threads_supported"))


def gloo_built() -> bool:
    """Whether torch.distributed (which the torch engine uses) has gloo."""
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> bool:
    """Whether torch.distributed has NCCL (a bool, not Horovod's version number)."""
    return bool(dist.is_available() and dist.is_nccl_available())


def mpi_built() -> bool:
    """Whether mpi4py (which the mpi engine uses) can be imported."""
    return importable("mpi4py")


def cuda_built() -> bool:
    """Whether this PyTorch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether this PyTorch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def mpi_enabled() -> bool:
    """Whether the current engine moves data with MPI (mpi engine, or Horovod's MPI controller)."""
    if not is_initialized():
        return False
    return communicator().engine == "mpi" or bool(_horovod("mpi_enabled"))


def gloo_enabled() -> bool:
    """Whether the current engine moves data with gloo (torch engine on a gloo group, or
    Horovod's gloo controller)."""
    if not is_initialized():
        return False
    comm = communicator()
    if comm.engine == "torch":
        return dist.get_backend(comm.group) == "gloo"
    return bool(_horovod("gloo_enabled"))


def ccl_built() -> bool:
    """False: mergecomp has no oneCCL engine."""
    return False


def ddl_built() -> bool:
    """False: mergecomp has no IBM DDL engine."""
    return False
