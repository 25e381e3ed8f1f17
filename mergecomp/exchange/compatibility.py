"""Which compressors each route of a merged group's payload can carry: the one declaration of
these rules.

A compressor declares what it does (:class:`~mergecomp.compressors.base.compressor.Compressor`:
``rounds``, ``low_rank``, ``votes``); a route that cannot carry one of those :data:`TRAITS`
refuses it here, with the reason.  The front ends (``scheme=``, ``mc.fsdp``, the momentum
exchange), the exchange (a plan's codecs) and the scheduler (the schemes it offers) all ask
:func:`check` or :func:`carries`; docs/compressors.md's matrix is rendered from :data:`ROUTES`.
Which option values each front end takes is :data:`mergecomp.pipeline.options.FRONT_ENDS`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.exchange.schemes import REDUCE_SCATTER, SHARDED

__all__ = ["Trait", "TRAITS", "Rules", "ROUTES", "FSDP", "MOMENTUM", "refusal", "carries", "check"]


@dataclass(frozen=True)
class Trait:
    """Something a compressor may do that a route may not carry: ``has(compressor)``, and how
    an error says it (``said(compressor)``, after the compressor's name)."""

    name: str
    has: Callable[[Compressor], bool]
    said: Callable[[Compressor], str]


#: what a route may refuse, by name
TRAITS: Dict[str, Trait] = {trait.name: trait for trait in (
    Trait("several rounds", lambda c: c.rounds > 1, lambda c: f"takes {c.rounds} rounds"),
    Trait("whole matrices", lambda c: c.low_rank, lambda c: "approximates whole matrices"),
    Trait("majority vote", lambda c: c.votes, lambda c: "returns a majority vote, not the average"),
)}


@dataclass(frozen=True)
class Rules:
    """What a route (a way a group's payload travels, or is used) cannot carry: ``refuses`` maps
    a :data:`TRAITS` name to why; ``memories`` an error-feedback memory's name to why."""

    name: str
    refuses: Mapping[str, str] = field(default_factory=dict)
    memories: Mapping[str, str] = field(default_factory=dict)


_SHARDS = {"several rounds": "its shards travel in one round",
           "whole matrices": "it cuts a group into shards, which cut its matrices"}
#: the compressed reduce-scatter of FSDP2 and FSDP1 (``mc.fsdp.compress``)
FSDP = REDUCE_SCATTER
#: Adam's momentum exchanged in place of the gradients (``exchange_momentum_after``)
MOMENTUM = "momentum exchange"

#: every route with a rule, by name: the sharded schemes, FSDP's reduction, the momentum
#: exchange (allreduce and allgather carry every compressor)
ROUTES: Dict[str, Rules] = {rules.name: rules for rules in (
    *(Rules(name, _SHARDS) for name in SHARDED),
    Rules(FSDP, {"several rounds": "a reduce-scatter has one round",
                 "whole matrices": "it reduces flat shards that cut them (FSDP's)",
                 "majority vote": "it must give the sum or the average of the gradients"}),
    Rules(MOMENTUM, {"majority vote": "the momentum needs the average; use 'efsignsgd' or 'onebit' for signs"},
          {"dgc": "it applies momentum to what it is given, which is Adam's momentum already; use "
                  "memory='residual' or 'averaged'"}),
)}


def refusal(compressor: Compressor, route: str, memory: Optional[str] = None) -> Optional[str]:
    """Why ``route`` cannot carry ``compressor`` (with the error-feedback ``memory`` of that
    name), or None where it can (a route without rules carries everything)."""
    rules = ROUTES.get(route)
    if rules is None:
        return None
    for name, why in rules.refuses.items():
        if TRAITS[name].has(compressor):
            return f"compressor {compressor.name!r}, which {TRAITS[name].said(compressor)}: {why}"
    if memory in rules.memories:
        return f"memory {memory!r}: {rules.memories[memory]}"
    return None


def carries(compressor: Compressor, route: str) -> bool:
    """Whether ``route`` can carry ``compressor`` (:func:`refusal`)."""
    return refusal(compressor, route) is None


def check(compressor: Compressor, route: str, who: str, memory: Optional[str] = None) -> None:
    """ValueError from ``who`` (the option or front end asking) where ``route`` cannot carry
    ``compressor`` and ``memory``, naming both and why."""
    why = refusal(compressor, route, memory)
    if why is not None:
        raise ValueError(f"{who}: {route} cannot carry {why}")
