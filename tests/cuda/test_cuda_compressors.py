"""Every registered compressor on CUDA tensors against the same work on the CPU: encode, the
decode of one's own payload, and the aggregate of three ranks' payloads (summed or gathered as
the pipeline moves them), for fp32, fp16 and bf16 groups of 0, 1, 7 and 1001 elements and one
large fp32 group.

What "the same" means depends on the algorithm (:mod:`cuda_support`): bit for bit for
elementwise codes and CPU-drawn indices; to rounding where a sum over the group, a matrix
product or a QR runs on each device; for stochastic rounding, where each device draws its own
numbers, the deterministic parts to rounding, every code a neighbour of its value, and the
decodes unbiased (their mean over many encodes within six standard errors of the input), and
the same payload again under the same seed.
"""
import pytest
import torch
from cuda_support import (BITWISE, DEVICE, DTYPES, LOW_RANK, NUMELS, ROUNDING, SELECTING, SIGN_SCALES, STOCHASTIC,
                          assert_close, bits, distinct, on_device)
from test_compressors import finish, run_rounds

import mergecomp
from mergecomp.kernels import bitpack

pytestmark = pytest.mark.cuda

NAMES = mergecomp.compressor_names()
RANKS = 3
#: a group large enough for top-k's sampled threshold (a stride over the group) and many buckets
LARGE = 100_003
#: low-rank results, relative to their largest magnitude
LOW_RANK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
#: the matrices (and a vector sent raw) of a PowerSGD group
MATRIX_SHAPES = [torch.Size([33, 31]), torch.Size([7]), torch.Size([16, 3, 3, 3])]


def steps(name, xs, shapes=None, compressors=None):
    """The compressors (one per rank; new ones unless given) and each rank's last-round
    ``(payload, ctx)`` for its input."""
    compressors = compressors or [mergecomp.get_compressor(name) for _ in xs]
    return compressors, run_rounds(compressors, xs, shapes=shapes)


def check_payload(name, cpu, gpu, x):
    """One rank's payload on each device (``x``: its input, on the CPU)."""
    assert [(t.dtype, t.shape) for t in cpu] == [(t.dtype, t.shape) for t in gpu]
    if name in BITWISE:
        for a, b in zip(cpu, gpu):
            assert torch.equal(bits(a), bits(b))
    elif name in SIGN_SCALES:
        assert torch.equal(bits(cpu[0]), bits(gpu[0]))
        assert_close(gpu[1], cpu[1], 1e-5, "the sign code's scalars")
    elif name in SELECTING:
        entries = []
        for payload in (cpu, gpu):
            values, indices = (t.cpu() for t in payload)
            if indices.dtype == torch.uint8:  # a bitmap (index_format): the values in ascending index order
                indices = bitpack.unpack(indices, 1, x.numel()).nonzero().view(-1)
            assert torch.equal(values, x[indices.long()])
            order = indices.argsort()
            entries.append((indices[order].long(), values[order]))
        (cpu_indices, cpu_values), (gpu_indices, gpu_values) = entries
        assert torch.equal(cpu_indices, gpu_indices) and torch.equal(bits(cpu_values), bits(gpu_values))


def check_result(name, cpu, gpu, dtype, xs, own=False):
    """A decode (``own``: of one's own payload; else the aggregate of the ranks') on each
    device; ``xs``: the inputs it comes from, on the CPU."""
    assert gpu.device == DEVICE and gpu.dtype == dtype and gpu.numel() == cpu.numel()
    if name in BITWISE and own:
        assert torch.equal(bits(cpu), bits(gpu))
    elif name in BITWISE | SELECTING:  # sums over ranks, in the wire's dtype for the casts
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name, dtype)
        assert_close(gpu, cpu, max(ROUNDING[dtype], ROUNDING[wire]), name)
    elif name in SIGN_SCALES:
        assert_close(gpu, cpu, max(ROUNDING[dtype], 1e-5), name)
    elif name in LOW_RANK:
        assert_close(gpu, cpu, LOW_RANK_TOLERANCE[dtype], name)
    elif name in STOCHASTIC and cpu.numel():  # each rounds its own way: both within a code's reach
        expected = torch.stack([x.double() for x in xs]).mean(0)
        # a QSGD level is at most a bucket's norm away; a TernGrad code is 0 or +-s, s <= max |x|
        reach = max(float(2 * x.double().abs().max() if name == "terngrad" else x.double().norm()) for x in xs)
        for result in (cpu, gpu):
            assert float((result.cpu().double() - expected).abs().max()) <= reach * (1 + ROUNDING[dtype])
    else:  # a compressor the registry learned elsewhere: it ran, and stayed finite
        assert bool(torch.isfinite(gpu.float()).all())


def compare(name, xs, shapes=None, compressors=(None, None)):
    """Encode, decode and aggregate ``xs`` (one per rank, on the CPU) on both devices, with the
    ``(CPU, CUDA)`` compressors given (a later step) or new ones; returns those compressors."""
    cpu_compressors, cpu_steps = steps(name, xs, shapes, compressors[0])
    gpu_compressors, gpu_steps = steps(name, [x.to(DEVICE) for x in xs], shapes, compressors[1])
    assert on_device([payload for payload, _ in gpu_steps])
    for (cpu, _), (gpu, _), x in zip(cpu_steps, gpu_steps, xs):
        check_payload(name, cpu, gpu, x)
    dtype = xs[0].dtype
    own = [c.decompress(p, ctx) for c, (p, ctx) in zip(gpu_compressors, gpu_steps)]
    own_cpu = [c.decompress(p, ctx) for c, (p, ctx) in zip(cpu_compressors, cpu_steps)]
    for a, b, x in zip(own_cpu, own, xs):
        check_result(name, a, b, dtype, [x], own=True)
    for a, b in zip(finish(cpu_compressors, cpu_steps), finish(gpu_compressors, gpu_steps)):
        check_result(name, a, b, dtype, xs)
    return cpu_compressors, gpu_compressors


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_compressor_on_cuda_matches_cpu(name, dtype, numel):
    compare(name, [distinct(numel, dtype, seed) for seed in range(RANKS)])


@pytest.mark.parametrize("name", NAMES)
def test_large_group_on_cuda_matches_cpu(name):
    """top-k's threshold from a strided sample, many QSGD buckets, the native kernels on the CPU."""
    g = torch.Generator().manual_seed(0)
    compare(name, [torch.randn(LARGE, generator=g) for _ in range(RANKS)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_powersgd_matrices_on_cuda_match_cpu_and_keep_q_there(dtype):
    numel = sum(s.numel() for s in MATRIX_SHAPES)
    xs = [distinct(numel, dtype, seed) for seed in range(RANKS)]
    compressors = compare("powersgd", xs, MATRIX_SHAPES)
    q = compressors[1][0].state["g"]["q"]
    assert q.device == DEVICE and q.numel() == 31 + 27  # a Q of n x 1 per matrix (rank 1)
    compare("powersgd", xs[::-1], MATRIX_SHAPES, compressors)  # a second step, from the warm start


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,kwargs", [("qsgd", {}), ("qsgd", {"levels": 7}), ("terngrad", {"clip": None})])
def test_stochastic_codecs_on_cuda_are_unbiased_and_seeded(name, kwargs, dtype):
    draws, numel = 256, 1001
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(0)) / 4).to(dtype).to(DEVICE)
    compressor = mergecomp.get_compressor(name, **kwargs)
    decodes = torch.stack([compressor.decompress(*compressor.compress(x, "g")).double() for _ in range(draws)])
    if name == "qsgd":  # a level is a step of the bucket's norm / levels
        step = x.double().norm() / compressor.levels
    else:  # a code is 0 or the largest magnitude
        step = x.double().abs().max()
    error = (decodes.mean(0) - x.double()).abs().max()
    # six standard errors of the mean of draws whose variance is at most step**2 / 4
    assert float(error) <= 6 * float(step) / 2 / draws ** 0.5
    assert not torch.equal(decodes[0], decodes[1])  # it does draw
    torch.manual_seed(5)
    first = compressor.compress(x, "g")[0]
    torch.manual_seed(5)
    again = compressor.compress(x, "g")[0]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(first, again))


def test_every_builtin_compressor_has_a_comparison():
    """A built-in compressor added later gets its own comparison here, not the generic check."""
    from cuda_support import KNOWN

    builtin = {n for n in NAMES if mergecomp.compressor_class(n).__module__.startswith("mergecomp.compressors")}
    assert builtin <= KNOWN, sorted(builtin - KNOWN)
