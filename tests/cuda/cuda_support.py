"""What the CUDA tests share: the device, the inputs, tolerances, a kernel that keeps the GPU
busy, and the comparison of a codec's payloads and results across devices.

Every module here is marked ``cuda`` (``tests/conftest.py`` skips it without a CUDA device).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

DEVICE = torch.device("cuda", 0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: empty, one element, odd sizes (a partial byte of packed bits, a partial QSGD bucket)
NUMELS = (0, 1, 7, 1001)
#: largest difference between CPU and CUDA results that went through sums in another order,
#: relative to the largest magnitude: a few units of the last place of the dtype
ROUNDING = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

#: the built-in compressors by how their CUDA output compares with the CPU's:
#: payloads equal bit for bit (elementwise codes; rand-k's indices come from a CPU generator)
BITWISE = frozenset({"none", "fp16", "bf16", "signsgd", "signum", "randk"})
#: sign bits equal bit for bit; their scalars are sums over the group, equal to rounding
SIGN_SCALES = frozenset({"efsignsgd", "onebit"})
#: the same entries kept (the inputs have no ties), their values bit for bit
SELECTING = frozenset({"topk", "dgc"})
#: matrix products and QR on each device: equal to rounding
LOW_RANK = frozenset({"powersgd", "acpsgd"})
#: stochastic rounding: each device draws its own numbers (unbiased on both)
STOCHASTIC = frozenset({"qsgd", "terngrad"})
KNOWN = BITWISE | SIGN_SCALES | SELECTING | LOW_RANK | STOCHASTIC


def distinct(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``numel`` values of both signs, their magnitudes distinct in ``dtype`` (from 2**-10 to
    2**10, at least 1.4 % apart for up to 1001 values: no ties for a top-k to break), in a
    random order; on the CPU."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.linspace(-10.0, 10.0, max(numel, 1), dtype=torch.float64)[:numel]
    signs = torch.randint(2, (numel,), generator=g) * 2 - 1
    return (magnitudes * signs)[torch.randperm(numel, generator=g)].to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the CPU (bit-for-bit comparisons, -0.0 and 0.0 told apart)."""
    return t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, relative: float, what: str = "") -> None:
    """``actual`` (any device) within ``relative`` times the largest magnitude of ``expected``
    (CPU) of it, element by element."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if expected.numel() == 0:
        return
    bound = relative * max(float(expected.abs().max()), 1e-30)
    worst = float((actual - expected).abs().max())
    assert worst <= bound, f"{what}: off by {worst:.3g} > {bound:.3g}"


def on_device(payloads: Sequence) -> bool:
    """Whether every tensor of every payload lives on :data:`DEVICE`."""
    return all(t.device == DEVICE for payload in payloads for t in payload)


@functools.lru_cache(maxsize=1)
def _cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second on :data:`DEVICE`, timed once by CUDA events."""
    with torch.cuda.device(DEVICE):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1e3)


def gpu_sleep(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for about ``seconds``; returns at once."""
    torch.cuda._sleep(int(seconds * _cycles_per_second()))
