"""The TensorFlow side of one exchange: gradients in, averaged gradients out, eager or graph.

:func:`allreduce_gradients` prepares the gradients in TF (``None`` -> zeros, ``tf.IndexedSlices``
-> dense with a warning), then crosses into torch once per step through ``tf.py_function``:
inside it the gradients are DLPack views (no copy), the :class:`~.reducer.GradientReducer`
merges, compresses and communicates them, and the results come back as DLPack views (no copy).

Graph mode (``tf.function``, Keras ``model.fit``): the ``py_function`` is one op in the graph.
TF runs it on its executor with the Python interpreter (GIL held while encoding, released while
torch waits on the network), once per step, after every gradient is computed.  XLA cannot
compile it: under ``jit_compile=True`` a clear error is raised.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from .bridge import to_tf, to_torch, torch_dtype
from .reducer import GradientReducer

__all__ = ["allreduce_gradients", "exchange_gradients", "variable_name"]


def variable_name(variable) -> str:
    """Keras 3 variables: ``path`` (unique in a model); tf.Variable: ``name``."""
    return getattr(variable, "path", None) or variable.name


def _in_xla_context() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):  # private API moved: TF's own error will name the op
        return False


def _dense(grad, variable, name: str, warn_sparse: bool) -> tf.Tensor:
    if grad is None:  # a variable the loss does not depend on: every rank still sends its group
        return tf.zeros(variable.shape, dtype=variable.dtype)
    if isinstance(grad, tf.IndexedSlices):
        if warn_sparse:
            warnings.warn(f"variable {name!r} has a sparse gradient (tf.IndexedSlices, e.g. an embedding); "
                          f"mergecomp exchanges it densely ({variable.shape.num_elements()} elements; "
                          f"sparse_as_dense=True says so and silences this)", stacklevel=5)
        return tf.convert_to_tensor(grad)
    return grad


def allreduce_gradients(reducer: GradientReducer, grads: Sequence[Optional[tf.Tensor]],
                        variables: Sequence) -> List[tf.Tensor]:
    """Average ``grads`` (one per variable; symbolic or eager) over ranks through ``reducer``.

    Returns dense tensors with the variables' shapes and dtypes, in the same order.
    """
    return exchange_gradients(reducer, grads, variables)[0]


def exchange_gradients(reducer: GradientReducer, grads: Sequence[Optional[tf.Tensor]], variables: Sequence,
                       local: Sequence[bool] = ()) -> Tuple[List[tf.Tensor], tf.Tensor]:
    """:func:`allreduce_gradients` with local variables (``local[i]``: keep this rank's
    gradient) and the reducer's ``backward_passes_per_step``.

    Returns the gradients and a boolean tensor: True when they are the exchanged ones, False on
    a pass that only added them to the reducer's local sums (then the gradients are the inputs).
    """
    variables = list(variables)
    if len(grads) != len(variables):
        raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
    if _in_xla_context():
        raise RuntimeError("mergecomp exchanges gradients in a tf.py_function, which XLA cannot compile: "
                           "pass jit_compile=False to model.compile() or tf.function()")
    names = [variable_name(v) for v in variables]
    dense = [_dense(g, v, n, reducer.warn_sparse) for g, v, n in zip(grads, variables, names)]
    reducer.bind(names, [tuple(v.shape) for v in variables], [torch_dtype(g.dtype) for g in dense],
                 list(local) or None)

    def exchange(*tensors):
        reduced = reducer.reduce([to_torch(t) for t in tensors])
        if reduced is None:
            return [*tensors, False]
        return [*(to_tf(t) for t in reduced), True]

    *reduced, ready = tf.py_function(exchange, dense, Tout=[g.dtype for g in dense] + [tf.bool],
                                     name="mergecomp_exchange")
    for out, v in zip(reduced, variables):
        out.set_shape(v.shape)
    ready.set_shape([])
    return reduced, ready
