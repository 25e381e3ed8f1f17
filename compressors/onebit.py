"""1-bit SGD (Seide et al., 2014): one bit per element, decoded to the mean of its side.

Wire: the bits ``x >= 0``, 1 bit per element packed in uint8, and two fp32 means: that of the
non-negative elements and that of the negative ones (0 for an empty side).  An element decodes
to the mean of its side.  Not summable (allgathered).  Default memory: ``residual`` (the
quantization error is carried to the next step, as in the paper).
"""
from __future__ import annotations

from typing import Tuple

import torch

from mergecomp.compressors.base.compressor import Payload
from mergecomp.compressors.base.sign_value import SignValueCompressor
from mergecomp.kernels.codecs.sums import SignStats
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("onebit")
class OneBitCompressor(SignValueCompressor):
    default_memory = "residual"

    def encode(self, bits: torch.Tensor, stats: SignStats, tensor: torch.Tensor) -> Tuple[Payload, Ctx]:
        count_pos = stats.nonnegative()
        count_neg = tensor.numel() - count_pos
        mean_pos = stats.nonnegative_sum() / count_pos.clamp_min(1)
        mean_neg = stats.negative_sum() / count_neg.clamp_min(1)
        means = torch.stack([mean_pos, mean_neg]).to(torch.float32)
        return (bits, means), (tensor.numel(), tensor.dtype)

    def sides(self, payload: Payload) -> Tuple[torch.Tensor, torch.Tensor]:
        means = payload[1]
        return means[1], means[0]
