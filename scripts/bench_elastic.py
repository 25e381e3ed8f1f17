"""An elastic Horovod job that goes from 4 workers to 2 and back to 4, against the same job
uninterrupted: final loss, ranks identical, and the time from a lost worker to training again.

    python scripts/bench_elastic.py --configs topk,onebit --json docs/img/data/elastic_gpt2_4_2_4_workers.jsonl

Each config runs twice under ``horovodrun --min-np 2 --max-np 4 --host-discovery-script``
(hosts on this machine, so no ssh): **steady**, 4 workers (``localhost:2`` and ``127.0.0.1:2``)
throughout; **4-2-4**, the two workers of ``127.0.0.1`` exit at ``--lose-at`` without a word
(``os._exit``: the others' collectives fail, they go back to their last commit and go on as 2),
and at ``--add-at`` rank 0 adds two slots on this machine's host name to the discovery script's
list (every rank is interrupted at that commit and 2 new workers join).  The model is
``bench_convergence``'s GPT-2 (2 layers, 96 wide) on the standard library's bytes, AdamW with
the LR schedule of ``bench_adam`` and ``exchange_momentum_after="auto"`` for the compressor
(the compressor's recipe); each worker draws its batches from the whole training set by
(seed, step, rank), the learning rate does not scale with the workers, ``state.commit()``
every step.  Final loss: the mean of the last 4 held-out evaluations (every 20 steps), as
``bench_convergence``'s language model.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adam import schedule, wrap_adamw  # noqa: E402
from bench_convergence import LM_BATCH, LM_CONTEXT, load_stdlib_bytes, make_gpt2  # noqa: E402

LOST_HOST = "127.0.0.1"
EVAL_EVERY = 20

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--configs", default="topk,onebit", help="compressors, each with exchange_momentum_after='auto'")
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--lose-at", type=int, default=120)
parser.add_argument("--add-at", type=int, default=240)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--scenarios", default="steady,4-2-4")
parser.add_argument("--json", default=None, help="append one record per run")
parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "HOSTS"), help=argparse.SUPPRESS)


def worker(config: str, out: str, hosts: str, args) -> None:
    """One elastic worker: trains, commits every step, notes its syncs and its first step after
    each in ``OUT/<pid>.jsonl``; rank 0 writes the evaluations into the state."""
    import mergecomp.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    model = make_gpt2()
    opt, _, _ = wrap_adamw(model, f"{config}@auto", args.steps, None, groups=2, lr=args.lr)
    lr_at = schedule(args.steps)
    train, held = load_stdlib_bytes()
    starts = torch.linspace(0, len(held) - LM_CONTEXT - 1, 64).long()
    held_out = torch.stack([held[s:s + LM_CONTEXT] for s in starts])
    here = os.environ.get("HOROVOD_HOSTNAME")
    log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")

    def note(**fields) -> None:
        params = float(sum(p.detach().double().sum() for p in model.parameters()))
        log.write(json.dumps({"pid": os.getpid(), "time": time.time(), "host": here, "rank": hvd.rank(),
                              "size": hvd.size(), "params": params, **fields}) + "\n")
        log.flush()

    @hvd.elastic.run
    def run(state):
        note(event="sync", step=state.step)
        first = True
        while state.step < args.steps:
            if args.lose_at and state.step == args.lose_at and here == LOST_HOST:
                note(event="exit", step=state.step)
                os._exit(1)
            for group in opt.param_groups:
                group["lr"] = args.lr * lr_at(state.step)
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + state.step * 1009 + hvd.rank())
            picks = torch.randint(len(train) - LM_CONTEXT, (LM_BATCH,), generator=generator).tolist()
            windows = torch.stack([train[s:s + LM_CONTEXT] for s in picks])
            opt.zero_grad()
            model(input_ids=windows, labels=windows).loss.backward()
            opt.step()
            state.step += 1
            if first:
                note(event="stepped", step=state.step)
                first = False
            if state.step % EVAL_EVERY == 0 and hvd.rank() == 0:
                with torch.no_grad():
                    state.curve = state.curve + [(state.step, model(input_ids=held_out, labels=held_out).loss.item())]
            if args.add_at and state.step == args.add_at and hvd.rank() == 0 and hvd.size() < 4:
                with open(hosts, "a") as f:
                    f.write(f"{socket.gethostname()}:2\n")
                note(event="add", step=state.step)
                deadline = time.monotonic() + 120
                while state._host_messages.empty() and time.monotonic() < deadline:  # as Horovod's own test
                    time.sleep(0.05)
            state.commit()
        note(event="done", step=state.step, curve=state.curve if hvd.rank() == 0 else None)

    run(hvd.elastic.TorchState(model, opt, step=0, curve=[]))


def launch(config: str, scenario: str, args) -> dict:
    """One horovodrun elastic job; its record."""
    folder = tempfile.mkdtemp(prefix="bench_elastic_")
    out, hosts, discover = (os.path.join(folder, name) for name in ("out", "hosts", "discover.sh"))
    os.mkdir(out)
    with open(hosts, "w") as f:
        f.write(f"localhost:2\n{LOST_HOST}:2\n")
    with open(discover, "w") as f:
        f.write(f"#!/bin/bash\ncat {hosts}\n")
    os.chmod(discover, 0o755)
    steady = scenario == "steady"
    command = ["horovodrun", "-np", "4", "--min-np", "2", "--max-np", "4", "--network-interface", "lo",
               "--host-discovery-script", discover, sys.executable, os.path.abspath(__file__),
               "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
               "--lose-at", "0" if steady else str(args.lose_at), "--add-at", "0" if steady else str(args.add_at),
               "--worker", config, out, hosts]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    wall = time.monotonic() - began
    notes = sorted((json.loads(line) for name in os.listdir(out) for line in open(os.path.join(out, name))),
                   key=lambda n: n["time"])
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
    curve = next((n["curve"] for n in notes if n["event"] == "done" and n["curve"] is not None), None)
    syncs = [n for n in notes if n["event"] == "sync"]
    worlds = []
    for n in syncs:  # the sizes the job trained at, in order
        if not worlds or worlds[-1] != n["size"]:
            worlds.append(n["size"])
    # every rank's parameters equal at every sync and at the end
    identical = all(len({n["params"] for n in notes if n["event"] == event and n["step"] == step
                         and n["size"] == size}) == 1
                    for event, step, size in {(n["event"], n["step"], n["size"]) for n in notes
                                              if n["event"] in ("sync", "done")})
    record = {"config": config, "scenario": scenario, "steps": args.steps, "returncode": done.returncode,
              "worlds": worlds, "ranks_identical": identical, "wall_s": wall, "load": os.getloadavg()[0],
              "curve": curve, "final_test_loss": statistics.fmean(loss for _, loss in curve[-4:]) if curve else None}
    exits = [n for n in notes if n["event"] == "exit"]
    if exits:
        lost = exits[0]["time"]
        after = [n for n in notes if n["time"] > lost and n["size"] == 2]
        record["lose_at"] = exits[0]["step"]
        record["kill_to_sync_s"] = min(n["time"] for n in after if n["event"] == "sync") - lost
        record["kill_to_step_s"] = min(n["time"] for n in after if n["event"] == "stepped") - lost
        record["resumed_at"] = min(n["step"] for n in after if n["event"] == "sync")
    adds = [n for n in notes if n["event"] == "add"]
    if adds:
        grown = [n for n in notes if n["time"] > adds[0]["time"] and n["size"] == 4]
        record["add_at"] = adds[0]["step"]
        record["add_to_step_s"] = min(n["time"] for n in grown if n["event"] == "stepped") - adds[0]["time"]
    return record


def main() -> None:
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args)
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    for config in args.configs.split(","):
        finals = {}
        for scenario in args.scenarios.split(","):
            record = launch(config, scenario, args)
            finals[scenario] = record["final_test_loss"]
            shown = {k: v for k, v in record.items() if k != "curve"}
            print(json.dumps(shown), flush=True)
            if args.json:
                append(args.json, record, made_by)
        if None not in finals.values() and "steady" in finals and len(finals) > 1:
            for scenario, loss in finals.items():
                print(f"# {config} {scenario}: {loss:.4f} ({100 * (loss / finals['steady'] - 1):+.2f} % vs steady)")


if __name__ == "__main__":
    main()
