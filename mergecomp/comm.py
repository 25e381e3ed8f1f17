"""The communicator interface: the few collectives the pipeline needs, started asynchronously.

Engines (``mergecomp.engines``) implement it over an existing distributed library; mergecomp
never moves bytes itself.  All ranks must issue the same collectives in the same order.

* ``allreduce_async(t)`` sums ``t`` over ranks in place; the handle's ``wait()`` returns ``t``.
* ``allgather_async(t)`` gathers equal-sized 1-D ``t`` from all ranks; ``wait()`` returns a
  ``(size, t.numel())`` tensor, row ``r`` from rank ``r``.
* ``broadcast_(t, root)`` copies rank ``root``'s ``t`` into every rank's ``t`` (blocking).

Every wait has a timeout; expiry raises :class:`CommunicationError` naming what was waited on.
"""
from __future__ import annotations

import abc
import os
from typing import Callable, Optional

import torch

__all__ = ["Communicator", "Handle", "CommunicationError", "default_timeout"]


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


class Communicator(abc.ABC):
    """Collectives over one group of processes."""

    engine = ""
    #: where this engine's collectives take their tensors (NCCL: the current CUDA device)
    device = torch.device("cpu")

    def __init__(self, rank: int, size: int, timeout: Optional[float] = None) -> None:
        self.rank = rank
        self.size = size
        self.timeout = default_timeout() if timeout is None else float(timeout)

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        raise NotImplementedError

    @abc.abstractmethod
    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        raise NotImplementedError

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        raise NotImplementedError

    def allreduce_(self, tensor: torch.Tensor, what: str = "allreduce") -> torch.Tensor:
        return self.allreduce_async(tensor).wait(what)

    def allgather(self, tensor: torch.Tensor, what: str = "allgather") -> torch.Tensor:
        return self.allgather_async(tensor).wait(what)


class LocalCommunicator(Communicator):
    """A single process: every collective is the identity."""

    engine = "local"

    def __init__(self, timeout: Optional[float] = None) -> None:
        super().__init__(0, 1, timeout)

    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        return Handle(lambda _: tensor, self.timeout)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        return Handle(lambda _: tensor.reshape(1, -1), self.timeout)

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        return tensor
