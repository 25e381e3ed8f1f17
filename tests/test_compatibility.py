"""The one declaration of what combines with what (mergecomp.exchange.compatibility and
mergecomp.pipeline.options.FRONT_ENDS) is what every entry point enforces: the scheme option,
a plan's codecs, the scheduler's offers, the front ends' options.  The FSDP and momentum
exchange refusals are exercised through their front ends in test_fsdp.py and
test_momentum_exchange.py."""
import pytest

from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.compatibility import FSDP, MOMENTUM, ROUTES, check, refusal
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.schemes import SHARDED
from mergecomp.pipeline.options import FRONT_ENDS, StepOptions
from mergecomp.registry import compressor_names, get_compressor
from mergecomp.scheduler.costmodel import Cluster
from mergecomp.scheduler.offline import exchange_codecs
from mergecomp.scheduler.online import SEARCHED, searched_codecs

COMPRESSORS = sorted(compressor_names())


def test_the_table_refuses_what_each_route_cannot_carry():
    refused = {(name, route) for name in COMPRESSORS for route in ROUTES
               if refusal(get_compressor(name), route) is not None}
    for route in SHARDED:
        assert {(name, route) for name in ("powersgd", "acpsgd")} <= refused
        assert (("topk", route) not in refused) and (("signsgd", route) not in refused)
    assert {(name, FSDP) for name in ("powersgd", "acpsgd", "signsgd", "signum")} <= refused
    assert ("qsgd", FSDP) not in refused and ("topk", FSDP) not in refused
    assert {(name, MOMENTUM) for name in ("signsgd", "signum")} <= refused
    assert ("onebit", MOMENTUM) not in refused and ("powersgd", MOMENTUM) not in refused
    assert refusal(get_compressor("topk"), MOMENTUM, memory="dgc") is not None
    assert refusal(get_compressor("topk"), "allgather") is None  # no rules: carries everything


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_check_names_the_asker_the_route_and_the_compressor(route):
    for name in COMPRESSORS:
        compressor = get_compressor(name)
        if refusal(compressor, route) is None:
            check(compressor, route, "someone")
            continue
        with pytest.raises(ValueError) as err:
            check(compressor, route, "someone")
        assert str(err.value).startswith(f"someone: {route} cannot carry compressor {name!r}")


@pytest.mark.parametrize("scheme", SHARDED)
def test_the_scheme_option_and_a_plans_codec_consult_the_table(scheme):
    for name in COMPRESSORS:
        compressor = get_compressor(name)
        exchange = Exchange.create(compressor, None, LocalCommunicator())
        if refusal(compressor, scheme) is None:
            StepOptions(scheme=scheme).check(compressor)
            assert exchange.route(scheme).compressor is compressor
            continue
        with pytest.raises(ValueError, match=f"scheme={scheme!r}: {scheme} cannot carry compressor {name!r}"):
            StepOptions(scheme=scheme).check(compressor)
        with pytest.raises(ValueError, match=f"codec {scheme!r}: {scheme} cannot carry compressor {name!r}"):
            exchange.route(scheme)


def test_the_schedulers_never_offer_a_route_that_refuses_the_compressor():
    for name in COMPRESSORS:
        compressor = get_compressor(name)
        online = searched_codecs(SEARCHED, compressor, world_size=8, per_host=2)
        offline = exchange_codecs(compressor, Cluster(8, 1e-4, 1e8, host_size=2))
        for offered in (online, offline):
            assert all(refusal(compressor, codec) is None for codec in offered), (name, offered)
        allgathered = not compressor.summable and refusal(compressor, SHARDED[0]) is None
        assert (set(SHARDED) <= set(online)) == allgathered, (name, online)


def test_every_front_end_gets_one_default_and_refuses_a_value_by_name():
    fixed = {"groups": "auto", "average": True, "prescale": 1.0, "postscale": 1.0}
    for who, accepts in FRONT_ENDS.items():
        given = {k: v for k, v in fixed.items() if k in accepts.fixed}
        made = StepOptions.create(who, {}, fixed=given)
        assert made.nonfinite == accepts.defaults.get("nonfinite", StepOptions().nonfinite)
        assert all(made.nonfinite in values for values, _ in accepts.values.values())
        for option, (values, why) in accepts.values.items():
            bad = next(v for v in ("skip", "propagate") if v not in values)
            with pytest.raises(ValueError, match=f"{who}: {option} must be one of .*{why}.*{bad!r}"):
                StepOptions.create(who, {option: bad}, fixed=given)
        for option in (*accepts.fixed, *accepts.without):
            with pytest.raises(TypeError, match=f"{who}.*{option}"):
                StepOptions.create(who, {option: None}, fixed=given)
    assert "nonfinite" in FRONT_ENDS["ddp_comm_hook"].values and "nonfinite" in FRONT_ENDS["GradientReducer"].values
    assert StepOptions().nonfinite == "propagate" and FRONT_ENDS["DiLoCo"].defaults == {"nonfinite": "skip"}
    StepOptions.create("DistributedOptimizer", {"nonfinite": "skip"}, fixed=fixed)
