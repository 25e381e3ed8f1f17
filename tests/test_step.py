"""MergedStep, the core every front end adapts: one process (local engine) for the lifecycle,
two gloo ranks for averaging, non-finite agreement and caller-given groups."""
import contextlib

import pytest
import torch

from mergecomp.comm import LocalCommunicator
from mergecomp.plan import GroupPlan
from mergecomp.step import MergedStep

from distributed import run_workers

NAMES = ["a", "b", "c", "d"]
SHAPES = [(3, 2), (5,), (0,), (4, 1)]


def local_step(compression="none", **kwargs) -> MergedStep:
    settings = dict(groups=GroupPlan(((3, 2), (1, 0))), nonfinite="raise")
    settings.update(kwargs)
    return MergedStep(compression, None, LocalCommunicator(), NAMES, SHAPES, [torch.float32] * 4,
                      torch.device("cpu"), **settings)


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
    from mergecomp import native

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


@pytest.mark.parametrize("compression", ["topk", "powersgd", "dgc", "onebit", "efsignsgd"])
def test_propagate_makes_the_step_nan_and_puts_error_feedback_back(compression):
    def run(step, seed):
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
        return step.finish()

    def state(step):
        return [{n: {k: v.clone() for k, v in f.items()} for n, f in holder.state.items()}
                for holder in (step.exchange.memory, step.exchange.compressor)]

    poisoned, clean = (local_step(compression=compression, nonfinite="propagate", groups=2) for _ in range(2))
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
    other = MergedStep("none", None, LocalCommunicator(), ["x"], [(7,)], [torch.float32], torch.device("cpu"))
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


def _two_rank_worker(rank):
    import mergecomp.torch as mc

    comm = mc.communicator()
    out = {}
    # averaging over ranks, with the first step's arrival order adopted (rank 0's)
    step = MergedStep("none", None, comm, NAMES, SHAPES, [torch.float32] * 4, torch.device("cpu"), groups=2)
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
    caller = MergedStep("topk", "residual", comm, NAMES, SHAPES, [torch.float32] * 4, torch.device("cpu"),
                        caller_groups=True)
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
