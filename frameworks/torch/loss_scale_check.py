"""Whether a ``torch.amp.GradScaler`` the momentum exchange was not given unscales its results.

The momentum goes on the wire in the gradients' loss scale, which the exchange learns only from
``grad_scaler=``.  Where the exchange was switched on by default (``mc.DistributedOptimizer``
with an Adam or AdamW and a lossy compressor with error feedback) a script written for the
gradients' exchange may scale its loss without saying so; a scaler's ``unscale_`` then divides
the exchange's results in place before ``step()``.  :class:`UnscaleCheck` compares their norm
when the exchange finished with their norm when ``step()`` runs, at the first update whose
exchange held a finite, nonzero result: one host read in the run.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

__all__ = ["SCALER_RATIO", "UnscaleCheck"]

#: a step's results at most this fraction of the exchange's (and any exact power of two below 1)
#: are taken for a scaler's unscaling: clipping alone shrinks a first update's gradients less
SCALER_RATIO = 2.0 ** -6


def _norm(flats: List[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the tensors ``flats`` together, as a float32 0-d tensor (no host read)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f, dtype=torch.float32) for f in flats]))


class UnscaleCheck:
    """One front end's check, from its first exchange on.

    Call :meth:`finished` with the group buffers an exchange wrote (``p.grad`` views) and
    :meth:`verify` when ``step()`` runs on them; once it returns True the check is over."""

    def __init__(self, who: str, option: str) -> None:
        self.who, self.option = who, option
        self._flats: Optional[List[torch.Tensor]] = None
        self._norm: Optional[torch.Tensor] = None

    def finished(self, flats: Optional[List[torch.Tensor]]) -> None:
        """The exchange finished with ``flats`` (None: its step is skipped)."""
        self._flats = flats
        self._norm = None if not flats else _norm(flats)

    def verify(self) -> bool:
        """``step()`` runs on the last exchange's results: whether the check is settled.
        ValueError (the same on every rank: the results and what a scaler or clipping does to
        them are) where they shrank as a scaler's unscaling shrinks them."""
        if self._norm is None:
            return False
        ratio = float(_norm(self._flats) / self._norm)
        self._flats = self._norm = None
        if not math.isfinite(ratio) or ratio == 0:
            return False  # nothing to compare: the next update decides
        if ratio < 1 and (ratio <= SCALER_RATIO or math.frexp(ratio)[0] == 0.5):
            raise ValueError(
                f"{self.who}: the gradients the exchange averaged were divided by {1 / ratio:.6g} before step(), "
                f"as a torch.amp.GradScaler's unscale_ divides them. Adam's momentum is exchanged by default here "
                f"({self.option}='auto'), and it goes on the wire in the loss scale: pass grad_scaler=scaler; "
                f"without a GradScaler pass {self.option}='auto' (clipping that shrinks the first update more than "
                f"{1 / SCALER_RATIO:.0f}x looks like one), or {self.option}=None to exchange the gradients")
        return True
