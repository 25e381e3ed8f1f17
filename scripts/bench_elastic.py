"""Elastic jobs that lose workers against the same jobs uninterrupted: final loss, ranks
identical, and the time from a lost worker to training again.

    python scripts/bench_elastic.py --configs topk,onebit --json docs/img/data/elastic_gpt2_4_2_4_workers.jsonl
    python scripts/bench_elastic.py --configs topk,onebit --scenarios torchrun-steady,torchrun-4-3 \
        --json docs/img/data/elastic_gpt2_torchrun_4_3_workers.jsonl

Horovod's elastic API (``hvd.elastic``), under ``horovodrun --min-np 2 --max-np 4
--host-discovery-script`` (hosts on this machine, so no ssh): **steady**, 4 workers
(``localhost:2`` and ``127.0.0.1:2``) throughout; **4-2-4**, the two workers of ``127.0.0.1``
exit at ``--lose-at`` without a word (``os._exit``: the others' collectives fail, they go back
to their last commit and go on as 2), and at ``--add-at`` rank 0 adds two slots on this
machine's host name to the discovery script's list (every rank is interrupted at that commit
and 2 new workers join); a commit every step.

torchrun's elastic restarts: four agents of one process each (``--nnodes 3:4``, c10d
rendezvous, ``--max-restarts 10``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a store of its own
for every restart, without which a restarted worker can read an earlier attempt's addresses):
**torchrun-steady**, 4 ranks throughout; **torchrun-4-3**, at ``--lose-at`` one worker kills
its agent and itself (a lost node), the other agents restart their workers on 3 nodes, which
resume from the latest ``mc.checkpoint`` (one every ``--save-every`` steps; per-rank memories
folded or dropped, ``--residuals``).

The model is ``bench_convergence``'s GPT-2 (2 layers, 96 wide) on the standard library's bytes,
AdamW with the LR schedule of ``bench_adam`` and ``exchange_momentum_after="auto"`` for the
compressor (its recipe); each worker draws its batches from the whole training set by (seed,
step, rank); the learning rate does not scale with the workers.  ``--keep-global-batch``: on
fewer workers each takes the batches of the ranks it stands for (as DeepSpeed's elasticity
keeps the global batch), so the job trains on the uninterrupted job's samples.  Final loss: the
mean of the last 4 held-out evaluations (every 20 steps), as ``bench_convergence``'s language
model.
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import signal
import tempfile
import time
from typing import Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_adam import schedule, wrap_adamw  # noqa: E402
from bench_convergence import LM_BATCH, LM_CONTEXT, free_port, load_stdlib_bytes, make_gpt2  # noqa: E402

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
parser.add_argument("--scenarios", default="steady,4-2-4",
                    help="steady,4-2-4 (horovodrun elastic); torchrun-steady,torchrun-4-3 (torchrun's restarts)")
parser.add_argument("--keep-global-batch", action="store_true",
                    help="on 2 (or 1) workers each trains on the batches of 2 (4) of the 4-worker job's ranks at "
                         "once: the global batch, and the samples, of the uninterrupted job")
parser.add_argument("--json", default=None, help="append one record per run")
parser.add_argument("--job-timeout", type=float, default=1200, help="seconds before a job is stopped as hung")
parser.add_argument("--save-every", type=int, default=20,
                    help="torchrun scenarios: mc.checkpoint every this many steps")
parser.add_argument("--residuals", default="fold", choices=("fold", "drop"), help="torchrun scenarios: on 3 ranks")
parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "HOSTS"), help=argparse.SUPPRESS)
parser.add_argument("--torchrun-worker", nargs=3, metavar=("CONFIG", "OUT", "CHECKPOINTS"), help=argparse.SUPPRESS)


class Training:
    """What every worker trains, in either launcher: the model, the wrapped AdamW, the data, the
    LR schedule; :meth:`step` trains step ``step`` on rank ``rank``'s batch."""

    def __init__(self, config: str, args) -> None:
        torch.manual_seed(args.seed)
        self.args = args
        self.model = make_gpt2()
        self.opt, _, _ = wrap_adamw(self.model, f"{config}@auto", args.steps, None, groups=2, lr=args.lr)
        self.lr_at = schedule(args.steps)
        self.train, held = load_stdlib_bytes()
        starts = torch.linspace(0, len(held) - LM_CONTEXT - 1, 64).long()
        self.held_out = torch.stack([held[s:s + LM_CONTEXT] for s in starts])

    def step(self, step: int, rank: int, size: int) -> None:
        """With ``--keep-global-batch`` and ``size`` dividing 4, rank ``rank`` trains on the
        batches of the 4-worker job's ranks ``rank * 4 // size`` on (as one batch: its mean loss
        is their losses' mean), else on its own."""
        for group in self.opt.param_groups:
            group["lr"] = self.args.lr * self.lr_at(step)
        share = 4 // size if self.args.keep_global_batch and 4 % size == 0 else 1
        picks = []
        for virtual in range(rank * share, (rank + 1) * share):
            generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step * 1009 + virtual)
            picks += torch.randint(len(self.train) - LM_CONTEXT, (LM_BATCH,), generator=generator).tolist()
        windows = torch.stack([self.train[s:s + LM_CONTEXT] for s in picks])
        self.opt.zero_grad()
        self.model(input_ids=windows, labels=windows).loss.backward()
        self.opt.step()

    @torch.no_grad()
    def evaluate(self) -> float:
        return self.model(input_ids=self.held_out, labels=self.held_out).loss.item()

    def notes(self, out: str, host: Optional[str], mc) -> Callable[..., None]:
        """A function that appends one event, with the parameters' sum, to ``OUT/<pid>.jsonl``."""
        log = open(os.path.join(out, f"{os.getpid()}.jsonl"), "a")

        def note(**fields) -> None:
            params = float(sum(p.detach().double().sum() for p in self.model.parameters()))
            log.write(json.dumps({"pid": os.getpid(), "time": time.time(), "host": host, "rank": mc.rank(),
                                  "size": mc.size(), "params": params, **fields}) + "\n")
            log.flush()

        return note


def horovod_worker(config: str, out: str, hosts: str, args) -> None:
    """One elastic Horovod worker: trains, commits every step, notes its syncs and its first step
    after each; every rank keeps the evaluations in the state (equal parameters, equal losses),
    so whichever is rank 0 after a reset syncs them."""
    import mergecomp.torch as hvd

    hvd.init()
    training = Training(config, args)
    here = os.environ.get("HOROVOD_HOSTNAME")
    note = training.notes(out, here, hvd)

    @hvd.elastic.run
    def run(state):
        note(event="sync", step=state.step)
        first = True
        while state.step < args.steps:
            if args.lose_at and state.step == args.lose_at and here == LOST_HOST:
                note(event="exit", step=state.step)
                os._exit(1)
            training.step(state.step, hvd.rank(), hvd.size())
            state.step += 1
            if first:
                note(event="stepped", step=state.step)
                first = False
            if state.step % EVAL_EVERY == 0:
                state.curve = state.curve + [(state.step, training.evaluate())]
            if args.add_at and state.step == args.add_at and hvd.rank() == 0 and hvd.size() < 4:
                with open(hosts, "a") as f:
                    f.write(f"{socket.gethostname()}:2\n")
                note(event="add", step=state.step)
                deadline = time.monotonic() + 120
                while state._host_messages.empty() and time.monotonic() < deadline:  # as Horovod's own test
                    time.sleep(0.05)
            state.commit()
        note(event="done", step=state.step, curve=state.curve if hvd.rank() == 0 else None)

    run(hvd.elastic.TorchState(training.model, training.opt, step=0, curve=[]))


def torchrun_worker(config: str, out: str, checkpoints: str, args) -> None:
    """One worker of a torchrun job with elastic restarts: resumes from the latest
    ``mc.checkpoint`` (on whatever number of ranks it now has), saves one every
    ``--save-every`` steps; the worker of the agent started with ``BENCH_ELASTIC_VICTIM=1``
    kills its agent and itself at ``--lose-at`` (a lost node)."""
    import mergecomp.torch as mc

    mc.init()
    training = Training(config, args)
    note = training.notes(out, os.environ.get("GROUP_RANK"), mc)
    latest = os.path.join(checkpoints, "latest")
    step, curve = 0, []
    if os.path.exists(latest):
        with open(latest) as f:
            extra = mc.checkpoint.load(f.read().strip(), training.model, training.opt, residuals=args.residuals)
        step, curve = extra["step"], extra["curve"]
    note(event="sync", step=step)
    first = True
    while step < args.steps:
        if args.lose_at and step == args.lose_at and os.environ.get("BENCH_ELASTIC_VICTIM") == "1":
            note(event="exit", step=step)
            os.kill(os.getppid(), signal.SIGKILL)  # the node's agent
            os._exit(1)
        training.step(step, mc.rank(), mc.size())
        step += 1
        if first:
            note(event="stepped", step=step)
            first = False
        if step % EVAL_EVERY == 0:
            curve = curve + [(step, training.evaluate())]
        if step % args.save_every == 0:
            path = os.path.join(checkpoints, f"step{step}")
            mc.checkpoint.save(path, training.model, training.opt, step=step, curve=curve)
            if mc.rank() == 0:  # every rank has written once save returns on rank 0
                with open(latest + ".new", "w") as f:
                    f.write(path)
                os.replace(latest + ".new", latest)
    note(event="done", step=step, curve=curve if mc.rank() == 0 else None)


def _worker_args(args, lose: bool, add: bool) -> List[str]:
    return [os.path.abspath(__file__), "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(args.seed),
            "--lose-at", str(args.lose_at if lose else 0), "--add-at", str(args.add_at if add else 0),
            "--save-every", str(args.save_every), "--residuals", args.residuals,
            *(["--keep-global-batch"] if args.keep_global_batch else [])]


def _horovodrun(config: str, scenario: str, args, folder: str, out: str) -> int:
    """A horovodrun elastic job (``steady`` or ``4-2-4``); its exit status."""
    hosts, discover = os.path.join(folder, "hosts"), os.path.join(folder, "discover.sh")
    with open(hosts, "w") as f:
        f.write(f"localhost:2\n{LOST_HOST}:2\n")
    with open(discover, "w") as f:
        f.write(f"#!/bin/bash\ncat {hosts}\n")
    os.chmod(discover, 0o755)
    changes = scenario != "steady"
    command = ["horovodrun", "-np", "4", "--min-np", "2", "--max-np", "4", "--network-interface", "lo",
               "--host-discovery-script", discover, sys.executable, *_worker_args(args, changes, changes),
               "--worker", config, out, hosts]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.job_timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
    return done.returncode


def _torchrun(config: str, scenario: str, args, folder: str, out: str) -> int:
    """Four torchrun agents of one process each (``--nnodes 3:4``, c10d rendezvous on this
    machine, agent 0 its host), ``torchrun-steady`` or ``torchrun-4-3`` (agent 3's worker kills
    its agent at ``--lose-at``; the others restart on 3 nodes from the latest checkpoint); the
    first surviving agent's exit status."""
    checkpoints = os.path.join(folder, "checkpoints")
    os.mkdir(checkpoints)
    port = free_port()
    agents = []
    for node in range(4):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3:4", "--nproc_per_node", "1",
                   "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "bench_elastic",
                   "--rdzv_conf", f"is_host={str(node == 0).lower()},last_call_timeout=2", "--max-restarts", "10",
                   "--monitor-interval", "0.5", *_worker_args(args, scenario != "torchrun-steady", False),
                   "--torchrun-worker", config, out, checkpoints]
        victim = "1" if node == 3 and scenario != "torchrun-steady" else "0"
        agents.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1", "BENCH_ELASTIC_VICTIM": victim,
                                            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))
        if node == 0:
            time.sleep(1)  # the rendezvous host binds its port first
    try:
        outputs = [agent.communicate(timeout=args.job_timeout)[0] for agent in agents]
    except subprocess.TimeoutExpired:  # a restart that never trained again: stop every agent and its workers
        import psutil  # torchrun starts its workers in sessions of their own

        for agent in agents:
            with contextlib.suppress(psutil.NoSuchProcess):
                for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
        outputs = [agent.communicate()[0] for agent in agents]
    codes = [agent.returncode for agent in agents]
    if any(code for code in codes[:3]):
        print(*(o[-2000:] for o in outputs), file=sys.stderr)
    return max(codes[:3], key=abs)


def launch(config: str, scenario: str, args) -> dict:
    """One job of ``scenario``; its record."""
    folder = tempfile.mkdtemp(prefix="bench_elastic_")
    out = os.path.join(folder, "out")
    os.mkdir(out)
    began = time.monotonic()
    job = _torchrun if scenario.startswith("torchrun") else _horovodrun
    returncode = job(config, scenario, args, folder, out)
    wall = time.monotonic() - began
    notes = sorted((json.loads(line) for name in os.listdir(out) for line in open(os.path.join(out, name))),
                   key=lambda n: n["time"])
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
    record = {"config": config, "scenario": scenario, "seed": args.seed, "steps": args.steps, "returncode": returncode,
              "worlds": worlds, "ranks_identical": identical, "wall_s": wall, "load": os.getloadavg()[0],
              "curve": curve, "final_test_loss": statistics.fmean(loss for _, loss in curve[-4:]) if curve else None}
    if scenario.startswith("torchrun"):
        record.update(save_every=args.save_every, residuals=args.residuals)
    if args.keep_global_batch:
        record["global_batch"] = "kept"
    exits = [n for n in notes if n["event"] == "exit"]
    if exits:
        lost = exits[0]["time"]
        after = [n for n in notes if n["time"] > lost and n["size"] < 4]
        record["lose_at"] = exits[0]["step"]
        synced = [n for n in after if n["event"] == "sync"]
        stepped = [n for n in after if n["event"] == "stepped"]
        if not stepped:  # it never trained again
            record["status"] = "did not train again"
            return record
        record["kill_to_sync_s"] = min(n["time"] for n in synced) - lost
        record["kill_to_step_s"] = min(n["time"] for n in stepped) - lost
        record["resumed_at"] = min(n["step"] for n in synced)
    adds = [n for n in notes if n["event"] == "add"]
    if adds:
        grown = [n for n in notes if n["time"] > adds[0]["time"] and n["size"] == 4]
        record["add_at"] = adds[0]["step"]
        record["add_to_step_s"] = min(n["time"] for n in grown if n["event"] == "stepped") - adds[0]["time"]
    return record


def main() -> None:
    args = parser.parse_args()
    if args.worker:
        return horovod_worker(*args.worker, args)
    if args.torchrun_worker:
        return torchrun_worker(*args.torchrun_worker, args)
    from mergecomp_bench.records import append, provenance

    made_by = provenance()
    for config in args.configs.split(","):
        finals = {}
        for scenario in args.scenarios.split(","):
            record = launch(config, scenario, args)
            finals[scenario] = record["final_test_loss"] if record.get("status", "ok") == "ok" else None
            shown = {k: v for k, v in record.items() if k != "curve"}
            print(json.dumps(shown), flush=True)
            if args.json:
                append(args.json, record, made_by)
        if None not in finals.values() and "steady" in finals and len(finals) > 1:
            for scenario, loss in finals.items():
                print(f"# {config} {scenario}: {loss:.4f} ({100 * (loss / finals['steady'] - 1):+.2f} % vs steady)")


if __name__ == "__main__":
    main()
