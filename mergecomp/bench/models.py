"""Benchmark models as ``torch.nn.Module``: ResNet-50, ResNet-18, VGG-16, GPT-2 small.

No torchvision, no downloads.  At full width every model has exactly the parameters (names,
shapes, order) of :mod:`mergecomp.bench.zoo`, i.e. of torchvision's / GPT-2's, so the gradient
set a benchmark exchanges is the real one.  What makes a CPU run practical is the *input*:

* CNNs take 32x32 images by default (``image_size``); ResNets pool adaptively, VGG-16 keeps its
  ``AdaptiveAvgPool2d((7, 7))`` so its 25088-wide classifier is unchanged.
* GPT-2 runs a short sequence by default (``seq_len=64``; the position table keeps 1024 rows).
* ``width`` (default 1.0) scales the channel / embedding width for quick tests; the parameter
  count then differs from the zoo's (only ``width=1`` is the real gradient set).

Example::

    from mergecomp.bench.models import build_model, loss
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

from . import zoo

__all__ = ["ResNet", "VGG16", "GPT2", "build_model", "loss", "MODELS", "DEFAULT_INPUT"]

#: default input knob per model: image side for CNNs, sequence length for GPT-2
DEFAULT_INPUT = {"resnet50": 32, "resnet18": 32, "vgg16": 32, "gpt2-small": 64}


def _scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                           if downsample else None)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
                           if downsample else None)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision's ResNet layout (parameter names included): 7x7 stem, max-pool, 4 stages."""

    def __init__(self, blocks: Tuple[int, ...], bottleneck: bool, num_classes: int = 1000,
                 width: float = 1.0) -> None:
        super().__init__()
        block = Bottleneck if bottleneck else BasicBlock
        base = _scaled(64, width)
        self.conv1 = nn.Conv2d(3, base, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        inplanes = base
        for stage, count in enumerate(blocks, start=1):
            planes = _scaled(64 * 2 ** (stage - 1), width)
            layers = []
            for b in range(count):
                stride = 2 if (b == 0 and stage > 1) else 1
                downsample = b == 0 and (stage > 1 or inplanes != planes * block.expansion)
                layers.append(block(inplanes, planes, stride, downsample))
                inplanes = planes * block.expansion
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG16(nn.Module):
    """torchvision's vgg16 (no batch norm), names ``features.N`` / ``classifier.N``."""

    CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def __init__(self, num_classes: int = 1000, width: float = 1.0) -> None:
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


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 small's parameters (12 layers, d=768, 12 heads, vocab 50257, 1024 positions, LM
    head tied to ``wte``), as ``nn.Linear`` weights (out, in), names as in :mod:`mergecomp.bench.zoo`."""

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257,
                 context: int = 1024, width: float = 1.0) -> None:
        super().__init__()
        d = _scaled(d // heads, width) * heads
        self.context = context
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context of {self.context}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied LM head


MODELS: Dict[str, Callable[..., nn.Module]] = {
    "resnet50": lambda width=1.0, num_classes=1000: ResNet((3, 4, 6, 3), True, num_classes, width),
    "resnet18": lambda width=1.0, num_classes=1000: ResNet((2, 2, 2, 2), False, num_classes, width),
    "vgg16": lambda width=1.0, num_classes=1000: VGG16(num_classes, width),
    "gpt2-small": lambda width=1.0, num_classes=None: GPT2(width=width),
}


def loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a benchmark model's output against ``make_batch``'s target: the logits
    per image, or per token for GPT-2."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def build_model(name: str, width: float = 1.0, input_size: Optional[int] = None, seed: int = 0
                ) -> Tuple[nn.Module, Callable[[int, Optional[torch.Generator]], Tuple[torch.Tensor, torch.Tensor]]]:
    """A model and ``make_batch(batch_size, generator=None) -> (data, target)`` of synthetic data;
    :func:`loss` turns the model's output and the target into the training loss.

    Args:
        name: ``resnet50``, ``resnet18``, ``vgg16`` or ``gpt2-small``.
        width: channel / embedding width multiplier (1.0 = the real gradient set, checked
            against :func:`mergecomp.bench.zoo.numel`).
        input_size: image side (CNNs, default 32) or sequence length (GPT-2, default 64).
        seed: initial weights.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; benchmark models: {', '.join(MODELS)}")
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    size = DEFAULT_INPUT[name] if input_size is None else int(input_size)
    torch.manual_seed(seed)
    model = MODELS[name](width=width)
    if width == 1.0:
        count = sum(p.numel() for p in model.parameters())
        assert count == zoo.numel(name), (name, count, zoo.numel(name))
    if name == "gpt2-small":
        vocab = model.wte.num_embeddings

        def make_batch(batch_size, generator=None):
            tokens = torch.randint(vocab, (batch_size, size + 1), generator=generator)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        classes = model.fc.out_features if hasattr(model, "fc") else model.classifier[-1].out_features

        def make_batch(batch_size, generator=None):
            data = torch.randn(batch_size, 3, size, size, generator=generator)
            return data, torch.randint(classes, (batch_size,), generator=generator)
    return model, make_batch


if __name__ == "__main__":  # quick look: python -m mergecomp.bench.models
    for key in MODELS:
        m, _ = build_model(key)
        print(f"{key}: {sum(p.numel() for p in m.parameters()):,} parameters, "
              f"{sum(1 for _ in m.parameters())} tensors, {math.fsum(p.numel() * 4 for p in m.parameters()) / 2**20:.1f} MB")
