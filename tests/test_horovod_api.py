"""DistributedOptimizer as a drop-in for Horovod's, on real gloo processes: the
synchronize()/step() lifecycle, mixed precision with GradScaler (NaN on one rank skips the
step on every rank and leaves error feedback untouched), the lossless default, and the
Horovod-shaped arguments (Compression, gradient_predivide_factor, groups of tensors,
named_parameters naming more than the optimizer holds, Adasum, process sets)."""
import contextlib
import warnings

import pytest
import torch

from distributed import run_workers
from test_optimizer_dist import make_data, make_model, shard, train

WORLD = 2
ROWS = 16  # per rank


def model_for_test(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * WORLD, 8, generator=gen)
    y = torch.randint(0, 3, (ROWS * WORLD,), generator=gen)
    return x, y


def part(t, rank):
    return t[rank * ROWS:(rank + 1) * ROWS]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def single_process(steps, skip=(), clip=None, lr=0.1, seed=0):
    """The same training on the joined batch in one process (``skip``: steps not taken)."""
    x, y = batch()
    model = model_for_test(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        if step in skip:
            continue
        opt.zero_grad()
        loss_of(model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return params_of(model)


def poison_on(model, rank, where, step, bad_rank=1):
    """At ``step`` on ``bad_rank``, an Inf appears in the last layer's weight gradient."""
    if step == where and rank == bad_rank:
        return model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    return None


def state_copy(holder):
    return {name: {k: v.clone() for k, v in fields.items()} for name, fields in holder.state.items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


# -- mixed precision ---------------------------------------------------------------------------
def _amp_worker(rank, compression, bad_step):
    import mergecomp.torch as mc

    x, y = batch()
    x, y = part(x, rank), part(y, rank)
    out = {}
    for run in ("poisoned", "reference"):  # reference: the bad step is simply not taken
        model = model_for_test()
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                      compression, memory="residual", groups=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(6):
            if run == "reference" and step == bad_step:
                scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
                continue
            hook = poison_on(model, rank, bad_step, step) if run == "poisoned" else None
            memory, codec = state_copy(opt.memory), state_copy(opt.compressor)
            opt.zero_grad()
            scaler.scale(loss_of(model, x, y)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            if step == bad_step:
                out["all_nan"] = all(p.grad.isnan().all().item() for p in model.parameters())
                out["state_kept"] = same_state(memory, state_copy(opt.memory)) and \
                    same_state(codec, state_copy(opt.compressor))
                out["had_state"] = bool(memory)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            if hook is not None:
                hook.remove()
        out[run] = params_of(model)
        out[run + "_scale"] = scaler.get_scale()
    return out


@pytest.mark.parametrize("compression", ["topk", "powersgd", "efsignsgd"])  # powersgd: compressor state too; efsignsgd: a carried residual
def test_grad_scaler_skips_the_same_step_on_every_rank_and_error_feedback_is_untouched(compression):
    results = run_workers(_amp_worker, WORLD, compression, 3)
    for out in results:
        assert out["all_nan"]  # every rank saw the overflow, so every rank's scaler skipped
        assert out["had_state"] and out["state_kept"]
        assert out["poisoned_scale"] == out["reference_scale"]
        assert torch.equal(out["poisoned"], out["reference"])
    assert torch.equal(results[0]["poisoned"], results[1]["poisoned"])


def _amp_recipe_worker(rank, compression, recipe):
    """Five GradScaler steps, an Inf on rank 1 at step 2.  ``recipe``: "horovod" (synchronize,
    unscale_, clip, step inside skip_synchronize), "plain" (unscale_, clip, scaler.step, as
    written for one process or DDP) or "step only" (scaler.step alone)."""
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression, groups=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "step() was called after synchronize()"
        for step in range(5):
            hook = poison_on(model, rank, 2, step)
            opt.zero_grad()
            scaler.scale(loss_of(model, part(x, rank), part(y, rank))).backward()
            if recipe == "horovod":
                opt.synchronize()
            if recipe != "step only":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if recipe == "horovod":
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if hook is not None:
                hook.remove()
    return params_of(model), scales


@pytest.mark.parametrize("compression", ["none", "efsignsgd"])
def test_grad_scaler_plain_recipe_unscales_the_averaged_gradients(compression):
    """The recipe people write for one process or DDP (``scaler.unscale_(opt)``, clipping,
    ``scaler.step(opt)``, no synchronize) gives Horovod's recipe's parameters bit for bit: the
    scaler unscales and checks the averaged gradients, not the local ones under exchange."""
    horovod = run_workers(_amp_recipe_worker, WORLD, compression, "horovod")
    plain = run_workers(_amp_recipe_worker, WORLD, compression, "plain")
    step_only = run_workers(_amp_recipe_worker, WORLD, compression, "step only")
    for runs in (horovod, plain, step_only):
        for params, scales in runs:
            assert torch.isfinite(params).all()
            assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0]  # the Inf step skipped, on every rank
        assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(plain[0][0], horovod[0][0])
    assert not torch.equal(step_only[0][0], plain[0][0])  # the clipping took effect


# -- synchronize() / step() lifecycle ----------------------------------------------------------
def _sync_without_step_worker(rank):
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), groups=2)
    loss_of(model, part(x, rank), part(y, rank)).backward()
    opt.synchronize()  # e.g. a scaler that then skipped step()
    opt.zero_grad()
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            loss_of(model, part(x, rank), part(y, rank)).backward()
            opt.synchronize()
            opt.step()  # outside skip_synchronize(): warns (once), does not exchange again
    warned = [w for w in caught if issubclass(w.category, UserWarning) and "skip_synchronize" in str(w.message)]
    return (params_of(model) - single_process(5)).abs().max().item(), len(warned)


def test_synchronize_without_step_then_normal_steps_and_the_warning():
    for diff, warned in run_workers(_sync_without_step_worker, WORLD):
        assert diff < 1e-5
        assert warned == 1


def _clip_worker(rank, bad_step):
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), groups=2)
    for step in range(5):
        hook = poison_on(model, rank, bad_step, step)
        opt.zero_grad()
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if torch.isfinite(norm):  # a non-finite norm on one rank is non-finite on all
            with opt.skip_synchronize():
                opt.step()
        if hook is not None:
            hook.remove()
    return (params_of(model) - single_process(5, skip={bad_step}, clip=0.5)).abs().max().item()


def test_clipping_between_synchronize_and_step_with_a_skipped_step():
    for diff in run_workers(_clip_worker, WORLD, 2):
        assert diff < 1e-5


def _ddp_clip_worker(rank, compression, recipe):
    """Five clipped steps.  ``recipe``: "ddp" (``backward()``, clip ``model.parameters()``,
    ``step()``, as written for DDP), "horovod" (``synchronize()`` before the clip, ``step()``
    inside ``skip_synchronize()``) or "unclipped"."""
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression, groups=2)
    averaged = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            opt.zero_grad()
            loss_of(model, part(x, rank), part(y, rank)).backward()
            if recipe == "horovod":
                opt.synchronize()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            gathered = mc.allgather(grads.unsqueeze(0))
            averaged = averaged and all(torch.equal(g, grads) for g in gathered)  # the same on every rank
            if recipe != "unclipped":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if recipe == "horovod":
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    return params_of(model), averaged


@pytest.mark.parametrize("compression", ["none", "efsignsgd"])
def test_clipping_right_after_backward_clips_the_averaged_gradients(compression):
    """DDP's recipe (clip between ``backward()`` and ``step()``, no synchronize): when
    ``backward()`` returns, ``p.grad`` already holds the averaged gradients, so the clip acts on
    what ``step()`` applies and gives Horovod's recipe's parameters bit for bit."""
    ddp = run_workers(_ddp_clip_worker, WORLD, compression, "ddp")
    horovod = run_workers(_ddp_clip_worker, WORLD, compression, "horovod")
    unclipped = run_workers(_ddp_clip_worker, WORLD, compression, "unclipped")
    for params, averaged in ddp:
        assert averaged
        assert torch.equal(params, horovod[0][0]) and torch.equal(params, ddp[0][0])
        assert not torch.equal(params, unclipped[0][0])
    if compression == "none":
        assert (ddp[0][0] - single_process(5, clip=0.05)).abs().max().item() < 1e-5


def _unused_parameter_amp_worker(rank, recipe):
    """The plain GradScaler recipe when a parameter gets no gradient (so ``backward()`` cannot
    know it is over): ``scaler.step(opt)`` reads ``opt.param_groups``, which finishes the
    exchange first."""
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    spare = torch.nn.Parameter(torch.zeros(4))  # in the optimizer, never in the graph
    opt = mc.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [spare], lr=0.1, momentum=0.9),
                                  list(model.named_parameters()) + [("spare", spare)], groups=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(5):
        hook = poison_on(model, rank, 2, step)
        opt.zero_grad()
        scaler.scale(loss_of(model, part(x, rank), part(y, rank))).backward()
        if recipe == "plain":
            in_flight = opt.merged.in_flight
            scaler.unscale_(opt)
        else:
            in_flight = True
            opt.synchronize()
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize() if recipe == "horovod" else contextlib.nullcontext():
            scaler.step(opt)
        scaler.update()
        if hook is not None:
            hook.remove()
    return params_of(model), in_flight, torch.equal(spare.detach(), torch.zeros(4))


def test_grad_scaler_plain_recipe_with_a_parameter_that_gets_no_gradient():
    plain = run_workers(_unused_parameter_amp_worker, WORLD, "plain")
    horovod = run_workers(_unused_parameter_amp_worker, WORLD, "horovod")
    for params, in_flight, spare_unchanged in plain:
        assert in_flight and spare_unchanged  # backward() left the exchange to the scaler's read
        assert torch.isfinite(params).all() and torch.equal(params, horovod[0][0])


def _two_backwards_worker(rank):
    """Two backward passes per step with ``backward_passes_per_step=1``: as under DDP, each
    pass's gradients are averaged and the second adds to the first."""
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), groups=2)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(2):
            loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.step()
    return params_of(model)


def test_two_backward_passes_per_step_add_their_averaged_gradients():
    for params in run_workers(_two_backwards_worker, WORLD):
        assert (params - single_process(3, lr=0.2)).abs().max().item() < 1e-5  # twice the gradient


# -- defaults and Horovod arguments --------------------------------------------------------------
def _default_worker(rank):
    import mergecomp.torch as mc

    x, y = batch()
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters())  # default compression, groups="auto"
    for _ in range(5):
        opt.zero_grad()
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.step()
    return opt.compressor.name, (params_of(model) - single_process(5)).abs().max().item()


def test_default_compression_is_lossless():
    for name, diff in run_workers(_default_worker, WORLD):
        assert name == "none"
        assert diff < 1e-5


def _predivide_worker(rank, factor):
    import mergecomp.torch as mc

    x, y = batch()
    local = []
    for r in range(WORLD):  # every rank's local gradient, computed here for the expectation
        m = model_for_test()
        loss_of(m, part(x, r), part(y, r)).backward()
        local.append([p.grad.clone() for p in m.parameters()])
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  mc.Compression.none, 1, mc.Average, factor, groups=1)
    loss_of(model, part(x, rank), part(y, rank)).backward()
    opt.synchronize()
    worst = 0.0
    for i, p in enumerate(model.parameters()):
        want = sum(g[i] * (1.0 / factor) for g in local) * (factor / WORLD)
        worst = max(worst, (p.grad - want).abs().max().item())
    mean = [sum(g[i] for g in local) / WORLD for i in range(len(local[0]))]
    close_to_mean = all(torch.allclose(p.grad, m, atol=1e-6) for p, m in zip(model.parameters(), mean))
    try:
        mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                op=mc.Sum, gradient_predivide_factor=factor)
        sum_rejected = False
    except ValueError:
        sum_rejected = True
    return worst, close_to_mean, sum_rejected


def test_gradient_predivide_factor_divides_before_the_sum_and_rescales_after():
    for worst, close_to_mean, sum_rejected in run_workers(_predivide_worker, WORLD, 4.0):
        assert worst < 1e-7 and close_to_mean and sum_rejected


def _params_and_groups_worker(rank):
    import mergecomp.torch as mc

    x, y = batch()
    out = {}
    # named_parameters names a frozen-by-omission head too: only the optimizer's are exchanged
    model = model_for_test()
    extra = torch.nn.Linear(3, 3)
    named = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.step()
    out["superset"] = (params_of(model) - single_process(3)).abs().max().item()
    out["exchanged"] = sorted(opt.param_names)
    opt.remove_hooks()
    # groups as lists of parameters
    model = model_for_test()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(),
                                  groups=[[model[0].weight, model[0].bias], [model[2].weight]])
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.step()
    out["tensor_groups"] = sorted(sorted(opt.merged.tensor_names(g)) for g in opt.groups)
    out["tensor_groups_diff"] = (params_of(model) - single_process(3)).abs().max().item()
    opt.remove_hooks()
    # Compression attributes, Horovod's positional order, num_groups, backward passes
    model = model_for_test()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for codec in (mc.Compression.fp16, mc.Compression.topk):
        opt = mc.DistributedOptimizer(sgd, model.named_parameters(), codec, 1, mc.Average, 1.0, 2)
        out.setdefault("codecs", []).append((opt.compressor.name, len(opt.groups)))
        loss_of(model, part(x, rank), part(y, rank)).backward()
        opt.synchronize()
        out.setdefault("finite", []).append(all(torch.isfinite(p.grad).all().item() for p in model.parameters()))
        opt.zero_grad()
        opt.remove_hooks()
    opt = mc.DistributedOptimizer(sgd, model.named_parameters(), sparse_as_dense=True)
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        loss_of(model, part(x, rank), part(y, rank)).backward()
    opt.step()
    out["two_passes"] = opt.merged.step
    opt.remove_hooks()
    errors = {}
    for case, kwargs in {"adasum": dict(op=mc.Adasum), "process_set": dict(process_set=object())}.items():
        try:
            mc.DistributedOptimizer(sgd, model.named_parameters(), **kwargs)
        except (NotImplementedError, ValueError) as err:
            errors[case] = str(err)
    out["errors"] = errors
    out["global_set"] = mc.DistributedOptimizer(sgd, model.named_parameters(),
                                                process_set=mc.global_process_set).merged.step == 0
    return out


def test_horovod_arguments():
    for out in run_workers(_params_and_groups_worker, WORLD):
        assert out["superset"] < 1e-5
        assert out["exchanged"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert out["tensor_groups"] == [["0.bias", "0.weight"], ["2.bias"], ["2.weight"]]
        assert out["tensor_groups_diff"] < 1e-5
        assert out["codecs"] == [("fp16", 2), ("topk", 2)] and all(out["finite"])
        assert out["two_passes"] == 1
        assert "mc.Average" in out["errors"]["adasum"]
        assert "process_set" in out["errors"]["process_set"]
        assert out["global_set"]


def _optimizer_class_worker(rank):
    import mergecomp.torch as mc

    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), compression="topk", groups=1)
    pre_hooks = []
    opt.register_step_pre_hook(lambda *args: pre_hooks.append(1))
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = make_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            train(model, opt, shard(x, rank), shard(y, rank), steps=1)
            schedule.step()
    opt.remove_hooks()
    # After load_state_dict (torch then wraps the class's step() for hooks) each hook still runs once.
    reloaded = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    reloaded_hooks = []
    reloaded.register_step_pre_hook(lambda *args: reloaded_hooks.append(1))
    reloaded.load_state_dict(reloaded.state_dict())
    train(model, reloaded, shard(x, rank), shard(y, rank), steps=2)
    return (isinstance(opt, torch.optim.SGD), isinstance(opt, mc.DistributedOptimizer), type(opt).__name__,
            len(pre_hooks), opt.param_groups[0]["lr"], len(opt.state), len(reloaded_hooks))


def test_the_optimizer_is_the_users_class_with_its_hooks_and_lr_schedulers():
    """As with Horovod, the wrapper is a subclass of the user's optimizer class: isinstance checks,
    torch's step hooks and LR schedulers work (and nothing of torch's private state is rebuilt)."""
    for is_sgd, is_ours, name, hooks, lr, states, reloaded in run_workers(_optimizer_class_worker, 2):
        assert is_sgd and is_ours and name == "SGD"
        assert hooks == 3 and lr == pytest.approx(0.1 * 0.5 ** 3) and states == 6  # a momentum buffer per parameter
        assert reloaded == 2


class HalfForTheWire:
    """A compressor written for Horovod: static compress/decompress, as its docs show."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def _horovod_codec_worker(rank):
    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression=HalfForTheWire, groups=1)
    torch.manual_seed(1 + rank)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    every = [mc.allgather(g[None]) for g in grads]
    return [bool(torch.equal(e[0], e[1])) for e in every], repr(opt.merged.exchange.compressor)


def test_a_compressor_written_for_horovod_works_in_distributed_optimizer():
    for same, name in run_workers(_horovod_codec_worker, WORLD):
        assert all(same) and name == "HorovodCodec(HalfForTheWire)"


def _sparse_adam_worker(rank):
    import mergecomp.torch as mc

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(11, 3, sparse=True)
    opt = mc.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
                                  embedding.named_parameters(), sparse_as_dense=True)
    embedding(torch.tensor([[1, 2, 4], [4, 3, 9]]) + rank).sum().backward()  # the ranks touch other rows
    opt.step()
    return embedding.weight.detach()


def test_sparse_gradients_reach_sparse_adam_averaged():
    zero, one = run_workers(_sparse_adam_worker, WORLD)
    torch.manual_seed(0)
    start = torch.nn.Embedding(11, 3).weight.detach()
    assert torch.equal(zero, one)
    touched = {1, 2, 3, 4, 5, 9, 10}                                   # rows either rank looked up
    assert all(torch.equal(zero[r], start[r]) != (r in touched) for r in range(11))
