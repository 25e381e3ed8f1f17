"""What was changed so that the pipeline is right on CUDA, checked where it can be on the CPU (the
CUDA tests themselves are in ``tests/cuda``): the scheduler's arrival clock and which step it
stamps with events, host draws moved to a device, device-side NaN/Inf flags, DGC's masking and
the sign decode's values without a host read, and the torch engine's backend choice."""
import time

import pytest
import torch
from steps import planned

import mergecomp
from mergecomp.compressors.base.sparse import shared_random_indices
from mergecomp.compressors.signsgd import VoteCodec
from mergecomp.engines.communicator import LocalCommunicator
from mergecomp.engines.torch_dist import BACKEND_VARIABLE, default_backend
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import GroupPlan, layout
from mergecomp.kernels import bitpack
from mergecomp.kernels.codecs import decode_signs, pack_signs, sign_sum
from mergecomp.kernels.transfer import pinned, to_device
from mergecomp.pipeline import planned as planned_module
from mergecomp.pipeline.nonfinite import NONFINITE_GRADIENT, OVERFLOWED, NonfiniteCheck
from mergecomp.scheduler.clock import Arrivals, StepEnds, settled_now
from mergecomp.scheduler.online import SchedulerConfig


# -- the scheduler's clock ------------------------------------------------------------------------
def test_arrival_times_leave_the_hooks_own_work_out():
    """The stamps are host seconds between the gradients less the hooks' own work, bounded by the
    host's clock read around them (whatever the machine's speed)."""
    arrivals = Arrivals(4, torch.device("cpu"), events=True)
    assert not arrivals.events  # CUDA events on a CUDA device only: host seconds here
    first = time.perf_counter()
    arrivals.arrived(2)
    time.sleep(0.03)  # the backward pass between two gradients
    arrivals.arrived(0)
    second = time.perf_counter()
    with arrivals.own_work():  # the hook's own work
        time.sleep(0.05)
    arrivals.arrived(1)
    last = time.perf_counter()
    ready = arrivals.seconds()
    assert ready[3] == 0.0  # never arrived
    assert 0.03 <= ready[0] - ready[2] <= second - first
    assert 0.0 <= ready[1] - ready[0] <= (last - first) - (ready[0] - ready[2]) - 0.05  # the 0.05 s left out
    before = time.perf_counter()
    assert before <= settled_now(torch.device("cpu")) <= time.perf_counter()  # no device to wait for


def test_step_ends_time_each_step_from_the_second_and_start_over_when_told():
    """On the CPU both kinds of reading are the host clock: a step's seconds from the second
    step on, none after ``forget`` (a step that is no sample)."""
    ends = StepEnds(torch.device("cpu"))
    assert ends.seconds() is None
    time.sleep(0.02)
    assert ends.seconds(lagged=True) >= 0.02
    time.sleep(0.01)
    assert ends.seconds() >= 0.01
    ends.forget()
    assert ends.seconds(lagged=True) is None and ends.seconds() is not None


def test_the_step_stamped_for_the_profile_is_the_one_the_scheduler_profiles(monkeypatch):
    """Only the step whose end the scheduler profiles stamps its arrivals, with event stamps
    (which a CUDA device takes); every other step stamps nothing."""
    asked = []

    def arrivals(count, device, events=False):
        asked.append(events)
        return Arrivals(count, device, events)

    monkeypatch.setattr(planned_module, "Arrivals", arrivals)
    names, shapes = ["a", "b", "c"], [(16, 8), (8,), (4, 8)]
    step = planned("topk", None, LocalCommunicator(), names, shapes, [torch.float32] * 3, groups="auto",
                   scheduler=SchedulerConfig(warmup_steps=2, settle_steps=0, probe_steps=1, retune_window=1000))
    g = torch.Generator().manual_seed(0)
    profiled, stamped = [], []
    for _ in range(6):
        searches, before = step.scheduler.searches if step.scheduler else 0, len(asked)
        for i in reversed(range(3)):
            step.add(i, torch.randn(shapes[i], generator=g))
        step.finish()
        profiled.append(step.scheduler.searches > searches)
        stamped.append(asked[before:])
    assert profiled.count(True) == 1
    assert stamped == [[True] if p else [] for p in profiled]


# -- host draws on a device -------------------------------------------------------------------------
def test_host_draws_are_pinned_for_cuda_only_and_the_cpu_keeps_its_tensor():
    assert pinned(torch.device("cuda", 0)) and pinned("cuda") and not pinned("cpu")
    host = torch.arange(5)
    assert to_device(host, torch.device("cpu")) is host
    # rand-k's indices: the CPU generator's draws whatever the device (the same on every rank)
    expected = torch.randint(1000, (50,), generator=torch.Generator().manual_seed(7))
    assert torch.equal(shared_random_indices(1000, 50, 7, torch.device("cpu")), expected)


# -- no host read in the step -------------------------------------------------------------------------
def test_dgc_memory_clears_the_momentum_exactly_where_a_nonzero_value_went_out():
    memory = mergecomp.get_memory("dgc")
    g = torch.Generator().manual_seed(0)
    compensated = memory.compensate(torch.randn(100, generator=g), "g")
    momentum = memory.state["g"]["momentum"].clone()
    indices = torch.tensor([3, 17, 42, 99, 0])
    values = compensated[indices].clone()
    values[[1, 3]] = 0  # sent as zeros: their momentum stays
    memory.update_sparse(compensated, "g", indices, values)
    expected = momentum.index_fill(0, indices[values != 0], 0)
    assert torch.equal(memory.state["g"]["momentum"], expected)


def test_nonfinite_flags_are_built_per_group_without_indexing():
    comm = LocalCommunicator()
    group = layout(GroupPlan(((0, 1),)), [torch.Size([6]), torch.Size([3])])[0]
    ok = Exchange(mergecomp.get_compressor("topk"), mergecomp.get_memory("residual"), comm)
    cast = Exchange(mergecomp.get_compressor("fp16"), mergecomp.get_memory("residual"), comm)
    bad = torch.randn(9)
    bad[4] = float("nan")
    big = torch.randn(9)
    big[2] = 1e6  # finite, beyond fp16: its payload overflows
    jobs = [ok.start(group, torch.randn(9)), ok.start(group, bad), cast.start(group, big)]
    culprits = NonfiniteCheck(comm, jobs, 0).culprits(["fine", "nan", "overflow"])
    assert culprits == [(0, "nan", NONFINITE_GRADIENT), (0, "overflow", OVERFLOWED)]
    known = ok.start(group, bad.clone(), finite=False)
    assert known.finite.dtype == torch.bool and not known.finite and not known.compensated.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_sign_values_are_made_where_the_bits_are(dtype):
    x = torch.randn(37, generator=torch.Generator().manual_seed(1))
    packed, _ = pack_signs(x)
    assert torch.equal(decode_signs(packed, 37, dtype), torch.where(x >= 0, 1.0, -1.0).to(dtype))
    sides = [(torch.tensor(-0.3), torch.tensor([0.7])), (-2.0, 1.5)]  # tensors (a payload's) or floats
    expected = sum(bitpack.decode(packed, 1, 37, torch.tensor([float(a), float(b)]).to(dtype)) for a, b in sides) / 2
    assert torch.equal(sign_sum([packed, packed], sides, 37, dtype, divisor=2), expected)
    votes = torch.tensor([-1.0, 0.0, 1.0, 1.0, 0.0, -1.0, 1.0]).to(dtype)
    codec = VoteCodec()
    assert torch.equal(codec.decompress(*codec.compress(votes, "g")), votes)


# -- the torch engine's backend -----------------------------------------------------------------------
def test_the_torch_backend_is_named_by_the_environment_or_follows_cuda(monkeypatch):
    monkeypatch.setenv(BACKEND_VARIABLE, "nccl")
    assert default_backend() == "nccl"
    monkeypatch.delenv(BACKEND_VARIABLE)
    assert default_backend() == ("nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available()
                                 else "gloo")
