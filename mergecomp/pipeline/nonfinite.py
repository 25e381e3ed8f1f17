"""The ranks' agreement on NaN/Inf in a step's groups, and the policies a front end may choose.

Each rank knows which of its groups held a non-finite gradient (:attr:`Job.finite`) or whose
error-compensated payload overflowed its 16-bit cast (:attr:`Job.overflowed`);
:class:`NonfiniteCheck` shares those bits in one small allreduce so that every rank applies the
step's policy (:class:`~mergecomp.pipeline.step.MergedStep`) to the same culprits.
"""
from __future__ import annotations

import itertools
from typing import List, Sequence, Tuple

import torch

from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.job import Job

__all__ = ["NONFINITE_POLICIES", "NONFINITE_GRADIENT", "OVERFLOWED", "NonfiniteCheck"]

#: what a NaN/Inf gradient on any rank does (:class:`~mergecomp.pipeline.step.MergedStep`)
NONFINITE_POLICIES = ("propagate", "raise", "skip", "ignore")
#: why a group is a culprit of :class:`NonfiniteCheck` (bits of its flag)
NONFINITE_GRADIENT, OVERFLOWED = 1, 2


def _flags(jobs: Sequence[Job]) -> torch.Tensor:
    """int32, one per job: why its group is a culprit (:data:`NONFINITE_GRADIENT`,
    :data:`OVERFLOWED`; 0: it is not).  Made on the device, run by run of jobs whose payloads
    were or were not checked (indexing by a list of groups would copy it there and wait)."""
    runs = []
    for checked, run in itertools.groupby(jobs, key=lambda job: job.overflowed is not None):
        run = list(run)
        bits = torch.stack([job.finite for job in run]).logical_not().to(torch.int32) * NONFINITE_GRADIENT
        if checked:  # casts' payloads only
            bits += torch.stack([job.overflowed for job in run]).to(torch.int32) * OVERFLOWED
        runs.append(bits)
    return torch.cat(runs)


class NonfiniteCheck:
    """Agree across ranks on which (rank, group) pairs held NaN/Inf this step, and why.

    ``jobs``: this step's groups, in plan order (the same on every rank); a group is a culprit
    when its gradient was not finite or its payload overflowed.  One small allreduce of a
    ``(size, groups)`` int32 matrix of those bits, started now; :meth:`culprits` waits and gives
    the same answer on every rank.
    """

    def __init__(self, comm: Communicator, jobs: Sequence[Job], step: int) -> None:
        device = jobs[0].finite.device if jobs else torch.device("cpu")
        flags = torch.zeros(comm.size, len(jobs), dtype=torch.int32, device=device)
        if jobs:
            flags[comm.rank] = _flags(jobs)
        self._what = f"non-finite gradient check at step {step} on rank {comm.rank}"
        self._handle = comm.allreduce_async(flags)

    def culprits(self, names: Sequence[str]) -> List[Tuple[int, str, int]]:
        """``(rank, group name, bits)`` of every culprit (:data:`NONFINITE_GRADIENT`, :data:`OVERFLOWED`)."""
        flags = self._handle.wait(self._what).cpu()
        return [(rank, names[g], int(flags[rank, g])) for rank, g in flags.nonzero().tolist()]
