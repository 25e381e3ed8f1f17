"""Run a function on N real processes joined by a gloo process group over loopback.

``run_workers(fn, world_size, *args)`` runs ``fn(rank, *args)`` on ``world_size`` processes
that set torchrun's environment variables and called ``mergecomp.torch.init()``; the results
come back in rank order.  The group is gloo's even where CUDA is available (``conftest.py`` sets
``MERGECOMP_TORCH_BACKEND=gloo``: ``init`` would pick NCCL, which takes one GPU per rank);
``env={"MERGECOMP_TORCH_BACKEND": "nccl"}`` asks for NCCL, each rank on the GPU of its local
rank.  A worker that raises makes the call raise with its traceback; a run that exceeds
``timeout`` seconds is killed and fails the test (never a hang).  The processes are pooled
between calls (see :func:`run_workers`): each test seeds what it needs.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, Dict, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEFAULT_ENV = {"MERGECOMP_TIMEOUT": "60"}


def _join_group(rank, world_size, port, env):
    local_size = int(env.get("LOCAL_WORLD_SIZE", world_size))  # hosts of that many ranks, host by host
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank % local_size), "WORLD_SIZE": str(world_size), **env})
    import torch

    import mergecomp.torch as mc

    torch.set_num_threads(1)
    if os.environ.get("MERGECOMP_TORCH_BACKEND") == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mc.init(engine="torch")
    return mc


def _call(fn, rank, args):
    """``(ok, payload)``: the pickled result, or the formatted traceback."""
    try:
        # Plain pickle: torch's queue reducers would share tensor memory with a process about to exit.
        return True, pickle.dumps(fn(rank, *args))
    except BaseException:  # report everything, including FloatingPointError from the library
        return False, traceback.format_exc()


def _worker(fn, rank, world_size, port, args, results, env):
    mc = None
    try:
        mc = _join_group(rank, world_size, port, env)
        results.put((0, rank, *_call(fn, rank, args), False))
    except BaseException:
        results.put((0, rank, False, traceback.format_exc(), False))
    finally:
        if mc is not None:
            mc.shutdown()


def _serve(rank, world_size, port, tasks, results):
    """A pooled worker: joins the group once, then runs ``(task_id, fn, args)`` items until it
    gets None, or until a task fails or leaves the runtime shut down (the pool is then retired)."""
    mc = None
    try:
        mc = _join_group(rank, world_size, port, DEFAULT_ENV)
        import torch

        while (item := tasks.get()) is not None:
            task_id, fn, args = item
            torch.set_num_threads(1)
            ok, payload = _call(fn, rank, args)
            reusable = ok and mc.is_initialized()
            results.put((task_id, rank, ok, payload, reusable))
            if not reusable:
                break
    except BaseException:
        results.put((-1, rank, False, traceback.format_exc(), False))
    finally:
        if mc is not None and mc.is_initialized():
            mc.shutdown()


class _Pool:
    """``world_size`` processes joined once in a gloo group, reused by every ``run_workers`` call
    of that size without ``env``: importing torch and joining the group cost seconds per launch."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.next_task = 1

    def run(self, fn, args, timeout: float) -> dict:
        task_id, self.next_task = self.next_task, self.next_task + 1
        for q in self.tasks:
            q.put((task_id, fn, args))
        return _collect(self.results, self.world_size, timeout, task_id)

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
        _stop(self.procs, wait=10 if graceful else 0)


_POOLS: Dict[int, _Pool] = {}


def _collect(results, world_size: int, timeout: float, task_id: int) -> dict:
    collected = {}
    while len(collected) < world_size:
        try:
            got_id, rank, ok, value, reusable = results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"workers did not finish within {timeout}s; got ranks {sorted(collected)}") from None
        if got_id in (task_id, -1):
            collected[rank] = (ok, value, reusable)
    return collected


def _stop(procs, wait: float) -> None:
    for p in procs:
        p.join(timeout=wait)
        if p.is_alive():
            p.kill()
            p.join()


def run_workers(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180,
                env: dict = None) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` ranks of a gloo group; the results in rank order.

    Without ``env`` the ranks come from a pool kept for the session (set
    ``MERGECOMP_TEST_FRESH=1`` for fresh processes every call); a call that fails, times out or
    shuts the runtime down retires its pool.  With ``env`` (variables for the workers, e.g. a
    short ``MERGECOMP_TIMEOUT``) fresh processes run the call; ``LOCAL_WORLD_SIZE=L`` there
    makes hosts of ``L`` consecutive ranks (``LOCAL_RANK = rank % L``, as torchrun numbers them).
    """
    if env is None and not os.environ.get("MERGECOMP_TEST_FRESH"):
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = _Pool(world_size)
        try:
            collected = pool.run(fn, args, timeout)
        except BaseException:
            _POOLS.pop(world_size).close(graceful=False)
            raise
        if not all(reusable for _, _, reusable in collected.values()):
            _POOLS.pop(world_size).close(graceful=all(ok for ok, _, _ in collected.values()))
    else:
        collected = _fresh(fn, world_size, args, timeout, {**DEFAULT_ENV, **(env or {})})
    failures = {r: v for r, (ok, v, _) in collected.items() if not ok}
    if failures:
        raise WorkerError(failures)
    return [pickle.loads(collected[r][1]) for r in range(world_size)]


def _fresh(fn, world_size: int, args, timeout: float, env: dict) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(results, world_size, timeout, 0)
    finally:
        _stop(procs, wait=10)


class WorkerError(AssertionError):
    """One or more workers raised; ``tracebacks`` maps rank -> formatted traceback."""

    def __init__(self, tracebacks):
        self.tracebacks = tracebacks
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__(f"worker(s) {sorted(tracebacks)} failed:\n{text}")
