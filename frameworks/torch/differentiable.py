"""The tensor collectives of ``mergecomp.torch``, differentiable as Horovod defines them.

When autograd records (a tensor requires grad and grad mode is on), the result has a
``grad_fn`` whose backward is itself a collective over the same process set:

=================  ==========================================================================
forward            gradient of the input
=================  ==========================================================================
allreduce          the same reduction (op, prescale, postscale) of the result's gradient
grouped_allreduce  the same, for each tensor
allgather          the ranks' average of the result's gradient, this rank's rows of it
broadcast          the ranks' average of the result's gradient on the root, zeros elsewhere
alltoall           an alltoall of the result's gradient back with the received splits
reducescatter      an allgather of the result's gradient, times the set's size for ``Sum``
                   and times the scale factors
=================  ==========================================================================

Otherwise they are :mod:`mergecomp.horovod_api.collectives`'s functions unchanged (the
``_async`` and in-place forms are never differentiable, as in Horovod).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from mergecomp.horovod_api import collectives as plain
from mergecomp.horovod_api.arguments import Average, Sum
from mergecomp.horovod_api.process_sets import resolve
from mergecomp.horovod_api.runtime import rank

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]


class _Collective(torch.autograd.Function):
    """``run(tensors) -> outputs``, whose backward is ``gradient(output grads) -> input grads``."""

    @staticmethod
    def forward(ctx, run: Callable, gradient: Callable, *tensors: torch.Tensor):
        ctx.gradient = gradient
        return tuple(run(list(tensors)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *ctx.gradient([g.contiguous() for g in grads]))


def _differentiable(tensors: Sequence[torch.Tensor], run: Callable[[List[torch.Tensor]], List[torch.Tensor]],
                    gradient: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> List[torch.Tensor]:
    """``run(tensors)``, through :class:`_Collective` when autograd records."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return run(list(tensors))
    return list(_Collective.apply(run, gradient, *tensors))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_allreduce`, differentiable."""
    reduction = dict(average=average, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                     process_set=process_set)
    return _differentiable(tensors, lambda ts: plain.grouped_allreduce(ts, name=name, compression=compression,
                                                                       **reduction),
                           lambda grads: plain.grouped_allreduce(grads, **reduction))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.allreduce`, differentiable."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = None) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_allgather`, differentiable."""
    rows, shapes = [t.shape[0] if t.dim() else 1 for t in tensors], [t.shape for t in tensors]

    def gradient(grads: List[torch.Tensor]) -> List[torch.Tensor]:
        averaged = plain.grouped_allreduce(grads, op=Average, process_set=process_set)
        row_counts = plain.grouped_allgather([torch.tensor([r]) for r in rows], process_set=process_set)
        mine = resolve(process_set, "allgather's gradient").rank()
        return [grad.narrow(0, int(counts[:mine].sum()), n).reshape(shape)
                for grad, counts, n, shape in zip(averaged, row_counts, rows, shapes)]

    return _differentiable(tensors, lambda ts: plain.grouped_allgather(ts, name, process_set), gradient)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.allgather`, differentiable."""
    return grouped_allgather([tensor], name, process_set)[0]


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None
              ) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.broadcast`, differentiable."""
    def gradient(grads: List[torch.Tensor]) -> List[torch.Tensor]:
        averaged = plain.allreduce(grads[0], op=Average, process_set=process_set)
        return [averaged if rank() == root_rank else torch.zeros_like(averaged)]  # root_rank: a rank of the job

    return _differentiable([tensor], lambda ts: [plain.broadcast(ts[0], root_rank, name, process_set)], gradient)[0]


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, splits: Any, name: Optional[str], process_set: Any):
        ctx.process_set = process_set
        out, received = plain.alltoall_async(tensor, splits, name, process_set).result()
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _unused: Any):
        back, _ = plain.alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: Any = None):
    """:func:`mergecomp.horovod_api.collectives.alltoall`, differentiable."""
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return plain.alltoall(tensor, splits, name, process_set)
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None, compression: Any = None,
                          op: Any = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_reducescatter`, differentiable."""
    def gradient(grads: List[torch.Tensor]) -> List[torch.Tensor]:
        factor = prescale_factor * postscale_factor
        if op == Sum:
            factor *= resolve(process_set, "reducescatter's gradient").size()
        return plain.grouped_allgather([g * factor if factor != 1.0 else g for g in grads], process_set=process_set)

    return _differentiable(tensors, lambda ts: plain.grouped_reducescatter(
        ts, name, compression, op, process_set, prescale_factor, postscale_factor), gradient)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = None, op: Any = Average,
                  process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0
                  ) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.reducescatter`, differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]
