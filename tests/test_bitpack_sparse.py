"""The vectorized kernels under the compressors: bit packing, base-3 packing and the threshold
top-k selection.

Both are checked against plain reference implementations (the straightforward versions they
replaced), exhaustively where the input space is small.
"""
import math

import pytest
import torch

from mergecomp.compressors.base.sparse import (SparseCompressor, num_selected, sample_stride, topk_abs_indices,
                                               topk_indices)
from mergecomp.kernels import bitpack, native, tritpack
from mergecomp.kernels.codecs import majority_vote, pack_signs
from mergecomp.kernels.codecs.scans import _flat_nonzero
from mergecomp.kernels.quantize import stochastic_round_


def reference_pack(codes, bits):
    per = 8 // bits
    codes = codes.reshape(-1).to(torch.uint8)
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (codes.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def reference_unpack(packed, bits, n):
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("copies", [1, 3, 4097])  # short (scalar) and long (vectorized) kernels
def test_pack_every_byte(bits, copies):
    every = torch.arange(256, dtype=torch.uint8)
    codes = reference_unpack(every, bits, 256 * 8 // bits).repeat(copies)
    assert torch.equal(bitpack.pack(codes, bits), every.repeat(copies))
    assert torch.equal(bitpack.unpack(every.repeat(copies), bits, codes.numel()), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", list(range(0, 19)) + [1001, 65537])
def test_pack_matches_reference(bits, n):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    for src in (codes, codes.to(torch.uint8), codes.float(), codes.to(torch.int8)):
        packed = bitpack.pack(src, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_size(n, bits)
        assert torch.equal(packed, reference_pack(src, bits))
        unpacked = bitpack.unpack(packed, bits, n)
        assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.long(), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_views(bits):
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 1 << bits, (1000,), dtype=torch.uint8, generator=g)
    for offset in range(9):  # storage offsets that break the lane alignment
        for view in (base[offset:], base[offset::3], base[offset:offset + 17]):
            assert torch.equal(bitpack.pack(view, bits), reference_pack(view, bits))
    signs = torch.randn(2001, generator=g) >= 0
    for view in (signs[3:], signs[::2], signs[5:900]):
        assert torch.equal(bitpack.pack(view, 1), reference_pack(view, 1))


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32])
def test_decode_is_a_lookup(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 1003):
        codes = torch.randint(0, 1 << bits, (n,), generator=g)
        values = (torch.randn(1 << bits, generator=g) * 10).to(dtype)
        out = bitpack.decode(bitpack.pack(codes, bits), bits, n, values)
        assert out.dtype == dtype and out.shape == (n,)
        assert torch.equal(out, values[codes])
    with pytest.raises(ValueError, match="values"):
        bitpack.decode(torch.zeros(1, dtype=torch.uint8), bits, 1, torch.zeros(3))


def reference_trits(n):
    """Every byte 0..242 as its five base-3 digits, least significant first, repeated to n codes."""
    digits = [(b // 3 ** j) % 3 for b in range(243) for j in range(5)]
    return torch.tensor((digits * (n // len(digits) + 1))[:n], dtype=torch.uint8)


@pytest.mark.parametrize("n", list(range(0, 12)) + [1215, 1216, 100_003])
def test_trits_pack_five_to_a_byte(n):
    codes = reference_trits(n)
    expected = [sum(int(c) * 3 ** j for j, c in enumerate(codes[i:i + 5])) for i in range(0, n, 5)]
    for src in (codes, codes.to(torch.int8), codes.long(), codes.repeat_interleave(2)[::2]):
        packed = tritpack.pack(src)
        assert packed.dtype == torch.uint8 and packed.numel() == tritpack.packed_size(n) == -(-n // 5)
        assert packed.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_trits_decode_is_a_lookup(dtype):
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 4, 5, 6, 1003):
        codes = torch.randint(0, 3, (n,), generator=g)
        values = (torch.randn(3, generator=g) * 10).to(dtype)
        packed = tritpack.pack(codes)
        out = tritpack.decode(packed, n, values)
        assert out.dtype == dtype and torch.equal(out, values[codes])
        into = torch.full((n,), float("nan"), dtype=dtype)
        assert tritpack.decode(packed, n, values, into) is into and torch.equal(into, values[codes])
    with pytest.raises(ValueError, match="3 values"):
        tritpack.decode(torch.zeros(1, dtype=torch.uint8), 1, torch.zeros(4))


def reference_threshold_topk(magnitude, k):
    """The threshold selection as first written (full |x|, one mask, one nonzero), its sample
    taken at the prime stride that meets every column of a matrix (:func:`sample_stride`)."""
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n)
    sample = magnitude[::sample_stride(n, k)]
    rank = min(sample.numel(), math.ceil(1.3 * k * sample.numel() / n))
    threshold = sample.topk(rank, sorted=False).values.min()
    candidates = torch.nonzero(magnitude >= threshold).view(-1)
    if candidates.numel() >= k:
        among = magnitude[candidates]
        if magnitude.dtype == torch.float32 and native.usable(magnitude):  # ascending, of ties the first
            kth = among.topk(k).values.min()
            tie = among == kth
            return candidates[(among > kth) | (tie & (tie.cumsum(0) <= k - (among > kth).sum()))]
        return candidates[among.topk(k, sorted=False).indices]
    return magnitude.topk(k, sorted=False).indices


@pytest.mark.parametrize("n", [1, 9, 1000, 16385, 100_003, (1 << 20) + 13, 3 * (1 << 20) + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_threshold_topk_matches_reference(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    if n > 10:
        x[::7] = 0  # ties at the bottom
        x[3::11] = x[5]  # ties in the middle
    for ratio in (0.001, 0.01, 0.3):
        k = num_selected(n, ratio)
        expected = reference_threshold_topk(x.abs(), k)
        assert torch.equal(topk_indices(x.abs(), k, "threshold"), expected)
        assert torch.equal(topk_abs_indices(x, k, "threshold"), expected)
        assert torch.equal(topk_abs_indices(x, k, "exact"), x.abs().topk(k, sorted=False).indices)


def test_flat_nonzero():
    g = torch.Generator().manual_seed(0)
    for n in range(0, 70):
        for offset in range(3):
            mask = (torch.rand(n + offset, generator=g) < 0.3)[offset:]
            assert torch.equal(_flat_nonzero(mask), torch.nonzero(mask).view(-1))
    mask = torch.rand(1_000_003, generator=g) < 0.01
    assert torch.equal(_flat_nonzero(mask), torch.nonzero(mask).view(-1))


def test_sparse_decode_adds_repeated_indices():
    class Keep(SparseCompressor):
        def select(self, tensor, k, name):
            return torch.arange(k)

    c = Keep(ratio=0.5)
    values = torch.tensor([1.0, 2.0, 3.0])
    indices = torch.tensor([4, 1, 4], dtype=torch.int32)
    expected = torch.tensor([0.0, 2.0, 0.0, 0.0, 4.0, 0.0])
    assert torch.equal(c.decompress((values, indices), (6, torch.float32)), expected)


@pytest.mark.parametrize("voters", [1, 2, 3, 300])
def test_majority_vote_counts_any_number_of_voters(voters):
    g = torch.Generator().manual_seed(voters)
    xs = torch.randn(voters, 77, generator=g)
    votes = torch.where(xs >= 0, 1, -1).sum(0)
    out = majority_vote([pack_signs(x)[0] for x in xs], 77, torch.float64)
    assert out.dtype == torch.float64 and torch.equal(out, votes.sign().double())


@pytest.mark.parametrize("shift", [0, 1])
def test_stochastic_round_is_unbiased_and_stays_between_neighbours(shift):
    a = torch.tensor([-2.75, -1.0, -0.3, 0.0, 0.001, 0.5, 1.25, 3.0]).repeat(40_000)
    rounded = stochastic_round_(a.clone(), shift=shift) - shift
    assert torch.equal(rounded, rounded.round())
    assert ((rounded >= a.floor()) & (rounded <= a.ceil())).all()
    mean = rounded.view(40_000, 8).mean(0)
    # Bernoulli variance <= 1/4 per draw: 6 sigma over 40k draws is 0.015
    torch.testing.assert_close(mean, a[:8], atol=0.015, rtol=0)


@pytest.mark.parametrize("name", ["topk", "dgc"])
@pytest.mark.parametrize("n,ratio", [(0, 0.5), (1, 0.01), (13, 0.2), (1000, 0.01), (1000, 0.05), (4099, 0.1),
                                     (20_000, 0.5), (20_000, 0.02)])
def test_bitmap_indices_decode_as_the_int32_ones(name, n, ratio):
    """A bitmap payload (values in ascending index order) decodes, aggregates and names its
    entries bit for bit as the int32 one; ``"auto"`` sends whichever is smaller."""
    import mergecomp

    generator = torch.Generator().manual_seed(n)
    ranks = [torch.randn(n, generator=generator) for _ in range(3)]
    codecs = {form: mergecomp.get_compressor(name, ratio=ratio, index_format=form)
              for form in ("int32", "bitmap", "auto")}
    encoded = {form: [codec.compress(x.clone(), "g") for x in ranks] for form, codec in codecs.items()}
    k = num_selected(n, ratio)
    for form, codec in codecs.items():
        payload, ctx = encoded[form][0]
        reference, reference_ctx = encoded["int32"][0]
        assert torch.equal(codec.decompress(payload, ctx), codecs["int32"].decompress(reference, reference_ctx))
        indices, values = codec.sent_entries(payload, ctx)
        ordered = reference[1].long().argsort()
        assert torch.equal(indices, reference[1].long()[ordered]) and torch.equal(values, reference[0][ordered])
        for average in (False, True):
            assert torch.equal(codec.aggregate([p for p, _ in encoded[form]], ctx, 3, average),
                               codecs["int32"].aggregate([p for p, _ in encoded["int32"]], reference_ctx, 3, average))
    bitmap_bytes = -(-n // 8)
    assert encoded["bitmap"][0][0][1].numel() == bitmap_bytes
    sent = sum(t.numel() * t.element_size() for t in encoded["auto"][0][0])
    assert sent == 4 * k + (bitmap_bytes if 32 * k > n else 4 * k)


def test_sparse_index_format_is_checked():
    import mergecomp

    with pytest.raises(ValueError, match="index_format must be one of"):
        mergecomp.get_compressor("topk", index_format="csr")
