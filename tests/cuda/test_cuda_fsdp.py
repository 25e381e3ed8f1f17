"""``mc.fsdp.compress`` on CUDA: FSDP2 (``fully_shard``) on two processes sharing one GPU through
gloo (which moves CUDA tensors through host memory); the compressed reduce-scatter's payloads,
flags and shards on the GPU."""
import pytest
import torch
from distributed import run_workers
from test_fsdp import _overflow_worker, _train, full_on_cpu

pytestmark = pytest.mark.cuda


def _compare_worker(rank, world, device, compression, dtype=None):
    """FSDP's own parameters after 3 steps and ``compression``'s (both copied to the CPU), and
    the devices its error-feedback state lives on."""
    device = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    own, _ = _train(rank, None, device=device, dtype=dtype)
    params, reductions = _train(rank, compression, device=device, dtype=dtype)
    kept = {t.device.type for r in reductions for fields in r.state_dict()["memory"].values() for t in fields.values()}
    return own, params, kept


def _average_worker(rank, world, device):
    """torch's own reduce-scatter with ReduceOp.AVG (FSDP2's choice for fp32 and bf16) on this
    device: the shard and the mean every rank's chunk should give."""
    import torch.distributed as dist

    inputs = [torch.arange(world * 3, dtype=torch.float32) * (r + 1) for r in range(world)]
    shard = torch.empty(3, device=device)
    dist.reduce_scatter_tensor(shard, inputs[rank].to(device), op=dist.ReduceOp.AVG)
    return shard.cpu(), sum(x.view(world, 3)[rank] for x in inputs) / world


#: the largest difference from FSDP's own parameters after 3 steps each compressor may show (0: none)
GAPS = {"none": 0.0, "fp16": 1e-3, "qsgd": 0.1, "topk": 1.0, "efsignsgd": 1.0}


def check_compare(results, compression, gap_bound):
    """What every device must show (the CPU's run of it: ``tests/test_fsdp.py``): ranks agree,
    the lossless path is FSDP's own bit for bit, a lossy one departs from it within its bound;
    the largest departure."""
    own, first, _ = results[0]
    for _, params, _ in results:
        assert all(torch.equal(a, b) for a, b in zip(params, first)), f"{compression}: ranks disagree"
    gap = max(float((a - b).abs().max()) for a, b in zip(first, own))
    if gap_bound == 0.0:
        assert gap == 0.0, f"{compression}: lossless must be FSDP's own reduce-scatter bit for bit, off by {gap}"
    else:
        assert 0 < gap < gap_bound, f"{compression}: {gap} from FSDP's own (bound {gap_bound})"
    return gap


def test_torch_reduce_scatter_averages_on_the_gpu():
    """The reference the next test compares with: gloo's reduce-scatter of CUDA tensors with AVG."""
    for shard, expected in run_workers(_average_worker, 2, 2, "cuda", timeout=120):
        assert torch.equal(shard, expected), (shard, expected)


@pytest.mark.parametrize("compression", list(GAPS))
def test_fsdp2_compressed_reduce_scatter_on_a_shared_gpu(compression):
    results = run_workers(_compare_worker, 2, 2, "cuda", compression, timeout=120)
    check_compare(results, compression, GAPS[compression])
    assert compression == "none" or results[0][2] <= {"cuda"}, "the error feedback stays on the GPU"


def test_bf16_parameters_and_reduction_on_a_shared_gpu():
    results = run_workers(_compare_worker, 2, 2, "cuda", "qsgd", torch.bfloat16, timeout=120)
    check_compare(results, "qsgd bf16", 0.1)


def test_an_overflow_on_one_rank_makes_every_shard_nan_on_the_gpu():
    for nan, same, kept in run_workers(_overflow_worker, 2, 2, "cuda", timeout=120):
        assert nan and same and kept > 0


def _int8_worker(rank, world, device):
    """FSDP's own parameters after 3 steps and those with the int8 parameter all-gather (the
    payloads encoded and decoded on the GPU), both copied to the CPU."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}")
    own, _ = _train(rank, None, device=device)
    params, _ = _train(rank, "none", device=device, all_gather="int8")
    return own, params, set()


def test_the_int8_parameter_all_gather_on_a_shared_gpu():
    check_compare(run_workers(_int8_worker, 2, 2, "cuda", timeout=120), "int8 all-gather", 0.05)


def _offload_worker(rank, world, compression, all_gather):
    """FSDP2 with ``CPUOffloadPolicy`` (sharded parameters and gradients in host memory, the
    collectives on the GPU): FSDP's own parameters after 3 SGD steps and mergecomp's."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import mergecomp.torch as mc

    device = torch.device(f"cuda:{torch.cuda.current_device()}")

    def train(compression):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
        fully_shard(model[0], offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        if compression is not None:
            mc.fsdp.compress(model, compression, all_gather=all_gather)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=data).to(device)).pow(2).sum().backward()
            opt.step()
        return [full_on_cpu(p) for p in model.parameters()]

    return train(None), train(compression), set()


@pytest.mark.parametrize("compression,all_gather,bound", [("none", "none", 0.0), ("qsgd", "int8", 0.1)])
def test_cpu_offload_with_the_compressed_collectives(compression, all_gather, bound):
    """On CPU-only hosts FSDP2 refuses CPUOffloadPolicy itself (it needs an accelerator)."""
    results = run_workers(_offload_worker, 2, 2, compression, all_gather, timeout=120)
    check_compare(results, f"{compression} + {all_gather} all-gather, CPU offload", bound)
