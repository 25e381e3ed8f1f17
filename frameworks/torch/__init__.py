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
from mergecomp.horovod_api import elastic_on_first_use
from mergecomp.horovod_api.arguments import Adasum, Average, Max, Min, Product, Sum
from mergecomp.horovod_api.collectives import (allgather_async, allgather_object, allreduce_, allreduce_async,
                                               allreduce_async_, barrier, broadcast_, broadcast_async,
                                               broadcast_async_, broadcast_object, ccl_built, cross_rank, cross_size,
                                               cuda_built, ddl_built, gloo_built, gloo_enabled,
                                               grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                                               grouped_allreduce_async_, grouped_reducescatter_async, join, mpi_built,
                                               mpi_enabled, mpi_threads_supported, nccl_built, poll, reducescatter_async,
                                               rocm_built, sparse_allreduce_async, synchronize)
from mergecomp.engines.communicator import CommunicationError as HorovodInternalError
from mergecomp.horovod_api.negotiation import MismatchError
from mergecomp.horovod_api.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from mergecomp.horovod_api.runtime import (communicator, init, is_initialized, local_rank, local_size, rank, shutdown,
                                           size)
from mergecomp.horovod_api.timeline import start_timeline, stop_timeline
from mergecomp.registry import Compression

from . import checkpoint, fsdp
from .ddp_hook import ddp_comm_hook
from .diloco import DiLoCo, averaging, nesterov
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                             grouped_reducescatter, reducescatter)
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DiLoCo", "averaging", "nesterov", "DistributedOptimizer", "HorovodInternalError",
    "Max", "Min", "MismatchError", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "checkpoint", "communicator", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "ddp_comm_hook", "fsdp", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]


#: ``mc.elastic`` (Horovod's elastic API), imported on first use: it needs Horovod
__getattr__ = elastic_on_first_use(__name__)
