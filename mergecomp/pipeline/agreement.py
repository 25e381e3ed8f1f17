"""The ranks agree on how their exchange was built, before any gradient collective.

Ranks that wrap different models, compressors or settings would issue mismatched collectives:
a hang, or gradients of different tensors silently summed.  :func:`check_ranks_agree` turns
that into one ``ValueError`` on every rank, naming what differs.
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

from mergecomp.exchange.exchange import Exchange

__all__ = ["check_ranks_agree"]


def check_ranks_agree(exchange: Exchange, parts: Mapping[str, Any], who: str) -> None:
    """Raise ``ValueError`` on every rank if any rank's settings differ from rank 0's.

    Compared: the exchange's compressor, memory, averaging and engine, and the front end's
    ``parts``, which map a description (``"groups"``) to a value whose ``repr`` is the same on
    ranks built the same way.  One allgather of a 56-bit hash per part.
    """
    comm = exchange.comm
    parts = {"compressor": repr(exchange.compressor), "memory": repr(exchange.memory),
             "op (average or sum)": exchange.average, "engine": comm.engine, **parts}
    mine = torch.tensor([int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:7], "little")
                         for v in parts.values()], dtype=torch.int64)
    gathered = comm.allgather(mine.to(comm.device), "the cross-rank configuration check").cpu()
    differ = [(rank, name) for rank in range(1, gathered.shape[0])
              for name, a, b in zip(parts, gathered[0], gathered[rank]) if a != b]
    if differ:
        where = "; ".join(f"rank {rank} differs from rank 0 in its {name}" for rank, name in differ)
        raise ValueError(f"{who} on rank {comm.rank}: the ranks were not built the same way: {where}. "
                         f"Every rank must wrap the same model with the same settings")
