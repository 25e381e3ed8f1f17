"""Adam's momentum exchanged through mergecomp's DDP hook (``exchange_momentum_after``) on real
gloo processes: lossless equals the one-process reference of the algorithm (the same one the
DistributedOptimizer path is held to), compressors keep the ranks identical and learn, a
GradScaler's overflow skips the step everywhere, a checkpoint resumes exactly, bad settings
raise naming the option."""
import io

import pytest
import torch
from distributed import WorkerError, run_workers
from test_ddp_hook import BUCKET_MB
from test_momentum_exchange import AFTER, STEPS, make_adam, make_schedule, reference
from test_momentum_exchange import run as train
from test_optimizer_dist import flat_params, make_data, make_model, shard


def hooked(compression="none", per_tensor=False, scaler=None, fused=False, **options):
    """The test model in DDP with the hook exchanging AdamW's momentum: ``(ddp, opt, state)``."""
    import mergecomp.torch as mc

    model = make_model()
    caps = {"bucket_cap_mb_list": [1e-6]} if per_tensor else {"bucket_cap_mb": BUCKET_MB}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **caps)
    opt = make_adam(model, fused=fused)
    state, hook = mc.ddp_comm_hook(compression, named_parameters=model.named_parameters(),
                                   exchange_momentum_after=AFTER, optimizer=opt, grad_scaler=scaler, **options)
    ddp.register_comm_hook(state, hook)
    return ddp, opt, state


def _lossless_worker(rank, per_tensor, refresh, closure, exempt=()):
    x, y = make_data()
    ddp, opt, state = hooked(per_tensor=per_tensor, variance_refresh_every=refresh, uncompressed=list(exempt))
    train(ddp, opt, shard(x, rank), shard(y, rank), STEPS, make_schedule(opt), closure=closure)
    return flat_params(ddp.module), state.momentum.exchange.active, len(state.layout)


@pytest.mark.parametrize("per_tensor,refresh,closure,exempt", [
    (False, None, False, ()), (True, None, False, ()), (False, 2, False, ()), (False, None, True, ()),
    (False, None, False, ("0.bias", "4.*"))])
def test_lossless_through_the_hook_equals_the_one_process_reference(per_tensor, refresh, closure, exempt):
    """The hook's buckets are the groups (a bucket holding exempt parameters: two groups, each
    transformed in its own buffer and its result copied back after the averaged momentum is
    formed); the optimizer's own step() (called by the user, with an LR schedule; or given a
    closure that runs the backward pass) runs the frozen-variance update."""
    expected = reference(2, STEPS, "AdamW", refresh=refresh)
    assert (expected - reference(2, STEPS, "AdamW", after=STEPS)).abs().max() > 1e-4  # the test can fail
    for params, active, buckets in run_workers(_lossless_worker, 2, per_tensor, refresh, closure, exempt):
        assert active and buckets > 1
        torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)


def _compressor_worker(rank, names):
    import mergecomp.torch as mc

    x, y = make_data()
    out = {}
    for name in names:  # the first and last layers' biases exempt: buckets split in two
        ddp, opt, state = hooked(name, compression_warmup_steps=2, uncompressed=["0.bias", "4.bias"])
        before = torch.nn.functional.cross_entropy(ddp.module(x), y).item()
        train(ddp, opt, shard(x, rank), shard(y, rank), 20, clip=1.0)
        after = torch.nn.functional.cross_entropy(ddp.module(x), y).item()
        gathered = mc.allgather(flat_params(ddp.module).unsqueeze(0))
        out[name] = (bool((gathered == gathered[0]).all()), before, after, state.momentum.exchange.active)
    return out


def test_compressors_through_the_hook_keep_the_ranks_identical_and_learn():
    """With clipping through torch's clip_grad_norm_ on the averaged momentum in p.grad."""
    for result in run_workers(_compressor_worker, 2, ["onebit", "topk", "powersgd", "qsgd"], timeout=300):
        for name, (identical, before, after, active) in result.items():
            assert identical and active, name
            assert after < before, (name, before, after)


def _scaler_worker(rank, poison, fused=False):
    x, y = make_data()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    ddp, opt, state = hooked(scaler=scaler, fused=fused)
    train(ddp, opt, shard(x, rank), shard(y, rank), STEPS, make_schedule(opt), scaler=scaler, poison=poison)
    return flat_params(ddp.module), scaler.get_scale(), state.momentum.exchange.updates


@pytest.mark.parametrize("fused", [False, True])
def test_a_grad_scaler_changes_nothing_and_its_overflow_skips_the_step_everywhere(fused):
    """The momentum goes on the wire in the loss scale and comes back unscaled by the scaler (a
    fused AdamW's step gets the scale handed over instead: the update divides it out): the
    lossless run equals the reference; an Inf in the warm-up or the momentum phase skips that
    step on every rank (not counted as an update) and halves the scale."""
    expected = reference(2, STEPS, "AdamW")
    for params, scale, updates in run_workers(_scaler_worker, 2, (), fused):
        assert scale == 2.0 ** 10 and updates == STEPS
        torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)
    for poison in (1, AFTER + 2):
        results = run_workers(_scaler_worker, 2, (poison,), fused)
        assert torch.equal(results[0][0], results[1][0]) and torch.isfinite(results[0][0]).all()
        assert all(scale == 2.0 ** 9 and updates == STEPS - 1 for _, scale, updates in results)


def _resume_worker(rank, compression):
    # per-tensor buckets from the start: a fresh DDP's first buckets are then the trained one's
    # (else the first step after the restart groups, and so compresses, differently)
    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)
    ddp, opt, state = hooked(compression, per_tensor=True)
    schedule = make_schedule(opt)
    train(ddp, opt, *mine, AFTER + 2, schedule)
    saved = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "schedule": schedule.state_dict(),
                "hook": state.state_dict()}, saved)
    train(ddp, opt, *mine, 4, schedule)
    straight = flat_params(ddp.module)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    ddp, opt, state = hooked(compression, per_tensor=True)  # a fresh process's objects, as a restart makes them
    ddp.module.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    schedule = make_schedule(opt)
    schedule.load_state_dict(checkpoint["schedule"])
    state.load_state_dict(checkpoint["hook"])
    train(ddp, opt, *mine, 4, schedule)
    return straight, flat_params(ddp.module), "mergecomp_momentum" in checkpoint["hook"]


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_resume_in_the_momentum_phase_continues_exactly(compression):
    for straight, resumed, kept in run_workers(_resume_worker, 2, compression):
        assert kept and torch.equal(straight, resumed)


def _bad_worker(rank, case):
    import mergecomp.torch as mc

    model = make_model()
    if case == "sgd":
        mc.ddp_comm_hook("onebit", named_parameters=model.named_parameters(), exchange_momentum_after=2,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    elif case == "without the option":
        mc.ddp_comm_hook("onebit", named_parameters=model.named_parameters(), optimizer=make_adam(model))
    elif case == "unnamed":
        mc.ddp_comm_hook("onebit", exchange_momentum_after=2)
    elif case == "other parameters":
        mc.ddp_comm_hook("onebit", named_parameters=model.named_parameters(), exchange_momentum_after=2,
                         optimizer=make_adam(make_model()))
    elif case == "no optimizer":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state, hook = mc.ddp_comm_hook("onebit", named_parameters=model.named_parameters(),
                                       exchange_momentum_after=2)
        ddp.register_comm_hook(state, hook)
        x, y = make_data()
        torch.nn.functional.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()


@pytest.mark.parametrize("case,match", [
    ("sgd", "needs a torch.optim.Adam or AdamW, got SGD"), ("without the option", "optimizer is only used with"),
    ("unnamed", "pass named_parameters"),
    ("other parameters", "does not hold 6 of the parameters"), ("no optimizer", "call state.set_optimizer")])
def test_bad_settings_raise_naming_the_problem_on_every_rank(case, match):
    with pytest.raises(WorkerError, match=match) as raised:
        run_workers(_bad_worker, 2, case)
    tracebacks = raised.value.tracebacks
    assert sorted(tracebacks) == [0, 1] and all(match in tb.strip().splitlines()[-1] for tb in tracebacks.values())


def _nan_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    ddp, opt, state = hooked("onebit")
    train(ddp, opt, shard(x, rank), shard(y, rank), STEPS, make_schedule(opt), poison=(AFTER + 2,) if rank else ())
    gathered = mc.allgather(flat_params(ddp.module).unsqueeze(0))
    return bool(torch.isfinite(gathered).all()), bool((gathered == gathered[0]).all()), state.momentum.exchange.updates


def test_a_nan_in_the_momentum_phase_skips_the_update_on_every_rank():
    """No GradScaler: the optimizer's step() on a step whose exchange held NaN/Inf applies
    nothing (not Adam's own step either) and is not counted."""
    for finite, identical, updates in run_workers(_nan_worker, 2):
        assert finite and identical and updates == STEPS - 1


def _again_worker(rank):
    x, y = make_data()
    out = []
    for again in (False, True):
        ddp, opt, state = hooked("onebit")
        train(ddp, opt, shard(x, rank), shard(y, rank), AFTER + 2)
        if again:  # as a framework's second fit()/train() hands the same optimizer over again
            state.set_optimizer(opt)
        train(ddp, opt, shard(x, rank), shard(y, rank), 3)
        out.append(flat_params(ddp.module))
    return out


def test_handing_the_same_optimizer_over_again_keeps_the_exchange_as_it_is():
    for once, again in run_workers(_again_worker, 2):
        assert torch.equal(once, again)


def _split_bucket_worker(rank):
    x, y = make_data()
    grads = []
    for compression in ("none", "onebit"):  # the exempt bias travels exactly either way
        ddp, opt, state = hooked(compression, uncompressed=["0.bias"])
        train(ddp, opt, shard(x, rank), shard(y, rank), AFTER)  # the lossless warm-up: the same state
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(shard(x, rank)), shard(y, rank)).backward()  # the phase's first
        grads.append(ddp.module[0].bias.grad.clone())
    return grads


def test_an_exempt_parameter_of_a_split_bucket_gets_the_averaged_momentum_not_the_wire():
    """The part of a split bucket goes back into DDP's bucket after the averaged momentum is formed:
    in the momentum phase's first step the exempt bias's p.grad under 1-bit SGD is the averaged
    momentum, as with the lossless exchange, not what went on the wire (divided by Adam's
    denominator)."""
    for lossless, onebit in run_workers(_split_bucket_worker, 2):
        torch.testing.assert_close(onebit, lossless, rtol=0, atol=1e-7)
