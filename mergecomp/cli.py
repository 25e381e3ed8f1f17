"""The ``mergecomp`` console script: parses the command line and dispatches.

    mergecomp plan ...    the offline planner, :mod:`mergecomp.scheduler.offline`

The throughput benchmark is benchmark tooling, outside the library: ``mergecomp-bench``
(:mod:`mergecomp_bench.runner`).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Sequence

from mergecomp.compressor_args import keyword_args
from mergecomp.registry import compressor_names
from mergecomp.scheduler import offline, zoo

__all__ = ["main"]

DEFAULT_WORLD_SIZES = "2,4,8,16,32,64,128,256,512,1024"
PLAN_EXAMPLES = """examples:
  mergecomp plan --model resnet50 --compressor topk --bandwidth 10 --latency 50
  mergecomp plan --sizes grads.json --compressor qsgd -C bucket_size=256 --world-sizes 8,64,512
  mergecomp plan --model gpt2-small --compressor onebit --codec-gbps 200 --host-size 1,8
"""


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


def _positive_ints(text: str, option: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"mergecomp: {option} must be positive integers, got {text!r}")
    return values


def _cmd_plan(args) -> int:
    shapes = _load_shapes(args)
    world_sizes = _positive_ints(args.world_sizes, "--world-sizes")
    host_sizes = _positive_ints(args.host_sizes, "--host-sizes")
    try:
        rows = offline.plan_table(shapes, args.compressor, keyword_args(args.compressor_arg), world_sizes,
                                  args.bandwidth, args.latency, args.backward_ms, args.max_groups, args.codec_gbps,
                                  host_sizes, args.intra_bandwidth, args.intra_latency)
    except (ValueError, TypeError) as err:
        raise SystemExit(f"mergecomp: {err}") from None
    if not rows:
        raise SystemExit("mergecomp: no world size is a multiple of a host size")
    source = args.sizes or args.model
    print(f"# {source}: {len(shapes)} tensors, {sum(offline.gradient_bytes(shapes)) / 2**20:.1f} MB of fp32 "
          f"gradients; compressor {args.compressor}; link {args.bandwidth:g} Gbit/s, {args.latency:g} us per host; "
          f"inside a host {args.intra_bandwidth:g} Gbit/s, {args.intra_latency:g} us; backward {args.backward_ms:g} ms; "
          f"codecs {f'at {args.codec_gbps:g} Gbit/s' if args.codec_gbps else 'measured here'}")
    print("\n".join(offline.markdown_table(rows)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(offline.to_json(rows), f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mergecomp", description="mergecomp command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="predict the best merge plan for 2..1024 workers", description=offline.__doc__,
                          epilog=PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--model", default="resnet50", help=f"built-in model: {', '.join(zoo.MODELS)}")
    source.add_argument("--sizes", help="JSON list of gradient sizes (elements) or shapes, backward order")
    plan.add_argument("--compressor", default="topk", help=f"one of {', '.join(compressor_names())}")
    plan.add_argument("-C", "--compressor-arg", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--world-sizes", default=DEFAULT_WORLD_SIZES)
    plan.add_argument("--host-sizes", default="1",
                      help="ranks per host, comma-separated (default 1); each world size it divides gets a row")
    plan.add_argument("--bandwidth", type=float, default=10.0,
                      help="each host's link bandwidth, Gbit/s, shared by its ranks (default 10)")
    plan.add_argument("--latency", type=float, default=50.0, help="per-message latency, us (default 50)")
    plan.add_argument("--intra-bandwidth", type=float, default=100.0,
                      help="bandwidth between ranks of a host, Gbit/s (default 100)")
    plan.add_argument("--intra-latency", type=float, default=5.0,
                      help="per-message latency between ranks of a host, us (default 5)")
    plan.add_argument("--backward-ms", type=float, default=100.0, help="backward compute time (default 100)")
    plan.add_argument("--max-groups", type=int, default=4)
    plan.add_argument("--codec-gbps", type=float, default=None,
                      help="assume this encode/decode throughput (Gbit/s) instead of measuring here")
    plan.add_argument("--json", help="also write the rows to this JSON file")
    plan.set_defaults(run=_cmd_plan)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
