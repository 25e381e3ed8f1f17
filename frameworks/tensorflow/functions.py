"""Broadcast that starts every data-parallel TF job: variables from one rank to all."""
from __future__ import annotations

from typing import Iterable, List

import numpy as np
import tensorflow as tf
import torch

from mergecomp.horovod_api.runtime import communicator

__all__ = ["broadcast_variables"]


def _broadcast_values(values: List, root_rank: int) -> List[np.ndarray]:
    """Rank ``root_rank``'s ``values`` (eager tensors or arrays) on every rank, as numpy arrays.

    All values travel as the bytes of one buffer in one broadcast; each comes back with its
    own shape and dtype (0-d included).
    """
    arrays = [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in values]
    raw = np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
    communicator().broadcast_(torch.from_numpy(raw), root_rank)
    out, offset = [], 0
    for a in arrays:
        # a.shape keeps 0-d values 0-d; the copy is aligned (TF's kernels need that)
        out.append(raw[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape).copy())
        offset += a.nbytes
    return out


def broadcast_variables(variables: Iterable, root_rank: int = 0):
    """Overwrite every rank's variables with rank ``root_rank``'s values.

    All variables travel as the bytes of one buffer in one broadcast (any dtype and shape,
    including 0-d counters and Keras' seed-generator states).  Every rank must pass the same
    variables in the same order.  Works eagerly and inside ``tf.function`` (there the broadcast
    is one ``tf.py_function`` op, like the gradient exchange; returns the group of assignments).

    Example::

        mct.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    if communicator().size == 1 or not variables:
        return None
    if tf.executing_eagerly():
        for v, value in zip(variables, _broadcast_values(variables, root_rank)):
            v.assign(value)
        return None
    dtypes = [tf.as_dtype(v.dtype) for v in variables]
    received = tf.py_function(lambda *values: _broadcast_values(list(values), root_rank),
                              [tf.convert_to_tensor(v) for v in variables], Tout=dtypes,
                              name="mergecomp_broadcast")
    assigns = []
    for v, value in zip(variables, received):
        value.set_shape(v.shape)
        assigns.append(v.assign(value))
    return tf.group(*[a for a in assigns if a is not None])
