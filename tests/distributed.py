"""Run a function on N real processes joined by a gloo process group over loopback.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes; each sets torchrun's
environment variables, calls ``mergecomp.torch.init()`` and returns ``fn(rank, *args)``.  The
results come back in rank order.  A worker that raises makes the call raise with its traceback;
a run that exceeds ``timeout`` seconds is killed and fails the test (never a hang).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, env):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), **env})
    import torch

    import mergecomp.torch as mc

    torch.set_num_threads(1)
    try:
        mc.init(engine="torch")
        # Plain pickle: torch's queue reducers would share tensor memory with a process about to exit.
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # report everything, including FloatingPointError from the library
        results.put((rank, False, traceback.format_exc()))
    finally:
        mc.shutdown()


def run_workers(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180,
                env: dict = None) -> List[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"MERGECOMP_TIMEOUT": "60", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected = {}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"workers did not finish within {timeout}s; got ranks {sorted(collected)}") from None
            collected[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in collected.items() if not ok}
    if failures:
        raise WorkerError(failures)
    return [pickle.loads(collected[r][1]) for r in range(world_size)]


class WorkerError(AssertionError):
    """One or more workers raised; ``tracebacks`` maps rank -> formatted traceback."""

    def __init__(self, tracebacks):
        self.tracebacks = tracebacks
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__(f"worker(s) {sorted(tracebacks)} failed:\n{text}")
