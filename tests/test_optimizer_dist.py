"""DistributedOptimizer on real processes (gloo over loopback): exactness, every compressor,
gradient accumulation, unused parameters, non-finite gradients."""
import math

import pytest
import torch
from distributed import WorkerError, run_workers

import mergecomp

STEPS = 20
BATCH = 32


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def make_data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 16, generator=g)
    target_map = torch.randn(16, 4, generator=g)
    y = (x @ target_map).argmax(dim=1)
    return x, y


def shard(tensor, rank, world=2):
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(model, opt, x, y, steps=STEPS, set_to_none=True):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- exactness ---------------------------------------------------------------------------------
def _exact_worker(rank, groups, world):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression="none", groups=groups)
    train(model, opt, shard(x, rank, world), shard(y, rank, world))
    reference = make_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    train(reference, ref_opt, x, y)
    return (flat_params(model) - flat_params(reference)).abs().max().item(), len(opt.groups)


@pytest.mark.parametrize("groups,expected_groups", [("layerwise", 6), (1, 1), (3, 3)])
def test_none_matches_single_process_on_joined_batch(groups, expected_groups):
    for diff, n_groups in run_workers(_exact_worker, 2, groups, 2):
        assert n_groups == expected_groups
        assert diff < 1e-5


def test_none_matches_single_process_on_four_ranks():
    for diff, _ in run_workers(_exact_worker, 4, 2, 4):
        assert diff < 1e-5


def _grad_view_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression="none", groups=2)
    train(model, opt, shard(x, rank), shard(y, rank), steps=5, set_to_none=False)
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in opt.merged.buffers]
    in_buffers = all(any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in model.parameters())
    reference = make_model()
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), x, y, steps=5)
    return in_buffers, (flat_params(model) - flat_params(reference)).abs().max().item()


def test_grads_are_views_of_the_group_buffers_and_in_place_accumulation_is_exact():
    """After step() each p.grad is its slot in a merged buffer (no copy back); with
    zero_grad(set_to_none=False) the next backward accumulates straight into it."""
    for in_buffers, diff in run_workers(_grad_view_worker, 2):
        assert in_buffers
        assert diff < 1e-5


# -- every compressor ----------------------------------------------------------------------------
def _all_compressors_worker(rank, names):
    import mergecomp.torch as mc

    x, y = make_data()
    out = {}
    for name in names:
        model = make_model()
        # Momentum-free SGD: the dgc memory applies momentum correction itself.
        opt = torch.optim.SGD(model.parameters(), lr=0.05 if name in ("signsgd", "signum", "efsignsgd") else 0.2)
        opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=name, groups=2)
        losses = train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=40)
        full = torch.nn.functional.cross_entropy(model(x), y).item()
        out[name] = (flat_params(model), losses, full)
    return out


def test_every_compressor_keeps_ranks_identical_and_learns():
    names = mergecomp.compressor_names()
    r0, r1 = run_workers(_all_compressors_worker, 2, names, timeout=300)
    x, y = make_data()
    initial = torch.nn.functional.cross_entropy(make_model()(x), y).item()
    for name in names:
        params0, losses, full = r0[name]
        params1 = r1[name][0]
        assert torch.equal(params0, params1), f"{name}: ranks diverged"
        assert math.isfinite(full), name
        assert full < 0.9 * initial, f"{name}: loss {initial:.3f} -> {full:.3f}"


# -- gradient accumulation ---------------------------------------------------------------------
def _accumulation_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression="none", groups=2,
                                  backward_passes_per_step=2)
    mine_x, mine_y = shard(x, rank, 2), shard(y, rank, 2)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        for micro in range(2):
            loss = torch.nn.functional.cross_entropy(model(shard(mine_x, micro, 2)), shard(mine_y, micro, 2)) / 2
            loss.backward()
        opt.step()
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train(reference, ref_opt, x, y, steps=5)
    return (flat_params(model) - flat_params(reference)).abs().max().item()


def test_gradient_accumulation_matches_joined_batch():
    for diff in run_workers(_accumulation_worker, 2):
        assert diff < 1e-5


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 8)
        self.head_a = torch.nn.Linear(8, 4)
        self.head_b = torch.nn.Linear(8, 4)
        self.frozen = torch.nn.Linear(8, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        return self.head_b(h) if use_b else self.head_a(h)


def _unused_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = TwoHeads()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", groups=2)
    for step in range(6):
        # Rank 1 uses head_b on odd steps only; rank 0 never does.
        use_b = rank == 1 and step % 2 == 1
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank, 2), use_b), shard(y, rank, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat_params(model)


def test_parameters_without_gradient_and_frozen_parameters():
    p0, p1 = run_workers(_unused_worker, 2)
    assert torch.equal(p0, p1)


# -- non-finite gradients ----------------------------------------------------------------------
def _nonfinite_worker(rank, policy, set_to_none=True):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", memory="residual", groups=2, nonfinite=policy)
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=2, set_to_none=set_to_none)
    before = flat_params(model)
    if rank == 1:  # a NaN in one weight's gradient, produced during backward
        model[4].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
    loss = torch.nn.functional.cross_entropy(model(shard(x, rank, 2)), shard(y, rank, 2))
    opt.zero_grad(set_to_none=set_to_none)
    loss.backward()
    opt.step()
    residuals = [t for fields in opt.memory.state.values() for t in fields.values()]
    return (torch.equal(before, flat_params(model)), opt.skipped_steps,
            all(torch.isfinite(t).all() for t in residuals))


def test_nonfinite_gradient_raises_on_every_rank_naming_rank_and_group():
    with pytest.raises(WorkerError) as err:
        run_workers(_nonfinite_worker, 2, "raise")
    assert sorted(err.value.tracebacks) == [0, 1]
    for tb in err.value.tracebacks.values():
        assert "FloatingPointError" in tb and "rank 1" in tb and "4.weight" in tb


@pytest.mark.parametrize("set_to_none", [True, False])  # False: the NaN is accumulated in place
def test_nonfinite_gradient_skip_skips_on_all_ranks_and_keeps_memory_finite(set_to_none):
    for unchanged, skipped, finite in run_workers(_nonfinite_worker, 2, "skip", set_to_none):
        assert unchanged and skipped == 1 and finite


def _sign_parts_worker(rank):
    """signSGD sends each group's bits as its parts wrote them; rank 1's NaN sends its group by
    the whole-group route (copied): the same bytes on the wire, so the step completes."""
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="signsgd", groups=2, nonfinite="skip")
    assert all(group.numel % 64 for group in opt.groups)  # bits that end inside an 8-byte word
    poisoned = []
    model[2].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan"))
                                  if rank == 1 and poisoned else grad)
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=2)
    poisoned.append(True)
    before = flat_params(model)
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=1)
    skipped_unchanged = torch.equal(before, flat_params(model))
    poisoned.clear()
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=2)
    return opt.skipped_steps, skipped_unchanged, flat_params(model)


def test_sign_bits_sent_as_written_and_a_rank_copying_its_group_agree_on_the_wire():
    (skipped0, unchanged0, params0), (skipped1, unchanged1, params1) = run_workers(_sign_parts_worker, 2)
    assert skipped0 == skipped1 == 1 and unchanged0 and unchanged1
    assert torch.equal(params0, params1)


def _create_graph_worker(rank, compression, eager):
    import contextlib

    import mergecomp.torch as mc
    from mergecomp.kernels import native

    x, y = make_data()
    results = []
    for create_graph in (False, True):
        model = make_model()
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      compression=compression, groups=2)
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(shard(x, rank, 2)), shard(y, rank, 2))
            opt.zero_grad()
            with native.disabled() if eager else contextlib.nullcontext():  # torch ops would record
                loss.backward(create_graph=create_graph)  # the hooks run with grad mode on
            opt.step()
        results.append((flat_params(model), any(p.grad.requires_grad for p in model.parameters())))
    return results


@pytest.mark.parametrize("compression", ["none", "signsgd"])
@pytest.mark.parametrize("eager", [False, True], ids=["native", "eager"])
def test_backward_with_create_graph_exchanges_the_same_gradients_and_records_nothing(compression, eager):
    for (plain, _), (graph, recorded) in run_workers(_create_graph_worker, 2, compression, eager):
        assert torch.equal(plain, graph) and not recorded


# -- bad input ---------------------------------------------------------------------------------
def _bad_input_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    other = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    cases = {
        "compressor": lambda: mc.DistributedOptimizer(sgd, model.named_parameters(), compression="nope"),
        "memory": lambda: mc.DistributedOptimizer(sgd, model.named_parameters(), compression="topk", memory="nope"),
        "ratio": lambda: mc.DistributedOptimizer(sgd, model.named_parameters(),
                                                 compression=mergecomp.get_compressor("topk", ratio=1.5)),
        "params": lambda: mc.DistributedOptimizer(sgd, other.named_parameters(), compression="none"),
        "groups": lambda: mc.DistributedOptimizer(sgd, model.named_parameters(), compression="none",
                                                  groups=[["0.weight", "missing.weight"]]),
    }
    for case, build in cases.items():
        try:
            build()
        except ValueError as err:
            errors[case] = str(err)
    return errors


def test_bad_input_is_rejected_with_a_message_naming_it():
    errors = run_workers(_bad_input_worker, 1)[0]
    assert "unknown compressor 'nope'" in errors["compressor"] and "topk" in errors["compressor"]
    assert "unknown memory 'nope'" in errors["memory"]
    assert "ratio" in errors["ratio"]
    assert "named_parameters does not match" in errors["params"]
    assert "missing.weight" in errors["groups"]


# -- broadcasts --------------------------------------------------------------------------------
def _broadcast_worker(rank):
    import mergecomp.torch as mc

    model = make_model(seed=rank)                      # different initial weights per rank
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    x, y = make_data(seed=rank)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    sgd.step()                                         # different momentum buffers per rank
    opt = mc.DistributedOptimizer(sgd, model.named_parameters(), compression="none", groups=1)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    mc.broadcast_optimizer_state(opt, root_rank=0)
    momenta = torch.cat([sgd.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return (flat_params(model), momenta, sgd.param_groups[0]["lr"], mc.broadcast_object({"rank": rank}, 1),
            _zero_grad_checks(rank))


def _zero_grad_checks(rank):
    """What broadcast_optimizer_state leaves in ``p.grad`` (zeros, as Horovod), and that training
    after it is unchanged (in the same launch as the broadcast test: a launch costs seconds)."""
    import mergecomp.torch as mc

    x, y = make_data()
    out = {}
    for run in ("zeros", "none"):  # "none": gradients reset to None, as before zeros were left
        model = make_model()
        frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        model.register_parameter("frozen", frozen)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      model.named_parameters(), groups=2)
        mc.broadcast_parameters(model.state_dict(), root_rank=0)
        mc.broadcast_optimizer_state(opt, root_rank=0)
        if run == "zeros":
            out["zero_grads"] = all(p.grad is not None and not p.grad.is_sparse and p.grad.shape == p.shape
                                    and p.grad.dtype == p.dtype and not p.grad.any() for p in trainable)
            out["frozen_none"] = frozen.grad is None
            out["no_state"] = len(opt.state) == 0  # no step was taken
        else:
            for p in trainable:
                p.grad = None
        for step in range(4):
            if step:  # step 0: backward accumulates into what broadcast_optimizer_state left
                opt.zero_grad(set_to_none=step == 1)
            torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
        out["params_" + run] = torch.cat([p.detach().reshape(-1) for p in trainable])
    reference = make_model()
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), x, y, steps=4)
    out["reference"] = flat_params(reference)

    # a plain optimizer: a gradient already there is kept; no step is taken
    lin = torch.nn.Linear(4, 2)
    given = torch.full_like(lin.weight, 7.0)
    lin.weight.grad = given
    adam = torch.optim.Adam(lin.parameters(), lr=0.01)
    mc.broadcast_optimizer_state(adam, root_rank=0)
    out["kept"] = lin.weight.grad is given and bool((given == 7).all())
    out["bias_zero"] = lin.bias.grad is not None and not lin.bias.grad.any()
    adam.step()
    out["adam_step"] = adam.state[lin.weight]["step"].item()
    # once the optimizer has state, missing gradients stay missing
    adam.zero_grad()
    mc.broadcast_optimizer_state(adam, root_rank=0)
    out["stateful_none"] = all(p.grad is None for p in lin.parameters())
    # SparseAdam rejects dense gradients: its zeros are sparse, and the next step works
    emb = torch.nn.Embedding(5, 3, sparse=True)
    before = emb.weight.detach().clone()
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    mc.broadcast_optimizer_state(sparse_adam, root_rank=0)
    out["sparse_zero"] = emb.weight.grad.is_sparse and not emb.weight.grad.to_dense().any()
    emb(torch.tensor([1, 3])).sum().backward()
    sparse_adam.step()
    out["sparse_rows"] = (emb.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    return out


@pytest.fixture(scope="module")
def broadcasts():
    return run_workers(_broadcast_worker, 2)


def test_broadcast_parameters_optimizer_state_and_objects_from_root(broadcasts):
    (p0, m0, lr0, obj0, _), (p1, m1, lr1, obj1, _) = broadcasts
    assert torch.equal(p0, p1) and torch.equal(m0, m1)
    assert lr0 == lr1 == pytest.approx(0.1)
    assert obj0 == obj1 == {"rank": 1}


def test_broadcast_optimizer_state_leaves_zero_gradients_and_training_is_unchanged(broadcasts):
    """As after Horovod's: zero gradients where the optimizer has no state yet (no step taken);
    the DistributedOptimizer's next backward accumulates into them and gives the same result."""
    for *_, out in broadcasts:
        assert out["zero_grads"] and out["frozen_none"] and out["no_state"]
        assert torch.equal(out["params_zeros"], out["params_none"])  # bit for bit as without them
        assert (out["params_zeros"] - out["reference"]).abs().max().item() < 1e-5
        assert out["kept"] and out["bias_zero"] and out["adam_step"] == 1
        assert out["stateful_none"]
        assert out["sparse_zero"] and out["sparse_rows"] == [1, 3]


def _zero_grad_before_step(rank):
    """zero_grad() between backward() and the step that takes the exchanged gradients raises
    AssertionError as Horovod's does, and the step then goes on; after synchronize(), after a
    GradScaler skipped the step (it read param_groups to unscale), and after step() it is
    allowed; with a parameter left without a gradient (the exchange still in flight) it raises."""
    import mergecomp.torch as mc

    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = shard(make_data()[0], rank), shard(make_data()[1], rank)
    loss = lambda scale=1.0: torch.nn.functional.cross_entropy(model(x), y) * scale  # noqa: E731
    seen = {}
    loss().backward()
    try:
        opt.zero_grad()
    except AssertionError as err:
        seen["after backward"] = str(err)
    opt.step()  # the gradients survived the refused zero_grad
    opt.zero_grad()
    loss().backward()
    opt.synchronize()
    opt.zero_grad()  # allowed: synchronize() took them
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss(float("inf") if rank == 1 else 1.0)).backward()
    scaler.step(opt)  # inf: skipped on every rank
    scaler.update()
    opt.zero_grad()  # allowed: unscale_ read param_groups
    (model[0](x).sum() * 0).backward()  # only the first layer gets a gradient: the exchange waits
    try:
        opt.zero_grad()
    except AssertionError as err:
        seen["in flight"] = str(err)
    return seen, scaler.get_scale(), flat_params(model)


def test_zero_grad_between_backward_and_step_raises_as_horovods():
    out = run_workers(_zero_grad_before_step, 2, timeout=120)
    for seen, scale, _ in out:
        assert set(seen) == {"after backward", "in flight"}
        assert all("zero_grad() was called after loss.backward() but before optimizer.step()" in m
                   for m in seen.values())
        assert scale < 2.0 ** 16
    assert torch.equal(out[0][2], out[1][2])
