"""The error-feedback memories and a group's exchange on CUDA tensors: the memories' state against
the CPU's, the fused and part-by-part encodes falling back to the plain path (they are CPU
kernels) with the same payloads and memory as the CPU's fused path, and the NaN/Inf check."""
import pytest
import torch
from cuda_support import (DEVICE, DTYPES, LOW_RANK, ROUNDING, SIGN_SCALES, STOCHASTIC, assert_close, bits,
                          distinct)

import mergecomp
from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import GroupPlan, layout
from mergecomp.kernels import native
from mergecomp.kernels.codecs import all_finite
from mergecomp.pipeline.nonfinite import OVERFLOWED, NonfiniteCheck

pytestmark = pytest.mark.cuda

NAMES = mergecomp.compressor_names()
SHAPES = [torch.Size([33, 31]), torch.Size([7]), torch.Size([16, 3, 3, 3])]
NUMEL = sum(s.numel() for s in SHAPES)
STEPS = 3
#: compressors whose CPU encode folds the residual memory into a kernel of its own
FUSED_ON_CPU = ("topk", "dgc", "efsignsgd", "onebit")


GROUP = layout(GroupPlan(((0, 1, 2),)), SHAPES)[0]


def gradients(dtype=torch.float32):
    return [distinct(NUMEL, dtype, seed) for seed in range(STEPS)]


# -- the memories -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", mergecomp.memory_names())
def test_memory_on_cuda_matches_cpu_dense_and_sparse(name):
    """compensate, then update with a sent tensor that is zero but at some entries (as dense
    ``update`` and as ``update_sparse``), three steps: the state on CUDA is the CPU's."""
    memories = {(device, sparse): mergecomp.get_memory(name) for device in ("cpu", DEVICE) for sparse in (False, True)}
    g = torch.Generator().manual_seed(0)
    for grad in gradients():
        indices = torch.randperm(NUMEL, generator=g)[:NUMEL // 10]
        for (device, sparse), memory in memories.items():
            compensated = memory.compensate(grad.to(device, copy=True), "g")
            at = indices.to(device)
            values = compensated[at] * 0.5  # half of each entry was sent
            if sparse:
                memory.update_sparse(compensated, "g", at, values)
            else:
                memory.update(compensated, "g", torch.zeros_like(compensated).index_put_((at,), values))
    states = {key: memory.state_dict().get("g", {}) for key, memory in memories.items()}
    if name != "none":
        assert states[(DEVICE, False)]
    for sparse in (False, True):
        cpu, gpu = states[("cpu", sparse)], states[(DEVICE, sparse)]
        assert cpu.keys() == gpu.keys()
        for field, value in cpu.items():
            if value.numel() == NUMEL:  # per element: on the device
                assert gpu[field].device == DEVICE
            assert_close(gpu[field], value, 1e-6, f"{name} {field}")
    for field, value in states[(DEVICE, False)].items():
        assert_close(states[(DEVICE, True)][field], value.cpu(), 1e-6, f"{name} {field}: update_sparse against update")


# -- a group's exchange -------------------------------------------------------------------------
def exchange_steps(name, device, dtype=torch.float32):
    """Three steps of one group's exchange on one rank: the results, whether each encode was a
    fused one, the memory's state, and what ``begin`` offered (part-by-part encodes)."""
    compressor = mergecomp.get_compressor(name)
    exchange = Exchange(compressor, mergecomp.get_memory(compressor.default_memory), LocalCommunicator())
    results, fused, parts = [], [], []
    for grad in gradients(dtype):
        flat = grad.to(device, copy=True)
        if flat.device.type == "cuda":  # (on the CPU, parts offered would keep the memory's state)
            parts.append(exchange.begin(GROUP, torch.empty_like(flat)))
        job = exchange.start(GROUP, flat)
        fused.append(job.encoded)
        results.append(exchange.finish(job).clone())
        exchange.end_step()
    return results, fused, parts, exchange.memory.state_dict().get(GROUP.name, {})


@pytest.mark.parametrize("name", NAMES)
def test_exchange_on_cuda_takes_the_plain_path_and_matches_cpu(name):
    gpu, gpu_fused, gpu_parts, gpu_memory = exchange_steps(name, DEVICE)
    assert not any(gpu_fused) and all(p is None for p in gpu_parts)  # CPU kernels only
    cpu, cpu_fused, _, cpu_memory = exchange_steps(name, "cpu")
    if name in FUSED_ON_CPU and native.usable(torch.zeros(1)):
        assert all(cpu_fused)  # so the comparison below is fused against plain
    if name in STOCHASTIC:
        for result, expected in zip(gpu, cpu):  # each rounds its own way
            assert result.device == DEVICE and bool(torch.isfinite(result).all())
        return
    tolerance = 1e-4 if name in LOW_RANK else 1e-5 if name in SIGN_SCALES else ROUNDING[torch.float32]
    for step, (result, expected) in enumerate(zip(gpu, cpu)):
        assert result.device == DEVICE
        assert_close(result, expected, tolerance, f"{name} step {step}")
    assert gpu_memory.keys() == cpu_memory.keys()
    for field, value in cpu_memory.items():
        assert_close(gpu_memory[field], value, tolerance * 10, f"{name} memory {field}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_group_is_reported_and_zeroed_on_cuda(bad, dtype):
    exchange = Exchange(mergecomp.get_compressor("topk"), mergecomp.get_memory("residual"), LocalCommunicator())
    flat = distinct(NUMEL, dtype, 0).to(DEVICE)
    assert bool(all_finite(flat))
    flat[NUMEL // 2] = bad
    assert not bool(all_finite(flat))
    job = exchange.start(GROUP, flat)
    assert job.finite.device == DEVICE and not bool(job.finite)
    result = exchange.finish(job)
    assert bool((result == 0).all())  # zeroed before the memory or the compressor saw it
    culprits = NonfiniteCheck(exchange.comm, [job], 0).culprits(["g"])
    assert culprits == [(0, "g", 1)]


def test_a_cast_that_overflows_is_flagged_on_cuda():
    """fp16 with error feedback: a finite gradient beyond 65504 overflows its payload."""
    exchange = Exchange(mergecomp.get_compressor("fp16"), mergecomp.get_memory("residual"), LocalCommunicator())
    flat = distinct(NUMEL, torch.float32, 0).to(DEVICE)
    flat[3] = 1e6
    job = exchange.start(GROUP, flat)
    assert bool(job.finite) and job.overflowed.device == DEVICE and bool(job.overflowed)
    exchange.finish(job)
    assert NonfiniteCheck(exchange.comm, [job], 0).culprits(["g"]) == [(0, "g", OVERFLOWED)]


def test_sign_decode_and_vote_codec_stay_on_the_device():
    """The two values a sign bit decodes to, and the vote's 2-bit codes, made on the device."""
    from mergecomp.compressors.signsgd import VoteCodec
    from mergecomp.kernels.codecs import decode_signs, pack_signs

    x = distinct(1001, torch.float32, 0).to(DEVICE)
    packed, _ = pack_signs(x)
    decoded = decode_signs(packed, x.numel(), torch.float16)
    assert decoded.device == DEVICE and torch.equal(bits(decoded), bits(torch.where(x >= 0, 1.0, -1.0).half()))
    votes = torch.tensor([-1.0, 0.0, 1.0] * 5, device=DEVICE)
    codec = VoteCodec()
    assert torch.equal(codec.decompress(*codec.compress(votes, "g")), votes)


def test_step_counters_of_a_checkpoint_mapped_to_the_gpu_are_read_on_the_host():
    """rand-k's step (its indices' seed) and the averaged memory's update count, loaded from
    tensors on the GPU (``torch.load(map_location="cuda")``), stay CPU scalars: each step reads
    them."""
    x = distinct(1001, torch.float32, 0).to(DEVICE)
    randk, memory = mergecomp.get_compressor("randk"), mergecomp.get_memory("averaged")
    for _ in range(2):
        memory.update(memory.compensate(x.clone(), "g"), "g", torch.zeros_like(x))
        randk.compress(x, "g")
    loaded_randk, loaded_memory = mergecomp.get_compressor("randk"), mergecomp.get_memory("averaged")
    for source, target in ((randk, loaded_randk), (memory, loaded_memory)):
        target.load_state_dict({g: {k: v.to(DEVICE) for k, v in fields.items()} for g, fields in
                                source.state_dict().items()})
    assert loaded_randk.state["g"]["step"].device.type == "cpu"
    assert loaded_memory.state["g"]["updates"].device.type == "cpu"
    assert loaded_memory.state["g"]["error"].device == DEVICE
    assert torch.equal(loaded_randk.compress(x, "g")[0][0], randk.compress(x, "g")[0][0])
