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
from .ddp_hook import ddp_comm_hook
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .horovod_args import global_process_set
from .optimizer import Adasum, Average, Compression, DistributedOptimizer, Sum
from mergecomp.runtime import communicator, init, is_initialized, local_rank, local_size, rank, shutdown, size

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "communicator",
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
