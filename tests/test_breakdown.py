"""Where a step's time goes (mergecomp.exchange.breakdown): the parts of a step add up to it and to the
training loop's own clock, each group's passes over its elements per codec path, and every
front end shows the same dict."""
import time

import pytest
import torch
from distributed import run_workers
from test_step import NAMES, SHAPES, grads, local_step

from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.exchange.breakdown import GROUP_PARTS, PARTS, Breakdown, Stopwatch, combine

#: The parts are exclusive slices of one step and ``compute`` is the rest, so they add up to the
#: step up to float rounding.
ROUNDING = 1e-9


def step_bounds(befores, afters, steps):
    """Bounds on the mean of the last ``steps`` spans of a clock that stamps each step's end
    once between the host readings ``befores[k]`` and ``afters[k]`` (a breakdown's steps run
    from the end of one update to the end of the next): whatever the machine's speed, the mean
    lies between the two."""
    last = range(len(befores) - steps, len(befores))
    return (sum(befores[k] - afters[k - 1] for k in last) / steps,
            sum(afters[k] - befores[k - 1] for k in last) / steps)


def check_parts(breakdown, steps):
    """The parts are all there, non-negative, and add up to the step."""
    assert breakdown["steps"] == steps
    parts = [breakdown[f"{part}_s"] for part in PARTS]
    assert all(p >= 0 for p in parts), breakdown
    assert sum(parts) == pytest.approx(breakdown["step_s"], rel=ROUNDING)
    for group in breakdown["groups"]:
        assert all(group[f"{part}_s"] >= 0 for part in GROUP_PARTS)
        assert group["passes"] == pytest.approx(sum(group["passes_by_stage"].values()))


def test_stopwatch_charges_nested_time_to_the_inner_part_only():
    clock = Stopwatch()
    began = time.perf_counter()
    with clock("decode"):
        time.sleep(0.01)
        with clock("wait", "g"):
            time.sleep(0.02)
    span = time.perf_counter() - began
    seconds = clock.take()
    assert set(seconds) == {("decode", None), ("wait", "g")}
    # the outer part holds its own 0.01 s and not the inner 0.02 s: with it, the parts would add
    # up to more than the span, however slow the machine
    assert seconds[("wait", "g")] >= 0.02 and seconds[("decode", None)] >= 0.01
    assert sum(seconds.values()) <= span and clock.take() == {}


def test_combine_weights_by_steps_and_keeps_the_newest_groups():
    def record(steps, seconds, codec):
        group = {"name": "g", "codec": codec, "bytes": 8, "passes_by_stage": {"encode": seconds}}
        return {"steps": steps, "step_s": seconds, **{f"{p}_s": seconds for p in PARTS},
                "groups": [{**group, "steps": steps, **{f"{p}_s": seconds for p in GROUP_PARTS}}]}

    out = combine([record(1, 1.0, "fp16"), record(3, 2.0, "compressed"), record(1, 4.0, "compressed")])
    assert out["steps"] == 5 and out["step_s"] == pytest.approx(2.2)
    [group] = out["groups"]  # the fp16 record's group is another group
    assert group["steps"] == 4 and group["wait_s"] == pytest.approx(2.5) and group["passes"] == pytest.approx(2.5)
    assert combine([])["steps"] == 0 and combine([])["groups"] == []


def test_the_window_keeps_the_newest_steps():
    timings = Breakdown(window=2)
    for _ in range(4):
        timings.end_step({("encode", None): 0.0}, [])
    assert timings.summary()["steps"] == 2 and timings.summary(1)["steps"] == 1
    timings.window = 1
    assert timings.summary()["steps"] == 1
    with pytest.raises(ValueError, match="window"):
        timings.window = 0


def test_local_steps_add_up_to_the_loop_clock():
    step, g = local_step(), grads(0)
    befores, afters, compute, update = [], [], 0.004, 0.002
    for _ in range(6):
        time.sleep(compute)  # the "forward and backward"
        for i in reversed(range(len(NAMES))):
            step.add(i, g[i])
        step.finish()
        befores.append(time.perf_counter())
        with step.time_update():
            time.sleep(update)
        afters.append(time.perf_counter())
    out = step.step_breakdown(4)
    check_parts(out, 4)
    lower, upper = step_bounds(befores, afters, 4)
    assert lower <= out["step_s"] <= upper
    assert out["compute_s"] >= compute and out["optimizer_s"] >= update
    assert [(grp["name"], grp["codec"], grp["bytes"]) for grp in out["groups"]] == \
        [(grp.name, "compressed", grp.numel * 4) for grp in step.groups]
    assert step.schedule_report()["breakdown"]["steps"] == 6 - 1  # the first step only starts the clock


def test_a_failed_step_is_no_sample():
    step, bad = local_step(), grads(1)
    bad[0][0, 0] = float("nan")
    for _ in range(2):
        step.finish()
    with pytest.raises(FloatingPointError):
        for i, t in enumerate(bad):
            step.add(i, t)
        step.finish()
    step.finish()  # starts the clock again
    step.finish()
    assert step.step_breakdown()["steps"] == 2


def test_an_uncompressed_group_sends_its_residual_once_and_then_skips_the_memory():
    from mergecomp.exchange.plan import GroupPlan

    step = local_step(compression="topk", groups=GroupPlan(((3, 2, 1, 0),), ("compressed",)))
    total = applied = 0
    for seed in range(3):  # top-k leaves a residual
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
            total = total + t.reshape(-1).sum()
        applied = applied + sum(t.sum() for t in step.finish().tensors(4))
    assert step.exchange.memory.state
    step.set_plan(GroupPlan(((3, 2, 1, 0),), ("none",)))
    for seed in range(3, 6):
        for i, t in enumerate(grads(seed)):
            step.add(i, t)
            total = total + t.reshape(-1).sum()
        applied = applied + sum(t.sum() for t in step.finish().tensors(4))
        if seed == 3:  # the first uncompressed step adds the residual and sends it: no residual left
            assert step.step_breakdown(1)["groups"][0]["passes_by_stage"].get("compensate") == 1
            assert not step.exchange.memory.state
    assert float(applied) == pytest.approx(float(total), abs=1e-4)  # nothing lost
    [group] = step.step_breakdown(2)["groups"]
    assert "compensate" not in group["passes_by_stage"] and "memory" not in group["passes_by_stage"]


def test_the_tensorflow_reducer_shows_the_same_breakdown():
    from mergecomp.tensorflow.reducer import GradientReducer

    reducer = GradientReducer("topk", groups=2, comm=LocalCommunicator())
    reducer.bind(NAMES, SHAPES, [torch.float32] * len(NAMES))
    for seed in range(3):
        reducer.reduce(grads(seed))
    out = reducer.step_breakdown()
    check_parts(out, 2)
    assert out["optimizer_s"] == 0 and len(out["groups"]) == 2


# -- passes per codec path, and the front ends on two ranks ------------------------------------
#: passes over a group's elements, by stage, on 2 ranks with each compressor's default memory,
#: where the native kernels serve fp32 gradients that backward accumulated into the group's
#: buffer (from the second step on: nothing copied in)
PASSES = {
    ("none", None): {"decode": 1},  # allreduce in place, then the division; no NaN/Inf check (a plain sum)
    ("fp16", None): {"encode": 1, "decode": 2},  # cast, its pass the check too; cast back, divide
    # residual, fused encode: one scan of gradient + residual writes the new residual, sets the
    # candidates aside and checks the gradient for NaN/Inf; zero the dense sum (k entries scattered)
    ("topk", None): {"encode": 1, "decode": 1},
    # residual, fused encode of each gradient as it arrives (the check in its pass): signs and
    # sums of gradient + carried residual, the compensated gradient kept in the memory's buffer
    # (the residual is worked out in the next step's pass); all ranks' bits in one pass
    ("onebit", None): {"encode": 1, "decode": 1},
    ("efsignsgd", None): {"encode": 1, "decode": 1},
    # no memory, each gradient's bits packed as it arrives; the vote in one pass
    ("signsgd", None): {"encode": 1, "decode": 1},
    # its momentum stepped and its bits packed as each gradient arrives, into a second buffer
    ("signum", None): {"encode": 1, "decode": 1},
    # two-phase: the check, then on this rank's half the second stage too: compensate, encode,
    # memory (decode + subtract), and the sign sum of its shard before every shard is decoded;
    # the first-stage memory decodes the shards side by side (decodes, copies and zeros: 2 passes)
    ("onebit", "two-phase"): {"check": 1, "compensate": 1.5, "encode": 1.5, "memory": 4, "decode": 1.5},
}
#: where no native kernel serves the tensors, there is no fused encode: the residual memory adds,
#: the codec encodes, the memory decodes its own payload and subtracts (top-k: copies); the cast
#: is checked apart, and so is every gradient met part by part
UNFUSED = {**{(codec, None): {"check": 1, "compensate": 1, "encode": 1, "memory": 2, "decode": 1}
              for codec in ("onebit", "efsignsgd")},
           ("fp16", None): {"encode": 1, "check": 1, "decode": 2},
           # residual: add; threshold scan; residual copy (k entries aside); the dense sum
           ("topk", None): {"check": 1, "compensate": 1, "encode": 1, "memory": 1, "decode": 1},
           **{(codec, None): {"check": 1, "encode": 1, "decode": 1} for codec in ("signsgd", "signum")}}


def _optimizer_worker(rank, compression, scheme):
    import mergecomp.torch as mc
    from mergecomp.kernels import native

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=compression, groups=1,
                                  scheme=scheme)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    befores, afters = [], []
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        befores.append(time.perf_counter())
        opt.step()
        afters.append(time.perf_counter())
    return opt.step_breakdown(4), step_bounds(befores, afters, 4), native.usable(torch.zeros(1))


@pytest.mark.parametrize("compression,scheme", list(PASSES))
def test_optimizer_breakdown_and_passes_per_codec_path(compression, scheme):
    for out, (lower, upper), fused in run_workers(_optimizer_worker, 2, compression, scheme):
        check_parts(out, 4)
        assert lower <= out["step_s"] <= upper
        assert out["optimizer_s"] > 0 and out["wait_s"] > 0
        [group] = out["groups"]
        expected = PASSES[compression, scheme] if fused else UNFUSED.get((compression, scheme), PASSES[compression, scheme])
        assert group["passes_by_stage"] == pytest.approx(expected, rel=1e-2)
        assert group["codec"] == (scheme or "compressed") and group["bytes"] == (64 * 256 + 256 + 256 * 10 + 10) * 4


def _ddp_worker(rank):
    import mergecomp.torch as mc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state, hook = mc.ddp_comm_hook("topk", named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return state.step_breakdown()


def test_ddp_hook_state_shows_the_breakdown():
    for out in run_workers(_ddp_worker, 2):
        check_parts(out, 3)
        assert out["optimizer_s"] == 0 and out["groups"][0]["passes_by_stage"].get("copy-in", 0) == 0
