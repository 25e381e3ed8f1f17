"""Gradients written where they are sent, on real gloo processes: ``p.grad`` stays a view of its
group's buffer across ``zero_grad()`` (either ``set_to_none``; under ``set_to_none=True`` but
where the sign codes encode the gradients where they lie, which it drops), a group of one tensor
is sent from its own gradient, and what users do to gradients (a module's ``zero_grad``, replacing
``p.grad``, clipping, ``GradScaler``, Horovod's predivide factor, a NaN on one rank) gives the
uncompressed single-process result, with a copy only where a gradient was not in place."""
import pytest
import torch
from distributed import run_workers
from test_codecs import needs_kernels
from test_momentum_exchange import run
from test_optimizer_dist import flat_params, make_data, make_model, shard

STEPS = 6


def _steps(model, opt, x, y, zero, steps=STEPS, scaler=None, clip=None, poison=None, rank=0):
    """``steps`` steps, zeroing with ``zero(model, opt, step)``; the breakdown's copy-in passes
    of each step; ``poison``: (rank, step) whose loss is Inf."""
    copied = []
    for t in range(steps):
        run(model, opt, x, y, 1, scaler=scaler, clip=clip, poison=(0,) if poison == (rank, t) else (),
            zero=lambda model, opt, _: zero(model, opt, t))
        if hasattr(opt, "merged"):
            copied.append(sum(g["passes_by_stage"].get("copy-in", 0.0) for g in opt.step_breakdown(1)["groups"]))
    return copied


ZEROS = {
    "opt.zero_grad()": lambda model, opt, t: opt.zero_grad(),
    "opt.zero_grad(set_to_none=False)": lambda model, opt, t: opt.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda model, opt, t: model.zero_grad(),
    "p.grad = zeros at step 3": lambda model, opt, t: (
        opt.zero_grad(), [setattr(p, "grad", torch.zeros_like(p)) for p in model.parameters()] if t == 3 else None),
}


def _views_worker(rank, world, zero, groups, extra):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression="none", groups=groups, **extra)
    copied = _steps(model, opt, shard(x, rank, world), shard(y, rank, world), ZEROS[zero])
    slots = opt.merged.slots
    held = [p.grad is slot for p, slot in zip(model.parameters(), slots)]
    reference, joined = make_model(), world * (x.shape[0] // world)  # the samples the shards hold
    _steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), x[:joined], y[:joined],
           ZEROS[zero])
    return held, [slot is None for slot in slots], copied, (flat_params(model) - flat_params(reference)).abs().max()


@pytest.mark.parametrize("zero", list(ZEROS))
def test_the_slots_stay_the_gradients_and_only_gradients_elsewhere_are_copied(zero):
    """Two groups of three tensors: from the second step every p.grad is its slot and nothing
    is copied in, whichever zero_grad the user calls, but after a module's zero_grad() (which
    drops them) or a gradient the user replaced: those are copied, counted, then slots again."""
    for held, _, copied, diff in run_workers(_views_worker, 2, 2, zero, 2, {}):
        assert diff < 1e-5
        assert all(held)
        if zero == "model.zero_grad()":
            assert all(c > 0 for c in copied[1:])  # the first step is no breakdown sample
        elif zero.startswith("p.grad ="):
            assert copied[1:3] == [0, 0] and copied[3] > 0 and copied[4:] == [0, 0]
        else:
            assert copied[1:] == [0] * (STEPS - 1)


def _wide_worker(rank, world, set_to_none):
    """One group of over STREAM_MIN elements (zeroed by non-temporal stores where the kernels
    are on): after each zero_grad, every p.grad its slot and all zeros."""
    import mergecomp.torch as mc
    from mergecomp.kernels.native import STREAM_MIN

    def wide():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                                   torch.nn.Tanh(), torch.nn.Linear(1024, 4))

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    x, y = make_data()
    model = wide()
    opt = mc.DistributedOptimizer(sgd(model), model.named_parameters(), compression="none", groups=1)
    zeroed = []

    def zero(model, opt, t):
        opt.zero_grad(set_to_none=set_to_none)
        if t:  # from the second step on, the slots are the gradients
            zeroed.append(all(p.grad is slot and not slot.any() for p, slot in zip(model.parameters(),
                                                                                 opt.merged.slots)))
    _steps(model, opt, shard(x, rank, world), shard(y, rank, world), zero, steps=4)
    reference, joined = wide(), world * (x.shape[0] // world)
    _steps(reference, sgd(reference), x[:joined], y[:joined], ZEROS["opt.zero_grad()"], steps=4)
    return ([b.numel() >= STREAM_MIN for b in opt.merged.buffers], zeroed,
            (flat_params(model) - flat_params(reference)).abs().max())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_group_past_the_cache_is_zeroed_for_the_next_backward(set_to_none):
    """A group large enough to be filled past the cache: zeros in every slot after zero_grad(),
    and the parameters of the uncompressed single-process run on 2 ranks."""
    for large, zeroed, diff in run_workers(_wide_worker, 2, 2, set_to_none):
        assert large == [True] and zeroed == [True] * 3
        assert diff < 1e-5


@pytest.mark.parametrize("world", [3, 4])
def test_a_group_of_one_tensor_is_sent_from_its_gradient(world):
    """Layer-wise groups: no buffer, no slot, no copy; each result lands in p.grad itself, exact
    on 3 and 4 ranks; and Horovod's gradient_predivide_factor scales once."""
    for held, bufferless, copied, diff in run_workers(_views_worker, world, world, "opt.zero_grad()", "layerwise",
                                                      {"gradient_predivide_factor": 2.0}):
        assert diff < 1e-5
        assert all(bufferless) and not any(held)
        assert copied[1:] == [0] * (STEPS - 1)


def _scaler_worker(rank, poison, compression):
    import mergecomp.torch as mc

    x, y = make_data()
    out = []
    for wrapped in (True, False):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if wrapped:
            opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=compression, groups=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
        xs, ys = (shard(x, rank), shard(y, rank)) if wrapped else (x, y)
        _steps(model, opt, xs, ys, ZEROS["opt.zero_grad()"], scaler=scaler, clip=0.5,  # the Inf at step 2 either way
               poison=poison if wrapped else (0, poison[1]) if poison else None, rank=rank if wrapped else 0)
        out.append((flat_params(model), scaler.get_scale()))
    return out


@pytest.mark.parametrize("poison", [None, (1, 2)])
def test_grad_scaler_and_clipping_on_the_slots_match_one_process(poison):
    """``GradScaler`` (unscale_, step, update) and ``clip_grad_norm_`` work on the slots in
    place; an Inf on rank 1 in a step of plain sums (no NaN/Inf check: the sum carries it to
    every rank) makes every rank skip it and halve the scale, as one process does."""
    for (params, scale), (reference, reference_scale) in run_workers(_scaler_worker, 2, poison, "none"):
        assert scale == reference_scale == (2.0 ** 11 if poison else 2.0 ** 12)
        assert (params - reference).abs().max() < 1e-5


def _topk_poison_worker(rank, poisoned):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", groups=2)
    nan_results, checks = None, []
    for t in range(5):
        opt.zero_grad()
        if t == 2 and not poisoned:
            continue  # the twin run: as if the poisoned step had never happened
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank))
        (loss * float("inf") if t == 2 and rank == 1 else loss).backward()
        if t == 2:
            opt.synchronize()  # what GradScaler does with a step whose gradients are not finite
            nan_results = all(bool(p.grad.isnan().all()) for p in model.parameters())
            with opt.skip_synchronize():
                pass
        else:
            opt.step()
        checks.append(sum(g["passes_by_stage"].get("check", 0.0) for g in opt.step_breakdown(1)["groups"]))
    return flat_params(model), nan_results, checks


def test_topk_checks_the_slots_in_its_scan_and_a_nan_step_leaves_no_trace():
    """Top-k's fused scan is the NaN/Inf check of gradients lying in their slots (no pass of its
    own): an Inf on rank 1 makes every rank's result NaN (the default ``propagate``) and puts the
    error feedback back, so that skipping the step ends where a run without it ends, bit for bit."""
    poisoned, twin = (run_workers(_topk_poison_worker, 2, flag) for flag in (True, False))
    for (params, nan_results, checks), (reference, _, _) in zip(poisoned, twin):
        assert nan_results is True
        assert checks[2:] == [0.0] * 3  # the slots from the 2nd step on: no check pass, the poisoned step too
        assert torch.equal(params, reference)


def _parts_worker(rank, world, compression):
    import mergecomp.torch as mc

    x, y = make_data()
    x, y = shard(x, rank, world), shard(y, rank, world)
    out = []
    for set_to_none in (True, False):
        model = make_model()
        model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))  # never gets a gradient
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      model.named_parameters(), compression=compression, groups=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
        dropped, held, copied = [], [], []
        for t in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            dropped.append(all(p.grad is None for p in model.parameters()))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss * float("inf") if (t, rank) == (3, 1) else loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            held.append(all(p.grad is slot for p, slot in zip(model.parameters(), opt.merged.slots)))
            copied.append(sum(g["passes_by_stage"].get("copy-in", 0.0) for g in opt.step_breakdown(1)["groups"]))
        out.append((flat_params(model), dropped, held, copied, scaler.get_scale()))
    return out


@needs_kernels
@pytest.mark.parametrize("compression,world", [("signsgd", 2), ("onebit", 3)])
def test_gradients_encoded_where_they_lie_are_dropped_by_zero_grad_and_nothing_is_written_into_the_groups(
        compression, world):
    """The sign codes encode each gradient where autograd left it: zero_grad() drops those
    gradients as torch does (no fill of their groups, no accumulation into the slots) and the
    step's result is a view of its group again, nothing copied in but a parameter without a
    gradient's zeros.  With a GradScaler, clipping and an Inf on one rank, the parameters end
    bit for bit where zero_grad(set_to_none=False), which keeps the slots and fills them, ends."""
    for (params, dropped, held, copied, scale), (kept, kept_dropped, kept_held, kept_copied, kept_scale) in run_workers(
            _parts_worker, world, world, compression):
        assert scale == kept_scale == 2.0 ** 11  # the Inf on rank 1 at step 3 skipped that step on every rank
        assert torch.equal(params, kept)
        assert all(dropped) and all(held)
        assert not any(kept_dropped[1:]) and all(kept_held)
        # from the 2nd step on, only the unused parameter's zeros are written in, either way
        assert copied[1:] == kept_copied[1:] and all(0 < c < 0.01 for c in copied[1:])
