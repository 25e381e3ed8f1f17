"""mergecomp.torch.integrations with the real frameworks (Lightning, Accelerate, transformers'
Trainer) on 2 gloo ranks over loopback: each trains a tiny model, the lossless hook ends where
plain DDP does, a compressor leaves both ranks with the same parameters, the hook runs every step,
and a run resumed from a checkpoint ends exactly where the uninterrupted one does (and does not
without mergecomp's state).  One launch per framework; the tests below read its results.  A
framework that is not installed skips its tests."""
import contextlib
import importlib.util
import logging
import os
import warnings

import pytest
import torch
from distributed import free_port, run_workers

from mergecomp.torch.momentum_exchange import LrWarmup

#: an option left out, where None would give it
DEFAULT = object()


def requires(module):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install -e '.[integrations]')")


#: 64 samples, 8 features, 4 classes; each rank trains on its half, 8 samples a batch
def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return x, (x @ torch.randn(8, 4, generator=g)).argmax(dim=1)


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@contextlib.contextmanager
def kept_environment():
    """The frameworks edit os.environ (Lightning's environment drops WORLD_SIZE at teardown);
    the pooled workers need theirs back."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def residual_total(record):
    """Sum of |residual| of every rank's error-feedback memory in a checkpoint record."""
    return [sum(t.abs().sum().item() for fields in state["memory"].values() for t in fields.values())
            for state in record["ranks"]]


# -- Lightning -----------------------------------------------------------------------------------
def _lightning_kit():
    """Lightning's tiny module and ``fit(strategy, epochs, module, ckpt, save)`` on the workers' ranks."""
    import lightning.pytorch as pl

    import mergecomp.torch as mc

    logging.getLogger("lightning").setLevel(logging.ERROR)
    x, y = make_data()

    class Tiny(pl.LightningModule):
        def __init__(self, exchange=None, momentum_after=None, beta2=0.999):
            super().__init__()
            self.net, self.exchange, self.momentum_after, self.beta2 = make_net(), exchange, momentum_after, beta2

        def training_step(self, batch, index):
            self.wrapped = self.trainer.strategy.model is not self  # in DDP?
            self.bucket_views = getattr(self.trainer.strategy.model, "gradient_as_bucket_view", None)
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            if self.exchange == "hook":  # plain AdamW: the DDP hook exchanges its momentum
                return torch.optim.AdamW(self.parameters(), lr=0.01, betas=(0.9, self.beta2), weight_decay=0.1)
            if self.momentum_after == "default":  # AdamW's momentum by DistributedOptimizer's default
                opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
                return mc.DistributedOptimizer(opt, named_parameters=self.named_parameters(), compression=self.exchange,
                                               groups=1, total_steps=8)
            if self.momentum_after:  # AdamW with its momentum exchanged after a lossless warm-up
                opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
                return mc.DistributedOptimizer(opt, named_parameters=self.named_parameters(), compression=self.exchange,
                                               groups=1, exchange_momentum_after=self.momentum_after,
                                               variance_refresh_every=2)
            opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
            if self.exchange is None:
                return opt
            return mc.DistributedOptimizer(opt, named_parameters=self.named_parameters(), compression=self.exchange,
                                           groups=1)

    def fit(strategy, epochs=2, module=None, ckpt=None, save=None, callbacks=None, plugins=None):
        module = module or Tiny()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
        with kept_environment():
            trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=epochs, logger=False,
                                 enable_checkpointing=callbacks is not None, callbacks=callbacks, plugins=plugins,
                                 enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, loader, ckpt_path=ckpt)
            if save:
                trainer.save_checkpoint(save)
        return flat(module)

    return Tiny, fit


def _lightning(rank, folder, port, saved_by_three):
    import mergecomp.torch as mc
    from mergecomp.torch.integrations.lightning import (CHECKPOINT_KEY, MergecompDDPStrategy, MergecompDiLoCoStrategy,
                                                        MergecompStrategy)

    import lightning.pytorch as pl

    Tiny, fit = _lightning_kit()

    def without_ours(path):
        """A copy of the checkpoint at ``path`` without mergecomp's entry."""
        bare = f"{path}.bare"
        if rank == 0:
            checkpoint = torch.load(path, weights_only=False)
            del checkpoint[CHECKPOINT_KEY]
            torch.save(checkpoint, bare)
        torch.distributed.barrier()
        return bare

    out = {"ddp": fit(pl.strategies.DDPStrategy())}
    # DDP with mergecomp's hook, on CPU
    module = Tiny()
    out["hook_none"] = fit(MergecompDDPStrategy("none", gradient_as_bucket_view=False), module=module)
    out["hook_none_bucket_views"] = module.bucket_views  # DDP's own argument stands
    strategy, module = MergecompDDPStrategy("topk"), Tiny()
    out["hook_topk"] = fit(strategy, module=module)
    out["hook_steps"], out["hook_wrapped"] = strategy.hook_state.step, module.wrapped
    out["hook_bucket_views"] = module.bucket_views
    path = os.path.join(folder, "hook.ckpt")
    fit(MergecompDDPStrategy("topk"), epochs=1, save=path)
    out["hook_record"] = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    resumed = MergecompDDPStrategy("topk")
    out["hook_resumed"] = fit(resumed, ckpt=path)
    out["hook_resumed_steps"] = resumed.hook_state.step
    out["hook_forgetful"] = fit(MergecompDDPStrategy("topk"), ckpt=without_ours(path))
    # the hook exchanging AdamW's momentum from update 3 on, Lightning's step(closure) included; DDP
    # keeps its first buckets (find_unused_parameters), so the resumed run's are the trained one's
    def adam_hook():
        return MergecompDDPStrategy("onebit", exchange_momentum_after=3, variance_refresh_every=2,
                                    find_unused_parameters=True)

    strategy = adam_hook()
    out["hook_adam"] = fit(strategy, module=Tiny("hook"))
    out["hook_adam_updates"] = strategy.hook_state.momentum.exchange.updates
    path = os.path.join(folder, "hook_adam.ckpt")
    fit(adam_hook(), epochs=1, module=Tiny("hook"), save=path)
    strategy = adam_hook()
    out["hook_adam_resumed"] = fit(strategy, module=Tiny("hook"), ckpt=path)
    out["hook_adam_resumed_updates"] = strategy.hook_state.momentum.exchange.updates
    # "auto", given and by default (AdamW's gradients through 1-bit SGD): fit's 8 updates, K = 2
    for label, options in (("auto", {"exchange_momentum_after": "auto"}), ("default", {})):
        strategy = MergecompDDPStrategy("onebit", **options)
        with warnings.catch_warnings(record=True) as caught:  # R follows the optimizer's beta2
            warnings.simplefilter("always")
            out[f"hook_adam_{label}_params"] = fit(strategy, module=Tiny("hook", beta2=0.95))
        momentum = strategy.hook_state.momentum.exchange
        out[f"hook_adam_{label}"] = (momentum.after, momentum.refresh_every, momentum.updates)
        out[f"hook_adam_{label}_warnings"] = [str(w.message) for w in caught if "measured with beta2" in str(w.message)]
    out["hook_adam_warnings"] = {}
    for compression, options in (("randk", {}), ("topk", {"exchange_momentum_after": None})):
        strategy = MergecompDDPStrategy(compression, **options)
        with warnings.catch_warnings(record=True) as caught:  # randk has no recipe: told what to add
            warnings.simplefilter("always")
            fit(strategy, epochs=1, module=Tiny("hook"))
        out["hook_adam_warnings"][compression] = (strategy.hook_state.momentum, [
            str(w.message) for w in caught if "exchange its momentum" in str(w.message)])

    # no DDP: mc.DistributedOptimizer exchanges, after mc.init() ran as one process (the README's
    # script under Lightning's launcher, as rank 0 sees it); the strategy starts mergecomp anew
    mc.shutdown()
    mc.init(engine="local")
    with kept_environment():
        os.environ["MASTER_PORT"] = str(port)  # Lightning starts the process group again
        out["opt_none"] = fit(MergecompStrategy(), module=Tiny("none"))
    out["opt_size"] = mc.size()
    module = Tiny("topk")
    out["opt_topk"] = fit(MergecompStrategy(), module=module)
    out["opt_wrapped"], out["opt_exchanges"] = module.wrapped, module.trainer.optimizers[0].merged.step
    path = os.path.join(folder, "opt.ckpt")
    fit(MergecompStrategy(), epochs=1, module=Tiny("topk"), save=path)
    out["opt_resumed"] = fit(MergecompStrategy(), module=Tiny("topk"), ckpt=path)
    out["opt_forgetful"] = fit(MergecompStrategy(), module=Tiny("topk"), ckpt=without_ours(path))
    # AdamW's momentum exchanged from update 3 on (epoch 1 ends at update 4): resumed in the phase
    module = Tiny("onebit", momentum_after=3)
    out["adam_onebit"] = fit(MergecompStrategy(), module=module)
    out["adam_phase"] = module.trainer.optimizers[0].momentum_exchange.active
    path = os.path.join(folder, "adam.ckpt")
    fit(MergecompStrategy(), epochs=1, module=Tiny("onebit", momentum_after=3), save=path)
    out["adam_resumed"] = fit(MergecompStrategy(), module=Tiny("onebit", momentum_after=3), ckpt=path)
    # the same by DistributedOptimizer's default under "16-mixed": the strategy hands the exchange
    # the precision plugin's GradScaler (without it the first update raises, naming grad_scaler=)
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = Tiny("onebit", momentum_after="default")
    out["adam_amp"] = fit(MergecompStrategy(), module=module, plugins=[MixedPrecision("16-mixed", "cpu")])
    momentum = module.trainer.optimizers[0].momentum_exchange
    out["adam_amp_exchange"] = (momentum.grad_scaler is module.trainer.precision_plugin.scaler, momentum.active,
                                momentum.updates)
    # checkpoints of 3 ranks resumed on these 2: every rank's residuals the mean of the 3 saved
    module = Tiny("topk")
    fit(MergecompStrategy(), epochs=1, module=module, ckpt=os.path.join(saved_by_three, "opt.ckpt"))
    out["opt_other_size"] = module.trainer.optimizers[0].merged.state_dict()
    strategy = MergecompDDPStrategy("topk")
    fit(strategy, epochs=1, ckpt=os.path.join(saved_by_three, "hook.ckpt"))
    out["hook_other_size"] = strategy.hook_state.bind().state_dict()
    # DiLoCo: with H = 1 and plain averaging as the outer step it is DDP (SGD's momentum is linear);
    # Streaming top-k resumed from a checkpoint taken mid-round, a fragment in flight
    out["diloco_every_step"] = fit(MergecompDiLoCoStrategy(1, outer_optimizer=mc.averaging))

    def diloco():
        return MergecompDiLoCoStrategy(4, "topk", fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)

    strategy, module = diloco(), Tiny()
    every_step = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(folder, "diloco"), every_n_train_steps=4,
                                              save_top_k=-1)
    out["diloco"] = fit(strategy, module=module, callbacks=[every_step])
    out["diloco_steps"] = strategy.diloco.inner_steps
    out["diloco_bucket_views"] = module.bucket_views
    path = os.path.join(folder, "diloco", "epoch=0-step=4.ckpt")
    out["diloco_record"] = torch.load(path, weights_only=False)[CHECKPOINT_KEY]
    out["diloco_resumed"] = fit(diloco(), ckpt=path)
    strategy = MergecompDiLoCoStrategy(4, "topk", fragments="auto", fragment_sync_delay="auto", fragment_codecs="auto")
    out["diloco_codecs_params"] = fit(strategy)
    out["diloco_codecs"] = strategy.diloco.fragment_codecs
    try:
        fit(MergecompStrategy(), module=Tiny())
    except TypeError as err:
        out["opt_plain"] = str(err)
    out["refused"] = {}
    for name, make in {"ddp_comm_hook": lambda: MergecompDDPStrategy(ddp_comm_hook=lambda state, bucket: None),
                       "groups": lambda: MergecompDDPStrategy("topk", groups=2),
                       "find_unused_parameters": lambda: MergecompStrategy(find_unused_parameters=True)}.items():
        try:
            make()
        except (TypeError, ValueError) as err:
            out["refused"][name] = f"{type(err).__name__}: {err}"
    return out


def _lightning_on_three(rank, folder, port):
    """Checkpoints of a 3-rank job: the DDP hook's and mc.DistributedOptimizer's, with top-k."""
    import mergecomp.torch as mc
    from mergecomp.torch.integrations.lightning import MergecompDDPStrategy, MergecompStrategy

    Tiny, fit = _lightning_kit()
    fit(MergecompDDPStrategy("topk"), epochs=1, save=os.path.join(folder, "hook.ckpt"))
    mc.shutdown()
    mc.init(engine="local")
    with kept_environment():
        os.environ["MASTER_PORT"] = str(port)  # Lightning starts the process group again
        fit(MergecompStrategy(), epochs=1, module=Tiny("topk"), save=os.path.join(folder, "opt.ckpt"))
    if rank == 0:
        return {name: torch.load(os.path.join(folder, f"{name}.ckpt"), weights_only=False) for name in ("hook", "opt")}
    return None


@pytest.fixture(scope="module")
def lightning_on_three(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lightning3"))
    saved = run_workers(_lightning_on_three, 3, folder, free_port(), timeout=240)[0]
    return folder, saved


@pytest.fixture(scope="module")
def lightning(tmp_path_factory, lightning_on_three):
    return run_workers(_lightning, 2, str(tmp_path_factory.mktemp("lightning")), free_port(), lightning_on_three[0],
                       timeout=300)


@requires("lightning")
def test_lightning_hook_strategy_trains_on_cpu_like_ddp(lightning):
    for out in lightning:
        assert (out["hook_none"] - out["ddp"]).abs().max().item() < 1e-6
        assert out["hook_steps"] == 8 and out["hook_wrapped"]  # the hook ran every step (DDPStrategy's: CUDA only)
        # gradients written into DDP's buckets unless the user says otherwise
        assert out["hook_bucket_views"] and not out["hook_none_bucket_views"]
        assert not torch.equal(out["hook_topk"], out["ddp"])
    assert torch.equal(lightning[0]["hook_topk"], lightning[1]["hook_topk"])


@requires("lightning")
def test_lightning_hook_strategy_resumes_exactly(lightning):
    record = lightning[0]["hook_record"]
    assert record["world_size"] == 2 and [state["rank"] for state in record["ranks"]] == [0, 1]
    assert all(total > 0 for total in residual_total(record))
    for out in lightning:
        assert out["hook_resumed_steps"] == 8
        assert torch.equal(out["hook_resumed"], out["hook_topk"])
        assert not torch.equal(out["hook_forgetful"], out["hook_topk"])


@requires("lightning")
def test_lightning_hook_strategy_exchanges_adamws_momentum_and_resumes_exactly(lightning):
    """MergecompDDPStrategy("onebit", exchange_momentum_after=3) with a plain AdamW from
    configure_optimizers: 8 updates, 5 of them in the momentum phase (Lightning runs the
    backward pass inside optimizer.step(closure)); resumed after epoch 1, the same parameters.
    ``MergecompDDPStrategy("onebit")`` alone trains as with ``exchange_momentum_after="auto"``;
    a compressor without a recipe, or the option given as None, sends the gradients."""
    for out in lightning:
        assert out["hook_adam_updates"] == 8 and out["hook_adam_resumed_updates"] == 8
        for label in ("auto", "default"):  # onebit's recipe: a quarter of fit's 8 updates, R for beta2 0.95
            assert out[f"hook_adam_{label}"] == (2, 8, 8)
            assert len(out[f"hook_adam_{label}_warnings"]) == 1
            assert "with beta2=0.95" in out[f"hook_adam_{label}_warnings"][0]
        assert torch.equal(out["hook_adam_default_params"], out["hook_adam_auto_params"])
        momentum, [told] = out["hook_adam_warnings"]["randk"]
        assert momentum is None and told.startswith("MergecompDDPStrategy: 'randk'")
        assert "exchange_momentum_after=K" in told
        assert out["hook_adam_warnings"]["topk"] == (None, [])  # the user's gradients, no word
        assert torch.equal(out["hook_adam_resumed"], out["hook_adam"])
        assert not torch.equal(out["hook_adam"], out["hook_none"])
    assert torch.equal(lightning[0]["hook_adam"], lightning[1]["hook_adam"])


@requires("lightning")
def test_lightning_resumes_three_ranks_checkpoints_on_two_with_the_residuals_folded(lightning, lightning_on_three):
    """Each rank of the 2 holds the mean of the 3 saved ranks' residuals, never one rank's own."""
    from mergecomp.torch.integrations.lightning import CHECKPOINT_KEY

    for name, own in (("hook", lambda state: state), ("opt", lambda states: states[0])):
        record = lightning_on_three[1][name][CHECKPOINT_KEY]
        assert record["world_size"] == 3
        saved = [own(state) for state in record["ranks"]]
        for out in lightning:
            resumed = out[f"{name}_other_size"]
            assert resumed["step"] == saved[0]["step"] > 0 and resumed["memory"].keys() == saved[0]["memory"].keys()
            for group, fields in resumed["memory"].items():
                for field, value in fields.items():
                    each = [state["memory"][group][field] for state in saved]
                    assert not any(torch.equal(value, mine) for mine in each)
                    torch.testing.assert_close(value, torch.stack(each).mean(dim=0))


@requires("lightning")
def test_lightning_diloco_strategy_averages_like_ddp_and_resumes_exactly(lightning):
    """``MergecompDiLoCoStrategy``: with H = 1 and plain averaging it is DDP; Streaming DiLoCo
    with top-k resumed from a checkpoint taken while a fragment is in flight (each rank's local
    parameters differing) ends where the uninterrupted run does; at the end every rank holds
    the global model; ``fragments``, ``fragment_sync_delay`` and ``fragment_codecs="auto"`` pass
    through it to DiLoCo, the same choice on every rank."""
    for out in lightning:
        assert (out["diloco_every_step"] - out["ddp"]).abs().max().item() < 1e-5
        assert out["diloco_steps"] == 8 and torch.equal(out["diloco_resumed"], out["diloco"])
        assert len(out["diloco_codecs"]) == 2, out["diloco_codecs"]  # H = 4: two fragments, chosen at step 2
        assert out["diloco_bucket_views"]
    assert torch.equal(lightning[0]["diloco"], lightning[1]["diloco"])
    assert lightning[0]["diloco_codecs"] == lightning[1]["diloco_codecs"]
    assert torch.equal(lightning[0]["diloco_codecs_params"], lightning[1]["diloco_codecs_params"])
    ranks = lightning[0]["diloco_record"]["ranks"]
    assert ranks[0]["diloco"]["in_flight"] is not None
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["parameters"], ranks[1]["parameters"]))


@requires("lightning")
def test_lightning_optimizer_strategy_exchanges_once(lightning):
    for out in lightning:
        assert out["opt_size"] == 2
        assert not out["opt_wrapped"] and out["opt_exchanges"] == 8  # one exchange a step: ours, no DDP's
        assert (out["opt_none"] - out["ddp"]).abs().max().item() < 1e-6
        assert torch.equal(out["opt_resumed"], out["opt_topk"])
        assert not torch.equal(out["opt_forgetful"], out["opt_topk"])
        assert "not a mc.DistributedOptimizer" in out["opt_plain"]
    assert torch.equal(lightning[0]["opt_topk"], lightning[1]["opt_topk"])


@requires("lightning")
def test_lightning_optimizer_strategy_exchanges_adams_momentum(lightning):
    """AdamW with exchange_momentum_after and 1-bit SGD under MergecompStrategy: the momentum
    phase runs, the ranks agree, and a run resumed inside the phase ends where the uninterrupted
    one does; by DistributedOptimizer's default under "16-mixed" the strategy hands the exchange
    the precision plugin's GradScaler and the run trains into the momentum phase."""
    start = flat(make_net())
    for out in lightning:
        assert out["adam_phase"]
        assert not torch.equal(out["adam_onebit"], start) and torch.isfinite(out["adam_onebit"]).all()
        assert torch.equal(out["adam_resumed"], out["adam_onebit"])
        assert not torch.equal(out["adam_amp"], start) and torch.isfinite(out["adam_amp"]).all()
        handed, active, updates = out["adam_amp_exchange"]
        assert handed and active and 0 < updates <= 8  # into the momentum phase; a scaler's skip not counted
    assert torch.equal(lightning[0]["adam_onebit"], lightning[1]["adam_onebit"])
    assert torch.equal(lightning[0]["adam_amp"], lightning[1]["adam_amp"])


@requires("lightning")
def test_lightning_refuses_what_it_cannot_honour(lightning):
    refused = lightning[0]["refused"]
    assert refused["ddp_comm_hook"].startswith("ValueError") and "ddp_comm_hook" in refused["ddp_comm_hook"]
    assert refused["groups"].startswith("TypeError") and "['groups']" in refused["groups"]
    assert "find_unused_parameters" in refused["find_unused_parameters"]


# -- Accelerate ----------------------------------------------------------------------------------
def _accelerate(rank, folder):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    import mergecomp.torch as mc
    from mergecomp.torch.integrations.accelerate import register, register_diloco

    x, y = make_data()
    x, y = x[32 * rank:][:32], y[32 * rank:][:32]

    def run(compression=None, steps=range(6), save=None, load=None, adamw=False, after=2, diloco=None,
            first_buckets=False, total=40):
        # DDP's default for plain DDP, bucket views as the docs say for mergecomp; first_buckets: DDP
        # keeps its first buckets (find_unused_parameters), so a fresh one's are the trained one's
        with kept_environment():
            views = ([DistributedDataParallelKwargs(gradient_as_bucket_view=True, find_unused_parameters=first_buckets)]
                     if compression else None)
            accelerator = Accelerator(cpu=True, kwargs_handlers=views)
            net = make_net()
            made = (torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1) if adamw
                    else torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9))
            model, opt = accelerator.prepare(net, made)
            momentum = {"optimizer": opt, **({} if after == DEFAULT else {"exchange_momentum_after": after})} \
                if adamw else {}
            if after == "auto" and total:
                # onebit's recipe: K = 0.6 x 5 % of 40 updates, at least a quarter of them: 10
                momentum["total_steps"] = total
            if diloco is not None:
                state = register_diloco(accelerator, model, opt, compression=compression, **diloco)
            else:
                state = register(accelerator, model, compression, **momentum) if compression else None
            if load:
                accelerator.load_state(load)
            for step in steps:
                batch = slice(8 * (step % 4), 8 * (step % 4) + 8)
                opt.zero_grad()
                accelerator.backward(torch.nn.functional.cross_entropy(model(x[batch]), y[batch]))
                opt.step()
                if save and step == 2:
                    accelerator.save_state(save)
        return flat(net), state

    out = {"ddp": run()[0], "none": run("none")[0]}
    path = os.path.join(folder, "state")
    out["topk"], state = run("topk", save=path)
    out["topk_steps"] = state.step
    out["record"] = torch.load(os.path.join(path, "custom_checkpoint_0.pkl"), weights_only=False)
    out["resumed"], state = run("topk", steps=range(3, 6), load=path)
    out["resumed_steps"] = state.step
    # AdamW (through Accelerate's optimizer wrapper) with its momentum exchanged from update 3 on,
    # with DDP's first buckets kept and with its default (rebuilt after the first step)
    for suffix, first_buckets in (("", True), ("_rebuilt", False)):
        path = os.path.join(folder, f"adam_state{suffix}")
        out[f"adam{suffix}"], state = run("onebit", save=path, adamw=True, first_buckets=first_buckets)
        out[f"adam_updates{suffix}"] = state.momentum.exchange.updates
        out[f"adam_resumed{suffix}"], state = run("onebit", steps=range(3, 6), load=path, adamw=True,
                                                  first_buckets=first_buckets)
        out[f"adam_resumed_updates{suffix}"] = state.momentum.exchange.updates
    state = run("onebit", adamw=True, after="auto")[1]
    out["adam_auto"] = (state.momentum.exchange.after, state.momentum.exchange.refresh_every)
    for label, after in (("auto", "auto"), ("default", DEFAULT)):  # K follows the LR; optimizer=opt alone: "auto"
        out[f"adam_{label}_params"], state = run("onebit", adamw=True, after=after, total=None)
        exchange = state.momentum.exchange
        out[f"adam_{label}_followed"] = (exchange.after, exchange.follow, exchange.updates, exchange.active)
    # DiLoCo around Accelerate's optimizer: every step with plain averaging is DDP; top-k every
    # 4 steps resumed from a state saved mid-round
    averaging = {"sync_every": 1, "outer_optimizer": mc.averaging}
    out["diloco_averaging"] = run("none", diloco=averaging)[0]
    path = os.path.join(folder, "diloco_state")
    out["diloco_topk"], state = run("topk", save=path, diloco={"sync_every": 4})
    out["diloco_steps"] = state.inner_steps
    out["diloco_resumed"], state = run("topk", steps=range(3, 6), load=path, diloco={"sync_every": 4})
    out["diloco_resumed_steps"] = state.inner_steps
    state.sync()
    out["diloco_synced"] = torch.cat([p.detach().reshape(-1) for p in state.params])
    with kept_environment():
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(make_net())
        register(accelerator, model, "fp16", checkpoint=False)
        try:
            register(accelerator, model, "topk", checkpoint=False)
        except RuntimeError as err:
            out["twice"] = str(err)
    return out


@pytest.fixture(scope="module")
def accelerate(tmp_path_factory):
    return run_workers(_accelerate, 2, str(tmp_path_factory.mktemp("accelerate")), timeout=180)


@requires("accelerate")
def test_accelerate_register_trains_like_ddp_and_resumes_exactly(accelerate):
    for out in accelerate:
        assert (out["none"] - out["ddp"]).abs().max().item() < 1e-6
        assert out["topk_steps"] == 6 and not torch.equal(out["topk"], out["ddp"])
        assert out["resumed_steps"] == 6 and torch.equal(out["resumed"], out["topk"])
    assert torch.equal(accelerate[0]["topk"], accelerate[1]["topk"])
    record = accelerate[0]["record"]
    assert record["world_size"] == 2 and all(total > 0 for total in residual_total(record))
    assert "already has a communication hook" in accelerate[0]["twice"]


@requires("accelerate")
def test_accelerate_register_diloco_averages_like_ddp_and_resumes_exactly(accelerate):
    for out in accelerate:
        assert (out["diloco_averaging"] - out["ddp"]).abs().max().item() < 1e-6
        assert out["diloco_steps"] == 6 and out["diloco_resumed_steps"] == 6
        assert torch.equal(out["diloco_resumed"], out["diloco_topk"])
    assert not torch.equal(accelerate[0]["diloco_topk"], accelerate[1]["diloco_topk"])  # mid-round: each its own
    assert torch.equal(accelerate[0]["diloco_synced"], accelerate[1]["diloco_synced"])


@requires("accelerate")
def test_accelerate_register_exchanges_adamws_momentum_and_resumes_exactly(accelerate):
    """``register(accelerator, model, "onebit", exchange_momentum_after=2, optimizer=opt)`` with
    the prepared (wrapped) AdamW: 6 updates, the last 4 in the momentum phase; ``load_state``
    after step 3 ends where the uninterrupted run does: bit for bit where a fresh DDP's buckets
    are the trained one's; with DDP's default, whose first buckets after the restart hold the
    tensors in another order than the rebuilt ones, 1-bit SGD's side means round otherwise in the
    last digit at that step (docs/frontends.md), and nothing more is lost."""
    for out in accelerate:
        for suffix in ("", "_rebuilt"):
            assert out[f"adam_updates{suffix}"] == 6 and out[f"adam_resumed_updates{suffix}"] == 6
        assert torch.equal(out["adam_resumed"], out["adam"])
        torch.testing.assert_close(out["adam_resumed_rebuilt"], out["adam_rebuilt"], rtol=0, atol=1e-6)
        assert out["adam_auto"] == (10, 32)
        assert out["adam_auto_followed"] == (None, LrWarmup(0.6, 150), 6, False)  # still warming up
        assert out["adam_default_followed"] == out["adam_auto_followed"]  # optimizer=opt alone: "auto"
        assert torch.equal(out["adam_default_params"], out["adam_auto_params"])
    assert torch.equal(accelerate[0]["adam"], accelerate[1]["adam"])


# -- transformers' Trainer -----------------------------------------------------------------------
def trainer_run(output_dir, register_args=None, resume=None, diloco=False, **training_args):
    """The tiny net trained by a transformers ``Trainer`` (``register(trainer, **register_args)``
    unless None; ``register_diloco`` with ``diloco``), with ``training_args`` over these:
    ``(parameters, callback)``."""
    from transformers import Trainer, TrainingArguments

    from mergecomp.torch.integrations.transformers import register, register_diloco

    logging.getLogger("transformers").setLevel(logging.ERROR)
    x, y = make_data()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def forward(self, x, labels):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    with kept_environment():
        args = TrainingArguments(**{"output_dir": output_dir, "per_device_train_batch_size": 8, "logging_strategy": "no",
                                    "report_to": "none", "use_cpu": True, "seed": 0, "disable_tqdm": True,
                                    **training_args})
        model = Tiny()
        trainer = Trainer(model=model, args=args, train_dataset=[{"x": a, "labels": b} for a, b in zip(x, y)])
        callback = None if register_args is None else (register_diloco if diloco else register)(trainer, **register_args)
        trainer.train(resume_from_checkpoint=resume)
    return flat(model), callback


def _transformers(rank, folder, saved_by_three):
    import shutil

    import mergecomp.torch as mc
    from mergecomp.torch.integrations.transformers import DILOCO_STATE_FILE, STATE_FILE

    def train(run, compression=None, resume=None):
        return trainer_run(os.path.join(folder, run), compression and {"compression": compression}, resume,
                           max_steps=4, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", save_steps=2)

    def copied(run, keep_state=True):
        """``topk``'s checkpoint after step 2, copied to ``run``'s output folder."""
        target = os.path.join(folder, run, "checkpoint-2")
        if rank == 0:
            shutil.copytree(os.path.join(folder, "topk", "checkpoint-2"), target)
            if not keep_state:
                os.remove(os.path.join(target, STATE_FILE))
        torch.distributed.barrier()
        return target

    out = {"ddp": train("ddp")[0], "none": train("none", "none")[0]}
    out["topk"], callback = train("topk", "topk")
    out["topk_steps"] = callback.hook_state.step
    out["topk_bucket_views"] = callback.trainer.model_wrapped.gradient_as_bucket_view
    out["record"] = torch.load(os.path.join(folder, "topk", "checkpoint-2", STATE_FILE), weights_only=True)
    copied("resumed")
    out["resumed"], callback = train("resumed", "topk", resume=True)
    out["resumed_steps"] = callback.hook_state.step
    out["forgetful"] = train("forgetful", "topk", resume=copied("forgetful", keep_state=False))[0]

    # AdamW's momentum exchanged from update 3 on, with a linear schedule and clipping; DDP keeps its
    # first buckets (find_unused_parameters), so the resumed run's are the trained one's
    def train_adam(run, resume=None, after=2, optim="adamw_torch"):
        options = {"compression": "onebit", **({} if after is DEFAULT else {"exchange_momentum_after": after})}
        params, callback = trainer_run(os.path.join(folder, run), options, resume, max_steps=8, learning_rate=1e-2,
                                       lr_scheduler_type="linear", warmup_steps=2, optim=optim, weight_decay=0.1,
                                       max_grad_norm=1.0, save_steps=4, ddp_find_unused_parameters=True)
        return params, callback.hook_state.momentum.exchange

    out["adam"], momentum = train_adam("adam")
    out["adam_active"], out["adam_updates"] = momentum.active, momentum.updates
    out["adam_record"] = torch.load(os.path.join(folder, "adam", "checkpoint-4", STATE_FILE), weights_only=True)
    elsewhere = os.path.join(folder, "elsewhere", "step-4")  # outside the resumed run's output_dir
    if rank == 0:
        shutil.copytree(os.path.join(folder, "adam", "checkpoint-4"), elsewhere)
    torch.distributed.barrier()
    out["adam_resumed"], momentum = train_adam("adam_resumed", resume=elsewhere)
    out["adam_resumed_updates"] = momentum.updates
    # onebit's recipe, 0.6 LR warm-ups of 2 updates: asked for, by default, and by default with the
    # Trainer's default optimizer (a fused AdamW)
    for label, after, optim in (("auto", "auto", "adamw_torch"), ("default", DEFAULT, "adamw_torch"),
                                ("fused", DEFAULT, "adamw_torch_fused")):
        out[f"adam_{label}_params"], momentum = train_adam(f"adam_{label}", after=after, optim=optim)
        out[f"adam_{label}"] = (momentum.after, momentum.refresh_every, momentum.exchange.compressor.name,
                                momentum.updates, momentum.active)
    out["adam_warnings"] = {}
    for compression, options in (("randk", {}), ("topk", {"exchange_momentum_after": None})):
        with warnings.catch_warnings(record=True) as caught:  # randk has no recipe: told what to add
            warnings.simplefilter("always")
            callback = trainer_run(os.path.join(folder, f"adam_{compression}"), {"compression": compression, **options},
                                   max_steps=1, optim="adamw_torch", save_strategy="no")[1]
        out["adam_warnings"][compression] = (callback.hook_state.momentum, [
            str(w.message) for w in caught if "exchange its momentum" in str(w.message)])

    # DiLoCo around the Trainer's SGD: with H = 1 and plain averaging as the outer step it is DDP
    # (unclipped: DDP clips the average of the gradients, DiLoCo each rank's own, whose norms here
    # pass the Trainer's default of 1 where the average's do not)
    sgd = {"max_steps": 4, "learning_rate": 0.5, "lr_scheduler_type": "constant", "optim": "sgd",
           "save_strategy": "no", "max_grad_norm": 0}
    out["ddp_unclipped"] = trainer_run(os.path.join(folder, "ddp_unclipped"), **sgd)[0]
    out["diloco_every_step"] = trainer_run(os.path.join(folder, "diloco_every_step"),
                                           {"sync_every": 1, "outer_optimizer": mc.averaging}, diloco=True, **sgd)[0]

    out["diloco"], callback = trainer_diloco(os.path.join(folder, "diloco"))
    out["diloco_steps"] = callback.diloco.inner_steps
    out["diloco_bucket_views"] = callback.trainer.model_wrapped.gradient_as_bucket_view
    out["diloco_record"] = torch.load(os.path.join(folder, "diloco", "checkpoint-2", DILOCO_STATE_FILE),
                                      weights_only=True)
    out["diloco_resumed"], _ = trainer_diloco(os.path.join(folder, "diloco_resumed"),
                                              os.path.join(folder, "diloco", "checkpoint-2"))

    # the 3-rank job's checkpoint resumed here: trained to the end, then loaded once more to look at
    other_size = os.path.join(saved_by_three, "checkpoint-2")
    out["diloco_other_size"], callback = trainer_diloco(os.path.join(folder, "diloco_other_size"), other_size)
    callback._ranks.load_state_dict(torch.load(os.path.join(other_size, DILOCO_STATE_FILE), weights_only=True))
    diloco = callback.diloco
    out["diloco_other_size_loaded"] = {"memories": [f.merged.state_dict()["memory"] for f in diloco.fragments],
                                       "parameters": [p.detach().clone() for p in diloco.params]}
    return out


def trainer_diloco(output_dir, resume=None):
    """Streaming DiLoCo with top-k around the Trainer's AdamW, 6 steps, a checkpoint after step 2
    (while fragment 0 is in flight): ``trainer_run``'s."""
    return trainer_run(output_dir, {"sync_every": 4, "compression": "topk", "fragments": 2, "fragment_sync_delay": 1,
                                    "fragment_update_alpha": 0.5},
                       resume, diloco=True, max_steps=6, learning_rate=0.2, lr_scheduler_type="constant",
                       optim="adamw_torch", save_steps=2)


def _transformers_on_three(rank, folder):
    """The Trainer's DiLoCo checkpoints of a 3-rank job; rank 0 returns its record of step 2."""
    from mergecomp.torch.integrations.transformers import DILOCO_STATE_FILE

    trainer_diloco(folder)
    return torch.load(os.path.join(folder, "checkpoint-2", DILOCO_STATE_FILE), weights_only=True) if rank == 0 else None


@pytest.fixture(scope="module")
def transformers_on_three(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("transformers3"))
    return folder, run_workers(_transformers_on_three, 3, folder, timeout=180)[0]


@pytest.fixture(scope="module")
def transformers(tmp_path_factory, transformers_on_three):
    return run_workers(_transformers, 2, str(tmp_path_factory.mktemp("transformers")), transformers_on_three[0],
                       timeout=240)


@requires("transformers")
@requires("accelerate")
def test_transformers_trainer_callback_trains_like_ddp_and_resumes_exactly(transformers):
    for out in transformers:
        assert (out["none"] - out["ddp"]).abs().max().item() < 1e-6
        assert out["topk_steps"] == 4 and not torch.equal(out["topk"], out["ddp"])
        assert out["topk_bucket_views"]  # register() has the Trainer's DDP write gradients into its buckets
        assert out["resumed_steps"] == 4 and torch.equal(out["resumed"], out["topk"])
        assert not torch.equal(out["forgetful"], out["topk"])
    assert torch.equal(transformers[0]["topk"], transformers[1]["topk"])
    record = transformers[0]["record"]
    assert record["world_size"] == 2 and all(total > 0 for total in residual_total(record))


@requires("transformers")
@requires("accelerate")
def test_transformers_trainer_exchanges_adamws_momentum_and_resumes_from_any_folder(transformers):
    """``register(trainer, "onebit", exchange_momentum_after=2)`` with the Trainer's AdamW, linear
    schedule and clipping: the momentum phase runs through the Trainer's own optimizer step, the
    ranks stay identical, and ``train(resume_from_checkpoint=<a folder outside output_dir>)``
    ends exactly where the uninterrupted run does.  ``register(trainer, "onebit")`` alone trains
    as with ``exchange_momentum_after="auto"``, also with the Trainer's default fused AdamW; a
    compressor without a recipe, or the option given as None, sends the gradients."""
    for out in transformers:
        assert out["adam_active"] and out["adam_updates"] == 8 and out["adam_resumed_updates"] == 8
        assert torch.equal(out["adam_resumed"], out["adam"])
        for label in ("auto", "default", "fused"):
            assert out[f"adam_{label}"] == (2, 32, "onebit", 8, True)
        assert torch.equal(out["adam_default_params"], out["adam_auto_params"])
        # the fused kernel rounds otherwise in the warm-up; the momentum phase is the same update
        torch.testing.assert_close(out["adam_fused_params"], out["adam_auto_params"], rtol=0, atol=1e-5)
        assert out["adam_record"]["ranks"][0]["mergecomp_momentum"]["updates"] == 4
        momentum, [told] = out["adam_warnings"]["randk"]
        assert momentum is None and told.startswith("MergecompCallback: 'randk'")
        assert "exchange_momentum_after=K" in told
        assert out["adam_warnings"]["topk"] == (None, [])  # the user's gradients, no word
    assert torch.equal(transformers[0]["adam"], transformers[1]["adam"])


@requires("transformers")
@requires("accelerate")
def test_transformers_trainer_trains_with_diloco_and_resumes_exactly(transformers):
    """``register_diloco``: the DDP model sends nothing in the inner steps (with H = 1 and plain
    averaging DiLoCo is DDP); Streaming DiLoCo with top-k resumes exactly from a checkpoint taken
    while a fragment is in flight, every rank from its own local parameters (they differ there);
    at the end every rank holds the global model."""
    for out in transformers:
        assert (out["diloco_every_step"] - out["ddp_unclipped"]).abs().max().item() < 1e-6
        assert out["diloco_steps"] == 6 and torch.equal(out["diloco_resumed"], out["diloco"])
        assert out["diloco_bucket_views"]
    assert torch.equal(transformers[0]["diloco"], transformers[1]["diloco"])
    ranks = transformers[0]["diloco_record"]["ranks"]
    assert ranks[0]["diloco"]["in_flight"]["fragment"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["parameters"], ranks[1]["parameters"]))


@requires("transformers")
@requires("accelerate")
def test_transformers_trainer_resumes_three_ranks_diloco_on_two_with_the_memories_folded(transformers,
                                                                                        transformers_on_three):
    """A 3-rank job's DiLoCo checkpoint resumed on 2 ranks: it trains to the end with the ranks
    equal, and each rank loads the mean of the 3 saved ranks' error-feedback memories (never one
    rank's own) and rank 0's local parameters."""
    record = transformers_on_three[1]
    assert record["world_size"] == 3
    saved = record["ranks"]
    assert torch.equal(transformers[0]["diloco_other_size"], transformers[1]["diloco_other_size"])
    for out in transformers:
        loaded = out["diloco_other_size_loaded"]
        for parameter, rank0 in zip(loaded["parameters"], saved[0]["parameters"]):
            assert torch.equal(parameter, rank0)
        assert loaded["memories"][0]  # fragment 0 was sent before step 2 (fragment 1 was not)
        for k, memory in enumerate(loaded["memories"]):
            for group, fields in memory.items():
                for field, value in fields.items():
                    each = [state["diloco"]["fragments"][k]["mergecomp"]["memory"][group][field] for state in saved]
                    assert not any(torch.equal(value, mine) for mine in each)
                    torch.testing.assert_close(value, torch.stack(each).mean(dim=0))


@requires("transformers")
@requires("accelerate")
@pytest.mark.parametrize("warmup,steps,run", [(0, 2000, (2000, 0)), (300, 2000, (2000, 300)), (0.1, 2000, (2000, 200))])
def test_the_trainers_auto_sees_the_run_and_its_lr_warm_up(tmp_path, warmup, steps, run):
    from transformers import TrainingArguments

    from mergecomp.torch.integrations.transformers import run_length

    with kept_environment():
        args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup, use_cpu=True, report_to="none")
    assert run_length(args, steps) == {"total_steps": run[0], "lr_warmup_steps": run[1]}
