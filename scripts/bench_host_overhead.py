"""
mergecomp's own work per step with no network: one process, plain torch (SGD and AdamW, foreach
and fused), DDP on one rank, and mergecomp's DistributedOptimizer (none, fp16, topk, powersgd,
1-bit SGD, and 1-bit SGD exchanging AdamW's momentum) side by side, interleaved round after
round; ms per step, aten operators per step, and each row's ratio to plain torch with the same
optimizer.

    python scripts/bench_host_overhead.py                                  # the narrow GPT-2s
    python scripts/bench_host_overhead.py --models resnet50,gpt2-small --rounds 2 --steps 5
    python scripts/bench_host_overhead.py --out docs/img/data/host_overhead_cpu_narrow_gpt2.jsonl

The default models are GPT-2 with 12 layers 64 wide (148 tensors) and with 24 layers 56 wide
(292 tensors, about the same parameters: 3.88 M and 3.79 M): doubling the layers at the same
parameter count shows what each tensor costs, which the last table compares with DDP's.  Not a
test: ratios from one run, on one thread per process unless --threads says otherwise.  Each
round times every configuration in turn for a few steps, each right after a few steps of plain
torch with the same optimizer; a row's ratio is the median over the rounds of its time over
that torch time, so the drifts of a shared machine's speed fall on both.  Times are the
process's CPU time (wall time beside it).
"""
import argparse
import json
import os
import re
import sys
import time

# -----------------------------------------------------------------------------
# defaults
models = "gpt2-12x64,gpt2-24x56"
configs = "all"       # or labels from mergecomp_bench.host_overhead.CONFIGS, comma-separated
groups = 4            # mergecomp's groups (an int, "auto", or "default": groups of about 25 MB, at most 4)
rounds = 20           # interleaved rounds; each row: the median over them
steps = 3             # timed steps per configuration and round
warmup = 5            # untimed steps of each run first (the momentum exchange's phase starts after 2)
resident = 30e6       # models with fewer parameters keep a run per configuration for all rounds
threads = 1           # torch threads
# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=models)
    p.add_argument("--configs", default=configs)
    p.add_argument("--groups", default=str(groups))
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--out", help="append one JSON record per row to this file")
    return p.parse_args(argv)


def table(rows):
    print(f"\n{'model':12s} {'config':20s} {'cpu ms':>8s} {'x torch':>8s} {'wall ms':>8s} {'aten ops':>9s}  "
          f"cpu ms by round")
    for row in rows:
        if "median_ms" not in row:  # it failed in every round
            print(f"{row['model']:12s} {row['config']:20s} {row.get('error', 'not run')}")
            continue
        x = "-" if row["x"] is None else f"{row['x']:.2f}x"
        ops = f"{row['aten_ops']:.0f}" if "aten_ops" in row else "-"
        wall = f"{row['median_wall_ms']:.2f}" if "median_wall_ms" in row else "-"
        print(f"{row['model']:12s} {row['config']:20s} {row['median_ms']:8.2f} {x:>8s} {wall:>8s} {ops:>9s}  "
              + " ".join(f"{ms:.1f}" for ms in row["ms"]))


def per_tensor(rows, small, large):
    """What each configuration adds to its torch anchor's step (its ratio less 1, times the
    anchor's median) on the two models, and how much more on the one with more tensors."""
    from mergecomp_bench.host_overhead import ANCHORS

    by = {(row["model"], row["config"]): row for row in rows}
    print(f"\n{small} -> {large}: ms a configuration adds to its torch anchor's step, and how much more with "
          f"the larger model's tensors")
    for row in rows:
        if (row["model"] != small or row["config"] in ANCHORS.values() or (large, row["config"]) not in by
                or any(by[(m, row["config"])].get("x") is None for m in (small, large))):
            continue
        anchor = ANCHORS[row["optimizer"].split("-")[0]]
        added = [(by[(m, row["config"])]["x"] - 1) * by[(m, anchor)]["median_ms"] for m in (small, large)]
        print(f"  {row['config']:20s} {added[0]:7.2f} ms -> {added[1]:7.2f} ms  ({added[1] - added[0]:+.2f} ms)")


def main(argv=None):
    args = parse_args(argv)
    import torch

    from mergecomp_bench.host_overhead import CONFIGS, build, compare

    torch.set_num_threads(args.threads)
    chosen = CONFIGS if args.configs == "all" else [c for c in CONFIGS if c.label in args.configs.split(",")]
    unknown = set(args.configs.split(",")) - {c.label for c in CONFIGS} if args.configs != "all" else set()
    if unknown:
        sys.exit(f"unknown configurations {sorted(unknown)}; known: {[c.label for c in CONFIGS]}")
    plan = None if args.groups == "default" else args.groups if args.groups == "auto" else int(args.groups)
    from mergecomp_bench.records import provenance

    info = {**provenance(), "threads": args.threads, "load_before": os.getloadavg()[0]}
    rows = []
    began = time.time()
    for name in args.models.split(","):
        model = build(name, torch.device("cpu"))
        print(f"{name}: {model.parameters:,} parameters in {model.tensors} tensors", flush=True)
        rows += compare(model, chosen, args.rounds, args.steps, args.warmup, plan,
                        log=lambda line: print(line, flush=True), resident=model.parameters < resident)
    info["load_after"] = os.getloadavg()[0]
    info["seconds"] = round(time.time() - began, 1)
    table(rows)
    narrow = [name for name in args.models.split(",") if re.fullmatch(r"gpt2-\d+x\d+", name)]
    if len(narrow) >= 2:  # the same model with more tensors
        per_tensor(rows, narrow[0], narrow[1])
    print(f"\n{info['cpu']}, {info['threads']} thread(s); load average {info['load_before']:.2f} before, "
          f"{info['load_after']:.2f} after; {info['seconds']:.0f} s")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({**info, "groups_option": args.groups, "steps": args.steps, **row}) + "\n")
        print(f"appended {len(rows)} records to {args.out}")


if __name__ == "__main__":
    main()
