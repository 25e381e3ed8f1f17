"""Training on CUDA: ``mergecomp.torch.DistributedOptimizer`` (the merged step), the DDP hook,
``torch.amp.GradScaler("cuda")`` and a ``torch.compile``'d model; on one process, on two
processes sharing one GPU through gloo (which moves CUDA tensors through host memory), and on
two GPUs through NCCL where there are two."""
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from test_ddp_hook import BUCKET_MB
from test_optimizer_dist import flat_params, make_data, make_model, shard

import mergecomp

pytestmark = pytest.mark.cuda

STEPS = 5
#: (compression, options, parameter dtype) trained on every rank: every compressor...
EVERY = [(name, {}, torch.float32) for name in mergecomp.compressor_names()]
#: ...and the two-phase scheme, 16-bit parameters
RUNS = EVERY + [("topk", {"scheme": "two-phase"}, torch.float32), ("qsgd", {"scheme": "two-phase"}, torch.float32),
                ("signsgd", {"scheme": "two-phase"}, torch.float32), ("topk", {}, torch.bfloat16),
                ("fp16", {}, torch.float16)]
NCCL_RUNS = [("none", {}, torch.float32), ("fp16", {}, torch.float32), ("topk", {}, torch.float32),
             ("powersgd", {}, torch.float32), ("signsgd", {"scheme": "two-phase"}, torch.float32)]


def device_of_rank() -> torch.device:
    """This process's GPU: its local rank's under NCCL, GPU 0 under gloo (``tests/distributed.py``)."""
    return torch.device("cuda", torch.cuda.current_device())


def batches(rank, world, device):
    x, y = make_data()
    return shard(x, rank, world).to(device), shard(y, rank, world).to(device)


def sgd(model, name):
    # the dgc memory applies momentum itself; the sign codes want small steps
    lr = 0.02 if name in ("signsgd", "signum", "efsignsgd") else 0.1
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0 if name == "dgc" else 0.9)


def _train_worker(rank, world, runs):
    """Each run trained STEPS steps on this rank's shard; the lossless run also against one
    process training on the joined batch."""
    import mergecomp.torch as mc

    device = device_of_rank()
    x, y = batches(rank, world, device)
    out = {}
    for name, options, dtype in runs:
        model = make_model(seed=rank).to(device)  # another start on each rank...
        mc.broadcast_parameters(model.state_dict(), root_rank=0)  # ...until rank 0's is broadcast
        model.to(dtype)
        opt = mc.DistributedOptimizer(sgd(model, name), model.named_parameters(), compression=name, groups=2,
                                      **options)
        losses = []
        for _ in range(STEPS):
            loss = F.cross_entropy(model(x.to(dtype)).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        grads_here = all(p.grad.device == device for p in model.parameters())
        out[(name, tuple(options.items()), str(dtype))] = (flat_params(model).float().cpu(), losses, grads_here)
    joined, target = (t.to(device) for t in make_data())
    reference = make_model().to(device)
    ref_opt = sgd(reference, "none")
    for _ in range(STEPS):
        ref_opt.zero_grad()
        F.cross_entropy(reference(joined), target).backward()
        ref_opt.step()
    out["reference"] = flat_params(reference).cpu()
    return out


def check_training(results, runs):
    """Every run: the same parameters on every rank, finite, gradients on the GPU; lossless
    training equal to one process on the joined batch."""
    for name, options, dtype in runs:
        key = (name, tuple(options.items()), str(dtype))
        params, losses, grads_here = results[0][key]
        assert grads_here, key
        assert all(math.isfinite(v) for v in losses) and bool(torch.isfinite(params).all()), key
        for other in results[1:]:
            assert torch.equal(other[key][0], params), f"{key}: ranks diverged"
        if name == "none" and dtype == torch.float32:
            assert (params - results[0]["reference"]).abs().max().item() < 1e-5


def test_distributed_optimizer_on_one_process():
    check_training(run_workers(_train_worker, 1, 1, EVERY), EVERY)


def test_distributed_optimizer_on_two_ranks_sharing_a_gpu_through_gloo():
    check_training(run_workers(_train_worker, 2, 2, RUNS, timeout=300), RUNS)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL takes one GPU per rank: fewer than 2 GPUs")
def test_distributed_optimizer_on_two_gpus_through_nccl():
    results = run_workers(_train_worker, 2, 2, NCCL_RUNS, env={"MERGECOMP_TORCH_BACKEND": "nccl"}, timeout=300)
    check_training(results, NCCL_RUNS)


# -- the DDP hook -------------------------------------------------------------------------------
def _ddp_worker(rank, names):
    import mergecomp.torch as mc

    device = device_of_rank()
    x, y = batches(rank, 2, device)
    out = {}
    for name in (None, *names):
        model = torch.nn.parallel.DistributedDataParallel(make_model().to(device), device_ids=[device.index],
                                                          bucket_cap_mb=BUCKET_MB)
        if name is not None:
            state, hook = mc.ddp_comm_hook(name, named_parameters=model.module.named_parameters())
            model.register_comm_hook(state, hook)
        opt = sgd(model, name or "none")
        for _ in range(STEPS):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        out[name] = flat_params(model).cpu()
    return out


def test_ddp_hook_on_two_ranks_sharing_a_gpu_through_gloo():
    names = ("none", "topk", "powersgd", "qsgd")
    r0, r1 = run_workers(_ddp_worker, 2, names, timeout=300)
    assert (r0["none"] - r0[None]).abs().max().item() < 1e-6  # as DDP's own allreduce
    for name in names:
        assert torch.equal(r0[name], r1[name]), f"{name}: ranks diverged"
        assert bool(torch.isfinite(r0[name]).all())


# -- GradScaler with an overflow on one rank ------------------------------------------------------
def _scaler_worker(rank, compression, overflow_at):
    """fp16 autocast and ``GradScaler("cuda")``; at step ``overflow_at`` rank 1's loss is inf."""
    import mergecomp.torch as mc

    device = device_of_rank()
    x, y = batches(rank, 2, device)
    model = make_model().to(device)
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression=compression, groups=2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8)
    scales, moved, memory_kept = [], [], []
    for step in range(STEPS):
        before = flat_params(model).clone()
        memory = {g: {k: v.clone() for k, v in fields.items()} for g, fields in opt.memory.state_dict().items()}
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if step == overflow_at and rank == 1:
            loss = loss * float("inf")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(before, flat_params(model)))
        after = opt.memory.state_dict()
        memory_kept.append(after.keys() == memory.keys() and all(
            torch.equal(after[g][k], v) for g, fields in memory.items() for k, v in fields.items()))
    return scales, moved, memory_kept, flat_params(model).cpu()


@pytest.mark.parametrize("compression", ["none", "topk"])
def test_grad_scaler_skips_an_overflow_on_every_rank(compression):
    overflow_at = 2
    r0, r1 = run_workers(_scaler_worker, 2, compression, overflow_at, timeout=300)
    for scales, moved, memory_kept, _ in (r0, r1):
        assert moved == [step != overflow_at for step in range(STEPS)]
        assert scales[overflow_at] == scales[overflow_at - 1] / 2  # backed off on every rank
        assert memory_kept[overflow_at]  # the error feedback left as it was
    assert r0[0] == r1[0] and torch.equal(r0[3], r1[3])


# -- torch.compile --------------------------------------------------------------------------------
def _compiled_worker(rank):
    """The same model eager and compiled, lossless and with top-k."""
    import mergecomp.torch as mc

    device = device_of_rank()
    x, y = batches(rank, 1, device)
    eager = make_model().to(device)
    initial = {k: v.clone() for k, v in eager.state_dict().items()}
    compiled = torch.compile(eager)
    out = {}
    for label, model in (("eager", eager), ("compiled", compiled)):
        for name in ("none", "topk"):
            eager.load_state_dict(initial)
            opt = mc.DistributedOptimizer(sgd(eager, name), eager.named_parameters(), compression=name, groups=2)
            for _ in range(STEPS):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            out[(label, name)] = (flat_params(eager).cpu(), opt.merged.step)
            opt.remove_hooks()
    return out


def test_a_compiled_model_trains_as_the_eager_one():
    (out,) = run_workers(_compiled_worker, 1, timeout=300)
    for name in ("none", "topk"):
        assert out[("compiled", name)][1] == STEPS  # every step went through the exchange
        assert bool(torch.isfinite(out[("compiled", name)][0]).all())
    assert (out[("compiled", "none")][0] - out[("eager", "none")][0]).abs().max().item() < 1e-4
