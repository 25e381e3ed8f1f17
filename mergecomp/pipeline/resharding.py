"""A merged step's state, saved on N ranks, for a world of another size (a torchrun elastic
restart from every rank's checkpoint: :func:`fold`; a Horovod elastic reset, where the ranks
that stay keep their own state in memory and the others join: :func:`rejoined`).

Every rank's :meth:`~mergecomp.pipeline.step.MergedStep.state_dict` holds state of two kinds:

* **replicated**: the plan, the step counters, PowerSGD's ``Q``, rand-k's step, ACP-SGD's factor:
  equal on every rank, so any rank's serves the new world;
* **per rank**: the error-feedback memories (``"memory"``: residuals, DGC's velocity, the
  averaged memory's error) and a compressor's own running state (Signum's momentum), each this
  rank's share of what has not been sent yet.

:func:`fold` makes one state every rank of the new world loads: a tensor equal on every old rank
is kept; a per-rank one (a floating tensor that differs) becomes the mean over the old ranks
(``residuals="fold"``: the average of the unsent gradients is what every rank would have added;
a rank that leaves no longer takes its share with it), or is dropped (``residuals="drop"``: the
memories start at zero, as DeepSpeed's 1-bit Adam does on every load).  A group whose tensors
differ in shape between ranks, and the sharded schemes' state (its shards are cut by N), start
afresh either way.  The scheduler's measured timings depend on N: it searches again.

:func:`rejoined` makes each rank's state after a Horovod elastic reset: the root's replicated
state; this rank's own per-rank state where it stayed (its state is at the root's step and
plan), nothing where it joined (a joiner never starts with another rank's residual); a rank
that left took its share with it.  Which compressor fields are per rank is told by the ranks
that stayed: a field that differs between any of them and the root's.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["RESIDUAL_POLICIES", "FOLDED", "EVERY_RANK", "fold", "to_fold", "rejoined", "same_run",
           "differing_fields"]

#: what :func:`fold` does with each rank's share of state
RESIDUAL_POLICIES = ("fold", "drop")
#: the holders whose per-rank state :func:`fold` may fold (the others start afresh)
FOLDED = ("memory", "compressor")
#: the key of a state that holds every old rank's state, folded where it is loaded (:func:`to_fold`)
EVERY_RANK = "every_rank"


def _fold_group(fields: List[Dict[str, torch.Tensor]], residuals: str) -> Dict[str, torch.Tensor]:
    """One group's fields from every old rank's: equal tensors kept, the others folded (their
    mean) or, under ``"drop"`` or where they cannot be averaged, left out."""
    out = {}
    for name, first in fields[0].items():
        mine = [f.get(name) for f in fields]
        if any(t is None or t.shape != first.shape or t.dtype != first.dtype for t in mine):
            continue
        if all(torch.equal(t, first) for t in mine[1:]):
            out[name] = first
        elif residuals == "fold" and first.is_floating_point():
            out[name] = torch.stack(mine).mean(dim=0, dtype=torch.float64 if first.dtype == torch.float64
                                               else torch.float32).to(first.dtype)
    return out


def fold(states: Sequence[Dict[str, Any]], holders: Sequence[str], residuals: str = "fold") -> Dict[str, Any]:
    """The state one rank of a world of any size loads, from the states of every rank of the
    world that saved them (module docstring); ``holders``: the exchange's state holders
    (:meth:`~mergecomp.exchange.exchange.Exchange.holders`).  The rest comes from rank 0's; the
    result names no rank and no world size, so it loads on every rank as its own."""
    if residuals not in RESIDUAL_POLICIES:
        raise ValueError(f"residuals must be one of {RESIDUAL_POLICIES}, got {residuals!r}")
    first = states[0]
    if any(s["plan"] != first["plan"] or s["shapes"] != first["shapes"] for s in states[1:]):
        raise ValueError("the ranks' checkpoints hold different plans or tensors: they were not saved by one job")
    out = {key: value for key, value in first.items() if key not in ("rank", "world_size")}
    for key in holders:
        if key not in FOLDED:  # the sharded schemes' state, cut by N: afresh
            out[key] = {}
            continue
        held = [s.get(key, {}) for s in states]
        groups = [name for name in held[0] if all(name in h for h in held)]
        folded = {name: _fold_group([h[name] for h in held], residuals) for name in groups}
        out[key] = {name: fields for name, fields in folded.items() if fields}  # an empty one starts afresh
    out["scheduler"] = None
    return out


def to_fold(states: Sequence[Dict[str, Any]], residuals: str = "fold") -> Dict[str, Any]:
    """A state standing for every rank's ``states`` of a job saved on another number of ranks:
    :meth:`~mergecomp.pipeline.step.MergedStep.load_state_dict` folds it on load (:func:`fold`,
    which needs the loading exchange's holders), so a front end can take it before its step is
    built and save it again unchanged."""
    if residuals not in RESIDUAL_POLICIES:
        raise ValueError(f"residuals must be one of {RESIDUAL_POLICIES}, got {residuals!r}")
    return {EVERY_RANK: list(states), "residuals": residuals}


def same_run(own: Optional[Dict[str, Any]], root: Dict[str, Any]) -> bool:
    """Whether ``own`` (this rank's state from before the reset) continues the root's: the
    same plan, tensors and step."""
    return own is not None and all(own.get(key) == root.get(key) for key in ("plan", "shapes", "step"))


def differing_fields(own: Optional[Dict[str, Any]], root: Dict[str, Any]) -> List[int]:
    """Per compressor field of the root's state (groups and fields in sorted order): 1 where
    ``own``, continuing the root's run, holds that field with another value, else 0."""
    mine = own.get("compressor", {}) if same_run(own, root) else {}
    flags = []
    for group, fields in sorted(root.get("compressor", {}).items()):
        for name, value in sorted(fields.items()):
            held = mine.get(group, {}).get(name)
            flags.append(int(held is not None and not (held.shape == value.shape and torch.equal(held, value))))
    return flags


def rejoined(own: Optional[Dict[str, Any]], root: Dict[str, Any], per_rank: Optional[Sequence[int]],
             holders: Sequence[str], world_size: int) -> Dict[str, Any]:
    """The state this rank loads after an elastic reset (module docstring): ``root``, the
    root's state without its memory; ``own``, this rank's from before the reset (None where it
    joined); ``per_rank``, per compressor field as :func:`differing_fields` orders them, nonzero
    where any rank's differs from the root's (None: no field does).  The scheduler searches
    again unless the world kept its size."""
    stayed = same_run(own, root)
    out = {key: value for key, value in root.items() if key not in holders}
    flags = iter(per_rank) if per_rank is not None else itertools.repeat(0)
    compressor: Dict[str, Dict[str, torch.Tensor]] = {}
    for group, fields in sorted(root.get("compressor", {}).items()):
        for name, value in sorted(fields.items()):
            if not next(flags):
                compressor.setdefault(group, {})[name] = value
            elif stayed and name in own["compressor"].get(group, {}):
                compressor.setdefault(group, {})[name] = own["compressor"][group][name]
    for key in holders:
        out[key] = {}
    out["memory"] = own["memory"] if stayed else {}
    out["compressor"] = compressor
    if root.get("world_size") != world_size:
        out["scheduler"] = None
    return out
