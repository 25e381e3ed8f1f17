"""FSDP2 step time on the namespace cluster: FSDP's own reduce-scatter (fp32, or bf16
``reduce_dtype``) against mergecomp's compressed reduce-scatter (``mc.fsdp.compress``).

Every configuration trains ``bench_adam``'s GPT-2 (4 layers x 256, byte-level; 3.2 M parameters)
with ``fully_shard`` on each transformer block and on the root, AdamW, one worker per host and one
thread each, the hosts joined by ``--rate`` links (``mergecomp_bench.cluster``; root).  It reports
the median step time over ``--steps`` steps after ``--warmup``, each configuration's ratio to
FSDP fp32 and to FSDP bf16 from the same run, the training loss of the last step, each rank's
peak resident memory (``ru_maxrss``), and the bytes each rank's interface sent per step and
parameter (``/proc/net/dev`` of its namespace: TCP/IP headers included; all-gather and
reduce-scatter together).  ``--param-dtype bf16`` gives every configuration FSDP's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (the parameters all-gathered and computed in
bf16, as FSDP users commonly train); ``--no-reshard`` gives every configuration
``reshard_after_forward=False`` (one all-gather a step: ZeRO-2's traffic).

Configurations: ``fsdp`` (fp32 reduce-scatter), ``fsdp-bf16`` (``MixedPrecisionPolicy(reduce_dtype=
torch.bfloat16)``), ``fsdp-a2a`` and ``fsdp-bf16-a2a`` (the same with a reduce-scatter sending
NCCL's bytes, where gloo's sends an all-reduce's: :class:`AllToAllReduceScatter`; ratios against
them get columns of their own), and ``COMPRESSOR[:key=value;...][+MEMORY[:key=value;...]][@int8]`` for
mergecomp's reduce-scatter (``@int8``: and its int8 parameter all-gather, ``all_gather="int8"``;
``none@int8`` is FSDP's own reduce-scatter with it).  Each record also holds the bytes the
error-feedback memories keep on each rank (``memory_mb``).

``--converge`` trains as ``bench_adam`` does instead (its seed, batch of 8, AdamW with weight
decay, warm-up + cosine LR schedule over ``--steps``, validation loss on the held-out windows
every 50 steps, the last four averaged) and reports each configuration's validation loss against
FSDP fp32's: accuracy, on any ``--rate`` (``loopback`` needs no root).

    python scripts/bench_fsdp.py --configs fsdp-bf16,fp16,qsgd:levels=7,topk --json out.jsonl
    python scripts/bench_fsdp.py --hosts 8 --rate 10gbit --steps 5 --configs qsgd:levels=7   # bytes vs ranks
    python scripts/bench_fsdp.py --converge --rate loopback --steps 2000 --warmup 0 --batch 8 --configs qsgd:levels=7+averaged
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adam import DECAY, EVAL_EVERY, LR, make_model, random_windows, rank_data, schedule  # noqa: E402
from bench_convergence import StdlibBytes, compressor_of, memory_of  # noqa: E402
from bench_time_to_accuracy import run_cluster  # noqa: E402

BASELINES = ("fsdp", "fsdp-bf16")
#: the same two with a reduce-scatter that sends NCCL's bytes (:class:`AllToAllReduceScatter`)
NCCL_BYTES_BASELINES = ("fsdp-a2a", "fsdp-bf16-a2a")
CONFIGS = "fp16,qsgd:levels=7,topk"

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--configs", default=CONFIGS, help="comma list of mergecomp compressors (the baselines always run)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--batch", type=int, default=4, help="windows of 64 bytes per worker and step")
parser.add_argument("--hosts", type=int, default=2)
parser.add_argument("--rate", default="1gbit", help="each host's link (tc tbf), or 'loopback'")
parser.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="FSDP's param_dtype for every configuration")
parser.add_argument("--no-reshard", action="store_true",
                    help="fully_shard(reshard_after_forward=False): the parameters all-gathered once a step, kept "
                         "from forward to backward (ZeRO-2's traffic)")
parser.add_argument("--converge", action="store_true", help="train as bench_adam does and report validation loss")
parser.add_argument("--seed", type=int, default=0, help="with --converge: bench_adam's seed")
parser.add_argument("--no-baselines", action="store_true",
                    help="run only --configs; the baselines' ratios come from the records in --json")
parser.add_argument("--json", default=None, help="append one JSON record per configuration")
parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
parser.add_argument("--out", default=None, help=argparse.SUPPRESS)


class AllToAllReduceScatter:
    """FSDP2's lossless reduce-scatter sending what NCCL's sends, ``(N - 1) / N`` of the buffer
    per rank (gloo's own sends an all-reduce's bytes, twice that): one all-to-all of the chunks
    (as bytes), then each rank sums the chunks it received in the buffer's dtype."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        world = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received.view(torch.uint8), input_tensor.view(torch.uint8), group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)


def sharded_model(config, param_dtype, reshard=True):
    """The GPT-2 under fully_shard (``reshard``: its ``reshard_after_forward``), and mergecomp's
    reduce-scatter unless ``config`` is a baseline."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mergecomp.torch as mc

    model = make_model()
    params = torch.bfloat16 if param_dtype == "bf16" else None
    reduce = torch.bfloat16 if config.startswith("fsdp-bf16") else (torch.float32 if params else None)
    policy = MixedPrecisionPolicy(param_dtype=params, reduce_dtype=reduce)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    reductions = []
    if config in NCCL_BYTES_BASELINES:
        for module in [*model.transformer.h, model]:
            module.set_custom_reduce_scatter(AllToAllReduceScatter())
    elif config not in BASELINES:
        config, _, all_gather = config.partition("@")
        spec, _, memory = config.partition("+")
        reductions = mc.fsdp.compress(model, compressor_of(spec), memory=memory_of(memory) if memory else None,
                                      all_gather=all_gather or "none")
    return model, reductions


def memory_mb(reductions):
    """MB the error-feedback memories of ``reductions`` keep on this rank (a memory instance the
    modules share counted once)."""
    memories = {id(holder.memory): holder.memory for holder in reductions}.values()
    return sum(t.numel() * t.element_size() for memory in memories
               for fields in memory.state_dict().values() for t in fields.values()) / 2 ** 20


def worker(args):
    import mergecomp.torch as mc

    torch.set_num_threads(1)
    mc.init(engine="torch")
    rank, world = mc.rank(), mc.size()
    train, held_out = rank_data(rank, world, 64 if args.converge else 1)
    torch.manual_seed(args.seed if args.converge else 0)
    model, reductions = sharded_model(args.worker, args.param_dtype, not args.no_reshard)
    if args.converge:  # bench_adam's training
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args.warmup + args.steps))
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    else:
        opt, lr_schedule = torch.optim.AdamW(model.parameters(), lr=LR), None
        generator = torch.Generator().manual_seed(rank)
    times, sent, curve = [], 0, []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sent = -tx_bytes()
        windows = random_windows(train, generator, args.batch)
        began = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=windows, labels=windows).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - began)
        if lr_schedule is not None:
            lr_schedule.step()
            if (step + 1) % EVAL_EVERY == 0 or step + 1 == args.warmup + args.steps:
                with torch.no_grad():
                    curve.append({"step": step + 1, "test_loss": model(input_ids=held_out, labels=held_out).loss.item()})
    sent += tx_bytes()
    numel = sum(p.numel() for p in model.parameters())
    peaks = mc.allgather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    memories = mc.allgather_object(memory_mb(reductions))
    sent = mc.allgather_object(sent / args.steps / numel)
    mc.shutdown()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"config": args.worker, "world": world, "step_s": statistics.median(times[args.warmup:]),
                       "loss": loss.item(), "peak_rss_mb": peaks, "memory_mb": memories,
                       "sent_bytes_per_param": sent,
                       "param_dtype": args.param_dtype, "batch": args.batch,
                       "reshard_after_forward": not args.no_reshard,
                       **({"seed": args.seed, "steps": args.warmup + args.steps, "curve": curve,
                           "final_test_loss": StdlibBytes.final_loss(curve)}
                          if args.converge else {})}, f)


def tx_bytes(interface="eth0"):
    """Bytes this network namespace's ``interface`` has sent (0 where it has none: loopback)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                return int(fields.split()[8])
    return 0


def earlier_baselines(args):
    """The last record of each baseline in ``--json`` run as this run is (seed, steps, ranks,
    parameter dtype, and ``--converge`` or not)."""
    if not args.json or not os.path.exists(args.json):
        return []
    steps = args.warmup + args.steps
    found = {}
    with open(args.json) as f:
        for line in f:
            r = json.loads(line)
            if (r.get("config") in BASELINES and r.get("status") == "ok" and r.get("world") == args.hosts
                    and r.get("param_dtype") == args.param_dtype and ("curve" in r) == args.converge
                    and r.get("reshard_after_forward", True) == (not args.no_reshard)
                    and (not args.converge or (r.get("seed"), r.get("steps")) == (args.seed, steps))):
                found[r["config"]] = r
    return list(found.values())


def main():
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    configs = [] if args.no_baselines else list(BASELINES)
    configs += [c for c in args.configs.split(",") if c and c not in configs]
    records = earlier_baselines(args) if args.no_baselines else []
    command_of = lambda config, out: [  # noqa: E731
        sys.executable, os.path.abspath(__file__), "--worker", config, "--out", out, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch", str(args.batch), "--param-dtype", args.param_dtype,
        "--seed", str(args.seed), *(["--converge"] if args.converge else []),
        *(["--no-reshard"] if args.no_reshard else [])]
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    for record in run_cluster(args, configs, command_of, timeout=1200):
        records = [r for r in records if r["config"] != record["config"]] + [record]
        if args.json:
            append(args.json, record, made_by)
    base = {r["config"]: r["step_s"] for r in records
            if r["status"] == "ok" and r["config"] in BASELINES + NCCL_BYTES_BASELINES}
    against = [b for b in NCCL_BYTES_BASELINES if b in base]  # their columns where they ran
    if args.converge:
        reference = next((r["final_test_loss"] for r in records if r["status"] == "ok" and r["config"] == "fsdp"), None)
        print(f"FSDP2 GPT-2 4x256, AdamW, {args.hosts} workers x batch {args.batch}, {args.warmup + args.steps} steps, "
              f"seed {args.seed}: validation loss")
        print("| configuration | validation loss | vs FSDP fp32 | step s |")
        print("|---|---:|---:|---:|")
        for r in records:
            if r["status"] == "ok":
                versus = "-" if reference is None else f"{100 * (r['final_test_loss'] / reference - 1):+.2f} %"
                print(f"| {r['config']} | {r['final_test_loss']:.4f} | {versus} | {r['step_s']:.3f} |")
            else:
                print(f"| {r['config']} | {r['status']} | | |")
        return
    print(f"FSDP2 GPT-2 4x256, {args.hosts} hosts at {args.rate}, batch {args.batch} x 64 bytes per worker, "
          f"params {args.param_dtype}, reshard_after_forward={not args.no_reshard}, median of {args.steps} steps")
    print("| configuration | step s | vs FSDP fp32 | vs FSDP bf16 | " + "".join(f"vs {b} | " for b in against)
          + "last loss | peak RSS MB (per rank) | memories MB (per rank) | bytes sent per step and parameter "
          "(per rank) | load |")
    print("|---|---:|---:|---:|" + "---:|" * len(against) + "---:|---|---|---|---|")
    for r in records:
        if r["status"] != "ok":
            print(f"| {r['config']} | {r['status']} | | | " + "| " * len(against) + "| | | | |")
            continue
        ratios = [f"{base[b] / r['step_s']:.2f}x" if b in base else "-" for b in BASELINES + tuple(against)]
        print(f"| {r['config']} | {r['step_s']:.3f} | " + " | ".join(ratios) + f" | {r['loss']:.3f} | "
              f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mb'])} | "
              f"{', '.join(f'{m:.1f}' for m in r.get('memory_mb', []))} | "
              f"{', '.join(f'{b:.2f}' for b in r['sent_bytes_per_param'])} | {r['load_before']} / {r['load_after']} |")


if __name__ == "__main__":
    main()
