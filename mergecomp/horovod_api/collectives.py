"""Horovod-shaped tensor collectives (``mc.allreduce``, ``mc.allgather``, ``mc.alltoall`` ...) on
whatever engine :func:`mergecomp.torch.init` picked, through the :class:`~mergecomp.engines.communicator.Communicator`.

Every rank must call the same collectives in the same order.  Tensors are moved to the engine's
device (``communicator().device``) and made contiguous when needed; results come back on the
input's device.  Each wait is bounded by the communicator's timeout (``MERGECOMP_TIMEOUT``) and
raises :class:`~mergecomp.engines.communicator.CommunicationError` naming the operation (and ``name`` if given).

Differences from Horovod, on purpose or by necessity:

* ``alltoall`` pads each destination's rows to the largest block any rank sends, so uneven
  splits move ``size x`` that block per rank.
* ``allgather_async`` exchanges the first dimensions synchronously; only the data is in flight.
* ``poll`` cannot ask the engine whether a collective finished: it waits for it, then says True.
* ``join`` does not serve the other ranks' later collectives (see its docstring).
* Only the global process set exists; ``process_set`` must be None or ``mc.global_process_set``.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from mergecomp.engines.communicator import CommunicationError, load_object, object_bytes
from mergecomp.horovod_api.arguments import Average, check_process_set, resolve_op
from mergecomp.horovod_api.runtime import communicator, importable, is_initialized
from mergecomp.registry import Compression

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "allgather_async",
           "broadcast", "broadcast_", "broadcast_object", "alltoall", "allgather_object", "synchronize", "poll", "barrier", "join",
           "cross_rank", "cross_size", "mpi_threads_supported", "nccl_built", "mpi_built", "gloo_built",
           "mpi_enabled", "gloo_enabled", "cuda_built", "rocm_built"]

#: the most dimensions a tensor given to allgather/alltoall may have (its shape is exchanged
#: in a fixed-size header)
MAX_DIMS = 32

#: dtypes allgather can name in its header, to check that every rank sends the same one
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)


def _what(op: str, name: Optional[str]) -> str:
    return f"{op} of {name!r}" if name else op


@contextmanager
def _named(what: str):
    """Re-raise a CommunicationError from an engine call with the operation's name in front."""
    try:
        yield
    except CommunicationError as err:
        if str(err).startswith(what):
            raise
        raise CommunicationError(f"{what}: {err}") from err


def _on_device(tensor: torch.Tensor, device: torch.device, copy: bool) -> torch.Tensor:
    """``tensor`` on ``device``, contiguous; a fresh copy when ``copy`` or when it had to move."""
    if not copy and tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.detach().to(device, memory_format=torch.contiguous_format, copy=True)


class CollectiveHandle:
    """An in-flight collective started by one of the ``*_async`` functions; pass it to
    :func:`synchronize` (the result) or :func:`poll`."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish = finish
        self._done = False
        self._result: Any = None

    def result(self) -> Any:
        if not self._done:
            self._result = self._finish()
            self._done = True
            self._finish = None
        return self._result


def synchronize(handle: CollectiveHandle) -> Any:
    """Wait for the collective ``handle`` stands for and return its result (again on later calls)."""
    return handle.result()


def poll(handle: CollectiveHandle) -> bool:
    """True when the collective has finished.

    The communicator's handles cannot be asked without waiting, so this waits for the collective
    (bounded by the timeout) and then returns True: a ``while not poll(h)`` loop ends after one
    turn, and ``synchronize`` afterwards returns at once.
    """
    handle.result()
    return True


# -- allreduce ---------------------------------------------------------------------------------
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> CollectiveHandle:
    """Start an in-place allreduce of ``tensor``; :func:`synchronize` returns ``tensor``.

    ``op``: ``mc.Average`` (default) or ``mc.Sum``; ``average=True/False`` is the older spelling
    (not together with ``op``); ``mc.Adasum`` raises NotImplementedError.  ``prescale_factor``
    multiplies each rank's tensor before the sum, ``postscale_factor`` the result after it (and
    after the division by the number of ranks).  Integer tensors: the average is the sum
    floor-divided by the number of ranks, and scale factors other than 1 raise ValueError.
    """
    what = _what("allreduce", name)
    try:
        op = resolve_op(average, op, process_set)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    scaled = prescale_factor != 1.0 or postscale_factor != 1.0
    integer = not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)
    if integer and scaled:
        raise ValueError(f"{what}: prescale_factor/postscale_factor need a floating-point tensor, "
                         f"got {tensor.dtype}")
    comm = communicator()
    work = _on_device(tensor, comm.device, copy=False)
    if prescale_factor != 1.0:
        with torch.no_grad():
            work.mul_(prescale_factor)
    with _named(what):
        inner = comm.allreduce_async(work)

    @torch.no_grad()
    def finish() -> torch.Tensor:
        with _named(what):
            out = inner.wait(what)
        if op == Average and comm.size > 1:
            if integer:
                out.div_(comm.size, rounding_mode="floor")
            else:
                out.div_(comm.size)
        if postscale_factor != 1.0:
            out.mul_(postscale_factor)
        if out is not tensor:
            tensor.copy_(out)
        return tensor

    return CollectiveHandle(finish)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> CollectiveHandle:
    """Like :func:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
    return allreduce_async_(tensor.detach().clone(memory_format=torch.contiguous_format), average, name, op,
                            prescale_factor, postscale_factor, process_set)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """The reduction of ``tensor`` over ranks, as a new tensor (see :func:`allreduce_async_`).
    Not differentiable (autograd does not flow through it).

    ``compression=mc.Compression.fp16`` (in Horovod's position, the fourth argument) sends a
    floating-point tensor as float16 and returns it in its own dtype; other tensors are sent as
    they are.
    """
    if compression not in (None, Compression.none, Compression.fp16):
        raise ValueError(f"{_what('allreduce', name)}: compression must be mc.Compression.none or "
                         f"mc.Compression.fp16, got {compression!r}")
    if compression == Compression.fp16 and tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
        half = tensor.detach().to(torch.float16)
        return allreduce_(half, average, name, op, prescale_factor, postscale_factor, process_set).to(tensor.dtype)
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                       process_set))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


# -- allgather ---------------------------------------------------------------------------------
def _header(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{what}: tensors of more than {MAX_DIMS} dimensions are not supported")
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    return torch.tensor([tensor.dim(), code, *tensor.shape] + [-1] * (MAX_DIMS - tensor.dim()), dtype=torch.int64)


def _check_headers(headers: torch.Tensor, what: str) -> List[Tuple[int, ...]]:
    """The shapes in ``headers`` (row ``r``: rank ``r``'s :func:`_header`); ValueError naming two
    ranks unless all send one dtype and shapes that differ in the first dimension only.  Every
    rank holds the same rows, so every rank raises the same error."""
    shapes = [tuple(int(d) for d in row[2:2 + int(row[0])]) for row in headers]
    codes = [int(row[1]) for row in headers]
    for r in range(len(shapes)):
        if codes[r] != codes[0]:
            raise ValueError(f"{what}: rank 0 sends {_DTYPES[codes[0]] if codes[0] >= 0 else 'another dtype'} "
                             f"but rank {r} sends {_DTYPES[codes[r]] if codes[r] >= 0 else 'another dtype'}")
        if len(shapes[r]) != len(shapes[0]) or shapes[r][1:] != shapes[0][1:]:
            raise ValueError(f"{what}: only the first dimension may differ between ranks, but rank 0 has "
                             f"shape {list(shapes[0])} and rank {r} has {list(shapes[r])}")
    return shapes


def _gather_rows_async(tensor: torch.Tensor, what: str) -> Tuple[List[int], Callable[[], torch.Tensor]]:
    """Start gathering every rank's ``tensor`` (first dimension may differ): returns each rank's
    first dimension and a function that waits and returns the concatenation along dim 0.

    The shapes are exchanged first (blocking; every rank gets the same header, so every rank
    raises the same ValueError on a mismatch), then the tensors padded to the longest.
    """
    comm = communicator()
    tensor = tensor.detach()  # not differentiable; the padded copy must not record autograd history
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    with _named(what):
        headers = comm.allgather(_header(tensor, what).to(comm.device), what + " (shapes)").cpu()
    firsts = [s[0] for s in _check_headers(headers, what)]
    longest, rest = max(firsts), tuple(tensor.shape[1:])
    if longest * math.prod(rest) == 0:  # nothing to move (gloo rejects empty tensors)
        empty = tensor.new_empty((sum(firsts),) + rest)
        return firsts, lambda: empty
    padded = tensor.new_zeros((longest,) + rest, device=comm.device)
    padded[:tensor.shape[0]] = tensor
    with _named(what):
        inner = comm.allgather_async(padded.reshape(-1))

    def finish() -> torch.Tensor:
        with _named(what):
            out = inner.wait(what).view((comm.size, longest) + rest)
        return torch.cat([out[r, :firsts[r]] for r in range(comm.size)]).to(tensor.device)

    return firsts, finish


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> CollectiveHandle:
    """Start :func:`allgather`; the first dimensions are exchanged before this returns."""
    _, finish = _gather_rows_async(tensor, _what("allgather", name))
    return CollectiveHandle(finish)


def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order.

    The first dimension may differ between ranks; the others and the dtype must match
    (ValueError naming the ranks otherwise).  A 0-d tensor counts as one row.
    """
    return synchronize(allgather_async(tensor, name))


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """A list of every rank's ``obj`` in rank order (pickled with ``torch.save``)."""
    sizes, finish = _gather_rows_async(object_bytes(obj), _what("allgather_object", name))
    rows = finish().cpu()
    return [load_object(part) for part in rows.split(sizes)]


# -- broadcast ---------------------------------------------------------------------------------
def _check_root(root_rank: int, what: str) -> None:
    size = communicator().size
    if not 0 <= root_rank < size:
        raise ValueError(f"{what}: root_rank {root_rank} is not a rank of this job (size {size})")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set: Any = None) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank (pickled with ``torch.save``)."""
    what = _what("broadcast_object", name)
    check_process_set(process_set)
    _check_root(root_rank, what)
    with _named(what):
        return communicator().broadcast_object(obj, root_rank)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None
               ) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``root_rank``'s, in place; returns ``tensor``."""
    what = _what("broadcast", name)
    check_process_set(process_set)
    _check_root(root_rank, what)
    comm = communicator()
    work = _on_device(tensor, comm.device, copy=False)
    with _named(what):
        comm.broadcast_(work, root_rank)
    if work is not tensor:
        with torch.no_grad():
            tensor.copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None
              ) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank, as a new tensor (``tensor`` is unchanged)."""
    return broadcast_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name, process_set)


# -- alltoall ----------------------------------------------------------------------------------
def _send_splits(rows: int, splits: Optional[Union[Sequence[int], torch.Tensor]], size: int,
                 what: str) -> List[int]:
    """The rows for each destination: ``splits`` checked, or equal parts of ``rows``."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{what}: the first dimension {rows} does not divide into {size} equal splits; "
                             f"pass splits=")
        return [rows // size] * size
    send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(send) != size or any(s < 0 for s in send) or sum(send) != rows:
        raise ValueError(f"{what}: splits {send} must be {size} non-negative counts summing to the "
                         f"first dimension {rows}")
    return send


def alltoall(tensor: torch.Tensor, splits: Optional[Union[Sequence[int], torch.Tensor]] = None,
             name: Optional[str] = None, process_set: Any = None):
    """Rank ``r`` sends the ``splits[d]`` rows of ``tensor`` after the first ``sum(splits[:d])``
    to rank ``d``; each rank returns the rows it received, concatenated in sender order.

    ``splits`` None: equal parts (the first dimension must divide by the number of ranks).
    Returns the tensor when ``splits`` is None, else ``(tensor, received_splits)`` where
    ``received_splits[s]`` (int64) is how many rows came from rank ``s`` (newer Horovod's form).
    The dtype and all dimensions but the first must match across ranks (ValueError naming two).

    Two of the engine's all-to-alls: first, to each destination, its row count with the most
    rows this rank sends anyone and the shape header (int64); then the rows, each destination's
    padded to the most any rank sends anyone.  Each rank moves ``size x`` that largest block:
    O(tensor) when the splits are even.
    """
    what = _what("alltoall", name)
    check_process_set(process_set)
    comm = communicator()
    if tensor.dim() == 0:
        raise ValueError(f"{what}: needs a tensor of at least one dimension")
    tensor = tensor.detach()  # not differentiable; the padded copy must not record autograd history
    send = _send_splits(tensor.shape[0], splits, comm.size, what)
    meta = torch.cat([torch.tensor([[count, max(send)] for count in send], dtype=torch.int64),
                      _header(tensor, what).expand(comm.size, -1)], dim=1)
    with _named(what):
        got = comm.alltoall(meta.reshape(-1).to(comm.device), what + " (splits)").cpu()
    _check_headers(got[:, 2:], what)
    received, longest, rest = got[:, 0].clone(), int(got[:, 1].max()), tuple(tensor.shape[1:])
    padded = tensor.new_zeros((comm.size, longest) + rest, device=comm.device)
    for dest, part in enumerate(tensor.split(send)):
        padded[dest, :send[dest]] = part
    with _named(what):
        blocks = comm.alltoall(padded.reshape(-1), what).view((comm.size, longest) + rest)
    out = torch.cat([blocks[src, :count] for src, count in enumerate(received.tolist())]).to(tensor.device)
    return out if splits is None else (out, received)


# -- barrier, join ----------------------------------------------------------------------------
def barrier(process_set: Any = None) -> None:
    """Return once every rank has called ``barrier`` (CommunicationError after the timeout)."""
    check_process_set(process_set)
    comm = communicator()
    with _named("barrier"):
        comm.allreduce_(torch.zeros(1, device=comm.device), "barrier")


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``; returns the rank that called it last.

    "Last" is judged by each rank's wall clock (``time.time()``) at the call, so across hosts it
    is only as right as their clocks agree.  Unlike Horovod, a rank waiting in ``join`` does not
    take part in the collectives other ranks still issue: those (and the waiting ``join``) end
    with CommunicationError at the timeout instead of completing, so every rank must reach
    ``join`` without further collectives.  ``device`` is accepted for Horovod compatibility.
    """
    comm = communicator()
    stamp = torch.tensor([time.time()], dtype=torch.float64, device=comm.device)
    with _named("join"):
        stamps = comm.allgather(stamp, "join").reshape(-1).cpu()
    return int(torch.argmax(stamps))


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
