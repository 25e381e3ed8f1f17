"""Broadcasts that start every data-parallel job: parameters and optimizer state from one rank."""
from __future__ import annotations

import io
from typing import Iterable, Mapping, Tuple, Union

import torch

from mergecomp.runtime import communicator

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]

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
    comm = communicator()
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.is_contiguous():
            comm.broadcast_(tensor, root_rank)
        else:
            tensor.copy_(comm.broadcast_(tensor.contiguous(), root_rank))


def broadcast_object(obj, root_rank: int = 0):
    """Return rank ``root_rank``'s ``obj`` on every rank (pickled with ``torch.save``)."""
    comm = communicator()
    if comm.size == 1:
        return obj
    payload = torch.empty(0, dtype=torch.uint8)
    if comm.rank == root_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    length = comm.broadcast_(torch.tensor([payload.numel()], dtype=torch.int64, device=comm.device), root_rank)
    if comm.rank != root_rank:
        payload = torch.empty(int(length), dtype=torch.uint8)
    payload = comm.broadcast_(payload.to(comm.device), root_rank)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (hyperparameters, momenta) equal to rank ``root_rank``'s.

    For a :class:`~mergecomp.torch.DistributedOptimizer` only the wrapped optimizer's state is
    broadcast: error-feedback residuals are per rank by design.
    """
    inner = getattr(optimizer, "wrapped_optimizer", optimizer)
    state = broadcast_object(inner.state_dict(), root_rank)
    inner.load_state_dict(state)
