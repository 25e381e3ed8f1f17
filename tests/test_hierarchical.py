"""The hierarchical schemes (codecs "hierarchical", "hierarchical-two-phase") on real gloo ranks
made into hosts by LOCAL_WORLD_SIZE (2 hosts x 2 ranks; 3 hosts x 2 for the two-phase scheme across hosts), through MergedStep and the
torch engine's per-host groups; one process per host and one host, where they are the flat
schemes; bad layouts; and a run on the namespace cluster (root only)."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from distributed import run_workers
from test_two_phase import (ALLGATHERED, CONSERVING, CUTS, NAMES, STEPS, grads, make_step, mean_grads, residual_total,
                            run)

HIER, HIER2 = "hierarchical", "hierarchical-two-phase"
#: every tensor a group of its own: the empty and the 1-element tensors alone
LAYERWISE = tuple((i,) for i in reversed(range(len(NAMES))))


def second_start(comm, step, group, codec):
    """Where this rank's second-stage residual of ``group`` (sent with ``codec``) starts."""
    from mergecomp.compressors.base.capabilities import shard_alignment
    from mergecomp.exchange.schemes.two_phase import shard_bounds

    align, rank = shard_alignment(step.exchange.compressor), comm.rank
    if codec == HIER2:
        local = comm.local_size
        start, stop = shard_bounds(group.numel, local, align)[rank % local]
        return shard_bounds(stop - start, comm.size // local, align, start)[rank // local][0]
    return shard_bounds(group.numel, comm.size, align)[rank][0]


def identical(comm, results):
    rows = comm.allgather(torch.cat(results))
    return bool((rows == rows[0]).all())


def host_vote(size, local, steps):
    """signSGD's hierarchical result: per element, the majority over hosts of the sign of the
    host's sum (a zero sum sent as +), 0 on a tie."""
    out = []
    for s in steps:
        flat = [torch.cat([g.reshape(-1) for g in grads(r, s)]) for r in range(size)]
        sums = [sum(flat[h * local:(h + 1) * local]) for h in range(size // local)]
        out.append(torch.sign(sum(torch.where(x >= 0, 1.0, -1.0) for x in sums)))
    return out


#: the compressors a 3-host run covers (one of each kind of payload and aggregate)
THREE_HOSTS = ["qsgd", "onebit", "signsgd", "topk"]


def _worker(rank, light=False):
    """Everything on 2 hosts x 2; with ``light``, the two-phase scheme across hosts for
    :data:`THREE_HOSTS` only (the 3-host run)."""
    import mergecomp.torch as mc
    from mergecomp.exchange.plan import GroupPlan

    comm = mc.communicator()
    size, local = comm.size, comm.local_size
    out = {"split": [c.size for c in comm.split_hosts()]}
    for codec in (HIER2,) if light else (HIER, HIER2):
        # the exact codec gives the plain average (integer-valued gradients: exact sums), also in
        # groups of one tensor (the empty one, the single element)
        for groups in (CUTS, LAYERWISE):
            out[(codec, "none", len(groups))] = [torch.equal(a, b) for a, b in zip(
                run(make_step(comm, "none", codec, groups=groups), rank, range(2), integers=True),
                run(make_step(comm, "none", "compressed", groups=groups), rank, range(2), integers=True))]
        for name in THREE_HOSTS if light else ALLGATHERED:
            torch.manual_seed(rank)  # the stochastic codecs draw on each rank
            step = make_step(comm, name, codec)
            out[(codec, name)] = {"identical": identical(comm, run(step, rank, range(STEPS))),
                                  "second_stage": sorted({f for fields in step.exchange.schemes["two-phase"].memory.state.values()
                                                          for f in fields})}
            if name in CONSERVING:
                # what was applied plus every residual of both stages is the sum of the mean gradients
                step = make_step(comm, name, codec, memory="residual")
                applied = sum(run(step, rank, range(STEPS)))
                out[(codec, name)]["gap"] = (applied + residual_total(comm, step, second_start)
                                             - mean_grads(size, range(STEPS))).abs().max().item()
        torch.manual_seed(rank)
        out[(codec, "layerwise")] = identical(comm, run(make_step(comm, "topk", codec, groups=LAYERWISE), rank,
                                                        range(2)))
        votes = run(make_step(comm, "signsgd", codec), rank, range(3))
        out[(codec, "vote")] = [torch.equal(a, b) for a, b in zip(votes, host_vote(size, local, range(3)))]
    if light:
        return out
    out["signum"] = [torch.equal(a, b) for a, b in zip(run(make_step(comm, "signum", HIER), rank, range(3)),
                                                       run(make_step(comm, "signum", HIER2), rank, range(3)))]
    # checkpoint and resume: bit-exact (both stages' residuals, the stochastic codec's draws)
    for codec, name in ((HIER2, "efsignsgd"), (HIER, "qsgd")):
        torch.manual_seed(7 + rank)
        saved = make_step(comm, name, codec, memory="residual")
        run(saved, rank, range(2))
        state, rng = saved.state_dict(), torch.get_rng_state()
        cont = run(saved, rank, range(2, 4))
        resumed = make_step(comm, name, codec, memory="residual")
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        out[("resume", codec)] = [torch.equal(a, b) for a, b in zip(cont, run(resumed, rank, range(2, 4)))]
    # plan switches between every scheme and between cuts keep every residual
    step = make_step(comm, "topk", HIER2)
    applied = sum(run(step, rank, range(2)))
    for s, plan in enumerate([GroupPlan(((4, 3, 2), (1, 0)), (HIER, "two-phase")),
                              GroupPlan(((4,), (3, 2, 1, 0)), ("compressed", HIER2)),
                              GroupPlan(((4, 3), (2, 1, 0)), (HIER2, HIER))]):
        step.set_plan(plan)
        applied += sum(run(step, rank, range(2 + 2 * s, 4 + 2 * s)))
    out["switch_gap"] = (applied + residual_total(comm, step, second_start)
                         - mean_grads(size, range(8))).abs().max().item()
    # the scheme option, through the PyTorch front end
    from test_optimizer_dist import flat_params, make_data, make_model, shard, train

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model.named_parameters(),
                                  compression="topk", groups=2, scheme=HIER2)
    train(model, opt, shard(x, rank, size), shard(y, rank, size), steps=10)
    out["optimizer"] = identical(comm, [flat_params(model)])
    return out


@pytest.fixture(scope="module")
def results():
    results = run_workers(_worker, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    assert all(out["split"] == [2, 2] for out in results)  # hosts, not a flat scheme
    return results


def test_three_hosts_of_two_two_phase_across_hosts():
    results = run_workers(_worker, 6, True, env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    for out in results:
        assert out["split"] == [2, 3]
        assert out[(HIER2, "none", len(CUTS))] == [True, True]
        assert out[(HIER2, "none", len(LAYERWISE))] == [True, True]
        assert out[(HIER2, "vote")] == [True] * 3
        for name in THREE_HOSTS:
            assert out[(HIER2, name)]["identical"], name
            if name in CONSERVING:
                assert out[(HIER2, name)]["gap"] < 1e-4, (name, out[(HIER2, name)])


@pytest.mark.parametrize("codec", [HIER, HIER2])
def test_hierarchical_with_the_exact_codec_is_the_plain_average(results, codec):
    for out in results:
        assert out[(codec, "none", len(CUTS))] == [True, True]
        assert out[(codec, "none", len(LAYERWISE))] == [True, True]
        assert out[(codec, "layerwise")]


@pytest.mark.parametrize("codec", [HIER, HIER2])
@pytest.mark.parametrize("name", ALLGATHERED)
def test_every_allgathered_compressor_gives_identical_results_and_conserves_the_gradient(results, codec, name):
    import mergecomp

    for out in results:
        assert out[(codec, name)]["identical"]
        if name in CONSERVING:
            assert out[(codec, name)]["gap"] < 1e-4, out[(codec, name)]
    lossy = mergecomp.get_compressor(name).default_memory != "none"
    # a second-stage residual only across hosts by two-phase, where the first stage feeds back
    assert results[0][(codec, name)]["second_stage"] == (["residual"] if codec == HIER2 and lossy else [])


@pytest.mark.parametrize("codec", [HIER, HIER2])
def test_the_vote_is_over_hosts_of_the_sign_of_each_hosts_sum(results, codec):
    for out in results:
        assert out[(codec, "vote")] == [True] * 3
        assert out["signum"] == [True] * 3


def test_checkpoint_resume_is_bit_exact(results):
    for out in results:
        assert out[("resume", HIER2)] == [True, True]
        assert out[("resume", HIER)] == [True, True]


def test_plan_switches_between_schemes_keep_the_residuals(results):
    for out in results:
        assert out["switch_gap"] < 1e-4


def test_the_optimizer_takes_the_scheme_and_ranks_stay_identical(results):
    assert all(out["optimizer"] for out in results)


# -- where the hierarchy is flat -----------------------------------------------------------------
def _flat_worker(rank):
    import mergecomp.torch as mc

    comm = mc.communicator()
    out = {}
    for hierarchical, flat in ((HIER, "compressed"), (HIER2, "two-phase")):
        for name in ("qsgd", "efsignsgd", "topk"):
            runs = []
            for codec in (hierarchical, flat):
                torch.manual_seed(rank)
                runs.append(run(make_step(comm, name, codec), rank, range(3)))
            out[(hierarchical, name)] = [torch.equal(a, b) for a, b in zip(*runs)]
    out["split"] = [c.size for c in comm.split_hosts()]
    return out


@pytest.mark.parametrize("env", [{"LOCAL_WORLD_SIZE": "1"}, None], ids=["1 process per host", "one host"])
def test_hierarchical_on_one_process_per_host_or_one_host_is_the_flat_scheme(env):
    results = run_workers(_flat_worker, 2, env=env)
    for out in results:
        assert all(v == [True] * 3 for k, v in out.items() if k != "split"), out
        assert out["split"] == ([1, 2] if env else [2, 1])


def test_a_single_process_runs_the_hierarchical_scheme_flat():
    from mergecomp.engines.communicator import LocalCommunicator

    comm = LocalCommunicator()
    for codec in (HIER, HIER2):
        got = run(make_step(comm, "topk", codec), 0, range(2))
        want = run(make_step(comm, "topk", "compressed"), 0, range(2))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# -- bad layouts ---------------------------------------------------------------------------------
def test_host_layout_names_the_ranks_that_break_it():
    from mergecomp.engines.communicator import host_layout

    assert host_layout([(0, 2), (1, 2), (0, 2), (1, 2)], True) == 2
    assert host_layout([(0, 2), (0, 2), (1, 2), (1, 2)], False) == 2
    with pytest.raises(ValueError, match=r"same number of processes.*\{2: \[0, 1\], 3: \[2, 3\]\}"):
        host_layout([(0, 2), (1, 2), (0, 3), (1, 3)], True)
    with pytest.raises(ValueError, match="3 ranks do not make hosts of 2"):
        host_layout([(0, 2), (1, 2), (0, 2)], True)
    with pytest.raises(ValueError, match=r"host by host.*ranks \[1, 2\] have local ranks \[0, 1\]"):
        host_layout([(0, 2), (0, 2), (1, 2), (1, 2)], True)
    with pytest.raises(ValueError, match=r"once per host; ranks \[2, 3\] have local ranks \[1, 2\]"):
        host_layout([(0, 2), (0, 2), (1, 2), (2, 2)], False)


def _bad_layout_worker(rank, layout):
    import mergecomp.torch as mc

    comm = mc.communicator()
    comm.local_rank, comm.local_size = layout[rank]
    try:
        run(make_step(comm, "topk", HIER), rank, range(1))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("layout, message", [
    ([(0, 2), (1, 2), (0, 1), (0, 1)], r"same number of processes, but the ranks report local sizes "
                                       r"\{1: \[2, 3\], 2: \[0, 1\]\}"),
    ([(1, 2), (0, 2), (0, 2), (1, 2)], r"numbered host by host .* ranks \[0, 1\] have local ranks \[1, 0\]"),
], ids=["unequal local sizes", "not host by host"])
def test_a_bad_layout_is_a_clear_error_on_every_rank(layout, message):
    errors = run_workers(_bad_layout_worker, 4, layout, env={"MERGECOMP_TIMEOUT": "20"}, timeout=120)
    for rank, err in enumerate(errors):
        assert f"rank {rank}: cannot split the 4 ranks into hosts" in err
        assert re.search(message, err), err


# -- the namespace cluster -------------------------------------------------------------------------
def cluster_worker() -> int:
    """One process of a cluster run: hierarchical results identical on every rank, and equal to
    the plain average with the exact codec.  Exit code 0, or 3 with the failures printed."""
    import mergecomp.torch as mc

    mc.init(engine="torch")
    comm, rank = mc.communicator(), mc.rank()
    failures = []
    for codec in (HIER, HIER2):
        exact = run(make_step(comm, "none", codec), rank, range(2), integers=True)
        if not all(torch.equal(a, b) for a, b in zip(
                exact, run(make_step(comm, "none", "compressed"), rank, range(2), integers=True))):
            failures.append(f"{codec} none != plain average")
        for name in ("topk", "efsignsgd", "qsgd"):
            torch.manual_seed(rank)
            if not identical(comm, run(make_step(comm, name, codec), rank, range(3))):
                failures.append(f"{codec} {name}: ranks differ")
    split = [c.size for c in comm.split_hosts()]
    mc.shutdown()
    print(f"rank {rank}: hosts {split}, failures {failures}", flush=True)
    return 3 if failures or split != [2, 2] else 0


def test_cluster_of_two_hosts_of_two_processes_gives_identical_results():
    """mergecomp_bench.cluster with 2 processes per namespace host (needs root and iproute2;
    skipped otherwise): the hierarchical schemes across the veth links."""
    from mergecomp_bench.cluster import Cluster, ClusterError

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root and iproute2")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); from test_hierarchical import cluster_worker; " \
           f"sys.exit(cluster_worker())"
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
           "MERGECOMP_TIMEOUT": "60"}
    try:
        with Cluster(2, "1gbit", procs_per_host=2) as cluster:
            names = [*cluster.host_ns, cluster.bridge_ns]
            codes = cluster.run([sys.executable, "-c", code], timeout=240, env=env)
            output = [list(lines) for lines in cluster.output]
    except ClusterError as err:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(str(err))
    assert codes == [0] * 4, output
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
