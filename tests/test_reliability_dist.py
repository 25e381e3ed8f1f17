"""Failure modes end in a clear error on every rank within bounded time, or are handled:
cross-rank mismatch, collective timeouts, a killed worker, odd tensors, checkpoint/resume,
resource hygiene."""
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from distributed import free_port, run_workers
from test_optimizer_dist import flat_params, make_data, make_model, shard, train

import mergecomp


# -- cross-rank mismatch -------------------------------------------------------------------------
def _mismatch_worker(rank, what):
    import mergecomp.torch as mc

    model = make_model()
    if what == "model" and rank == 1:
        model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
    compression = "topk" if what == "compressor" and rank == 1 else "none"
    groups = 3 if what == "groups" and rank == 1 else 2
    began = time.monotonic()
    try:
        mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                compression=compression, groups=groups)
    except ValueError as err:
        return str(err), time.monotonic() - began
    return None, time.monotonic() - began


@pytest.mark.parametrize("what,expected", [("model", "parameters"), ("compressor", "compressor"),
                                           ("groups", "groups")])
def test_ranks_built_differently_raise_on_every_rank(what, expected):
    for rank, (message, seconds) in enumerate(run_workers(_mismatch_worker, 2, what)):
        assert message is not None, f"rank {rank} did not notice the mismatch"
        assert f"rank 1 differs from rank 0 in its {expected}" in message
        assert seconds < 30


# -- timeouts ------------------------------------------------------------------------------------
def _late_worker(rank):
    x, y = make_data()
    model = make_model()
    import mergecomp.torch as mc

    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="none", groups=1)
    if rank == 1:
        time.sleep(10)  # rank 1 stalls past rank 0's 2 s however slowly rank 0 reaches its collective
    began = time.monotonic()
    try:
        train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=1)
    except mergecomp.engines.communicator.CommunicationError as err:
        return str(err), time.monotonic() - began
    return None, time.monotonic() - began


def test_a_stalled_rank_times_out_naming_group_and_step():
    results = run_workers(_late_worker, 2, env={"MERGECOMP_TIMEOUT": "2"}, timeout=60)
    message, seconds = results[0]
    assert message is not None and "timed out after 2s" in message
    assert "group 'g" in message and "step 0" in message and "rank 0" in message
    assert seconds < 10


# -- a worker dies -------------------------------------------------------------------------------
KILLED_WORKER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import mergecomp.torch as mc
    from test_optimizer_dist import make_data, make_model, shard
    mc.init()
    rank = mc.rank()
    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", groups=2)
    for step in range(1000):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank, 2)), shard(y, rank, 2))
        opt.zero_grad(); loss.backward(); opt.step()
    print("finished without noticing", flush=True)
""")


def test_a_killed_worker_makes_the_survivor_exit_nonzero_with_a_message(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WORKER.format(tests=os.path.dirname(__file__)))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MERGECOMP_TIMEOUT": "300"}  # noticed, not timed out
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    began = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0
    assert time.monotonic() - began < 60
    assert "finished without noticing" not in out
    assert "CommunicationError" in err and "failed or timed out" in err


# -- odd tensors ---------------------------------------------------------------------------------
class OddModel(torch.nn.Module):
    """0-d, empty, fp64, non-contiguous, sparse-gradient and frozen parameters together."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))                        # 0-d
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))                        # no elements
        self.transposed = torch.nn.Parameter(torch.randn(4, 16).t())              # non-contiguous
        self.wide = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))    # fp64
        self.embed = torch.nn.Embedding(10, 4, sparse=True)                       # sparse gradient
        self.frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x):
        h = (x @ self.transposed) * self.scale + self.empty.sum()
        h = (h.double() @ self.wide).float() + self.frozen
        return h + self.embed(torch.arange(x.shape[0]) % 10)


#: the compressors whose payloads are allgathered (packed into bytes, one row per rank)
ALLGATHERED = [name for name in mergecomp.compressor_names() if not mergecomp.get_compressor(name).summable]


def _odd_worker(rank):
    """``(max deviation from one process on the joined batch, groups, {compressor: (empty
    parameter's gradient shape, parameters after a step) or the error it raised})``."""
    import mergecomp.torch as mc

    x, y = make_data()
    layerwise = {}
    for name in ALLGATHERED:  # the empty parameter is a group of its own
        model = OddModel()
        try:
            with pytest.warns(UserWarning, match="sparse gradient"):
                opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                              model.named_parameters(), compression=name, groups="layerwise")
                train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=1)
            layerwise[name] = tuple(model.empty.grad.shape), flat_params(model)
        except RuntimeError as err:
            layerwise[name] = repr(err)
    model = OddModel()
    with pytest.warns(UserWarning, match="sparse gradient"):
        opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                      compression="none", groups=2)
        train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=5)
    reference = OddModel()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    # One process on the whole batch: embeddings index by position within the shard.
    for _ in range(5):
        loss = sum(torch.nn.functional.cross_entropy(reference(shard(x, r, 2)), shard(y, r, 2)) for r in range(2)) / 2
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    return max((a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
               for a, b in zip(model.parameters(), reference.parameters())), len(opt.groups), layerwise


@pytest.fixture(scope="module")
def odd_runs():
    return run_workers(_odd_worker, 2)


def test_odd_tensors_are_exchanged_exactly(odd_runs):
    for diff, groups, _ in odd_runs:
        assert diff < 1e-5
        assert groups >= 3   # fp64 parameters never share a buffer with fp32 ones


@pytest.mark.parametrize("name", ALLGATHERED)
def test_an_empty_parameter_in_a_group_of_its_own_with_every_allgather_compressor(odd_runs, name):
    (*_, rank0), (*_, rank1) = odd_runs
    assert not isinstance(rank0[name], str), rank0[name]
    (shape, params0), (_, params1) = rank0[name], rank1[name]
    assert shape == (0, 3)
    assert torch.isfinite(params0).all() and torch.equal(params0, params1)


# -- checkpoint / resume -------------------------------------------------------------------------
def _resume_worker(rank, compression):
    import mergecomp.torch as mc

    x, y = make_data()
    mine = shard(x, rank, 2), shard(y, rank, 2)

    def build():
        model = make_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if compression != "dgc" else 0.0)
        return model, mc.DistributedOptimizer(sgd, model.named_parameters(), compression=compression, groups=2)

    model, opt = build()
    train(model, opt, *mine, steps=20)
    uninterrupted = flat_params(model)

    model, opt = build()
    train(model, opt, *mine, steps=10)
    buffer = io.BytesIO()  # as torch.save(...) to a file would
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    train(model, opt, *mine, steps=3)  # work after the checkpoint that the resume must not see
    model, opt = build()
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    train(model, opt, *mine, steps=10)
    return torch.equal(uninterrupted, flat_params(model)), flat_params(model)


@pytest.mark.parametrize("compression", ["none", "topk", "dgc", "randk", "powersgd", "signum"])
def test_resume_from_checkpoint_equals_uninterrupted_run(compression):
    (same0, p0), (same1, p1) = run_workers(_resume_worker, 2, compression)
    assert same0 and same1
    assert torch.equal(p0, p1)


def _auto_resume_worker(rank):
    import mergecomp.torch as mc
    from mergecomp.scheduler.online import SchedulerConfig

    x, y = make_data()
    config = SchedulerConfig(warmup_steps=1, settle_steps=0, probe_steps=1, retune_window=1000)
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", scheduler=config)
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=15)
    state = opt.state_dict()
    fresh = make_model()
    resumed = mc.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1), fresh.named_parameters(),
                                      compression="topk", scheduler=config)
    resumed.load_state_dict(state)
    train(fresh, resumed, shard(x, rank, 2), shard(y, rank, 2), steps=2)
    return opt.plan == resumed.plan, resumed.schedule_report()["phase"]


def test_resume_keeps_the_chosen_plan_without_searching_again():
    for same_plan, phase in run_workers(_auto_resume_worker, 2):
        assert same_plan and phase == "monitor"


# -- resource hygiene ----------------------------------------------------------------------------
def _hygiene_worker(rank):
    import resource

    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                  compression="topk", groups=2)
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=200)
    buffers = [b.data_ptr() for b in opt.merged.buffers]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train(model, opt, shard(x, rank, 2), shard(y, rank, 2), steps=800)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return buffers == [b.data_ptr() for b in opt.merged.buffers], (rss_after - rss_before) / 1024


def test_thousand_steps_reuse_buffers_and_do_not_grow_memory():
    for reused, growth_mb in run_workers(_hygiene_worker, 2, timeout=300):
        assert reused
        assert growth_mb < 8, f"max RSS grew by {growth_mb:.1f} MB over 800 steps"


# -- shutdown ------------------------------------------------------------------------------------
def _staggered_shutdown(rank):
    import mergecomp.torch as mc

    mc.barrier()  # the ranks leave together, however far apart they started
    if rank == 1:
        time.sleep(1.5)
    began = time.monotonic()
    mc.shutdown()
    return time.monotonic() - began, mc.is_initialized()


def test_shutdown_waits_for_every_rank_before_tearing_down():
    """A rank leaving early must not close its connections under a peer (that can abort the
    peer's process on exit), so shutdown meets the other ranks first."""
    (early, early_up), (late, late_up) = run_workers(_staggered_shutdown, 2, timeout=60)
    assert early >= 1.0 > late
    assert not early_up and not late_up
