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

Any dtype travels unchanged through allgather, all-to-all and broadcast (engines move raw bytes
where their library needs it).  Every wait has a timeout; expiry raises
:class:`CommunicationError` naming what was waited on.
"""
from __future__ import annotations

import abc
import io
import os
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["Communicator", "Handle", "CommunicationError", "default_timeout", "launcher_local", "object_bytes",
           "load_object"]


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

    def close(self) -> None:
        """Release what the engine set up for this communicator (nothing by default); call it
        only when no collective is in flight."""

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
