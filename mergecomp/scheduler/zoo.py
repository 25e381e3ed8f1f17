"""Parameter shapes of the built-in models of ``mergecomp plan`` and of the benchmarks, generated
in code (no torch, no downloads).

The names, shapes and order are those of :mod:`mergecomp_bench.models`: transformers'
``ResNetForImageClassification`` and ``GPT2LMHeadModel``, and torchvision's ``vgg16``.
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


def _conv_norm(params: Named, prefix: str, out_ch: int, in_ch: int, kernel: int) -> None:
    """A ``ResNetConvLayer`` / ``ResNetShortCut``: bias-free convolution, then batch norm."""
    params.append((f"{prefix}convolution.weight", (out_ch, in_ch, kernel, kernel)))
    params.append((f"{prefix}normalization.weight", (out_ch,)))
    params.append((f"{prefix}normalization.bias", (out_ch,)))


def _resnet(blocks: Tuple[int, ...], bottleneck: bool, classes: int = 1000) -> Named:
    """transformers' ``ResNetForImageClassification`` (``downsample_in_first_stage=False``)."""
    expansion = 4 if bottleneck else 1
    params: Named = []
    _conv_norm(params, "resnet.embedder.embedder.", 64, 3, 7)
    inplanes = 64
    for stage, count in enumerate(blocks):
        planes = 64 * 2 ** stage
        out = planes * expansion
        for block in range(count):
            prefix = f"resnet.encoder.stages.{stage}.layers.{block}."
            if block == 0 and (stage > 0 or inplanes != out):  # registered before the block's convolutions
                _conv_norm(params, prefix + "shortcut.", out, inplanes, 1)
            if bottleneck:
                _conv_norm(params, prefix + "layer.0.", planes, inplanes, 1)
                _conv_norm(params, prefix + "layer.1.", planes, planes, 3)
                _conv_norm(params, prefix + "layer.2.", out, planes, 1)
            else:
                _conv_norm(params, prefix + "layer.0.", out, inplanes, 3)
                _conv_norm(params, prefix + "layer.1.", out, out, 3)
            inplanes = out
    params.append(("classifier.1.weight", (classes, inplanes)))
    params.append(("classifier.1.bias", (classes,)))
    return params


def resnet50_named_shapes() -> Named:
    """ResNet-50 (transformers' bottleneck ``ResNetForImageClassification``, 1000 classes): 161
    tensors, 25,557,032 elements; torchvision's resnet50 has the same shapes."""
    return _resnet((3, 4, 6, 3), bottleneck=True)


def resnet18_named_shapes() -> Named:
    """ResNet-18 (transformers' basic ``ResNetForImageClassification``, 1000 classes): 62 tensors,
    11,689,512 elements; torchvision's resnet18 has the same shapes."""
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
    """GPT-2 small (transformers' ``GPT2LMHeadModel``: 12 layers, d=768, vocab 50257, context 1024,
    LM head tied to ``wte``, so not a parameter of its own): 148 tensors, 124,439,808 elements.
    The projections are ``Conv1D`` weights, stored (in, out)."""
    d, vocab, context = 768, 50257, 1024
    params: Named = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (context, d))]
    for layer in range(12):
        p = f"transformer.h.{layer}."
        params += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                   (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                   (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                   (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                   (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                   (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    params += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
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
