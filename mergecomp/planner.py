"""Offline planner: the best merge plan of a model for 2..1024 workers, predicted on one machine.

For each world size, :func:`plan_table` predicts the best merge plan (groups cut by bytes along
the backward order, one codec per group) and its step-time breakdown, with the same predictor
the online scheduler uses (:mod:`mergecomp.costmodel`).  Assumptions, stated once:

* Network: ring collectives under the α-β model.  Allreduce of B bytes costs
  ``2(N-1)·α + 2(N-1)/N · B/β``; allgather where each rank contributes B bytes costs
  ``(N-1)·α + (N-1) · B/β`` — it grows with N, so sparse and quantized payloads (which cannot
  be summed) lose to allreduce at scale.  One collective at a time; no congestion or hierarchy.
* Compute: the backward pass takes ``backward_ms`` (``--backward-ms``) and gradients become
  ready in proportion to their bytes, last layer first.
* Codec costs are measured once on this machine on random data with the model's shapes (or
  assumed from ``codec_gbps``, ``--codec-gbps``); decoding gathered payloads grows linearly
  with N, extrapolated from 1 and 2 payloads.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from .costmodel import (Affine, CodecCost, Prediction, Profile, fit_affine, predict, ring_allgather,
                        ring_allreduce, search)
from .plan import CODECS, has_codec_choice
from .probes import probe_sizes, time_codec
from .registry import get_compressor

__all__ = ["gradient_bytes", "plan_table", "markdown_table", "to_json"]

#: the planner models fp32 gradients
ELEMENT_BYTES = 4


def gradient_bytes(shapes: Sequence[Sequence[int]]) -> List[int]:
    """Bytes of each tensor's fp32 gradient."""
    return [math.prod(s) * ELEMENT_BYTES for s in shapes]


def _codec_costs(compressors, shapes, codec_gbps) -> Dict[str, tuple]:
    """Per codec: (payload ratio, encode fit, decode fit for one payload, extra decode fit per
    additional gathered payload, summable).  Measured once, with 1 and 2 payloads."""
    samples = probe_sizes(gradient_bytes(shapes))
    nbytes = [b for b, _ in samples]
    torch_shapes = [torch.Size(s) for s in shapes]
    out = {}
    for name, compressor in compressors.items():
        if codec_gbps:
            per_byte = 8 / (codec_gbps * 1e9) if name != "none" else 0.0
            _, _, ratio = time_codec(compressor, samples[:1], torch_shapes, torch.float32, torch.device("cpu"), 1)
            out[name] = (ratio, Affine(0.0, per_byte), Affine(0.0, per_byte), Affine(), compressor.summable)
            continue
        encode, decode1, ratio = time_codec(compressor, samples, torch_shapes, torch.float32, torch.device("cpu"), 1)
        _, decode2, _ = time_codec(compressor, samples, torch_shapes, torch.float32, torch.device("cpu"), 2)
        extra = [max(0.0, b - a) for a, b in zip(decode1, decode2)]
        out[name] = (ratio, fit_affine(nbytes, encode), fit_affine(nbytes, decode1),
                     fit_affine(nbytes, extra) if not compressor.summable else Affine(), compressor.summable)
    return out


def plan_table(shapes, compressor_name: str, compressor_args, world_sizes: Sequence[int],
               bandwidth_gbit: float, latency_us: float, backward_ms: float, max_groups: int,
               codec_gbps=None) -> List[Dict]:
    """One row per world size: the predicted best plan and the baselines (seconds).

    Each row maps ``world_size`` to the int and ``best``, ``fp32_fused``, ``layerwise`` and
    ``one_group`` to :class:`~mergecomp.costmodel.Prediction` s.
    """
    sizes = gradient_bytes(shapes)
    total = sum(sizes)
    ready, prefix = [], 0
    for size in sizes:
        prefix += size
        ready.append(backward_ms / 1e3 * prefix / total)
    compressor = get_compressor(compressor_name, **compressor_args)
    compressors = {name: compressor if name == "compressed" else get_compressor(name) for name in CODECS}
    bandwidth = bandwidth_gbit * 1e9 / 8
    latency = latency_us * 1e-6
    measured = _codec_costs(compressors, shapes, codec_gbps)
    rows = []
    for n in world_sizes:
        codecs = {}
        for name, (ratio, enc, dec, extra, summable) in measured.items():
            network = (ring_allreduce if summable else ring_allgather)(latency, bandwidth, n)
            decode = Affine(dec.fixed + (n - 1) * extra.fixed, dec.per_byte + (n - 1) * extra.per_byte)
            codecs[name] = CodecCost(ratio, enc, decode, network)
        profile = Profile(sizes, ready, codecs)
        allowed = CODECS if has_codec_choice(compressor) else ("compressed",)
        best = search(profile, max_groups, allowed, top=1)[0]
        fused = search(profile, max_groups, ("none",), top=1)[0]
        layerwise = predict(profile, list(range(1, len(sizes))), ["compressed"] * len(sizes))
        single = predict(profile, [], ["compressed"])
        rows.append({"world_size": n, "best": best, "fp32_fused": fused, "layerwise": layerwise,
                     "one_group": single})
    return rows


def _describe(prediction: Prediction) -> str:
    """``"12.3MB:compressed + 85.1MB:none"``: each group's gradient megabytes and codec."""
    return " + ".join(f"{group['bytes'] / 2**20:.1f}MB:{codec}"
                      for group, codec in zip(prediction.groups, prediction.codecs))


def markdown_table(rows: Sequence[Dict]) -> List[str]:
    """The lines of a markdown table of :func:`plan_table`'s rows (milliseconds, speedups)."""
    lines = ["| workers | best plan (groups: MB:codec) | predicted ms | exposed net ms | fp32 fused ms "
             "| layer-wise ms | 1 group ms | vs fp32 | vs layer-wise |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        best, fused, layer, single = row["best"], row["fp32_fused"], row["layerwise"], row["one_group"]
        lines.append(f"| {row['world_size']} | {_describe(best)} | {best.total * 1e3:.1f} | "
                     f"{best.exposed_network * 1e3:.1f} | {fused.total * 1e3:.1f} | {layer.total * 1e3:.1f} | "
                     f"{single.total * 1e3:.1f} | {fused.total / best.total:.2f}x | {layer.total / best.total:.2f}x |")
    return lines


def to_json(rows: Sequence[Dict]) -> List[Dict]:
    """:func:`plan_table`'s rows as JSON values: each prediction's total, cuts, codecs and
    exposed network seconds."""
    return [{k: (v if k == "world_size" else {"total_s": v.total, "cuts": v.cuts, "codecs": v.codecs,
                                              "exposed_network_s": v.exposed_network})
             for k, v in row.items()} for row in rows]
