"""mc.DiLoCo on real gloo ranks: dense DiLoCo against the algorithm written out by hand, compressed
DiLoCo keeping every rank equal, resume, NaN/Inf, bad input."""
import copy

import pytest
import torch
from distributed import run_workers


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(rank, steps):
    data = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data)) for _ in range(steps)]


def inner_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _dense_worker(rank, world, H=3, rounds=4):
    """mergecomp's DiLoCo (dense) and the algorithm by hand (AdamW inner, the pseudo-gradients
    allreduced and averaged, Nesterov SGD outer), from rank-different data."""
    import torch.distributed as dist

    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    with torch.no_grad():  # ranks start apart: DiLoCo starts every rank from rank 0's
        for p in model.parameters():
            p.add_(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H)
    for x, y in data:
        inner_step(model, opt, x, y)
    ours = [p.detach().clone() for p in model.parameters()]

    reference = make_model()
    inner = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    global_params = [p.detach().clone() for p in reference.parameters()]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    for step, (x, y) in enumerate(data, 1):
        inner_step(reference, inner, x, y)
        if step % H == 0:
            for g, p in zip(global_params, reference.parameters()):
                delta = (g - p.detach()).contiguous()
                dist.all_reduce(delta)
                g.grad = delta / world
            outer.step()
            with torch.no_grad():
                for p, g in zip(reference.parameters(), global_params):
                    p.copy_(g)
    theirs = [p.detach() for p in reference.parameters()]
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs)), diloco.state_bytes(), diloco.inner_steps


@pytest.mark.parametrize("world", [2, 3])
def test_dense_diloco_is_the_algorithm(world):
    for gap, state_bytes, steps in run_workers(_dense_worker, world, world, timeout=120):
        assert gap < 1e-5, gap
        params = sum(p.numel() for p in make_model().parameters())
        assert state_bytes == 2 * params * 4, "the global parameters and the outer momentum, fp32"
        assert steps == 12


def _compressed_worker(rank, H=4, rounds=6):
    """Top-k 10 % with its residual memory on the pseudo-gradients: every rank ends with the same
    parameters, the loss falls, the memory holds this rank's residual."""
    import mergecomp.torch as mc

    data = batches(rank, H * rounds)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk", groups=2)
    x0, y0 = data[0]
    before = float(torch.nn.functional.cross_entropy(model(x0), y0))
    for x, y in data:
        inner_step(model, opt, x, y)
    after = float(torch.nn.functional.cross_entropy(model(x0), y0))
    residual = sum(float(t.abs().sum()) for fields in diloco.memory.state_dict().values() for t in fields.values())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), before, after, residual, len(diloco.groups)


def test_compressed_diloco_keeps_the_ranks_equal_and_learns():
    out = run_workers(_compressed_worker, 2, timeout=120)
    assert torch.equal(out[0][0], out[1][0])
    for _, before, after, residual, groups in out:
        assert after < before and residual > 0 and groups == 2


def _resume_worker(rank, path, H=3):
    """Save after 2 rounds and one more inner step (model, inner optimizer, DiLoCo), go on 2
    rounds; a fresh run loads the checkpoint and goes on the same way."""
    import mergecomp.torch as mc

    data = batches(rank, 5 * H)

    def build():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, mc.DiLoCo(model.named_parameters(), opt, sync_every=H, compression="topk")

    model, opt, diloco = build()
    for x, y in data[:2 * H + 1]:
        inner_step(model, opt, x, y)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict()})
    torch.save(saved, f"{path}.{rank}")
    for x, y in data[2 * H + 1:]:
        inner_step(model, opt, x, y)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, diloco = build()
    loaded = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    diloco.load_state_dict(loaded["diloco"])
    for x, y in data[2 * H + 1:]:
        inner_step(model, opt, x, y)
    return all(torch.equal(a, b) for a, b in zip(straight, model.parameters())), diloco.inner_steps


def test_resume_continues_exactly(tmp_path):
    for exact, steps in run_workers(_resume_worker, 2, str(tmp_path / "ckpt"), timeout=120):
        assert exact and steps == 15


def _nonfinite_worker(rank, nonfinite):
    """Rank 1's model blows up in the second round: under "skip" every rank goes back to the
    global parameters of round 1 and the next round goes on; under "raise" every rank raises."""
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=2, nonfinite=nonfinite)
    data = batches(rank, 6)
    for x, y in data[:2]:
        inner_step(model, opt, x, y)
    global_after_one = [g.clone() for g in diloco.global_params]
    inner_step(model, opt, *data[2])
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    try:
        inner_step(model, opt, *data[3])
    except FloatingPointError as err:
        return "raised", str(err)
    back = all(torch.equal(p, g) for p, g in zip(model.parameters(), global_after_one))
    for x, y in data[4:]:
        inner_step(model, opt, x, y)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return back, diloco.skipped_steps, finite


def test_a_nonfinite_pseudo_gradient_skips_the_round_on_every_rank():
    for back, skipped, finite in run_workers(_nonfinite_worker, 2, "skip", timeout=120):
        assert back and skipped == 1 and finite
    for raised, message in run_workers(_nonfinite_worker, 2, "raise", timeout=120):
        assert raised == "raised" and "rank 1" in message and "0.weight" in message


def _bad_input_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for kwargs in ({"sync_every": 0}, {"sync_every": 2, "nonfinite": "propagate"}, {"sync_every": 2, "average": False},
                   {"sync_every": 2 + rank}):
        try:
            mc.DiLoCo(model.named_parameters(), opt, **kwargs).close()
            errors.append(None)
        except (ValueError, TypeError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    return errors


def test_bad_input_is_refused_by_name_on_every_rank():
    for every, propagate, average, disagree in run_workers(_bad_input_worker, 2, timeout=120):
        assert every.startswith("ValueError") and "sync_every" in every
        assert propagate.startswith("ValueError") and "nonfinite" in propagate and "'propagate'" in propagate
        assert average.startswith("TypeError") and "average" in average
        assert disagree is not None and "sync_every" in disagree, disagree
