"""
DDP communication hooks side by side: DDP's own allreduce, PyTorch's fp16 and PowerSGD hooks,
mergecomp's hooks (fp16, powersgd, topk) and mergecomp's DistributedOptimizer with
groups="auto", on the same model, 2 ranks.  Not a test: it prints a table.

Run it plainly; for each configuration it starts the 2 ranks as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR/PORT), each in its own process with a timeout, so a configuration that
crashes or hangs (PyTorch's powerSGD_hook on gloo, see docs/frontends.md) is reported as such
and the others still run:

    python scripts/bench_ddp_hooks.py
    python scripts/bench_ddp_hooks.py --configs ddp,torch-powersgd,mc-powersgd --steps 20

One configuration by hand (what the driver runs):

    torchrun --nproc_per_node 2 scripts/bench_ddp_hooks.py --worker ddp
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# -----------------------------------------------------------------------------
# defaults
configs = "ddp,torch-fp16,torch-powersgd,mc-fp16,mc-powersgd,mc-topk,mc-opt-auto-topk,mc-opt-auto-powersgd"
hidden = 2048               # MLP width: 784 -> hidden -> hidden -> hidden -> 10 (about 10M parameters)
batch_size = 32             # per rank
warmup_steps = 40           # untimed; covers DDP's bucket rebuild and the auto scheduler's search (at most 28 steps)
steps = 30                  # timed
threads = 1                 # torch threads per rank (2 ranks on 2 cores)
timeout = 180               # seconds per configuration
rounds = 2                  # runs of each configuration, interleaved; the fastest is reported
# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=configs, help="comma-separated, from: " + configs)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--warmup-steps", type=int, default=warmup_steps)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--rounds", type=int, default=rounds, help="runs of every configuration; the fastest is kept")
    p.add_argument("--worker", help="run this one configuration (as one rank, torchrun's environment)")
    p.add_argument("--out", help="worker: write rank 0's result as JSON here")
    return p.parse_args(argv)


# -- worker (one configuration, under torchrun) ----------------------------------------------------
def make_model(width):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def build(config, model):
    """(module to call, optimizer, mergecomp DistributedOptimizer or None) for one configuration."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import mergecomp.torch as mc

    sgd = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)  # noqa: E731
    if config.startswith("mc-opt-auto-"):
        mc.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = mc.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(),
                                      compression=config[len("mc-opt-auto-"):], groups="auto")
        return model, opt, opt
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if config == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif config == "torch-powersgd":
        # start_powerSGD_iter=2 (default 1000): compress from the third step on, like ours
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=2,
                                            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif config.startswith("mc-"):
        state, hook = mc.ddp_comm_hook(config[len("mc-"):], named_parameters=model.named_parameters())
        ddp.register_comm_hook(state, hook)
    elif config != "ddp":
        raise SystemExit(f"unknown configuration {config!r}; known: {configs}")
    return ddp, sgd(ddp.parameters()), None


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import mergecomp.torch as mc

    torch.set_num_threads(args.threads)
    mc.init(engine="torch")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.hidden)
    module, opt, ours = build(args.worker, model)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 784, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    times, losses = [], []
    for step in range(args.warmup_steps + args.steps):
        began = time.perf_counter()
        loss = F.cross_entropy(module(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= args.warmup_steps:
            times.append(time.perf_counter() - began)
        losses.append(loss.item())
    # the slowest rank's median step
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    result = {"config": args.worker, "status": "ok", "step_ms": median.item() * 1e3, "world": world,
              "params": sum(p.numel() for p in model.parameters()),
              "loss_first": losses[0], "loss_last": losses[-1]}
    if ours is not None:
        report = ours.schedule_report()
        chosen = report.get("chosen") or {}
        sizes = chosen.get("sizes", [])
        codecs = chosen.get("codecs") or ["compressed"] * len(sizes)
        result["plan"] = "auto chose " + " + ".join(f"{b / 2**20:.1f}MB:{c}" for b, c in zip(sizes, codecs))
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    mc.shutdown()


# -- driver ------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(config, args):
    """Start both ranks of one configuration (torchrun's environment, each rank in its own
    session), wait up to ``args.timeout`` seconds, kill what is left; return rank 0's result or
    what went wrong.  A rank that fails ends the run at once: its peer may be stuck in gloo."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-u", __file__, "--worker", config, "--out", out, "--hidden", str(args.hidden),
                   "--batch-size", str(args.batch_size), "--warmup-steps", str(args.warmup_steps),
                   "--steps", str(args.steps), "--threads", str(args.threads)]
        port = free_port()
        procs, logs = [], []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(args.threads),
                   "MERGECOMP_TIMEOUT": str(int(args.timeout))}
            logs.append(open(os.path.join(tmp, f"rank{rank}.log"), "w+"))
            procs.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline, status = time.monotonic() + args.timeout, None
        while status is None:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                status = "ok"
            elif any(c not in (None, 0) for c in codes):
                status = f"crashed (exit {[c for c in codes if c not in (None, 0)][0]})"
            elif time.monotonic() > deadline:
                status = f"hung, killed after {args.timeout:g}s"
            else:
                time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if status == "ok" and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        errors = []
        for log in logs:
            log.seek(0)
            errors += [line.strip() for line in log if "Error" in line or "doesn't match" in line]
        gloo = [e[e.index("Received"):] for e in errors if "Received data size" in e]  # gloo's own words
        return {"config": config, "status": status, "error": (gloo or errors or [""])[-1][:160]}


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    chosen = [c for c in args.configs.split(",") if c]
    print(f"MLP 784-{args.hidden}x3-10, batch {args.batch_size} per rank, 2 ranks (gloo), "
          f"{args.threads} thread(s) each; {args.warmup_steps} warm-up + {args.steps} timed steps")
    best, failures = {}, {}
    for round_ in range(1, args.rounds + 1):
        for config in chosen:  # rounds interleave the configurations: load changes hit all alike
            began = time.perf_counter()
            result = run_config(config, args)
            print(f"  round {round_} {config:22s} {result['status']:26s} "
                  + (f"{result['step_ms']:8.1f} ms/step" if "step_ms" in result else result.get("error", ""))
                  + f"   ({time.perf_counter() - began:.0f}s)", flush=True)
            if "step_ms" not in result:
                failures.setdefault(config, []).append(result)
            elif config not in best or result["step_ms"] < best[config]["step_ms"]:
                best[config] = result
    results = [best.get(c) or failures[c][0] for c in chosen]
    base = next((r["step_ms"] for r in results if r["config"] == "ddp" and "step_ms" in r), None)
    print()
    print("| configuration | status | median step (ms, slowest rank, best run) | step time vs DDP | loss first -> last | notes |")
    print("|---|---|---:|---:|---|---|")
    for r in results:
        if "step_ms" in r:
            ratio = f"{r['step_ms'] / base:.2f}x" if base else "-"
            note = r.get("plan", "")
            print(f"| {r['config']} | ok | {r['step_ms']:.1f} | {ratio} | "
                  f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | {note} |")
        else:
            statuses = ", ".join(f["status"] for f in failures[r["config"]])
            print(f"| {r['config']} | failed in {len(failures[r['config']])} of {args.rounds} runs: {statuses} "
                  f"| - | - | - | {r.get('error', '')} |")


if __name__ == "__main__":
    main()
