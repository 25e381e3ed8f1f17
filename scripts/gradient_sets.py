"""Gradient shapes of well-known models, generated in code (no torchvision needed).

Used by the scripts in this folder (``sys.path`` holds the script's folder, so
``from gradient_sets import resnet50_shapes`` works from any of them).  Every function returns
the shapes in *backward* order: the order in which gradients become ready, i.e. the reverse of
the parameters' forward (``named_parameters``) order.
"""
from __future__ import annotations

import math
from typing import List, Tuple

__all__ = ["resnet50_named_shapes", "resnet50_shapes", "RESNET50_TENSORS", "RESNET50_NUMEL"]

#: torchvision.models.resnet50(): 161 parameter tensors, 25,557,032 elements
RESNET50_TENSORS = 161
RESNET50_NUMEL = 25_557_032

_RESNET50_BLOCKS = (3, 4, 6, 3)
_EXPANSION = 4


def resnet50_named_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """``(name, shape)`` of torchvision's resnet50 parameters in *forward* order, named as
    ``model.named_parameters()`` names them (bottleneck blocks [3, 4, 6, 3], expansion 4)."""
    params: List[Tuple[str, Tuple[int, ...]]] = []

    def conv_bn(prefix: str, conv: str, bn: str, out_ch: int, in_ch: int, kernel: int) -> None:
        params.append((f"{prefix}{conv}.weight", (out_ch, in_ch, kernel, kernel)))
        params.append((f"{prefix}{bn}.weight", (out_ch,)))
        params.append((f"{prefix}{bn}.bias", (out_ch,)))

    conv_bn("", "conv1", "bn1", 64, 3, 7)
    inplanes = 64
    for stage, blocks in enumerate(_RESNET50_BLOCKS, start=1):
        planes = 64 * 2 ** (stage - 1)
        for block in range(blocks):
            prefix = f"layer{stage}.{block}."
            conv_bn(prefix, "conv1", "bn1", planes, inplanes, 1)
            conv_bn(prefix, "conv2", "bn2", planes, planes, 3)
            conv_bn(prefix, "conv3", "bn3", planes * _EXPANSION, planes, 1)
            if block == 0:  # projection shortcut (channel count and/or stride change)
                conv_bn(prefix, "downsample.0", "downsample.1", planes * _EXPANSION, inplanes, 1)
            inplanes = planes * _EXPANSION
    params.append(("fc.weight", (1000, inplanes)))
    params.append(("fc.bias", (1000,)))

    assert len(params) == RESNET50_TENSORS, len(params)
    assert sum(math.prod(s) for _, s in params) == RESNET50_NUMEL
    return params


def resnet50_shapes() -> List[Tuple[int, ...]]:
    """The 161 gradient shapes of resnet50 in backward order (``fc.bias`` first)."""
    return [shape for _, shape in reversed(resnet50_named_shapes())]
