"""Single-process tests of every registered compressor.

Several ranks are simulated in-process: each fake rank has its own compressor instance (state is
per rank), summable payloads are added elementwise, the others travel as an allgather delivers
them (packed into bytes by the pipeline's own packing, one row per rank, unpacked in place).
Every test runs twice: with the native fp32 CPU kernels (mergecomp.kernels.native) and on the eager
torch path.
"""
import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mergecomp
from mergecomp.compressors.base.capabilities import SparseEntries
from mergecomp.compressors.base.compressor import bits_per_element
from mergecomp.compressors.base.sparse import num_selected
from mergecomp.exchange.encoder import feed, fused
from mergecomp.kernels import bitpack, native
from mergecomp.kernels.wire import pack_payload, unpack_payload

ALL = mergecomp.compressor_names()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
NUMELS = [0, 1, 2, 7, 1000]

EXPECTED_NAMES = {"none", "fp16", "bf16", "topk", "dgc", "qsgd", "terngrad", "onebit", "signsgd",
                  "efsignsgd", "signum", "randk", "powersgd", "acpsgd"}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True, params=["native", "eager"])
def codec_path(request):
    if request.param == "eager":
        with native.disabled():
            yield request.param
    else:
        yield request.param


# -- helpers ---------------------------------------------------------------------------------
def make(name, **kwargs):
    return mergecomp.get_compressor(name, **kwargs)


def add_payloads(payloads):
    """Elementwise sum of several ranks' payloads (what the allreduce does)."""
    return tuple(torch.stack(parts).sum(dim=0).to(parts[0].dtype) for parts in zip(*payloads))


def gather_payloads(payloads):
    """What an allgather of the ranks' payloads delivers: each packed into bytes as the pipeline
    packs it, the rows gathered into one ``(ranks, bytes)`` buffer, each row unpacked in place."""
    packed = [pack_payload(p) for p in payloads]
    rows = torch.cat([raw for raw, _ in packed]).view(len(packed), -1)
    return [unpack_payload(row, packed[0][1]) for row in rows]


def run_rounds(compressors, xs, group="g", shapes=None):
    """Compress on every fake rank and run the intermediate rounds: the last round's
    (payload, ctx) per rank."""
    steps = [c.compress(x, group, shapes) for c, x in zip(compressors, xs)]
    for _ in range(compressors[0].rounds - 1):
        summed = add_payloads([p for p, _ in steps])
        steps = [c.next_round(summed, ctx) for c, (_, ctx) in zip(compressors, steps)]
    return steps


def finish(compressors, steps, average=True):
    """What every rank gets from the last round's payloads: one result per rank."""
    payloads = [p for p, _ in steps]

    def arrived():  # every rank receives its own copy (aggregate may reuse the received buffers)
        return [add_payloads(payloads)] if compressors[0].summable else gather_payloads(payloads)

    return [c.aggregate(arrived(), ctx, len(steps), average) for c, (_, ctx) in zip(compressors, steps)]


def exchange(compressors, xs, group="g", shapes=None, average=True):
    """One step on ``len(xs)`` fake ranks.  Returns (aggregate per rank, local decode per rank)."""
    steps = run_rounds(compressors, xs, group, shapes)
    local = [c.decompress(p, ctx) for c, (p, ctx) in zip(compressors, steps)]
    return finish(compressors, steps, average), local


def roundtrip(c, x, group="g", shapes=None):
    """Single rank: (local decode, aggregate with world_size 1)."""
    results, local = exchange([c], [x], group, shapes)
    return local[0], results[0]


def same(a, b):
    """Structural equality of ctx objects (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def pm_sign(x):
    """The sign convention of the sign compressors: +1 for x >= 0, -1 otherwise."""
    return torch.where(x >= 0, 1.0, -1.0)


def nbytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


# -- registry and flags ----------------------------------------------------------------------
def test_all_compressors_registered():
    assert EXPECTED_NAMES <= set(ALL)


@pytest.mark.parametrize("name, summable, votes, memory, rounds", [
    ("none", True, False, "none", 1), ("fp16", True, False, "none", 1),
    ("bf16", True, False, "none", 1), ("topk", False, False, "residual", 1),
    ("dgc", False, False, "dgc", 1), ("qsgd", False, False, "none", 1),
    ("terngrad", False, False, "none", 1), ("onebit", False, False, "residual", 1),
    ("signsgd", False, True, "none", 1), ("efsignsgd", False, False, "residual", 1),
    ("signum", False, True, "none", 1), ("randk", True, False, "residual", 1),
    ("powersgd", True, False, "residual", 2), ("acpsgd", True, False, "residual", 1),
])
def test_flags(name, summable, votes, memory, rounds):
    c = make(name)
    assert (c.summable, c.votes, c.default_memory, c.rounds) == (summable, votes, memory, rounds)
    assert memory in mergecomp.memory_names()


# -- generic contract ------------------------------------------------------------------------
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ALL)
def test_roundtrip_shape_dtype_device(name, dtype, numel):
    x = torch.randn(numel, dtype=dtype)
    original = x.clone()
    c = make(name)
    payload, _ = c.compress(x, "g")
    assert isinstance(payload, tuple) and all(isinstance(t, torch.Tensor) for t in payload)
    if c.summable and len(payload) > 1:
        assert len({t.dtype for t in payload}) == 1
    local, result = roundtrip(make(name), x)
    for out in (local, result):
        assert out.shape == (numel,) and out.dtype == dtype and out.device == x.device
        assert torch.isfinite(out).all()
    assert torch.equal(x, original), "compress must not modify its input"


@pytest.mark.parametrize("name", ALL)
def test_payload_and_ctx_do_not_depend_on_values(name):
    n = 777
    inputs = [torch.randn(n), torch.zeros(n), -torch.rand(n) * 1e4, torch.full((n,), 3.0)]
    specs, ctxs = [], []
    for x in inputs:
        payload, ctx = make(name).compress(x, "g")
        specs.append([(t.dtype, t.shape) for t in payload])
        ctxs.append(ctx)
    assert all(s == specs[0] for s in specs)
    if not make(name).summable:  # ctx decodes the other ranks' payloads: must agree
        assert all(same(ctx, ctxs[0]) for ctx in ctxs)


@pytest.mark.parametrize("n", [300, 0])
@pytest.mark.parametrize("name", ALL)
def test_aggregate_of_three_ranks(name, n):
    compressors = [make(name) for _ in range(3)]
    steps = run_rounds(compressors, [torch.randn(n) for _ in compressors])
    local = [c.decompress(p, ctx) for c, (p, ctx) in zip(compressors, steps)]
    mean = finish(compressors, steps, average=True)
    total = finish(compressors, steps, average=False)
    for r in range(1, 3):  # every rank ends with the same result
        assert torch.equal(mean[r], mean[0]) and torch.equal(total[r], total[0])
    if compressors[0].votes:
        assert torch.equal(mean[0], total[0])
    else:
        torch.testing.assert_close(mean[0], total[0] / 3)
        if not compressors[0].summable:  # allgather: the sum of the ranks' decodes
            torch.testing.assert_close(total[0], torch.stack(local).sum(0))


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("name, kwargs", [("onebit", {}), ("efsignsgd", {}), ("qsgd", {}), ("qsgd", {"levels": 7}),
                                          ("terngrad", {}), ("terngrad", {"packing": "base3"})])
def test_one_pass_aggregate_is_decode_add_divide_bit_for_bit(name, kwargs, average, codec_path):
    """The compressors that sum every rank's decode in one pass (no per-rank temporaries) give
    what decoding each payload, adding in rank order and dividing gives."""
    from mergecomp.compressors.base.compressor import Compressor

    n, ranks = 70_001, 4
    c = make(name, **kwargs)
    assert c.passes.aggregated(ranks, average) == 1
    sent = [c.compress(torch.randn(n) * (r + 1), "g") for r in range(ranks)]
    payloads, ctx = [p for p, _ in sent], sent[0][1]
    got = c.aggregate(payloads, ctx, ranks, average).clone()
    assert torch.equal(got, Compressor.aggregate(c, payloads, ctx, ranks, average))


@settings(max_examples=15, deadline=None)
@given(numel=st.integers(0, 300), dtype=st.sampled_from(DTYPES), ranks=st.integers(1, 3))
@pytest.mark.parametrize("name", ALL)
def test_property_sizes(name, numel, dtype, ranks):
    xs = [torch.randn(numel, dtype=dtype) for _ in range(ranks)]
    results, local = exchange([make(name) for _ in xs], xs)
    for out in results + local:
        assert out.shape == (numel,) and out.dtype == dtype
        assert torch.isfinite(out).all()


def test_state_is_per_group():
    c = make("signum")
    c.compress(torch.randn(5), "a")
    c.compress(torch.randn(9), "b")
    assert c.state["a"]["momentum"].shape == (5,) and c.state["b"]["momentum"].shape == (9,)


@pytest.mark.parametrize("name", ALL)
def test_through_the_exchange_pipeline(name):
    """Single rank through the real pipeline (LocalCommunicator, default memory), 3 steps."""
    from mergecomp.engines.communicator import LocalCommunicator
    from mergecomp.exchange.exchange import Exchange
    from mergecomp.exchange.plan import GroupPlan, layout

    shapes = [torch.Size([16, 12]), torch.Size([12]), torch.Size([3, 2, 2])]
    group = layout(GroupPlan(((0, 1, 2),)), shapes)[0]
    c = make(name)
    ex = Exchange(c, mergecomp.get_memory(c.default_memory), LocalCommunicator())
    for _ in range(3):
        flat = torch.randn(group.numel)
        out = ex.finish(ex.start(group, flat.clone()))
        assert out.shape == (group.numel,) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        if name == "none":
            torch.testing.assert_close(out, flat)


# -- casts -----------------------------------------------------------------------------------
def normal_values(n, low, high, dtype=torch.float32):
    mags = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(low, high))
    signs = torch.where(torch.rand(n) < 0.5, -1.0, 1.0).double()
    return (mags * signs).to(dtype)


@pytest.mark.parametrize("name, exponent", [("fp16", 11), ("bf16", 8)])
def test_cast_rounding_bound(name, exponent):
    x = normal_values(10_000, -13, 15)
    out, _ = roundtrip(make(name), x)
    rel = ((out - x).abs() / x.abs()).max()
    assert rel <= 2.0 ** -exponent


def test_none_is_exact():
    x = torch.randn(1000, dtype=torch.float64)
    out, _ = roundtrip(make("none"), x)
    assert torch.equal(out, x)


def test_fp16_prescale():
    x = torch.full((4,), 60000.0)
    results, _ = exchange([make("fp16", prescale=4) for _ in range(4)], [x.clone() for _ in range(4)],
                          average=False)
    assert torch.isfinite(results[0]).all()
    torch.testing.assert_close(results[0], 4 * x, rtol=1e-3, atol=0)


# -- sparsifiers -----------------------------------------------------------------------------
@pytest.mark.parametrize("selection", ["exact", "threshold"])
@pytest.mark.parametrize("n", [1000, 100_000])
def test_topk_keeps_the_k_largest(selection, n):
    signs = torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    x = (torch.randperm(n) + 1).float() * signs  # distinct magnitudes
    c = make("topk", ratio=0.01, selection=selection)
    (values, indices), ctx = c.compress(x, "g")
    k = num_selected(n, 0.01)
    assert indices.dtype == torch.int32 and indices.numel() == k
    expected = set(x.abs().topk(k).indices.tolist())
    assert set(indices.tolist()) == expected
    assert torch.equal(values, x[indices.long()])
    dense = c.decompress((values, indices), ctx)
    assert torch.count_nonzero(dense) == k
    assert torch.equal(dense[indices.long()], values)


def test_k_is_the_exact_ceiling_of_ratio_times_n():
    # 0.07 * 200 is 14.000000000000002 in floating point: a float ceiling keeps 15
    for n, ratio, k in [(200, 0.07, 14), (100, 0.07, 7), (201, 0.07, 15), (5, 0.01, 1), (0, 0.5, 0)]:
        assert num_selected(n, ratio) == k, (n, ratio)
        for name in ("topk", "dgc"):
            (values, indices), _ = make(name, ratio=ratio, index_format="int32").compress(torch.randn(n), "g")
            assert values.numel() == indices.numel() == k, (name, n, ratio)
            (values, bitmap), _ = make(name, ratio=ratio, index_format="bitmap").compress(torch.randn(n), "g")
            assert values.numel() == k and bitmap.dtype == torch.uint8 and bitmap.numel() == -(-n // 8)


@pytest.mark.parametrize("n", [10, 5000, 200_000])
def test_dgc_returns_exactly_k(n):
    x = torch.randn(n)
    c = make("dgc", ratio=0.01, index_format="int32")
    (values, indices), _ = c.compress(x, "g")
    k = num_selected(n, 0.01)
    assert values.numel() == indices.numel() == k
    assert indices.unique().numel() == k
    # a threshold selection: every kept magnitude is at least (nearly) every dropped one
    kept = torch.zeros(n, dtype=torch.bool)
    kept[indices.long()] = True
    if k < n:
        assert x[kept].abs().min() >= x[~kept].abs().max()


def test_randk_shared_indices():
    x = torch.randn(1000)
    a, b = make("randk", ratio=0.05), make("randk", ratio=0.05)
    (_, ctx_a), (_, ctx_b) = a.compress(x, "g"), b.compress(torch.randn(1000), "g")
    assert torch.equal(ctx_a.indices, ctx_b.indices)  # same name, same step, fresh instances
    assert ctx_a.indices.numel() == num_selected(1000, 0.05)
    (_, next_a) = a.compress(x, "g")
    assert not torch.equal(next_a.indices, ctx_a.indices)  # the next step draws anew
    assert a.state["g"]["step"].dim() == 0 and a.state["g"]["step"].dtype == torch.int64
    assert int(a.state["g"]["step"]) == 2
    (_, other) = b.compress(x, "h")  # another group has its own counter and seed
    assert int(b.state["h"]["step"]) == 1 and not torch.equal(other.indices, ctx_a.indices)


def test_randk_sum_over_ranks():
    xs = [torch.randn(500) for _ in range(3)]
    results, _ = exchange([make("randk", ratio=0.1) for _ in xs], xs)
    _, ctx = make("randk", ratio=0.1).compress(xs[0], "g")
    mask = torch.zeros(500, dtype=torch.bool)
    mask[ctx.indices] = True
    expected = torch.where(mask, torch.stack(xs).mean(0), 0)
    torch.testing.assert_close(results[0], expected)


def test_randk_repeated_index_decode():
    randk = make("randk", ratio=0.5)
    ctx_type = type(randk.compress(torch.randn(4), "g")[1])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    ctx = ctx_type(5, torch.float32, torch.tensor([1, 1, 3]))
    values = (x[ctx.indices],)
    # biased: each selected element kept once; unbiased: counted per draw, scaled by n / k
    assert torch.equal(randk.decompress(values, ctx), torch.tensor([0.0, 2.0, 0.0, 4.0, 0.0]))
    scaled = make("randk", ratio=0.5, unbiased=True).decompress(values, ctx)
    torch.testing.assert_close(scaled, torch.tensor([0.0, 4.0, 0.0, 4.0, 0.0]) * 5 / 3)


def test_randk_unbiased_on_average():
    n, draws = 20, 4000
    c = make("randk", ratio=0.25, unbiased=True)
    k = num_selected(n, 0.25)
    x = torch.randn(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        total += roundtrip(c, x)[0]
    var = (n / k) * (1 - 1 / n) * x ** 2
    assert ((total / draws - x).abs() <= 6 * (var / draws).sqrt() + 1e-9).all()


# -- quantizers ------------------------------------------------------------------------------
@pytest.mark.parametrize("levels, bucket", [(64, 512), (8, 64), (7, 64), (1, 7)])
def test_qsgd_wire_format(levels, bucket):
    n = 1001
    x = torch.randn(n)
    (q, norms), _ = make("qsgd", levels=levels, bucket_size=bucket).compress(x, "g")
    assert norms.dtype == torch.float32 and norms.shape == (math.ceil(n / bucket),)
    if levels > 7:  # one int8 level per element
        assert q.dtype == torch.int8 and q.shape == (n,)
    else:  # level + levels in 4 bits, two to a byte, low nibble first
        assert q.dtype == torch.uint8 and q.shape == (math.ceil(n / 2),)
        q = bitpack.unpack(q, 4, n).to(torch.int8) - levels
    assert q.abs().max() <= levels
    torch.testing.assert_close(norms[0], x[:bucket].norm())


@pytest.mark.parametrize("bucket", [64, None])
def test_qsgd_unbiased(bucket):
    m, draws, levels = 64, 20_000, 4
    x = torch.randn(m, dtype=torch.float64)
    c = make("qsgd", levels=levels, bucket_size=bucket)
    if bucket is None:  # one norm for the whole buffer: draw one call at a time
        draws = 3000
        out = torch.stack([roundtrip(c, x)[0] for _ in range(draws)])
    else:  # many copies of x, one per bucket, in a single call
        out = roundtrip(c, x.repeat(draws))[0].view(draws, m)
    step = x.norm() / levels
    bound = 6 * (step / 2) / math.sqrt(draws)  # Bernoulli variance <= step^2 / 4
    assert ((out.mean(0) - x).abs() <= bound + 1e-9).all()


def test_terngrad_unbiased_without_clipping():
    m, draws = 50, 20_000
    x = torch.randn(m, dtype=torch.float64)
    c = make("terngrad", clip=None)
    out = roundtrip(c, x.repeat(draws))[0].view(draws, m)
    s = x.abs().max()
    assert ((out.mean(0) - x).abs() <= 6 * (s / 2) / math.sqrt(draws) + 1e-9).all()


def test_terngrad_clipping_and_ternary_codes():
    x = torch.randn(1000)
    x[3] = 100.0
    (packed, scalar), ctx = make("terngrad").compress(x, "g")
    assert packed.dtype == torch.uint8 and packed.numel() == bitpack.packed_size(1000, 2)
    assert scalar.dtype == torch.float32 and scalar.shape == (1,)
    bound = 2.5 * x.std()
    torch.testing.assert_close(scalar[0], bound)  # the outlier was clipped
    out = make("terngrad").decompress((packed, scalar), ctx)
    assert set((out / scalar).unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.all((out == 0) | (torch.sign(out) == torch.sign(x)))


@pytest.mark.parametrize("name, kwargs", [(n, {}) for n in sorted(EXPECTED_NAMES)] + [
    ("none", {"prescale": 2.0}), ("fp16", {"prescale": 2.0}), ("bf16", {"prescale": 2.0}),
    ("terngrad", {"packing": "base3"}), ("qsgd", {"levels": 7})])
def test_decompress_leaves_the_payload_as_it_was(name, kwargs, codec_path):
    """An error-feedback memory decodes this rank's own payload before the payload is sent: the
    decode must not change it (``none`` with a prescale once multiplied it in place, and the
    momentum exchange then averaged twice the momentum)."""
    c = make(name, **kwargs)
    x = torch.randn(4099)
    payload, ctx = c.compress(x, "g", [torch.Size([4099])])
    for _ in range(1, c.rounds):  # a one-rank exchange of the earlier rounds
        payload, ctx = c.next_round(payload, ctx)
    sent = [t.clone() for t in payload]
    c.decompress(payload, ctx)
    assert all(torch.equal(a, b) for a, b in zip(payload, sent))


@pytest.mark.parametrize("value_dtype", ["fp16", "bf16"])
def test_topk_values_in_half_precision_keep_their_rounding_in_the_residual(value_dtype, codec_path):
    """``value_dtype``: the values travel in it, decode to the gradient's dtype, and what the
    cast rounded off stays in the residual: decoded + residual is the compensated gradient."""
    c, memory = make("topk", ratio=0.05, value_dtype=value_dtype), mergecomp.get_memory("residual")
    grad = torch.randn(20_000) / 3
    payload = encode(c, memory, grad.clone(), codec_path)
    assert payload[0].dtype == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[value_dtype])
    decoded = c.decompress(payload, (grad.numel(), torch.float32))
    residual = memory.state_dict()["g"]["residual"]
    assert not torch.equal(decoded[payload[1].long()], grad[payload[1].long()])  # rounded
    assert torch.equal(decoded + residual, grad)
    assert c.may_overflow and not make("topk").may_overflow


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 1003, 100_003])
def test_terngrad_base3_packing_carries_the_same_codes_in_fewer_bytes(n, codec_path):
    """Five codes to a byte: ``ceil(n / 5)`` bytes where 2-bit codes take ``ceil(n / 4)``; from
    the same random state both packings decode to the same tensor, alone and summed over ranks."""
    x = torch.randn(n)
    decoded, summed = {}, {}
    for packing in ("2bit", "base3"):
        c = make("terngrad", packing=packing)
        torch.manual_seed(3)
        (packed, scalar), ctx = c.compress(x, "g")
        assert packed.dtype == torch.uint8
        assert packed.numel() == (-(-n // 5) if packing == "base3" else bitpack.packed_size(n, 2))
        decoded[packing] = c.decompress((packed, scalar), ctx).clone()
        other = c.compress(2 * x, "g")[0]
        summed[packing] = c.decode_sum([(packed, scalar), other], ctx, 2).clone()
    assert torch.equal(decoded["2bit"], decoded["base3"])
    assert torch.equal(summed["2bit"], summed["base3"])


@pytest.mark.parametrize("dtype, spread", [(torch.float32, 1.0), (torch.float16, 30.0)], ids=str)
def test_terngrad_clips_at_the_std_of_a_gradient_with_a_large_mean(dtype, spread):
    x = (1e4 + spread * torch.randn(20_000, dtype=torch.float64)).to(dtype)
    (_, scalar), _ = make("terngrad", clip=2.5).compress(x, "g")
    torch.testing.assert_close(scalar[0].double(), 2.5 * x.double().std(), rtol=1e-5, atol=0)


def test_terngrad_constant_tensor_not_clipped_to_zero():
    x = torch.full((100,), 0.5)
    out, _ = roundtrip(make("terngrad"), x)
    assert torch.equal(out, x)  # std 0: no clipping, probability 1 everywhere


# -- sign methods ----------------------------------------------------------------------------
def test_signsgd_majority_vote():
    xs = [torch.randn(1001) for _ in range(3)]
    xs[0][:5] = 0.0
    c = make("signsgd")
    payloads = [c.compress(x, "g")[0] for x in xs]
    _, ctx = c.compress(xs[0], "g")
    expected = torch.sign(sum(pm_sign(x) for x in xs))
    for average in (True, False):
        assert torch.equal(c.aggregate(payloads, ctx, 3, average), expected)
    assert torch.equal(c.decompress(payloads[0], ctx), pm_sign(xs[0]))  # 0 decodes to +1
    # a tie gives 0
    tie = c.aggregate([payloads[0], c.compress(-xs[0] - 1e-3, "g")[0]], ctx, 2, True)
    assert torch.equal(tie, torch.zeros(1001))


def test_signum_momentum():
    beta = 0.9
    c = make("signum", beta=beta)
    x1, x2 = torch.randn(100), torch.randn(100)
    c.compress(x1, "g")
    payload, ctx = c.compress(x2, "g")
    momentum = beta * (1 - beta) * x1 + (1 - beta) * x2
    torch.testing.assert_close(c.state["g"]["momentum"], momentum)
    assert c.state["g"]["momentum"].shape == (100,)
    assert torch.equal(c.decompress(payload, ctx), pm_sign(momentum))
    assert payload[0].numel() == bitpack.packed_size(100, 1)


def test_onebit_decodes_to_side_means():
    x = torch.tensor([1.0, 2.0, -3.0, 0.0, -1.0])
    c = make("onebit")
    (packed, means), ctx = c.compress(x, "g")
    assert means.dtype == torch.float32 and torch.equal(means, torch.tensor([1.0, -2.0]))
    assert torch.equal(c.decompress((packed, means), ctx), torch.tensor([1.0, 1.0, -2.0, 1.0, -2.0]))
    (_, means), _ = c.compress(torch.tensor([0.5, 1.5]), "g")
    assert torch.equal(means, torch.tensor([1.0, 0.0]))  # no negative element


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_onebit_keeps_the_mean_of_a_tiny_side(dtype):
    x = -(torch.rand(20_000) + 0.5)
    x[[3, 9000, 17000]] = torch.tensor([1e-3, 2e-3, 4e-3])  # 3 small positives
    x = x.to(dtype)
    (_, means), _ = make("onebit").compress(x, "g")
    exact = x.double()
    expected = torch.stack([exact[exact >= 0].mean(), exact[exact < 0].mean()])
    torch.testing.assert_close(means.double(), expected, rtol=1e-5, atol=0)


def test_efsignsgd_scale():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0])
    c = make("efsignsgd")
    (packed, scale), ctx = c.compress(x, "g")
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    torch.testing.assert_close(scale[0], x.abs().sum() / 5)
    torch.testing.assert_close(c.decompress((packed, scale), ctx), pm_sign(x) * 2.0)


# -- PowerSGD --------------------------------------------------------------------------------
def low_rank(m, n, r, dtype=torch.float64):
    return torch.randn(m, r, dtype=dtype) @ torch.randn(r, n, dtype=dtype)


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_exact_for_low_rank(rank):
    c = make("powersgd", rank=rank)
    shapes = [torch.Size([32, 24]), torch.Size([10])]
    for _ in range(3):  # the first step from the random Q, then warm starts
        x = torch.cat([low_rank(32, 24, rank).view(-1), torch.randn(10, dtype=torch.float64)])
        local, result = roundtrip(c, x, shapes=shapes)
        torch.testing.assert_close(result, x)
        torch.testing.assert_close(local, x)
    assert c.state["g"]["q"].shape == (24 * rank,)


def test_low_rank_layout_batches_the_equally_spaced_tensors_of_one_shape():
    """Three layers of (bias, weight, bias, weight, weight) and a stray weight: the weights of
    one shape one layer apart form a batch each (the stray one, out of step, its own); the two
    biases of each layer, of one length, two batches a layer apart (not pairs); payload order is
    batch after batch, by first member."""
    from mergecomp.compressors.base.low_rank import Batch, group_layout

    layer = [(12,), (16, 12), (12,), (12, 16), (4, 16)]
    shapes = [torch.Size(s) for s in layer * 3 + [(16, 12)]]
    size = sum(math.prod(s) for s in layer)  # 12 + 192 + 12 + 192 + 64 = 472
    layout = group_layout("powersgd", "g", sum(math.prod(s) for s in shapes), shapes, 1, 2.0)
    assert layout.matrices == (Batch(12, size, 3, (16, 12)), Batch(216, size, 3, (12, 16)),
                               Batch(408, size, 3, (4, 16)), Batch(3 * size, 192, 1, (16, 12)))
    assert layout.raw == (Batch(0, size, 3, (12,)), Batch(204, size, 3, (12,)))
    assert layout.p_numel == 3 * (16 + 12 + 4) + 16 and layout.q_numel == 3 * (12 + 16 + 16) + 12


@pytest.mark.parametrize("kernels", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_compressors_are_exact_for_low_rank_layers_in_batches(name, kernels):
    """Layers of rank-2 matrices (batched by shape) with raw runs between, on 3 ranks sharing
    each shape's column space (fresh rows each step): PowerSGD and ACP-SGD (holding ``P``)
    deliver the group's average exactly, the same on every rank."""
    layer = [(6,), (24, 20), (20,), (20, 24)]
    shapes = [torch.Size(s) for s in layer * 4]
    us = [torch.randn(s[0], 2, dtype=torch.float64) for s in layer if len(s) == 2]

    def sample():
        parts = []
        for s in layer * 4:
            if len(s) == 2:
                u = us[0] if s[0] == 24 else us[1]
                parts.append((u @ torch.randn(2, s[1], dtype=torch.float64)).view(-1))
            else:
                parts.append(torch.randn(s, dtype=torch.float64))
        return torch.cat(parts)

    codecs = [make(name, rank=2) for _ in range(3)]
    with contextlib.ExitStack() as stack:
        if not kernels:
            stack.enter_context(native.disabled())
        for _ in range(4):  # PowerSGD: exact every step; ACP-SGD: on the steps it holds a P (odd ones)
            xs = [sample() for _ in codecs]
            results, local = exchange(codecs, xs, shapes=shapes)
    torch.testing.assert_close(results[0], torch.stack(xs).mean(0))
    for r in range(3):
        assert torch.equal(results[r], results[0])


def test_powersgd_payload_sizes():
    c = make("powersgd", rank=2)
    shapes = [torch.Size([256, 128]), torch.Size([128]), torch.Size([4, 4])]
    x = torch.randn(256 * 128 + 128 + 16)
    (p,), ctx = c.compress(x, "g", shapes)
    assert p.numel() == 256 * 2 + 128 + 16  # P of the big matrix, then the raw elements
    (q,), _ = c.next_round((p,), ctx)
    assert q.numel() == 128 * 2
    assert (p.numel() + q.numel()) / x.numel() < 1 / 30


def test_powersgd_raw_paths_are_exact():
    c = make("powersgd")
    x = torch.randn(100)
    local, result = roundtrip(c, x)  # shapes None: one 1-D tensor, sent raw
    assert torch.equal(result, x) and torch.equal(local, x)
    assert bits_per_element(c, 100) == 32
    # 4x4 at rank 1: (4 + 4) * 1 * 2 >= 16, not worth compressing
    (p,), ctx = c.compress(x[:16], "h", [torch.Size([4, 4])])
    assert p.numel() == 16
    (q,), ctx = c.next_round((p,), ctx)
    assert q.numel() == 0
    assert torch.equal(c.aggregate([(q,)], ctx, 1, False), x[:16])


def test_powersgd_three_ranks_local_and_summed():
    u = torch.randn(30, 2, dtype=torch.float64)
    shapes = [torch.Size([30, 20]), torch.Size([5])]
    xs = [torch.cat([(u @ torch.randn(2, 20, dtype=torch.float64)).view(-1),
                     torch.randn(5, dtype=torch.float64)]) for _ in range(3)]
    results, local = exchange([make("powersgd", rank=2) for _ in xs], xs, shapes=shapes)
    torch.testing.assert_close(results[0], torch.stack(xs).mean(0))  # shared column space
    for r in range(3):
        assert torch.equal(results[r], results[0])
        torch.testing.assert_close(local[r], xs[r])  # this rank's own part, own raw elements


def test_powersgd_warm_start_converges_to_best_rank_one():
    u, _ = torch.linalg.qr(torch.randn(40, 5, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 5, dtype=torch.float64))
    m = u @ torch.diag(torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5], dtype=torch.float64)) @ v.T
    c = make("powersgd", rank=1)
    for _ in range(25):
        _, result = roundtrip(c, m.reshape(-1).clone(), shapes=[m.shape])
    best = math.sqrt(5.0 ** 2 + 2.0 ** 2 + 1.0 ** 2 + 0.5 ** 2)
    assert (result.view(40, 30) - m).norm() <= best * (1 + 1e-6)


def test_powersgd_without_warm_start_draws_new_q():
    c = make("powersgd", warm_start=False)
    x = torch.randn(20 * 30)
    shapes = [torch.Size([20, 30])]
    (p1,), _ = c.compress(x, "g", shapes)
    (p2,), _ = c.compress(x, "g", shapes)
    assert "q" not in c.state["g"] and int(c.state["g"]["step"]) == 2
    assert not torch.equal(p1, p2)
    (p3,), _ = make("powersgd", warm_start=False).compress(x, "g", shapes)
    assert torch.equal(p1, p3)  # the same draw on every rank


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("kernels", [True, False], ids=["native", "torch"])
def test_powersgd_residual_written_in_one_pass_is_compensated_less_own_decode(rank, kernels):
    """The residual memory lets PowerSGD subtract its own decode as it writes it: the residual is
    the compensated group less ``decompress`` of this rank's payload, raw runs included, as the
    decode-then-subtract path leaves it (bit for bit at rank 1)."""
    shapes = [torch.Size([64, 48]), torch.Size([48]), torch.Size([32, 3, 3, 3]), torch.Size([7])]
    x = torch.randn(sum(math.prod(s) for s in shapes))
    c, direct, plain = make("powersgd", rank=rank), mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    with contextlib.ExitStack() as stack:
        if not kernels:
            stack.enter_context(native.disabled())
        payload, ctx = c.next_round(*c.compress(x, "g", shapes))
        assert feed(direct, c, x, "g", [(payload, ctx, 0)]) == c.passes.subtract_decoded == 1
        plain.update(x, "g", c.decompress(payload, ctx))  # decode, then subtract
        expected = x - c.decompress(payload, ctx)
    residual = direct.state["g"]["residual"]
    if rank == 1:
        assert torch.equal(residual, plain.state["g"]["residual"])
    torch.testing.assert_close(residual, expected, rtol=1e-5, atol=1e-5)
    assert not residual[64 * 48:64 * 48 + 48].any()  # a raw run goes out exactly


def test_powersgd_low_precision_residual_takes_the_decode_then_subtract_path():
    c, memory = make("powersgd"), mergecomp.get_memory("residual")
    x = low_rank(16, 12, 1, torch.float32).to(torch.float16).view(-1)
    payload, ctx = c.next_round(*c.compress(x, "g", [torch.Size([16, 12])]))
    assert not c.subtract_decoded(payload, ctx, x, lambda: pytest.fail("no buffer asked for"))
    assert feed(memory, c, x, "g", [(payload, ctx, 0)]) == c.passes.decompress + memory.passes.update
    assert torch.equal(memory.state["g"]["residual"], x - c.decompress(payload, ctx))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_powersgd_low_precision(dtype):
    x = low_rank(16, 12, 1, torch.float32).to(dtype).view(-1)
    local, result = roundtrip(make("powersgd"), x, shapes=[torch.Size([16, 12])])
    assert result.dtype == dtype and local.dtype == dtype
    torch.testing.assert_close(result.float(), x.float(), rtol=0.05, atol=0.05 * x.float().abs().max().item())


def test_powersgd_bf16_factors_halve_the_wire_and_keep_their_rounding_in_the_memory():
    """``factor_dtype="bf16"``: both rounds in bf16 (half the bits of fp32 factors); this
    rank's decode is of its rounded ``Q`` and raw elements, so the residual holds the rounding,
    on the one-pass and the decode-then-subtract route alike."""
    shapes = [torch.Size([64, 48]), torch.Size([48]), torch.Size([32, 40])]
    numel = sum(math.prod(s) for s in shapes)
    assert bits_per_element(make("powersgd", rank=4, factor_dtype="bf16"), numel, shapes=shapes) == \
        bits_per_element(make("powersgd", rank=4), numel, shapes=shapes) / 2
    x = torch.cat([low_rank(64, 48, 2, torch.float32).view(-1), torch.randn(48) * 1e-3,
                   low_rank(32, 40, 2, torch.float32).view(-1)])
    c = make("powersgd", rank=2, factor_dtype="bf16")
    (p,), ctx = c.compress(x, "g", shapes)
    (q,), ctx = c.next_round((p,), ctx)
    assert p.dtype == q.dtype == torch.bfloat16
    raw = slice(64 * 48, 64 * 48 + 48)
    local = c.decompress((q,), ctx)
    assert local.dtype == torch.float32 and torch.equal(local[raw], x[raw].bfloat16().float())
    assert not torch.equal(local[raw], x[raw])  # the rounding is this rank's decode
    assert (local - x).norm() < 0.05 * x.norm()  # exact but for bf16's rounding (fp32: see above)
    direct, plain = mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    assert feed(direct, c, x, "g", [((q,), ctx, 0)]) == c.passes.subtract_decoded
    plain.update(x, "g", local)
    torch.testing.assert_close(direct.state["g"]["residual"], x - local, rtol=0, atol=1e-6)
    assert direct.state["g"]["residual"][raw].abs().max() > 0
    summed = c.aggregate([(q,)], ctx, 1, False)
    assert summed.dtype == torch.float32 and torch.equal(summed, local)


def test_powersgd_factor_dtype_named_when_bad():
    for bad in ("fp16", "fp8", torch.bfloat16):
        with pytest.raises(ValueError, match="factor_dtype"):
            make("powersgd", factor_dtype=bad)


def test_powersgd_shapes_must_match():
    with pytest.raises(ValueError, match="shapes"):
        make("powersgd").compress(torch.randn(10), "g", [torch.Size([3, 3])])


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_compressors_refuse_a_group_that_is_not_flat_and_contiguous(name):
    with pytest.raises(ValueError, match="flat contiguous group"):
        make(name).compress(torch.randn(2 * 24 * 20)[::2], "g", [torch.Size([24, 20])])


# -- ACP-SGD ---------------------------------------------------------------------------------
def test_acpsgd_alternates_its_factors_and_is_exact_for_low_rank_once_it_holds_one():
    """Step 0 sends ``P = M Q`` for the drawn ``Q``, step 1 ``Q = M^T P`` for the summed ``P``:
    from then on a rank-2 matrix (and the raw elements) arrive exactly."""
    c = make("acpsgd", rank=2)
    shapes = [torch.Size([32, 24]), torch.Size([10])]
    x = torch.cat([low_rank(32, 24, 2).view(-1), torch.randn(10, dtype=torch.float64)])
    sizes = []
    for step in range(4):
        (payload,), ctx = c.compress(x, "g", shapes)
        sizes.append(payload.numel())
        local = c.decompress((payload,), ctx)
        result = c.aggregate([(payload,)], ctx, 1, False)
        assert torch.equal(local, result)  # one rank: its own decode is the sum's
        if step:
            torch.testing.assert_close(result, x)
    assert sizes == [32 * 2 + 10, 24 * 2 + 10] * 2
    assert not c.state["g"]["holds_p"] and c.state["g"]["factor"].shape == (24 * 2,)


def test_acpsgd_three_ranks_average_a_shared_column_space_identically():
    u = torch.randn(30, 2, dtype=torch.float64)
    shapes = [torch.Size([30, 20]), torch.Size([5])]
    compressors = [make("acpsgd", rank=2) for _ in range(3)]
    for step in range(3):
        xs = [torch.cat([(u @ torch.randn(2, 20, dtype=torch.float64)).view(-1),
                         torch.randn(5, dtype=torch.float64)]) for _ in range(3)]
        results, local = exchange(compressors, xs, shapes=shapes)
        assert all(torch.equal(r, results[0]) for r in results)
        assert all(torch.equal(c.state["g"]["factor"], compressors[0].state["g"]["factor"]) for c in compressors)
        if not compressors[0].state["g"]["holds_p"]:  # this step sent Q for the held P: u's space
            torch.testing.assert_close(results[0], torch.stack(xs).mean(0))
            for r in range(3):
                torch.testing.assert_close(local[r], xs[r])


def test_acpsgd_costs_powersgd_of_half_its_rank_and_halves_again_in_bf16():
    shapes = [torch.Size([64, 48]), torch.Size([48]), torch.Size([32, 96])]
    numel = sum(math.prod(s) for s in shapes)
    acp = bits_per_element(make("acpsgd", rank=4), numel, shapes=shapes)
    assert acp == bits_per_element(make("powersgd", rank=2), numel, shapes=shapes)
    assert bits_per_element(make("acpsgd", rank=4, factor_dtype="bf16"), numel, shapes=shapes) == acp / 2


@pytest.mark.parametrize("factor_dtype", [None, "bf16"])
@pytest.mark.parametrize("kernels", [True, False], ids=["native", "torch"])
def test_acpsgd_residual_in_one_pass_is_compensated_less_own_decode_in_both_phases(factor_dtype, kernels):
    shapes = [torch.Size([64, 48]), torch.Size([48]), torch.Size([32, 3, 3, 3]), torch.Size([7])]
    x = torch.randn(sum(math.prod(s) for s in shapes))
    c = make("acpsgd", rank=3, factor_dtype=factor_dtype)
    with contextlib.ExitStack() as stack:
        if not kernels:
            stack.enter_context(native.disabled())
        for _ in range(2):  # holding Q, then P
            direct = mergecomp.get_memory("residual")
            payload, ctx = c.compress(x, "g", shapes)
            assert feed(direct, c, x, "g", [(payload, ctx, 0)]) == c.passes.subtract_decoded
            expected = x - c.decompress(payload, ctx)
            torch.testing.assert_close(direct.state["g"]["residual"], expected, rtol=1e-5, atol=1e-5)
            raw = direct.state["g"]["residual"][64 * 48:64 * 48 + 48]
            assert raw.any() == (factor_dtype == "bf16")  # a raw run's only loss: bf16's rounding
            c.aggregate([payload], ctx, 1, True)


def test_acpsgd_starts_afresh_when_its_group_changes_layout():
    c = make("acpsgd", rank=2)
    x = torch.randn(20 * 30)
    for _ in range(3):
        (payload,), ctx = c.compress(x, "g", [torch.Size([20, 30])])
        c.aggregate([(payload,)], ctx, 1, True)
    (payload,), ctx = c.compress(x, "g", [torch.Size([30, 20])])  # same numel, other matrix
    assert ctx.holds == "q" and payload.numel() == 30 * 2


def test_acpsgd_bad_options_named():
    for kwargs, option in (({"rank": 0}, "rank"), ({"factor_dtype": "fp16"}, "factor_dtype"),
                           ({"min_compression_rate": -1}, "min_compression_rate")):
        with pytest.raises(ValueError, match=option):
            make("acpsgd", **kwargs)


# -- bits on the wire ------------------------------------------------------------------------
N_BITS = 2 ** 16
K = num_selected(N_BITS, 0.01)


@pytest.mark.parametrize("name, kwargs, nominal, exact", [
    ("none", {}, 32, 32),
    ("fp16", {}, 16, 16),
    ("bf16", {}, 16, 16),
    ("signsgd", {}, 1, 1),
    ("signum", {}, 1, 1),
    ("efsignsgd", {}, 1, 1 + 32 / N_BITS),
    ("onebit", {}, 1, 1 + 64 / N_BITS),
    ("terngrad", {}, 2, 2 + 32 / N_BITS),
    ("terngrad", {"packing": "base3"}, 1.6, 8 * -(-N_BITS // 5) / N_BITS + 32 / N_BITS),
    ("qsgd", {}, 8 + 32 / 512, 8 + 32 / 512),
    ("qsgd", {"bucket_size": None}, 8, 8 + 32 / N_BITS),
    ("qsgd", {"levels": 7}, 4 + 32 / 512, 4 + 32 / 512),
    ("topk", {"ratio": 0.01}, 64 * 0.01, 64 * K / N_BITS),
    ("topk", {"ratio": 0.01, "value_dtype": "fp16"}, 48 * 0.01, 48 * K / N_BITS),
    ("dgc", {"ratio": 0.01}, 64 * 0.01, 64 * K / N_BITS),
    ("randk", {"ratio": 0.01}, 32 * 0.01, 32 * K / N_BITS),
    ("powersgd", {}, 32, 32),  # no shapes: one 1-D tensor, sent raw
])
def test_bits_per_element(name, kwargs, nominal, exact):
    c = make(name, **kwargs)
    bits = bits_per_element(c, N_BITS)
    assert bits == pytest.approx(exact)
    assert bits == pytest.approx(nominal, rel=0.01)
    assert "__probe__" not in c.state


# -- hyperparameter validation ---------------------------------------------------------------
@pytest.mark.parametrize("name, kwargs, option", [
    ("fp16", {"prescale": 0}, "prescale"),
    ("topk", {"ratio": 0}, "ratio"),
    ("topk", {"ratio": 1.5}, "ratio"),
    ("topk", {"selection": "random"}, "selection"),
    ("topk", {"value_dtype": "fp8"}, "value_dtype"),
    ("dgc", {"ratio": -0.1}, "ratio"),
    ("randk", {"ratio": 0}, "ratio"),
    ("randk", {"unbiased": "yes"}, "unbiased"),
    ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 128}, "levels"),
    ("qsgd", {"levels": 2.5}, "levels"),
    ("qsgd", {"bucket_size": 0}, "bucket_size"),
    ("terngrad", {"clip": 0}, "clip"),
    ("terngrad", {"clip": -1.0}, "clip"),
    ("terngrad", {"packing": "3bit"}, "packing"),
    ("signum", {"beta": 1.0}, "beta"),
    ("signum", {"beta": -0.1}, "beta"),
    ("powersgd", {"rank": 0}, "rank"),
    ("powersgd", {"rank": 1.5}, "rank"),
    ("powersgd", {"min_compression_rate": -1}, "min_compression_rate"),
    ("powersgd", {"warm_start": None}, "warm_start"),
])
def test_bad_hyperparameters(name, kwargs, option):
    with pytest.raises(ValueError, match=option):
        make(name, **kwargs)


# -- error feedback --------------------------------------------------------------------------
EF_CASES = {
    "topk": ({"ratio": 0.1}, None, 0.1),
    "randk": ({"ratio": 0.1}, None, 0.1),
    "onebit": ({}, None, 0.3),
    "efsignsgd": ({}, None, 0.3),
    "powersgd": ({"rank": 1}, [torch.Size([12, 20]), torch.Size([60])], 1 / 12),
}


@pytest.mark.parametrize("name", sorted(EF_CASES))
def test_error_feedback_conserves_the_gradient(name):
    kwargs, shapes, delta = EF_CASES[name]
    n, steps = 300, 200
    c, memory = make(name, **kwargs), mergecomp.get_memory("residual")
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    norms, largest = [], 0.0
    for _ in range(steps):
        grad = torch.randn(n, dtype=torch.float64)
        total += grad
        x = memory.compensate(grad.clone(), "g")
        _, local = exchange([c], [x], shapes=shapes)
        memory.update(x, "g", local[0])
        sent += local[0]
        residual = memory.state["g"]["residual"]
        norms.append(residual.norm().item())
        largest = max(largest, grad.norm().item())
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-9 * steps)
    # a delta-contraction keeps ||e|| below sqrt(1 - delta) / (1 - sqrt(1 - delta)) * max ||g||
    shrink = math.sqrt(1 - delta)
    assert max(norms) <= shrink / (1 - shrink) * largest
    # not growing (an unbounded random walk would grow by sqrt(175 / 75) ~ 1.5 here)
    assert sum(norms[-50:]) / 50 <= 1.25 * sum(norms[50:100]) / 50


def test_averaged_memory_feeds_back_a_moving_average_of_the_errors_and_clears_it():
    """error = decay * error + (1 - decay) * (compensated - sent); after reset_every updates the
    next step starts from no error."""
    memory = mergecomp.get_memory("averaged", decay=0.75, reset_every=3)
    grad = torch.tensor([1.0, -2.0, 4.0, 8.0])
    error = torch.zeros(4)
    for step in range(7):
        if step % 3 == 0:
            error = torch.zeros(4)  # cleared: steps 0, 3, 6
        x = memory.compensate(grad.clone(), "g")
        assert torch.equal(x, grad + error), step
        sent = torch.where(x.abs() >= 4, x, torch.zeros(4))
        memory.update(x, "g", sent)
        error = 0.75 * error + 0.25 * (x - sent)
        assert torch.allclose(memory.state["g"]["error"], error), step
    assert int(memory.state["g"]["updates"]) == 1


def test_averaged_memory_without_decay_or_clearing_is_the_residual_memory():
    averaged, residual = mergecomp.get_memory("averaged", decay=0.0, reset_every=0), mergecomp.get_memory("residual")
    compressor = make("topk", ratio=0.1, selection="exact")
    for step in range(6):
        grad = torch.randn(300, generator=torch.Generator().manual_seed(step))
        xa, xr = averaged.compensate(grad.clone(), "g"), residual.compensate(grad.clone(), "g")
        assert torch.equal(xa, xr), step
        payload, ctx = compressor.compress(xa, "g")
        sent = compressor.decompress(payload, ctx)
        averaged.update(xa, "g", sent)
        residual.update(xr, "g", sent)


def test_averaged_memory_lossless_steps_only_decay_the_error_and_it_resumes_from_a_checkpoint():
    memory = mergecomp.get_memory("averaged", decay=0.5, reset_every=4)
    x = memory.compensate(torch.ones(5), "g")
    memory.update(x, "g", torch.zeros(5))
    assert memory.sent_whole("g")
    assert torch.equal(memory.state["g"]["error"], torch.full((5,), 0.25))
    resumed = mergecomp.get_memory("averaged", decay=0.5, reset_every=4)
    resumed.load_state_dict(memory.state_dict())
    for m in (memory, resumed):
        for _ in range(2):  # updates 3 and 4; the fifth step starts from no error
            m.update(m.compensate(torch.ones(5), "g"), "g", torch.zeros(5))
    assert torch.equal(memory.state["g"]["error"], resumed.state["g"]["error"])
    assert torch.equal(resumed.compensate(torch.ones(5), "g"), torch.ones(5))


@pytest.mark.parametrize("kwargs, message", [({"decay": 1.0}, "decay must be in"), ({"decay": -0.1}, "decay must be in"),
                                             ({"reset_every": -1}, "reset_every must be"),
                                             ({"reset_every": 2.5}, "reset_every must be")])
def test_averaged_memory_rejects_bad_settings_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mergecomp.get_memory("averaged", **kwargs)


@pytest.mark.parametrize("memory_name", ["residual", "dgc", "averaged"])
@pytest.mark.parametrize("name, kwargs", [("topk", {}), ("dgc", {}), ("randk", {}),
                                          ("randk", {"unbiased": True}), ("fp16", {})])
def test_sparse_memory_update_matches_the_dense_one(name, kwargs, memory_name):
    """Memory.update_sparse (used where the codec's sent_entries are not None) leaves the same
    state as update() with the dense decode, step after step (the averaged memory: up to rounding)."""
    n = 5000
    def build():
        return make(name) if name == "fp16" else make(name, ratio=0.05, **kwargs)

    def same(a, b):  # the averaged memory scales the k sent entries apart: equal up to rounding
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6) if memory_name == "averaged" else torch.equal(a, b)

    sparse_c, dense_c = build(), build()
    sparse_m, dense_m = mergecomp.get_memory(memory_name), mergecomp.get_memory(memory_name)
    for step in range(5):
        grad = torch.randn(n)
        xs = sparse_m.compensate(grad.clone(), "g")
        xd = dense_m.compensate(grad.clone(), "g")
        assert same(xs, xd)
        payload, ctx = sparse_c.compress(xs, "g")
        dense_payload, dense_ctx = dense_c.compress(xd, "g")
        entries = sparse_c.sent_entries(payload, ctx) if isinstance(sparse_c, SparseEntries) else None
        if name == "fp16" or kwargs.get("unbiased"):
            assert entries is None
            continue
        sparse_m.update_sparse(xs, "g", *entries)
        dense_m.update(xd, "g", dense_c.decompress(dense_payload, dense_ctx))
        for field, value in dense_m.state["g"].items():
            assert same(sparse_m.state["g"][field], value), (step, field)


# -- the fused encode with the residual memory (FusedEncode.compress_fused) --------------------
SIGN_VALUE = ["onebit", "efsignsgd"]
#: the compressors with a fused encode with the residual memory (top-k and DGC by their threshold)
FUSED = [*SIGN_VALUE, "topk", "dgc"]


def plain_encode(c, memory, grad, name="g"):
    """The exchange's route without the fused encode: compensate, compress, feed."""
    compensated = memory.compensate(grad, name)
    payload, ctx = c.compress(compensated, name)
    feed(memory, c, compensated, name, [(payload, ctx, 0)])
    return payload


def encode(c, memory, grad, codec_path, name="g"):
    """As the exchange encodes: by the fused encode where it is offered (on the native path
    only, which is checked), its update run; else by compensate, compress, feed."""
    encoded = fused(c, memory, grad, name)
    assert (encoded is None) == (codec_path == "eager")
    if encoded is None:
        return plain_encode(c, memory, grad, name)
    payload, _, update = encoded
    update()
    return payload


def fused_matches_plain(pair, plain, grad, codec_path):
    """One step of ``grad`` by :func:`encode` on ``pair`` and by :func:`plain_encode` on
    ``plain`` (each a ``(compressor, memory)``): the payload, checked equal to the plain route's
    with the gradient left unwritten; None on the eager path (no fused encode to compare)."""
    given = grad.clone()
    payload = encode(*pair, given, codec_path)
    if codec_path == "eager":
        return None
    expected = plain_encode(*plain, grad.clone())
    assert torch.equal(given, grad)  # the gradient is not written
    assert all(torch.equal(a, b) for a, b in zip(payload, expected))
    return payload


@pytest.mark.parametrize("name", SIGN_VALUE)
def test_sign_scales_of_values_near_the_fp32_limit_are_finite(name):
    """Sides summing past fp32's largest value (a gradient under a huge loss scale) still give
    the finite scale or means their values have."""
    x = torch.full((1000,), 3e38)
    x[::2] = -3e38
    payload, _ = make(name).compress(x, "g")
    assert torch.isfinite(payload[1]).all() and torch.allclose(payload[1].abs(), torch.tensor(3e38)), payload[1]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000, 100_003])
@pytest.mark.parametrize("name", SIGN_VALUE)
def test_fused_encode_matches_compensate_compress_feed_bit_for_bit(name, n, codec_path):
    fused_c, plain_c = make(name), make(name)
    fused_m, plain_m = mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    for step in range(3):  # the first without a residual
        if fused_matches_plain((fused_c, fused_m), (plain_c, plain_m), torch.randn(n) * (step + 1), codec_path) is None:
            return  # eager: plain_encode on both sides
        assert torch.equal(fused_m.state_dict()["g"]["residual"], plain_m.state["g"]["residual"]), step


@pytest.mark.parametrize("n, ratio, capacity", [
    (1, 0.01, None), (2, 0.01, None), (1000, 0.01, None), (100_003, 0.01, None),
    (1_000_000, 0.1, None),  # the sampled threshold leaves fewer than k candidates
    (100_003, 0.01, 1),      # more candidates than the scan kept aside
])
@pytest.mark.parametrize("value_dtype", [None, "fp16"])
def test_topk_fused_encode_matches_compensate_compress_feed_bit_for_bit(n, ratio, capacity, value_dtype, codec_path,
                                                                        monkeypatch):
    """The one-pass scan of gradient + residual gives top-k's payload and residual bit for bit,
    in its usual case and in both fallbacks (the candidates too few, or more than it kept); with
    fp16 values the residual keeps their rounding on both routes."""
    import mergecomp.compressors.topk as topk_module

    if capacity is not None:
        monkeypatch.setattr(topk_module, "candidate_capacity", lambda k: capacity)
    fused_c, plain_c = (make("topk", ratio=ratio, value_dtype=value_dtype) for _ in range(2))
    fused_m, plain_m = mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    for step in range(3):  # the first without a residual
        grad = torch.randn(n) * (step + 1)
        if ratio == 0.1:  # the sampled elements are the largest: a threshold too high
            grad[::61] = 100.0 * (step + 1)
        given = grad.clone()
        encoded = fused(fused_c, fused_m, given, "g")
        assert (encoded is None) == (codec_path == "eager" or n == 1), (n, codec_path)  # k = n: all sent
        if encoded is None:
            return
        payload, _, update = encoded
        update()
        expected = plain_encode(plain_c, plain_m, grad.clone())
        assert torch.equal(given, grad)  # the gradient is not written
        assert all(torch.equal(a, b) for a, b in zip(payload, expected)), step
        assert torch.equal(fused_m.state["g"]["residual"], plain_m.state["g"]["residual"]), step


@pytest.mark.parametrize("shape", ["matrix", "mostly zeros"])
def test_topk_fused_encode_needs_no_second_scan_on_matrices_and_sparse_groups(shape, codec_path, monkeypatch):
    """The threshold's sample meets every column of a matrix whose columns differ in size (a
    stride sharing a factor with the row length saw a few of them and kept half the elements as
    candidates), and a group with fewer nonzeros than k (a position embedding a batch barely
    uses) takes its nonzeros and the first zeros: neither falls back to a second full scan, and
    both give the plain route's payload and residual bit for bit."""
    import mergecomp.compressors.topk as topk_module

    rescans = []
    select = topk_module.TopKCompressor.select
    monkeypatch.setattr(topk_module.TopKCompressor, "select",
                        lambda self, tensor, k, name: rescans.append(self) or select(self, tensor, k, name))
    g = torch.Generator().manual_seed(0)
    rows, columns = 20000, 64  # k = 12,800: a sample of 20,000 taken every n // 20,000 = 64 elements: one column
    fused_c, plain_c = make("topk"), make("topk")
    fused_m, plain_m = mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    for step in range(3):
        if shape == "matrix":  # column j about j times the size of column 1, column 0 tiny
            grad = (torch.randn(rows, columns, generator=g) * torch.arange(columns).clamp(min=1e-3)).flatten()
        else:
            grad = torch.zeros(rows * columns)
            grad[:300] = torch.randn(300, generator=g)  # 300 nonzeros
        if codec_path == "eager":
            return
        payload = fused_matches_plain((fused_c, fused_m), (plain_c, plain_m), grad, codec_path)
        assert payload is not None
        assert torch.equal(fused_m.state["g"]["residual"], plain_m.state["g"]["residual"]), step
    assert fused_c not in rescans  # the plain route selects by itself; the fused one never fell back


@pytest.mark.parametrize("n", [2, 1000, 100_003])
@pytest.mark.parametrize("name", ["dgc", "topk"])
def test_fused_encode_with_dgc_memory_matches_compensate_compress_feed_bit_for_bit(name, n, codec_path):
    """With DGC's memory the one pass also applies the momentum correction: payload, velocity
    and momentum (masked where values went out) bit for bit those of the plain route, also
    for a kept group rolled back and encoded again."""
    fused_c, plain_c = make(name), make(name)
    fused_m, plain_m = mergecomp.get_memory("dgc"), mergecomp.get_memory("dgc")
    for step in range(4):  # the first with zero momentum and velocity
        grad = torch.randn(n) * (step + 1)
        if step == 2:
            kept = fused_m.keep("g"), plain_m.keep("g")
            encode(fused_c, fused_m, grad.clone(), codec_path)
            plain_encode(plain_c, plain_m, grad.clone())
            fused_m.restore("g", kept[0])
            plain_m.restore("g", kept[1])
        payload = fused_matches_plain((fused_c, fused_m), (plain_c, plain_m), grad, codec_path)
        if payload is None:
            return  # eager: plain_encode on both sides
        for field in ("momentum", "velocity"):
            assert torch.equal(fused_m.state["g"][field], plain_m.state["g"][field]), (step, field)
        assert (fused_m.state["g"]["momentum"] == 0).sum() >= (payload[0] != 0).sum()


@pytest.mark.parametrize("name", FUSED)
def test_fused_encode_of_a_kept_group_keeps_the_old_residual_for_rollback(name, codec_path):
    c, memory = make(name), mergecomp.get_memory("residual")
    plain_c, plain_m = make(name), mergecomp.get_memory("residual")
    for seed in range(2):
        grad = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        encode(c, memory, grad.clone(), codec_path)
        plain_encode(plain_c, plain_m, grad.clone())
    before = memory.state["g"]["residual"]
    saved = before.clone()
    kept = memory.keep("g")
    encode(c, memory, torch.randn(1000), codec_path)
    if codec_path == "native":
        assert memory.state["g"]["residual"] is not before and torch.equal(before, saved)
    memory.restore("g", kept)
    assert memory.state["g"]["residual"] is before and torch.equal(before, saved)
    grad = torch.randn(1000)  # afterwards, as if the rolled-back step had never happened
    payload = encode(c, memory, grad.clone(), codec_path)
    assert all(torch.equal(a, b) for a, b in zip(payload, plain_encode(plain_c, plain_m, grad.clone())))
    assert torch.equal(memory.state_dict()["g"]["residual"], plain_m.state["g"]["residual"])


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("name", SIGN_VALUE)
def test_a_carried_residual_reads_the_same_by_every_other_route(name, kept, codec_path):
    """After the sign codes' fused encode the memory holds the compensated gradient and the two
    decoded values; compensate (another codec's route), top-k's fused encode, state_dict and a
    save / load read the residual that compensate, compress and feed leave, bit for bit, and a
    kept group's old buffer stays as it was."""
    fused_c, plain_c = make(name), make(name)
    fused_m, plain_m = mergecomp.get_memory("residual"), mergecomp.get_memory("residual")
    for step in range(2):
        grad = torch.randn(1000) * (step + 1)
        encode(fused_c, fused_m, grad.clone(), codec_path)
        plain_encode(plain_c, plain_m, grad.clone())
    expected = plain_m.state["g"]["residual"].clone()
    assert ("sides" in fused_m.state["g"]) == (codec_path == "native")
    assert torch.equal(fused_m.state_dict()["g"]["residual"], expected)
    resumed = mergecomp.get_memory("residual")
    resumed.load_state_dict(fused_m.state_dict())
    grad = torch.randn(1000)
    assert torch.equal(resumed.compensate(grad.clone(), "g"), grad + expected)
    buffer, saved = fused_m.state["g"]["residual"], fused_m.state["g"]["residual"].clone()
    kept_state = fused_m.keep("g") if kept else None
    assert torch.equal(fused_m.compensate(grad.clone(), "g"), grad + expected)
    assert "sides" not in fused_m.state["g"]
    if kept:
        assert torch.equal(buffer, saved)
        fused_m.restore("g", kept_state)
        assert fused_m.state["g"]["residual"] is buffer
        assert torch.equal(fused_m.state_dict()["g"]["residual"], expected)
    # top-k's fused encode on the same memory sees the plain residual
    topk_m = mergecomp.get_memory("residual")
    topk_m.load_state_dict({"g": {"residual": expected.clone()}})
    payload = encode(make("topk"), fused_m, grad.clone(), codec_path)
    assert all(torch.equal(a, b) for a, b in zip(payload, encode(make("topk"), topk_m, grad.clone(), codec_path)))


def test_fused_encode_only_with_the_plain_residual_and_dgc_memories():
    from mergecomp.compressors.memories import DGCMemory, ResidualMemory

    class Recording(ResidualMemory):
        def compensate(self, tensor, name):
            return super().compensate(tensor, name)

    class RecordingDGC(DGCMemory):
        def update_sparse(self, compensated, name, indices, values):
            return super().update_sparse(compensated, name, indices, values)

    grad = torch.randn(100)
    for memory in [mergecomp.get_memory("none"), mergecomp.get_memory("dgc"), ResidualMemory(beta=0.5),
                   ResidualMemory(gamma=2.0), Recording()]:
        assert fused(make("onebit"), memory, grad, "g") is None, memory
    for memory in [mergecomp.get_memory("none"), ResidualMemory(beta=0.5), ResidualMemory(gamma=2.0), Recording(),
                   RecordingDGC()]:
        assert fused(make("topk"), memory, grad, "g") is None, memory
    assert fused(make("topk", selection="exact"), mergecomp.get_memory("residual"), grad, "g") is None
    for name in ALL:
        if name not in FUSED:
            assert fused(make(name), mergecomp.get_memory("residual"), grad, "g") is None, name


@pytest.mark.parametrize("name, memory_name", [*((name, "residual") for name in FUSED), ("dgc", "dgc")])
def test_training_through_merged_step_with_the_fused_encode_equals_the_plain_route(name, memory_name, codec_path,
                                                                                 monkeypatch):
    """A small model trained 4 steps through MergedStep (one rank, 2 groups, the residual memory,
    a kept state for the propagate policy): parameters and residuals bit for bit the same with
    the fused encode of each whole group as with compensate, compress and feed (the encode of
    each gradient as it arrives: tests/test_step.py)."""
    from steps import planned

    from mergecomp.compressors.base.sign_value import SignValueCompressor
    from mergecomp.compressors.memories import DGCMemory, ResidualMemory
    from mergecomp.compressors.topk import TopKCompressor
    from mergecomp.engines.communicator import LocalCommunicator

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        names, params = zip(*model.named_parameters())
        step = planned(name, memory_name, LocalCommunicator(), names, [p.shape for p in params],
                       [p.dtype for p in params], groups=2, nonfinite="propagate")
        x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
        for _ in range(4):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for i, p in enumerate(params):
                step.add(i, p.grad)
                p.grad = None
            with torch.no_grad():
                for p, g in zip(params, step.finish().tensors(len(params))):
                    p.sub_(0.1 * g)
        memory = step.exchange.memory.state_dict()
        return [p.detach().clone() for p in params] + [t for g in sorted(memory) for _, t in sorted(memory[g].items())]

    declined = lambda *args: None  # noqa: E731  (no fused encode offered)
    monkeypatch.setattr(SignValueCompressor, "compress_fused_parts", declined)
    with monkeypatch.context() as patch:
        if codec_path == "native":  # the fused encode's update stands in for the memory's
            memory_class = ResidualMemory if memory_name == "residual" else DGCMemory
            patch.setattr(memory_class, "update", None)
            patch.setattr(memory_class, "update_sparse", None)
        with_fused = train()
    monkeypatch.setattr(SignValueCompressor, "compress_fused", declined)
    monkeypatch.setattr(TopKCompressor, "compress_fused", declined)
    plain = train()
    assert len(with_fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(with_fused, plain))
