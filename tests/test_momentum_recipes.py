"""exchange_momentum_after="auto": each compressor's recipe, scaled to the run, chosen in one
place for every front end; an option the user gives stands; what it cannot do raises."""
import warnings

import pytest
import torch
from distributed import run_workers
from test_momentum_exchange import AFTER, flat_params, make_adam, make_data, make_model, make_schedule, run, shard

import mergecomp
from mergecomp.torch.momentum_exchange import LrWarmup, MomentumSettings
from mergecomp.torch.momentum_recipes import RECIPES, adapt, choose, momentum_by_default


def test_each_recipe_scales_its_warm_up_to_the_runs_lr_warm_up():
    """K in LR warm-ups (5 % of total_steps where the warm-up is not given), at least 150
    updates (a quarter of a shorter run), the recipe's refresh interval, warm-up codec, wire
    form and compressor settings."""
    compression, options, _ = choose("topk", {"exchange_momentum_after": "auto", "total_steps": 2000}, "test")
    assert (compression.ratio, compression.value_dtype) == (0.025, "fp16")
    assert options == {"exchange_momentum_after": 150, "variance_refresh_every": 32,
                       "exchange_momentum_as": "momentum", "compression_warmup_codec": "qsgd"}
    compression, options, _ = choose("powersgd", {"exchange_momentum_after": "auto", "lr_warmup_steps": 200,
                                                  "total_steps": 5000}, "test")
    assert (compression.rank, options["exchange_momentum_after"], options["exchange_momentum_as"]) == (16, 240, "increment")

    def after(name, **run):
        return choose(name, {"exchange_momentum_after": "auto", **run}, "test")[1]["exchange_momentum_after"]

    # 0.6 LR warm-ups: 60 of a 2,000-update run, 600 of a 20,000-update one, 18 of 600: at least 150 (a quarter of 600)
    assert [after("onebit", total_steps=n) for n in (2000, 20000, 600, 100)] == [150, 600, 150, 25]
    assert (after("onebit", lr_warmup_steps=30), after("onebit", lr_warmup_steps=10, total_steps=40)) == (150, 10)
    assert choose("none", {"exchange_momentum_after": "auto", "total_steps": 10}, "test")[1] == {
        "exchange_momentum_after": 3, "exchange_momentum_as": "momentum", "compression_warmup_codec": "none"}


def test_a_short_run_takes_its_recipes_short_run_codec():
    """A warm-up of more than a tenth of ``total_steps`` in 8-bit QSGD takes 4-bit QSGD instead; a
    tenth or less, a run of unknown length and the recipes of other codecs keep theirs; a codec the
    user gives stands."""
    def codec(name, **given):
        return choose(name, {"exchange_momentum_after": "auto", **given}, "test")[1]["compression_warmup_codec"]

    assert [codec("onebit", total_steps=n) for n in (300, 600, 1200, 1500, 2000)] == ["qsgd4"] * 3 + ["qsgd"] * 2
    assert [codec(name, total_steps=600) for name in ("efsignsgd", "topk", "powersgd", "terngrad", "qsgd", "none")] \
        == ["qsgd4"] * 4 + ["fp16", "none"]
    assert codec("onebit") == codec("onebit", lr_warmup_steps=30) == "qsgd"
    assert codec("onebit", total_steps=600, compression_warmup_codec="fp16") == "fp16"


def test_what_the_user_gives_stands():
    mine = mergecomp.get_compressor("topk", ratio=0.1)
    compression, options, _ = choose(mine, {"exchange_momentum_after": "auto", "total_steps": 2000,
                                         "variance_refresh_every": 8, "exchange_momentum_as": "increment",
                                         "compression_warmup_codec": "fp16", "nonfinite": "skip"}, "test")
    assert compression is mine
    assert options == {"exchange_momentum_after": 150, "variance_refresh_every": 8, "exchange_momentum_as": "increment",
                       "compression_warmup_codec": "fp16", "nonfinite": "skip"}
    given = {"exchange_momentum_after": 7, "variance_refresh_every": None}  # no "auto": untouched
    assert choose("topk", given, "test") == ("topk", given, ())


class _Wrapper:
    """A framework's optimizer wrapper (Accelerate's, Lightning's): the torch optimizer as ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


@pytest.mark.parametrize("compression,optimizers,options,switched,warned", [
    ("onebit", ["AdamW"], {}, True, False),
    ("topk", ["wrapped Adam"], {}, True, False),
    ("onebit", ["fused AdamW"], {}, True, False),
    ("powersgd", ["AdamW"], {"nonfinite": "propagate"}, True, False),
    ("onebit", ["AdamW"], {"exchange_momentum_after": None}, False, False),  # the user's gradients, no word
    ("onebit", ["AdamW"], {"exchange_momentum_after": 7}, False, False),
    ("onebit", ["SGD"], {}, False, False),
    ("qsgd", ["AdamW"], {}, False, False),  # unbiased, no error feedback: its gradients are safe
    ("none", ["AdamW"], {}, False, False),
    ("randk", ["AdamW"], {}, False, True),  # no recipe
    ("onebit", ["amsgrad AdamW"], {}, False, True),  # an option the exchange does not implement
    ("onebit", ["AdamW", "AdamW"], {}, False, True),  # the exchange serves one optimizer
    ("terngrad", ["beta2 0.95 AdamW"], {"memory": "residual"}, True, False),
])
def test_a_hook_front_end_exchanges_adams_momentum_by_default_where_a_recipe_serves_it(
        caplog, compression, optimizers, options, switched, warned):
    """``momentum_by_default``: where the options do not name ``exchange_momentum_after``, one Adam or
    AdamW whose gradients a lossy compressor with error feedback would send gets ``"auto"``,
    with a logged warning naming the option that turns it off; where no recipe serves it, the
    gradients' warning names the line to add; everything else is left as it is, silently."""
    model = make_model()
    made = {"AdamW": lambda: make_adam(model), "wrapped Adam": lambda: _Wrapper(make_adam(model, "Adam")),
            "fused AdamW": lambda: make_adam(model, fused=True),
            "SGD": lambda: torch.optim.SGD(model.parameters(), 0.1),
            "amsgrad AdamW": lambda: make_adam(model, amsgrad=True),
            "beta2 0.95 AdamW": lambda: make_adam(model, betas=(0.9, 0.95))}
    memory = options.pop("memory", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = momentum_by_default(compression, memory, [made[name]() for name in optimizers], options, "Front")
    told = [str(w.message) for w in caught if "exchange its momentum" in str(w.message)]
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if switched:
        assert result == {**options, "exchange_momentum_after": "auto"}
        [line] = logged
        assert line.startswith("Front: ") and "exchanging its momentum instead" in line \
            and "exchange_momentum_after=None exchanges the gradients" in line, line
    else:
        assert result == options and logged == []
    if warned:
        [message] = told
        assert message.startswith(f"Front: {compression!r} with error feedback")
        assert "exchange_momentum_after=K" in message
    else:
        assert told == []


def test_without_the_runs_length_auto_follows_the_learning_rate():
    """Neither ``total_steps`` nor ``lr_warmup_steps`` (or 0): K is decided from the learning
    rate as the run goes, at least 150 updates and the recipe's multiple of the LR warm-up."""
    for length in ({}, {"total_steps": 0}):
        for name in ("onebit", "topk", "powersgd"):
            after = choose(name, {"exchange_momentum_after": "auto", **length}, "test")[1]["exchange_momentum_after"]
            assert after == LrWarmup(RECIPES[name].warmup, 150)
    assert [LrWarmup(1.5, 150).warmup(rose) for rose in (0, 100, 101, 1000)] == [150, 150, 152, 1500]
    for bad in ({"share": -1.0, "shortest": 150}, {"share": 0.6, "shortest": 0}):
        with pytest.raises(ValueError, match="LrWarmup"):
            LrWarmup(**bad)


@pytest.mark.parametrize("compression,options,message", [
    ("topk", {"exchange_momentum_after": "auto", "total_steps": 2.5}, "total_steps must be an int"),
    ("randk", {"exchange_momentum_after": "auto", "total_steps": 100}, "has recipes for"),
    ("topk", {"exchange_momentum_after": 5, "total_steps": 100}, "total_steps is only used with"),
    ("topk", {"lr_warmup_steps": 100}, "lr_warmup_steps is only used with"),
])
def test_what_auto_cannot_do_raises_naming_it(compression, options, message):
    with pytest.raises(ValueError, match=message):
        choose(compression, options, "test")


def test_every_recipe_builds_its_compressor():
    for name, recipe in RECIPES.items():
        compression, options, _ = choose(name, {"exchange_momentum_after": "auto", "total_steps": 10000}, "test")
        assert getattr(compression, "name", compression) == name
        assert options["exchange_momentum_after"] == max(150, round(recipe.warmup * 500))


def _auto_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    out = []
    for options in ({"exchange_momentum_after": "auto", "lr_warmup_steps": 4, "total_steps": 24},
                    {"exchange_momentum_after": 6, "variance_refresh_every": 32, "compression_warmup_codec": "qsgd4",
                     "compression": mergecomp.get_compressor("topk", ratio=0.025, value_dtype="fp16")}):
        model = make_model()
        options = {"compression": "topk", **options}
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), groups=2, **options)
        run(model, opt, shard(x, rank), shard(y, rank), AFTER + 6, make_schedule(opt))
        out.append(flat_params(model))
    return out


def test_distributed_optimizer_with_auto_trains_as_the_recipe_spelled_out():
    """``DistributedOptimizer(adamw, compression="topk", exchange_momentum_after="auto",
    lr_warmup_steps=4, total_steps=24)`` gives the same parameters, bit for bit, as top-k's recipe written out
    (2.5 % in fp16, K = 1.5 x 4, R = 32, the 4-bit QSGD warm-up codec of a short run), on every rank."""
    for auto, spelled in run_workers(_auto_worker, 2):
        assert torch.equal(auto, spelled)


WARMUP = 160  # LinearLR's warm-up: the lr rises through update 161 and is held at 162


def _follow_worker(rank, world):
    """1-bit SGD's recipe without the run's length, the LR warmed up over 160 updates: K follows
    it (162, past the floor of 150), compared with K = 162 given; a run saved at update 161 (the
    LR still rising) and resumed; the LR held from the start (K = 150); one rank's LR held while
    the others' rises."""
    import mergecomp.torch as mc

    x, y = make_data()
    out = {}

    def train(label, steps, after="auto", warm=True, state=None, **given):
        model = make_model()
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), compression="onebit", groups=2,
                                      exchange_momentum_after=after, **given)
        schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.05, total_iters=WARMUP) if warm else None
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            schedule.load_state_dict(state["schedule"])
            torch.set_rng_state(state["rng"])  # the 8-bit QSGD warm-up codec rounds stochastically
        run(model, opt, shard(x, rank), shard(y, rank), steps, schedule)
        out[label] = (flat_params(model), opt.momentum_exchange.after, opt.momentum_exchange.active)
        return {"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                "schedule": schedule.state_dict() if schedule else None}

    steps = WARMUP + 8
    train("followed", steps)
    train("given", steps, after=WARMUP + 2, variance_refresh_every=32, compression_warmup_codec="qsgd")
    train("resumed", steps - WARMUP - 1, state=train("saved", WARMUP + 1))  # before the hold
    train("held", 151, warm=False)
    train("one rank held", steps, warm=rank != 1)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_auto_without_the_runs_length_freezes_where_the_lr_warm_up_ends(world):
    """The warm-up ends once the learning rate stops rising, at least 150 updates: the run equals
    the recipe with that K given, bit for bit, and a resume from a checkpoint taken before the
    decision continues it exactly; ranks whose learning rates disagree still freeze together."""
    for out in run_workers(_follow_worker, world, world):
        followed, after, active = out["followed"]
        assert (after, active) == (WARMUP + 2, True)
        assert torch.equal(followed, out["given"][0]) and out["given"][1:] == (WARMUP + 2, True)
        assert torch.equal(followed, out["resumed"][0]) and out["resumed"][1:] == (WARMUP + 2, True)
        assert out["saved"][1:] == (None, False)
        assert out["held"][1:] == (150, True)
        assert out["one rank held"][1:] == (WARMUP + 2, True)


def test_auto_refreshes_within_the_variances_time_constant_unless_told_otherwise():
    """beta2 = 0.95: Adam's variance follows about 20 gradients, so the recipe's R = 32 becomes 8
    (0.4 of that), and "auto" warns that its warm-up may be short there; with beta2 = 0.999 (400)
    the recipe's stands, and so does an R the user gives."""
    model = make_model()

    def refresh(beta2, **given):
        adamw = torch.optim.AdamW(model.parameters(), betas=(0.9, beta2))
        _, options, chosen = choose("onebit", {"exchange_momentum_after": "auto", "total_steps": 2000, **given}, "test")
        settings = MomentumSettings.create(options["exchange_momentum_after"], options["variance_refresh_every"],
                                           chosen=chosen)
        return adapt(settings, adamw, "test").refresh_every

    with pytest.warns(UserWarning, match="measured with beta2=0.999 .*; with beta2=0.95 its warm-up can be too short"):
        assert (refresh(0.95), refresh(0.95, variance_refresh_every=32)) == (8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the recipes' measurements: no warning
        assert (refresh(0.99), refresh(0.999)) == (32, 32)


def _refresh_warning_worker(rank):
    import logging

    import mergecomp.torch as mc

    x, y = make_data()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mergecomp").addHandler(handler)
    for options in ({"exchange_momentum_after": 2, "variance_refresh_every": 32},
                    {"exchange_momentum_after": "auto", "lr_warmup_steps": 2}):
        model = make_model()
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
        opt = mc.DistributedOptimizer(adamw, model.named_parameters(), compression="onebit", **options)
        run(model, opt, shard(x, rank), shard(y, rank), 4)
        lines.append(f"refresh {opt.momentum_exchange.refresh_every}")
    logging.getLogger("mergecomp").removeHandler(handler)
    return [line for line in lines if "follows about" in line or line.startswith("refresh ")]


def test_a_refresh_slower_than_adams_variance_is_logged_at_the_freeze():
    for lines in run_workers(_refresh_warning_worker, 2):
        warned, first, auto = lines
        assert warned.startswith("exchange_momentum_after: Adam's variance with beta2=0.95 follows about the last 20 "
                                 "gradients; refreshed every 32 updates") and "variance_refresh_every=8 or less" in warned
        assert (first, auto) == ("refresh 32", "refresh 8")
