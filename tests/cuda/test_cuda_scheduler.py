"""The scheduler's clocks on CUDA: a step, a probe and a gradient's arrival are timed when the GPU
has done the work, not when Python queued it (:mod:`mergecomp.scheduler.clock`).  A kernel
that keeps the GPU busy for a known time (``torch.cuda._sleep``) returns at once on the host;
every time the scheduler reads must include it."""
import time

import pytest
import torch
import torch.nn.functional as F
from cuda_support import DEVICE, gpu_sleep
from distributed import run_workers
from test_optimizer_dist import make_data

from mergecomp.scheduler.clock import Arrivals, StepEnds, settle, settled_now

pytestmark = pytest.mark.cuda

SLEEP = 0.02  # seconds of GPU work per step, in the backward pass


@pytest.fixture(autouse=True)
def _calibrated():
    gpu_sleep(0.001)  # times the sleep kernel once, outside what the tests time
    settle(DEVICE)


def test_a_settled_clock_waits_for_the_device():
    began = time.perf_counter()
    gpu_sleep(0.05)
    launched = time.perf_counter() - began
    assert launched < 0.02  # the host only queued it...
    assert settled_now(DEVICE) - began >= 0.045  # ...the settled clock waited for it


def test_lagged_step_ends_read_the_step_before_without_waiting_for_this_one():
    """Events mark each step's end; a reading returns the step before (its GPU work included)
    from the third step on, and waits for none of the work the step just queued."""
    ends = StepEnds(DEVICE)
    readings, waited = [], []
    for _ in range(4):
        settle(DEVICE)  # the steps before are done, as they mostly are in training
        gpu_sleep(SLEEP)  # this step's work, still running at its end
        began = time.perf_counter()
        readings.append(ends.seconds(lagged=True))
        waited.append(time.perf_counter() - began)
    assert readings[:2] == [None, None]
    assert all(r >= 0.9 * SLEEP for r in readings[2:])
    assert max(waited) < 0.5 * SLEEP  # this step's work not waited for
    settle(DEVICE)


def test_arrival_events_time_the_device_and_leave_own_work_out():
    stamps = {}
    for events in (True, False):
        arrivals = Arrivals(3, DEVICE, events=events)
        settle(DEVICE)
        arrivals.arrived(0)
        gpu_sleep(0.05)  # the backward pass's kernels between two gradients
        arrivals.arrived(1)
        with arrivals.own_work():  # a hook's own kernels
            gpu_sleep(0.05)
        arrivals.arrived(2)
        settle(DEVICE)
        stamps[events] = arrivals.seconds()
    device, host = stamps[True], stamps[False]
    assert device[1] - device[0] >= 0.045 and abs(device[2] - device[1]) < 0.01
    assert host[1] - host[0] < 0.02  # host stamps are launch times: why the profiled step takes events


class SleepInBackward(torch.autograd.Function):
    """The identity, whose backward keeps the GPU busy for ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        gpu_sleep(ctx.seconds)
        return grad, None


class Sleepy(torch.nn.Module):
    """Three layers; the first layer's gradients come ``seconds`` of GPU time after the others'."""

    def __init__(self, seconds):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.head = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
        self.seconds = seconds

    def forward(self, x):
        hidden = torch.tanh(SleepInBackward.apply(self.first(x), self.seconds))
        return self.head(torch.tanh(self.second(hidden)))


def _scheduler_worker(rank, seconds):
    """``groups="auto"`` on one process where nothing else waits for the GPU: the local engine
    (no collective), no NaN/Inf check, fp16 (no codec that reads a result back), no loss read."""
    import mergecomp.torch as mc
    from mergecomp.scheduler.online import SchedulerConfig

    mc.shutdown()
    mc.init(engine="local")
    x, y = (t.to(DEVICE) for t in make_data())
    model = Sleepy(seconds).to(DEVICE)
    config = SchedulerConfig(warmup_steps=1, settle_steps=0, probe_steps=2, candidates=2, runoff_rounds=0,
                             retune_window=1000)
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                  compression="fp16", groups="auto", nonfinite="ignore", scheduler=config)
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if opt.scheduler is not None and opt.scheduler.phase == "monitor":
            break
    report = opt.schedule_report()
    return report["phase"], [c["measured_s"] for c in report["candidates"]], list(opt.scheduler.profile.ready)


def test_the_scheduler_measures_steps_and_arrivals_on_the_gpu():
    phase, measured, ready = run_workers(_scheduler_worker, 1, SLEEP, env={"MERGECOMP_TIMEOUT": "60"})[0]
    assert phase == "monitor" and measured
    assert min(measured) >= 0.9 * SLEEP, measured  # each candidate's steps include the GPU's work
    gaps = [b - a for a, b in zip(ready, ready[1:])]
    assert max(gaps) >= 0.9 * SLEEP, ready  # the first layer's gradients arrived after the sleep
