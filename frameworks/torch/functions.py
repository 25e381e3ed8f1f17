"""Broadcasts that start every data-parallel job: parameters and optimizer state from one rank."""
from __future__ import annotations

from typing import Iterable, List, Mapping, Tuple, Union

import torch

from mergecomp.engines.communicator import Communicator
from mergecomp.horovod_api.collectives import broadcast_object
from mergecomp.horovod_api.runtime import communicator

__all__ = ["broadcast_parameters", "broadcast_tensors", "broadcast_optimizer_state", "broadcast_class_state"]

Params = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


@torch.no_grad()
def broadcast_parameters(params: Params, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with rank ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.  Every rank must pass
            the same names in the same order.

    Example::

        mc.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    broadcast_tensors(communicator(), list(params.items()) if isinstance(params, Mapping) else list(params),
                      root_rank)


@torch.no_grad()
def broadcast_tensors(comm: Communicator, items: List[Tuple[str, torch.Tensor]], root_rank: int) -> None:
    """:func:`broadcast_parameters` of the ``(name, tensor)`` pairs ``items`` over ``comm``."""
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.is_contiguous():
            comm.broadcast_(tensor, root_rank)
        else:
            tensor.copy_(comm.broadcast_(tensor.contiguous(), root_rank))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (hyperparameters, momenta) equal to rank ``root_rank``'s.

    For a :class:`~mergecomp.torch.DistributedOptimizer` the merge plan, step counter and
    scheduler state come from ``root_rank`` too (:meth:`mergecomp.pipeline.step.MergedStep.agree_with`),
    so a checkpoint loaded on ``root_rank`` alone resumes on every rank.  Error-feedback
    residuals are per rank by design: they stay where every rank loaded its own at the same
    step, and are reset on every rank otherwise.

    When this rank's optimizer has no per-parameter state yet, each parameter that requires a
    gradient and has none is given a zero gradient (sparse for ``SparseAdam``), as Horovod's
    leaves it; Horovod takes a zero-gradient step to create the state, mergecomp takes no
    step.  Existing gradients are left as they are.
    """
    from .optimizer import DistributedOptimizer

    broadcast_class_state(optimizer, root_rank)
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.merged.agree_with(root_rank)


def broadcast_class_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """:func:`broadcast_optimizer_state` of the optimizer class's own state only (and the
    momentum exchange's): a :class:`~mergecomp.torch.DistributedOptimizer`'s merged state is
    left to the caller."""
    state = optimizer.state_dict()
    state.pop("mergecomp", None)
    if not state["state"]:
        _zero_missing_grads(optimizer)
    optimizer.load_state_dict(broadcast_object(state, root_rank))


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter of ``optimizer`` that requires a gradient and has none a zero one."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)  # it rejects dense gradients
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p, memory_format=torch.preserve_format)
                p.grad = zero.to_sparse() if sparse else zero
