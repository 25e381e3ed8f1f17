"""mc.fsdp.compress: FSDP2 (fully_shard) with mergecomp's compressed reduce-scatter, on real gloo ranks."""
import pytest
import torch
from distributed import run_workers


def sgd_steps(model, rank, steps=3, device="cpu"):
    """``steps`` SGD steps on a squared-output loss (in fp32) of this rank's own random inputs
    (8 features, drawn on the CPU, moved to ``device``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=data).to(device)).float().pow(2).sum().backward()
        opt.step()


def full_on_cpu(param):
    """A sharded parameter's full value on the CPU, its shards gathered as CPU tensors: DTensor's
    ``full_tensor()`` of CUDA shards under gloo crashed both processes (SIGSEGV in the functional
    all-gather; torch 2.11 on one H200, two processes sharing it)."""
    import torch.distributed as dist

    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, param.detach().to_local().cpu())
    return torch.cat(shards, dim=param.placements[0].dim)


def _train(rank, compression, steps=3, device="cpu", dtype=None, **options):
    """A 3-layer MLP on ``device`` under fully_shard (each Linear and the root; ``dtype``: the
    MixedPrecisionPolicy's parameter and reduce dtype), SGD on rank-own data; the full parameters
    (on the CPU) after ``steps`` steps and the compressed reduce-scatters (None: FSDP's own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5)).to(device)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    comms = None if compression is None else mc.fsdp.compress(model, compression, **options)
    sgd_steps(model, rank, steps, device)
    return [full_on_cpu(p) for p in model.parameters()], comms


def _compare_worker(rank, world):
    import mergecomp.torch as mc

    own, _ = _train(rank, None)
    out = {}
    for compression in ("none", "fp16", "qsgd", "topk"):
        params, comms = _train(rank, compression)
        out[compression] = max(float((a - b).abs().max()) for a, b in zip(own, params))
        if compression == "topk":
            out["residual"] = sum(t.numel() for c in comms for fields in c.state_dict()["memory"].values()
                                  for t in fields.values())
    errors = {}
    for bad in ("powersgd", "acpsgd", "signsgd"):
        try:
            mc.fsdp.compress(torch.nn.Linear(2, 2), bad)
        except ValueError as err:
            errors[bad] = str(err)
    try:
        mc.fsdp.compress(torch.nn.Linear(2, 2), "qsgd")
    except ValueError as err:
        errors["no_fsdp"] = str(err)
    return out, errors


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_reduce_scatter_against_fsdp_own(world):
    for out, errors in run_workers(_compare_worker, world, world, timeout=240):
        assert out["none"] == 0.0, "lossless must be FSDP's reduce-scatter bit for bit"
        assert 0 < out["fp16"] < 1e-3 and 0 < out["qsgd"] < 0.1 and out["topk"] > 0
        assert out["residual"] > 0, "top-k keeps its error feedback per module and destination"
        assert "rounds" in errors["powersgd"] and "vote" in errors["signsgd"]
        assert "acpsgd" in errors["acpsgd"] and "whole matrices" in errors["acpsgd"]
        assert "fully_shard" in errors["no_fsdp"]


def _cast_worker(rank, world):
    """fp16 through the compressed reduce-scatter, without a memory and with the residual one,
    against this rank's own chunk (exact) plus the fp16 rounding of every other rank's chunk,
    summed in fp32 by hand; the residual memory keeps what the other ranks' chunks lost, nothing
    of the own chunk."""
    import torch.distributed as dist

    import mergecomp.torch as mc

    inputs = [torch.randn(world * 7, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = sum(x.view(world, 7)[rank].half().float() for r, x in enumerate(inputs) if r != rank)
    expected += inputs[rank].view(world, 7)[rank]
    out = {}
    for memory in ("none", "residual"):
        reduce_scatter = mc.fsdp.CompressedReduceScatter("fp16", memory)
        given = inputs[rank].clone()
        shard = torch.empty(7)
        reduce_scatter(shard, given, None, dist.ReduceOp.SUM)
        kept = reduce_scatter.state_dict()["memory"]
        residual = sum(t.abs().sum() for fields in kept.values() for t in fields.values())
        kept_elements = sum(t.numel() for fields in kept.values() for t in fields.values())
        own = sum(float(t.view(world, 7)[rank].abs().sum()) for fields in kept.values() for t in fields.values())
        out[memory] = (torch.equal(shard, expected), torch.equal(given, inputs[rank]), float(residual), kept_elements,
                       own)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_cast_without_memory_reduces_what_every_rank_sent(world):
    for out in run_workers(_cast_worker, world, world, timeout=120):
        assert out["none"][:2] == (True, True) and out["none"][2:] == (0.0, 0, 0), out
        assert out["residual"][:2] == (True, True) and out["residual"][2] > 0, out
        assert out["residual"][3:] == (world * 7, 0.0), "one residual of the module's input, zero at the own chunk"


def _conservation_worker(rank, world, compressor):
    """``compressor`` at 25 % with the residual memory through one summing reduce-scatter: this
    rank's inputs, its shard and what its memory kept of each destination's chunk."""
    import torch.distributed as dist

    import mergecomp.torch as mc
    from mergecomp.registry import get_compressor

    given = torch.randn(world * 40, generator=torch.Generator().manual_seed(rank))
    reduce_scatter = mc.fsdp.CompressedReduceScatter(get_compressor(compressor, ratio=0.25), "residual", name="m")
    shard = torch.empty(40)
    reduce_scatter(shard, given.clone(), None, dist.ReduceOp.SUM)
    residual = reduce_scatter.state_dict()["memory"]["m"]["residual"].view(world, 40)
    return given, shard, dict(enumerate(residual))


@pytest.mark.parametrize("world,compressor", [(2, "topk"), (3, "topk"), (3, "randk")])
def test_the_memories_conserve_what_was_not_sent(world, compressor):
    """Rank d's shard plus every other rank's residual for d is the exact sum of chunk d (rand-k:
    every sender draws chunk d's indices as rank d decodes them)."""
    out = run_workers(_conservation_worker, world, world, compressor, timeout=120)
    for d, (_, shard, kept) in enumerate(out):
        assert float(kept[d].abs().sum()) == 0, "the own chunk travels exactly"
        exact = sum(given.view(world, 40)[d] for given, _, _ in out)
        remembered = sum(out[s][2][d] for s in range(world) if s != d)
        assert float(remembered.abs().sum()) > 0
        torch.testing.assert_close(shard + remembered, exact, rtol=0, atol=1e-5)


def _overflow_worker(rank, world, device="cpu"):
    """One step normal, one with an Inf in rank 0's gradients (on ``device``): every rank's shard
    is NaN, the memories are what the first step left."""
    import math

    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4 * world).to(device)
    fully_shard(model)
    comm, = mc.fsdp.compress(model, "topk")
    data = torch.Generator().manual_seed(rank)
    model(torch.randn(3, 6, generator=data).to(device)).pow(2).sum().backward()
    kept = comm.state_dict()["memory"]
    model.zero_grad()
    scale = math.inf if rank == 0 else 1.0
    (model(torch.randn(3, 6, generator=data).to(device)).pow(2).sum() * scale).backward()
    after = comm.state_dict()["memory"]
    grads_nan = all(bool(p.grad.to_local().isnan().all()) for p in model.parameters())
    same = kept.keys() == after.keys() and all(torch.equal(kept[k][f], after[k][f]) for k in kept for f in kept[k])
    return grads_nan, same, sum(t.numel() for fields in kept.values() for t in fields.values())


def test_an_overflow_on_one_rank_makes_every_shard_nan_and_keeps_the_memories():
    for grads_nan, same, kept in run_workers(_overflow_worker, 2, 2, timeout=120):
        assert grads_nan and same and kept > 0


def _resume_worker(rank, world, flow, path):
    """Save after 2 steps (model, optimizer and the memories), train a 3rd step; load into a
    fresh model and take the 3rd step again: the same parameters.  ``flow``: ``"holders"`` (each
    reduction's state_dict, kept in memory), ``"dcp"`` (torch.distributed.checkpoint: FSDP's
    sharded state dicts and ``Reductions.state_dict()``, each rank its entry), ``"full"``
    (``Reductions.full_state_dict()`` written by rank 0 alone, read by every rank); the DCP flow
    with the int8 parameter all-gather too."""
    import copy
    import io

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc
    from mergecomp.registry import get_memory

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
        fully_shard(model[0])
        fully_shard(model)
        # rank 0's file: one memory instance for every module, saved once
        memory = get_memory("residual") if flow == "full" else None
        reductions = mc.fsdp.compress(model, "topk", memory, all_gather="int8" if flow == "dcp" else "none")
        return model, torch.optim.Adam(model.parameters(), lr=0.01), reductions

    def step(model, opt, seed):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
        opt.step()

    model, opt, reductions = build()
    for seed in (10 * rank, 10 * rank + 1):
        step(model, opt, seed)
    model_state, opt_state = get_state_dict(model, opt)
    if flow == "dcp":
        dcp.save({"model": model_state, "optim": opt_state, "mergecomp": reductions.state_dict()}, checkpoint_id=path)
    else:
        saved = copy.deepcopy({"model": model_state, "optim": opt_state})
        if flow == "holders":
            saved["mergecomp"] = [r.state_dict() for r in reductions]
        else:
            full = reductions.full_state_dict()
            memories = [state["memory"] for state in torch.load(io.BytesIO(full[f"rank{rank}"]))]
            saved_once = (memories[1:] == [0] * (len(memories) - 1)
                          and sorted(memories[0]) == sorted(reductions[0].memory.state_dict()) != [])
            if rank == 0:
                torch.save(full, f"{path}.pt")
    dist.barrier()
    step(model, opt, 10 * rank + 2)
    straight = [p.detach().full_tensor() for p in model.parameters()]

    model, opt, reductions = build()
    model_state, opt_state = get_state_dict(model, opt)
    if flow == "dcp":
        saved = {"model": model_state, "optim": opt_state, "mergecomp": reductions.state_dict()}
        dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    if flow == "holders":
        for reduction, state in zip(reductions, saved["mergecomp"]):
            reduction.load_state_dict(state)
    else:
        reductions.load_state_dict(saved["mergecomp"] if flow == "dcp" else torch.load(f"{path}.pt"))
    step(model, opt, 10 * rank + 2)
    resumed = [p.detach().full_tensor() for p in model.parameters()]
    fresh = build()[2]
    try:
        fresh.load_state_dict({"rank7": b""})
        missing = ""
    except KeyError as err:
        missing = str(err)
    return all(torch.equal(a, b) for a, b in zip(straight, resumed)), missing, flow != "full" or saved_once


@pytest.mark.parametrize("flow", ["holders", "dcp", "full"])
def test_resume_with_the_memories_continues_exactly(flow, tmp_path):
    for exact, missing, saved_once in run_workers(_resume_worker, 2, 2, flow, str(tmp_path / "checkpoint"),
                                                  timeout=120):
        assert exact
        assert "rank" in missing and "rank7" in missing
        assert saved_once, "a memory the modules share is saved by the first module only"


def _hsdp_worker(rank, world):
    """4 ranks, 2 replicas x 2 shards: native HSDP (2-D mesh) against fully_shard on the 1-D
    shard mesh with mergecomp's replica all-reduce (lossless, QSGD, top-k), 3 SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def train(compression, all_gather="none"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
        holders = []
        if compression is None:
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            fully_shard(model[0], mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            holders = mc.fsdp.compress(model, compression, replicate_group=mesh["replicate"].get_group(),
                                       all_gather=all_gather)
        sgd_steps(model, rank)
        return torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()]), holders

    native, _ = train(None)
    out = {}
    for compression in ("none", "qsgd", "topk", "qsgd@int8"):
        params, holders = train(*compression.split("@"))
        replicas = mc.allgather(params.unsqueeze(0))  # every rank's full parameters
        out[compression] = (float((params - native).abs().max()), bool((replicas == replicas[0]).all()),
                            [type(h).__name__ for h in holders])
    torch.manual_seed(0)
    native_model = torch.nn.Linear(4, 4)
    fully_shard(native_model, mesh=mesh)
    try:
        mc.fsdp.compress(native_model, "qsgd")
        out["native"] = ""
    except ValueError as err:
        out["native"] = str(err)
    return out


def test_hsdp_replica_all_reduce_compressed():
    for out in run_workers(_hsdp_worker, 4, 4, timeout=300):
        assert out["none"][0] < 1e-6, "lossless: native HSDP's parameters"
        assert 0 < out["qsgd"][0] < 0.1 and out["topk"][0] > 0
        assert 0 < out["qsgd@int8"][0] < 0.1 and out["qsgd@int8"][0] != out["qsgd"][0], "the all-gather in int8"
        assert all(out[c][1] for c in ("none", "qsgd", "topk", "qsgd@int8")), "every rank holds the same parameters"
        assert out["topk"][2].count("CompressedAllReduce") == 2  # one per FSDP module
        assert "replicate_group" in out["native"] and "2-D" in out["native"]


def _fsdp1_worker(rank, world, strategy):
    """FSDP1 (each Linear and the root wrapped) with FSDP1's own reduction against mergecomp's
    hook, 3 SGD steps; the error feedback kept per flat parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    import mergecomp.torch as mc

    def train(compression):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
        kwargs = {"device_id": torch.device("cpu"), "sharding_strategy": getattr(ShardingStrategy, strategy)}
        model = FSDP(torch.nn.Sequential(FSDP(model[0], **kwargs), model[1], FSDP(model[2], **kwargs)), **kwargs)
        holders = [] if compression is None else mc.fsdp.compress(model, compression)
        sgd_steps(model, rank)
        with FSDP.summon_full_params(model):
            params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return params, holders

    own, _ = train(None)
    out = {}
    for compression in ("none", "fp16", "topk"):
        params, holders = train(compression)
        replicas = mc.allgather(params.unsqueeze(0))
        memory = holders[0].state_dict()["memory"]
        out[compression] = (float((params - own).abs().max()), bool((replicas == replicas[0]).all()), sorted(memory))
    try:
        mc.fsdp.compress(FSDP(torch.nn.Linear(8, 4), device_id=torch.device("cpu")), "none", all_gather="int8")
        refused = ""
    except ValueError as err:
        refused = str(err)
    return out, refused


@pytest.mark.parametrize("world,strategy", [(2, "FULL_SHARD"), (3, "SHARD_GRAD_OP"), (2, "NO_SHARD")])
def test_fsdp1_comm_hook(world, strategy):
    for out, refused in run_workers(_fsdp1_worker, world, world, strategy, timeout=240):
        assert "all_gather='int8'" in refused and "FSDP1" in refused
        assert out["none"][0] < 1e-6 and 0 < out["fp16"][0] < 1e-3 and out["topk"][0] > 0
        assert all(identical for _, identical, _ in out.values())
        # top-k keeps a residual for each of the 2 flat parameters (the root holds none), by place
        assert out["topk"][2] == ["fsdp1.0", "fsdp1.1"]


def _int8_gather_worker(rank, world):
    """The int8 all-gather of this rank's random shard (uneven blocks, a zero block), and FSDP2
    trained 3 SGD steps with it against FSDP's own all-gather."""
    import mergecomp.torch as mc

    shard = torch.randn(300, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    shard[256:] = 0  # the last block, all zeros
    gathered = torch.empty(world * 300)
    mc.fsdp.QuantizedAllGather(block=64)(gathered, shard.clone(), None)
    packed = torch.empty(world * 10, dtype=torch.uint8)  # bytes (FSDP2's mixed-dtype modules): exact
    mc.fsdp.QuantizedAllGather()(packed, torch.arange(10, dtype=torch.uint8) + 50 * rank, None)
    own, _ = _train(rank, None)
    params, _ = _train(rank, "none", all_gather="int8")
    replicas = mc.allgather(torch.cat([p.flatten() for p in params]).unsqueeze(0))
    errors = {}
    for bad in ({"all_gather": "int4"}, {"block": 6}):
        try:
            if "block" in bad:
                mc.fsdp.QuantizedAllGather(**bad)
            else:
                mc.fsdp.compress(torch.nn.Linear(2, 2), "qsgd", **bad)
        except ValueError as err:
            errors[next(iter(bad))] = str(err)
    exact = torch.equal(packed, torch.cat([torch.arange(10, dtype=torch.uint8) + 50 * r for r in range(world)]))
    return shard, gathered, max(float((a - b).abs().max()) for a, b in zip(own, params)), \
        bool((replicas == replicas[0]).all()) and exact, errors


@pytest.mark.parametrize("world", [2, 3])
def test_the_int8_all_gather_gives_every_rank_the_same_rounded_parameters(world):
    out = run_workers(_int8_gather_worker, world, world, timeout=240)
    gathered = out[0][1]
    for rank, (shard, mine, drift, identical, errors) in enumerate(out):
        assert torch.equal(mine, gathered), "every rank decodes the same parameters"
        decoded = gathered.view(world, 300)[rank]
        for start in range(0, 300, 64):  # within half a block's scale of the exact shard
            block = shard[start:start + 64]
            bound = float(block.abs().max()) / 127 / 2 + 1e-7
            assert float((decoded[start:start + 64] - block).abs().max()) <= bound
        assert torch.equal(decoded[256:], torch.zeros(44))
        assert not torch.equal(decoded, shard), "int8, not exact"
        assert identical and 0 < drift < 0.05, drift
        assert "int4" in errors["all_gather"] and "'none', 'int8'" in errors["all_gather"]
        assert "multiple of 4" in errors["block"]


def _user_paths_worker(rank, world):
    """What FSDP2 users do beyond the plain step, each with FSDP's own reduction and with
    mergecomp's: ``set_gradient_divide_factor`` (FSDP2 asks for a PREMUL_SUM, which gloo lacks:
    its own reference runs with ``set_force_sum_reduction_for_comms``), a parameter without a
    gradient, and ``torch.amp.GradScaler`` with an overflow on rank 0."""
    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
            self.unused = torch.nn.Linear(3, 3)  # in the root's FSDP group, never in the forward: no gradient

        def forward(self, x):
            return self.body(x)

    def build(compression, divide=None, force_sum=False):
        torch.manual_seed(0)
        model = Net()
        for layer in model.body[0], model.body[2]:
            fully_shard(layer)
        fully_shard(model)
        if divide is not None:
            model.set_gradient_divide_factor(divide)
            model.set_force_sum_reduction_for_comms(force_sum)
        reductions = None if compression is None else mc.fsdp.compress(model, compression)
        return model, reductions

    def full(model):
        return [p.detach().full_tensor() for p in model.parameters()]

    out = {}
    reference, _ = build(None, divide=3.0, force_sum=True)
    sgd_steps(reference, rank)
    for compression in ("none", "fp16"):
        model, _ = build(compression, divide=3.0)
        sgd_steps(model, rank)
        out[f"divide {compression}"] = max(float((a - b).abs().max()) for a, b in zip(full(reference), full(model)))
    own, _ = build(None)
    start = [p.clone() for p in full(own)]
    sgd_steps(own, rank)
    model, _ = build("none")
    sgd_steps(model, rank)
    out["no grad bit for bit"] = all(torch.equal(a, b) for a, b in zip(full(own), full(model)))
    out["no grad untouched"] = all(torch.equal(a, b) for a, b in zip(full(model)[-2:], start[-2:]))

    model, (_, first, _) = build("topk")  # the root's reduction, of the unused parameters, never runs
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.05), torch.amp.GradScaler("cpu", init_scale=1024.0)
    data = torch.Generator().manual_seed(rank)
    for overflow in (False, True):
        before, kept = [p.clone() for p in full(model)], first.state_dict()["memory"]
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=data)).pow(2).sum()
        scaler.scale(loss * (float("inf") if overflow and rank == 0 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    after = first.state_dict()["memory"]
    out["scaler skipped"] = all(torch.equal(a, b) for a, b in zip(before, full(model)))
    out["memories kept"] = all(torch.equal(kept[k][f], after[k][f]) for k in kept for f in kept[k]) and bool(kept)
    out["scale"] = scaler.get_scale()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_divide_factor_parameters_without_gradients_and_grad_scaler(world):
    for out in run_workers(_user_paths_worker, world, world, timeout=240):
        assert out["divide none"] < 1e-6 and 0 < out["divide fp16"] < 1e-3, out
        assert out["no grad bit for bit"] and out["no grad untouched"], out
        assert out["scaler skipped"] and out["memories kept"] and out["scale"] == 512.0, out
