"""Parameter shapes of well-known models, generated in code (no torchvision, no downloads).

Each ``*_named_shapes()`` returns ``(name, shape)`` in forward (``named_parameters``) order;
:func:`backward_shapes` reverses it into the order gradients become ready.  Used by the offline
planner and the benchmarks.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

__all__ = ["MODELS", "named_shapes", "backward_shapes", "numel"]

Shape = Tuple[int, ...]
Named = List[Tuple[str, Shape]]


def _conv_bn(params: Named, prefix: str, conv: str, bn: str, out_ch: int, in_ch: int, kernel: int) -> None:
    params.append((f"{prefix}{conv}.weight", (out_ch, in_ch, kernel, kernel)))
    params.append((f"{prefix}{bn}.weight", (out_ch,)))
    params.append((f"{prefix}{bn}.bias", (out_ch,)))


def _resnet(blocks: Tuple[int, ...], bottleneck: bool, classes: int = 1000) -> Named:
    expansion = 4 if bottleneck else 1
    params: Named = []
    _conv_bn(params, "", "conv1", "bn1", 64, 3, 7)
    inplanes = 64
    for stage, count in enumerate(blocks, start=1):
        planes = 64 * 2 ** (stage - 1)
        for block in range(count):
            prefix = f"layer{stage}.{block}."
            if bottleneck:
                _conv_bn(params, prefix, "conv1", "bn1", planes, inplanes, 1)
                _conv_bn(params, prefix, "conv2", "bn2", planes, planes, 3)
                _conv_bn(params, prefix, "conv3", "bn3", planes * expansion, planes, 1)
            else:
                _conv_bn(params, prefix, "conv1", "bn1", planes, inplanes, 3)
                _conv_bn(params, prefix, "conv2", "bn2", planes, planes, 3)
            if block == 0 and (stage > 1 or inplanes != planes * expansion):
                _conv_bn(params, prefix, "downsample.0", "downsample.1", planes * expansion, inplanes, 1)
            inplanes = planes * expansion
    params.append(("fc.weight", (classes, inplanes)))
    params.append(("fc.bias", (classes,)))
    return params


def resnet50_named_shapes() -> Named:
    """torchvision resnet50: 161 tensors, 25,557,032 elements."""
    return _resnet((3, 4, 6, 3), bottleneck=True)


def resnet18_named_shapes() -> Named:
    """torchvision resnet18: 62 tensors, 11,689,512 elements."""
    return _resnet((2, 2, 2, 2), bottleneck=False)


def vgg16_named_shapes() -> Named:
    """torchvision vgg16 (no batch norm): 32 tensors, 138,357,544 elements."""
    params: Named = []
    channels, index = 3, 0
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if width == "M":
            index += 1
            continue
        params += [(f"features.{index}.weight", (width, channels, 3, 3)), (f"features.{index}.bias", (width,))]
        channels, index = width, index + 2
    for i, (out_f, in_f) in zip((0, 3, 6), ((4096, 512 * 7 * 7), (4096, 4096), (1000, 4096))):
        params += [(f"classifier.{i}.weight", (out_f, in_f)), (f"classifier.{i}.bias", (out_f,))]
    return params


def gpt2_small_named_shapes() -> Named:
    """GPT-2 small (12 layers, d=768, vocab 50257, context 1024, tied head): 148 tensors,
    124,439,808 elements."""
    d, vocab, context = 768, 50257, 1024
    params: Named = [("wte.weight", (vocab, d)), ("wpe.weight", (context, d))]
    for layer in range(12):
        p = f"h.{layer}."
        params += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (3 * d, d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (4 * d, d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (d, 4 * d)), (p + "mlp.c_proj.bias", (d,))]
    params += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return params


MODELS: Dict[str, Callable[[], Named]] = {
    "resnet50": resnet50_named_shapes,
    "resnet18": resnet18_named_shapes,
    "vgg16": vgg16_named_shapes,
    "gpt2-small": gpt2_small_named_shapes,
}


def named_shapes(model: str) -> Named:
    """``(name, shape)`` of a built-in model, forward order; ValueError for unknown names."""
    try:
        return MODELS[model]()
    except KeyError:
        raise ValueError(f"unknown model {model!r}; built-in models: {', '.join(MODELS)}") from None


def backward_shapes(model: str) -> List[Shape]:
    """Shapes in the order their gradients become ready (reverse of forward order)."""
    return [shape for _, shape in reversed(named_shapes(model))]


def numel(model: str) -> int:
    return sum(math.prod(s) for _, s in named_shapes(model))
