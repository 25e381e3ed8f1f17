"""mergecomp.kernels.codecs: every operation gives the same result on its native and its torch path."""
import contextlib

import pytest
import torch

from mergecomp.kernels import bitpack, codecs, native

SIZES = [1, 9, 1000, 100_003]

needs_kernels = pytest.mark.skipif(not native.usable(torch.zeros(1)), reason="native kernels unavailable")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(5)


def both_paths(fn, *args, **kwargs):
    """``fn`` run on the native path, then on the torch path, each on fresh copies of the tensor
    arguments (some operations write into them); the results as a pair."""
    def run():
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        return fn(*copies, **kwargs)
    fast = run()
    with native.disabled():
        eager = run()
    return fast, eager


def _sign_stats(stats):
    return torch.stack([stats.nonnegative_sum(), stats.negative_sum(), stats.magnitude(), stats.nonnegative()])


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("shape", ["flat", "matrix"])
def test_pack_signs_gives_the_same_bits_and_stats_on_both_paths(n, shape):
    x = torch.randn(n)
    x[::5] = 0.0  # zeros travel as +
    if shape == "matrix":
        x = torch.cat([x, torch.randn(-n % 3)]).view(3, -1)

    def pack(x):
        bits, stats = codecs.pack_signs(x)
        return bits, _sign_stats(stats)

    (fast_bits, fast_stats), (eager_bits, eager_stats) = both_paths(pack, x)
    assert torch.equal(fast_bits, bitpack.pack(x.reshape(-1) >= 0, 1))
    assert torch.equal(eager_bits, fast_bits)
    exact = x.double()
    expected = torch.stack([exact.clamp_min(0).sum(), exact.clamp_max(0).sum(), exact.abs().sum(),
                            (x >= 0).sum().double()])
    torch.testing.assert_close(fast_stats.double(), expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(eager_stats, fast_stats, rtol=1e-5, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("n", [0] + SIZES)
@pytest.mark.parametrize("residual", ["none", "plain", "carried"])
def test_compensated_signs_are_pack_signs_of_the_gradient_plus_its_residual(n, residual):
    x = torch.randn(n)
    carried = None if residual == "none" else torch.randn(n)
    sides = (-0.5, 0.75) if residual == "carried" else (0.0, 0.0)
    compensated = x.clone()
    if carried is not None:
        compensated += carried if residual == "plain" else codecs.sign_remainder(carried, *sides, out=torch.empty(n))
    keep = torch.empty(n)
    bits, stats = codecs.compensated_signs(x, carried, sides, keep=keep)
    expected_bits, expected_stats = codecs.pack_signs(compensated)
    assert torch.equal(bits, expected_bits) and torch.equal(_sign_stats(stats), _sign_stats(expected_stats))
    assert torch.equal(keep, compensated)


@pytest.mark.parametrize("kernels", [True, False])
def test_sign_remainder_is_the_value_less_its_sign_decode(kernels):
    v = torch.randn(1000)
    v[::7] = 0.0
    negative, positive = -0.5, 0.75
    expected = v - codecs.decode_signs(codecs.pack_signs(v)[0], 1000, torch.float32, negative, positive)
    with contextlib.nullcontext() if kernels else native.disabled():
        out = codecs.sign_remainder(v.clone(), negative, positive, out=torch.empty(1000))
        in_place = v.clone()
        assert codecs.sign_remainder(in_place, negative, positive, out=in_place) is in_place
    assert torch.equal(out, expected) and torch.equal(in_place, expected)


@pytest.mark.parametrize("dtype, kernels", [(torch.float32, False), (torch.float64, True), (torch.float16, True)])
def test_compensated_signs_decline_where_no_kernel_serves(dtype, kernels):
    x = torch.randn(10, dtype=dtype)
    with contextlib.nullcontext() if kernels else native.disabled():
        assert codecs.compensated_signs(x, torch.randn(10, dtype=dtype)) is None
        assert codecs.compensated_signs(x, None) is None
    if dtype == torch.float32 and native.usable(x):
        assert codecs.compensated_signs(x, torch.randn(10, dtype=torch.float64)) is None


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_sign_stats_are_fp64(dtype, kernels):
    x = torch.tensor([-1.5, 0.0, 2.0, 3.0], dtype=dtype)
    with contextlib.nullcontext() if kernels else native.disabled():
        _, stats = codecs.pack_signs(x)
        sums = [stats.nonnegative_sum(), stats.negative_sum(), stats.magnitude(), stats.nonnegative()]
    assert [s.item() for s in sums] == [5.0, -1.5, 6.5, 3]
    assert {s.dtype for s in sums} == {torch.float64}


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_momentum_signs_same_momentum_and_bits_on_both_paths(n):
    x, momentum = torch.randn(n), torch.randn(n)

    def step(x, momentum):
        return codecs.momentum_signs(x, momentum, 0.9), momentum

    (fast_bits, fast_m), (eager_bits, eager_m) = both_paths(step, x, momentum)
    torch.testing.assert_close(fast_m, momentum.lerp(x, 0.1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(eager_m, fast_m, rtol=1e-6, atol=1e-7)
    assert torch.equal(fast_bits, bitpack.pack(fast_m >= 0, 1))
    assert torch.equal(eager_bits, fast_bits)


@needs_kernels
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_decode_codes_same_on_both_paths(bits):
    n = 100_003
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    values = torch.randn(1 << bits)
    fast, eager = both_paths(codecs.decode_codes, bitpack.pack(codes, bits), bits, n, values,
                             torch.empty(n))
    assert torch.equal(fast, values[codes.long()])
    assert torch.equal(eager, fast)


@needs_kernels
@pytest.mark.parametrize("bits, lo, hi, shift", [(8, -64, 64, 0), (2, -1, 1, 1), (4, -7, 7, 7)])
@pytest.mark.parametrize("n", SIZES)
def test_stochastic_codes_same_on_integers_on_both_paths(bits, lo, hi, shift, n):
    """Integral values round to themselves on both paths, those out of [lo, hi] to its ends."""
    ints = torch.randint(lo - 3, hi + 4, (n,)).float()
    fast, eager = both_paths(codecs.stochastic_codes, ints * 0.5, torch.full((-(-n // 300),), 2.0), 300,
                             lo, hi, shift, bits)
    codes = (ints.clamp(lo, hi) + shift).to(torch.int8)
    assert torch.equal(fast, codes if bits == 8 else bitpack.pack(codes, bits))
    assert torch.equal(eager, fast)


@needs_kernels
@pytest.mark.parametrize("levels, bits", [(64, 8), (7, 4)])
@pytest.mark.parametrize("n, bucket", [(100_003, 512), (70_000, (1 << 15) + 1), (1001, 301)])
def test_qsgd_encode_and_scale_levels_agree_on_both_paths(n, bucket, levels, bits):
    x = torch.randn(n)
    x[:bucket] = 0.0  # a bucket with norm 0
    (fast, fast_norms), (eager, eager_norms) = both_paths(codecs.qsgd_encode, x, bucket, levels, bits)
    assert fast.dtype == eager.dtype and fast.shape == eager.shape == (n if bits == 8 else -(-n // 2),)
    torch.testing.assert_close(eager_norms, fast_norms, rtol=1e-5, atol=0)
    shift = 0 if bits == 8 else levels
    scaled = x * levels / fast_norms.clamp_min(1e-30).repeat_interleave(bucket)[:n]
    for codes in (fast, eager):  # a neighbouring level, 0 in the zero bucket
        found = codes.float() if bits == 8 else bitpack.unpack(codes, 4, n).float() - shift
        assert torch.all((found - scaled).abs() < 1) and torch.all(found[:bucket] == 0)
    steps = fast_norms / levels
    decoded, eager_decoded = both_paths(codecs.scale_levels, fast, steps, bucket, torch.empty(n), bits, shift)
    assert torch.equal(eager_decoded, decoded)


@needs_kernels
@pytest.mark.parametrize("n", SIZES)
def test_moments_same_on_both_paths(n):
    x = torch.randn(n) * 3 + 1

    def reduce(x):
        stats = codecs.moments(x)
        return torch.stack([*stats.extremes(), stats.deviations()])

    fast, eager = both_paths(reduce, x)
    exact = x.double()
    expected = torch.stack([x.min(), x.max(), (exact - exact.mean()).square().sum().float()])
    torch.testing.assert_close(fast, expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(eager, fast, rtol=1e-5, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("voters", [1, 3])
@pytest.mark.parametrize("divisor", [1, 3])
def test_sign_sum_same_on_both_paths(voters, divisor):
    n = 100_003
    packed = [codecs.pack_signs(torch.randn(n))[0] for _ in range(voters)]
    sides = [(-torch.rand(1), torch.rand(1)) for _ in range(voters)]
    fast, eager = both_paths(codecs.sign_sum, packed, sides, n, torch.float32, divisor)
    expected = sum(codecs.decode_signs(p, n, torch.float32, *s) for p, s in zip(packed, sides)) / divisor
    torch.testing.assert_close(fast, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(eager, fast)  # both add in rank order and divide


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("bits", [2, 4])
def test_codes_sum_same_on_both_paths(ranks, bits):
    n = 100_003
    packed = [bitpack.pack(torch.randint(0, 1 << bits, (n,), dtype=torch.uint8), bits) for _ in range(ranks)]
    values = [torch.randn(1 << bits) for _ in range(ranks)]
    fast, eager = both_paths(codecs.codes_sum, packed, bits, values, n, ranks)
    assert torch.equal(eager, fast)


@needs_kernels
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("levels, bits", [(64, 8), (7, 4)])
def test_levels_sum_same_on_both_paths(ranks, levels, bits):
    n, bucket = 100_003, 512
    payloads = [codecs.qsgd_encode(torch.randn(n), bucket, levels, bits) for _ in range(ranks)]
    shift = 0 if bits == 8 else levels
    fast, eager = both_paths(lambda: codecs.levels_sum([c for c, _ in payloads], [s / levels for _, s in payloads],
                                                      bucket, torch.empty(n), bits, shift, ranks))
    assert torch.equal(eager, fast)


@needs_kernels
@pytest.mark.parametrize("n", SIZES + [(1 << 20) + 5])
def test_indices_above_same_on_both_paths(n):
    x = torch.randn(n)
    threshold = torch.tensor(1.5)
    fast, eager = both_paths(codecs.indices_above, x, threshold, True, 10)
    assert torch.equal(fast, torch.nonzero(x.abs() >= 1.5).view(-1))
    assert torch.equal(eager, fast)
    assert torch.equal(codecs.indices_above(x, threshold, False, 10), torch.nonzero(x >= 1.5).view(-1))


@needs_kernels
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_copy_finite_copies_fp32_and_checks_it_in_the_same_pass(bad):
    src = torch.randn(300, 7)
    if bad is not None:
        src[123, 4] = bad
    dst = torch.full((2100,), -1.0)
    assert codecs.copy_finite(src, dst) is (bad is None)
    torch.testing.assert_close(dst, src.reshape(-1), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype, kernels", [(torch.float16, True), (torch.float64, True),
                                            (torch.float32, False)])
def test_copy_finite_only_copies_where_it_cannot_check(dtype, kernels):
    src = torch.randn(300, 7, dtype=dtype)
    src[123, 4] = float("nan")
    dst = torch.zeros(2100, dtype=dtype)
    with contextlib.nullcontext() if kernels else native.disabled():
        assert codecs.copy_finite(src, dst) is None
    torch.testing.assert_close(dst, src.reshape(-1), rtol=0, atol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 100_003])
def test_copy_finite_scales_as_the_torch_path_does(n):
    src = torch.randn(n)
    (fast, fast_dst), (eager, eager_dst) = both_paths(lambda s, d: (codecs.copy_finite(s, d, 0.1), d), src,
                                                      torch.empty(n))
    assert fast is True and eager is None
    assert torch.equal(fast_dst, eager_dst) and torch.equal(fast_dst, src * 0.1)


def test_copy_finite_needs_the_same_numel():
    with pytest.raises(ValueError, match="src has 10 elements, dst 11"):
        codecs.copy_finite(torch.zeros(10), torch.zeros(11))


@pytest.mark.parametrize("n", [1, 9, 100_003, (1 << 19) + 5])
def test_zero_fills_every_element_on_both_paths(n):
    fast, eager = both_paths(codecs.zero_, torch.full((n,), float("nan")))
    assert torch.equal(fast, torch.zeros(n)) and torch.equal(eager, fast)
    offset = torch.full((n + 1,), 7.0)
    codecs.zero_(offset[1:])  # a buffer not aligned for the streaming stores
    assert offset[0] == 7.0 and torch.equal(offset[1:], torch.zeros(n))
