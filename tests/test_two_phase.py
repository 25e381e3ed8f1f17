"""The two-phase scheme (codec "two-phase") on 2, 3 and 4 real gloo ranks, through MergedStep and
the engine's all-to-all and allgather: groups whose sizes do not divide by the ranks, empty and
tiny tensors.  One launch per world size; the tests below read its results."""
import pytest
import torch
from distributed import run_workers

import mergecomp

NAMES = ["empty", "one", "w", "odd", "b"]
SHAPES = [(0,), (1,), (13, 7), (29,), (3,)]
DTYPES = [torch.float32] * len(NAMES)
#: two groups in backward order: the big weight with the empty and single tensors, then the rest
CUTS = (((4, 3), (2, 1, 0)))
#: the compressors whose payloads are allgathered, and which have error feedback by default
ALLGATHERED = ["qsgd", "terngrad", "onebit", "signsgd", "efsignsgd", "signum", "topk", "dgc"]
#: those whose aggregate is a mean (not a vote): with a residual memory nothing is lost
CONSERVING = ["qsgd", "terngrad", "onebit", "efsignsgd", "topk", "dgc"]
STEPS = 4


def grads(rank, step, integers=False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if integers:  # sums of these are exact in fp32, in any order
        return [torch.randint(-8, 9, s, generator=g).float() for s in SHAPES]
    return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(SHAPES)]


def make_step(comm, compression, codec, memory=None, groups=CUTS, **options):
    from steps import planned

    from mergecomp.exchange.plan import GroupPlan

    plan = GroupPlan(groups, (codec,) * len(groups))
    return planned(compression, memory, comm, NAMES, SHAPES, DTYPES, groups=plan, observe_order=False, **options)


def run(step, rank, steps, integers=False):
    out = []
    for s in steps:
        for i, g in enumerate(grads(rank, s, integers)):
            step.add(i, g)
        out.append(torch.cat([t.reshape(-1) for t in step.finish().tensors(len(NAMES))]).clone())
    return out


def two_phase_start(comm, step, group, codec):
    """Where this rank's second-stage residual of ``group`` starts."""
    from mergecomp.compressors.base.capabilities import shard_alignment
    from mergecomp.exchange.schemes.two_phase import shard_bounds

    return shard_bounds(group.numel, comm.size, shard_alignment(step.exchange.compressor))[comm.rank][0]


def residual_total(comm, step, start_of=two_phase_start):
    """Every rank's first-stage residuals / N plus every rank's second-stage residual (at
    ``start_of(comm, step, group, codec)``), as one flat vector in tensor order (gathered with
    the engine's allgather)."""
    size = comm.size
    total = torch.zeros(sum(torch.Size(s).numel() for s in SHAPES))
    starts = [0]
    for s in SHAPES:
        starts.append(starts[-1] + torch.Size(s).numel())
    exchange = step.exchange
    for group, codec in zip(step.groups, step.plan.codec_names()):
        mine = torch.zeros(group.numel)
        first = exchange.memory.state.get(group.name, {})
        field = first.get("residual", first.get("velocity"))
        if field is not None:
            mine += field / size
        second = exchange.schemes["two-phase"].memory.state.get(group.name, {})
        if "residual" in second:
            a = start_of(comm, step, group, codec)
            mine[a:a + second["residual"].numel()] += second["residual"]
        if "carry" in second:
            mine += second["carry"] / size
        summed = comm.allgather(mine).sum(0)
        for i, offset, n in zip(group.indices, group.offsets, group.numels()):
            total[starts[i]:starts[i] + n] = summed[offset:offset + n]
    return total


def mean_grads(size, steps):
    return sum(torch.cat([g.reshape(-1) for g in grads(r, s)]) for r in range(size) for s in steps) / size


def _worker(rank):
    import mergecomp.torch as mc

    comm = mc.communicator()
    size = comm.size
    out = {}
    # two-phase with the exact codec is the plain average (integer-valued gradients: exact sums)
    out["none"] = [torch.equal(a, b) for a, b in zip(
        run(make_step(comm, "none", "two-phase"), rank, range(2), integers=True),
        run(make_step(comm, "none", "compressed"), rank, range(2), integers=True))]
    for name in ALLGATHERED:
        torch.manual_seed(rank)  # the stochastic codecs draw on each rank
        step = make_step(comm, name, "two-phase")
        rows = comm.allgather(torch.cat(run(step, rank, range(STEPS))))
        out[name] = {"identical": bool((rows == rows[0]).all()),
                     "second_stage": sorted({f for fields in step.exchange.schemes["two-phase"].memory.state.values()
                                             for f in fields})}
        if name in CONSERVING:
            # what was applied plus every residual of both stages is the sum of the mean gradients
            step = make_step(comm, name, "two-phase", memory="residual")
            applied = sum(run(step, rank, range(STEPS)))
            out[name]["gap"] = (applied + residual_total(comm, step)
                                - mean_grads(size, range(STEPS))).abs().max().item()
    # packed codes whose shards must start at whole bytes or buckets: 4-bit QSGD with odd
    # buckets, TernGrad five codes to a byte (base 3)
    for key, compressor in (("qsgd4", mergecomp.get_compressor("qsgd", levels=7, bucket_size=7)),
                            ("terngrad_base3", mergecomp.get_compressor("terngrad", packing="base3"))):
        torch.manual_seed(rank)
        step = make_step(comm, compressor, "two-phase", memory="residual")
        applied = run(step, rank, range(STEPS))
        rows = comm.allgather(torch.cat(applied))
        out[key] = {"identical": bool((rows == rows[0]).all()),
                    "gap": (sum(applied) + residual_total(comm, step)
                            - mean_grads(size, range(STEPS))).abs().max().item()}
    # majority votes: the vote travels exactly, so both schemes give the same result
    for name in ("signsgd", "signum"):
        out[f"{name}_votes"] = [torch.equal(a, b) for a, b in zip(
            run(make_step(comm, name, "two-phase"), rank, range(3)),
            run(make_step(comm, name, "compressed"), rank, range(3)))]
    # checkpoint and resume: bit-exact
    torch.manual_seed(7)
    saved = make_step(comm, "efsignsgd", "two-phase")
    run(saved, rank, range(2))
    state = saved.state_dict()
    cont = run(saved, rank, range(2, 4))
    resumed = make_step(comm, "efsignsgd", "two-phase")
    resumed.load_state_dict(state)
    out["resume"] = [torch.equal(a, b) for a, b in zip(cont, run(resumed, rank, range(2, 4)))]
    # plan switches between schemes and cuts keep every residual (conservation across them)
    from mergecomp.exchange.plan import GroupPlan

    step = make_step(comm, "topk", "two-phase")
    applied = sum(run(step, rank, range(2)))
    step.set_plan(GroupPlan(((4, 3, 2), (1, 0)), ("compressed", "two-phase")))
    applied += sum(run(step, rank, range(2, 4)))
    step.set_plan(GroupPlan(((4,), (3, 2, 1, 0)), ("two-phase", "compressed")))
    applied += sum(run(step, rank, range(4, 6)))
    out["switch_gap"] = (applied + residual_total(comm, step) - mean_grads(size, range(6))).abs().max().item()
    # the averaged memory under two-phase, through a plan change that moves its errors
    for name in ("topk", "efsignsgd"):
        step = make_step(comm, name, "two-phase", memory="averaged")
        applied = run(step, rank, range(3))
        step.set_plan(GroupPlan(((4, 3, 2), (1, 0)), ("compressed", "two-phase")))
        applied += run(step, rank, range(3, 5))
        rows = comm.allgather(torch.cat(applied))
        out[f"{name}_averaged"] = {"identical": bool((rows == rows[0]).all()),
                                   "errors": sum(len(f) for f in step.exchange.memory.state.values())}
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request):
    return run_workers(_worker, request.param)


def test_two_phase_with_the_exact_codec_is_the_plain_average(results):
    for out in results:
        assert out["none"] == [True, True]


@pytest.mark.parametrize("name", ALLGATHERED)
def test_every_allgathered_compressor_gives_identical_results_and_conserves_the_gradient(results, name):
    for out in results:
        assert out[name]["identical"]
        if name in CONSERVING:
            assert out[name]["gap"] < 1e-4, out[name]
    memory = mergecomp.get_compressor(name).default_memory
    # a second-stage residual exactly where the first stage feeds back and the codec is lossy
    assert results[0][name]["second_stage"] == (["residual"] if memory != "none" else [])


@pytest.mark.parametrize("key", ["qsgd4", "terngrad_base3"])
def test_packed_shards_are_identical_and_conserve(results, key):
    """Shards start at whole packed bytes (4-bit QSGD's odd buckets, base-3 TernGrad's five
    codes): ranks agree and nothing is lost."""
    for out in results:
        assert out[key]["identical"] and out[key]["gap"] < 1e-4, out[key]


def test_majority_vote_is_the_same_in_both_schemes(results):
    for out in results:
        assert out["signsgd_votes"] == [True] * 3
        assert out["signum_votes"] == [True] * 3


def test_checkpoint_resume_is_bit_exact(results):
    for out in results:
        assert out["resume"] == [True, True]


def test_the_averaged_memory_keeps_the_ranks_identical_through_two_phase_and_a_plan_change(results):
    for out in results:
        for name in ("topk", "efsignsgd"):
            assert out[f"{name}_averaged"]["identical"] and out[f"{name}_averaged"]["errors"] > 0, name


def test_plan_switches_between_schemes_keep_the_residuals(results):
    for out in results:
        assert out["switch_gap"] < 1e-4


# -- the front ends' scheme option -------------------------------------------------------------
def _front_end_worker(rank, world):
    from test_ddp_hook import ddp
    from test_optimizer_dist import flat_params, make_data, make_model, shard, train

    import mergecomp.torch as mc

    x, y = make_data()
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    out = {}
    for name in ALLGATHERED:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05 if name in ("signsgd", "signum", "efsignsgd") else 0.2)
        opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=name, groups=2, scheme="two-phase")
        train(model, opt, xs, ys, steps=40)
        out[name] = (flat_params(model), torch.nn.functional.cross_entropy(model(x), y).item())
    model = make_model()
    wrapped, _ = ddp(model, "topk", scheme="two-phase")
    train(wrapped, torch.optim.SGD(model.parameters(), lr=0.2), xs, ys, steps=40)
    out["ddp topk"] = (flat_params(model), torch.nn.functional.cross_entropy(model(x), y).item())
    errors = []
    for options in ({"scheme": "ring"}, {"compression": "powersgd", "scheme": "two-phase"},
                    {"compression": "acpsgd", "scheme": "two-phase"}):
        try:
            mc.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), **options)
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    return out


def test_front_ends_train_with_two_phase_on_three_ranks():
    from test_optimizer_dist import make_data, make_model

    results = run_workers(_front_end_worker, 3, 3, timeout=300)
    x, y = make_data()
    initial = torch.nn.functional.cross_entropy(make_model()(x), y).item()
    for name in [*ALLGATHERED, "ddp topk"]:
        params, loss = results[0][name]
        assert all(torch.equal(params, out[name][0]) for out in results[1:]), f"{name}: ranks diverged"
        assert loss < 0.9 * initial, f"{name}: loss {initial:.3f} -> {loss:.3f}"
    ring, powersgd, acpsgd = results[0]["errors"]
    assert "scheme must be one of" in ring and "'ring'" in ring
    assert "powersgd" in powersgd and "rounds" in powersgd
    assert "acpsgd" in acpsgd and "whole matrices" in acpsgd
