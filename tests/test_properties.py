"""Property-based checks of every compressor's encode/decode over shapes, dtypes and ratios."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mergecomp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPARSIFIERS = ("topk", "dgc", "randk")


def build(name, ratio):
    kwargs = {"ratio": ratio} if name in SPARSIFIERS else {}
    return mergecomp.get_compressor(name, **kwargs)


def round_trip(compressor, tensor, shapes):
    payload, ctx = compressor.compress(tensor.clone(), "g", shapes)
    for _ in range(compressor.rounds - 1):
        payload, ctx = compressor.next_round(payload, ctx)
    return payload, compressor.aggregate([payload], ctx, 1, average=False)


@pytest.mark.parametrize("name", mergecomp.compressor_names())
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), cols=st.integers(1, 40), extra=st.integers(0, 70),
       dtype=st.sampled_from(DTYPES), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**31 - 1))
def test_decode_has_input_numel_dtype_and_is_finite(name, rows, cols, extra, dtype, ratio, seed):
    generator = torch.Generator().manual_seed(seed)
    shapes = [torch.Size([rows, cols]), torch.Size([extra])]
    numel = rows * cols + extra
    tensor = torch.randn(numel, generator=generator).to(dtype)
    compressor = build(name, ratio)
    payload, out = round_trip(compressor, tensor, shapes)
    assert out.shape == (numel,) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert all(isinstance(t, torch.Tensor) for t in payload)
    if name == "none":
        assert torch.equal(out, tensor)
    if name in SPARSIFIERS and numel:
        assert payload[0].numel() == min(numel, max(1, math.ceil(ratio * numel)))


@pytest.mark.parametrize("name", mergecomp.compressor_names())
@settings(max_examples=10, deadline=None)
@given(numel=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1))
def test_payload_size_does_not_depend_on_the_values(name, numel, seed):
    generator = torch.Generator().manual_seed(seed)
    sizes = []
    for data in (torch.randn(numel, generator=generator), torch.zeros(numel), torch.full((numel,), 1e30)):
        payload, _ = build(name, 0.01).compress(data, "g", None)
        sizes.append([t.numel() * t.element_size() for t in payload])
    assert sizes[0] == sizes[1] == sizes[2]
