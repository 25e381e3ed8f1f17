"""GroupPlan as a value: equality, codecs, JSON round trip, validation."""
import pytest

from mergecomp.exchange.plan import Exemptions, GroupPlan, build_plan


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


def test_exempt_tensors_leave_their_groups_for_trailing_exempt_groups():
    names, nbytes = ["w1", "b1", "w2", "b2", "h"], [40, 4, 40, 4, 40]
    kinds = ["f32", "f32", "f32", "f32", "f16"]
    exempt = Exemptions.create("b*", min_compress_numel=0).flags(names, [n // 4 for n in nbytes])
    assert exempt == [False, True, False, True, False]
    order = [4, 3, 2, 1, 0]
    # an int spec cuts the others only; exempt tensors keep their order, one group per kind
    assert build_plan(2, order, names, nbytes, kinds, exempt) == GroupPlan(
        ((4,), (2, 0), (3, 1)), ("compressed", "compressed", "exempt"))
    assert build_plan("layerwise", order, names, nbytes, (), exempt).groups == ((4,), (2,), (0,), (3, 1))
    # a plan that holds exempt tensors elsewhere is rebuilt, keeping the others' codecs; a group
    # marked exempt that holds none of them is compressed again
    given = GroupPlan(((4, 3), (2, 1, 0)), ("none", "exempt"))
    assert build_plan(given, order, names, nbytes, (), exempt) == GroupPlan(
        ((4,), (2, 0), (3, 1)), ("none", "compressed", "exempt"))
    assert build_plan(given, order, names, nbytes) == GroupPlan(((4, 3), (2, 1, 0)), ("none", "compressed"))
    small = Exemptions.create(min_compress_numel=10).flags(names, [n // 4 for n in nbytes])
    assert build_plan(1, order, names, nbytes, (), small) == GroupPlan(((4, 2, 0), (3, 1)), ("compressed", "exempt"))


def test_exemption_options_are_checked():
    with pytest.raises(ValueError, match="min_compress_numel must be an int >= 0, got -1"):
        Exemptions.create((), -1)
    with pytest.raises(ValueError, match="uncompressed must be name patterns"):
        Exemptions.create([None])
    with pytest.warns(UserWarning, match=r"pattern\(s\) \['\*norm\*'\] match none of the 2 names"):
        assert Exemptions.create(["*.bias", "*norm*"]).flags(["fc.weight", "fc.bias"], [6, 2]) == [False, True]
