"""EF-SignSGD (Karimireddy et al., 2019): scaled sign compression with error feedback.

Wire: the sign bits, 1 bit per element packed in uint8 (zeros sent as ``+``), and one fp32
scale ``mean |x| = ||x||_1 / n``; an element decodes to ``±scale``.  Not summable (allgathered);
the result is the mean (or sum) of the ranks' decodes.  Default memory: ``residual``.
"""
from __future__ import annotations

from typing import Tuple

import torch

from mergecomp.compressors.base.compressor import Payload
from mergecomp.compressors.base.sign_value import SignValueCompressor
from mergecomp.kernels.codecs.sums import SignStats
from mergecomp.registry import register_compressor

Ctx = Tuple[int, torch.dtype]


@register_compressor("efsignsgd")
class EFSignSGDCompressor(SignValueCompressor):
    default_memory = "residual"

    def encode(self, bits: torch.Tensor, stats: SignStats, tensor: torch.Tensor) -> Tuple[Payload, Ctx]:
        numel = tensor.numel()
        scale = (stats.magnitude() / max(numel, 1)).to(torch.float32).reshape(1)
        return (bits, scale), (numel, tensor.dtype)

    def sides(self, payload: Payload) -> Tuple[torch.Tensor, torch.Tensor]:
        scale = payload[1].reshape(())
        return -scale, scale
