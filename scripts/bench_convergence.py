"""Convergence table: every compressor (with its default error-feedback memory) trains the same
model for the same number of steps on 2 workers; final test accuracy and loss next to fp32.

Data: scikit-learn's bundled ``digits`` set (1,797 8x8 images, 10 classes; no download),
split 75/25 with a fixed seed, standardized; each worker trains on its half of the training
set.  The two worker processes are started once and run every configuration in turn.  Model: an MLP 64-256-256-10 (85k parameters), SGD with momentum 0.9 (none for the ``dgc``
memory, which applies momentum itself, and for the majority-vote methods ``signsgd``/``signum``,
which run at ``--sign-lr``), ``mc.DistributedOptimizer(groups=1)`` (one merged
group), gloo over loopback.  Each configuration runs with ``--seeds`` seeds; the median final
accuracy is reported.

    pip install scikit-learn matplotlib
    python scripts/bench_convergence.py --json docs/img/data/convergence_digits_mlp_2workers.jsonl
    python scripts/bench_convergence.py --compressors none,topk,dgc --steps 300 --seeds 1

Target (PASS/FAIL, not asserted): the error-feedback methods (default memory other than
``none``) end within 1 percentage point of fp32's accuracy.
"""
import argparse
import ast
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

# -- defaults ------------------------------------------------------------------------------------
COMPRESSORS = "none,fp16,topk,dgc,randk,qsgd,terngrad,signsgd,signum,efsignsgd,onebit,powersgd"
STEPS = 600
BATCH = 32           # per worker
LR = 0.05
SIGN_LR = 0.002      # the majority vote returns unit signs: a step of lr per element
EVAL_EVERY = 25
SEEDS = "0,1,2"
WORLD = 2
TARGET_PP = 1.0

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compressors", default=COMPRESSORS,
                    help="comma list; NAME:key=value;key=value sets compressor arguments, e.g. randk:ratio=0.1")
parser.add_argument("--steps", type=int, default=STEPS)
parser.add_argument("--batch-size", type=int, default=BATCH)
parser.add_argument("--lr", type=float, default=LR)
parser.add_argument("--sign-lr", type=float, default=SIGN_LR, help="lr of the majority-vote methods (signsgd, signum)")
parser.add_argument("--seeds", default=SEEDS)
parser.add_argument("--world-size", type=int, default=WORLD)
parser.add_argument("--json", default=None, help="append one JSON record (with curves) per run")


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    mean, std = x_train.mean(0), x_train.std(0)
    std[std < 1e-3] = 1.0  # pixels that are always 0 in the training set
    to = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return (to((x_train - mean) / std), torch.tensor(y_train), to((x_test - mean) / std), torch.tensor(y_test))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train_one(rank, world, name, seed, args, data):
    """One configuration on this rank (mergecomp already initialised); rank 0 returns the record."""
    import mergecomp
    import mergecomp.torch as mc

    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = MLP()
    base, _, options = name.partition(":")  # e.g. "randk:ratio=0.1"
    kwargs = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in options.split(";") if o)}
    compressor = mergecomp.get_compressor(base, **kwargs)
    memory = compressor.default_memory
    lr = args.sign_lr if compressor.votes else args.lr
    # No optimizer momentum on top of the dgc memory's own, nor on a majority vote's unit signs.
    momentum = 0.0 if memory == "dgc" or compressor.votes else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    optimizer = mc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression=compressor, memory=memory, groups=1)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    curve = []
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(x_train), (args.batch_size,), generator=gen)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        optimizer.step()
        if step % EVAL_EVERY == 0 or step == args.steps:
            with torch.no_grad():
                logits = model(x_test)
                test_loss = F.cross_entropy(logits, y_test).item()
                acc = (logits.argmax(1) == y_test).float().mean().item()
            curve.append({"step": step, "train_loss": loss.item(), "test_loss": test_loss, "test_acc": acc})
    optimizer.remove_hooks()
    return {"compressor": name, "memory": memory, "lr": lr, "seed": seed, "steps": args.steps,
            "world_size": world, "batch_size": args.batch_size, "final_acc": curve[-1]["test_acc"],
            "final_test_loss": curve[-1]["test_loss"], "curve": curve,
            "compressor_repr": repr(optimizer.compressor), "wall_s": time.perf_counter() - began, "status": "ok"}


def worker(rank, world, port, jobs, args, queue):
    """Runs every (compressor, seed) job in turn; the ranks stay joined in one process group."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import mergecomp.torch as mc

    torch.set_num_threads(1)
    mc.init(engine="torch")
    x_train, y_train, x_test, y_test = load_digits_split()
    shard = torch.arange(rank, len(x_train), world)
    data = (x_train[shard], y_train[shard], x_test, y_test)
    for name, seed in jobs:
        try:
            record = train_one(rank, world, name, seed, args, data)
        except Exception as err:  # keep going: a failing compressor is a result too
            record = {"compressor": name, "seed": seed, "status": f"failed: {err}"}
        if rank == 0:
            queue.put(record)
    mc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(jobs, args):
    """Spawn the workers once; yield each job's record as it finishes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, jobs, args, queue), daemon=True)
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    try:
        for name, seed in jobs:
            try:
                yield queue.get(timeout=600)
            except Exception:
                yield {"compressor": name, "seed": seed, "status": "timeout"}
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main():
    args = parser.parse_args()
    names = [c for c in args.compressors.split(",") if c]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results = {name: [] for name in names}
    jobs = [(name, seed) for name in names for seed in seeds]
    for r in run_all(jobs, args):
        name, seed = r["compressor"], r["seed"]
        results[name].append(r)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        status = f"acc {r['final_acc']:.4f}, test loss {r['final_test_loss']:.4f}" if r["status"] == "ok" else r["status"]
        print(f"# {name} seed {seed}: {status}", file=sys.stderr, flush=True)
    ok = lambda rs: [r for r in rs if r["status"] == "ok"]  # noqa: E731
    base = statistics.median(r["final_acc"] for r in ok(results["none"])) if ok(results.get("none", [])) else None
    print(f"digits, MLP 64-256-256-10, {args.world_size} workers x batch {args.batch_size}, {args.steps} steps, "
          f"lr {args.lr} (sign methods {args.sign_lr}), groups=1, seeds {seeds}: median over seeds")
    print()
    print("| compressor | memory | test accuracy % | min-max % | test loss | vs fp32 (pp) | error feedback | within 1 pp |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    verdicts = []
    for name in names:
        rs = ok(results[name])
        if not rs:
            print(f"| {name} | - | failed | | | | | |")
            continue
        accs = [r["final_acc"] for r in rs]
        acc = statistics.median(accs)
        loss = statistics.median(r["final_test_loss"] for r in rs)
        ef = rs[0]["memory"] != "none"
        delta = None if base is None else 100 * (acc - base)
        within = delta is not None and delta >= -TARGET_PP
        if ef:
            verdicts.append((name, within))
        print(f"| {'fp32 (none)' if name == 'none' else name} | {rs[0]['memory']} | {100 * acc:.2f} | "
              f"{100 * min(accs):.1f}-{100 * max(accs):.1f} | {loss:.4f} | "
              f"{'-' if delta is None or name == 'none' else f'{delta:+.2f}'} | {'yes' if ef else 'no'} | "
              f"{('PASS' if within else 'FAIL') if ef else '-'} |")
    print()
    if verdicts:
        passed = sum(v for _, v in verdicts)
        print(f"{'PASS' if passed == len(verdicts) else 'FAIL'}: {passed}/{len(verdicts)} error-feedback methods within "
              f"{TARGET_PP:g} pp of fp32 ({', '.join(n for n, v in verdicts if not v) or 'none failed'})")


if __name__ == "__main__":
    main()
