"""Every rank's mergecomp state in one checkpoint, for frameworks that write a checkpoint from
rank 0 alone (error-feedback memories differ from rank to rank; under DiLoCo the local
parameters too: :class:`DiLoCoRank`).

A record is ``{"world_size": N, "ranks": [state of rank 0, ..., state of rank N-1]}``, its
tensors on the CPU; on ranks other than 0, :func:`collect` gives ``"ranks": None`` (they do not
write it).  It takes N times one rank's state (top-k's residuals: 4 bytes per parameter per rank).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from mergecomp.torch.diloco import DiLoCo

__all__ = ["collect", "own", "AllRanks", "DiLoCoRank"]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(value, fn) for value in obj)
    return obj


def collect(local: Any) -> Dict[str, Any]:
    """The record of every rank's ``local`` (module docstring).  Collective on the world: every
    rank calls it at the same point."""
    world = dist.get_world_size()
    ranks = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(_map_tensors(local, lambda t: t.detach().cpu()), ranks, dst=0)
    return {"world_size": world, "ranks": ranks}


def own(record: Dict[str, Any], device: Optional[torch.device] = None,
        reshard: Optional[Callable[[List[Any]], Any]] = None) -> Any:
    """This rank's state in ``record``, its tensors on ``device``.  Saved on another number of
    ranks: ``reshard(every rank's state)`` where given (e.g.
    :func:`~mergecomp.pipeline.resharding.to_fold`: per-rank memories folded where the state is
    loaded), else rank 0's (the merged step then starts per-rank state afresh and says so)."""
    ranks = record.get("ranks")
    if ranks is None:
        raise ValueError("this mergecomp checkpoint record was written by a rank other than 0 and holds no "
                         "rank's state (save checkpoints from rank 0, e.g. not with save_on_each_node)")
    if record.get("world_size") == dist.get_world_size():
        mine = ranks[dist.get_rank()]
    else:
        mine = reshard(ranks) if reshard is not None else ranks[0]
    return _map_tensors(mine, lambda t: t.to(device)) if device is not None else mine


class AllRanks:
    """``target``'s state (anything with ``state_dict``/``load_state_dict``) for every rank in one
    checkpoint object: ``state_dict()`` is collective (:func:`collect`), ``load_state_dict``
    takes this rank's part (:func:`own`, moved to ``device``; ``reshard`` as there)."""

    def __init__(self, target: Any, device: Optional[torch.device] = None,
                 reshard: Optional[Callable[[List[Any]], Any]] = None) -> None:
        self.target = target
        self.device = device
        self.reshard = reshard

    def state_dict(self) -> Dict[str, Any]:
        return collect(self.target.state_dict())

    def load_state_dict(self, record: Dict[str, Any]) -> None:
        self.target.load_state_dict(own(record, self.device, self.reshard))

    def __repr__(self) -> str:
        return f"AllRanks({self.target!r})"


class DiLoCoRank:
    """What one rank resumes DiLoCo from: its DiLoCo state, its local parameters and its inner
    optimizer's state (under DiLoCo each rank's differ between synchronizations)."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    @staticmethod
    def reshard(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The state a rank of another number of ranks resumes from (``reshard`` of
        :class:`AllRanks`): the error-feedback memories folded
        (:meth:`~mergecomp.torch.DiLoCo.every_rank_state`), rank 0's local parameters and inner
        optimizer state on every rank."""
        return {**ranks[0], "diloco": DiLoCo.every_rank_state([state["diloco"] for state in ranks])}

    def state_dict(self) -> Dict[str, Any]:
        return {"diloco": self.diloco.state_dict(), "parameters": [p.detach().clone() for p in self.diloco.params],
                "inner_optimizer": self.diloco.inner_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.diloco.load_state_dict(state["diloco"])
        torch._foreach_copy_([p.data for p in self.diloco.params], state["parameters"])
        self.diloco.inner_optimizer.load_state_dict(state["inner_optimizer"])
