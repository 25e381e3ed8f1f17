"""Step-time model of merged, compressed gradient exchange, and the search over partitions.

Everything here is a plain function of plain numbers, shared by the online scheduler
(:mod:`mergecomp.scheduler.online`) and the offline planner (:mod:`mergecomp.scheduler.offline`, ``mergecomp plan``).

The timeline of one backward pass, for a partition of the tensors (in backward order) into
contiguous groups, each with a codec (``"compressed"``, ``"fp16"``, ``"none"``, or an exchange
scheme of the compressor such as ``"two-phase"``)::

    compute thread: grad ready ... [encode g0] ... grad ready ... [encode g1] ...   (encodes delay
                                                                                    later grads)
    network:                  [collective g0 ......]   [collective g1 ....]       (in plan order)
    after backward:                                  [decode g0]     [decode g1]  (in plan order)

* tensor ``i``'s gradient is ready ``ready[i]`` seconds after the first one, plus the encode
  time already spent on the compute thread;
* group ``g`` is encoded when its last gradient is ready and every earlier group was started
  (collectives start in plan order on every rank);
* the network runs one collective at a time: ``start = max(encoded, previous end)``;
* a collective also costs CPU on this process (the engine's threads copying, summing and
  moving bytes through sockets): the share of it that overlaps the rest of the backward pass
  delays that pass, as encoding does (:func:`cpu_taken`). With one core per worker this is
  part of why large uncompressed groups run slower than their network time alone says;
* decoding starts after the backward pass and the group's collective, in plan order.

Costs are affine fits ``a + b * bytes`` (:class:`Affine`): per codec for encode and decode
(input bytes), per collective kind for the network and its CPU (bytes one rank contributes).

Exchange schemes (:func:`flat_cost`, :func:`two_phase_cost`, :func:`hierarchical_cost`) turn a
compressor's measured costs (:class:`CodecFit`) into a :class:`CodecCost` on a :class:`Cluster`
under the α-β model.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from mergecomp.exchange.plan import CODECS

__all__ = [
    "Affine",
    "Cluster",
    "CodecCost",
    "CodecFit",
    "Profile",
    "Prediction",
    "cpu_taken",
    "fit_affine",
    "fit_span",
    "predict",
    "search",
    "search_by_scheme",
    "PLAIN",
    "ring_allreduce",
    "ring_allgather",
    "all_to_all",
    "flat_cost",
    "two_phase_cost",
    "hierarchical_cost",
]

#: the codecs that do not send a group with the configured compressor
PLAIN = ("fp16", "none")


@dataclass(frozen=True)
class Affine:
    """``seconds = fixed + per_byte * bytes``."""

    fixed: float = 0.0
    per_byte: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.fixed + self.per_byte * nbytes

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.fixed + other.fixed, self.per_byte + other.per_byte)

    def times(self, count: float) -> "Affine":
        """``count`` runs of this cost."""
        return Affine(self.fixed * count, self.per_byte * count)

    def of(self, fraction: float) -> "Affine":
        """This cost on ``fraction`` of the bytes, as a function of all of them."""
        return Affine(self.fixed, self.per_byte * fraction)


def fit_affine(nbytes: Sequence[float], seconds: Sequence[float]) -> Affine:
    """Least-squares fit of ``seconds = fixed + per_byte * nbytes`` (both clamped at >= 0)."""
    n = len(nbytes)
    if n == 0:
        raise ValueError("fit_affine needs at least one measurement")
    if n == 1 or max(nbytes) == min(nbytes):
        mean_rate = sum(seconds) / max(sum(nbytes), 1e-30)
        return Affine(0.0, max(mean_rate, 0.0))
    mx, my = sum(nbytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds))
    per_byte = max(sxy / sxx, 0.0)
    return Affine(max(my - per_byte * mx, 0.0), per_byte)


def fit_span(nbytes: Sequence[float], seconds: Sequence[float]) -> Affine:
    """The line through the smallest and the largest sample (both terms clamped at >= 0): the
    small one pins the per-call cost, the large one the per-byte cost.  For a per-call cost that
    gets multiplied (one per gathered payload, N of them), where a least-squares intercept moves
    with the noise on the largest sample."""
    lo = min(range(len(nbytes)), key=nbytes.__getitem__)
    hi = max(range(len(nbytes)), key=nbytes.__getitem__)
    if nbytes[hi] == nbytes[lo]:
        return fit_affine(nbytes, seconds)
    per_byte = max((seconds[hi] - seconds[lo]) / (nbytes[hi] - nbytes[lo]), 0.0)
    return Affine(max(seconds[lo] - per_byte * nbytes[lo], 0.0), per_byte)


def ring_allreduce(latency: float, bandwidth: float, world_size: int) -> Affine:
    """α-β cost of a ring allreduce of B bytes: 2(N-1) steps, each moving B/N bytes."""
    if world_size <= 1:
        return Affine()
    steps = 2 * (world_size - 1)
    return Affine(steps * latency, steps / world_size / bandwidth)


def ring_allgather(latency: float, bandwidth: float, world_size: int) -> Affine:
    """α-β cost of a ring allgather where each rank contributes B bytes: (N-1) steps of B bytes.

    The received volume grows with N: sparse and quantized payloads lose to allreduce at scale.
    """
    if world_size <= 1:
        return Affine()
    return Affine((world_size - 1) * latency, (world_size - 1) / bandwidth)


def all_to_all(latency: float, bandwidth: float, world_size: int, host_size: int = 1,
               intra_bandwidth: float = math.inf) -> Affine:
    """α-β cost of a pairwise all-to-all where each rank contributes B bytes, B/N to every rank:
    N-1 rounds.  With one rank per host ``(N-1)α + (N-1)/N · B/β``, flat in N.  With L ranks per
    host sharing its link, that link carries ``L(N-L)/N · B`` and each rank's link inside the host
    ``(L-1)/N · B`` (at ``intra_bandwidth``); the busier one bounds the time.
    """
    if world_size <= 1:
        return Affine()
    carried = max(host_size * (world_size - host_size) / bandwidth, (host_size - 1) / intra_bandwidth)
    return Affine((world_size - 1) * latency, carried / world_size)


@dataclass(frozen=True)
class Cluster:
    """``world_size`` ranks on hosts of ``host_size`` ranks.  Each host reaches the others through
    one link (``latency`` seconds per message, ``bandwidth`` bytes/s) that its ranks share; ranks
    of a host reach each other at ``intra_latency``, ``intra_bandwidth``.  Rings are ordered by
    host, so each ring step crosses a host's link once and its hops run at the slower of the two
    bandwidths.  ``two_level``: an allreduce on hosts of several ranks is a reduce-scatter inside
    the host, L concurrent ring allreduces of the 1/L shards across hosts, and an allgather inside
    the host, instead of one ring over all ranks (fewer steps, fewer bytes on the host's link,
    more inside the host)."""

    world_size: int
    latency: float
    bandwidth: float
    host_size: int = 1
    intra_latency: float = 0.0
    intra_bandwidth: float = math.inf
    two_level: bool = False

    def __post_init__(self) -> None:
        if self.host_size < 1 or self.world_size % self.host_size:
            raise ValueError(f"host size {self.host_size} does not divide world size {self.world_size}")

    @property
    def hosts(self) -> int:
        return self.world_size // self.host_size

    def _ring_bandwidth(self) -> float:
        return min(self.bandwidth, self.intra_bandwidth) if self.host_size > 1 else self.bandwidth

    def allreduce(self) -> Affine:
        if self.two_level and self.host_size > 1:
            return self.inside_host() + self.across_hosts().allreduce().of(1 / self.host_size)
        return ring_allreduce(self.latency, self._ring_bandwidth(), self.world_size)

    def allgather(self) -> Affine:
        return ring_allgather(self.latency, self._ring_bandwidth(), self.world_size)

    def all_to_all(self) -> Affine:
        return all_to_all(self.latency, self.bandwidth, self.world_size, self.host_size, self.intra_bandwidth)

    def inside_host(self) -> Affine:
        """A ring reduce-scatter and a ring allgather of B bytes among the ranks of a host."""
        return ring_allreduce(self.intra_latency, self.intra_bandwidth, self.host_size)

    def across_hosts(self) -> "Cluster":
        """One rank per host with 1/L of its link: each of the L concurrent exchanges among the
        ranks with the same local rank."""
        return Cluster(self.hosts, self.latency, self.bandwidth / self.host_size)


@dataclass(frozen=True)
class CodecCost:
    """What one codec costs: payload bytes per input byte, encode/decode time, the collective's
    wall time and the CPU time it takes on this process (default none)."""

    ratio: float
    encode: Affine
    decode: Affine
    network: Affine
    network_cpu: Affine = Affine()


@dataclass(frozen=True)
class CodecFit:
    """A compressor's own costs on a group, whatever the exchange: payload bytes per input byte;
    encode, and decode of one payload (with its aggregation), by the group's input bytes; each
    further payload aggregated by the same decode (``gathered``); whether payloads are summed by
    allreduce; and, in the two-phase scheme, the second phase's payload bytes per first-phase
    payload byte (2 where a vote of 1-bit signs travels as 2-bit codes)."""

    ratio: float
    encode: Affine
    decode: Affine
    gathered: Affine = Affine()
    summable: bool = False
    second_ratio: float = 1.0

    def aggregate(self, payloads: int) -> Affine:
        """Decoding and aggregating ``payloads`` payloads of the group."""
        return self.decode + self.gathered.times(payloads - 1)


def flat_cost(fit: CodecFit, cluster: Cluster) -> CodecCost:
    """The payload in one ring collective over all ranks: allreduce if summable, else allgather,
    after which every rank decodes N payloads."""
    if fit.summable:
        return CodecCost(fit.ratio, fit.encode, fit.decode, cluster.allreduce())
    return CodecCost(fit.ratio, fit.encode, fit.aggregate(cluster.world_size), cluster.allgather())


def two_phase_cost(fit: CodecFit, cluster: Cluster) -> CodecCost:
    """Each rank encodes the group (N shards); an all-to-all gives rank j shard j of every rank;
    rank j decodes and aggregates those N payloads, encodes the result and decodes it again (its
    residual), all between the two collectives: that middle stage holds the group's place on the
    network and, like collective CPU, delays a backward pass it overlaps.  A ring allgather of
    the aggregated shards follows, and every rank decodes N shards.  Bytes per rank:
    ``(1 + second_ratio)(N-1)/N`` times the payload, flat in N."""
    n = cluster.world_size
    middle = (fit.aggregate(n) + fit.encode + fit.decode).of(1 / n).of(1 / fit.ratio)
    network = cluster.all_to_all() + cluster.allgather().of(fit.second_ratio / n) + middle
    return CodecCost(fit.ratio, fit.encode, fit.decode.of(1 / n).times(n), network, middle)


def hierarchical_cost(fit: CodecFit, cluster: Cluster, across=flat_cost) -> CodecCost:
    """A ring reduce-scatter of the uncompressed group inside each host; each rank encodes its
    1/L shard and exchanges it with the ranks of the same local rank on the other hosts by
    ``across`` (:func:`flat_cost` or :func:`two_phase_cost`), the host's L exchanges sharing its
    link; a ring allgather of the decoded shards inside the host.  Encode and decode cover the
    shard (the decode is charged after the backward pass like every codec's, though the exchange
    runs it before the allgather inside the host).  With one rank per host it is ``across``."""
    shard = 1 / cluster.host_size
    inner = across(fit, cluster.across_hosts())
    network = cluster.inside_host().of(1 / fit.ratio) + inner.network.of(shard)
    return CodecCost(fit.ratio, inner.encode.of(shard), inner.decode.of(shard), network,
                     inner.network_cpu.of(shard))


def cpu_taken(cpu: float, start: float, duration: float, compute_end: float) -> float:
    """Seconds a collective of ``duration`` seconds, started at ``start`` and burning ``cpu``
    CPU seconds evenly, takes from a backward pass that would end at ``compute_end``: its CPU
    time in proportion to the overlap."""
    if cpu <= 0.0 or start >= compute_end:
        return 0.0
    return cpu * min(1.0, (compute_end - start) / duration) if duration > 0.0 else cpu


@dataclass
class Profile:
    """Inputs of the predictor.

    Attributes:
        sizes: gradient bytes per tensor, in backward order.
        ready: seconds from the first gradient to each tensor's gradient, backward order
            (compute only: without any time spent encoding).
        codecs: cost of each codec name that may be used.
    """

    sizes: List[int]
    ready: List[float]
    codecs: Dict[str, CodecCost]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.ready):
            raise ValueError(f"profile has {len(self.sizes)} sizes but {len(self.ready)} ready times")


@dataclass
class Prediction:
    """Predicted time from the first gradient to the last decoded group, and its parts."""

    cuts: Tuple[int, ...]
    codecs: Tuple[str, ...]
    total: float
    backward_end: float = 0.0
    encode: float = 0.0
    network: float = 0.0
    decode: float = 0.0
    exposed_network: float = 0.0
    groups: List[Dict[str, float]] = field(default_factory=list)


def _bounds(cuts: Sequence[int], n: int) -> List[Tuple[int, int]]:
    edges = [0, *cuts, n]
    return list(zip(edges, edges[1:]))


def predict(profile: Profile, cuts: Sequence[int], codecs: Sequence[str]) -> Prediction:
    """Predict one partition: ``cuts`` are the tensor indices where groups 1.. start."""
    n = len(profile.sizes)
    bounds = _bounds(cuts, n)
    if len(codecs) != len(bounds):
        raise ValueError(f"{len(bounds)} groups but {len(codecs)} codecs")
    compute_delay = 0.0   # encode time, and CPU taken by collectives, so far on the compute thread
    net_free = 0.0
    encoded_prev = 0.0
    ends, parts = [], []
    total_encode = total_network = 0.0
    for (a, b), codec in zip(bounds, codecs):
        cost = profile.codecs[codec]
        nbytes = sum(profile.sizes[a:b])
        ready = profile.ready[b - 1] + compute_delay
        encode = cost.encode(nbytes)
        encoded = max(ready, encoded_prev) + encode
        compute_delay += encode
        encoded_prev = encoded
        network = cost.network(nbytes * cost.ratio)
        start = max(encoded, net_free)
        net_free = start + network
        taken = cpu_taken(cost.network_cpu(nbytes * cost.ratio), start, network, profile.ready[-1] + compute_delay)
        compute_delay += taken
        ends.append(net_free)
        total_encode += encode
        total_network += network
        parts.append({"bytes": nbytes, "ready": ready, "encode": encode, "network": network,
                      "network_end": net_free, "network_cpu_taken": taken})
    backward_end = profile.ready[-1] + compute_delay
    clock = backward_end
    total_decode = 0.0
    for (a, b), codec, end, part in zip(bounds, codecs, ends, parts):
        decode = profile.codecs[codec].decode(part["bytes"])
        clock = max(clock, end) + decode
        total_decode += decode
        part["decode"] = decode
    exposed = max(0.0, max(ends) - backward_end)
    return Prediction(tuple(cuts), tuple(codecs), clock, backward_end, total_encode, total_network,
                      total_decode, exposed, parts)


def candidate_cuts(sizes: Sequence[int], points: int = 24) -> List[int]:
    """Up to ``points`` tensor boundaries at about equal byte quantiles (the search grid)."""
    n = len(sizes)
    if n <= points + 1:
        return list(range(1, n))
    total = sum(sizes)
    grid, prefix, i = [], 0, 0
    for i, size in enumerate(sizes[:-1]):
        prefix += size
        if prefix >= total * (len(grid) + 1) / (points + 1):
            grid.append(i + 1)
    return sorted(set(grid))


def _total(prefix: Sequence[int], ready: Sequence[float], costs: Sequence[CodecCost],
           edges: Sequence[int]) -> float:
    """``predict(...).total`` without the breakdown (the search's inner loop)."""
    delay = encoded = net_free = 0.0
    ends = []
    for g, cost in enumerate(costs):
        a, b = edges[g], edges[g + 1]
        nbytes = prefix[b] - prefix[a]
        enc = cost.encode.fixed + cost.encode.per_byte * nbytes
        encoded = max(ready[b - 1] + delay, encoded) + enc
        delay += enc
        payload = nbytes * cost.ratio
        start = max(encoded, net_free)
        network = cost.network.fixed + cost.network.per_byte * payload
        net_free = start + network
        cpu = cost.network_cpu.fixed + cost.network_cpu.per_byte * payload
        if cpu > 0.0:  # inline like the affine costs above: this loop runs ~10^5 times per search
            delay += cpu_taken(cpu, start, network, ready[-1] + delay)
        ends.append(net_free)
    clock = ready[-1] + delay
    for g, cost in enumerate(costs):
        nbytes = prefix[edges[g + 1]] - prefix[edges[g]]
        clock = max(clock, ends[g]) + cost.decode.fixed + cost.decode.per_byte * nbytes
    return clock


#: relative difference of predicted step times below which :func:`search` calls plans equal
TIE = 0.005


def search(profile: Profile, max_groups: int = 4, codecs: Sequence[str] = CODECS,
           top: int = 3, grid_points: int = 16) -> List[Prediction]:
    """The ``top`` best plans by predicted time, exhaustive over 1..``max_groups`` groups cut on
    a byte-quantile grid and over each group's codec.

    The candidates differ in kind: the fastest plan of each (codec carrying most bytes, number
    of groups) pair competes, and each codec's best comes before any codec's second best;
    the result is sorted fastest first.  Plans within :data:`TIE` of each other count as
    equally fast, and the one whose bytes wait least for the rest of their group wins
    (``sum(size * (group ready - tensor ready))``): where the model cannot tell plans apart
    (e.g. a cheap network fully hidden behind compute), sending gradients soon after they are
    ready is the safer bet against costs it does not see.
    """
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    unknown = [c for c in codecs if c not in profile.codecs]
    if unknown:
        raise ValueError(f"no cost known for codecs {unknown}")
    n = len(profile.sizes)
    prefix = [0]
    for size in profile.sizes:
        prefix.append(prefix[-1] + size)
    held_back = [0.0]  # prefix sums of size * ready time
    for size, ready in zip(profile.sizes, profile.ready):
        held_back.append(held_back[-1] + size * ready)
    grid = candidate_cuts(profile.sizes, grid_points)
    best: Dict[Tuple[str, int], Tuple[float, Tuple[int, ...], Tuple[str, ...], float]] = {}
    fastest: Dict[Tuple[str, int], float] = {}  # the lowest predicted time seen per key
    for k in range(1, min(max_groups, n) + 1):
        for assignment in itertools.product(codecs, repeat=k):
            costs = [profile.codecs[c] for c in assignment]
            for cuts in itertools.combinations(grid, k - 1):
                edges = (0, *cuts, n)
                total = _total(prefix, profile.ready, costs, edges)
                share: Dict[str, int] = {}
                for g, codec in enumerate(assignment):
                    share[codec] = share.get(codec, 0) + prefix[edges[g + 1]] - prefix[edges[g]]
                key = (max(share, key=share.get), k)
                fastest[key] = low = min(total, fastest.get(key, total))
                if total > low * (1 + TIE):
                    continue
                waiting = sum(profile.ready[b - 1] * (prefix[b] - prefix[a]) - (held_back[b] - held_back[a])
                              for a, b in zip(edges, edges[1:]))
                held = best.get(key)
                if held is None or held[0] > low * (1 + TIE) or waiting < held[3]:
                    best[key] = (total, cuts, assignment, waiting)
    ranked = sorted(best.items(), key=lambda item: item[1][0])
    leaders, seen = [], set()
    for (dominant, _), entry in ranked:
        if dominant not in seen:
            seen.add(dominant)
            leaders.append(entry)
    chosen = leaders + [entry for _, entry in ranked if entry not in leaders]
    return [predict(profile, cuts, assignment) for _, cuts, assignment, _ in sorted(chosen[:top])]


def search_by_scheme(profile: Profile, max_groups: int = 4, codecs: Sequence[str] = CODECS,
                     top: int = 3) -> List[Prediction]:
    """:func:`search` where every plan sends its compressed groups by one scheme: for each codec
    of ``codecs`` that sends the compressor (not in :data:`PLAIN`), the ``top`` best plans of
    it with the plain codecs; the ``top`` fastest of them all, fastest first.  With S schemes
    this searches ``S * (1 + len(plain)) ** K`` codec assignments of K groups instead of
    ``(S + len(plain)) ** K``."""
    plain = tuple(c for c in codecs if c in PLAIN)
    schemes = [c for c in codecs if c not in PLAIN]
    if len(schemes) <= 1:
        return search(profile, max_groups, codecs, top)
    unique = {(p.cuts, p.codecs): p for scheme in schemes for p in search(profile, max_groups, (scheme, *plain), top)}
    return sorted(unique.values(), key=lambda p: p.total)[:top]
