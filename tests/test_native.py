"""The native fp32 CPU codec kernels (mergecomp.kernels.native) against the eager torch reference."""
import contextlib
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import mergecomp
from mergecomp.kernels import bitpack, native, tritpack
from mergecomp.kernels.codecs import decode_signs, majority_vote, pack_signs, trits_sum
from mergecomp.kernels.quantize import bucket_norms

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
# Sizes around the kernels' 32768-element blocks and the 2**18 elements per thread.
SIZES = [1, 7, 8, 9, 1000, 32768, 32769, 100_003, (1 << 19) + 5]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(7)


def test_kernels_build_where_there_is_a_compiler():
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this machine")
    assert native.usable(torch.zeros(3))
    assert not native.usable(torch.zeros(3, dtype=torch.float64))
    assert not native.usable(torch.zeros(4, 2).t())
    with native.disabled():
        assert not native.usable(torch.zeros(3))


needs_kernels = pytest.mark.skipif(not HAS_COMPILER or not native.usable(torch.zeros(1)),
                                   reason="native kernels unavailable")


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_pack_signs_and_sums(n):
    x = torch.randn(n)
    x[::5] = 0.0
    packed, stats = native.pack_signs(x, torch.empty(bitpack.packed_size(n, 1), dtype=torch.uint8))
    assert torch.equal(packed, bitpack.pack(x >= 0, 1))
    exact = x.double()
    # each side adds runs of 8 same-signed terms in fp32: within 8 * 2**-24 of exact, relative
    torch.testing.assert_close(stats[:2], torch.stack([exact.clamp_min(0).sum(), exact.clamp_max(0).sum()]),
                               rtol=8 * 2.0**-24, atol=0)
    assert stats[2] == (x >= 0).sum()


@needs_kernels
@pytest.mark.parametrize("n", [0] + SIZES + [(1 << 20) + 37])  # the last: keep written past the cache
@pytest.mark.parametrize("carried", ["none", "plain", "carried", "carried, kept in place",
                                     "carried, kept unaligned"])
def test_compensated_signs_are_pack_signs_of_the_compensated_gradient_bit_for_bit(n, carried):
    """v = x + (r - side(r)) (sides 0: x + r; r None: x), rounded as torch rounds each step:
    its bits and sums are pack_signs' of v, and keep receives v (by non-temporal stores from
    2**20 elements on, where keep is 64-byte aligned)."""
    x, r = torch.randn(n), torch.randn(n) * 0.1
    x[::5], r[::5] = 0.0, -0.0  # zeros of both signs: +0 + -0 = +0 travels as +
    r[1::7] = -x[1::7]  # sums of exactly zero
    negative, positive = (-0.3125, 0.7) if carried.startswith("carried") else (0.0, 0.0)
    if carried == "none":
        v = x.clone()
    else:
        v = x + (r - torch.where(r >= 0, torch.tensor(positive), torch.tensor(negative)))
    x_before, r_before = x.clone(), r.clone()
    keep = r if carried.endswith("in place") else torch.empty(n + 1)[1:] if carried.endswith("unaligned") \
        else torch.empty(n)
    empty = torch.empty(bitpack.packed_size(n, 1), dtype=torch.uint8)
    bits, stats = native.compensated_signs(x, None if carried == "none" else r, negative, positive, keep, empty.clone())
    expected_bits, expected_stats = native.pack_signs(v, empty.clone())
    assert torch.equal(bits, expected_bits) and torch.equal(stats, expected_stats)
    assert torch.equal(keep, v) and torch.equal(torch.signbit(keep), torch.signbit(v))
    assert torch.equal(x, x_before)
    if keep is not r:
        assert torch.equal(r, r_before)
        without = native.compensated_signs(x, None if carried == "none" else r, negative, positive, None,
                                           empty.clone())
        assert torch.equal(without[0], expected_bits) and torch.equal(without[1], expected_stats)


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 100_003, (1 << 19) + 5])
@pytest.mark.parametrize("in_place", [False, True])
def test_sign_residual_is_the_value_less_its_decode_bit_for_bit(n, in_place):
    v = torch.randn(n)
    v[::5] = -0.0  # -0 - side keeps its sign as torch's subtraction does
    negative, positive = -0.3125, 0.7
    expected = v - decode_signs(bitpack.pack(v >= 0, 1), n, torch.float32, negative, positive)
    out = v if in_place else torch.empty(n)
    got = native.sign_residual(v, negative, positive, out)
    assert got is out and torch.equal(out, expected)
    assert torch.equal(torch.signbit(out), torch.signbit(expected))


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_moments(n):
    x = torch.randn(n) * 3 + 1e4  # blocks combined without cancelling the spread
    exact = x.double()
    expected = torch.stack([exact.min(), exact.max(), (exact - exact.mean()).square().sum()])
    torch.testing.assert_close(native.moments(x), expected, rtol=1e-10, atol=1e-9)


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_copy_finite_copies_and_finds_nan_and_inf_anywhere(n, bad):
    x = torch.randn(n)
    x[n // 3] = 3.4e38  # the largest finite floats are finite
    if bad is not None:
        x[n - 1] = bad
    out = torch.full((n + 1,), -7.0)
    assert native.copy_finite(x, out) is (bad is None)
    torch.testing.assert_close(out[:n], x, rtol=0, atol=0, equal_nan=True)
    assert out[n] == -7.0  # nothing written past n


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100_003])
@pytest.mark.parametrize("bad", [None, 65520.0, -1e30, float("nan")])
def test_cast_half_finite_rounds_as_torch_and_finds_what_overflows(n, bad):
    """fp32 -> fp16 bit for bit as torch's cast (ties to even at the top of the range: 65519.99
    rounds to 65504, 65520 to Inf), fp16 subnormals kept; the flag says whether all fit."""
    x = torch.randn(n) * 3000
    edges = torch.tensor([65504.0, 65519.99, -65519.99, 6e-8, -3e-8, 1e-9, 0.0, -0.0, 2049.0, 2051.0])
    x[:min(n, len(edges))] = edges[:n]
    if bad is not None and n:
        x[n - 1] = bad
    out = torch.full((n + 1,), 7.0, dtype=torch.float16)
    served = native.cast_half_finite(x, out)
    if served is None:
        pytest.skip("this CPU has no F16C conversion")
    assert served is (bad is None or n == 0)
    assert torch.equal(out[:n].view(torch.int16)[~x.isnan()], x.half().view(torch.int16)[~x.isnan()])
    assert out[:n].isnan().sum() == x.isnan().sum() and out[n] == 7.0  # nothing written past n


@needs_kernels
@pytest.mark.parametrize("offset", [0, 1, 15])  # the destination's alignment
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
@pytest.mark.parametrize("bad", [None, float("nan"), -float("inf")])
def test_copy_finite_streamed_past_the_cache_is_the_same(offset, scale, bad):
    n = 100_003
    x = torch.randn(n)
    if bad is not None:
        x[n // 2 + 5] = bad
    expected = x * scale if scale != 1.0 else x.clone()
    for stream in (False, True):
        out = torch.full((n + offset,), 7.0)
        assert native.copy_finite(x, out[offset:], scale, stream) is (bad is None)
        torch.testing.assert_close(out[offset:], expected, rtol=0, atol=0, equal_nan=True)
        assert (out[:offset] == 7.0).all()


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 100_003])
@pytest.mark.parametrize("scale", [0.25, 1 / 3])
def test_copy_finite_scales_as_torch_does_and_checks_what_it_wrote(n, scale):
    x = torch.randn(n)
    out = torch.empty(n)
    assert native.copy_finite(x, out, scale) is True
    assert torch.equal(out, x * scale)
    if n:
        x[n // 2] = 3e38  # finite, but not once scaled
        assert native.copy_finite(x, out, 4.0) is False
        assert out[n // 2] == float("inf")


@needs_kernels
def test_wrong_buffers_raise_instead_of_corrupting_memory():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="'out'.*at least 13 elements"):
        native.pack_signs(x, torch.empty(12, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'codes\\[0\\]'.*torch.int8"):
        native.scale_levels(torch.zeros(100, dtype=torch.int32), torch.ones(1), 100, 8, 0, torch.empty(100))
    with pytest.raises(ValueError, match="'packed\\[0\\]'.*not contiguous"):
        native.decode_codes(torch.zeros(50, dtype=torch.uint8)[::2], 2, 100, torch.ones(4), torch.empty(100))
    with pytest.raises(ValueError, match="'scales'"):
        native.stochastic_codes(x, torch.ones(1), 10, -1, 1, 0, 8, torch.empty(100, dtype=torch.int8))
    with pytest.raises(ValueError, match="bits"):
        native.stochastic_codes(x, torch.ones(1), 100, -1, 1, 0, 3, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'dst'.*at least 100 elements"):
        native.copy_finite(x, torch.empty(99))


def test_moments_rejects_empty():
    with pytest.raises(ValueError, match="empty"):
        native.moments(torch.empty(0))


@needs_kernels
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", SIZES)
def test_decode_codes_matches_bitpack(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    values = torch.randn(1 << bits)
    packed = bitpack.pack(codes, bits)
    out = native.decode_codes(packed, bits, n, values, torch.empty(n))
    assert torch.equal(out, values[codes.long()])
    assert torch.equal(out, bitpack.decode(packed, bits, n, values))


@needs_kernels
@pytest.mark.parametrize("bits, lo, hi, shift", [(8, -64, 64, 0), (1, 0, 1, 0), (2, -1, 1, 1),
                                                 (4, -7, 7, 7)])
@pytest.mark.parametrize("n", SIZES)
def test_stochastic_codes_exact_on_integers(bits, lo, hi, shift, n):
    """Integral values round to themselves; layout and padding as bitpack.pack."""
    ints = torch.randint(lo, hi + 1, (n,)).float()
    out = torch.empty(n if bits == 8 else bitpack.packed_size(n, bits),
                      dtype=torch.int8 if bits == 8 else torch.uint8)
    native.stochastic_codes(ints * 0.5, torch.full((-(-n // 300),), 2.0), 300, lo, hi, shift, bits, out)
    codes = (ints + shift).to(torch.int8)
    assert torch.equal(out, codes if bits == 8 else bitpack.pack(codes.to(torch.uint8), bits))


@needs_kernels
def test_stochastic_codes_scale_per_bucket_and_clamp():
    x = torch.tensor([0.5, -0.5, 2.0, -2.0] * 4)
    out = torch.empty(16, dtype=torch.int8)
    native.stochastic_codes(x, torch.tensor([2.0, 4.0, 0.0, 8.0]), 4, -3, 3, 0, 8, out)
    assert out.view(4, 4)[[0, 1, 2, 3]].tolist() == [[1, -1, 3, -3], [2, -2, 3, -3], [0, 0, 0, 0],
                                                       [3, -3, 3, -3]]


@needs_kernels
def test_stochastic_codes_unbiased():
    x = torch.linspace(-2.9, 2.9, 1 << 16)
    out = torch.empty(x.numel(), dtype=torch.int8)
    total = torch.zeros_like(x)
    draws = 200
    for _ in range(draws):
        total += native.stochastic_codes(x, torch.ones(1), x.numel(), -3, 3, 0, 8, out).float()
    mean = total / draws
    # each element: |mean - x| within 5 sigma of a Bernoulli(frac) over 200 draws
    assert (mean - x).abs().max() < 5 * 0.5 / draws ** 0.5
    # and across all elements the bias vanishes
    assert abs((mean - x).mean()) < 2e-3
    # neighbouring elements (two halves of one hash, or consecutive hashes) are uncorrelated
    err = native.stochastic_codes(x, torch.ones(1), x.numel(), -3, 3, 0, 8, out).float() - x
    assert abs(torch.corrcoef(torch.stack([err[:-1], err[1:]]))[0, 1]) < 0.03


@needs_kernels
def test_draws_follow_torch_seed_and_not_thread_count():
    x = torch.randn((1 << 19) + 3)
    out = torch.empty(x.numel(), dtype=torch.int8)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            torch.manual_seed(11)
            results.append(native.stochastic_codes(x, torch.tensor([8.0]), x.numel(), -64, 64, 0, 8,
                                                   out).clone())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    torch.manual_seed(12)
    assert not torch.equal(native.stochastic_codes(x, torch.tensor([8.0]), x.numel(), -64, 64, 0, 8,
                                                   out), results[0])


@needs_kernels
def test_kernels_give_the_same_bits_on_any_threads_torch_pool_or_their_own():
    """The kernels run on torch's OpenMP workers where the process has that runtime, else on
    threads of their own; either way, at any thread count, the same results."""
    x, r = torch.randn((1 << 20) + 37), torch.randn((1 << 20) + 37) * 0.1
    packed = torch.empty(bitpack.packed_size(x.numel(), 1), dtype=torch.uint8)
    lib, threads, results = native._library(), torch.get_num_threads(), []
    try:
        for shared in (True, False):
            if not shared:
                lib.mc_use_openmp(None, None, None)
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                keep = torch.empty_like(x)
                bits, stats = native.compensated_signs(x, r, -0.25, 0.5, keep, packed)
                results.append((bits.clone(), stats, keep))
    finally:
        native._share_openmp(lib)
        torch.set_num_threads(threads)
    for bits, stats, keep in results[1:]:
        assert torch.equal(bits, results[0][0]) and torch.equal(stats, results[0][1])
        assert torch.equal(keep, results[0][2])


def test_kernels_run_in_a_child_forked_after_torch_threads_ran():
    """torch's OpenMP workers do not exist in a forked child; the kernels must not wait for them."""
    code = ("import os, torch\nfrom mergecomp.kernels import native\ntorch.set_num_threads(2)\n"
            "x = torch.randn(4_000_000)\nout = torch.empty(500_000, dtype=torch.uint8)\n"
            "x.mul(2)\nbits = native.pack_signs(x, out)[0].clone()\npid = os.fork()\n"
            "if pid == 0:  # no torch operator here: those would wait for the workers\n"
            "    os._exit(0 if native.pack_signs(x, out)[0].numpy().tobytes() == bits.numpy().tobytes() else 3)\n"
            "print(os.waitpid(pid, 0)[1])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


@needs_kernels
@pytest.mark.parametrize("levels, bits", [(64, 8), (7, 4), (1, 4)])
@pytest.mark.parametrize("n, bucket", [(1000, 512), (100_003, 512), (70_000, 1 << 15), (513, 7),
                                       (1, 3), (0, 512)])
def test_qsgd_encode_and_scale_levels(n, bucket, levels, bits):
    x = torch.randn(n)
    x[:bucket] = 0.0  # a bucket with norm 0
    buckets = -(-n // bucket)
    out = torch.empty(n, dtype=torch.int8) if bits == 8 else torch.empty(-(-n // 2), dtype=torch.uint8)
    codes, norms = native.qsgd_encode(x, bucket, levels, bits, out, torch.empty(buckets))
    torch.testing.assert_close(norms, bucket_norms(x, bucket, torch.float32), rtol=1e-6, atol=0)
    shift = 0 if bits == 8 else levels
    found = codes if bits == 8 else bitpack.unpack(codes, 4, n).to(torch.int8) - shift
    assert torch.all(found[:bucket] == 0) and torch.all(found.abs() <= levels)
    scaled = x * levels / norms.clamp_min(1e-30).repeat_interleave(bucket)[:n]
    assert torch.all((found.float() - scaled).abs() < 1)
    if bits == 4 and n % 2:
        assert codes[-1] >> 4 == 0  # the padding nibble
    steps = norms / levels
    decoded = native.scale_levels(codes, steps, bucket, bits, shift, torch.empty(n))
    assert torch.equal(decoded, found.float() * steps.repeat_interleave(bucket)[:n])


def test_qsgd_encode_rejects_levels_beyond_its_bits():
    with pytest.raises(ValueError, match="levels"):
        native.qsgd_encode(torch.zeros(4), 4, 8, 4, torch.empty(2, dtype=torch.uint8), torch.empty(1))


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_momentum_signs(n):
    x, momentum = torch.randn(n), torch.randn(n)
    expected = momentum.lerp(x, 0.1)
    out = native.momentum_signs(x, momentum, 0.9,
                                torch.empty(bitpack.packed_size(n, 1), dtype=torch.uint8))
    torch.testing.assert_close(momentum, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, bitpack.pack(momentum >= 0, 1))


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("capacity", [1, 10 ** 6])
def test_indices_above(n, capacity):
    x = torch.randn(n)
    x[::3] *= -1
    expected = torch.nonzero(x.abs() >= 1.5).view(-1)
    assert torch.equal(native.indices_above(x, 1.5, capacity), expected)


@needs_kernels
@pytest.mark.parametrize("count, k", [(1, 1), (10, 3), (10, 10), (100_003, 77_000)])
@pytest.mark.parametrize("ties", [False, True])
def test_keep_largest_keeps_the_top_k_in_ascending_order_and_puts_the_others_back(count, k, ties):
    n = 3 * count
    indices = torch.randperm(n)[:count].sort().values
    values = torch.randn(count)
    if ties:  # many equal magnitudes of both signs at the k-th largest: the first ones are kept
        values = values.round().mul_(torch.where(torch.rand(count) < 0.5, -1.0, 1.0))
    momenta = torch.randn(count)
    out, u_out = torch.zeros(n), torch.zeros(n)
    magnitude = values.abs()
    kth = magnitude.topk(k).values.min()
    expected = (magnitude > kth) | ((magnitude == kth) & ((magnitude == kth).cumsum(0) <= k - (magnitude > kth).sum()))
    kept_indices, kept_values = native.keep_largest(indices.clone(), values.clone(), k, out, (momenta, u_out))
    assert torch.equal(kept_indices, indices[expected]) and torch.equal(kept_values, values[expected])
    rest = indices[~expected]
    assert torch.equal(out[rest], values[~expected]) and torch.equal(u_out[rest], momenta[~expected])
    assert out.count_nonzero() <= rest.numel() and u_out.count_nonzero() <= rest.numel()  # nothing else written
    assert torch.equal(native.keep_largest(indices.clone(), values.clone(), k)[0], indices[expected])
    with pytest.raises(ValueError, match="keep_largest"):
        native.keep_largest(indices.clone(), values.clone(), count + 1)
    with pytest.raises(ValueError, match="do not fit"):  # a scatter past the output's end
        native.keep_largest(indices.clone(), values.clone(), k, torch.zeros(int(indices[-1])))


@needs_kernels
@pytest.mark.parametrize("n, nonzeros, k", [(1, 0, 1), (10, 3, 10), (10, 0, 4), (65_536, 512, 656), (1000, 300, 301)])
def test_with_first_zeros_takes_the_nonzeros_and_the_first_zeros_in_ascending_order(n, nonzeros, k):
    """Of a group with fewer nonzeros than k, all among the candidates: those, and the first
    zeros to make k, ascending; the zeros' values read from out (a -0 stays one) and zeroed."""
    out = torch.zeros(n)
    out[1::4] = -0.0
    indices = torch.randperm(n)[:nonzeros].sort().values
    values = torch.randn(nonzeros)
    taken = out.clone()
    kept_indices, kept_values = native.with_first_zeros(indices, values, k, out)
    free = torch.ones(n, dtype=torch.bool)
    free[indices] = False
    zeros = torch.nonzero(free).view(-1)[:k - nonzeros]
    expected, order = torch.cat([indices, zeros]).sort()
    assert torch.equal(kept_indices, expected)
    assert torch.equal(kept_values, torch.cat([values, taken[zeros]])[order])
    assert torch.equal(kept_values.signbit(), torch.cat([values, taken[zeros]])[order].signbit())
    expected_out = taken.clone()
    expected_out[zeros] = 0.0
    assert torch.equal(out, expected_out) and torch.equal(out.signbit(), expected_out.signbit())
    with pytest.raises(ValueError, match="with_first_zeros"):
        native.with_first_zeros(indices, values, nonzeros, out)  # not fewer candidates than k


@needs_kernels
@pytest.mark.parametrize("n, stride", [(1, 1), (7, 3), (100_003, 1), (3_300_000, 167)])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "nonfinite"])
@pytest.mark.parametrize("residual", [False, True])
def test_sampled_threshold_is_the_float_topk_of_the_sample_gives(n, stride, kind, residual):
    x = torch.randn(n)
    if kind == "ties":  # many equal magnitudes of both signs
        x = x.round()
    elif kind == "zeros":
        x[n // 2:] = 0
    elif kind == "nonfinite":
        x[::5] = float("inf")
        x[1::11] = float("nan")
    r = torch.randn(n) * 0.1 if residual else None
    sample = (x[::stride] if r is None else r[::stride] + x[::stride]).abs()
    for rank in sorted({1, min(2, sample.numel()), sample.numel() // 3 + 1, sample.numel()}):
        expected = float(sample.topk(rank, sorted=False).values.min())
        got = native.sampled_threshold(x, r, stride, rank)
        assert got == expected or (got != got and expected != expected), (rank, got, expected)
    with pytest.raises(ValueError, match="sampled_threshold"):
        native.sampled_threshold(x, r, stride, sample.numel() + 1)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        native.sampled_threshold(x, r, 0, 1)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 4095, 100_002])
@pytest.mark.parametrize("source", ["plain", "residual", "momentum"])
def test_compensated_above_tells_whether_the_gradient_is_finite(bad, where, source):
    """The scan's flag is False exactly when an element of x (not of the memory) is NaN or
    Inf, wherever it lies (the first element, a block's last, the last), on every scan."""
    n = 100_003
    x, r, u = torch.randn(n), torch.randn(n) * 1e38, torch.randn(n)
    residual = None if source == "plain" else r
    momentum = (0.9, u, torch.empty(n)) if source == "momentum" else None
    assert native.compensated_above(x, residual, 2.0, torch.empty(n), 100, momentum)[4]  # x + r may overflow: x is finite
    x[where] = bad
    assert not native.compensated_above(x, residual, 2.0, torch.empty(n), 100, momentum)[4]


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("capacity", [3, 10 ** 6])
@pytest.mark.parametrize("source", ["plain", "residual", "residual in place"])
def test_compensated_above_takes_what_passes_and_leaves_the_rest(n, capacity, source):
    """c = x (or x + r): out = c except 0 where the first ``capacity`` elements with |c| >=
    threshold were taken (returned ascending with their c); the count is of all that passed;
    the same on 1 and 3 threads."""
    x, r = torch.randn(n), torch.randn(n)
    x[::5] = 0.0  # elements exactly at the threshold and zeros
    x[1::7] = 1.25
    c = x if source == "plain" else x + r
    above = torch.nonzero(c.abs() >= 1.25).view(-1)
    taken = above[:capacity]
    expected_out = c.clone()
    expected_out[taken] = 0
    threads, results = torch.get_num_threads(), []
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            residual = None if source == "plain" else r.clone()
            out = residual if source == "residual in place" else torch.empty(n)
            results.append((*native.compensated_above(x, residual, 1.25, out, capacity)[:3], out))
    finally:
        torch.set_num_threads(threads)
    for indices, values, count, out in results:
        assert count == above.numel() and torch.equal(indices, taken) and torch.equal(values, c[taken])
        assert torch.equal(out, expected_out)


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("source", ["plain", "residual", "momentum"])
def test_compensated_above_clearing_zeroes_x_and_changes_nothing_else(n, source):
    """With ``clear`` every element of x is 0 afterwards, and every other output, the
    finiteness flag included, is what the scan gives without it."""
    x, r, u = torch.randn(n), torch.randn(n), torch.randn(n)
    x[n // 2] = float("inf")  # the flag is read from x before it is cleared
    runs = []
    for clear in (False, True):
        given = x.clone()
        out, u_out = torch.empty(n), torch.empty(n)
        momentum = (0.9, u, u_out) if source == "momentum" else None
        found = native.compensated_above(given, None if source == "plain" else r, 1.0, out, 1000, momentum, clear)
        runs.append((found, out, u_out, given))
    (plain, out, u_out, kept), (cleared, out_c, u_out_c, zeroed) = runs
    assert torch.equal(kept, x) and not zeroed.any()
    assert plain[2] == cleared[2] and not plain[4] and not cleared[4]  # count; finite
    assert torch.equal(plain[0], cleared[0]) and torch.equal(plain[1], cleared[1])
    assert (plain[3] is None) == (cleared[3] is None) and (plain[3] is None or torch.equal(plain[3], cleared[3]))
    assert torch.equal(out, out_c) and (source != "momentum" or torch.equal(u_out, u_out_c))


@needs_kernels
@pytest.mark.parametrize("capacity", [5, 10 ** 6])
def test_compensated_above_masks_the_momentum_of_what_it_takes(capacity):
    """DGC's scan: u_out = m u + x and c = r + u_out everywhere, except that a candidate it
    takes gets out = 0 and u_out = 0 (where c != 0), its u_out returned; candidates beyond
    ``capacity`` keep both."""
    n = 100_003
    x, r, u = torch.randn(n), torch.randn(n), torch.randn(n)
    corrected = u.mul(0.9).add_(x)
    c = r + corrected
    out, u_out = torch.empty(n), torch.empty(n)
    indices, values, count, momenta, finite = native.compensated_above(x, r, 2.0, out, capacity, (0.9, u, u_out))
    assert finite
    above = torch.nonzero(c.abs() >= 2.0).view(-1)
    taken = above[:capacity]
    assert count == above.numel() and torch.equal(indices, taken) and torch.equal(values, c[taken])
    assert torch.equal(momenta, corrected[taken])
    expected_out, expected_u = c.clone(), corrected.clone()
    expected_out[taken] = 0
    expected_u[taken[c[taken] != 0]] = 0
    assert torch.equal(out, expected_out) and torch.equal(u_out, expected_u)


@needs_kernels
@pytest.mark.parametrize("voters", [1, 2, 3, 4, 255])
@pytest.mark.parametrize("n", [1, 9, 32769, (1 << 19) + 5])
def test_majority_vote_matches_eager(voters, n):
    packed = [pack_signs(torch.randn(n))[0] for _ in range(voters)]
    fast = majority_vote(packed, n, torch.float32)
    with native.disabled():
        eager = majority_vote(packed, n, torch.float32)
    assert torch.equal(fast, eager)
    if voters % 2 == 0:  # ties happen and give 0
        assert (fast == 0).any() or n < 100


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 8, 9, 32769, (1 << 19) + 5])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_codes_sum_is_the_sum_of_decodes_bit_for_bit(ranks, n, bits):
    """Every rank's table decode added in rank order, then divided, as decode + add_ + div_ do."""
    packed = [bitpack.pack(torch.randint(0, 1 << bits, (n,), dtype=torch.uint8), bits) for _ in range(ranks)]
    values = torch.randn(ranks, 1 << bits)
    for divisor in (1, ranks, 3):
        out = native.codes_sum(packed, bits, values, n, divisor, torch.full((n,), float("nan")))
        expected = native.decode_codes(packed[0], bits, n, values[0], torch.empty(n))
        for p, v in zip(packed[1:], values[1:]):
            expected.add_(native.decode_codes(p, bits, n, v, torch.empty(n)))
        assert torch.equal(out, expected.div_(divisor) if divisor != 1 else expected), divisor
    with pytest.raises(ValueError, match="values per rank"):
        native.codes_sum(packed, bits, values[:, :1], n, 1.0, out)


@needs_kernels
@pytest.mark.parametrize("n", [1, 5, 6, 32721, (1 << 20) + 7])
@pytest.mark.parametrize("bucket", [1 << 30, 301])
def test_stochastic_trits_pack_the_int8_codes_of_the_same_draws(n, bucket):
    """Drawn and packed in base 3 in one pass: the bytes tritpack packs from the int8 codes
    the same seed draws."""
    x = torch.randn(n)
    scales = torch.rand(-(-n // bucket)) + 0.5
    torch.manual_seed(1)
    codes = native.stochastic_codes(x, scales, bucket, -1, 1, 1, 8, torch.empty(n, dtype=torch.int8))
    torch.manual_seed(1)
    trits = native.stochastic_trits(x, scales, bucket, -1, 1, 1, torch.empty(-(-n // 5), dtype=torch.uint8))
    assert torch.equal(trits, tritpack.pack(codes))


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 5, 6, 32721, (1 << 20) + 7])  # a block and a byte split, streamed stores
def test_trits_sum_is_the_sum_of_decodes_bit_for_bit(ranks, n):
    """Base-3 codes: every rank's decode added in rank order, then divided, as the eager gathers
    do (:func:`mergecomp.kernels.codecs.trits_sum` with the kernels off)."""
    packed = [tritpack.pack(torch.randint(0, 3, (n,), dtype=torch.uint8)) for _ in range(ranks)]
    values = list(torch.randn(ranks, 3))
    for divisor in (1, ranks, 3):
        out = native.trits_sum(packed, torch.stack(values), n, divisor, torch.full((n,), float("nan")))
        with native.disabled():
            expected = trits_sum(packed, values, n, divisor, torch.empty(n))
        assert torch.equal(out, expected), divisor
    with pytest.raises(ValueError, match="3 values per rank"):
        native.trits_sum(packed, torch.zeros(ranks, 4), n, 1.0, out)


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 2, 5])
@pytest.mark.parametrize("n, bucket", [(1, 512), (100_003, 512), (70_000, (1 << 15) + 1), (1001, 301)])
@pytest.mark.parametrize("bits, shift", [(8, 0), (4, 7)])
def test_levels_sum_is_the_sum_of_scale_levels_bit_for_bit(ranks, n, bucket, bits, shift):
    codes = [torch.randint(-64, 65, (n,), dtype=torch.int8) if bits == 8
             else bitpack.pack(torch.randint(0, 15, (n,), dtype=torch.uint8), 4) for _ in range(ranks)]
    steps = [torch.rand(-(-n // bucket)) for _ in range(ranks)]
    out = native.levels_sum(codes, steps, bucket, bits, shift, ranks, torch.full((n,), float("nan")))
    expected = native.scale_levels(codes[0], steps[0], bucket, bits, shift, torch.empty(n))
    for c, s in zip(codes[1:], steps[1:]):
        expected.add_(native.scale_levels(c, s, bucket, bits, shift, torch.empty(n)))
    assert torch.equal(out, expected.div_(ranks) if ranks != 1 else expected)
    with pytest.raises(ValueError, match="steps for"):
        native.levels_sum(codes, [s[:-1] for s in steps] if n > 1 else [torch.rand(2)] * ranks, bucket, bits,
                          shift, 1, out)


@needs_kernels
def test_outputs_streamed_past_the_cache_are_the_same():
    """Outputs of 2**20 elements or more are written with non-temporal stores: the same values."""
    n = (1 << 20) + 37
    packed = [bitpack.pack(torch.randint(0, 2, (n,), dtype=torch.uint8), 1) for _ in range(2)]
    values = torch.randn(2, 2)
    expected = native.decode_codes(packed[0], 1, n, values[0], torch.empty(n))
    expected.add_(native.decode_codes(packed[1], 1, n, values[1], torch.empty(n))).div_(3)
    assert torch.equal(native.codes_sum(packed, 1, values, n, 3, torch.empty(n)), expected)
    codes = [torch.randint(-64, 65, (n,), dtype=torch.int8) for _ in range(2)]
    steps = [torch.rand(-(-n // 512)) for _ in range(2)]
    expected = torch.zeros(n)
    for c, st in zip(codes, steps):
        expected.add_((c.float() * st.repeat_interleave(512)[:n]))
    assert torch.equal(native.levels_sum(codes, steps, 512, 8, 0, 1, torch.empty(n)), expected)
    assert torch.equal(native.zero_fill(torch.full((n,), 5.0)), torch.zeros(n))


@needs_kernels
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("voters", [2, 5])
def test_majority_vote_streamed_is_the_eager_vote(voters, aligned):
    """An output of 2**20 + 37 elements (written past the cache where 64-byte aligned), with
    ties among an even number of voters: the vote in registers equals the eager byte count's."""
    n = (1 << 20) + 37
    packed = [pack_signs(torch.randn(n))[0] for _ in range(voters)]
    packed[1] = packed[0].clone()
    packed[1][::3] ^= 0xFF  # disagreeing there: ties among two voters
    out = torch.full((n + 16,), 7.0)[0 if aligned else 1:][:n]
    fast = majority_vote(packed, n, torch.float32, out=out)
    with native.disabled():
        eager = majority_vote(packed, n, torch.float32)
    assert fast.data_ptr() == out.data_ptr()
    assert torch.equal(fast, eager)
    assert (fast == 1).any() and (fast == -1).any() and bool((fast == 0).any()) == (voters % 2 == 0)


def test_majority_vote_voter_count_is_checked():
    with pytest.raises(ValueError, match="1 to 255 voters"):
        native.majority_vote([], 8, torch.empty(8))


# -- the compressors on both paths -----------------------------------------------------------
def _payload(name, x, **kwargs):
    torch.manual_seed(3)
    c = mergecomp.get_compressor(name, **kwargs)
    payload, ctx = c.compress(x, "g")
    return c, payload, ctx


@needs_kernels
@pytest.mark.parametrize("name", ["onebit", "efsignsgd", "signsgd", "signum"])
def test_sign_codecs_same_wire_on_both_paths(name):
    x = torch.randn(100_003)
    _, fast, _ = _payload(name, x)
    with native.disabled():
        c, eager, ctx = _payload(name, x)
    assert torch.equal(fast[0], eager[0])
    for a, b in zip(fast[1:], eager[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with native.disabled():
        reference = c.decompress(eager, ctx).clone()
    assert torch.equal(c.decompress(eager, ctx), reference)  # decoded natively


@needs_kernels
@pytest.mark.parametrize("name, kwargs", [("qsgd", {}), ("qsgd", {"bucket_size": None}),
                                          ("qsgd", {"levels": 7, "bucket_size": 301}), ("terngrad", {})])
def test_stochastic_codecs_agree_on_both_paths(name, kwargs):
    """Different draws, same layout and scalars; each path decodes the other's payload alike."""
    x = torch.randn(100_003)
    c, fast, ctx = _payload(name, x, **kwargs)
    with native.disabled():
        _, eager, _ = _payload(name, x, **kwargs)
        eager_decoded = c.decompress(fast, ctx).clone()
    assert [t.shape for t in fast] == [t.shape for t in eager]
    assert [t.dtype for t in fast] == [t.dtype for t in eager]
    torch.testing.assert_close(fast[1], eager[1], rtol=1e-5, atol=0)
    assert torch.equal(c.decompress(fast, ctx), eager_decoded)
    # both are unbiased estimates of x: the decoded error is small and centred
    for payload in (fast, eager):
        err = c.decompress(payload, ctx) - x
        assert abs(err.mean()) < 3 * err.std() / err.numel() ** 0.5 + 1e-6


# -- fallback --------------------------------------------------------------------------------
def _probe(env):
    code = ("import warnings, torch\nwarnings.simplefilter('always')\n"
            "from mergecomp.kernels import native\nimport mergecomp\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    ok = native.usable(torch.zeros(3))\n"
            "c = mergecomp.get_compressor('onebit')\n"
            "p, ctx = c.compress(torch.ones(1000), 'g')\n"
            "print(ok, bool(torch.allclose(c.decompress(p, ctx), torch.ones(1000))), "
            "'|'.join(str(x.message) for x in w))\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_environment_switch_turns_kernels_off():
    assert _probe({"MERGECOMP_NATIVE": "0"}).startswith("False True")


def test_failed_build_warns_and_falls_back(tmp_path):
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'cannot compile' >&2\nexit 1\n")
    broken.chmod(0o755)
    out = _probe({"CXX": str(broken), "MERGECOMP_CACHE": str(tmp_path / "cache")})
    assert out.startswith("False True"), out
    assert "building the native codec kernels failed" in out and "cannot compile" in out


def _split(n, cuts):
    """Parts ``(start, stop)`` of ``n`` elements cut at ``cuts`` (sorted, within [0, n])."""
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:]))


@needs_kernels
@pytest.mark.parametrize("n, cuts", [
    (1, []), (7, [3]), (40, [0, 0, 5, 21, 21, 37]), (1000, [1, 9, 16, 17, 500, 999]),
    (100_003, [13, 4096, 50_001, 99_990]),
    ((1 << 20) + 37, [5, 70_000, 1 << 19]),  # keep written past the cache, from part starts of all alignments
])
@pytest.mark.parametrize("carried", ["none", "none, not kept", "carried", "carried, kept in place"])
def test_parts_in_any_order_code_what_the_whole_group_codes(n, cuts, carried):
    """CompensatedSignParts over the parts of a group, added in a shuffled order, leaves the
    group's bits and kept values those of one compensated_signs of the whole, bit for bit; each
    part's sums add up to the whole group's to rounding, its count exactly.  Not kept (signSGD's
    parts): the bits of the gradient itself, nothing else written."""
    x, r = torch.randn(n), torch.randn(n) * 0.1
    x[::5] = 0.0
    negative, positive = (-0.3125, 0.7) if carried.startswith("carried") else (0.0, 0.0)
    whole_keep = torch.empty(n)
    whole_bits, whole_stats = native.compensated_signs(
        x, None if carried.startswith("none") else r.clone(), negative, positive, whole_keep,
        torch.empty(bitpack.packed_size(n, 1), dtype=torch.uint8))
    keep = r if carried.endswith("in place") else None if carried.endswith("not kept") else torch.empty(n)
    x_before, r_before = x.clone(), r.clone()
    bits = torch.randint(0, 256, (bitpack.packed_size(n, 1),), dtype=torch.uint8)  # garbage until written
    if n % 8:
        bits[-1] = 0  # padding: no part writes it
    parts = _split(n, cuts)
    stats = torch.zeros(len(parts), 3, dtype=torch.float64)
    code = native.CompensatedSignParts(n, None if carried.startswith("none") else r, negative, positive, keep, bits,
                                       stats, stream=n > (1 << 20))
    for k in torch.randperm(len(parts)).tolist():
        start, stop = parts[k]
        assert code(k, start, x[start:stop])
    assert torch.equal(bits, whole_bits)
    assert torch.equal(x, x_before)
    if keep is None:
        assert torch.equal(r, r_before)
        bits_alone = torch.zeros_like(bits)
        if n % 8:
            bits_alone[-1] = 0
        rows = torch.full((len(parts), 3), 5.0, dtype=torch.float64)
        code = native.CompensatedSignParts(n, None, 0.0, 0.0, None, bits_alone, rows, sums=False)
        for k in torch.randperm(len(parts)).tolist():
            start, stop = parts[k]
            assert code(k, start, x[start:stop])
        assert torch.equal(bits_alone, whole_bits) and not rows.any()  # the bits; rows tell only finiteness
    else:
        assert torch.equal(keep, whole_keep)
    torch.testing.assert_close(stats.sum(0)[:2], whole_stats[:2], rtol=16 * 2.0**-24, atol=1e-30)
    assert stats.sum(0)[2] == whole_stats[2]


@needs_kernels
@pytest.mark.parametrize("n,cuts", [(1003, [1, 16, 17, 500]), ((1 << 20) + 37, [5, 70_000, 1 << 19])])
@pytest.mark.parametrize("in_place", [False, True])
def test_momentum_parts_in_any_order_step_what_the_whole_group_steps(n, cuts, in_place):
    """MomentumSignParts over the parts of a group, in a shuffled order: the bits and the new
    momentum of one momentum_signs of the whole, bit for bit; the old momentum left as it was
    unless it is the target; the rows only tell finiteness."""
    x, m = torch.randn(n), torch.randn(n)
    x[::7] = 0.0
    whole_m = m.clone()
    whole_bits = native.momentum_signs(x, whole_m, 0.9, torch.empty(bitpack.packed_size(n, 1), dtype=torch.uint8))
    old = m.clone()
    keep = m if in_place else torch.full((n,), 7.0)
    bits = torch.randint(0, 256, (bitpack.packed_size(n, 1),), dtype=torch.uint8)
    if n % 8:
        bits[-1] = 0
    parts = _split(n, cuts)
    rows = torch.full((len(parts), 3), 5.0, dtype=torch.float64)
    code = native.MomentumSignParts(n, m, 0.1, keep, bits, rows, stream=n > (1 << 20))
    for k in torch.randperm(len(parts)).tolist():
        start, stop = parts[k]
        assert code(k, start, x[start:stop])
    assert torch.equal(bits, whole_bits) and torch.equal(keep, whole_m) and not rows.any()
    assert in_place or torch.equal(m, old)
    x[parts[0][0]] = float("nan")
    assert not code(0, parts[0][0], x[parts[0][0]:parts[0][1]])


@needs_kernels
@pytest.mark.parametrize("sums", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 5, 16, 999])  # in the part's head, its body, its last element
def test_a_part_holding_nan_or_inf_is_reported_not_finite(bad, where, sums):
    x = torch.randn(1000)
    x[7] = 3e38  # finite, however large
    code = native.CompensatedSignParts(1003, None, 0.0, 0.0, None, torch.zeros(bitpack.packed_size(1003, 1),
                                       dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.float64), sums=sums)
    assert code(0, 3, x)
    x[where] = bad
    assert not code(1, 3, x)


@needs_kernels
def test_parts_outside_their_group_or_not_fp32_are_refused():
    bits, stats = torch.zeros(8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="'out'"):  # 8 bytes of bits for 100 elements
        native.CompensatedSignParts(100, None, 0.0, 0.0, torch.empty(100), bits, stats)
    with pytest.raises(ValueError, match="sums=False"):
        native.CompensatedSignParts(64, None, 0.0, 0.0, torch.empty(64), bits, stats, sums=False)
    code = native.CompensatedSignParts(64, None, 0.0, 0.0, None, bits, stats)
    with pytest.raises(ValueError, match=r"elements \[60, 70\)"):
        code(0, 60, torch.randn(10))
    with pytest.raises(ValueError, match="row"):
        code(2, 0, torch.randn(10))
    with pytest.raises(ValueError, match="'x'"):
        code(0, 0, torch.randn(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        code(0, 0, torch.randn(4, 5).t())


@needs_kernels
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("ranks", [1, 2, 5])
def test_sign_sum_streamed_is_the_eager_sum_bit_for_bit(ranks, aligned):
    """1-bit codes of 2**20 + 37 elements (an output written past the cache where 64-byte
    aligned): each rank's bits picking its two values, 16 at a time, summed and divided as the
    eager path does."""
    from mergecomp.kernels.codecs import sign_sum

    n = (1 << 20) + 37
    packed = [bitpack.pack(torch.randint(0, 2, (n,), dtype=torch.uint8), 1) for _ in range(ranks)]
    sides = [(-0.3 - r, 0.7 + 0.1 * r) for r in range(ranks)]
    out = torch.empty(n) if aligned else torch.empty(n + 1)[1:]
    got = sign_sum(packed, sides, n, torch.float32, divisor=ranks, out=out)
    with native.disabled():
        want = sign_sum(packed, sides, n, torch.float32, divisor=ranks)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("m, n", [(1, 1), (3, 17), (64, 1000), (33, 1025), (700, 2048)])
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("subtract", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_low_rank_product_matches_torch(m, n, rank, subtract, stream):
    """``x - p @ q^T`` (or the products alone) in one pass for a batch of matrices spaced out in
    a group (3 of them, 5 elements apart): bit for bit as torch's bmm and sub at rank 1, to fp32
    rounding above it (torch adds the r products in its own order); the gaps are not written."""
    from mergecomp.kernels.codecs import low_rank

    r, count, stride = min(rank, m, n), 3, m * n + 5
    p, q = torch.randn(count, m, r), torch.randn(count, n, r)
    group = torch.randn(count * stride)
    x = group.as_strided((count, m, n), (stride, n, 1))
    expected = x - p @ q.transpose(1, 2) if subtract else p @ q.transpose(1, 2)
    minuend = x.contiguous() if subtract else None  # at out's strides, as the kernel takes them
    out = low_rank(p, q, torch.empty(count, m, n), minuend, stream=stream)
    with native.disabled():
        eager = low_rank(p, q, torch.empty(count, m, n), minuend)
    if r == 1:
        assert torch.equal(out, eager)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    in_place = group.clone()
    view = in_place.as_strided((count, m, n), (stride, n, 1))
    low_rank(p, q, view, view if subtract else None, stream=stream)
    assert torch.equal(view, out)
    gaps = torch.ones(count * stride, dtype=torch.bool)
    gaps.as_strided((count, m, n), (stride, n, 1)).fill_(False)
    assert torch.equal(in_place[gaps], group[gaps])


@needs_kernels
def test_low_rank_takes_factors_of_any_layout_and_refuses_mismatched_ones():
    from mergecomp.kernels.codecs import low_rank

    p = torch.randn(2, 3, 6).transpose(1, 2)  # (2, 6, 3), not contiguous: QR's factors come out so
    q = torch.randn(2, 5, 3)
    torch.testing.assert_close(low_rank(p, q, torch.empty(2, 6, 5)), p @ q.transpose(1, 2))
    with pytest.raises(ValueError, match="p \\(k, m, r\\) and qt \\(k, r, n\\)"):
        native.low_rank(torch.randn(1, 6, 3), torch.randn(1, 2, 5), None, torch.empty(1, 6, 5))
    with pytest.raises(ValueError, match="out must be 1 fp32 CPU row-major 6 x 5 matrices"):
        native.low_rank(torch.randn(1, 6, 3), torch.randn(1, 3, 5), None, torch.empty(1, 5, 6).transpose(1, 2))


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_frozen_adam_steps_match_their_torch_path(n):
    """The momentum exchange's three steps (onto the wire, back, the update) over a merged group
    of three tensors (segments: constants of their own; the middle one without Adam state), in
    one pass each: each result within 1e-6 of the size of its terms from the same arithmetic in
    fp64, as the torch path is (the kernel's square root is correctly rounded, torch's is not,
    so the two paths are not bit for bit); the inactive segment sends zeros, keeps its
    parameter; a value onto the wire beyond its segment's limit becomes the limit, its sign kept,
    and an Inf beyond it is still reported; the update raises the variance to its floor ``g * g *
    inv_bound2`` where it lies below (the same in both paths) and leaves it elsewhere."""
    from mergecomp.kernels.frozen_adam import Segments, frozen_update, momentum_from_wire, momentum_to_wire

    lengths = [n // 2, n // 4, n - n // 2 - n // 4]
    segments = Segments(torch.tensor([0, lengths[0], lengths[0] + lengths[1], n]), lengths,
                        torch.tensor([1, 0, 1], dtype=torch.uint8), [[0], [2]])
    g, m, p = torch.randn(n), torch.randn(n), torch.randn(n)
    v = torch.rand(n).square_() + 1e-12

    def each(*values):  # fp64 per segment, and per element
        per = torch.tensor(values, dtype=torch.float64)
        return per, per.repeat_interleave(torch.tensor(lengths))

    (mix, mix_e), (weight, weight_e), (eps, eps_e) = each(0.1, 0.2, -0.1), each(2.7, 1.0, 0.0), each(1e-8, 1e-6, 1e-8)
    (c, c_e), (keep, keep_e), (correction, correction_e) = each(1.7, 1.0, 0.6), each(1 - 1e-4, 1, 1), each(0.3, 1, 0.5)
    step, step_e = each(-1e-3, 0.0, -2e-3)
    bound, bound_e = each(0.5, 0.3, 0.0)
    limit, limit_e = each(0.5, 0.1, math.inf)  # the first segment's limit binds, the last has none
    unlimited = each(math.inf, math.inf, math.inf)[0]
    active = torch.tensor([1, 0, 1], dtype=torch.bool).repeat_interleave(torch.tensor(lengths))
    d = v.double().sqrt() + eps_e
    floor = torch.where(active, (g * g * bound_e.float()).double(), zero := torch.zeros(n, dtype=torch.float64))
    raised = torch.maximum(v.double(), floor)
    denom = raised.sqrt() / correction_e + eps_e
    variances = []

    def update():
        param, momentum, variance = p.clone(), torch.zeros(n), v.clone()
        frozen_update(list(param.split(lengths)), g, momentum, variance, segments, keep, correction, eps, step, bound)
        assert torch.equal(momentum[active], g[active]) and torch.equal(param[~active], p[~active])
        variances.append(variance)
        return param

    def to_wire(divide, limit=unlimited):
        wire = g.clone()
        momentum_to_wire(wire, m, v, segments, mix, weight, eps, c, limit, divide)
        return wire

    def from_wire():
        wire = g.clone()
        momentum_from_wire(wire, m, v, segments, c, eps, weight, divide=True)
        return wire

    mixed, mixed_size = g.double() * mix_e + m.double() * weight_e, g.double().abs() * mix_e.abs() + m.double().abs() * weight_e
    expected = [  # (run, exact, size of its terms)
        (lambda: to_wire(True), torch.where(active, mixed / d * c_e, zero), mixed_size / d * c_e),
        (lambda: to_wire(False), torch.where(active, mixed * c_e, zero), mixed_size * c_e),
        (lambda: to_wire(True, limit), torch.where(active, (mixed / d * c_e).clamp(-limit_e, limit_e), zero),
         mixed_size / d * c_e),
        (from_wire, torch.where(active, g.double() / c_e * d + m.double() * weight_e, g.double() / c_e),
         g.double().abs() / c_e * d + m.double().abs() * weight_e),
        (update, torch.where(active, p.double() * keep_e + step_e * g.double() / denom, p.double()),
         p.double().abs() * keep_e + step_e.abs() * g.double().abs() / denom),
    ]
    for run, exact, size in expected:
        for fused in (True, False):
            with contextlib.nullcontext() if fused else native.disabled():
                result = run()
            assert ((result.double() - exact).abs() <= 1e-6 * size).all(), ("fused" if fused else "torch", n)
    assert (floor > v.double()).any() or n < 8  # the floor is met somewhere
    assert ((mixed / d * c_e).abs() > limit_e)[:lengths[0]].any() or n < 8  # the limit too
    if lengths[0]:  # an Inf beyond the limit is not hidden by it: the kernel says so, the torch path keeps it
        wire = g.clone()
        wire[0] = math.inf
        assert momentum_to_wire(wire, m, v, segments, mix, weight, eps, c, limit, True) is False
        wire[0] = math.inf
        with native.disabled():
            assert momentum_to_wire(wire, m, v, segments, mix, weight, eps, c, limit, True) is None
        assert not wire[0].isfinite()
    for variance in variances:  # the same floor in both paths: products rounded alike
        assert torch.equal(variance, raised.float())
