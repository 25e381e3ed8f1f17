"""Horovod engine over ``horovod.torch``'s public async API (launch with ``horovodrun``).

Install with ``bash scripts/install_horovod.sh`` (Horovod 0.28.1 with PyTorch, gloo and MPI).
Works under both of horovodrun's controllers (``--gloo`` and ``--mpi``).

Horovod settings, applied by :func:`init_horovod` before ``hvd.init()`` (a value the user set,
e.g. with ``horovodrun --fusion-threshold-mb``, is kept, with a warning):

* ``HOROVOD_FUSION_THRESHOLD=0`` -- no tensor fusion.  mergecomp hands Horovod groups that are
  already merged (and compressed); fusion would copy each of them into Horovod's fusion buffer
  and out again, and would merge groups that happen to be ready in the same cycle, undoing the
  partition the merge scheduler chose and timed.
* ``HOROVOD_CACHE_CAPACITY=0`` -- every collective has a fresh name
  (``mergecomp.<kind>.<counter>``), so the response cache could never hit.
* ``HOROVOD_AUTOTUNE`` is warned about: it retunes fusion threshold and cycle time.
* ``HOROVOD_CYCLE_TIME`` is left at Horovod's default (1 ms).  With fusion off a shorter cycle
  could only cut latency, but the background thread negotiates every cycle, busy or not; on
  2 cores 0.5 ms measured no better (docs/engines.md).

Contracts, beyond :mod:`mergecomp.engines.communicator`:

* Names are unique per collective and issued in the same order on every rank (the caller's
  guarantee), so Horovod never matches the wrong tensors.
* Allgather, all-to-all and broadcast move raw bytes (uint8 views), so any dtype travels
  unchanged.  Horovod cannot sum bfloat16: it is reduced in fp32 (convert, reduce, convert
  back); 8- and 16-bit integers are summed in int32.
* CUDA tensors are staged through host memory unless Horovod was built with CUDA.
* Every wait polls ``hvd.poll`` until a deadline (sleeping ``POLL_SLEEP`` between polls after a
  first busy millisecond), then ``hvd.synchronize``; expiry raises naming rank and operation.
* :meth:`~mergecomp.engines.communicator.Communicator.split_hosts` (the hierarchical exchange) registers one
  Horovod process set per host and one per local rank, which Horovod allows after ``hvd.init()``
  only with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the environment (``horovodrun`` passes it on);
  without it the split raises, naming the variable.
"""
from __future__ import annotations

import itertools
import os
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

from mergecomp.engines.communicator import Communicator, Handle

__all__ = ["HorovodCommunicator", "init_horovod", "HOROVOD_SETTINGS", "POLL_SLEEP"]

#: Set before ``hvd.init()`` unless the user set them (see the module docstring).
HOROVOD_SETTINGS = {
    "HOROVOD_FUSION_THRESHOLD": "0",
    "HOROVOD_CACHE_CAPACITY": "0",
}
#: Seconds slept between two ``hvd.poll`` calls once the first millisecond of a wait has passed.
POLL_SLEEP = 200e-6
_SPIN_SECONDS = 1e-3
#: dtypes horovod.torch sums natively; others are summed in a wider type (see _sum_dtype).
_SUMMABLE = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
_WIDER = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def _sum_dtype(dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype Horovod sums ``dtype`` in: itself, int32 for small integers (the conversion back
    wraps around like an integer sum would), fp32 for bfloat16 and other floats; None if none."""
    if dtype in _SUMMABLE:
        return dtype
    if dtype in _WIDER:
        return _WIDER[dtype]
    return torch.float32 if dtype.is_floating_point else None


def init_horovod():
    """Apply :data:`HOROVOD_SETTINGS` (unless set) and ``hvd.init()``; returns ``horovod.torch``."""
    import horovod.torch as hvd

    if hvd.is_initialized():
        warnings.warn("Horovod was initialised before mergecomp.torch.init(): its fusion threshold and "
                      "cache are whatever they were set to then (mergecomp wants "
                      f"{HOROVOD_SETTINGS})", stacklevel=3)
        return hvd
    for key, value in HOROVOD_SETTINGS.items():
        current = os.environ.get(key)
        if current is None:
            os.environ[key] = value
        elif current != value:
            warnings.warn(f"{key}={current} is set; mergecomp recommends {value} (see mergecomp.engines.horovod)",
                          stacklevel=3)
    if os.environ.get("HOROVOD_AUTOTUNE", "0") not in ("", "0"):
        warnings.warn("HOROVOD_AUTOTUNE is on: it retunes Horovod's fusion threshold and cycle time, which "
                      "mergecomp sets to keep its merged groups intact", stacklevel=3)
    hvd.init()
    return hvd


def _poll(hvd, handle, timeout: float, describe: Callable[[], str]):
    """Wait for ``handle`` with ``hvd.poll`` until ``timeout`` seconds have passed."""
    if not hvd.poll(handle):
        start = time.monotonic()
        deadline = start + timeout
        while not hvd.poll(handle):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{describe()} did not complete within {timeout:g}s")
            if now - start > _SPIN_SECONDS:
                time.sleep(POLL_SLEEP)
    return hvd.synchronize(handle)


class HorovodCommunicator(Communicator):
    """Collectives on a Horovod process set: the global one, or ``process_set`` (a
    ``hvd.ProcessSet`` this rank belongs to, as :meth:`split_hosts` makes them).

    Attributes: ``local_rank``/``local_size``, ``controller`` (``"gloo"`` or ``"mpi"``).
    """

    engine = "horovod"

    def __init__(self, timeout: Optional[float] = None, process_set=None, prefix: str = "mergecomp") -> None:
        if process_set is None:
            hvd = init_horovod()
        else:  # a set of the running Horovod
            import horovod.torch as hvd
        self.hvd = hvd
        self._owns_horovod = process_set is None  # close() shuts Horovod down
        self._set = hvd.global_process_set if process_set is None else process_set
        super().__init__(self._set.rank(), self._set.size(), timeout)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.controller = "gloo" if hvd.gloo_enabled() else "mpi"
        self._cuda = hvd.cuda_built()
        self._counter = itertools.count()
        self._prefix = prefix if process_set is None else f"{prefix}.set{process_set.process_set_id}"

    def _name(self, kind: str) -> str:
        return f"{self._prefix}.{kind}.{next(self._counter)}"

    def _host(self, tensor: torch.Tensor) -> bool:
        """Does ``tensor`` have to be staged through host memory?"""
        return tensor.is_cuda and not self._cuda

    def _handle(self, handle, finish: Callable[[torch.Tensor], torch.Tensor],
                describe: Callable[[], str]) -> Handle:
        def wait(timeout: float) -> torch.Tensor:
            return finish(_poll(self.hvd, handle, timeout, describe))

        return Handle(wait, self.timeout)

    @staticmethod
    def _done(result: torch.Tensor) -> Handle:
        return Handle(lambda _: result, float("inf"))

    # -- collectives --------------------------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        name = self._name("allreduce")
        describe = self._describe(f"Horovod allreduce {name!r}", tensor)
        if tensor.numel() == 0 or self.size == 1:
            return self._done(tensor)
        dtype = _sum_dtype(tensor.dtype)
        if dtype is None:
            raise TypeError(f"{describe()}: Horovod cannot sum {tensor.dtype} tensors")
        direct = dtype == tensor.dtype and not self._host(tensor) and tensor.is_contiguous()
        if direct:
            work = tensor.detach()
        else:  # bf16, small ints, CUDA without CUDA Horovod, or strided: reduce a contiguous copy
            device = "cpu" if self._host(tensor) else tensor.device
            work = tensor.detach().to(device, dtype, memory_format=torch.contiguous_format, copy=True)
        handle = self.hvd.allreduce_async_(work, name=name, op=self.hvd.Sum, process_set=self._set)

        def finish(_) -> torch.Tensor:
            if not direct:
                with torch.no_grad():
                    tensor.copy_(work)
            return tensor

        return self._handle(handle, finish, describe)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        name = self._name("allgather")
        describe = self._describe(f"Horovod allgather {name!r}", tensor)
        flat = tensor.detach().reshape(-1)
        if self._host(flat):
            flat = flat.cpu()
        flat = flat.contiguous()
        if flat.numel() == 0 or self.size == 1:
            return self._done(flat.view(1, -1).expand(self.size, -1).clone().to(tensor.device))
        handle = self.hvd.allgather_async(flat.view(torch.uint8), name=name, process_set=self._set)

        def finish(out: torch.Tensor) -> torch.Tensor:
            return out.view(flat.dtype).view(self.size, -1).to(tensor.device)

        return self._handle(handle, finish, describe)

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        """``hvd.alltoall_async`` of a ``(size, m * itemsize)`` uint8 view, split equally (one row
        per rank); ``synchronize`` returns ``(rows, received_splits)``."""
        name = self._name("alltoall")
        describe = self._describe(f"Horovod alltoall {name!r}", tensor)
        block = self._block(tensor)
        send = tensor.detach().cpu() if self._host(tensor) else tensor.detach()
        if block == 0 or self.size == 1:
            return self._done(send.view(self.size, block).clone().to(tensor.device))
        handle = self.hvd.alltoall_async(send.view(self.size, block).view(torch.uint8), name=name,
                                         process_set=self._set)

        def finish(result) -> torch.Tensor:
            return result[0].view(send.dtype).to(tensor.device)

        return self._handle(handle, finish, describe)

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        name = self._name("broadcast")
        describe = self._describe(f"Horovod broadcast from rank {root} {name!r}", tensor)
        if tensor.numel() == 0 or self.size == 1:
            return tensor
        direct = not self._host(tensor) and tensor.is_contiguous()
        work = tensor.detach() if direct else tensor.detach().to(
            "cpu" if self._host(tensor) else tensor.device, memory_format=torch.contiguous_format, copy=True)
        handle = self.hvd.broadcast_async_(work.reshape(-1).view(torch.uint8), root, name=name,
                                           process_set=self._set)

        def finish(_) -> torch.Tensor:
            if not direct:
                with torch.no_grad():
                    tensor.copy_(work)
            return tensor

        return self._handle(handle, finish, describe).wait(f"broadcast from rank {root}")

    def _split_hosts(self, local_size: int):
        """Process sets of this rank's host (consecutive ranks) and of its local rank on every
        host, registered by every rank in the same order (``hvd.add_process_set``, which needs
        ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
        if self._set is not self.hvd.global_process_set:
            raise NotImplementedError("the horovod engine splits hosts from the global process set only")
        hosts = self.size // local_size
        layouts = [[h * local_size + l for l in range(local_size)] for h in range(hosts)]
        layouts += [[h * local_size + l for h in range(hosts)] for l in range(local_size)]
        try:
            sets = [self.hvd.add_process_set(ranks) for ranks in layouts]
        except ValueError as err:
            raise NotImplementedError(
                f"rank {self.rank}: the horovod engine runs the hierarchical exchange on {hosts} hosts of "
                f"{local_size} processes with Horovod process sets, which need HOROVOD_DYNAMIC_PROCESS_SETS=1 "
                f"in the environment of every rank (e.g. HOROVOD_DYNAMIC_PROCESS_SETS=1 horovodrun ...), "
                f"or use scheme='allgather' or 'two-phase' ({err})") from None
        host, local = divmod(self.rank, local_size)
        return (HorovodCommunicator(self.timeout, sets[host]), HorovodCommunicator(self.timeout, sets[hosts + local]))

    def subgroup(self, ranks: Sequence[int]) -> Optional["HorovodCommunicator"]:
        """A Horovod process set of ``ranks`` (``hvd.add_process_set``, every rank calls it;
        needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
        if self._set is not self.hvd.global_process_set:
            raise NotImplementedError("the horovod engine makes sub-groups of the global process set only")
        members = self.hvd.add_process_set(list(ranks))
        return HorovodCommunicator(self.timeout, members) if self.rank in ranks else None

    def duplicate(self) -> "HorovodCommunicator":
        """The same process set under other collective names (Horovod matches collectives by
        name, so two threads' collectives never meet)."""
        return HorovodCommunicator(self.timeout, self._set, prefix=f"{self._prefix}.dup{next(self._counter)}")

    def close(self) -> None:
        """``hvd.shutdown()`` (call only when no collective is in flight), which also ends the
        process sets of :meth:`split_hosts`; a process set's own communicator leaves its set to
        that shutdown (removing a set is a collective of every rank)."""
        super().close()
        if self._owns_horovod:
            self.hvd.shutdown()
