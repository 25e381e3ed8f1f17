"""The ``mergecomp`` console script.

    mergecomp plan --model resnet50 --compressor topk --bandwidth 10 --latency 50
    mergecomp plan --sizes grads.json --compressor qsgd -C bucket_size=256 --world-sizes 8,64,512

``plan`` predicts, for 2..1024 workers, the best merge plan (groups cut by bytes along the
backward order, one codec per group) and its step-time breakdown, with the same predictor the
online scheduler uses (:mod:`mergecomp.costmodel`).  Assumptions, stated once:

* Network: ring collectives under the α-β model.  Allreduce of B bytes costs
  ``2(N-1)·α + 2(N-1)/N · B/β``; allgather where each rank contributes B bytes costs
  ``(N-1)·α + (N-1) · B/β`` — it grows with N, so sparse and quantized payloads (which cannot
  be summed) lose to allreduce at scale.  One collective at a time; no congestion or hierarchy.
* Compute: the backward pass takes ``--backward-ms`` and gradients become ready in proportion to
  their bytes, last layer first.
* Codec costs are measured once on this machine on random data with the model's shapes (or
  assumed from ``--codec-gbps``); decoding gathered payloads grows linearly with N, extrapolated
  from 1 and 2 payloads.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Sequence

import torch

from .bench import zoo
from .cmdline import keyword_args
from .costmodel import Affine, CodecCost, Profile, fit_affine, predict, ring_allgather, ring_allreduce, search
from .registry import compressor_names, get_compressor
from .scheduler import probe_sizes, time_codec

__all__ = ["main", "plan_table"]

DEFAULT_WORLD_SIZES = "2,4,8,16,32,64,128,256,512,1024"


def _load_shapes(args) -> List[Sequence[int]]:
    if args.sizes:
        with open(args.sizes, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list) or not data:
            raise SystemExit(f"mergecomp: {args.sizes} must hold a non-empty JSON list of sizes or shapes")
        return [tuple(s) if isinstance(s, list) else (int(s),) for s in data]
    try:
        return zoo.backward_shapes(args.model)
    except ValueError as err:
        raise SystemExit(f"mergecomp: {err}") from None


def _codec_costs(compressors, shapes, codec_gbps, element: int) -> Dict[str, tuple]:
    """Per codec: (payload ratio, encode fit, decode fit for one payload, extra decode fit per
    additional gathered payload, summable).  Measured once, with 1 and 2 payloads."""
    sizes = [math.prod(s) * element for s in shapes]
    samples = probe_sizes(sizes)
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
    """One row per world size: the predicted best plan and the baselines (seconds)."""
    element = 4
    sizes = [math.prod(s) * element for s in shapes]
    total = sum(sizes)
    ready, prefix = [], 0
    for size in sizes:
        prefix += size
        ready.append(backward_ms / 1e3 * prefix / total)
    compressor = get_compressor(compressor_name, **compressor_args)
    compressors = {"compressed": compressor, "fp16": get_compressor("fp16"), "none": get_compressor("none")}
    bandwidth = bandwidth_gbit * 1e9 / 8
    latency = latency_us * 1e-6
    measured = _codec_costs(compressors, shapes, codec_gbps, element)
    rows = []
    for n in world_sizes:
        codecs = {}
        for name, (ratio, enc, dec, extra, summable) in measured.items():
            network = (ring_allreduce if summable else ring_allgather)(latency, bandwidth, n)
            decode = Affine(dec.fixed + (n - 1) * extra.fixed, dec.per_byte + (n - 1) * extra.per_byte)
            codecs[name] = CodecCost(ratio, enc, decode, network)
        profile = Profile(sizes, ready, codecs)
        allowed = ("compressed",) if compressor.votes or compressor_name == "none" else tuple(codecs)
        best = search(profile, max_groups, allowed, top=1)[0]
        fused = search(profile, max_groups, ("none",), top=1)[0]
        layerwise = predict(profile, list(range(1, len(sizes))), ["compressed"] * len(sizes))
        single = predict(profile, [], ["compressed"])
        rows.append({"world_size": n, "best": best, "fp32_fused": fused, "layerwise": layerwise,
                     "one_group": single})
    return rows


def _describe(prediction, sizes) -> str:
    edges = [0, *prediction.cuts, len(sizes)]
    parts = [f"{sum(sizes[a:b]) / 2**20:.1f}MB:{codec}" for (a, b), codec in
             zip(zip(edges, edges[1:]), prediction.codecs)]
    return " + ".join(parts)


def _cmd_plan(args) -> int:
    shapes = _load_shapes(args)
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    if any(n < 1 for n in world_sizes):
        raise SystemExit("mergecomp: --world-sizes must be positive integers")
    try:
        rows = plan_table(shapes, args.compressor, keyword_args(args.compressor_arg), world_sizes,
                          args.bandwidth, args.latency, args.backward_ms, args.max_groups, args.codec_gbps)
    except (ValueError, TypeError) as err:
        raise SystemExit(f"mergecomp: {err}") from None
    sizes = [math.prod(s) * 4 for s in shapes]
    source = args.sizes or args.model
    print(f"# {source}: {len(shapes)} tensors, {sum(sizes) / 2**20:.1f} MB of fp32 gradients; "
          f"compressor {args.compressor}; link {args.bandwidth:g} Gbit/s, {args.latency:g} us; "
          f"backward {args.backward_ms:g} ms")
    print("| workers | best plan (groups: MB:codec) | predicted ms | exposed net ms | fp32 fused ms "
          "| layer-wise ms | 1 group ms | vs fp32 | vs layer-wise |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        best, fused, layer, single = row["best"], row["fp32_fused"], row["layerwise"], row["one_group"]
        print(f"| {row['world_size']} | {_describe(best, sizes)} | {best.total * 1e3:.1f} | "
              f"{best.exposed_network * 1e3:.1f} | {fused.total * 1e3:.1f} | {layer.total * 1e3:.1f} | "
              f"{single.total * 1e3:.1f} | {fused.total / best.total:.2f}x | {layer.total / best.total:.2f}x |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{k: (v if k == "world_size" else {"total_s": v.total, "cuts": v.cuts, "codecs": v.codecs,
                                                          "exposed_network_s": v.exposed_network})
                        for k, v in row.items()} for row in rows], f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mergecomp", description="mergecomp command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="predict the best merge plan for 2..1024 workers",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--model", default="resnet50", help=f"built-in model: {', '.join(zoo.MODELS)}")
    source.add_argument("--sizes", help="JSON list of gradient sizes (elements) or shapes, backward order")
    plan.add_argument("--compressor", default="topk", help=f"one of {', '.join(compressor_names())}")
    plan.add_argument("-C", "--compressor-arg", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--world-sizes", default=DEFAULT_WORLD_SIZES)
    plan.add_argument("--bandwidth", type=float, default=10.0, help="link bandwidth, Gbit/s (default 10)")
    plan.add_argument("--latency", type=float, default=50.0, help="per-message latency, us (default 50)")
    plan.add_argument("--backward-ms", type=float, default=100.0, help="backward compute time (default 100)")
    plan.add_argument("--max-groups", type=int, default=4)
    plan.add_argument("--codec-gbps", type=float, default=None,
                      help="assume this encode/decode throughput (Gbit/s) instead of measuring here")
    plan.add_argument("--json", help="also write the rows to this JSON file")
    plan.set_defaults(run=_cmd_plan)
    sub.add_parser("bench", add_help=False, help="throughput benchmark: mergecomp plans vs DDP anchors, optionally "
                                                 "on a bandwidth-limited namespace cluster (mergecomp bench --help)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its options are mergecomp.bench.runner's own
        from .bench.runner import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
