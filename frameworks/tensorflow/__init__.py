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

Custom loops: ``tape = mct.DistributedGradientTape(tape, compression="topk")``.
"""
from mergecomp.registry import Compression
from mergecomp.runtime import init, is_initialized, local_rank, local_size, rank, shutdown, size

from .functions import broadcast_variables
from .ops import allreduce_gradients
from .optimizer import Average, DistributedGradientTape, DistributedOptimizer, Sum
from .reducer import GradientReducer

__all__ = [
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "GradientReducer",
    "Sum",
    "allreduce_gradients",
    "broadcast_variables",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
