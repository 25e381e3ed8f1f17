"""PyTorch front end, shaped like Horovod's ``horovod.torch``.

Example::

    import mergecomp.torch as mc
    mc.init()                                   # torchrun sets RANK/WORLD_SIZE
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * mc.size(), momentum=0.9)
    opt = mc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=mc.Compression.topk, memory="residual", groups=2)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    mc.broadcast_optimizer_state(opt, root_rank=0)
"""
from mergecomp.horovod_api.arguments import Adasum, Average, Sum, global_process_set
from mergecomp.horovod_api.collectives import (allgather, allgather_async, allgather_object, allreduce, allreduce_,
                                               allreduce_async, allreduce_async_, alltoall, barrier, broadcast,
                                               broadcast_, broadcast_object, cross_rank, cross_size, cuda_built,
                                               gloo_built, gloo_enabled, join, mpi_built, mpi_enabled,
                                               mpi_threads_supported, nccl_built, poll, rocm_built, synchronize)
from mergecomp.horovod_api.runtime import (communicator, init, is_initialized, local_rank, local_size, rank, shutdown,
                                           size)
from mergecomp.registry import Compression

from .ddp_hook import ddp_comm_hook
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "communicator",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "gloo_built",
    "gloo_enabled",
    "join",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rocm_built",
    "synchronize",
    "global_process_set",
    "ddp_comm_hook",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
