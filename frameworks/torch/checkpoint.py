"""Checkpoints in torch's distributed checkpoint format (``torch.distributed.checkpoint``) that
resume on another number of ranks: torchrun's elastic restarts (``--nnodes MIN:MAX``,
``--max-restarts``) after a lost or added worker.

    import mergecomp.torch as mc
    if os.path.exists("ckpt/latest"):
        extra = mc.checkpoint.load("ckpt/latest", model, opt)       # every rank, whatever the world's size
        start = extra["step"]
    ...
    mc.checkpoint.save("ckpt/latest", model, opt, step=step)        # every rank

What is written (one ``checkpoint_id`` folder, every rank calling): the model's state dict
(tensors, each written once) and the optimizer class's state, the same on every rank; each
rank's own mergecomp state under ``mergecomp.rank<r>`` (its error-feedback residuals differ
from every other rank's); the world size; the keyword objects given (rank 0's).  What is read:
the model and the optimizer class's state; on a world of the same size each rank its own
mergecomp state, on another size every old rank's, folded as
:meth:`~mergecomp.torch.DistributedOptimizer.load_every_rank` says (``residuals="fold"``: each
rank's memory the mean of the old ranks'; ``"drop"``: fresh; replicated state rank 0's; the
scheduler searches again).  Runs on the torch engine (torchrun), or on one process.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional

import torch

from mergecomp.engines.communicator import Communicator
from mergecomp.horovod_api.runtime import communicator

from .optimizer import DistributedOptimizer

__all__ = ["save", "load"]

_WORLD = "mergecomp.world_size"


def _own(rank: int) -> str:
    """The key of rank ``rank``'s mergecomp state."""
    return f"mergecomp.rank{rank}"


def _packed(obj: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def _unpacked(buffer: io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _communicator() -> Communicator:
    """The communicator, on an engine torch.distributed.checkpoint runs on (RuntimeError else)."""
    comm = communicator()
    if comm.engine not in ("torch", "local"):
        raise RuntimeError(f"mc.checkpoint writes with torch.distributed.checkpoint, which runs on the torch engine "
                           f"(torchrun); this process runs the {comm.engine!r} engine: save each rank's "
                           f"optimizer.state_dict() with torch.save, or use hvd.elastic under horovodrun")
    return comm


def save(checkpoint_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
    """Write ``model``, ``optimizer`` (its mergecomp state per rank) and ``extra`` (picklable
    objects, rank 0's) to the folder ``checkpoint_id``; every rank calls it."""
    import torch.distributed.checkpoint as dcp

    comm = _communicator()
    state = optimizer.state_dict()
    merged = state.pop("mergecomp", None)
    written: Dict[str, Any] = {"model": model.state_dict(), "optimizer": _packed(state), "extra": _packed(extra),
                               _WORLD: comm.size}
    if merged is not None:
        written[_own(comm.rank)] = _packed(merged)
    dcp.save(written, checkpoint_id=checkpoint_id)


def load(checkpoint_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         residuals: str = "fold") -> Dict[str, Any]:
    """Read what :func:`save` wrote into ``model`` and ``optimizer`` on this world, whatever its
    size (module docstring); returns the ``extra`` objects.  Every rank calls it, between steps."""
    import torch.distributed.checkpoint as dcp

    comm = _communicator()
    header = {_WORLD: 0}
    dcp.load(header, checkpoint_id=checkpoint_id)
    saved_size = int(header[_WORLD])
    ours = isinstance(optimizer, DistributedOptimizer)
    wanted = range(saved_size) if saved_size != comm.size else [comm.rank]
    read: Dict[str, Any] = {"model": model.state_dict(), "optimizer": io.BytesIO(), "extra": io.BytesIO(),
                            **({_own(r): io.BytesIO() for r in wanted} if ours else {})}
    dcp.load(read, checkpoint_id=checkpoint_id)
    model.load_state_dict(read["model"])
    optimizer.load_state_dict(_unpacked(read["optimizer"]))
    if ours:
        states: List[Optional[Dict[str, Any]]] = [None] * saved_size
        for r in wanted:
            states[r] = _unpacked(read[_own(r)])
        optimizer.merged.load_ranks(states, residuals)
    return _unpacked(read["extra"])
