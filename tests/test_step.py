"""MergedStep, the core every front end adapts: one process (local engine) for the lifecycle,
two gloo ranks for averaging, non-finite agreement and caller-given groups."""
import contextlib

import pytest
import torch
from distributed import run_workers
from steps import buckets, planned

from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.plan import GroupPlan
from mergecomp.pipeline.planned import PlannedStep

NAMES = ["a", "b", "c", "d"]
SHAPES = [(3, 2), (5,), (0,), (4, 1)]


def local_step(compression="none", memory=None, **kwargs) -> PlannedStep:
    settings = dict(groups=GroupPlan(((3, 2), (1, 0))), nonfinite="raise")
    settings.update(kwargs)
    return planned(compression, memory, LocalCommunicator(), NAMES, SHAPES, [torch.float32] * 4, **settings)


def grads(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def test_groups_start_in_plan_order_when_their_last_tensor_arrives():
    step = local_step()
    g = grads(0)
    step.add(1, g[1])  # second group's tensor: nothing can start before the first group
    assert not step._started
    step.add(3, g[3])
    assert not step._started and step.in_flight
    step.add(2, g[2])  # the first group (3, 2) is complete
    assert [job.group.indices for job in step._started] == [(3, 2)]
    step.add(0, g[0])
    assert [job.group.indices for job in step._started] == [(3, 2), (1, 0)]
    reduced = step.finish()
    assert not step.in_flight and step.step == 1
    for got, want in zip(reduced.tensors(4), g):
        assert got.shape == want.shape and torch.equal(got, want)


def test_missing_tensors_count_as_zeros_and_a_tensor_cannot_arrive_twice():
    step = local_step()
    g = grads(1)
    step.add(0, g[0])
    with pytest.raises(RuntimeError, match="'a' arrived twice"):
        step.add(0, g[0])
    out = step.finish().tensors(4)
    assert torch.equal(out[0], g[0]) and not out[1].any() and not out[3].any()


def test_a_gradient_already_in_its_slot_is_not_copied():
    step = local_step()
    step.finish()
    slot = step.slot(1)
    slot.fill_(2.0)
    step.add(1, slot)
    assert torch.equal(step.finish().tensors(4)[1], torch.full((5,), 2.0))


def test_nonfinite_policies():
    bad = grads(2)
    bad[3][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"rank 0.*'d'"):
        step = local_step()
        for i, t in enumerate(bad):
            step.add(i, t)
        step.finish()
    assert not step.in_flight and step.step == 1  # the next step can run
    skipping = local_step(nonfinite="skip")
    for i, t in enumerate(bad):
        skipping.add(i, t)
    assert skipping.finish() is None and skipping.skipped_steps == 1
    ignoring = local_step(nonfinite="ignore")
    for i, t in enumerate(bad):
        ignoring.add(i, t)
    assert ignoring.finish().tensors(4)[3].isnan().any()


@pytest.mark.parametrize("kernels", [True, False])
def test_prescale_scales_each_gradient_once_and_flags_what_overflows(kernels):
    from mergecomp.kernels import native

    with contextlib.nullcontext() if kernels else native.disabled():
        step = local_step(prescale=0.5, postscale=4.0)
        g = grads(3)
        for i, t in enumerate(g):
            step.add(i, t)
        assert all(torch.equal(got, want * 0.5 * 4.0) for got, want in zip(step.finish().tensors(4), g))
        big = local_step(prescale=4.0)
        g[1][2] = 3e38  # finite; not once scaled
        for i, t in enumerate(g):
            big.add(i, t)
        with pytest.raises(FloatingPointError, match="'b'"):
            big.finish()


@pytest.mark.parametrize("compression, memory", [("topk", None), ("powersgd", None), ("dgc", None), ("onebit", None),
                                                 ("efsignsgd", None), ("topk", "averaged"), ("onebit", "averaged"),
                                                 ("powersgd", "averaged")])
def test_propagate_makes_the_step_nan_and_puts_error_feedback_back(compression, memory):
    def run(step, seed):
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
        return step.finish()

    def state(step):
        return [{n: {k: v.clone() for k, v in f.items()} for n, f in holder.state.items()}
                for holder in (step.exchange.memory, step.exchange.compressor)]

    poisoned, clean = (local_step(compression, memory, nonfinite="propagate", groups=2) for _ in range(2))
    for seed in range(2):
        run(poisoned, seed)
        run(clean, seed)
    before = state(poisoned)
    bad = grads(5)
    bad[3][0, 0] = float("inf")
    for i, t in enumerate(bad):
        poisoned.add(i, t)
    out = poisoned.finish().tensors(4)
    assert all(t.isnan().all() for t in out if t.numel())
    after = state(poisoned)
    for a, b in zip(before, after):
        assert a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])
    for seed in (6, 7):  # afterwards, as if the poisoned step had never happened
        got = [t.clone() for t in run(poisoned, seed).tensors(4)]
        want = run(clean, seed).tensors(4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


FP16_SECOND = GroupPlan(((3, 2), (1, 0)), ("compressed", "fp16"))


def _residual_beyond_fp16(step, rank=0, big=1e5):
    """Two 1-bit SGD steps sent compressed, in the second a gradient of ``big`` at one element
    of group (1, 0) on ``rank``: its residual there ends near ``big``, beyond fp16's 65504.  Then
    the plan sends that group as fp16, so the next step's compensated gradient overflows the
    cast on that rank."""
    for seed, spike in ((10, False), (11, True)):
        g = grads(seed)
        if spike and step.comm.rank == rank:
            g[1][0] = big
        for i, t in enumerate(g):
            step.add(i, t)
        step.finish()
    step.set_plan(FP16_SECOND)


def _finite_steps(step, seeds=(13, 14)):
    out = []
    for seed in seeds:
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
        out.append(all(bool(torch.isfinite(t).all()) for t in step.finish().tensors(4)))
    return out


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("nonfinite", ["propagate", "raise", "skip"])
def test_a_compensated_gradient_overflowing_fp16_is_a_nonfinite_group_and_its_memory_starts_afresh(nonfinite,
                                                                                                  kernels):
    """The scheduler may send an error-feedback group as fp16. Where gradient + residual goes
    beyond fp16's range, the cast gives Inf and the residual update v - fp16(v) would keep -Inf
    (every later step NaN). The group counts as non-finite (the policy applies, naming the
    overflow) and its memory starts afresh; the steps after it are finite.  The native cast
    tells from its own pass; the torch cast is checked after it."""
    from mergecomp.kernels import native

    with contextlib.nullcontext() if kernels else native.disabled():
        _overflow_fp16_and_go_on(nonfinite)


def _overflow_fp16_and_go_on(nonfinite):
    step = local_step(compression="onebit", nonfinite=nonfinite, groups=GroupPlan(((3, 2), (1, 0))))
    _residual_beyond_fp16(step)
    name = step.groups[1].name
    assert float(step.exchange.memory.state[name]["residual"].abs().max()) > 65504
    for i, t in enumerate(grads(12)):
        step.add(i, t)
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError, match=r"rank 0, group '.*': its values, finite, overflowed the 16-bit "
                                                     r"cast"):
            step.finish()
    elif nonfinite == "skip":
        assert step.finish() is None and step.skipped_steps == 1
    else:
        assert all(t.isnan().all() for t in step.finish().tensors(4) if t.numel())
    assert name not in step.exchange.memory.state
    assert step.groups[0].name in step.exchange.memory.state  # the other group's residual stays
    assert _finite_steps(step) == [True, True]


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("nonfinite", ["propagate", "raise"])
def test_topk_values_overflowing_fp16_are_a_nonfinite_group_and_its_memory_starts_afresh(nonfinite, kernels):
    """Top-k's values cast to fp16 (``value_dtype="fp16"``): a finite value beyond 65504 is an
    overflow whether the fused encode (the threshold scan with the residual memory, native)
    or the plain compress made the payload, where the fused one sent Inf unflagged and kept
    -Inf in the residual: the policy applies, naming it, the group's memory starts afresh, and
    the steps after it are finite."""
    from mergecomp.kernels import native
    from mergecomp.registry import get_compressor

    with contextlib.nullcontext() if kernels else native.disabled():
        step = local_step(compression=get_compressor("topk", ratio=0.25, value_dtype="fp16"), nonfinite=nonfinite)
        g = grads(30)
        g[1][0] = 1e5
        for i, t in enumerate(g):
            step.add(i, t)
        if nonfinite == "raise":
            with pytest.raises(FloatingPointError, match="overflowed the 16-bit cast"):
                step.finish()
        else:
            assert all(t.isnan().all() for t in step.finish().tensors(4) if t.numel())
        assert step.groups[1].name not in step.exchange.memory.state
        assert _finite_steps(step) == [True, True]


@pytest.mark.parametrize("kernels", [True, False])
def test_an_fp16_bucket_is_checked_by_its_cast_and_tells_nan_from_overflow(kernels):
    """A caller's bucket sent as fp16 with no error feedback is checked for NaN/Inf by the cast's
    own pass (native) or on the fp16 payload (torch), not by a pass of its own over the fp32
    gradient; the policy still tells a NaN gradient from finite values beyond fp16's range."""
    from mergecomp.kernels import native

    def run(values, nonfinite="raise"):
        step = buckets("fp16", None, LocalCommunicator(), NAMES, SHAPES, [torch.float32] * 4, nonfinite=nonfinite)
        step.start_group((3, 2, 1, 0), torch.cat([v.reshape(-1) for v in reversed(values)]))
        return step, step._started[0]

    with contextlib.nullcontext() if kernels else native.disabled():
        g = grads(20)
        step, job = run(g, "propagate")
        out = step.finish().tensors(4)
        assert job.passes.get("check", 0) == (0 if kernels else 1)  # no fp32 pass: the cast's, or its payload's
        assert all(torch.equal(o, t.half().float()) for o, t in zip(out, g))
        for value, expected in ((float("nan"), r"rank 0, group '[^']*'\)"), (1e5, "overflowed the 16-bit cast")):
            g = grads(21)
            g[1][2] = value
            step, _ = run(g)
            with pytest.raises(FloatingPointError, match=expected):
                step.finish()
        step, _ = run(g, "propagate")
        assert all(t.isnan().all() for t in step.finish().tensors(4) if t.numel())


def _one_rank_overflows_worker(rank):
    import mergecomp.torch as mc

    step = planned("onebit", None, mc.communicator(), NAMES, SHAPES, [torch.float32] * 4,
                   groups=GroupPlan(((3, 2), (1, 0))), nonfinite="propagate")
    _residual_beyond_fp16(step, rank=1)
    before = memory_state(step)
    for i, t in enumerate(grads(12)):
        step.add(i, t)
    nan = all(bool(t.isnan().all()) for t in step.finish().tensors(4) if t.numel())
    after = memory_state(step)
    kept = {n: all(torch.equal(before[n][k], after[n][k]) for k in before[n]) for n in after}
    return {"nan": nan, "groups": sorted(after), "kept": kept, "finite": _finite_steps(step),
            "names": [group.name for group in step.groups]}


def test_one_rank_overflowing_fp16_makes_every_rank_skip_and_only_its_memory_starts_afresh():
    """Two gloo ranks; only rank 1's compensated gradient overflows fp16: both ranks' results
    are NaN (so GradScaler skips the step everywhere), rank 0's memory is put back as it was,
    rank 1's overflowed group starts afresh, and both go on with finite steps."""
    outs = run_workers(_one_rank_overflows_worker, 2)
    first, second = outs[0]["names"]
    for out in outs:
        assert out["nan"] and out["finite"] == [True, True]
        assert all(out["kept"].values())
    assert outs[0]["groups"] == sorted([first, second]) and outs[1]["groups"] == [first]


def test_plan_switch_only_between_steps_and_checkpoint_round_trip():
    step = local_step(compression="topk", groups=2)
    for seed in range(3):
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
        step.finish()
    step.add(0, grads(9)[0])
    with pytest.raises(RuntimeError, match="between steps"):
        step.set_plan("layerwise")
    step.finish()
    saved = step.state_dict()
    residual = sum(float(f.abs().sum()) for fields in step.exchange.memory.state.values() for f in fields.values())
    step.set_plan("layerwise")  # residuals follow their tensors into the new groups
    moved = sum(float(f.abs().sum()) for fields in step.exchange.memory.state.values() for f in fields.values())
    assert residual > 0 and moved == pytest.approx(residual)
    restored = local_step(compression="topk", groups=2)
    restored.load_state_dict(saved)
    assert restored.step == step.step and restored.plan == GroupPlan.from_json(saved["plan"])
    other = planned("none", None, LocalCommunicator(), ["x"], [(7,)], [torch.float32])
    with pytest.raises(ValueError, match="saved for another model"):
        other.load_state_dict(saved)


def test_handed_out_results_are_never_written_again():
    step = local_step(hand_out=True)
    for i, t in enumerate(grads(3)):
        step.add(i, t)
    first = step.finish().tensors(4)
    kept = [t.clone() for t in first]
    for i, t in enumerate(grads(4)):
        step.add(i, t)
    step.finish()
    assert all(torch.equal(a, b) for a, b in zip(first, kept))


def test_each_step_returns_its_values_through_the_same_views_until_the_groups_change():
    step = local_step()
    seen = []
    for seed in (11, 12):
        g = grads(seed)
        for i, t in enumerate(g):
            step.add(i, t)
        out = step.finish().tensors(4)
        assert all(torch.equal(got, want) for got, want in zip(out, g))
        seen.append(out)
    assert all(a is b for a, b in zip(*seen))  # the buffers did not move: no new views
    step.set_plan(GroupPlan(((0, 1, 2, 3),)))
    g = grads(13)
    for i, t in enumerate(g):
        step.add(i, t)
    out = step.finish().tensors(4)
    assert all(torch.equal(got, want) for got, want in zip(out, g))
    assert not any(a is b for a, b in zip(out, seen[-1]))
    handing = local_step(hand_out=True)
    firsts = []
    for seed in (14, 15):
        for i, t in enumerate(grads(seed)):
            handing.add(i, t)
        firsts.append(handing.finish().tensors(4)[0])
    assert firsts[0] is not firsts[1] and firsts[0].data_ptr() != firsts[1].data_ptr()


def _two_rank_worker(rank):
    import mergecomp.torch as mc

    comm = mc.communicator()
    out = {}
    # averaging over ranks, with the first step's arrival order adopted (rank 0's)
    step = planned("none", None, comm, NAMES, SHAPES, [torch.float32] * 4, groups=2, nonfinite="raise")
    g = [t * (rank + 1) for t in grads(5)]
    for i in (0, 1, 2, 3):
        step.add(i, g[i])
    reduced = step.finish().tensors(4)
    out["average"] = max(float((r - t * 1.5).abs().max()) if t.numel() else 0.0 for r, t in zip(reduced, grads(5)))
    out["order"] = step.plan.order
    # one rank's NaN raises on both, naming the rank
    bad = grads(6)
    if rank == 1:
        bad[1][0] = float("inf")
    for i, t in enumerate(bad):
        step.add(i, t)
    try:
        step.finish()
        out["raised"] = None
    except FloatingPointError as err:
        out["raised"] = str(err)
    # caller-given groups (DDP's buckets) that change between steps keep their residuals: the
    # second step sends zeros, so all its merged group holds is what the first step left
    caller = buckets("topk", "residual", comm, NAMES, SHAPES, [torch.float32] * 4)
    for layout, values in (([(3, 2), (1, 0)], grads(7)), ([(3, 2, 1, 0)], [torch.zeros(s) for s in SHAPES])):
        for members in layout:
            caller.start_group(members, torch.cat([values[i].reshape(-1) for i in members]))
        caller.finish()
        residuals = {name: float(fields["residual"].abs().sum())
                     for name, fields in caller.exchange.memory.state.items()}
        out.setdefault("caller_residuals", []).append(residuals)
    out["caller_groups"] = [g.indices for g in caller.groups]
    return out


def test_two_ranks_average_agree_on_nonfinite_and_take_caller_groups():
    for rank, out in enumerate(run_workers(_two_rank_worker, 2)):
        assert out["average"] < 1e-6
        assert out["order"] == (0, 1, 2, 3)  # the order the tensors arrived on rank 0
        assert out["raised"] is not None and "rank 1" in out["raised"] and "'b'" in out["raised"]
        assert out["caller_groups"] == [(3, 2, 1, 0)]
        first, second = out["caller_residuals"]
        assert len(first) == 2 and len(second) == 1  # the old groups' state is gone
        assert 0 < sum(second.values()) <= sum(first.values()) + 1e-6


SIGN_SHAPES = [(33, 7), (5,), (0,), (1000, 3), (17,), (1,)]  # part starts of every alignment


def sign_step(compression, parts=True, **kwargs) -> PlannedStep:
    """A one-rank PlannedStep of SIGN_SHAPES in 2 groups; ``parts`` False: the gradients are
    copied into the group buffers and the whole group is encoded at once."""
    names = [f"t{i}" for i in range(len(SIGN_SHAPES))]
    step = planned(compression, None, LocalCommunicator(), names, SIGN_SHAPES, [torch.float32] * len(names),
                   groups=GroupPlan(((5, 4, 3), (2, 1, 0))), **kwargs)
    if not parts:
        step.exchange.begin = lambda *args: None
    return step


def sign_grads(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SIGN_SHAPES]


def run_sign_step(step, seed, bad=None):
    """One step of ``sign_grads(seed)``, in backward order, ``bad`` (index, value) written into
    one gradient; the results (cloned), or None."""
    g = sign_grads(seed)
    if bad is not None:
        g[bad[0]].view(-1)[3] = bad[1]
    for i in reversed(range(len(g))):
        step.add(i, g[i])
    reduced = step.finish()
    return None if reduced is None else [t.clone() for t in reduced.tensors(len(g))]


def memory_state(step):
    return {n: {k: v.clone() for k, v in f.items()} for n, f in step.exchange.memory.state.items()}


def compressor_state(step):
    return {n: {k: v.clone() for k, v in f.items()} for n, f in step.exchange.compressor.state.items()}


@pytest.mark.parametrize("nonfinite", ["propagate", "raise", "skip", "ignore"])
@pytest.mark.parametrize("compression", ["onebit", "efsignsgd", "signsgd", "signum"])
def test_sign_codes_encoded_as_gradients_arrive_give_what_the_whole_group_gives(compression, nonfinite):
    """Each gradient encoded as it arrives (no copy into the group buffer) gives the results and
    the memory the whole group's encode gives: the same sign bits, the scales (sums added part
    by part) to fp32 rounding; signSGD's votes bit for bit."""
    from mergecomp.kernels import native

    if not native.usable(torch.zeros(1)):
        pytest.skip("the parts are encoded by the native kernels")
    by_parts, whole = sign_step(compression, nonfinite=nonfinite), sign_step(compression, False, nonfinite=nonfinite)
    for seed in range(4):
        got, want = run_sign_step(by_parts, seed), run_sign_step(whole, seed)
        assert all(g.sign().eq(w.sign()).all() for g, w in zip(got, want))
        torch.testing.assert_close(got, want, rtol=0 if compression.startswith("sign") else 1e-6, atol=0)
    breakdown = by_parts.step_breakdown()
    assert all("copy-in" not in group["passes_by_stage"] for group in breakdown["groups"])
    a, b = memory_state(by_parts), memory_state(whole)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    a, b = compressor_state(by_parts), compressor_state(whole)  # Signum's momentum, bit for bit
    assert a.keys() == b.keys() and bool(a) == (compression == "signum")
    assert all(torch.equal(a[name][k], b[name][k]) for name in a for k in a[name])


@pytest.mark.parametrize("nonfinite", ["propagate", "raise", "skip"])
@pytest.mark.parametrize("bad", [(0, float("nan")), (4, float("-inf")), (3, float("inf"))])
@pytest.mark.parametrize("compression", ["efsignsgd", "signsgd", "signum"])
def test_a_nonfinite_gradient_met_part_by_part_leaves_the_memory_as_the_whole_group_route(compression, nonfinite,
                                                                                          bad):
    """A NaN or Inf found while the parts are encoded puts the memory back and the group goes on
    as a whole: the group's memory after the step (rolled back, or advanced as by zeros) is, bit
    for bit, what the route without parts leaves, and the steps after it agree (signSGD: no
    memory, the same outcome and later steps)."""
    from mergecomp.kernels import native

    if not native.usable(torch.zeros(1)):
        pytest.skip("the parts are encoded by the native kernels")
    by_parts, whole = sign_step(compression, nonfinite=nonfinite), sign_step(compression, False, nonfinite=nonfinite)
    run_sign_step(by_parts, 0)
    saved = by_parts.exchange.memory.state_dict()
    saved_compressor = by_parts.exchange.compressor.state_dict()
    for step in (by_parts, whole):  # the same residuals (Signum: momentum) on both
        step.exchange.memory.load_state_dict(saved)
        step.exchange.compressor.load_state_dict(saved_compressor)
    outcomes = []
    for step in (by_parts, whole):
        with pytest.raises(FloatingPointError) if nonfinite == "raise" else contextlib.nullcontext():
            outcomes.append(run_sign_step(step, 1, bad))
    if nonfinite == "propagate":
        assert all(t.isnan().all() for out in outcomes for t in out if t.numel())
    elif nonfinite == "skip":
        assert outcomes == [None, None]
    a, b = memory_state(by_parts), memory_state(whole)
    assert a.keys() == b.keys() and bool(a) == (compression == "efsignsgd")
    if a:
        held = by_parts.groups[by_parts.group_of(bad[0])].name  # the group that held it
        assert all(torch.equal(a[held][k], b[held][k]) for k in a[held])
    for name in a:  # the other group was encoded part by part
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-6)
    a, b = compressor_state(by_parts), compressor_state(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[name][k], b[name][k]) for name in a for k in a[name])
    for seed in (2, 3):
        got, want = run_sign_step(by_parts, seed), run_sign_step(whole, seed)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("compression,state", [("onebit", memory_state), ("signum", compressor_state)])
def test_an_aborted_step_puts_back_the_memory_its_parts_wrote(compression, state):
    step = sign_step(compression, nonfinite="propagate")
    run_sign_step(step, 0)
    before = state(step)
    g = sign_grads(1)
    step.add(5, g[5])
    step.add(4, g[4])  # the first group is partly encoded
    step.abort()
    after = state(step)
    assert before and before.keys() == after.keys()
    assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
    assert run_sign_step(step, 1) is not None and not step.in_flight


@pytest.mark.parametrize("compression", ["onebit", "efsignsgd", "signsgd"])
def test_gradients_near_the_fp32_limit_are_finite_part_by_part(compression):
    """Finite gradients whose sides sum past fp32's largest value (a huge loss scale) are not
    taken for NaN/Inf, and their scales stay finite (signSGD: the votes are +-1)."""
    step = sign_step(compression, nonfinite="raise")
    for i, n in enumerate(SIGN_SHAPES):
        g = torch.full(n, 3e38)
        g.view(-1)[::2] = -3e38
        step.add(i, g)
    out = step.finish().tensors(len(SIGN_SHAPES))
    size = torch.tensor(1.0 if compression == "signsgd" else 3e38)
    assert all(torch.isfinite(t).all() and torch.allclose(t.abs(), size) for t in out if t.numel())


def test_a_counter_of_a_one_element_group_is_not_taken_for_per_element_state():
    """rand-k keeps a 0-d step counter per group: in a group of one element it has the group's
    numel, and the plan change after the first step (the observed order) must drop it, not cut it."""
    step = planned("randk", None, LocalCommunicator(), ["one", "w"], [(1,), (5,)], [torch.float32] * 2,
                   groups="layerwise", nonfinite="raise")
    for s in range(3):
        g = grads(s)
        step.add(0, g[0].reshape(-1)[:1])  # not the reverse order: the plan changes after step 0
        step.add(1, g[1])
        assert step.finish() is not None
    assert step.step == 3


def _index_formats_worker(rank):
    """Top-k at 10 % with the residual memory (the fused scan) over a group of 4,000 elements,
    its indices as int32 and as a bitmap, five steps on the same gradients."""
    import mergecomp.torch as mc
    from mergecomp.compressors.topk import TopKCompressor

    names, shapes = ["w", "b"], [(40, 90), (400,)]
    results = {}
    for form in ("int32", "bitmap"):
        step = planned(TopKCompressor(0.1, index_format=form), "residual", mc.communicator(), names, shapes,
                       [torch.float32] * 2, groups=1, compression_warmup_steps=0)
        outs = []
        for seed in range(5):
            generator = torch.Generator().manual_seed(100 * seed + rank)
            for i, shape in enumerate(shapes):
                step.add(i, torch.randn(shape, generator=generator))
            outs.append(torch.cat([t.reshape(-1) for t in step.finish().tensors(2)]))
        results[form] = (torch.stack(outs), memory_state(step))
    (int32, int32_memory), (bitmap, bitmap_memory) = results["int32"], results["bitmap"]
    same_memory = all(torch.equal(int32_memory[g][f], bitmap_memory[g][f]) for g in int32_memory for f in int32_memory[g])
    return {"equal": torch.equal(int32, bitmap), "memory": same_memory, "result": bitmap}


def test_top_k_sends_a_bitmap_with_the_same_results_and_memories():
    """Two gloo ranks: the bitmap payload ends every step with the int32 one's results and
    error-feedback memories, bit for bit, and the ranks agree."""
    outs = run_workers(_index_formats_worker, 2)
    for out in outs:
        assert out["equal"] and out["memory"]
    assert torch.equal(outs[0]["result"], outs[1]["result"])
