"""Benchmark models as ``torch.nn.Module``: ResNet-50, ResNet-18, VGG-16, GPT-2 small.

The ResNets and GPT-2 are ``transformers``' own classes built from configs (no download):
``ResNetForImageClassification`` (bottleneck layers for ResNet-50, basic for ResNet-18, 1000
classes) and ``GPT2LMHeadModel`` (12 layers, 768 wide, 12 heads, vocabulary 50257, 1024
positions, LM head tied to the token embedding, dropout 0).  ``transformers`` comes with
``pip install -e ".[bench]"``; it is imported only when one of these is built.  VGG-16 has no
``transformers`` class and is written here, after torchvision's ``vgg16``.

At full width every model has exactly the parameters (names, shapes, order) of
:mod:`mergecomp.scheduler.zoo`, so the gradient set a benchmark exchanges is the real one.  What
makes a CPU run practical is the *input*:

* CNNs take 32x32 images by default (``input_size``); ResNets pool adaptively, VGG-16 keeps its
  ``AdaptiveAvgPool2d((7, 7))`` so its 25088-wide classifier is unchanged.
* GPT-2 runs a short sequence by default (64 tokens; at most its 1024 positions).
* ``width`` (default 1.0) scales the channel / embedding width for quick tests; the parameter
  count then differs from the zoo's (only ``width=1`` is the real gradient set).

Example::

    from mergecomp_bench.models import build_model, loss
    model, make_batch = build_model("resnet50")          # 25,557,032 parameters
    data, target = make_batch(8)                          # 8 images of 3x32x32, 1000 classes
    loss(model(data), target).backward()
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from mergecomp.scheduler import zoo

__all__ = ["VGG16", "build_model", "loss", "MODELS", "DEFAULT_INPUT"]

#: default input knob per model: image side for CNNs, sequence length for GPT-2
DEFAULT_INPUT = {"resnet50": 32, "resnet18": 32, "vgg16": 32, "gpt2-small": 64}
CLASSES = 1000       # CNN heads
GPT2_VOCAB = 50257
GPT2_CONTEXT = 1024  # position table rows: the longest sequence GPT-2 small takes


def _scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError as err:
        if err.name != "transformers":
            raise
        raise ImportError('the ResNet and GPT-2 benchmark models are transformers\' classes; '
                          'install it with pip install -e ".[bench]"') from err
    return transformers


def _resnet(depths: Tuple[int, ...], bottleneck: bool, width: float = 1.0) -> nn.Module:
    """``ResNetForImageClassification``: 7x7 stem, max-pool, 4 stages, 1000 classes."""
    t = _transformers()
    expansion = 4 if bottleneck else 1
    config = t.ResNetConfig(embedding_size=_scaled(64, width),
                            hidden_sizes=[expansion * _scaled(64 * 2 ** i, width) for i in range(4)],
                            depths=list(depths), layer_type="bottleneck" if bottleneck else "basic",
                            num_labels=CLASSES)
    return t.ResNetForImageClassification(config)


def _gpt2(width: float = 1.0) -> nn.Module:
    """``GPT2LMHeadModel`` of GPT-2 small's size; ``width`` scales the 64 dimensions per head."""
    t = _transformers()
    heads = 12
    config = t.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=GPT2_CONTEXT, n_embd=_scaled(768 // heads, width) * heads,
                          n_layer=12, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          use_cache=False)
    return t.GPT2LMHeadModel(config)


class VGG16(nn.Module):
    """torchvision's vgg16 (no batch norm), names ``features.N`` / ``classifier.N``.  Written
    here because ``transformers`` has no VGG."""

    CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def __init__(self, num_classes: int = CLASSES, width: float = 1.0) -> None:
        super().__init__()
        layers, channels = [], 3
        for v in self.CONFIG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                out = _scaled(v, width)
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True)]
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        hidden = _scaled(4096, width)
        self.classifier = nn.Sequential(
            nn.Linear(channels * 49, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


MODELS: Dict[str, Callable[..., nn.Module]] = {
    "resnet50": lambda width=1.0: _resnet((3, 4, 6, 3), True, width),
    "resnet18": lambda width=1.0: _resnet((2, 2, 2, 2), False, width),
    "vgg16": lambda width=1.0: VGG16(width=width),
    "gpt2-small": lambda width=1.0: _gpt2(width),
}


def loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a benchmark model's output against ``make_batch``'s target: the logits
    (``output.logits`` for ``transformers``' models) per image, or per token for GPT-2."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def build_model(name: str, width: float = 1.0, input_size: Optional[int] = None, seed: int = 0
                ) -> Tuple[nn.Module, Callable[[int, Optional[torch.Generator]], Tuple[torch.Tensor, torch.Tensor]]]:
    """A model and ``make_batch(batch_size, generator=None) -> (data, target)`` of synthetic data;
    :func:`loss` turns the model's output and the target into the training loss.

    Args:
        name: ``resnet50``, ``resnet18``, ``vgg16`` or ``gpt2-small``.
        width: channel / embedding width multiplier (1.0 = the real gradient set, checked
            against :func:`mergecomp.scheduler.zoo.numel`).
        input_size: image side (CNNs, default 32) or sequence length (GPT-2, default 64, at
            most 1024).
        seed: initial weights.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; benchmark models: {', '.join(MODELS)}")
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    size = DEFAULT_INPUT[name] if input_size is None else int(input_size)
    if name == "gpt2-small" and not 1 <= size <= GPT2_CONTEXT:
        raise ValueError(f"GPT-2 small takes sequences of 1 to {GPT2_CONTEXT} tokens, got {size}")
    torch.manual_seed(seed)
    model = MODELS[name](width=width)
    if width == 1.0:
        count = sum(p.numel() for p in model.parameters())
        assert count == zoo.numel(name), (name, count, zoo.numel(name))
    if name == "gpt2-small":
        def make_batch(batch_size, generator=None):
            tokens = torch.randint(GPT2_VOCAB, (batch_size, size + 1), generator=generator)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        def make_batch(batch_size, generator=None):
            data = torch.randn(batch_size, 3, size, size, generator=generator)
            return data, torch.randint(CLASSES, (batch_size,), generator=generator)
    return model, make_batch


if __name__ == "__main__":  # quick look: python -m mergecomp_bench.models
    for key in MODELS:
        m, _ = build_model(key)
        print(f"{key}: {sum(p.numel() for p in m.parameters()):,} parameters, "
              f"{sum(1 for _ in m.parameters())} tensors, {math.fsum(p.numel() * 4 for p in m.parameters()) / 2**20:.1f} MB")
