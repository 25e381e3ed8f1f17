"""mc.fsdp.compress: FSDP2 (fully_shard) with mergecomp's compressed reduce-scatter, on real gloo ranks."""
import pytest
import torch
from distributed import run_workers


def _train(rank, compression, steps=3, **options):
    """A 3-layer MLP under fully_shard (each Linear and the root), SGD on rank-own data; the full
    parameters after ``steps`` steps and the compressed reduce-scatters (None: FSDP's own)."""
    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    comms = None if compression is None else mc.fsdp.compress(model, compression, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=data)).pow(2).sum().backward()
        opt.step()
    return [p.detach().full_tensor() for p in model.parameters()], comms


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
    for bad in ("powersgd", "signsgd"):
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
        assert "fully_shard" in errors["no_fsdp"]


def _overflow_worker(rank, world):
    """One step normal, one with an Inf in rank 0's gradients: every rank's shard is NaN, the
    memories are what the first step left."""
    import math

    from torch.distributed.fsdp import fully_shard

    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4 * world)
    fully_shard(model)
    comm, = mc.fsdp.compress(model, "topk")
    data = torch.Generator().manual_seed(rank)
    model(torch.randn(3, 6, generator=data)).pow(2).sum().backward()
    kept = comm.state_dict()["memory"]
    model.zero_grad()
    scale = math.inf if rank == 0 else 1.0
    (model(torch.randn(3, 6, generator=data)).pow(2).sum() * scale).backward()
    after = comm.state_dict()["memory"]
    grads_nan = all(bool(p.grad.to_local().isnan().all()) for p in model.parameters())
    same = kept.keys() == after.keys() and all(torch.equal(kept[k][f], after[k][f]) for k in kept for f in kept[k])
    return grads_nan, same, sum(t.numel() for fields in kept.values() for t in fields.values())


def test_an_overflow_on_one_rank_makes_every_shard_nan_and_keeps_the_memories():
    for grads_nan, same, kept in run_workers(_overflow_worker, 2, 2, timeout=120):
        assert grads_nan and same and kept > 0
