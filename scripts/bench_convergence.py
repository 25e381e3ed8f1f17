"""Convergence table: every compressor (with its default error-feedback memory) trains the same
model for the same number of steps on 2 workers; final held-out metrics next to fp32.

Two tasks, no download:

* ``--task digits``: scikit-learn's bundled ``digits`` set (1,797 8x8 images, 10 classes),
  split 75/25 with a fixed seed, standardized; each worker trains on its half of the training
  set.  Model: an MLP 64-256-256-10 (85k parameters), SGD with momentum 0.9 (none for the
  ``dgc`` memory, which applies momentum itself, and for the majority-vote methods
  ``signsgd``/``signum``, which run at ``--sign-lr``).  Target: error-feedback methods within
  1 percentage point of fp32's test accuracy.
* ``--task lm``: a byte-level language model on CPython's standard-library sources (the
  ``*.py`` files at the top of ``sysconfig``'s stdlib folder, sorted by name: the first 90 % of
  the bytes train, the last 10 % are held out; the loss reported is the mean of the last four
  evaluations).  Model: ``transformers.GPT2LMHeadModel`` from a
  small ``GPT2Config`` (2 layers, 96 wide, 4 heads, 64-byte context, 256-symbol vocabulary;
  0.25 M parameters, no weights downloaded), Adam.  Each worker samples windows from its half of
  the training bytes.  Target: error-feedback methods within 1 % of fp32's validation loss
  (nats per byte).

``mc.DistributedOptimizer(groups=1)`` (one merged group), gloo over loopback; the worker
processes are started once and run every configuration in turn.  Each configuration runs with
``--seeds`` seeds; medians are reported.  ``--warmup-steps`` and ``--uncompressed`` measure
the convergence-safety options (``compression_warmup_steps``, ``uncompressed``).

    pip install -e ".[bench]"
    python scripts/bench_convergence.py --json docs/img/data/convergence_digits_mlp_2workers.jsonl
    python scripts/bench_convergence.py --task lm --json docs/img/data/convergence_stdlib_bytes_gpt2_2workers.jsonl
    python scripts/bench_convergence.py --compressors none,topk,dgc --steps 300 --seeds 1
"""
import argparse
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
COMPRESSORS = "none,fp16,bf16,topk,dgc,randk,qsgd,terngrad,signsgd,signum,efsignsgd,onebit,powersgd"
STEPS = 600
BATCH = 32           # per worker
LR = 0.05
SIGN_LR = 0.002      # the majority vote returns unit signs: a step of lr per element
EVAL_EVERY = 25
SEEDS = "0,1,2"
WORLD = 2
TARGET_PP = 1.0      # digits: within 1 percentage point of fp32's test accuracy
LM_STEPS, LM_LR, LM_BATCH, LM_CONTEXT = 500, 1e-3, 8, 64
TARGET_LOSS = 0.01   # lm: within 1 % of fp32's validation loss

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compressors", default=COMPRESSORS,
                    help="comma list; NAME:key=value;key=value sets compressor arguments, e.g. randk:ratio=0.1")
parser.add_argument("--steps", type=int, default=None, help=f"default: {STEPS} (digits), {LM_STEPS} (lm)")
parser.add_argument("--batch-size", type=int, default=BATCH)
parser.add_argument("--lr", type=float, default=LR)
parser.add_argument("--sign-lr", type=float, default=SIGN_LR, help="lr of the majority-vote methods (signsgd, signum)")
parser.add_argument("--seeds", default=SEEDS)
parser.add_argument("--world-size", type=int, default=WORLD)
parser.add_argument("--json", default=None, help="append one JSON record (with curves) per run")
parser.add_argument("--task", choices=("digits", "lm"), default="digits")
parser.add_argument("--warmup-steps", type=int, default=0, help="compression_warmup_steps")
parser.add_argument("--memory", default=None, help="error-feedback memory for every compressor (default: each one's own); "
                    "NAME:key=value;key=value sets its arguments, e.g. averaged:decay=0.9")
parser.add_argument("--uncompressed", default="", help="comma list of name patterns sent uncompressed")
parser.add_argument("--report", metavar="JSONL[,JSONL]", default=None,
                    help="print the table from the records of earlier --json runs (with the same options; fp32's "
                         "records without them are the baseline); no training")



def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    mean, std = x_train.mean(0), x_train.std(0)
    std[std < 1e-3] = 1.0  # pixels that are always 0 in the training set
    to = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return (to((x_train - mean) / std), torch.tensor(y_train), to((x_test - mean) / std), torch.tensor(y_test))


def load_stdlib_bytes():
    """CPython's top-level standard-library sources as one uint8 tensor: (train, held out)."""
    import pathlib
    import sysconfig

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def make_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=LM_CONTEXT, n_embd=96, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Digits:
    name, steps, metric = "digits", STEPS, "test_acc"

    def __init__(self, rank, world, args):
        x_train, y_train, self.x_test, self.y_test = load_digits_split()
        shard = torch.arange(rank, len(x_train), world)
        self.x, self.y, self.batch_size = x_train[shard], y_train[shard], args.batch_size

    def model(self):
        return MLP()

    def optimizer(self, params, compressor, memory, args):
        lr = args.sign_lr if compressor.votes else args.lr
        # No optimizer momentum on top of the dgc memory's own, nor on a majority vote's unit signs.
        momentum = 0.0 if memory == "dgc" or compressor.votes else 0.9
        return torch.optim.SGD(params, lr=lr, momentum=momentum), lr

    def loss(self, model, gen):
        idx = torch.randint(len(self.x), (self.batch_size,), generator=gen)
        return F.cross_entropy(model(self.x[idx]), self.y[idx])

    @staticmethod
    def final_loss(curve):
        return curve[-1]["test_loss"]

    @torch.no_grad()
    def evaluate(self, model):
        logits = model(self.x_test)
        return {"test_loss": F.cross_entropy(logits, self.y_test).item(),
                "test_acc": (logits.argmax(1) == self.y_test).float().mean().item()}


class StdlibBytes:
    name, steps, metric = "lm", LM_STEPS, "test_loss"

    def __init__(self, rank, world, args):
        train, held_out = load_stdlib_bytes()
        per = len(train) // world
        self.train = train[rank * per:(rank + 1) * per]
        starts = torch.linspace(0, len(held_out) - LM_CONTEXT - 1, 64).long()
        self.held_out = torch.stack([held_out[s:s + LM_CONTEXT] for s in starts])

    def model(self):
        return make_gpt2()

    def optimizer(self, params, compressor, memory, args):
        return torch.optim.Adam(params, lr=LM_LR), LM_LR

    def loss(self, model, gen):
        starts = torch.randint(len(self.train) - LM_CONTEXT, (LM_BATCH,), generator=gen)
        windows = torch.stack([self.train[s:s + LM_CONTEXT] for s in starts.tolist()])
        return model(input_ids=windows, labels=windows).loss

    @staticmethod
    def final_loss(curve):
        """The mean of the last 4 evaluations (the last 100 steps): one evaluation of a language
        model this early in training swings by several per cent from step to step."""
        return statistics.fmean(point["test_loss"] for point in curve[-4:])

    @torch.no_grad()
    def evaluate(self, model):
        return {"test_loss": model(input_ids=self.held_out, labels=self.held_out).loss.item()}


TASKS = {"digits": Digits, "lm": StdlibBytes}


def parse_spec(spec: str):
    """``"randk:ratio=0.1;seed=3"`` -> ``("randk", {"ratio": 0.1, "seed": 3})`` (values that are
    not Python literals stay strings: ``"terngrad:packing=base3"``)."""
    from mergecomp.compressor_args import keyword_args

    base, _, options = spec.partition(":")
    return base, keyword_args([o for o in options.split(";") if o])


def compressor_of(spec: str):
    """The registry's compressor for ``"NAME[:key=value;...]"`` (:func:`parse_spec`)."""
    import mergecomp

    name, options = parse_spec(spec)
    return mergecomp.get_compressor(name, **options)


def memory_of(spec: str):
    """The registry's error-feedback memory for ``"NAME[:key=value;...]"`` (:func:`parse_spec`)."""
    import mergecomp

    name, options = parse_spec(spec)
    return mergecomp.get_memory(name, **options)


def train_one(rank, world, name, seed, args, task):
    """One configuration on this rank (mergecomp already initialised); rank 0 returns the record."""
    import mergecomp.torch as mc

    torch.manual_seed(seed)
    model = task.model()
    compressor = compressor_of(name)
    memory = args.memory or compressor.default_memory
    optimizer, lr = task.optimizer(model.parameters(), compressor, parse_spec(memory)[0], args)
    optimizer = mc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compressor,
                                        memory=memory_of(memory), groups=1,
                                        compression_warmup_steps=args.warmup_steps,
                                        uncompressed=[p for p in args.uncompressed.split(",") if p],
                                        exchange_momentum_after=None)  # Adam's gradients, as measured
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    steps = args.steps or task.steps
    curve = []
    began = time.perf_counter()
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = task.loss(model, gen)
        loss.backward()
        optimizer.step()
        if step % EVAL_EVERY == 0 or step == steps:
            curve.append({"step": step, "train_loss": loss.item(), **task.evaluate(model)})
    optimizer.remove_hooks()
    return {"task": task.name, "compressor": name, "memory": memory, "lr": lr, "seed": seed, "steps": steps,
            "world_size": world, "warmup_steps": args.warmup_steps, "uncompressed": args.uncompressed,
            "final_acc": curve[-1].get("test_acc"), "final_test_loss": task.final_loss(curve), "curve": curve,
            "compressor_repr": repr(optimizer.compressor), "wall_s": time.perf_counter() - began, "status": "ok"}


def worker(rank, world, port, jobs, args, queue):
    """Runs every (compressor, seed) job in turn; the ranks stay joined in one process group."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import mergecomp.torch as mc

    torch.set_num_threads(1)
    mc.init(engine="torch")
    task = TASKS[args.task](rank, world, args)
    for name, seed in jobs:
        try:
            record = train_one(rank, world, name, seed, args, task)
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
    if args.report:
        options = (args.warmup_steps, args.uncompressed)
        for path in args.report.split(","):
            with open(path) as f:
                for r in map(json.loads, f):
                    own = (r.get("warmup_steps", 0), r.get("uncompressed", ""))
                    baseline = r["compressor"] == "none" and own == (0, "")
                    if r.get("task", "digits") == args.task and r["compressor"] in results and r["seed"] in seeds \
                            and (own == options or baseline) and (args.memory in (None, r["memory"]) or baseline) \
                            and r not in results[r["compressor"]]:
                        results[r["compressor"]].append(r)
        return report(args, names, seeds, results)
    jobs = [(name, seed) for name in names for seed in seeds]
    try:
        from tqdm import tqdm
        progress = tqdm(total=len(jobs), desc=args.task, file=sys.stderr)
    except ImportError:
        progress = None
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    for r in run_all(jobs, args):
        name, seed = r["compressor"], r["seed"]
        results[name].append(r)
        if args.json:
            append(args.json, r, made_by)
        status = (f"test loss {r['final_test_loss']:.4f}" + (f", acc {r['final_acc']:.4f}" if r["final_acc"] else "")
                  if r["status"] == "ok" else r["status"])
        message = f"# {name} seed {seed}: {status}"
        if progress is not None:
            progress.update()
            progress.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)
    report(args, names, seeds, results)


def report(args, names, seeds, results):
    """A markdown table of medians over seeds, and the PASS/FAIL line of the task's target."""
    lm = args.task == "lm"
    key = "final_test_loss" if lm else "final_acc"
    ok = lambda rs: [r for r in rs if r["status"] == "ok"]  # noqa: E731
    base = {r["seed"]: r[key] for r in ok(results.get("none", []))}  # same seed: same weights and batches
    steps = args.steps or (LM_STEPS if lm else STEPS)
    extras = f", compression_warmup_steps {args.warmup_steps}" * bool(args.warmup_steps) + \
        f", uncompressed {args.uncompressed}" * bool(args.uncompressed)
    if lm:
        print(f"stdlib bytes, GPT-2 (2x96), {args.world_size} workers x batch {LM_BATCH} x {LM_CONTEXT} bytes, "
              f"{steps} steps, Adam lr {LM_LR}, groups=1{extras}, seeds {seeds}: median over seeds")
        header = ("| compressor | memory | validation loss (nats/byte) | min-max | vs fp32, same seed (median) "
                  "| error feedback | within 1 % |")
    else:
        print(f"digits, MLP 64-256-256-10, {args.world_size} workers x batch {args.batch_size}, {steps} steps, "
              f"lr {args.lr} (sign methods {args.sign_lr}), groups=1{extras}, seeds {seeds}: median over seeds")
        header = ("| compressor | memory | test accuracy % | min-max % | test loss | vs fp32, same seed (pp, median) "
                  "| error feedback | within 1 pp |")
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    verdicts = []
    for name in names:
        rs = ok(results[name])
        if not rs:
            print(f"| {name} | - | {results[name][0]['status'] if results[name] else 'no record'} |" + " |" * 5)
            continue
        values = [r[key] for r in rs]
        value = statistics.median(values)
        ef = rs[0]["memory"] != "none"
        paired = [(r[key], base[r["seed"]]) for r in rs if r["seed"] in base]
        if lm:
            delta = statistics.median(v / b - 1 for v, b in paired) if paired else None
            within = delta is not None and delta <= TARGET_LOSS
            shown = f"{value:.4f} | {min(values):.4f}-{max(values):.4f} | " + \
                ("-" if delta is None or name == "none" else f"{100 * delta:+.2f} %")
        else:
            delta = statistics.median(100 * (v - b) for v, b in paired) if paired else None
            within = delta is not None and delta >= -TARGET_PP
            loss = statistics.median(r["final_test_loss"] for r in rs)
            shown = f"{100 * value:.2f} | {100 * min(values):.1f}-{100 * max(values):.1f} | {loss:.4f} | " + \
                ("-" if delta is None or name == "none" else f"{delta:+.2f}")
        if ef:
            verdicts.append((name, within))
        print(f"| {'fp32 (none)' if name == 'none' else name} | {rs[0]['memory']} | {shown} | {'yes' if ef else 'no'} | "
              f"{('PASS' if within else 'FAIL') if ef else '-'} |")
    print()
    if verdicts:
        passed = sum(v for _, v in verdicts)
        target = f"{100 * TARGET_LOSS:g} % of fp32's validation loss" if lm else f"{TARGET_PP:g} pp of fp32's accuracy"
        print(f"{'PASS' if passed == len(verdicts) else 'FAIL'}: {passed}/{len(verdicts)} error-feedback methods within "
              f"{target} ({', '.join(n for n, v in verdicts if not v) or 'none failed'})")


if __name__ == "__main__":
    main()
