"""TensorFlow 2 / Keras 3 front end: the same compressors, memories, merge plans and scheduler
as ``mergecomp.torch``, reached zero-copy through DLPack (the torch side does all compression).

Example (launch one process per worker with ``torchrun``, like the torch front end)::

    import keras
    import mergecomp.tensorflow as mct

    mct.init()                                    # same communicator as mergecomp.torch
    model = make_model()
    opt = mct.DistributedOptimizer(keras.optimizers.SGD(0.01 * mct.size()),
                                   compression=mct.Compression.topk, groups=2)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")  # jit_compile stays off
    model.build(input_shape)
    mct.broadcast_variables(model.variables, root_rank=0)
    model.fit(x_shard, y_shard, epochs=3)

Custom loops: ``tape = mct.DistributedGradientTape(tape, compression=mct.Compression.topk)``.
Horovod's ``horovod.tensorflow`` names are here with Horovod's arguments (``allreduce``,
``broadcast``, ``broadcast_object``, ``PartialDistributedGradientTape`` ...).
"""
from mergecomp.horovod_api import elastic_on_first_use
from mergecomp.horovod_api.arguments import Adasum, Average, Sum, global_process_set
from mergecomp.horovod_api.collectives import (cross_rank, cross_size, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                               mpi_threads_supported, nccl_built)
from mergecomp.horovod_api.runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size
from mergecomp.registry import Compression

from .collectives import allgather, allgather_object, allreduce, barrier, broadcast, broadcast_object, join
from .functions import broadcast_variables
from .ops import allreduce_gradients
from .optimizer import DistributedGradientTape, DistributedOptimizer, PartialDistributedGradientTape
from .reducer import GradientReducer

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer", "GradientReducer",
    "PartialDistributedGradientTape", "Sum", "allgather", "allgather_object", "allreduce", "allreduce_gradients",
    "barrier", "broadcast", "broadcast_object", "broadcast_variables", "cross_rank", "cross_size", "global_process_set",
    "gloo_built", "gloo_enabled", "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "shutdown", "size",
]


#: ``mct.elastic`` (Horovod's elastic API), imported on first use: it needs Horovod
__getattr__ = elastic_on_first_use(__name__)
