"""A demo third-party compressor: scaled sign (1 byte per element + one scale per rank).

Not decorated: mergecomp finds it through the entry point ``demo_plugin`` in the group
``mergecomp.compressors`` declared in this package's pyproject.toml.
"""
import torch

import mergecomp


class ScaledSign(mergecomp.Compressor):
    """Send ``sign(x)`` as int8 and ``mean(|x|)``; decode as ``scale * sign``."""

    summable = False
    default_memory = "residual"

    def compress(self, tensor, name, shapes=None):
        scale = tensor.abs().mean().reshape(1).to(torch.float32)
        signs = torch.where(tensor >= 0, 1, -1).to(torch.int8)
        return (signs, scale), tensor.dtype

    def decompress(self, payload, ctx):
        signs, scale = payload
        return signs.to(ctx).mul_(scale.to(ctx))
