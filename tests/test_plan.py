"""GroupPlan as a value: equality, codecs, JSON round trip, validation."""
import pytest

from mergecomp.plan import GroupPlan, build_plan


def test_all_compressed_codecs_equal_the_default():
    groups = ((0, 1), (2,))
    explicit = GroupPlan(groups, ("compressed", "compressed"))
    assert explicit == GroupPlan(groups) and hash(explicit) == hash(GroupPlan(groups))
    assert explicit.codec_names() == ("compressed", "compressed")
    mixed = GroupPlan(groups, ("none", "compressed"))
    assert mixed != GroupPlan(groups) and mixed.codec_names() == ("none", "compressed")


def test_json_round_trip_and_rebuild_keep_the_codecs():
    plan = GroupPlan(((2,), (1, 0)), ("fp16", "none"))
    assert GroupPlan.from_json(plan.to_json()) == plan
    assert build_plan(plan, [2, 1, 0], ["a", "b", "c"], [4, 4, 4]) == plan


def test_from_cuts_and_cuts_are_inverse():
    order = [5, 3, 4, 0, 2, 1]
    plan = GroupPlan.from_cuts(order, [1, 4], ["none", "compressed", "fp16"])
    assert plan == GroupPlan(((5,), (3, 4, 0), (2, 1)), ("none", "compressed", "fp16"))
    assert plan.cuts() == (1, 4) and plan.order == tuple(order)
    assert GroupPlan.from_cuts(order, plan.cuts(), plan.codec_names()) == plan
    assert GroupPlan.from_cuts(order, []).cuts() == ()


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="empty group"):
        GroupPlan(((0,), ()))
    with pytest.raises(ValueError, match="needs as many codecs"):
        GroupPlan(((0,), (1,)), ("none",))
