"""torch.distributed engine: gloo on CPU, NCCL on CUDA (launch with ``torchrun``)."""
from __future__ import annotations

import datetime
import itertools
import os
import warnings
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mergecomp.engines.communicator import Communicator, Handle

__all__ = ["TorchCommunicator", "init_process_group", "default_backend", "BACKEND_VARIABLE"]


#: the environment variable naming the backend ``init`` takes when none is given
BACKEND_VARIABLE = "MERGECOMP_TORCH_BACKEND"
#: allgather into one flat tensor: ``all_gather_single`` where torch has it (it deprecates the
#: older name), ``all_gather_into_tensor`` before that (torch 2.11, for one)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def default_backend() -> str:
    """The backend of ``init(backend=None)``: ``MERGECOMP_TORCH_BACKEND`` where set (``gloo``
    keeps CPU tensors' collectives on a host with GPUs, several ranks on one GPU), else NCCL where
    CUDA is available, else gloo."""
    named = os.environ.get(BACKEND_VARIABLE)
    if named:
        return named
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_process_group(backend: Optional[str], timeout: float) -> None:
    """Initialise the default process group from torchrun's environment, if not done yet
    (``backend`` None: :func:`default_backend`)."""
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch engine: environment variables {missing} are not set; launch with "
            f"`torchrun --nproc_per_node N script.py` or call torch.distributed.init_process_group first"
        )
    if backend is None:
        backend = default_backend()
    limit = datetime.timedelta(seconds=timeout)
    generation = next(_generations)
    if generation == 0:
        _warn_shared_store()
        dist.init_process_group(backend, timeout=limit)
        return
    # Again after a shutdown: the launcher's store still holds the earlier group's keys, which a
    # rank arriving late would read as its peers' addresses; each generation gets keys of its own.
    store, rank, size = next(dist.rendezvous("env://", timeout=limit))
    dist.init_process_group(backend, store=dist.PrefixStore(f"mergecomp/init{generation}", store), rank=rank,
                            world_size=size, timeout=limit)


def _warn_shared_store() -> None:
    """Warn (rank 0) when torchrun restarts its workers on a store that outlives them: its agents
    share one TCPStore across rendezvous rounds unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    so a restarted worker can read a peer address of an earlier attempt and fail to connect
    (pytorch/pytorch#135712), and torchrun restarts it again until its restarts are spent."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
            and os.environ.get("RANK") == "0"):
        warnings.warn(
            "torchrun restarts these workers (--max-restarts > 0) on one TCPStore shared across its "
            "restarts: a restarted worker can read an address of an earlier attempt's workers and fail "
            "to connect (gloo: 'connectFullMesh failed ... Connection refused'; pytorch/pytorch#135712). "
            "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment so that every "
            "restart gets a store of its own", stacklevel=3)


#: how many times this process initialised the default group here (0: not yet)
_generations = itertools.count()


#: dtypes gloo and NCCL sum as they are, and move as they are
_SUMMABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
             torch.int64)


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous), as raw bytes when the backends lack its dtype (16-bit and wide
    unsigned integers, bool, complex)."""
    return tensor if tensor.dtype in _SUMMABLE else tensor.view(torch.uint8)


class TorchCommunicator(Communicator):
    """Collectives on a torch.distributed process group (default: the world)."""

    engine = "torch"

    def __init__(self, group=None, timeout: Optional[float] = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self.group = group
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _handle(self, work, result: torch.Tensor, describe: Callable[[], str],
                finish: Optional[Callable[[], torch.Tensor]] = None) -> Handle:
        def wait(timeout: float) -> torch.Tensor:
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
            except RuntimeError as err:  # gloo/NCCL name neither the rank nor the operation
                raise RuntimeError(f"{describe()} failed: {err}") from err
            return result if finish is None else finish()

        return Handle(wait, self.timeout)

    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        """``all_reduce`` (sum) in place; a dtype the backend cannot sum (gloo: 16-bit and unsigned
        integers but uint8) is summed in int64 and copied back (wrapping as an integer sum would)."""
        describe = self._describe("torch all_reduce", tensor)
        if tensor.dtype not in _SUMMABLE:
            wide = tensor.to(torch.int64)
            work = dist.all_reduce(wide, group=self.group, async_op=True)
            return self._handle(work, tensor, describe, finish=lambda: tensor.copy_(wide))
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return self._handle(work, tensor, describe)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        flat = _movable(tensor.reshape(-1))
        out = flat.new_empty(self.size * flat.numel())
        work = _all_gather_single(out, flat, group=self.group, async_op=True)
        return self._handle(work, out.view(tensor.dtype).view(self.size, -1),
                            self._describe("torch all_gather_single", tensor))

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        """``all_to_all_single`` on ``tensor`` (bytes for dtypes the backend lacks; gloo moves
        empty blocks too)."""
        out = tensor.new_empty((self.size, self._block(tensor)))
        work = dist.all_to_all_single(_movable(out.view(-1)), _movable(tensor), group=self.group, async_op=True)
        return self._handle(work, out, self._describe("torch all_to_all_single", tensor))

    def _split_hosts(self, local_size: int) -> Tuple["TorchCommunicator", "TorchCommunicator"]:
        """``dist.new_group`` of this rank's host (consecutive ranks) and of its local rank on
        every host; only their members create each (``use_local_synchronization``), so ranks
        outside this communicator's group take no part."""
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.size))
        host, local = divmod(self.rank, local_size)
        timeout = datetime.timedelta(seconds=self.timeout)
        groups = [dist.new_group(members, timeout=timeout, use_local_synchronization=True)
                  for members in (ranks[host * local_size:(host + 1) * local_size], ranks[local::local_size])]
        return tuple(TorchCommunicator(group, self.timeout) for group in groups)

    def subgroup(self, ranks: Sequence[int]) -> Optional["TorchCommunicator"]:
        """``dist.new_group`` of ``ranks``, created by its members only (``use_local_synchronization``)."""
        if self.rank not in ranks:
            return None
        members = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.size))
        group = dist.new_group([members[r] for r in ranks], timeout=datetime.timedelta(seconds=self.timeout),
                               use_local_synchronization=True)
        return TorchCommunicator(group, self.timeout)

    def close(self) -> None:
        """Destroy the group this communicator made (not the default group: shutdown does)."""
        super().close()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        work = dist.broadcast(_movable(tensor), group=self.group, async_op=True, group_src=root)  # root in the group
        describe = self._describe(f"torch broadcast from rank {root}", tensor)
        return self._handle(work, tensor, describe).wait(f"broadcast from rank {root}")
