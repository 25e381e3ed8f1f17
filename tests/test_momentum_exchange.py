"""DistributedOptimizer(..., exchange_momentum_after=K) on real gloo processes: the lossless run
equals a one-process reference of the algorithm bit for bit, every averaging compressor keeps the
ranks identical, resume continues exactly, a GradScaler's overflow skips the step everywhere,
bad options raise."""
import contextlib
import io
import math

import pytest
import torch
from distributed import WorkerError, run_workers
from test_optimizer_dist import flat_params, make_data, make_model, shard

import mergecomp
from mergecomp.kernels.frozen_adam import inv_bound2
from mergecomp.torch.momentum_exchange import wire_bound

AFTER = 4  # warm-up updates
STEPS = 10
LR = 1e-2


def make_adam(model, kind="AdamW", **kwargs):
    cls = getattr(torch.optim, kind)
    return cls(model.parameters(), lr=LR, weight_decay=0.1, **kwargs)


def make_schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def run(model, opt, x, y, steps, schedule=None, scaler=None, poison=(), clip=None, closure=False, zero=None):
    """``steps`` training steps; the gradient is Inf at the steps in ``poison``; ``clip``: the
    (unscaled) gradients clipped to that norm; ``closure``: the forward and backward pass run
    inside ``opt.step(closure)``, as Lightning runs them (no scaler, clipping or poison);
    ``zero(model, opt, step)`` zeroes the gradients (default ``opt.zero_grad()``)."""
    for t in range(steps):
        if closure:
            def forward_backward():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(forward_backward)
        else:
            if zero:
                zero(model, opt, t)
            else:
                opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if t in poison:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler and clip:
                scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if schedule:
            schedule.step()


def average(tensors, half=False):
    """The ranks' average as the exchange computes it: summed as they are, or (``half``) cast to
    fp16 and summed in fp16 (``compression_warmup_codec="fp16"``), divided in fp32."""
    return sum(t.half() if half else t for t in tensors).float() / len(tensors)


def reference(world, steps, kind, after=AFTER, refresh=None, half=False, device="cpu"):
    """The algorithm on one process: each rank's gradient computed here; the averaged gradient
    through torch's Adam for ``after`` updates, then each rank's momentum
    ``(1 - b1) * (g + wd * p [Adam]) + b1 * m`` averaged, and Adam's update with the variance of
    update ``after`` (raised where Adam's bound ``|m| <= B sqrt(v)`` needs it); at the phase's updates 1, 2, 4, ... below ``refresh`` and every
    ``refresh``-th after that, the averaged gradient refreshes the variance with the weight of
    the steps since it was last written.  ``half``: the warm-up's and the refreshes' averages
    are taken in fp16.  Computed on ``device``; the parameters returned on the CPU."""
    x, y = (t.to(device) for t in make_data())
    model = make_model().to(device)
    opt = make_adam(model, kind)
    schedule = make_schedule(opt)
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    written = after  # the update that last wrote the variance
    for t in range(steps):
        local = []
        for rank in range(world):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            local.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            if t < after:
                for k, p in enumerate(model.parameters()):
                    p.grad = average([grads[k] for grads in local], half)
                opt.step()
            else:
                lr, decay = group["lr"], group["weight_decay"]
                n = t - after + 1  # refreshed at the phase's updates 1, 2, 4, ... below R, then every R
                refreshing = refresh and (n % refresh == 0 or (n < refresh and n & (n - 1) == 0))
                gap = t + 1 - written
                if refreshing:
                    written = t + 1
                for k, p in enumerate(model.parameters()):
                    state = opt.state[p]
                    sent = []
                    for grads in local:
                        g = grads[k].clone()
                        if not refreshing:
                            g.mul_(1 - beta1)
                        if kind == "Adam":
                            g.add_(p, alpha=(1 if refreshing else 1 - beta1) * decay)
                        sent.append(g if refreshing else g.add_(state["exp_avg"], alpha=beta1))
                    mean = average(sent, half and refreshing)
                    if refreshing:
                        state["exp_avg"].lerp_(mean, 1 - beta1)
                        state["exp_avg_sq"].mul_(beta2 ** gap).addcmul_(mean, mean, value=1 - beta2 ** gap)
                    else:
                        state["exp_avg"].copy_(mean)
                    m = state["exp_avg"]  # Adam's own bound on the variance: v >= (m / B)^2
                    torch.maximum(state["exp_avg_sq"], m * m * inv_bound2(beta1, beta2), out=state["exp_avg_sq"])
                    state["step"] += 1
                    if kind == "AdamW":
                        p.mul_(1 - lr * decay)
                    step = float(state["step"])
                    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** written)).add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))
        schedule.step()
    return flat_params(model).cpu()


def _lossless_worker(rank, world, kind, groups, refresh, fused, half=False, device="cpu"):
    import mergecomp.torch as mc
    from mergecomp.kernels import native

    x, y = (t.to(device) for t in make_data())
    model = make_model().to(device)
    opt = mc.DistributedOptimizer(make_adam(model, kind), model.named_parameters(), groups=groups,
                                  exchange_momentum_after=AFTER, variance_refresh_every=refresh,
                                  compression_warmup_codec="fp16" if half else "none")
    with contextlib.nullcontext() if fused else native.disabled():
        run(model, opt, shard(x, rank, world), shard(y, rank, world), STEPS, make_schedule(opt))
    return flat_params(model).cpu(), opt.momentum_exchange.active


@pytest.mark.parametrize("world,kind,groups,refresh,fused", [
    (2, "AdamW", 2, None, False), (2, "Adam", "layerwise", None, False), (3, "AdamW", 1, None, False),
    (2, "AdamW", 2, 2, False), (2, "Adam", 1, 3, False), (2, "AdamW", 2, 2, True)])
def test_lossless_equals_the_one_process_reference(world, kind, groups, refresh, fused):
    """Bit for bit on the torch path; within an ulp or so of each step with the fused update
    kernel (its square root is correctly rounded, torch's is not)."""
    expected = reference(world, STEPS, kind, refresh=refresh)
    without_freeze = reference(world, STEPS, kind, after=STEPS)  # Adam throughout: the test can fail
    assert (expected - without_freeze).abs().max() > 1e-4
    if refresh:
        assert not torch.equal(expected, reference(world, STEPS, kind))
    for params, active in run_workers(_lossless_worker, world, world, kind, groups, refresh, fused):
        assert active
        if world == 2 and not fused:
            assert torch.equal(params, expected)
        else:  # three ranks' sum: the collective's order of additions
            torch.testing.assert_close(params, expected, rtol=0, atol=1e-6)


def test_an_fp16_warmup_and_fp16_refreshes_equal_the_reference_with_fp16_averages():
    expected = reference(2, STEPS, "AdamW", refresh=2, half=True)
    assert not torch.equal(expected, reference(2, STEPS, "AdamW", refresh=2))
    for params, active in run_workers(_lossless_worker, 2, 2, "AdamW", 2, 2, False, True):
        assert active and torch.equal(params, expected)


def _plan_change_worker(rank, world, plans):
    """The lossless exchange with AdamW, its plan changed to each of ``plans`` in turn during the
    momentum phase; the parameters, Adam's state in the state dict (views of the flat groups)
    and the bytes ``torch.save`` writes for it, then and in the warm-up."""
    import mergecomp.torch as mc
    from mergecomp.kernels import native

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), groups=2,
                                  exchange_momentum_after=AFTER)
    schedule, xs, ys = make_schedule(opt), shard(x, rank, world), shard(y, rank, world)
    sizes = []
    for segment, plan in enumerate([None, *plans]):
        if plan is not None:
            opt.set_plan(plan)
        with native.disabled():  # torch's operators, as the reference's: bit for bit
            run(model, opt, xs, ys, AFTER if segment == 0 else (STEPS - AFTER) // len(plans), schedule)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        sizes.append(buffer.tell())
    states = [opt.state[p]["exp_avg"] for p in model.parameters()]
    return flat_params(model), sizes, opt.momentum_exchange.active, [s.is_contiguous() for s in states]


def test_a_plan_change_in_the_momentum_phase_moves_the_flat_state_and_stays_exact():
    """Adam's momentum and variance live in flat buffers per group; when the plan changes in the
    momentum phase they move to the new groups, and the lossless run still equals the
    one-process reference bit for bit; a checkpoint of the state (views of the buffers) is no
    larger than in the warm-up, when they were tensors of their own."""
    expected = reference(2, STEPS, "AdamW")
    for params, sizes, active, contiguous in run_workers(_plan_change_worker, 2, 2, ["layerwise", 1, 3]):
        assert active and all(contiguous)
        assert torch.equal(params, expected)
        assert max(sizes[1:]) < 1.05 * sizes[0], sizes


def _dropped_grad_worker(rank):
    """In the momentum phase, one parameter's p.grad set to None between backward and step."""
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression="onebit", groups=2,
                                  exchange_momentum_after=AFTER)
    run(model, opt, shard(x, rank), shard(y, rank), AFTER + 2)
    dropped, kept = model[0].weight, model[2].weight
    before = [t.detach().clone() for t in (dropped, kept)] + [opt.state[t]["step"].clone() for t in (dropped, kept)]
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank)).backward()
    dropped.grad = None
    opt.step()
    after = [dropped.detach(), kept.detach(), opt.state[dropped]["step"], opt.state[kept]["step"]]
    unchanged = [torch.equal(a, b) for a, b in zip(before, after)]
    run(model, opt, shard(x, rank), shard(y, rank), 2)  # and training goes on
    gathered = mc.allgather(flat_params(model).unsqueeze(0))
    return unchanged, bool((gathered == gathered[0]).all())


def test_a_gradient_dropped_before_step_leaves_its_parameter_and_step_count_alone():
    for unchanged, identical in run_workers(_dropped_grad_worker, 2):
        assert unchanged == [True, False, True, False] and identical


def _compressor_worker(rank, names, scheme, refresh, world=2, device="cpu", warmup_codec="none", send="momentum"):
    import mergecomp.torch as mc

    x, y = (t.to(device) for t in make_data())
    out = {}
    for name in names:  # a registry name, or (name, its keyword arguments)
        model = make_model().to(device)
        compression = name if isinstance(name, str) else mergecomp.get_compressor(name[0], **name[1])
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression=compression, groups=2,
                                      exchange_momentum_after=AFTER, scheme=scheme, compression_warmup_steps=2,
                                      variance_refresh_every=refresh, compression_warmup_codec=warmup_codec,
                                      exchange_momentum_as=send)
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        before = torch.nn.functional.cross_entropy(model(x), y).item()
        run(model, opt, xs, ys, 20)
        after = torch.nn.functional.cross_entropy(model(x), y).item()
        params = flat_params(model)
        gathered = mc.allgather(params.unsqueeze(0))
        out[str(name)] = (bool((gathered == gathered[0]).all()), before, after,
                     sorted(opt.memory.state) if opt.memory.feeds_back else None)
    return out


AVERAGING = [n for n in mergecomp.compressor_names() if not mergecomp.get_compressor(n).votes and n != "dgc"]


@pytest.mark.parametrize("scheme,refresh", [(None, None), ("two-phase", 3)])
def test_every_averaging_compressor_keeps_ranks_identical_and_learns(scheme, refresh):
    shardable = [n for n in AVERAGING if (c := mergecomp.get_compressor(n)).rounds == 1 and not c.low_rank]
    names = AVERAGING if scheme is None else shardable
    for result in run_workers(_compressor_worker, 2, names, scheme, refresh, timeout=300):
        for name, (identical, before, after, _) in result.items():
            assert identical, name
            assert math.isfinite(after) and after < before, (name, before, after)


@pytest.mark.parametrize("scheme", [None, "two-phase"])
def test_sending_the_increment_keeps_ranks_identical_and_learns(scheme):
    """``exchange_momentum_as="increment"`` with a sign code, a sparsifier, a quantizer and a
    low-rank codec (also with bf16 factors), the variance refreshed, each with its error feedback."""
    low_rank = ["powersgd", ("powersgd", {"rank": 2, "factor_dtype": "bf16"}), ("acpsgd", {"factor_dtype": "bf16"})]
    names = ["onebit", "topk", "qsgd"] + (low_rank if scheme is None else [])
    for result in run_workers(_compressor_worker, 2, names, scheme, 3, 2, "cpu", "none", "increment", timeout=300):
        for name, (identical, before, after, _) in result.items():
            assert identical, name
            assert math.isfinite(after) and after < before, (name, before, after)


@pytest.mark.parametrize("codec", ["qsgd", "qsgd4"])
def test_a_qsgd_warmup_and_refreshes_keep_ranks_identical_and_learn(codec):
    """``compression_warmup_codec="qsgd"`` (8-bit) or ``"qsgd4"``: the warm-up's and the
    refreshes' gradients arrive quantized (each rank draws its own rounding), and every rank
    still averages the same."""
    for result in run_workers(_compressor_worker, 2, ["onebit", "topk"], None, 3, 2, "cpu", codec, timeout=300):
        for name, (identical, before, after, _) in result.items():
            assert identical, name
            assert math.isfinite(after) and after < before, (name, before, after)


@pytest.mark.parametrize("scheme", [None, "two-phase"])
def test_four_ranks_stay_identical_and_learn(scheme):
    """Four ranks, the variance refreshed: a sign code, a sparsifier, a quantizer and a low-rank
    codec, each with its error feedback (under two-phase the second stage's too)."""
    names = ["onebit", "topk", "qsgd"] + (["powersgd"] if scheme is None else [])
    for result in run_workers(_compressor_worker, 4, names, scheme, 3, 4, timeout=300):
        for name, (identical, before, after, _) in result.items():
            assert identical, name
            assert math.isfinite(after) and after < before, (name, before, after)


def _auto_worker(rank, world):
    import dataclasses

    import mergecomp.torch as mc
    import mergecomp.torch.momentum_exchange as exchange

    # every candidate measured, whatever this machine's load made the predictions
    exchange.SEARCH = dataclasses.replace(exchange.SEARCH, prune_ratio=1e9)
    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression="onebit",
                                  exchange_momentum_after=AFTER)  # groups="auto": the scheduler searches
    installed, set_plan = [], opt.merged.set_plan
    opt.merged.set_plan = lambda plan: (installed.append(tuple(plan.codec_names())), set_plan(plan))
    run(model, opt, shard(x, rank, world), shard(y, rank, world), 30)
    gathered = mc.allgather(flat_params(model).unsqueeze(0))
    return bool((gathered == gathered[0]).all()), opt.schedule_report(), installed


def test_the_scheduler_searches_the_momentum_phase_on_three_ranks():
    """It searches, and only plans that send every group with the compressor: a probe sending a
    group as fp16 or uncompressed would hand the momentum that group's whole residual at once."""
    for identical, report, installed in run_workers(_auto_worker, 3, 3):
        assert identical
        assert report["phase"] != "fixed" and len(installed) > 1
        tried = [tuple(c["codecs"]) for c in report["candidates"]] + installed
        assert not [codecs for codecs in tried if {"fp16", "none"} & set(codecs)], tried


def _resume_worker(rank, compression, who_loads, save_at, refresh, send="momentum", grow_at=None):
    import mergecomp.torch as mc

    x, y = make_data()
    xs, ys = shard(x, rank), shard(y, rank)

    def fresh():
        model = make_model()
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression=compression,
                                      groups=2, exchange_momentum_after=AFTER, variance_refresh_every=refresh,
                                      exchange_momentum_as=send)
        return model, opt

    def train(model, opt, begin, end):  # the loss 10,000 times larger from update grow_at on
        for t in range(begin, end):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs), ys)
            (loss * (1e4 if grow_at is not None and t >= grow_at else 1.0)).backward()
            opt.step()

    model, opt = fresh()
    train(model, opt, 0, save_at)
    buffer = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    train(model, opt, save_at, save_at + 4)
    uninterrupted = flat_params(model)

    model, opt = fresh()
    if who_loads == "every rank" or rank == 0:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    mc.broadcast_optimizer_state(opt, root_rank=0)
    interval = opt.momentum_exchange.refresh_interval
    train(model, opt, save_at, save_at + 4)
    return flat_params(model), uninterrupted, opt.momentum_exchange.active, interval


@pytest.mark.parametrize("compression,who_loads,save_at,refresh,send,grow_at", [
    ("topk", "every rank", AFTER + 2, None, "momentum", None),  # momentum phase: the momentum's residuals, per rank
    ("onebit", "every rank", AFTER - 1, 2, "momentum", None),  # saved in the warm-up: the freeze comes after resuming
    ("none", "rank 0", AFTER + 2, None, "momentum", None),      # rank 0's checkpoint, broadcast: phase and coefficients
    ("efsignsgd", "every rank", AFTER + 1, 3, "momentum", None),  # refreshes on both sides of the checkpoint
    ("powersgd", "every rank", AFTER + 2, 3, "increment", None),  # the increments' residuals and PowerSGD's Q
    ("onebit", "every rank", AFTER + 5, 4, "momentum", AFTER + 2),  # saved with the interval halved by grown gradients
])
def test_resume_continues_exactly(compression, who_loads, save_at, refresh, send, grow_at):
    for resumed, uninterrupted, active, interval in run_workers(_resume_worker, 2, compression, who_loads, save_at,
                                                                refresh, send, grow_at):
        assert active
        assert interval == (refresh if grow_at is None or refresh is None else refresh // 2)
        assert torch.equal(resumed, uninterrupted)


def _scaler_worker(rank, poison_rank, device="cpu", fused=False, clip=None, poison_at=AFTER + 2):
    import mergecomp.torch as mc

    x, y = (t.to(device) for t in make_data())
    xs, ys = shard(x, rank), shard(y, rank)
    results = []
    for use_scaler in (False, True):
        model = make_model().to(device)
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0 ** 10,
                                      growth_interval=1000) if use_scaler else None
        opt = mc.DistributedOptimizer(make_adam(model, fused=fused), model.named_parameters(), compression="none",
                                      groups=2, exchange_momentum_after=AFTER, grad_scaler=scaler)
        poison = (poison_at,) if use_scaler and rank == poison_rank else ()
        run(model, opt, xs, ys, STEPS + (1 if use_scaler else 0), scaler=scaler, poison=poison, clip=clip)
        results.append((flat_params(model).cpu(), opt.momentum_exchange.updates,
                        scaler.get_scale() if scaler else None))
    return results


@pytest.mark.parametrize("fused,clip,poison_at", [
    (False, None, AFTER + 2), (True, None, AFTER + 2), (True, 1.0, AFTER + 2), (True, None, 1)])
def test_grad_scaler_skips_an_overflow_everywhere_and_otherwise_changes_nothing(fused, clip, poison_at):
    """With a fused Adam the scaler hands its step the loss scale and the overflow instead of
    unscaling and skipping it (unless ``unscale_`` ran first, for clipping): the frozen-variance
    update divides the scale out and leaves a step with an overflow alone, in the momentum
    phase and (not counted) in the warm-up."""
    for (plain, plain_updates, _), (scaled, scaled_updates, scale) in run_workers(_scaler_worker, 2, 1, "cpu",
                                                                                    fused, clip, poison_at):
        assert scaled_updates == plain_updates == STEPS  # one step more, one skipped
        assert scale == 2.0 ** 9  # the overflow halved it on this rank too
        assert torch.equal(scaled, plain)  # powers of two: the loss scale cancels exactly


def _unnamed_scaler_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(make_adam(model, fused=True), model.named_parameters(), compression="none",
                                  exchange_momentum_after=AFTER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    try:
        run(model, opt, shard(x, rank), shard(y, rank), 1, scaler=scaler)
    except ValueError as err:
        return str(err)
    return None


def test_a_grad_scaler_the_exchange_was_not_given_raises_on_every_rank():
    """A fused Adam shows the scaler stepping it (it hands the step its scale): without
    ``grad_scaler=`` the momentum would go on the wire out of the loss scale, so the first
    step raises, naming the option, on every rank."""
    for message in run_workers(_unnamed_scaler_worker, 2):
        assert message is not None and "pass grad_scaler=scaler" in message, message


def _unused_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    spare = torch.nn.Parameter(torch.ones(3))  # in the optimizer, never in the loss
    frozen_late = model[4].bias  # gets no gradient after the warm-up
    adam = torch.optim.AdamW([*model.parameters(), spare], lr=LR, weight_decay=0)
    opt = mc.DistributedOptimizer(adam, [*model.named_parameters(), ("spare", spare)], compression="efsignsgd",
                                  exchange_momentum_after=AFTER)
    run(model, opt, shard(x, rank), shard(y, rank), AFTER)
    moved = frozen_late.detach().clone()
    frozen_late.requires_grad_(False)
    run(model, opt, shard(x, rank), shard(y, rank), 3)
    gathered = mc.allgather(flat_params(model).unsqueeze(0))
    return (torch.equal(gathered[0], gathered[1]), (spare.detach() - 1).abs().max().item(),
            torch.equal(frozen_late.detach(), moved), bool(torch.isfinite(gathered).all()))


def test_parameters_without_gradients():
    for identical, spare_moved, late_unchanged, finite in run_workers(_unused_worker, 2):
        assert identical and finite
        # zero gradients, zero variance: the sign codec's error (it cannot send a zero) meets the
        # mean variance, not a denominator of eps (which moves it by about 1e6)
        assert spare_moved < 3 * 5 * LR
        assert not late_unchanged  # its momentum still moves it, as under 1-bit Adam


def _bad_options_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    errors = []
    cases = [
        (lambda: torch.optim.SGD(model.parameters(), lr=0.1), {}),
        (lambda: make_adam(model), {"compression": "signsgd"}),
        (lambda: make_adam(model, amsgrad=True), {}),
        (lambda: make_adam(model), {"exchange_momentum_after": 0}),
        (lambda: make_adam(model), {"op": mc.Sum}),
        (lambda: make_adam(model), {"exchange_momentum_after": None, "grad_scaler": torch.amp.GradScaler("cpu")}),
        (lambda: make_adam(model), {"grad_scaler": object()}),
        (lambda: make_adam(model), {"compression": "dgc"}),
        (lambda: make_adam(model), {"variance_refresh_every": 0}),
        (lambda: make_adam(model), {"exchange_momentum_after": None, "variance_refresh_every": 5}),
        (lambda: make_adam(model), {"exchange_momentum_as": "gradient"}),
        (lambda: make_adam(model), {"exchange_momentum_after": None, "exchange_momentum_as": "increment"}),
    ]
    for make, kwargs in cases:
        kwargs = {"exchange_momentum_after": AFTER, **kwargs}
        try:
            mc.DistributedOptimizer(make(), model.named_parameters(), **kwargs)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
        else:
            errors.append(None)
    # memory=None: the residual memory for an unbiased quantizer with the option, its own without
    memories = [mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression=name,
                                        **kwargs).memory.name
                for name, kwargs in (("qsgd", {"exchange_momentum_after": AFTER}),
                                     ("qsgd", {"exchange_momentum_after": AFTER, "memory": "none"}),
                                     ("qsgd", {}), ("onebit", {"exchange_momentum_after": AFTER}),
                                     ("none", {"exchange_momentum_after": AFTER}))]
    return errors, memories


def test_an_unbiased_quantizer_gets_error_feedback_by_default():
    for _, memories in run_workers(_bad_options_worker, 2):
        assert memories == ["residual", "none", "none", "residual", "none"]


def test_bad_options_raise_naming_the_option():
    for errors, _ in run_workers(_bad_options_worker, 2):
        (sgd, vote, amsgrad, zero, op_sum, scaler_alone, not_scaler, dgc, refresh_zero, refresh_alone, send_bad,
         send_alone) = errors
        assert "exchange_momentum_after" in sgd and "SGD" in sgd
        assert "signsgd" in vote and "majority vote" in vote
        assert "amsgrad" in amsgrad
        assert "exchange_momentum_after" in zero and "0" in zero
        assert "op=" in op_sum
        assert "grad_scaler" in scaler_alone
        assert "GradScaler" in not_scaler
        assert "'dgc'" in dgc and "residual" in dgc
        assert "variance_refresh_every" in refresh_zero and "0" in refresh_zero
        assert "variance_refresh_every" in refresh_alone and "exchange_momentum_after" in refresh_alone
        assert "exchange_momentum_as" in send_bad and "'gradient'" in send_bad and "increment" in send_bad
        assert "exchange_momentum_as" in send_alone and "exchange_momentum_after" in send_alone


def _disagree_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    mc.DistributedOptimizer(make_adam(model), model.named_parameters(), exchange_momentum_after=AFTER + rank)


def test_ranks_must_agree_on_the_warm_up():
    with pytest.raises(WorkerError, match="exchange_momentum_after"):
        run_workers(_disagree_worker, 2)


def _wire_worker(rank, low_rank, send="momentum", stale=False):
    import mergecomp.torch as mc
    from mergecomp.compressors.none import NoneCompressor

    class Recording(NoneCompressor):
        """Exact (a power-of-two prescale) but not lossless: the momentum phase scales for it."""
        sent = []

        def compress_checked(self, tensor, name, shapes=None):
            self.sent.append(tensor.clone())
            return super().compress_checked(tensor, name, shapes)

    Recording.low_rank = low_rank
    x, y = make_data()
    xs, ys = shard(x, rank), shard(y, rank)
    model = torch.nn.Linear(16, 4, bias=False)
    torch.nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(0))
    codec = Recording(prescale=2.0)
    opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression=codec,
                                  exchange_momentum_after=AFTER, compression_warmup_steps=AFTER,
                                  exchange_momentum_as=send)
    run(model, opt, xs, ys, AFTER + 1)
    group, state = opt.param_groups[0], opt.state[model.weight]
    beta1 = group["betas"][0]
    grad, = torch.autograd.grad(torch.nn.functional.cross_entropy(model(xs), ys), model.weight)
    if stale:  # one element's variance decayed to nearly nothing: its value would be enormous
        state["exp_avg_sq"].view(-1)[0] = 1e-30
    before = state["exp_avg"].clone()
    local = (1 - beta1) * grad + (0 if send == "increment" else beta1 * before)
    expected = local if low_rank else local / (state["exp_avg_sq"].sqrt() + group["eps"])
    limit = wire_bound(*group["betas"], send == "increment")  # one tensor: coefficient 1
    assert not stale or float(expected.view(-1)[0].abs()) > 1e3 * limit
    expected = expected if low_rank else expected.clamp(-limit, limit)
    del codec.sent[:]
    run(model, opt, xs, ys, 1)
    averaged = beta1 * before + (1 - beta1) * mc.allgather(grad.unsqueeze(0)).mean(0)
    keep = slice(1 if stale else 0, None)  # the stale element's momentum: what its limit let through
    return codec.sent[0], expected.flatten(), state["exp_avg"].flatten()[keep], averaged.flatten()[keep]


@pytest.mark.parametrize("low_rank,stale", [(False, False), (True, False), (False, True)])
def test_the_momentum_goes_on_the_wire_divided_by_adams_denominator(low_rank, stale):
    """A lossy codec gets ``m / (sqrt(v) + eps)``, the update's own scale, in which one codec
    scale fits every element; a low-rank one gets ``m`` (one tensor: coefficient 1).  A value
    beyond :func:`wire_bound` (an element whose variance decayed to 1e-30, a thousand times
    beyond it) goes as the bound, its sign kept; the others as they are."""
    for sent, expected, momentum, averaged in run_workers(_wire_worker, 2, low_rank, "momentum", stale, timeout=120):
        torch.testing.assert_close(sent, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(momentum, averaged, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("low_rank", [False, True])
def test_the_increment_sends_only_the_gradients_share_and_adds_the_rest_after(low_rank):
    """``exchange_momentum_as="increment"``: the wire holds ``(1 - b1) * g`` (over Adam's
    denominator where the momentum would be), and the momentum after the exchange is still
    ``b1 * m + (1 - b1) * mean(g)``."""
    for sent, expected, momentum, averaged in run_workers(_wire_worker, 2, low_rank, "increment", False,
                                                          timeout=120):
        torch.testing.assert_close(sent, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(momentum, averaged, rtol=1e-5, atol=1e-7)


def _nan_worker(rank, compression):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression=compression, groups=2,
                                  exchange_momentum_after=AFTER)
    run(model, opt, shard(x, rank), shard(y, rank), STEPS, make_schedule(opt), poison=(AFTER + 2,) if rank else ())
    gathered = mc.allgather(flat_params(model).unsqueeze(0))
    return bool(torch.isfinite(gathered).all()), bool((gathered == gathered[0]).all()), opt.momentum_exchange.updates


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_a_nan_in_the_momentum_phase_skips_the_update_instead_of_writing_it(compression):
    """Without a GradScaler, an Inf on rank 1 in the momentum phase would reach Adam's momentum
    and the parameters for good: the update is skipped on every rank (not counted), the ranks
    stay identical and finite; a lossless exchange is checked too in that phase."""
    for finite, identical, updates in run_workers(_nan_worker, 2, compression):
        assert finite and identical and updates == STEPS - 1


def _outgrown_worker(rank, compression):
    import logging

    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    opt = mc.DistributedOptimizer(adamw, model.named_parameters(), compression=compression, groups=2,
                                  exchange_momentum_after=AFTER, variance_refresh_every=4)
    written = AFTER  # the variance's last write: the freeze, then the refreshes at phase updates 1, 2, 4 and 6
    largest, lines = [], []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mergecomp").addHandler(handler)
    logging.getLogger("mergecomp").setLevel(logging.INFO)
    for t in range(AFTER + 6):
        before = flat_params(model)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank)), shard(y, rank))
        (loss * (1e4 if t >= AFTER + 2 else 1.0)).backward()  # the gradients outgrow the frozen variance
        opt.step()
        written = t + 1 if t - AFTER + 1 in (1, 2, 4, 6) else written
        step = float(adamw.state[next(model.parameters())]["step"])
        bound = LR * math.sqrt(1 / inv_bound2(0.9, 0.95)) * math.sqrt(1 - 0.95 ** written) / (1 - 0.9 ** step)
        largest.append(float((flat_params(model) - before).abs().max()) / bound)
    logging.getLogger("mergecomp").removeHandler(handler)
    logging.getLogger("mergecomp").setLevel(logging.NOTSET)
    momentum = opt.momentum_exchange
    return largest, [line for line in lines if "refreshed" in line], (momentum.refreshes, momentum.refresh_interval)


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_gradients_outgrowing_the_frozen_variance_move_no_element_further_than_adam_would(compression):
    """The loss scaled 10,000-fold two updates after the freeze: the frozen variance would turn
    it into steps thousands of times Adam's; the update raises the variance to Adam's own bound
    ``|m| <= B sqrt(v)`` instead, so no element moves further than ``lr * B`` (bias-corrected)
    in any update, the steps stay of Adam's size (above a tenth of the bound); the next refresh
    (phase update 4) finds that the gradients outgrew the variance since update 6 and halves the
    interval (the next refresh at phase update 6, not 8), which the refresh of update 6, the
    variance written from the grown gradients, doubles back where it then holds (the lossless
    exchange) and halves again to every update where the gradients outgrew it again (1-bit
    SGD's): each logged."""
    second, interval = {"none": ("the frozen variance held", 4),
                        "onebit": ("the gradients outgrew the frozen variance", 1)}[compression]
    for largest, lines, exchange in run_workers(_outgrown_worker, 2, compression):
        assert max(largest) <= 1 + 1e-4, largest
        assert min(largest[AFTER:]) > 0.1, largest
        outgrew, then = lines
        assert outgrew.startswith("exchange_momentum_after: the gradients outgrew the frozen variance between "
                                  f"updates {AFTER + 2} and {AFTER + 4}"), outgrew
        assert outgrew.endswith("refreshed now, and every 2 updates from here (was 4) while they keep outgrowing it")
        assert then.startswith(f"exchange_momentum_after: {second} between updates {AFTER + 4} and {AFTER + 6}"), then
        assert then.endswith("refreshed every 4 updates from here (was 2)" if interval == 4
                             else "every update from here (was 2) while they keep outgrowing it"), then
        assert exchange == (4, interval)  # refreshes sent: phase updates 1, 2, 4, 6


def _default_worker(rank):
    import logging
    import warnings

    import mergecomp.torch as mc

    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("mergecomp").addHandler(handler)
    out = {}
    try:
        for label, make, compression, options in [
                ("adamw onebit", make_adam, "onebit", {}), ("adamw topk", make_adam, "topk", {}),
                ("adamw onebit, a GradScaler given", make_adam, "onebit",
                 {"grad_scaler": torch.amp.GradScaler("cpu")}),
                ("adamw randk (no recipe)", make_adam, "randk", {}),
                ("adamw onebit, op=Sum", make_adam, "onebit", {"op": mc.Sum}),
                ("adamw onebit, gradients asked for", make_adam, "onebit", {"exchange_momentum_after": None}),
                ("adamw onebit, K given", make_adam, "onebit", {"exchange_momentum_after": AFTER}),
                ("adamw qsgd (no error feedback)", make_adam, "qsgd", {}), ("adamw none", make_adam, "none", {}),
                ("sgd onebit", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "onebit", {})]:
            model = make_model()
            log.seek(0)
            log.truncate()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = mc.DistributedOptimizer(make(model), model.named_parameters(), compression=compression,
                                              **options)
            momentum = opt.momentum_exchange
            out[label] = ("off" if momentum is None else momentum.after, log.getvalue(),
                          [str(w.message) for w in caught if "exchange its momentum" in str(w.message)])
    finally:
        logging.getLogger("mergecomp").removeHandler(handler)
    return out


def test_adams_gradients_through_error_feedback_exchange_its_momentum_by_default():
    """Not given ``exchange_momentum_after``, Adam or AdamW with a lossy error-feedback
    compressor that has a recipe exchanges its momentum by the recipe (``"auto"``), logged as a
    warning naming the option that turns it off (and ``grad_scaler=`` where none was given);
    without a recipe, or under ``op=mc.Sum``, the gradients go with a warning naming the line to
    add; given as None, or anything else, nothing changes, silently."""
    out = run_workers(_default_worker, 2)[0]
    for label in ("adamw onebit", "adamw topk", "adamw onebit, a GradScaler given"):
        after, logged, told = out[label]
        assert after is None and told == [], label  # None: K follows the LR warm-up, as "auto" decides it
        assert logged.startswith("DistributedOptimizer: AdamW's gradients through") \
            and "exchange_momentum_after=None exchanges the gradients" in logged, logged
        assert ("grad_scaler=scaler" in logged) == ("GradScaler given" not in label), logged
    for label in ("adamw randk (no recipe)", "adamw onebit, op=Sum"):
        after, logged, [message] = out[label]
        assert after == "off" and "DistributedOptimizer" in message and "exchange_momentum_after=K" in message, label
    assert out["adamw onebit, K given"] == (AFTER, "", [])
    for label in ("adamw onebit, gradients asked for", "adamw qsgd (no error feedback)", "adamw none", "sgd onebit"):
        assert out[label] == ("off", "", []), label


def _default_equals_auto_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    params = []
    for options in ({}, {"exchange_momentum_after": "auto"}):
        model = make_model()
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression="onebit",
                                      total_steps=STEPS, **options)
        run(model, opt, shard(x, rank), shard(y, rank), STEPS, clip=0.5)
        params.append((flat_params(model), opt.momentum_exchange.active))
    return params


def test_the_default_trains_bit_for_bit_as_auto_and_clipping_is_not_taken_for_a_scaler():
    """The default is ``"auto"`` itself (here into its momentum phase), and clipping the averaged
    gradients before ``step()``, without a scaler, passes the default's loss-scale check."""
    for (default, active), (auto, auto_active) in run_workers(_default_equals_auto_worker, 2):
        assert active and auto_active
        assert torch.equal(default, auto)


def _default_under_a_scaler_worker(rank, clip, fused, given):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt = mc.DistributedOptimizer(make_adam(model, fused=fused), model.named_parameters(), compression="onebit",
                                  total_steps=STEPS, **({"grad_scaler": scaler} if given else {}))
    try:
        run(model, opt, shard(x, rank), shard(y, rank), STEPS, scaler=scaler, clip=clip)
    except ValueError as err:
        return str(err), opt.momentum_exchange.updates
    return None, opt.momentum_exchange.updates


@pytest.mark.parametrize("clip,fused,given", [(None, False, False), (0.5, False, False), (None, True, False),
                                               (0.5, False, True)])
def test_a_grad_scaler_the_default_exchange_was_not_given_raises_at_the_first_update_on_every_rank(
        clip, fused, given):
    """Switched on by default, the exchange sees a ``GradScaler`` it was not given when
    ``unscale_`` divides its results before ``step()`` (clipped after, too), or when the scaler
    hands a fused Adam its scale: the first update raises on every rank, naming
    ``grad_scaler=``, before anything moves.  Given the scaler, the run trains."""
    for message, updates in run_workers(_default_under_a_scaler_worker, 2, clip, fused, given):
        if given:
            assert message is None and updates == STEPS
        else:
            assert message is not None and "grad_scaler=scaler" in message and updates == 0, message
