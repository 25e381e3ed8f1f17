"""mergecomp.torch.ddp_comm_hook on real processes (2 and 3 gloo ranks): exactness against DDP's
own allreduce, training with compressors, uneven inputs under ``join()``, checkpoints, error
feedback across DDP's bucket rebuild."""
import copy
import math

import pytest
import torch
from distributed import run_workers
from test_optimizer_dist import flat_params, make_data, make_model, shard

#: small buckets: the models below span several DDP buckets
BUCKET_MB = 0.002


class OutOfOrder(torch.nn.Module):
    """Registered in another order than used: DDP's rebuilt buckets differ from its first ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(32, 4)
        self.body = torch.nn.Linear(32, 32)
        self.stem = torch.nn.Linear(16, 32)

    def forward(self, x):
        return self.head(torch.tanh(self.body(torch.tanh(self.stem(x)))))


def ddp(model, compression=None, per_tensor=False, **hook_args):
    """``model`` in DDP with small buckets and, unless ``compression`` is None, our hook.

    torch 2.13's DDP puts all parameters in one bucket for the first iteration and rebuilds the
    buckets after it.  ``per_tensor`` gives every parameter its own bucket from the start (a
    1-byte ``bucket_cap_mb_list``), so a fresh DDP has the same buckets as a trained one.
    """
    import mergecomp.torch as mc

    caps = {"bucket_cap_mb_list": [1e-6]} if per_tensor else {"bucket_cap_mb": BUCKET_MB}
    wrapped = torch.nn.parallel.DistributedDataParallel(model, **caps)
    state = None
    if compression is not None:
        state, hook = mc.ddp_comm_hook(compression, named_parameters=model.named_parameters(), **hook_args)
        wrapped.register_comm_hook(state, hook)
    return wrapped, state


def train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# -- exactness and training ---------------------------------------------------------------------
def _training_worker(rank):
    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)
    out = {}
    reference, _ = ddp(make_model())
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), *mine, steps=10)
    hooked, state = ddp(make_model(), "none")
    train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1, momentum=0.9), *mine, steps=10)
    out["none"] = ((flat_params(hooked) - flat_params(reference)).abs().max().item(), len(state.layout))
    for name in ("topk", "powersgd", "qsgd"):
        model, state = ddp(make_model(), name)
        train(model, torch.optim.SGD(model.parameters(), lr=0.2), *mine, steps=30)
        full = torch.nn.functional.cross_entropy(model(x), y).item()
        out[name] = (flat_params(model), full, len(state.layout))
    return out


def test_none_hook_equals_ddp_and_compressors_train_identically_on_all_ranks():
    r0, r1 = run_workers(_training_worker, 2)
    for result in (r0, r1):
        diff, buckets = result["none"]
        assert buckets > 1
        assert diff < 1e-6
    x, y = make_data()
    initial = torch.nn.functional.cross_entropy(make_model()(x), y).item()
    for name in ("topk", "powersgd", "qsgd"):
        params0, full, buckets = r0[name]
        assert buckets > 1, name
        assert torch.equal(params0, r1[name][0]), f"{name}: ranks diverged"
        assert math.isfinite(full) and full < 0.9 * initial, f"{name}: loss {initial:.3f} -> {full:.3f}"


def _uneven_worker(rank, compression):
    """Rank r has 2 + r batches inside ``model.join()``; each step accumulates two micro-batches,
    the first under ``no_sync()``."""
    x, y = make_data()
    batches = [(x[8 * (rank + k) % 32:][:8], y[8 * (rank + k) % 32:][:8]) for k in range(2 + rank)]
    params = {}
    for hook in (None, compression):
        model, _ = ddp(make_model(), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for xb, yb in batches:
                opt.zero_grad()
                with model.no_sync():
                    torch.nn.functional.cross_entropy(model(xb[:4]), yb[:4]).backward()
                torch.nn.functional.cross_entropy(model(xb[4:]), yb[4:]).backward()
                opt.step()
        params[hook] = flat_params(model)
    return params


@pytest.mark.parametrize("compression", ["none", "topk"])
def test_uneven_inputs_with_join_and_no_sync_as_with_ddp(compression):
    """DDP's recipe for uneven inputs: a rank whose data ran out serves the others' buckets with
    zeros through the hook, so no rank waits; the lossless hook ends where DDP's own allreduce
    does, a compressor leaves every rank with the same parameters."""
    outs = run_workers(_uneven_worker, 3, compression)
    for out in outs:
        assert torch.equal(out[compression], outs[0][compression]), "ranks diverged"
        if compression == "none":
            assert (out["none"] - out[None]).abs().max().item() < 1e-6
        else:
            assert not torch.equal(out[compression], out[None])


# -- checkpoints --------------------------------------------------------------------------------
def _checkpoint_worker(rank):
    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)

    def fresh():
        # A resumed top-k run repeats the uninterrupted one bit for bit only if DDP's first
        # buckets after the restart hold the same parameters as before it (see ddp()).
        model, state = ddp(make_model(), "topk", per_tensor=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state

    model, opt, state = fresh()
    train(model, opt, *mine, steps=4)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
    train(model, opt, *mine, steps=4)
    uninterrupted = flat_params(model)

    resumed, resumed_opt, resumed_state = fresh()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    resumed_state.load_state_dict(saved["hook"])
    train(resumed, resumed_opt, *mine, steps=4)

    # Without the hook's state the residuals are lost: the run differs.
    forgetful, forgetful_opt, _ = fresh()
    forgetful.load_state_dict(saved["model"])
    forgetful_opt.load_state_dict(saved["opt"])
    train(forgetful, forgetful_opt, *mine, steps=4)
    residual = sum(t.abs().sum().item() for fields in saved["hook"]["memory"].values() for t in fields.values())
    return ((flat_params(resumed) - uninterrupted).abs().max().item(),
            (flat_params(forgetful) - uninterrupted).abs().max().item(), residual, saved["hook"]["step"])


def test_state_survives_save_and_load():
    for resumed_diff, forgetful_diff, residual, step in run_workers(_checkpoint_worker, 2):
        assert step == 4 and residual > 0
        assert resumed_diff == 0.0
        assert forgetful_diff > 1e-4


def _unbound_worker(rank):
    """A hook built before torch.distributed exists (as a Lightning or Accelerate script builds
    it before the framework starts the group), loaded with a checkpoint, binds at its first bucket."""
    import mergecomp.torch as mc

    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)
    model, state = ddp(make_model(), "topk", per_tensor=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, *mine, steps=2)
    saved = copy.deepcopy({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
    train(model, opt, *mine, steps=2)
    uninterrupted = flat_params(model)

    mc.shutdown()  # no process group from here until init()
    net = make_model()
    net.load_state_dict(saved["model"])
    unbound, hook = mc.ddp_comm_hook("topk", named_parameters=net.named_parameters())
    before = (unbound.bound, unbound.state_dict(), repr(unbound))
    unbound.load_state_dict(saved["hook"])
    loaded = (unbound.bound, unbound.step)
    mc.init(engine="torch")
    resumed = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb_list=[1e-6])
    resumed.register_comm_hook(unbound, hook)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, *mine, steps=2)
    return before, loaded, unbound.bound, unbound.step, (flat_params(resumed) - uninterrupted).abs().max().item()


def test_hook_built_before_the_process_group_binds_at_its_first_bucket():
    for before, loaded, bound, step, diff in run_workers(_unbound_worker, 2):
        assert before == (False, {}, "DDPHookState(not bound yet, step=0)")
        assert loaded == (False, 2)  # kept until it binds
        assert bound and step == 4
        assert diff == 0.0


# -- error feedback across DDP's bucket rebuild ---------------------------------------------------
def _rebuild_worker(rank):
    from mergecomp.compressors.memories import ResidualMemory

    class Recording(ResidualMemory):
        """Remembers the residual each group found when it was compensated."""

        def compensate(self, tensor, name):
            found = self.state.get(name, {}).get("residual")
            self.found[name] = None if found is None else found.clone()
            return super().compensate(tensor, name)

    memory = Recording()
    memory.found = {}
    x, y = make_data()
    model = OutOfOrder()
    wrapped, state = ddp(model, "topk", memory=memory)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    train(wrapped, opt, shard(x, rank), shard(y, rank), steps=1)
    first = list(state.layout)
    per_param = {}
    for group in first:
        residual = memory.state[group.name]["residual"]
        for i, offset, n in zip(group.indices, group.offsets, group.numels()):
            per_param[i] = residual[offset:offset + n].clone()
    memory.found = {}
    train(wrapped, opt, shard(x, rank), shard(y, rank), steps=1)
    second = list(state.layout)
    worst = 0.0
    for group in second:
        found = memory.found[group.name]
        for i, offset, n in zip(group.indices, group.offsets, group.numels()):
            worst = max(worst, (found[offset:offset + n] - per_param[i]).abs().max().item())
    stale = set(memory.state) - {group.name for group in second}
    return ([g.indices for g in first], [g.indices for g in second], worst,
            sum(t.abs().sum().item() for t in per_param.values()), sorted(stale))


def test_error_feedback_is_remapped_when_ddp_rebuilds_its_buckets():
    for first, second, worst, total, stale in run_workers(_rebuild_worker, 2):
        # torch 2.13: one bucket in iteration 1, then several
        assert len(second) > 1 and first != second, "the test needs DDP to change its buckets"
        assert total > 0
        assert worst == 0.0
        assert stale == []


# -- errors ---------------------------------------------------------------------------------------
def _nonfinite_worker(rank):
    x, y = make_data()
    model, _ = ddp(make_model(), "topk", nonfinite="raise")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, shard(x, rank), shard(y, rank), steps=2)
    if rank == 1:
        model.module[4].weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
    try:
        train(model, opt, shard(x, rank), shard(y, rank), steps=1)
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_nonfinite_gradient_raises_on_every_rank_naming_rank_and_bucket():
    for message in run_workers(_nonfinite_worker, 2):
        assert "non-finite gradient" in message and "rank 1" in message and "4.weight" in message


def _grad_scaler_worker(rank, compression, uncompressed):
    x, y = make_data()
    mine = shard(x, rank), shard(y, rank)
    model, state = ddp(make_model(), compression, uncompressed=uncompressed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    out = {"params": [], "scales": []}
    for step in range(5):
        loss = torch.nn.functional.cross_entropy(model(mine[0]), mine[1])
        if step == 2 and rank == 1:  # one rank's scaled gradients overflow fp32 at this step
            loss = loss * 1e38
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out["params"].append(flat_params(model))
        out["scales"].append(scaler.get_scale())
    memory = state.merged.exchange.memory.state
    out["memory_finite"] = all(bool(torch.isfinite(t).all()) for fields in memory.values() for t in fields.values())
    return out


@pytest.mark.parametrize("compression, uncompressed", [("none", ()), ("topk", ()), ("topk", ("*.bias",)),
                                                      ("powersgd", ())])
def test_grad_scaler_skips_an_overflowing_step_on_every_rank_as_with_ddp(compression, uncompressed):
    """DDP's standard AMP recipe with the hook's defaults: one rank's gradients overflow at step 2,
    every rank's buckets come back NaN (also a bucket split around its exempt biases), so every
    GradScaler skips that step and halves its scale, the memory stays finite, and training goes on."""
    outs = run_workers(_grad_scaler_worker, 2, compression, uncompressed)
    for out in outs:
        params = out["params"]
        assert out["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        assert torch.equal(params[2], params[1])  # skipped
        assert not torch.equal(params[3], params[2]) and bool(torch.isfinite(params[4]).all())
        assert out["memory_finite"]
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"]))


def _bad_settings_worker(rank):
    import mergecomp.torch as mc

    errors = {}
    for case, kwargs in {"compressor": {"compression": "nope"}, "nonfinite": {"nonfinite": "skip"}}.items():
        try:
            mc.ddp_comm_hook(**kwargs)
        except ValueError as err:
            errors[case] = str(err)
    return errors


def test_bad_settings_are_rejected():
    errors = run_workers(_bad_settings_worker, 1)[0]
    assert "unknown compressor 'nope'" in errors["compressor"]
    assert "skip" in errors["nonfinite"]


def _mismatch_worker(rank):
    import mergecomp.torch as mc

    model = torch.nn.parallel.DistributedDataParallel(make_model())
    try:
        mc.ddp_comm_hook("topk" if rank == 0 else "qsgd", named_parameters=model.named_parameters())
    except ValueError as err:
        return str(err)
    return None


def test_ranks_with_different_hooks_raise_on_every_rank():
    for message in run_workers(_mismatch_worker, 2):
        assert message is not None and "rank 1 differs from rank 0 in its compressor" in message


def test_every_ranks_state_loaded_before_binding_is_kept_and_saved_again():
    """A checkpoint of another number of ranks loaded before the hook binds (Lightning and the
    Trainer resume before DDP's first bucket) is folded only where the step loads it: unbound, the
    hook reports rank 0's step and saves the same every-rank state back."""
    from mergecomp.pipeline.resharding import EVERY_RANK, to_fold
    from mergecomp.torch.ddp_hook import DDPHookState

    def residuals(state):
        return [each["memory"]["g"]["residual"].tolist() for each in state[EVERY_RANK]]

    states = [{"step": 7, "memory": {"g": {"residual": torch.full((3,), float(r))}}} for r in range(3)]
    state = DDPHookState(build=lambda: None)
    state.load_state_dict(to_fold(states, "drop"))
    assert state.step == 7 and not state.bound
    saved = state.state_dict()
    assert saved["residuals"] == "drop" and residuals(saved) == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    again = DDPHookState(build=lambda: None)
    again.load_state_dict(saved)
    assert again.step == 7 and residuals(again.state_dict()) == residuals(saved)
