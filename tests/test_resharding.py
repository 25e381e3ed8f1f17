"""A DistributedOptimizer checkpoint saved by 4 gloo ranks, resumed on 3 (a torchrun elastic
restart): replicated state kept, per-rank memories folded (their mean) or dropped, no rank given
another's residual, the ranks in step afterwards."""
import pytest
import torch
from distributed import run_workers


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def wrap(model, compression):
    import mergecomp.torch as mc

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mc.DistributedOptimizer(opt, model.named_parameters(), compression=compression, groups=1,
                                   exchange_momentum_after=None)  # AdamW's gradients: their memories resharded


def train(model, opt, rank, steps, seed):
    data = torch.Generator().manual_seed(seed + rank)
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=data), torch.randint(0, 4, (6,), generator=data)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _save(rank, folder, compression):
    model = make_model()
    opt = wrap(model, compression)
    train(model, opt, rank, 5, 0)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{folder}/rank{rank}.pt")


def _resume(rank, folder, compression, residuals):
    model = make_model()
    opt = wrap(model, compression)
    saved = [torch.load(f"{folder}/rank{r}.pt", weights_only=False) for r in range(4)]
    model.load_state_dict(saved[0]["model"])
    opt.load_every_rank([s["opt"] for s in saved], residuals=residuals)
    memory = opt.merged.exchange.memory.state_dict()
    compressor = opt.merged.exchange.compressor.state_dict()
    train(model, opt, rank, 3, 100)
    return memory, compressor, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("compression,residuals", [("topk", "fold"), ("topk", "drop"), ("powersgd", "fold")])
def test_four_ranks_resume_on_three(tmp_path, compression, residuals):
    run_workers(_save, 4, str(tmp_path), compression, timeout=120)
    old = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["opt"]["mergecomp"] for r in range(4)]
    out = run_workers(_resume, 3, str(tmp_path), compression, residuals, timeout=120)
    [group] = old[0]["memory"]
    residual = [s["memory"][group]["residual"] for s in old]
    for memory, compressor, params in out:
        if residuals == "fold":
            mine = memory[group]["residual"]
            assert torch.allclose(mine, torch.stack(residual).mean(0), atol=1e-7)
            assert not any(torch.equal(mine, r) for r in residual), "a rank holds another rank's residual"
        else:
            assert group not in memory
        for name, fields in old[0]["compressor"].items():  # replicated (PowerSGD's Q): rank 0's, exactly
            assert all(torch.equal(compressor[name][k], v) for k, v in fields.items())
        assert torch.equal(params, out[0][2])


def _save_dcp(rank, folder):
    import mergecomp.torch as mc

    model = make_model()
    opt = wrap(model, "topk")
    train(model, opt, rank, 5, 0)
    mc.checkpoint.save(f"{folder}/dcp", model, opt, step=5)
    return opt.merged.state_dict(), torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load_dcp(rank, folder):
    import mergecomp.torch as mc

    model = make_model()
    opt = wrap(model, "topk")
    extra = mc.checkpoint.load(f"{folder}/dcp", model, opt)
    return (extra, opt.merged.state_dict(), torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            opt.state_dict()["state"])


def test_distributed_checkpoint_resumes_on_three_ranks_and_on_four(tmp_path):
    """mc.checkpoint (torch.distributed.checkpoint) saved by 4 ranks: on 3, every rank's memory is
    the old ranks' mean; on 4, each rank's own; the model and Adam's state on every rank."""
    saved = run_workers(_save_dcp, 4, str(tmp_path), timeout=120)
    [group] = saved[0][0]["memory"]
    residuals = [state["memory"][group]["residual"] for state, _ in saved]
    for world in (3, 4):
        out = run_workers(_load_dcp, world, str(tmp_path), timeout=120)
        for rank, (extra, merged, params, adam) in enumerate(out):
            assert extra == {"step": 5}
            assert torch.equal(params, saved[0][1])
            assert merged["step"] == saved[0][0]["step"] and merged["plan"] == saved[0][0]["plan"]
            mine = merged["memory"][group]["residual"]
            expected = torch.stack(residuals).mean(0) if world == 3 else residuals[rank]
            assert torch.allclose(mine, expected, atol=1e-7)
            assert set(adam) == set(out[0][3]) and all(
                torch.equal(adam[k]["exp_avg"], out[0][3][k]["exp_avg"]) for k in adam)
