"""Deep Gradient Compression (Lin et al., 2018): top-k by a sampled threshold, with momentum
correction and momentum-factor masking in the ``dgc`` error-feedback memory (its default).

The threshold is estimated from a strided sample of the magnitudes, as in the paper; the payload
is exactly k values and their indices (as top-k's: int32, or a bitmap where that is smaller) so
every rank sends the same bytes.
"""
from __future__ import annotations

from mergecomp.compressors.topk import TopKCompressor
from mergecomp.registry import register_compressor


@register_compressor("dgc")
class DGCCompressor(TopKCompressor):
    default_memory = "dgc"

    def __init__(self, ratio: float = 0.01, index_format: str = "auto") -> None:
        super().__init__(ratio, selection="threshold", index_format=index_format)
