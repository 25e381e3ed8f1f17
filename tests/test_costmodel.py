"""The step-time predictor and the partition search (plain functions, no processes)."""
import itertools

import pytest

from mergecomp.scheduler.costmodel import (TIE, Affine, Cluster, CodecCost, CodecFit, Profile, all_to_all,
                                           candidate_cuts, cpu_taken, fit_affine, fit_span, flat_cost,
                                           hierarchical_cost, predict, ring_allgather, ring_allreduce, search,
                                           two_phase_cost)

FREE = Affine()


def profile(sizes, ready, **codecs):
    return Profile(list(sizes), list(ready), codecs)


def test_timeline_by_hand():
    # Two tensors ready at 0 s and 1 s; network 1 s per 1000 bytes plus 0.5 s per collective.
    net = CodecCost(1.0, FREE, Affine(0.1, 0.0), Affine(0.5, 1e-3))
    p = profile([1000, 1000], [0.0, 1.0], none=net)
    two = predict(p, [1], ["none", "none"])
    # g0: sent 0 -> 1.5; g1: ready 1, network free at 1.5 -> 3.0.
    # Decodes start after backward (1.0), in order: g0 1.5 -> 1.6, g1 3.0 -> 3.1.
    assert two.groups[0]["network_end"] == pytest.approx(1.5)
    assert two.groups[1]["network_end"] == pytest.approx(3.0)
    assert two.total == pytest.approx(3.1)
    one = predict(p, [], ["none"])
    assert one.total == pytest.approx(1.0 + 2.5 + 0.1)


def test_encode_time_delays_later_gradients():
    slow_encode = CodecCost(0.5, Affine(1.0, 0.0), FREE, FREE)
    p = profile([10, 10], [0.0, 0.5], c=slow_encode)
    layerwise = predict(p, [1], ["c", "c"])
    assert layerwise.groups[1]["ready"] == pytest.approx(0.5 + 1.0)  # g0's encode delays g1's grad
    assert layerwise.backward_end == pytest.approx(0.5 + 2.0)       # both encodes on the compute thread
    assert layerwise.encode == pytest.approx(2.0)


def test_collective_cpu_delays_the_backward_pass_it_overlaps():
    # 1 s of network and 0.4 s of this process's CPU per 1000 bytes sent uncompressed.
    net = CodecCost(1.0, FREE, FREE, Affine(0.0, 1e-3), network_cpu=Affine(0.0, 4e-4))
    p = profile([1000, 1000], [0.0, 1.0], none=net)
    two = predict(p, [1], ["none", "none"])
    # g0 runs 0 -> 1 s, all of it beside the backward pass: its 0.4 s of CPU push g1 to 1.4 s;
    # g1 starts when the backward pass is over and takes nothing from it.
    assert two.groups[0]["network_cpu_taken"] == pytest.approx(0.4)
    assert two.groups[1]["ready"] == pytest.approx(1.4)
    assert two.groups[1]["network_cpu_taken"] == 0.0
    assert two.backward_end == pytest.approx(1.4)
    assert two.total == pytest.approx(2.4)
    free = profile([1000, 1000], [0.0, 1.0], none=CodecCost(1.0, FREE, FREE, Affine(0.0, 1e-3)))
    assert predict(free, [1], ["none", "none"]).total == pytest.approx(2.0)
    assert predict(p, [], ["none"]).total == pytest.approx(3.0)  # sent after the backward pass
    # in proportion to the overlap: half of a 2 s collective overlaps 1 s of compute left
    assert cpu_taken(0.4, 0.0, 2.0, 1.0) == pytest.approx(0.2)
    assert cpu_taken(0.4, 1.0, 2.0, 1.0) == 0.0


def _brute_force(p, max_groups, codecs):
    n = len(p.sizes)
    best = None
    for k in range(1, max_groups + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            for assignment in itertools.product(codecs, repeat=k):
                total = predict(p, cuts, assignment).total
                if best is None or total < best[0]:
                    best = (total, cuts, assignment)
    return best


@pytest.mark.parametrize("bandwidth", [1e8, 1e9, 1e10])
def test_search_finds_the_brute_force_optimum(bandwidth):
    sizes = [4_000_000, 100, 2_000_000, 300, 8_000_000, 1_000_000, 50, 6_000_000]
    ready = [0.002 * i for i in range(len(sizes))]
    net = ring_allreduce(1e-4, bandwidth, 4)
    gather = ring_allgather(1e-4, bandwidth, 4)
    cpu = Affine(1e-5, 0.3 / bandwidth)  # the search's fast path charges collective CPU like predict
    p = profile(sizes, ready,
                none=CodecCost(1.0, FREE, FREE, net, cpu),
                fp16=CodecCost(0.5, Affine(1e-5, 2e-11), Affine(1e-5, 2e-11), net, cpu),
                compressed=CodecCost(0.02, Affine(2e-4, 5e-10), Affine(1e-4, 3e-10), gather))
    expected_total, _, _ = _brute_force(p, 3, ("none", "fp16", "compressed"))
    found = search(p, max_groups=3, grid_points=len(sizes))[0]
    # plans within TIE count as equally fast (the search then prefers gradients sent soon)
    assert expected_total <= found.total <= expected_total * (1 + TIE) + 1e-12


def test_search_fast_path_agrees_with_predict():
    from mergecomp.scheduler.costmodel import _total

    sizes = [4_000_000, 100, 2_000_000, 300, 8_000_000]
    ready = [0.003 * i for i in range(len(sizes))]
    codecs = dict(none=CodecCost(1.0, FREE, Affine(1e-4, 1e-10), ring_allreduce(1e-4, 1e9, 4), Affine(1e-4, 1e-9)),
                  compressed=CodecCost(0.05, Affine(2e-4, 5e-10), Affine(1e-4, 3e-10), ring_allgather(1e-4, 1e9, 4)))
    p = profile(sizes, ready, **codecs)
    prefix = [0, *itertools.accumulate(sizes)]
    for k in (1, 2, 3):
        for cuts in itertools.combinations(range(1, len(sizes)), k - 1):
            for assignment in itertools.product(codecs, repeat=k):
                fast = _total(prefix, ready, [codecs[c] for c in assignment], (0, *cuts, len(sizes)))
                assert fast == pytest.approx(predict(p, cuts, assignment).total, rel=1e-12)


def test_equal_predictions_prefer_gradients_sent_soon():
    """A network hidden behind compute makes every cut predict the same step time; the search
    then keeps the plan whose gradients wait least for their group (balanced groups here)."""
    sizes = [1000] * 8
    ready = [0.1 * i for i in range(len(sizes))]
    cheap = CodecCost(0.03, FREE, Affine(0.0, 1e-6), Affine(1e-4, 1e-9))
    p = profile(sizes, ready, compressed=cheap)
    totals = {predict(p, cuts, ["compressed"] * 3).total
              for cuts in itertools.combinations(range(1, 8), 2)}
    assert max(totals) - min(totals) < 1e-9  # the model cannot tell the cuts apart
    best = search(p, max_groups=3, codecs=("compressed",), top=3, grid_points=8)
    three = next(plan for plan in best if len(plan.cuts) == 2)
    lengths = [b - a for a, b in zip((0, *three.cuts), (*three.cuts, 8))]
    assert max(lengths) - min(lengths) <= 1, three.cuts


def test_prediction_is_monotone_in_bandwidth_and_latency():
    sizes = [1_000_000] * 6
    ready = [0.01 * i for i in range(6)]
    totals = []
    for bandwidth in (1e8, 1e9, 1e10, 1e11):
        p = profile(sizes, ready, none=CodecCost(1.0, FREE, FREE, ring_allreduce(1e-4, bandwidth, 8)))
        totals.append(predict(p, [2, 4], ["none"] * 3).total)
    assert totals == sorted(totals, reverse=True)
    slower = [predict(profile(sizes, ready, none=CodecCost(1.0, FREE, FREE, ring_allreduce(lat, 1e9, 8))),
                      [3], ["none"] * 2).total for lat in (1e-5, 1e-4, 1e-3)]
    assert slower == sorted(slower)


def test_compression_pays_on_a_slow_link_and_not_on_a_fast_one():
    sizes = [4_000_000] * 25            # 100 MB of gradients
    ready = [0.004 * i for i in range(25)]

    def compressed_share(bandwidth):
        net = ring_allreduce(5e-5, bandwidth, 2)
        p = profile(sizes, ready,
                    none=CodecCost(1.0, FREE, FREE, net),
                    compressed=CodecCost(1 / 32, Affine(1e-4, 1e-9), Affine(1e-4, 1e-9), net))
        best = search(p, max_groups=4, codecs=("none", "compressed"))[0]
        return sum(g["bytes"] for g, c in zip(best.groups, best.codecs) if c == "compressed") / sum(sizes)

    assert compressed_share(1.25e8) > 0.5    # 1 Gbit/s: most bytes compressed
    assert compressed_share(1.25e11) == 0.0  # 1 Tbit/s: plain allreduce


def test_fit_affine_recovers_a_line():
    fit = fit_affine([1e3, 1e5, 1e7], [0.001 + 2e-9 * x for x in (1e3, 1e5, 1e7)])
    assert fit.fixed == pytest.approx(0.001)
    assert fit.per_byte == pytest.approx(2e-9)
    assert fit_affine([100], [1.0]).per_byte == pytest.approx(0.01)


def test_fit_span_keeps_the_per_call_cost_of_the_smallest_sample():
    nbytes = [3e3, 4e7, 1.3e8, 5e8]
    seconds = [1e-4 + 3e-10 * x for x in nbytes]
    assert fit_span(nbytes, seconds).fixed == pytest.approx(1e-4)
    assert fit_span(nbytes, seconds).per_byte == pytest.approx(3e-10)
    seconds[-1] -= 0.05  # one noisy run of the largest sample
    assert fit_span(nbytes, seconds).fixed == pytest.approx(1e-4, rel=0.01)
    assert fit_affine(nbytes, seconds).fixed > 1e-3  # a least-squares intercept: 50 times too large
    assert fit_span([10], [1.0]).per_byte == pytest.approx(0.1)


def test_ring_costs_follow_the_alpha_beta_model():
    assert ring_allreduce(1e-3, 1e9, 4)(4e9) == pytest.approx(6e-3 + 6.0)
    assert ring_allgather(1e-3, 1e9, 4)(1e9) == pytest.approx(3e-3 + 3.0)   # grows with N
    assert ring_allreduce(1e-3, 1e9, 1)(1e9) == 0.0


def test_all_to_all_follows_the_alpha_beta_model_and_shares_the_host_link():
    assert all_to_all(1e-3, 1e9, 4)(4e9) == pytest.approx(3e-3 + 3.0)       # (N-1)/N·B/β
    # 4 ranks per host: the host's link carries 4 · 12/16 · B, not 15/16 · B
    assert all_to_all(1e-3, 1e9, 16, 4)(1.6e9) == pytest.approx(15e-3 + 4.8)
    assert all_to_all(0.0, 1e9, 4, 4, intra_bandwidth=1e10)(4e9) == pytest.approx(0.3)  # one host
    assert all_to_all(1e-3, 1e9, 1)(1e9) == 0.0
    with pytest.raises(ValueError, match="does not divide"):
        Cluster(12, 0.0, 1e9, 8)


#: a non-summable codec of 1/32 the bytes, with per-call and per-byte costs
FIT = CodecFit(1 / 32, Affine(1e-4, 1e-10), Affine(1e-4, 1e-10), Affine(5e-5, 1e-10))


@pytest.mark.parametrize("world_size", [4, 16, 64, 256, 1024])
def test_two_phase_bytes_per_rank_are_flat_in_n_while_allgather_grows(world_size):
    bandwidth = 1e9
    cluster = Cluster(world_size, 0.0, bandwidth)
    free = CodecFit(FIT.ratio, FREE, FREE)  # the network alone
    per_rank = two_phase_cost(free, cluster).network.per_byte
    assert per_rank * bandwidth == pytest.approx(2 * (world_size - 1) / world_size)  # 2(N-1)/N of the payload
    assert per_rank * bandwidth < 2.0
    gathered = flat_cost(free, cluster).network.per_byte * bandwidth
    assert gathered == pytest.approx(world_size - 1)
    if world_size >= 16:  # within 10 % of 2 payloads from 16 ranks on (1.5 at N=4)
        assert per_rank * bandwidth == pytest.approx(2.0, rel=0.1)


def test_two_phase_costs_by_hand():
    fit = CodecFit(0.25, Affine(1e-3, 1e-9), Affine(2e-3, 2e-9), Affine(5e-4, 1e-9))
    cost = two_phase_cost(fit, Cluster(4, 0.0, 1e9))
    group, payload = 4e8, 1e8
    # middle stage on 1/4 of the group: decode 4 payloads (2 ms + 3 · 0.5 ms + 5e-9 · 1e8),
    # encode (1 ms + 0.1 s), decode the re-encoded shard for the residual (2 ms + 0.2 s)
    middle = 3.5e-3 + 0.5 + 0.101 + 0.202
    assert cost.network_cpu(payload) == pytest.approx(middle)
    # all-to-all 3/4 · 1e8 B and allgather of 3 shards of 2.5e7 B at 1e9 B/s, plus the middle
    assert cost.network(payload) == pytest.approx(0.075 + 0.075 + middle)
    assert cost.encode(group) == pytest.approx(0.401)
    assert cost.decode(group) == pytest.approx(4 * 2e-3 + 0.8)  # 4 shards: 4 calls, the group's bytes
    votes = two_phase_cost(CodecFit(0.25, FREE, FREE, second_ratio=2.0), Cluster(4, 0.0, 1e9))
    assert votes.network(payload) == pytest.approx(0.075 + 2 * 0.075)  # 2-bit codes of 1-bit signs


def _compressed_vs_two_phase(world_size):
    sizes = [4_000_000] * 25
    ready = [0.004 * i for i in range(25)]
    cluster = Cluster(world_size, 5e-5, 1.25e9)
    p = profile(sizes, ready, compressed=flat_cost(FIT, cluster), two=two_phase_cost(FIT, cluster))
    return search(p, 4, ("compressed",), top=1)[0].total, search(p, 4, ("two",), top=1)[0].total


def test_two_phase_wins_over_allgather_at_scale_and_not_with_two_ranks():
    gathered, two_phase = _compressed_vs_two_phase(2)
    assert gathered < two_phase
    gathered, two_phase = _compressed_vs_two_phase(512)
    assert two_phase < gathered / 10


@pytest.mark.parametrize("across", [flat_cost, two_phase_cost])
def test_hierarchical_with_one_rank_per_host_is_flat(across):
    cluster = Cluster(64, 5e-5, 1.25e9, 1, 5e-6, 1.25e10)
    assert hierarchical_cost(FIT, cluster, across) == across(FIT, cluster)


def test_hierarchical_costs_by_hand():
    fit = CodecFit(0.25, Affine(1e-3, 1e-9), Affine(2e-3, 2e-9), Affine(5e-4, 1e-9))
    cost = hierarchical_cost(fit, Cluster(16, 1e-4, 1e9, 4, 1e-5, 1e10))
    group, payload = 4e8, 1e8
    # reduce-scatter + allgather of the fp32 group inside the host: 6 steps, 2 · 3/4 · 4e8 B at 1e10;
    # allgather of 2.5e7-byte shards among 4 hosts, 4 of them sharing each host's link
    inside = 6e-5 + 0.06
    across = 3e-4 + 3 * 2.5e7 / (1e9 / 4)
    assert cost.network(payload) == pytest.approx(inside + across)
    assert cost.encode(group) == pytest.approx(1e-3 + 0.1)                   # the 1/4 shard
    assert cost.decode(group) == pytest.approx(2e-3 + 3 * 5e-4 + 5e-9 * 1e8)  # 4 hosts' shards


def test_two_level_allreduce_by_hand():
    flat = Cluster(64, 1e-4, 1e9, 8, 1e-5, 1e10)
    two_level = Cluster(64, 1e-4, 1e9, 8, 1e-5, 1e10, two_level=True)
    assert flat.allreduce()(6.4e9) == pytest.approx(126e-4 + 2 * 63 / 64 * 6.4)
    # inside: 14 steps, 2 · 7/8 · B at 1e10; across: 8 rings of B/8 among 8 hosts on 1/8 of the link
    assert two_level.allreduce()(6.4e9) == pytest.approx(14e-5 + 1.12 + 14e-4 + 2 * 7 / 8 * 6.4)
    assert Cluster(64, 1e-4, 1e9, two_level=True).allreduce() == Cluster(64, 1e-4, 1e9).allreduce()


def test_candidate_grid_and_bad_input():
    grid = candidate_cuts([1] * 100, points=9)
    assert len(grid) == 9 and grid == sorted(grid) and 0 < grid[0] and grid[-1] < 100
    with pytest.raises(ValueError, match="max_groups"):
        search(profile([1], [0.0], none=CodecCost(1.0, FREE, FREE, FREE)), max_groups=0)
    with pytest.raises(ValueError, match="codecs"):
        search(profile([1], [0.0], none=CodecCost(1.0, FREE, FREE, FREE)), codecs=("fp16",))


def test_rehearse_times_warm_runs_of_the_exchange_and_leaves_the_compressor_as_it_was():
    import torch

    import mergecomp
    from mergecomp.kernels.workspace import Workspace
    from mergecomp.scheduler.probes import Call, rehearse

    compressor = mergecomp.get_compressor("topk")
    pool = Workspace()
    compressor.workspace = pool
    shapes = [torch.Size([1000]), torch.Size([100_000])]
    run = rehearse(compressor, None, "compressed", [(4000, 1), (404_000, 2)], shapes, torch.float32,
                   torch.device("cpu"), 2)
    assert len(run.encode) == len(run.middle) == len(run.decode) == 2 and min(run.encode + run.decode) > 0
    assert 0 < run.ratio < 0.1  # top-k keeps 1 %: values and indices
    # one allgather of the packed payload per size: what the exchange sends for a group of top-k
    assert [[(c.level, c.op, c.dtype) for c in calls] for calls in run.calls] == [[("world", "allgather", torch.uint8)]] * 2
    assert isinstance(run.calls[0][0], Call) and run.calls[1][0].nbytes == run.ratio * 404_000
    # The probe used a private pool and cleaned up after itself.
    assert compressor.workspace is pool and pool.step == 0
    assert "__scheduler_probe__" not in compressor.state


def test_rehearse_takes_the_fused_encode_as_the_exchange_does(monkeypatch):
    import torch

    import mergecomp
    from mergecomp.compressors.memories import ResidualMemory
    from mergecomp.kernels import native
    from mergecomp.scheduler.probes import rehearse

    if not native.usable(torch.zeros(1)):
        pytest.skip("native kernels unavailable")
    monkeypatch.setattr(ResidualMemory, "update", None)  # the fused encode's update stands in for it
    memory = mergecomp.get_memory("residual")
    run = rehearse(mergecomp.get_compressor("onebit"), memory, "compressed", [(4000, 1)], [torch.Size([1000])],
                   torch.float32, torch.device("cpu"), 2)
    assert min(run.encode + run.decode) > 0 and "__scheduler_probe__" not in memory.state


@pytest.mark.parametrize("codec, per_host, calls", [
    ("two-phase", 1, [("world", "alltoall", "uint8"), ("world", "allgather", "uint8")]),
    ("hierarchical", 2, [("local", "alltoall", "float32"), ("cross", "allgather", "uint8"),
                         ("local", "allgather", "float32")]),
    ("hierarchical-two-phase", 2, [("local", "alltoall", "float32"), ("cross", "alltoall", "uint8"),
                                   ("cross", "allgather", "uint8"), ("local", "allgather", "float32")]),
    ("hierarchical", 1, [("world", "allgather", "uint8")]),  # one process per host: the flat scheme
])
def test_rehearse_records_the_collectives_of_each_scheme_in_their_order(codec, per_host, calls):
    """A group of a scheme that does not apply on this layout goes by its fallback, as the
    exchange sends it."""
    import torch

    import mergecomp
    from mergecomp.scheduler.probes import rehearse

    world = 6 if codec == "hierarchical-two-phase" else 4 if per_host == 2 else 3
    run = rehearse(mergecomp.get_compressor("qsgd"), mergecomp.get_memory("residual"), codec, [(40_000, 1)],
                   [torch.Size([10_000])], torch.float32, torch.device("cpu"), world, per_host)
    assert [(c.level, c.op, str(c.dtype).removeprefix("torch.")) for c in run.calls[0]] == calls


def test_measurements_travel_as_one_tensor_and_agree_on_the_slowest_rank():
    import torch

    from mergecomp.engines.communicator import LocalCommunicator
    from mergecomp.scheduler.probes import CodecProbe, Measurements

    def record(scale):
        return Measurements([0.0, 0.3 * scale, 0.2], {
            "compressed": CodecProbe(0.25, [1e-3 * scale, 4e-3], [2e-3, 5e-3], [1e-2, 3e-2], [1e-3, 2e-3]),
            "none": CodecProbe(1.0, [0.0, 0.0], [0.0, 0.0], [2e-2, 9e-2 * scale], [2e-3, 4e-3])}, 0.5 * scale)

    mine, theirs = record(1.0), record(2.0)
    flat = mine.to_tensor(torch.device("cpu"))
    assert flat.dtype == torch.float64 and mine.from_tensor(flat) == mine
    with pytest.raises(ValueError, match="numbers"):
        mine.from_tensor(flat[1:])

    class TwoRanks(LocalCommunicator):  # rank 0 of 2; rank 1 measured ``theirs``
        def allgather(self, tensor, what="allgather"):
            return torch.stack([tensor, theirs.to_tensor(tensor.device)])

    agreed = mine.agree(TwoRanks(), torch.device("cpu"))
    assert agreed == theirs
    profile = agreed.cost_profile([100, 200, 300], [1000, 4000])
    assert profile.ready == [0.0, 0.6, 0.6]  # gradients become ready in backward order
    assert profile.sizes == [100, 200, 300] and list(profile.codecs) == ["compressed", "none"]
    cost = profile.codecs["compressed"]
    assert cost.ratio == 0.25 and cost.network(250) == pytest.approx(1e-2)  # fitted over payload bytes
