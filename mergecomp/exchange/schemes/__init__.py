"""Exchange schemes: how a merged group's payload travels between the ranks.

One file per scheme (:mod:`.allreduce`, :mod:`.allgather`, :mod:`.two_phase`,
:mod:`.hierarchical`, :mod:`.reduce_scatter`), each a :class:`~mergecomp.exchange.schemes.base.Scheme`; :data:`SCHEMES` is the
one list of them by name.  A new scheme is a new file and one entry here.

Names, as plan codecs and the ``scheme`` option use them: a group of the configured compressor
(plan codec ``"compressed"``) goes by allreduce where its payloads add up and by allgather
otherwise; a group may instead name a sharded scheme (:data:`SHARDED`).  The reduce-scatter
(:data:`REDUCE_SCATTER`) is no plan codec: ``mc.fsdp`` asks for it by name.
"""
from typing import Dict, Type

from mergecomp.exchange.schemes.allgather import AllGather
from mergecomp.exchange.schemes.allreduce import AllReduce
from mergecomp.exchange.schemes.base import Scheme
from mergecomp.exchange.schemes.hierarchical import Hierarchical, HierarchicalTwoPhase
from mergecomp.exchange.schemes.reduce_scatter import ReduceScatter
from mergecomp.exchange.schemes.two_phase import TwoPhase

__all__ = ["SCHEMES", "SHARDED", "OPTIONS", "ALLREDUCE", "ALLGATHER", "TWO_PHASE", "HIERARCHICAL",
           "HIERARCHICAL_TWO_PHASE", "REDUCE_SCATTER", "Scheme"]

#: every scheme, by name
SCHEMES: Dict[str, Type[Scheme]] = {scheme.name: scheme for scheme in
                                    (AllReduce, AllGather, TwoPhase, Hierarchical, HierarchicalTwoPhase,
                                     ReduceScatter)}

ALLREDUCE, ALLGATHER, TWO_PHASE = AllReduce.name, AllGather.name, TwoPhase.name
HIERARCHICAL, HIERARCHICAL_TWO_PHASE = Hierarchical.name, HierarchicalTwoPhase.name
REDUCE_SCATTER = ReduceScatter.name
#: the schemes that send the configured compressor's payloads in shards: plan codecs of their own
SHARDED = tuple(name for name, scheme in SCHEMES.items() if scheme.sharded)
#: values of the front ends' ``scheme`` option (None: the default)
OPTIONS = (ALLGATHER, *SHARDED)
