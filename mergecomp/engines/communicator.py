"""The communicator interface: the few collectives the pipeline needs, started asynchronously.

Engines (``mergecomp.engines``) implement it over an existing distributed library; mergecomp
never moves bytes itself.  All ranks must issue the same collectives in the same order.

* ``allreduce_async(t)`` sums ``t`` over ranks in place; the handle's ``wait()`` returns ``t``.
* ``allgather_async(t)`` gathers equal-sized 1-D ``t`` from all ranks; ``wait()`` returns a
  ``(size, t.numel())`` tensor, row ``r`` from rank ``r``.
* ``alltoall_async(t)`` sends block ``r`` of the 1-D contiguous ``t`` (elements
  ``[r*m, (r+1)*m)``, ``m = t.numel() / size``; ValueError unless it divides) to rank ``r``;
  ``wait()`` returns a ``(size, m)`` tensor of ``t``'s dtype and device, row ``r`` from rank
  ``r``.  ``m`` may be 0 (a ``(size, 0)`` result, no hang).
* ``broadcast_(t, root)`` copies rank ``root``'s ``t`` into every rank's ``t`` (blocking).
* ``split_hosts()`` returns ``(local, cross)``: communicators over this host's processes and
  over the processes with this local rank on every host (the hierarchical exchange's levels).

Any dtype travels unchanged through allgather, all-to-all and broadcast (engines move raw bytes
where their library needs it).  Every wait has a timeout; expiry raises
:class:`CommunicationError` naming what was waited on.
"""
from __future__ import annotations

import abc
import io
import os
import pickle
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["Communicator", "Handle", "CommunicationError", "default_timeout", "launcher_local", "object_bytes",
           "load_object", "host_layout"]


def default_timeout() -> float:
    """Seconds to wait for one collective: ``MERGECOMP_TIMEOUT`` or 300."""
    value = os.environ.get("MERGECOMP_TIMEOUT", "300")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"MERGECOMP_TIMEOUT must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"MERGECOMP_TIMEOUT must be positive, got {value!r}")
    return seconds


def object_bytes(obj: Any) -> torch.Tensor:
    """``obj`` pickled with ``torch.save``, as a 1-D uint8 tensor (for object collectives)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def load_object(raw: torch.Tensor) -> Any:
    """The object :func:`object_bytes` turned into the uint8 CPU tensor ``raw``."""
    return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=False)


class CommunicationError(RuntimeError):
    """A collective failed or did not finish within the timeout."""


class Handle:
    """An in-flight collective.  ``wait(what)`` blocks until done and returns the result;
    ``what`` names the operation in the error raised on failure or timeout."""

    def __init__(self, wait: Callable[[float], torch.Tensor], timeout: float) -> None:
        self._wait = wait
        self._timeout = timeout
        self._result: Optional[torch.Tensor] = None

    def wait(self, what: str = "collective", timeout: Optional[float] = None) -> torch.Tensor:
        """The result; ``timeout`` (seconds) overrides the communicator's limit for this wait."""
        if self._result is None:
            limit = self._timeout if timeout is None else float(timeout)
            try:
                self._result = self._wait(limit)
            except Exception as err:  # engines raise their own types; name the operation
                raise CommunicationError(
                    f"{what} failed or timed out after {limit:g}s "
                    f"(set MERGECOMP_TIMEOUT to change the limit): {err}"
                ) from err
        return self._result


#: (local rank, local size) variables of the launchers, in the order they are looked up
_LOCAL_VARIABLES = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"),                         # torchrun
                    ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),               # horovodrun
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
                    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))                      # MPICH, Intel MPI


def launcher_local(rank: int, size: int) -> Tuple[int, int]:
    """``(local_rank, local_size)``: this process's index among the processes of its host and
    their number, from the launcher's variables; ``(rank, size)`` (one host) without them."""
    for rank_var, size_var in _LOCAL_VARIABLES:
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ.get(size_var, size))
    return rank, size


def host_layout(pairs: Sequence[Tuple[int, int]], host_major: bool) -> int:
    """``L``, the processes per host, from every rank's ``(local_rank, local_size)`` (row ``r``:
    rank ``r``'s), after checking that every host runs ``L`` processes numbered ``0..L-1`` and,
    when ``host_major``, that rank ``r`` is local rank ``r % L`` (hosts hold consecutive ranks, as
    torchrun numbers them).  ValueError naming the ranks that break it."""
    size = len(pairs)
    by_size: Dict[int, List[int]] = {}
    for rank, (_, local_size) in enumerate(pairs):
        by_size.setdefault(local_size, []).append(rank)
    if len(by_size) > 1:
        raise ValueError(f"every host must run the same number of processes, but the ranks report local sizes "
                         f"{dict(sorted(by_size.items()))} (local size: ranks)")
    local_size = next(iter(by_size))
    if local_size < 1 or size % local_size:
        raise ValueError(f"{size} ranks do not make hosts of {local_size} processes each (the local size every "
                         f"rank reports)")
    if host_major:
        bad = [rank for rank, (local_rank, _) in enumerate(pairs) if local_rank != rank % local_size]
        rule = f"ranks must be numbered host by host (rank r is local rank r % {local_size})"
    else:
        counts = [sum(local_rank == l for local_rank, _ in pairs) for l in range(local_size)]
        bad = [rank for rank, (local_rank, _) in enumerate(pairs)
               if not 0 <= local_rank < local_size or counts[local_rank] != size // local_size]
        rule = f"each local rank 0..{local_size - 1} must occur once per host"
    if bad:
        raise ValueError(f"{rule}; ranks {bad} have local ranks {[pairs[r][0] for r in bad]}")
    return local_size


class Communicator(abc.ABC):
    """Collectives over one group of processes.

    Attributes: ``rank``/``size`` in the group; ``local_rank``/``local_size`` on this host (an
    engine that knows them sets them, else the launcher's variables, see :func:`launcher_local`);
    ``timeout`` in seconds for any one collective.
    """

    engine = ""
    #: where this engine's collectives take their tensors (NCCL: the current CUDA device)
    device = torch.device("cpu")

    def __init__(self, rank: int, size: int, timeout: Optional[float] = None) -> None:
        self.rank = rank
        self.size = size
        self.local_rank, self.local_size = launcher_local(rank, size)
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self._hosts: Optional[Tuple[Communicator, Communicator]] = None

    def close(self) -> None:
        """Release what the engine set up for this communicator, its :meth:`split_hosts`
        communicators included; call it only when no collective is in flight."""
        for comm in self._hosts or ():
            if comm is not self:
                comm.close()
        self._hosts = None

    #: :meth:`split_hosts` needs rank ``r`` to be local rank ``r % local_size`` (the engine
    #: derives hosts from rank numbers)
    host_major = True

    def split_hosts(self) -> Tuple["Communicator", "Communicator"]:
        """``(local, cross)``: this host's processes (``local.rank`` is the local rank) and the
        processes with this local rank on every host (``cross.rank`` is the host's index), with
        this communicator's timeout.  Built on the first call, which every rank makes at the same
        point: one allgather of every rank's ``(local_rank, local_size)``, checked by
        :func:`host_layout` (ValueError on every rank), then the engine's groups.  One process per
        host: ``local`` is a single-process :class:`LocalCommunicator` and ``cross`` this one; one
        host: the other way round (neither needs engine groups)."""
        if self._hosts is None:
            local_size = self._local_size() if self.size > 1 else 1
            if local_size == 1:
                self._hosts = (LocalCommunicator(self.timeout), self)
            elif local_size == self.size:
                self._hosts = (self, LocalCommunicator(self.timeout))
            else:
                self._hosts = self._split_hosts(local_size)
        return self._hosts

    def _local_size(self) -> int:
        """Every rank's ``(local_rank, local_size)`` by one allgather, checked by :func:`host_layout`."""
        mine = torch.tensor([self.local_rank, self.local_size], dtype=torch.int64, device=self.device)
        table = self.allgather(mine, f"the host layout check on rank {self.rank}").cpu().tolist()
        try:
            return host_layout([(local_rank, local_size) for local_rank, local_size in table], self.host_major)
        except ValueError as err:
            raise ValueError(f"rank {self.rank}: cannot split the {self.size} ranks into hosts: {err}") from None

    def _split_hosts(self, local_size: int) -> Tuple["Communicator", "Communicator"]:
        """The engine's ``(local, cross)`` communicators for hosts of ``local_size`` processes
        (at least 2 hosts of at least 2 processes; the layout is checked)."""
        raise NotImplementedError(f"the {self.engine or type(self).__name__} engine cannot build per-host "
                                  f"communicators (the hierarchical exchange on several hosts of several "
                                  f"processes); use the torch or mpi engine")

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        raise NotImplementedError

    @abc.abstractmethod
    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        raise NotImplementedError

    @abc.abstractmethod
    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        """Start sending block ``r`` of ``tensor`` to rank ``r`` (see the module docstring);
        ``wait()`` returns the ``(size, m)`` received blocks, row ``r`` from rank ``r``."""
        raise NotImplementedError

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        raise NotImplementedError

    def allreduce_(self, tensor: torch.Tensor, what: str = "allreduce") -> torch.Tensor:
        return self.allreduce_async(tensor).wait(what)

    def allgather(self, tensor: torch.Tensor, what: str = "allgather") -> torch.Tensor:
        return self.allgather_async(tensor).wait(what)

    def alltoall(self, tensor: torch.Tensor, what: str = "alltoall") -> torch.Tensor:
        return self.alltoall_async(tensor).wait(what)

    def _block(self, tensor: torch.Tensor) -> int:
        """``m``, the elements per block of :meth:`alltoall_async`'s ``tensor``; ValueError
        unless it is 1-D, contiguous and its numel divides by ``size``."""
        where = f"alltoall on rank {self.rank} of {self.size}"
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"{where}: needs a 1-D contiguous tensor, got shape {list(tensor.shape)}")
        if tensor.numel() % self.size:
            raise ValueError(f"{where}: {tensor.numel()} elements do not divide into {self.size} equal blocks")
        return tensor.numel() // self.size

    def _describe(self, op: str, tensor: torch.Tensor) -> Callable[[], str]:
        """A function naming ``op`` on ``tensor`` here, for the engines' error messages."""
        return lambda: (f"{op} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} "
                        f"elements on rank {self.rank} of {self.size}")

    #: bytes of a pickled object that travel in :meth:`allgather_object`'s first allgather
    INLINE_BYTES = 504

    def allgather_object(self, obj: Any, what: str = "allgather_object") -> List[Any]:
        """Every rank's ``obj`` in rank order, pickled: one allgather of a fixed-size buffer (the
        length, then up to :attr:`INLINE_BYTES` bytes), and a second for the rest of objects
        longer than that."""
        if self.size == 1:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(8 + self.INLINE_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = torch.frombuffer(bytearray(data[:self.INLINE_BYTES]), dtype=torch.uint8)
        head[8:8 + first.numel()] = first
        rows = self.allgather(head.to(self.device), what).cpu()
        lengths = rows[:, :8].contiguous().view(torch.int64).reshape(-1).tolist()
        rest = max(lengths) - self.INLINE_BYTES
        tails = None
        if rest > 0:
            tail = torch.zeros(rest, dtype=torch.uint8)
            if len(data) > self.INLINE_BYTES:
                tail[:len(data) - self.INLINE_BYTES] = torch.frombuffer(bytearray(data[self.INLINE_BYTES:]),
                                                                        dtype=torch.uint8)
            tails = self.allgather(tail.to(self.device), what).cpu()
        objects = []
        for r, n in enumerate(lengths):
            raw = rows[r, 8:8 + min(n, self.INLINE_BYTES)].numpy().tobytes()
            if n > self.INLINE_BYTES:
                raw += tails[r, :n - self.INLINE_BYTES].numpy().tobytes()
            objects.append(pickle.loads(raw))
        return objects

    def subgroup(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """A communicator over ``ranks`` (ranks of this communicator, ascending), with this one's
        timeout; None on a rank outside them.  Every rank of this communicator calls it at the
        same point (engines whose groups need only their members still get every rank's call)."""
        raise NotImplementedError(f"the {self.engine or type(self).__name__} engine cannot make sub-groups "
                                  f"(process sets); use the torch or mpi engine")

    def duplicate(self) -> "Communicator":
        """A communicator over the same ranks whose collectives never interleave with this one's
        (for collectives issued from another thread); every rank calls it at the same point."""
        return self.subgroup(list(range(self.size)))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Rank ``root``'s ``obj`` on every rank (pickled with ``torch.save``; two broadcasts:
        the length, then the bytes)."""
        if self.size == 1:
            return obj
        payload = object_bytes(obj) if self.rank == root else torch.empty(0, dtype=torch.uint8)
        length = self.broadcast_(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), root)
        if self.rank != root:
            payload = torch.empty(int(length), dtype=torch.uint8)
        return load_object(self.broadcast_(payload.to(self.device), root).cpu())


class LocalCommunicator(Communicator):
    """A single process: every collective is the identity."""

    engine = "local"

    def __init__(self, timeout: Optional[float] = None) -> None:
        super().__init__(0, 1, timeout)

    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        return Handle(lambda _: tensor, self.timeout)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        return Handle(lambda _: tensor.reshape(1, -1), self.timeout)

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        result = tensor.view(1, self._block(tensor))
        return Handle(lambda _: result, self.timeout)

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        return tensor

    def subgroup(self, ranks: Sequence[int]) -> "LocalCommunicator":
        if list(ranks) != [0]:
            raise ValueError(f"a single process has rank 0 only, not {list(ranks)}")
        return LocalCommunicator(self.timeout)
