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

from typing import Any, List, Optional, Sequence

import torch

from mergecomp.horovod_api import collectives as plain
from mergecomp.horovod_api.arguments import Average, Sum
from mergecomp.horovod_api.process_sets import resolve
from mergecomp.horovod_api.runtime import rank

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]


def _records(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options: dict, *tensors: torch.Tensor):
        ctx.options = options
        return tuple(plain.grouped_allreduce(list(tensors), **options))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        options = {k: v for k, v in ctx.options.items() if k not in ("name", "compression")}
        return (None, *plain.grouped_allreduce([g.contiguous() for g in grads], **options))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                      compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_allreduce`, differentiable."""
    options = dict(average=average, name=name, compression=compression, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)
    if not _records(tensors):
        return plain.grouped_allreduce(list(tensors), **options)
    return list(_GroupedAllreduce.apply(options, *tensors))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = None, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.allreduce`, differentiable."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name: Optional[str], process_set: Any, *tensors: torch.Tensor):
        ctx.process_set = process_set
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        return tuple(plain.grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        averaged = plain.grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.process_set)
        row_counts = plain.grouped_allgather([torch.tensor([r]) for r in ctx.rows], process_set=ctx.process_set)
        mine = resolve(ctx.process_set, "allgather's gradient").rank()
        parts = []
        for grad, counts, rows, shape in zip(averaged, row_counts, ctx.rows, ctx.shapes):
            start = int(counts[:mine].sum())
            parts.append(grad.narrow(0, start, rows).reshape(shape))
        return (None, None, *parts)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = None) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_allgather`, differentiable."""
    if not _records(tensors):
        return plain.grouped_allgather(list(tensors), name, process_set)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.allgather`, differentiable."""
    return grouped_allgather([tensor], name, process_set)[0]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: Any):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return plain.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        averaged = plain.allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:  # a rank of the job, as broadcast's root_rank
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None
              ) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.broadcast`, differentiable."""
    if not _records([tensor]):
        return plain.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


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
    if not _records([tensor]):
        return plain.alltoall(tensor, splits, name, process_set)
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options: dict, *tensors: torch.Tensor):
        ctx.options = options
        return tuple(plain.grouped_reducescatter(list(tensors), **options))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        options = ctx.options
        factor = options["prescale_factor"] * options["postscale_factor"]
        if options["op"] == Sum:
            factor *= resolve(options["process_set"], "reducescatter's gradient").size()
        scaled = [g * factor if factor != 1.0 else g.contiguous() for g in grads]
        return (None, *plain.grouped_allgather(scaled, process_set=options["process_set"]))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None, compression: Any = None,
                          op: Any = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """:func:`mergecomp.horovod_api.collectives.grouped_reducescatter`, differentiable."""
    options = dict(name=name, compression=compression, op=op, process_set=process_set,
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    if not _records(tensors):
        return plain.grouped_reducescatter(list(tensors), **options)
    return list(_GroupedReducescatter.apply(options, *tensors))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = None, op: Any = Average,
                  process_set: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0
                  ) -> torch.Tensor:
    """:func:`mergecomp.horovod_api.collectives.reducescatter`, differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]
