"""exchange_momentum_after="auto": each compressor's recipe, scaled to the run, chosen in one
place for every front end; an option the user gives stands; what it cannot do raises."""
import pytest
import torch
from distributed import run_workers
from test_momentum_exchange import AFTER, flat_params, make_adam, make_data, make_model, make_schedule, run, shard

import mergecomp
from mergecomp.torch.momentum_recipes import RECIPES, choose


def test_each_recipe_scales_its_warm_up_to_the_runs_lr_warm_up():
    """K in LR warm-ups (5 % of total_steps where the warm-up is not given), the recipe's
    refresh interval, warm-up codec, wire form and compressor settings."""
    compression, options = choose("topk", {"exchange_momentum_after": "auto", "total_steps": 2000}, "test")
    assert (compression.ratio, compression.value_dtype) == (0.025, "fp16")
    assert options == {"exchange_momentum_after": 150, "variance_refresh_every": 32,
                       "exchange_momentum_as": "momentum", "compression_warmup_codec": "qsgd"}
    compression, options = choose("powersgd", {"exchange_momentum_after": "auto", "lr_warmup_steps": 100,
                                               "total_steps": 5000}, "test")
    assert (compression.rank, options["exchange_momentum_after"], options["exchange_momentum_as"]) == (16, 120, "increment")
    assert choose("onebit", {"exchange_momentum_after": "auto", "total_steps": 600}, "test")[1][
        "exchange_momentum_after"] == 18
    assert choose("none", {"exchange_momentum_after": "auto", "total_steps": 10}, "test")[1] == {
        "exchange_momentum_after": 1, "exchange_momentum_as": "momentum", "compression_warmup_codec": "none"}


def test_what_the_user_gives_stands():
    mine = mergecomp.get_compressor("topk", ratio=0.1)
    compression, options = choose(mine, {"exchange_momentum_after": "auto", "total_steps": 2000,
                                         "variance_refresh_every": 8, "exchange_momentum_as": "increment",
                                         "compression_warmup_codec": "fp16", "nonfinite": "skip"}, "test")
    assert compression is mine
    assert options == {"exchange_momentum_after": 150, "variance_refresh_every": 8, "exchange_momentum_as": "increment",
                       "compression_warmup_codec": "fp16", "nonfinite": "skip"}
    given = {"exchange_momentum_after": 7, "variance_refresh_every": None}  # no "auto": untouched
    assert choose("topk", given, "test") == ("topk", given)


@pytest.mark.parametrize("compression,options,message", [
    ("topk", {"exchange_momentum_after": "auto"}, "give total_steps=N"),
    ("topk", {"exchange_momentum_after": "auto", "total_steps": 0}, "give total_steps=N"),
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
        compression, options = choose(name, {"exchange_momentum_after": "auto", "total_steps": 2000}, "test")
        assert getattr(compression, "name", compression) == name
        assert options["exchange_momentum_after"] == round(recipe.warmup * 100)


def _auto_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    out = []
    for options in ({"exchange_momentum_after": "auto", "lr_warmup_steps": 4},
                    {"exchange_momentum_after": 6, "variance_refresh_every": 32, "compression_warmup_codec": "qsgd",
                     "compression": mergecomp.get_compressor("topk", ratio=0.025, value_dtype="fp16")}):
        model = make_model()
        options = {"compression": "topk", **options}
        opt = mc.DistributedOptimizer(make_adam(model), model.named_parameters(), groups=2, **options)
        run(model, opt, shard(x, rank), shard(y, rank), AFTER + 6, make_schedule(opt))
        out.append(flat_params(model))
    return out


def test_distributed_optimizer_with_auto_trains_as_the_recipe_spelled_out():
    """``DistributedOptimizer(adamw, compression="topk", exchange_momentum_after="auto",
    lr_warmup_steps=4)`` gives the same parameters, bit for bit, as top-k's recipe written out
    (2.5 % in fp16, K = 1.5 x 4, R = 32, the 8-bit QSGD warm-up codec), on every rank."""
    for auto, spelled in run_workers(_auto_worker, 2):
        assert torch.equal(auto, spelled)
