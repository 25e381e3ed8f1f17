"""Broadcast that starts every data-parallel TF job: variables from one rank to all."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import tensorflow as tf
import torch

from mergecomp.runtime import communicator

__all__ = ["broadcast_variables"]


def broadcast_variables(variables: Iterable, root_rank: int = 0) -> None:
    """Overwrite every rank's variables with rank ``root_rank``'s values (eagerly, once).

    All variables travel as the bytes of one buffer in one broadcast (any dtype, including
    Keras' seed-generator states).  Every rank must pass the same variables in the same order.

    Example::

        mct.broadcast_variables(model.variables, root_rank=0)
    """
    if not tf.executing_eagerly():
        raise RuntimeError("broadcast_variables() runs eagerly: call it once before training, outside tf.function")
    comm = communicator()
    variables = list(variables)
    if comm.size == 1 or not variables:
        return
    arrays = [np.ascontiguousarray(v.numpy()) for v in variables]
    raw = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    payload = torch.from_numpy(raw)
    comm.broadcast_(payload, root_rank)
    offset = 0
    for v, a in zip(variables, arrays):
        part = raw[offset:offset + a.nbytes]
        v.assign(part.view(a.dtype).reshape(a.shape))
        offset += a.nbytes
