"""Top-k sparsification: send the k = ratio * n largest-magnitude elements (values + int32 indices).

``selection="exact"`` uses ``torch.topk``; ``"threshold"`` (default) estimates the k-th largest
magnitude from a sample and runs the exact top-k only among the candidates above it, which keeps
a merged 25 M-element buffer fast (see :func:`mergecomp.sparse.topk_indices`).  Error feedback:
residual memory by default, so what is not sent now is sent later.
"""
import torch

from mergecomp.registry import register_compressor
from mergecomp.sparse import SparseCompressor, topk_abs_indices

_SELECTIONS = ("exact", "threshold")


@register_compressor("topk")
class TopKCompressor(SparseCompressor):
    def __init__(self, ratio: float = 0.01, selection: str = "threshold") -> None:
        super().__init__(ratio)
        if selection not in _SELECTIONS:
            raise ValueError(f"topk selection must be one of {_SELECTIONS}, got {selection!r}")
        self.selection = selection

    @property
    def compress_passes(self) -> float:
        """The threshold scan (the sample and the k values are small); exact: ``abs`` and ``topk``."""
        return 1 if self.selection == "threshold" else 2

    def select(self, tensor: torch.Tensor, k: int, name: str) -> torch.Tensor:
        return topk_abs_indices(tensor, k, self.selection)
