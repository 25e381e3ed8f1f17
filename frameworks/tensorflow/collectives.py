"""``horovod.tensorflow``'s tensor collectives (``allreduce``, ``allgather``, ``broadcast``,
``broadcast_object`` ...) on TF tensors: :mod:`mergecomp.horovod_api.collectives` run on DLPack views.

Eagerly the tensors cross into torch without a copy; inside ``tf.function`` each call is one
``tf.py_function`` op (not XLA-compilable).  Every rank must call the same collectives in the
same order; each wait is bounded by ``MERGECOMP_TIMEOUT`` and raises
:class:`~mergecomp.engines.communicator.CommunicationError` naming the operation.  Like the torch front end's,
these are not differentiable: no gradient flows through them.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import tensorflow as tf
import torch

from mergecomp.horovod_api import collectives
from mergecomp.horovod_api.arguments import check_process_set
from mergecomp.registry import Compression

from .bridge import to_tf, to_torch

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object", "barrier", "join"]


def check_devices(device_dense: str, device_sparse: str, what: str) -> None:
    """Horovod's device placement options: only their default ('') is accepted."""
    if device_dense or device_sparse:
        raise NotImplementedError(f"{what}: device_dense/device_sparse are not supported; mergecomp reduces on "
                                  f"its engine's device (leave them '')")


def _on_torch(fn: Callable[[torch.Tensor], torch.Tensor], tensor, name: str, shape=None) -> tf.Tensor:
    """``fn`` applied to a torch view of ``tensor``: eagerly, or as one py_function in a graph."""
    tensor = tf.convert_to_tensor(tensor)

    def call(t):
        return to_tf(fn(to_torch(t)))

    if tf.executing_eagerly():
        return call(tensor)
    out = tf.py_function(call, [tensor], Tout=tensor.dtype, name=name)
    out.set_shape(tensor.shape if shape is None else shape)
    return out


def allreduce(tensor, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """The reduction over ranks of ``tensor`` (same shape and dtype on every rank).

    ``op``: ``Average`` (default) or ``Sum`` (``average=`` is the older spelling); ``Adasum``
    raises NotImplementedError.  ``compression=Compression.fp16`` sends a floating tensor as
    float16.  A ``tf.IndexedSlices`` is reduced densely (the result is a dense tensor).
    """
    check_devices(device_dense, device_sparse, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    return _on_torch(lambda t: collectives.allreduce(t, average, name, compression, op, prescale_factor,
                                                     postscale_factor, process_set), tensor, "mergecomp_allreduce")


def allgather(tensor, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 in rank order (the first dimension
    may differ between ranks, the others and the dtype may not)."""
    check_process_set(process_set)
    tensor = tf.convert_to_tensor(tensor)
    return _on_torch(lambda t: collectives.allgather(t, name), tensor, "mergecomp_allgather",
                     shape=tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else [None])


def broadcast(tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank (same shape and dtype on every rank)."""
    return _on_torch(lambda t: collectives.broadcast(t, root_rank, name, process_set), tensor,
                     "mergecomp_broadcast")


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Rank ``root_rank``'s Python object on every rank (pickled; call it eagerly)."""
    return collectives.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: Any = None) -> List[Any]:
    """Every rank's Python object, in rank order (pickled; call it eagerly)."""
    check_process_set(process_set)
    return collectives.allgather_object(obj, name)


barrier = collectives.barrier
join = collectives.join
