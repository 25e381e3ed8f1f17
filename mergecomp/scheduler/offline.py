"""Offline planner: the best merge plan of a model for 2..1024 workers, predicted on one machine.

For each world size and host size, :func:`plan_table` predicts the best merge plan (groups cut by
bytes along the backward order, one codec per group) and its step-time breakdown, with the same
predictor the online scheduler uses (:mod:`mergecomp.scheduler.costmodel`).  Assumptions, stated once:

* Network: α-β model; each host has one link (``--bandwidth``, ``--latency``) shared by its
  ``--host-sizes`` ranks, which reach each other at ``--intra-bandwidth``, ``--intra-latency``.
  Rings are ordered by host.  Allreduce of B bytes costs ``2(N-1)·α + 2(N-1)/N · B/β`` by one
  ring (with several ranks per host, a plan may take a two-level allreduce instead);
  allgather where each rank contributes B bytes ``(N-1)·α + (N-1) · B/β``, growing with N;
  all-to-all ``(N-1)·α + (N-1)/N · B/β`` with one rank per host (the shared link carries L
  times more with L).  One collective at a time; no congestion.
* Exchange schemes of a non-summable compressor: ``compressed`` (allgather), ``two-phase``
  (all-to-all of the compressed shards, aggregation, allgather of the re-compressed aggregates;
  N >= 3), and with several ranks per host ``hierarchical`` and ``hierarchical-two-phase``
  (uncompressed reduce-scatter and allgather inside the host, the compressed 1/L shard across
  hosts).  A plan uses one of them, beside fp16 and uncompressed groups.
* Compute: the backward pass takes ``backward_ms`` (``--backward-ms``) and gradients become
  ready in proportion to their bytes, last layer first.
* Codec costs are measured once on this machine on random data with the model's shapes, with
  1 and 2 payloads (each further gathered payload decodes at the measured difference), or
  assumed from ``codec_gbps`` (``--codec-gbps``: every encode, and every payload's decode, at
  that throughput of the gradient's bytes).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.exchange.compatibility import carries
from mergecomp.exchange.plan import CODECS, COMPRESSED, has_codec_choice
from mergecomp.exchange.schemes import HIERARCHICAL, HIERARCHICAL_TWO_PHASE, TWO_PHASE
from mergecomp.registry import get_compressor, get_memory
from mergecomp.scheduler.costmodel import (PLAIN, Affine, Cluster, CodecFit, Prediction, Profile, fit_span, flat_cost,
                                           hierarchical_cost, predict, search, search_by_scheme, two_phase_cost)
from mergecomp.scheduler.probes import probe_sizes, rehearse

__all__ = ["exchange_codecs", "gradient_bytes", "plan_table", "markdown_table", "to_json"]

#: the planner models fp32 gradients
ELEMENT_BYTES = 4


def gradient_bytes(shapes: Sequence[Sequence[int]]) -> List[int]:
    """Bytes of each tensor's fp32 gradient."""
    return [math.prod(s) * ELEMENT_BYTES for s in shapes]


#: the cost of each codec of the configured compressor (a plan codec name) on a cluster
SCHEME_COSTS = {
    COMPRESSED: flat_cost,
    TWO_PHASE: two_phase_cost,
    HIERARCHICAL: hierarchical_cost,
    HIERARCHICAL_TWO_PHASE: functools.partial(hierarchical_cost, across=two_phase_cost),
}
#: the codecs of the fp16/bf16 baseline (a cast, or nothing, by ring allreduce)


def _codec_fits(compressors: Dict[str, Compressor], shapes, codec_gbps) -> Dict[str, CodecFit]:
    """Each compressor's :class:`~mergecomp.scheduler.costmodel.CodecFit`: measured once, with 1 and 2
    payloads (:func:`~mergecomp.scheduler.costmodel.fit_span`: the per-call costs get multiplied by up to N
    payloads), or assumed from ``codec_gbps``.  Measured encodes include the configured
    compressor's default error-feedback memory, which every codec's groups go through."""
    samples = probe_sizes(gradient_bytes(shapes))
    memory = get_memory(compressors[COMPRESSED].default_memory)
    nbytes = [b for b, _ in samples]
    torch_shapes = [torch.Size(s) for s in shapes]
    out = {}
    for name, compressor in compressors.items():
        second = 2.0 if compressor.votes else 1.0
        exchanged = functools.partial(rehearse, compressor, codec=COMPRESSED, shapes=torch_shapes,
                                      dtype=torch.float32, device=torch.device("cpu"))
        if codec_gbps:
            rate = Affine(0.0, 8 / (codec_gbps * 1e9) if name != "none" else 0.0)
            ratio = exchanged(None, samples=samples[:1], world_size=1).ratio
            out[name] = CodecFit(ratio, rate, rate, rate, compressor.summable, second)
            continue
        one = exchanged(memory, samples=samples, world_size=1)
        two = exchanged(None, samples=samples, world_size=2)
        extra = [max(0.0, b - a) for a, b in zip(one.decode, two.decode)]
        out[name] = CodecFit(one.ratio, fit_span(nbytes, one.encode), fit_span(nbytes, one.decode),
                             fit_span(nbytes, extra), compressor.summable, second)
    return out


def exchange_codecs(compressor: Compressor, cluster: Cluster) -> Tuple[str, ...]:
    """The codecs that send a group with ``compressor`` on ``cluster``: ``compressed`` always;
    for a compressor whose payloads are allgathered also, where they can carry it
    (:func:`~mergecomp.exchange.compatibility.carries`), ``two-phase`` (N >= 3) and, with
    several ranks per host, ``hierarchical`` and ``hierarchical-two-phase`` (3 hosts or more)."""
    if compressor.summable:  # payloads that add up travel best by allreduce
        return (COMPRESSED,)
    wanted = {COMPRESSED: True, TWO_PHASE: cluster.world_size >= 3,
              HIERARCHICAL: cluster.host_size > 1,
              HIERARCHICAL_TWO_PHASE: cluster.host_size > 1 and cluster.hosts >= 3}
    return tuple(name for name, ok in wanted.items() if ok and carries(compressor, name))


def _fastest(predictions: Sequence[Prediction]) -> Prediction:
    return min(predictions, key=lambda p: p.total)


def _predictions(profile: Profile, schemes: Sequence[str], plain: Sequence[str], max_groups: int) -> Dict:
    """The best plan, the baselines' plans, layer-wise and one group (see :func:`plan_table`)."""
    n = len(profile.sizes)
    return {"best": search_by_scheme(profile, max_groups, (*schemes, *plain), top=1)[0],
            "fp16": search(profile, max_groups, PLAIN, top=1)[0],
            "fp32_fused": search(profile, max_groups, ("none",), top=1)[0],
            "layerwise": predict(profile, list(range(1, n)), [COMPRESSED] * n),
            "one_group": predict(profile, [], [COMPRESSED])}


def plan_table(shapes, compressor_name: str, compressor_args, world_sizes: Sequence[int],
               bandwidth_gbit: float, latency_us: float, backward_ms: float, max_groups: int,
               codec_gbps=None, host_sizes: Sequence[int] = (1,), intra_gbit: float = 100.0,
               intra_latency_us: float = 5.0) -> List[Dict]:
    """One row per host size and world size that it divides: the predicted best plan and the
    baselines (seconds).

    Each row maps ``world_size`` and ``host_size`` to ints and ``best``, ``fp16`` (the best plan
    of fp16 and uncompressed groups), ``fp32_fused``, ``layerwise`` and ``one_group`` to
    :class:`~mergecomp.scheduler.costmodel.Prediction` s.  Each plan of ``best`` sends its compressed
    groups by one exchange scheme (:func:`exchange_codecs`); with several ranks per host, each
    plan allreduces by one ring or in two levels (:class:`~mergecomp.scheduler.costmodel.Cluster`),
    whichever predicts faster.
    """
    sizes = gradient_bytes(shapes)
    total = sum(sizes)
    ready, prefix = [], 0
    for size in sizes:
        prefix += size
        ready.append(backward_ms / 1e3 * prefix / total)
    compressor = get_compressor(compressor_name, **compressor_args)
    compressors = {name: compressor if name == COMPRESSED else get_compressor(name) for name in CODECS}
    fits = _codec_fits(compressors, shapes, codec_gbps)
    plain = PLAIN if has_codec_choice(compressor) else ()
    rows = []
    for host_size in host_sizes:
        for n in (n for n in world_sizes if n % host_size == 0):
            found = []
            for two_level in sorted({False, host_size > 1}):
                cluster = Cluster(n, latency_us * 1e-6, bandwidth_gbit * 1e9 / 8, host_size,
                                  intra_latency_us * 1e-6, intra_gbit * 1e9 / 8, two_level)
                schemes = exchange_codecs(compressor, cluster)
                codecs = {name: flat_cost(fits[name], cluster) for name in PLAIN}
                codecs.update((name, SCHEME_COSTS[name](fits[COMPRESSED], cluster)) for name in schemes)
                found.append(_predictions(Profile(sizes, ready, codecs), schemes, plain, max_groups))
            rows.append({"world_size": n, "host_size": host_size,
                         **{key: _fastest([f[key] for f in found]) for key in found[0]}})
    return rows


def _describe(prediction: Prediction) -> str:
    """``"12.3MB:compressed + 85.1MB:none"``: each group's gradient megabytes and codec."""
    return " + ".join(f"{group['bytes'] / 2**20:.1f}MB:{codec}"
                      for group, codec in zip(prediction.groups, prediction.codecs))


def markdown_table(rows: Sequence[Dict]) -> List[str]:
    """The lines of a markdown table of :func:`plan_table`'s rows (milliseconds, speedups)."""
    lines = ["| workers | per host | best plan (groups: MB:codec) | predicted ms | exposed net ms "
             "| best fp16/bf16 plan ms | vs fp16 | fp32 fused ms | layer-wise ms | 1 group ms | vs fp32 "
             "| vs layer-wise |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        best, fp16, fused = row["best"], row["fp16"], row["fp32_fused"]
        layer, single = row["layerwise"], row["one_group"]
        lines.append(f"| {row['world_size']} | {row['host_size']} | {_describe(best)} | {best.total * 1e3:.1f} | "
                     f"{best.exposed_network * 1e3:.1f} | {fp16.total * 1e3:.1f} | {fp16.total / best.total:.2f}x | "
                     f"{fused.total * 1e3:.1f} | {layer.total * 1e3:.1f} | {single.total * 1e3:.1f} | "
                     f"{fused.total / best.total:.2f}x | {layer.total / best.total:.2f}x |")
    return lines


def to_json(rows: Sequence[Dict]) -> List[Dict]:
    """:func:`plan_table`'s rows as JSON values: each prediction's total, cuts, codecs and
    exposed network seconds."""
    return [{k: (v if isinstance(v, int) else {"total_s": v.total, "cuts": v.cuts, "codecs": v.codecs,
                                               "exposed_network_s": v.exposed_network})
             for k, v in row.items()} for row in rows]
