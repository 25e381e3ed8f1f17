"""torch.distributed engine: gloo on CPU, NCCL on CUDA (launch with ``torchrun``)."""
from __future__ import annotations

import datetime
import os
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from mergecomp.engines.communicator import Communicator, Handle

__all__ = ["TorchCommunicator", "init_process_group"]


def init_process_group(backend: Optional[str], timeout: float) -> None:
    """Initialise the default process group from torchrun's environment, if not done yet."""
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch engine: environment variables {missing} are not set; launch with "
            f"`torchrun --nproc_per_node N script.py` or call torch.distributed.init_process_group first"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


class TorchCommunicator(Communicator):
    """Collectives on a torch.distributed process group (default: the world)."""

    engine = "torch"

    def __init__(self, group=None, timeout: Optional[float] = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self.group = group
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _handle(self, work, result: torch.Tensor, describe: Callable[[], str]) -> Handle:
        def wait(timeout: float) -> torch.Tensor:
            try:
                work.wait(timeout=datetime.timedelta(seconds=timeout))
            except RuntimeError as err:  # gloo/NCCL name neither the rank nor the operation
                raise RuntimeError(f"{describe()} failed: {err}") from err
            return result

        return Handle(wait, self.timeout)

    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return self._handle(work, tensor, self._describe("torch all_reduce", tensor))

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        out = tensor.new_empty(self.size * tensor.numel())
        work = dist.all_gather_single(out, tensor.reshape(-1), group=self.group, async_op=True)
        return self._handle(work, out.view(self.size, -1), self._describe("torch all_gather_single", tensor))

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        """``all_to_all_single`` on ``tensor`` as it is: gloo and NCCL move any dtype, and gloo
        empty blocks too."""
        out = tensor.new_empty((self.size, self._block(tensor)))
        work = dist.all_to_all_single(out, tensor, group=self.group, async_op=True)
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

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        work = dist.broadcast(tensor, src=root, group=self.group, async_op=True)
        describe = self._describe(f"torch broadcast from rank {root}", tensor)
        return self._handle(work, tensor, describe).wait(f"broadcast from rank {root}")
