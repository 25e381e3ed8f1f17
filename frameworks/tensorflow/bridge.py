"""TensorFlow <-> torch tensors through DLPack: zero-copy, same device, same dtype.

``to_torch(t)`` views a TF eager tensor's buffer as a torch tensor (no copy); ``to_tf(t)``
hands a torch tensor's buffer to TF, which keeps the torch storage alive until it drops the
tensor (no copy if the buffer starts on a 64-byte boundary, else one copy: TF's kernels need
aligned buffers).  TF tensors are immutable: never write into a tensor returned by ``to_torch``.
What a trip through the bridge costs: :mod:`mergecomp.tensorflow.bridge_cost`.
"""
from __future__ import annotations

import tensorflow as tf
import torch
import torch.utils.dlpack

__all__ = ["to_torch", "to_tf", "torch_dtype"]

#: bytes; the largest EIGEN_MAX_ALIGN_BYTES of any TF build
_ALIGN = 64
_DTYPES = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
           tf.float64: torch.float64}


def torch_dtype(dtype: tf.dtypes.DType) -> torch.dtype:
    """The torch dtype of a TF floating dtype; TypeError for anything a gradient cannot be."""
    try:
        return _DTYPES[tf.as_dtype(dtype)]
    except KeyError:
        raise TypeError(f"mergecomp exchanges floating gradients (float16, bfloat16, float32, float64), "
                        f"got {tf.as_dtype(dtype).name}") from None


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """A torch view of an eager TF tensor (no copy).  Read only."""
    return torch.from_dlpack(tensor)


def to_tf(tensor: torch.Tensor) -> tf.Tensor:
    """An eager TF tensor sharing ``tensor``'s memory.  Do not modify ``tensor`` afterwards.

    TF's CPU kernels abort the process on a buffer that is not aligned to Eigen's boundary
    (``Check failed: IsAligned()``), which views at an offset usually are: such a tensor is
    copied first (torch allocates on 64-byte boundaries).
    """
    if tensor.data_ptr() % _ALIGN or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))
