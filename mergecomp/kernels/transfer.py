"""Tensors made on the host for a device, moved there without waiting for it.

A CPU tensor copied to a CUDA device the plain way (``.to(device)``) is a synchronous copy: the
host waits until the device's stream has caught up.  Made in pinned memory and copied with
``non_blocking=True`` instead, it joins the stream like a kernel launch (torch's pinned-memory
allocator keeps the host buffer until the copy is done).  For values a codec draws from a CPU
generator so that every rank gets the same ones whatever its device (rand-k's indices,
PowerSGD's first ``Q``).
"""
from __future__ import annotations

import torch

__all__ = ["pinned", "to_device"]


def pinned(device: torch.device) -> bool:
    """Whether host tensors made for ``device`` are made pinned (``pin_memory=``): on a CUDA
    device."""
    return torch.device(device).type == "cuda"


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor made with ``pin_memory=pinned(device)``) on ``device``, copied
    without the host waiting; ``host`` itself on the CPU."""
    return host.to(device, non_blocking=pinned(device))
