"""groups="auto" on real processes: convergence, agreement, exactness across switches,
error-feedback state across switches, plan cache."""
import logging

import pytest
import torch
from distributed import run_workers
from test_optimizer_dist import flat_params, make_data, make_model, shard

from mergecomp.scheduler.online import SchedulerConfig

FAST = dict(warmup_steps=2, settle_steps=1, probe_steps=2, retune_window=1000)


def _auto_worker(rank, world, compression, steps, cache_path=None, slow_after=None, window=None, prune_ratio=2.0):
    import time

    import mergecomp.torch as mc

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("mergecomp").addHandler(handler)
    logging.getLogger("mergecomp").setLevel(logging.INFO)

    x, y = make_data()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=compression, groups="auto",
                                  scheduler=SchedulerConfig(**{**FAST, "retune_window": window or 1000},
                                                            cache_path=cache_path, prune_ratio=prune_ratio),
                                  exchange_momentum_after=None)  # the gradients' search from the first step
    plans, slowdown = [], 0.05
    for step in range(steps):
        if slow_after is not None and step >= slow_after:
            if step == slow_after:  # past the retune's margin whatever the chosen plan measured under load
                chosen = opt.schedule_report()["chosen"] or {}
                slowdown = max(slowdown, 2 * (chosen.get("measured_s") or 0.0))
            time.sleep(slowdown)  # the "network" got slower
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank, world)), shard(y, rank, world))
        opt.zero_grad()
        loss.backward()
        opt.step()
        plans.append(opt.plan)
    reference = make_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(reference(x), y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    profile = opt.scheduler.profile if opt.scheduler else None
    return {"report": opt.schedule_report(), "plans": plans, "params": flat_params(model),
            "profiled": None if profile is None else (len(profile.sizes), sorted(profile.codecs)),
            "ratios": None if profile is None else {name: cost.ratio for name, cost in profile.codecs.items()},
            "diff": (flat_params(model) - flat_params(reference)).abs().max().item(), "log": messages}


def test_auto_converges_agrees_and_stays_exact_across_switches():
    r0, r1 = run_workers(_auto_worker, 2, 2, "none", 30)
    report = r0["report"]
    assert report["phase"] == "monitor"
    assert report["search_steps"] <= 30
    assert len(report["candidates"]) >= 2
    # Every candidate predicted; each measured unless predicted over prune_ratio x the fastest
    # prediction (which of them is the timings' call: a loaded machine spreads the predictions).
    assert all(c["predicted_s"] is not None for c in report["candidates"])
    fastest = min(c["predicted_s"] for c in report["candidates"])
    assert all(c["measured_s"] is not None or c["predicted_s"] > fastest * SchedulerConfig().prune_ratio
               for c in report["candidates"])
    # Every rank ran the same plan at every step, and the plan did change during the search.
    assert r0["plans"] == r1["plans"]
    assert len(set(r0["plans"])) > 1
    assert r0["report"]["chosen"] == r1["report"]["chosen"]
    # compression="none" stays exact through every switch.
    assert r0["diff"] < 1e-5 and r1["diff"] < 1e-5
    assert any("chose a" in m for m in r0["log"])
    # The cost model's inputs stay readable after the search: one entry per parameter.
    assert r0["profiled"] == (len(r0["plans"][-1].order), ["compressed"])


def test_auto_on_three_ranks_searches_the_two_phase_scheme_and_agrees():
    results = run_workers(_auto_worker, 3, 3, "qsgd", 40, None, None, None, 1e9)  # every candidate measured
    r0 = results[0]
    assert all(r["plans"] == r0["plans"] and torch.equal(r["params"], r0["params"]) for r in results[1:])
    assert r0["report"]["phase"] == "monitor"
    assert "two-phase" in r0["profiled"][1]
    # the best plan sending the compressor by each scheme alone is verified
    verified = [set(c["codecs"]) for c in r0["report"]["candidates"] if c["measured_s"] is not None]
    assert {"compressed"} in verified and {"two-phase"} in verified


def test_auto_on_two_hosts_of_two_searches_the_hierarchical_scheme_and_agrees():
    results = run_workers(_auto_worker, 4, 4, "qsgd", 30, env={"LOCAL_WORLD_SIZE": "2"}, timeout=600)
    r0 = results[0]
    assert all(r["plans"] == r0["plans"] and torch.equal(r["params"], r0["params"]) for r in results[1:])
    assert r0["report"]["phase"] == "monitor"
    assert r0["profiled"][1] == ["compressed", "fp16", "hierarchical", "none", "two-phase"]
    # across hosts, the hierarchical probe sends this local rank's shard of each group (whole
    # QSGD buckets, so at least half) compressed: less than the whole group's compressed bytes
    ratios = r0["ratios"]
    assert ratios["compressed"] / 2 <= ratios["hierarchical"] < ratios["compressed"] < 0.3
    assert r0["diff"] < 0.5  # it trains: close to the single-process reference


def _scheme_codecs(rank):
    import mergecomp
    from mergecomp.scheduler.online import SEARCHED, searched_codecs

    get = mergecomp.get_compressor
    return {"qsgd@2": searched_codecs(SEARCHED, get("qsgd"), 2), "qsgd@3": searched_codecs(SEARCHED, get("qsgd"), 3),
            "signsgd@4": searched_codecs(SEARCHED, get("signsgd"), 4),
            "fp16@4": searched_codecs(SEARCHED, get("fp16"), 4),
            "qsgd@4 allgather": searched_codecs(SEARCHED, get("qsgd"), 4, "allgather"),
            "topk@4 two-phase": searched_codecs(SEARCHED, get("topk"), 4, "two-phase"),
            **{f"topk@4 {scheme}": searched_codecs(SEARCHED, get("topk"), 4, scheme)
               for scheme in ("hierarchical", "hierarchical-two-phase")},
            **{f"qsgd@{n}/{per_host}": searched_codecs(SEARCHED, get("qsgd"), n, None, per_host)
               for n, per_host in ((4, 2), (6, 2), (8, 8))},
            "signsgd@6/2": searched_codecs(SEARCHED, get("signsgd"), 6, None, 2),
            "fp16@4/2": searched_codecs(SEARCHED, get("fp16"), 4, None, 2),
            "qsgd@4/2 allgather": searched_codecs(SEARCHED, get("qsgd"), 4, "allgather", 2)}


def test_which_codecs_the_search_offers():
    got = _scheme_codecs(0)
    assert got["qsgd@2"] == ("compressed", "fp16", "none")
    assert got["qsgd@3"] == ("compressed", "fp16", "none", "two-phase")
    assert got["signsgd@4"] == ("compressed", "two-phase")  # the vote: no fp16/none
    assert got["fp16@4"] == ("compressed", "fp16", "none")   # summable: allreduce already
    assert got["qsgd@4 allgather"] == ("compressed", "fp16", "none")
    assert got["topk@4 two-phase"] == ("two-phase", "fp16", "none")
    # a sharded scheme asked for takes every compressed group
    assert got["topk@4 hierarchical"] == ("hierarchical", "fp16", "none")
    assert got["topk@4 hierarchical-two-phase"] == ("hierarchical-two-phase", "fp16", "none")
    # several processes on several hosts: the hierarchical schemes too (two-phase across 3+ hosts)
    assert got["qsgd@4/2"] == ("compressed", "fp16", "none", "two-phase", "hierarchical")
    assert got["qsgd@6/2"] == ("compressed", "fp16", "none", "two-phase", "hierarchical", "hierarchical-two-phase")
    assert got["qsgd@8/8"] == ("compressed", "fp16", "none", "two-phase")  # one host
    assert got["signsgd@6/2"] == ("compressed", "two-phase", "hierarchical", "hierarchical-two-phase")
    assert got["fp16@4/2"] == ("compressed", "fp16", "none")
    assert got["qsgd@4/2 allgather"] == ("compressed", "fp16", "none")


def test_auto_with_a_compressor_keeps_ranks_identical():
    # no plan left unmeasured for its prediction (which the timings decide: a loaded machine
    # predicted the compressor's plans over 2x the fastest and pruned them)
    r0, r1 = run_workers(_auto_worker, 2, 2, "topk", 25, None, None, None, 1e9)  # prune_ratio
    assert r0["plans"] == r1["plans"]
    assert torch.equal(r0["params"], r1["params"])
    # The best plans using the compressor alone, at two group counts, are among the candidates and verified.
    verified = [c for c in r0["report"]["candidates"] if c["measured_s"] is not None]
    assert len({c["groups"] for c in verified if set(c["codecs"]) == {"compressed"}}) >= 2


def test_plan_cache_round_trip_and_foreign_entries(tmp_path):
    cache = str(tmp_path / "plans.json")
    first = run_workers(_auto_worker, 2, 2, "none", 26, cache)[0]
    chosen = first["report"]["chosen"]
    again = run_workers(_auto_worker, 2, 2, "none", 5, cache)[0]
    assert again["report"]["search_steps"] == 0
    assert again["plans"][-1] == first["plans"][-1]
    assert any("cached merge plan" in m for m in again["log"])
    assert chosen is not None
    # A different world size has a different signature: the entry is ignored, with a log line.
    single = run_workers(_auto_worker, 1, 1, "none", 3, cache)[0]
    assert any("no plan for this model" in m for m in single["log"])


def test_retunes_when_the_step_time_drifts_and_all_ranks_follow():
    r0, r1 = run_workers(_auto_worker, 2, 2, "none", 55, None, 30, 6)
    events = [h["event"] for h in r0["report"]["history"]]
    assert events[:2] == ["chosen", "retune"], r0["report"]["history"]
    assert r0["report"]["searches"] >= 2
    assert r0["plans"] == r1["plans"]
    assert r0["diff"] < 1e-5


def _switch_worker(rank):
    import mergecomp.torch as mc

    x, y = make_data()
    model = make_model()
    opt = mc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  compression="topk", memory="residual", groups=1)

    def residual_by_param():
        out = {}
        for group in opt.groups:
            residual = opt.memory.state[group.name]["residual"]
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                out[i] = residual[offset:offset + n].clone()
        return out

    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(shard(x, rank, 2)), shard(y, rank, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    before = residual_by_param()
    opt.set_plan("layerwise")
    after_layerwise = residual_by_param()
    opt.set_plan(3)
    after_three = residual_by_param()
    same = all(torch.equal(before[i], after_layerwise[i]) and torch.equal(before[i], after_three[i])
               for i in before)
    nonzero = sum(t.abs().sum().item() for t in before.values()) > 0
    return same, nonzero, len(opt.groups)


def test_switching_plans_carries_every_residual_over():
    for same, nonzero, groups in run_workers(_switch_worker, 2):
        assert same and nonzero and groups == 3


# Step seconds of candidates A, B, C (named in the order the search visits them): on their
# first visit, and on later ones.
SCRIPTS = {
    # A's first visit is slow (a transient); B is steady; C is far behind.
    "transient": {"A": (0.12, 0.10), "B": (0.11, 0.11), "C": (0.30, 0.30)},
    # The machine slows down during the run-off; C, out after the first pass, was never re-measured.
    "drift": {"A": (0.10, 0.13), "B": (0.105, 0.14), "C": (0.11, 0.11)},
}


def _scripted_worker(rank, runoff_rounds, runoff_margin, script="transient", prune_ratio=2.0):
    """Drive a MergeScheduler over the real process group with step times from SCRIPTS.
    Rank 1 runs 1 % slower, so agreement (max over ranks) is exercised too."""
    import mergecomp.torch as mc
    from mergecomp.exchange.plan import GroupPlan
    from mergecomp.registry import get_compressor
    from mergecomp.scheduler.online import MergeScheduler

    n = 8
    order = list(range(n))
    config = SchedulerConfig(warmup_steps=1, settle_steps=1, probe_steps=2, codecs=("compressed",),
                             runoff_rounds=runoff_rounds, runoff_margin=runoff_margin, retune_window=1000,
                             prune_ratio=prune_ratio)
    scheduler = MergeScheduler(mc.communicator(), get_compressor("none"), order,
                               [4096] * n, [torch.Size([1024])] * n, torch.float32, torch.device("cpu"),
                               lambda cuts, codecs: GroupPlan.from_cuts(order, cuts, codecs), "scripted", config)
    plan = GroupPlan.from_cuts(order, range(1, n))  # layer-wise: never a candidate (max_groups 4)
    labels, stretches, trace = {}, {}, []
    for _ in range(60):
        if scheduler.phase == "monitor":
            break
        seconds = 0.2
        if scheduler.phase == "verify":
            if plan not in labels:
                labels[plan] = "ABC"[len(labels)]
            label = labels[plan]
            if not trace or trace[-1] != label:
                stretches[label] = stretches.get(label, 0) + 1
            trace.append(label)
            first, later = SCRIPTS[script][label]
            seconds = first if stretches[label] == 1 else later
        switched = scheduler.observe(seconds * (1.01 if rank == 1 else 1.0), [0.0] * n, plan)
        plan = switched or plan
    report = scheduler.report()
    probes = {labels[c.plan]: c.probes for c in scheduler.candidates if c.plan in labels}
    return {"chosen": labels.get(scheduler.chosen.plan), "trace": "".join(trace), "probes": probes,
            "predicted": [(c.predicted, c.measured) for c in scheduler.candidates],
            "search_steps": report["search_steps"],
            "measured": {labels[c.plan]: c.measured for c in scheduler.candidates if c.plan in labels}}


def test_runoff_alternates_the_two_best_and_picks_on_all_their_probes():
    r0, r1 = run_workers(_scripted_worker, 2, 2, 0.15)
    assert r0["chosen"] == r1["chosen"] == "A"  # B looked faster after one visit each
    assert r0["trace"] == r1["trace"]
    # First pass A, B, C (settle + 2 probes each), then B A A B; a plan already installed
    # needs no settling step, so A's second visit adds 2 steps to its first.
    assert r0["trace"] == "AAABBBCCC" + "BBB" + "AAA" + "AA" + "BBB"
    assert [len(r0["probes"][k]) for k in "ABC"] == [6, 6, 2]
    assert r0["measured"]["A"] == pytest.approx(0.101)  # median of all six probes, max over ranks
    assert r0["search_steps"] == 1 + 1 + 9 + 11


def test_after_a_runoff_only_its_finalists_compete():
    r0, r1 = run_workers(_scripted_worker, 2, 2, 0.15, "drift")
    # C's single early visit (0.11 s) beats both finalists' medians (0.13, 0.14 s), but it lost
    # the first pass under the same conditions they had then.
    assert r0["chosen"] == r1["chosen"] == "A"
    assert r0["measured"]["C"] < r0["measured"]["A"]


def test_no_runoff_when_the_runner_up_is_clearly_slower():
    r0, _ = run_workers(_scripted_worker, 2, 2, 0.05)  # A's 0.12 s is 9 % behind B's 0.11 s
    assert r0["chosen"] == "B"
    assert r0["trace"] == "AAABBBCCC"
    r0, _ = run_workers(_scripted_worker, 2, 0, 0.15)  # run-off disabled
    assert r0["chosen"] == "B" and r0["trace"] == "AAABBBCCC"


def test_plans_predicted_far_slower_than_the_best_are_not_measured():
    r0, r1 = run_workers(_scripted_worker, 2, 2, 0.15, "transient", 1.0)
    fastest = min(predicted for predicted, _ in r0["predicted"])
    assert r0["predicted"] == r1["predicted"]  # every rank skips the same plans
    assert any(predicted > fastest for predicted, _ in r0["predicted"])
    for predicted, measured in r0["predicted"]:
        assert (measured is None) == (predicted > fastest)
    assert r0["chosen"] == r1["chosen"] is not None


class _Counted:
    """The engine's communicator, counting the allreduces started through it (they still run)."""

    def __init__(self, comm):
        self.comm, self.allreduces = comm, 0

    def allreduce_async(self, tensor):
        self.allreduces += 1
        return self.comm.allreduce_async(tensor)

    def __getattr__(self, name):
        return getattr(self.comm, name)


def _replay_worker(rank, budget):
    import mergecomp.torch as mc
    from mergecomp.scheduler.costmodel import fit_affine
    from mergecomp.scheduler.probes import Call, replay_within

    comm = _Counted(mc.communicator())
    numels = (1, 1 << 10, 1 << 14, 1 << 18)
    calls = [[Call("world", "allreduce", n, torch.float32)] for n in numels]
    timed = replay_within(comm, calls, torch.device("cpu"), budget)
    wall, cpu = (fit_affine([4.0 * n for n in numels[:2]], [t[i] for t in timed[:2]]) for i in (0, 1))
    fitted = [(wall(4.0 * n), cpu(4.0 * n)) for n in numels[2:]]
    return timed, comm.allreduces, timed[2:] == fitted


def test_a_profile_replays_what_fits_its_budget_and_predicts_the_rest():
    for budget, replayed in ((float("inf"), 4), (0.0, 2)):
        (timed, allreduces, predicted), (timed1, allreduces1, _) = run_workers(_replay_worker, 2, budget)
        assert timed == timed1 and len(timed) == 4  # the slowest rank's seconds, on every rank
        assert allreduces == allreduces1 == 2 * replayed  # each replayed size runs twice
        assert predicted == (replayed == 2)


def _exchange_probe_worker(rank, budget):
    import mergecomp.torch as mc
    from mergecomp.exchange.plan import WARMUP_QSGD4
    from mergecomp.registry import get_compressor
    from mergecomp.scheduler.probes import exchange_within

    comm = _Counted(mc.communicator())
    probed = {codec: exchange_within(comm, get_compressor("onebit"), codec, 1 << 16, torch.float32,
                                     torch.device("cpu"), budget) for codec in ("none", WARMUP_QSGD4)}
    return probed, comm.allreduces


def test_a_codec_probe_rehearses_its_work_and_replays_its_collectives_within_the_budget():
    """``exchange_within``: the same ``(own, collectives)`` seconds on every rank; the exact
    average's allreduce replayed (twice) at 1/64, 1/8 and all of the group, or, with no budget
    left, at the two small sizes only (the full one fitted); 4-bit QSGD goes by allgather."""
    for budget, replayed in ((float("inf"), 3), (0.0, 2)):
        (probed, allreduces), (probed1, allreduces1) = run_workers(_exchange_probe_worker, 2, budget)
        assert probed == probed1 and all(own > 0 and network > 0 for own, network in probed.values())
        assert allreduces == allreduces1 == 2 * replayed


@pytest.mark.parametrize("option, value", [("probe_budget", 0.0), ("prune_ratio", 0.5), ("probe_steps", 0)])
def test_scheduler_settings_out_of_range_are_refused_by_name(option, value):
    with pytest.raises(ValueError, match=option):
        SchedulerConfig(**{option: value})
