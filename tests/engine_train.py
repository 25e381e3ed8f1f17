"""One training script for every launcher (used by tests/test_engines.py).

    torchrun --nproc_per_node 2 tests/engine_train.py
    mpirun -np 2 python tests/engine_train.py
    horovodrun -np 2 --gloo python tests/engine_train.py

Each rank prints lines ``MCJSON {...}`` (launchers prefix output lines; parse from the marker)
and, with ``--out DIR``, appends the full records (with ``params``) to ``DIR/rank<r>.jsonl``:

* ``--mode train`` (default): ``{"kind": "collectives", ...}`` (a self-check of the engine's
  collectives: dtypes incl. bf16/fp16, strided tensors, allgather, broadcast, all-to-all), then
  for each ``--schemes`` entry and compressor ``{"kind": "train", "compressor", "scheme",
  "params": [...flat parameters...]}`` after ``--steps`` steps with fixed groups (deterministic given the seed: qsgd draws from torch's
  generator, seeded per rank).
  With ``--out``, then a timeout check: rank 0 waits 1.5 s for an allreduce the other ranks
  have not joined yet and reports ``{"kind": "timeout", "error": "...", "recovered": bool}``:
  the error, and whether the same collective completed once they joined (after a marker file).
* ``--mode collectives``: the ``collectives`` record only.
* ``--mode init``: ``{"kind": "init", "engine", "rank", "size", "local_rank"}`` or, when
  ``mc.init`` raises, ``{"kind": "error", "error": "..."}`` and exit status 3.
"""
import argparse
import functools
import json
import os
import sys
import time
from typing import Optional

import torch

import mergecomp.torch as mc

COMPRESSORS = "none,fp16,topk,signsgd,qsgd"


_OUT = None


def emit(**record) -> None:
    """Print ``record`` (without its long ``params``) and append all of it to ``--out``'s file."""
    short = {k: v for k, v in record.items() if k != "params"}
    sys.stdout.flush()
    # One write(2) of a short line: atomic on a pipe, so the ranks' lines never interleave.
    os.write(1, ("MCJSON " + json.dumps(short) + "\n").encode())
    if _OUT is not None:
        with open(_OUT, "a") as f:
            f.write(json.dumps(record) + "\n")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_data(rank: int, world: int, batch: int = 32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    per = batch // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train(compressor: str, steps: int, seed: int, scheme=None):
    rank, world = mc.rank(), mc.size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = mc.DistributedOptimizer(opt, model.named_parameters(), compression=compressor, groups=2, scheme=scheme)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = make_data(rank, world)
    torch.manual_seed(seed + rank)  # qsgd's stochastic rounding: deterministic given the seed
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_diloco(steps: int) -> torch.Tensor:
    """Streaming DiLoCo (top-k, 2 fragments, H = 4, the exchange in flight for one step) around
    AdamW, then every fragment synchronized: the flat parameters, the same on every rank."""
    rank, world = mc.rank(), mc.size()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=4, compression="topk", fragments=2,
                       fragment_sync_delay=1)
    x, y = make_data(rank, world)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    diloco.sync()
    diloco.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _expect(failures: list, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Append to ``failures`` unless ``got`` equals ``want`` exactly, in dtype and shape too."""
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        failures.append(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()} ({want.dtype})")


def check_collectives(comm) -> list:
    """Failures (strings) of a self-check of ``comm``'s collectives; empty when all is well."""
    rank, size = comm.rank, comm.size
    ranks_sum = size * (size - 1) / 2
    failures = []
    expect = functools.partial(_expect, failures)

    # Values whose sums are exact in every dtype used (bf16 has 8 significant bits).
    base = torch.tensor([[1.5, -2.25], [1024.0, 0.0078125]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = (base * (rank + 1)).to(dtype)
        out = comm.allreduce_(t, f"allreduce {dtype}")
        expect(f"allreduce {dtype}", t, (base * (ranks_sum + size)).to(dtype))
        if out is not t:
            failures.append(f"allreduce {dtype} did not return the tensor it was given")
    for dtype in (torch.int32, torch.int64, torch.uint8):
        t = torch.full((5,), rank + 1, dtype=dtype)
        comm.allreduce_(t, f"allreduce {dtype}")
        expect(f"allreduce {dtype}", t, torch.full((5,), int(ranks_sum + size), dtype=dtype))
    strided = torch.arange(12.0).view(3, 4).t()
    comm.allreduce_(strided, "allreduce strided")
    expect("allreduce strided", strided, torch.arange(12.0).view(3, 4).t() * size)
    empty = torch.empty(0)
    comm.allreduce_(empty, "allreduce empty")

    for dtype in (torch.bfloat16, torch.int64, torch.uint8, torch.float32):
        t = torch.tensor([rank, rank + 0.5, 3]).to(dtype)
        out = comm.allgather(t, f"allgather {dtype}")
        want = torch.stack([torch.tensor([r, r + 0.5, 3]).to(dtype) for r in range(size)])
        expect(f"allgather {dtype}", out, want)

    root = size - 1
    t = torch.full((2, 3), float(rank), dtype=torch.bfloat16)
    comm.broadcast_(t, root)
    expect("broadcast bf16", t, torch.full((2, 3), float(root), dtype=torch.bfloat16))
    t = torch.tensor(rank + 7, dtype=torch.int64)
    comm.broadcast_(t, root)
    expect("broadcast 0-d int64", t, torch.tensor(root + 7, dtype=torch.int64))
    return failures + check_alltoall(comm) + check_split_hosts(comm)


def check_split_hosts(comm) -> list:
    """Failures of a self-check of the per-host communicators: ``split_hosts()`` (on one host,
    this communicator and a single process), and on one host the engine's own groups for hosts
    of all the ranks (every rank in the host's group, alone in its group across hosts), each
    allgathering the ranks; Horovod's NotImplementedError without dynamic process sets."""
    rank, size, local_size = comm.rank, comm.size, comm.local_size
    failures = []
    expect = functools.partial(_expect, failures)
    sizes = [c.size for c in comm.split_hosts()]
    if sizes != [local_size, size // local_size]:
        failures.append(f"split_hosts() on hosts of {local_size} of {size} ranks: sizes {sizes}")
    if local_size != size:
        return failures
    try:
        local, cross = comm._split_hosts(size)
    except NotImplementedError as err:
        if comm.engine != "horovod" or "HOROVOD_DYNAMIC_PROCESS_SETS=1" not in str(err):
            failures.append(f"split_hosts: {err}")
        return failures
    mine = torch.tensor([rank])
    expect("allgather inside the host", local.allgather(mine, "allgather inside the host"),
           torch.arange(size).view(-1, 1))
    expect("allgather across hosts", cross.allgather(mine, "allgather across hosts"), mine.view(1, 1))
    local.close()
    cross.close()
    return failures


def check_alltoall(comm) -> list:
    """Failures of a self-check of ``comm``'s all-to-all (dtypes; blocks of 0, 1 and 5 elements;
    the error for a size that does not divide) and of ``mc.alltoall`` with uneven splits on it."""
    rank, size = comm.rank, comm.size
    failures = []
    expect = functools.partial(_expect, failures)
    for dtype in (torch.bfloat16, torch.int64, torch.uint8, torch.float32):
        for block in (0, 1, 5):
            # element k of the block for rank d is 25 * rank + 5 * d + k: distinct, and exact in
            # every dtype up to 4 ranks (< 100)
            t = torch.tensor([25 * rank + 5 * d + k for d in range(size) for k in range(block)]).to(dtype)
            want = torch.tensor([[25 * s + 5 * rank + k for k in range(block)] for s in range(size)]).to(dtype)
            expect(f"alltoall {dtype} block {block}", comm.alltoall(t, f"alltoall {dtype}"), want.view(size, block))
    try:
        comm.alltoall(torch.zeros(size + 1), "alltoall of size + 1 elements")
        failures.append("alltoall of size + 1 elements did not raise")
    except ValueError as err:
        if f"rank {rank} of {size}" not in str(err) or f"{size + 1} elements" not in str(err):
            failures.append(f"alltoall of size + 1 elements: unclear error {err}")
    splits = [(d + rank) % 3 for d in range(size)]  # a row is (sender, destination, index)
    rows = torch.tensor([[rank, d, i] for d in range(size) for i in range(splits[d])], dtype=torch.bfloat16)
    out, received = mc.alltoall(rows.view(-1, 3), splits=splits, name="rows")
    want = torch.tensor([[s, rank, i] for s in range(size) for i in range((rank + s) % 3)], dtype=torch.bfloat16)
    expect("mc.alltoall rows", out, want.view(-1, 3))
    expect("mc.alltoall received splits", received, torch.tensor([(rank + s) % 3 for s in range(size)]))
    return failures


def error_of(call) -> Optional[str]:
    """The exception ``call()`` raises, as ``"Type: message"``; None when it returns."""
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_timeout(comm, marker: str, seconds: float = 1.5) -> None:
    """Rank 0 times out on an allreduce the others join only after ``marker`` exists; then the
    same handle, waited again, completes."""
    t = torch.ones(4)
    if comm.rank == 0:
        saved, comm.timeout = comm.timeout, seconds
        handle = comm.allreduce_async(t)  # the handle keeps the short timeout
        comm.timeout = saved
        error = error_of(lambda: handle.wait("the lonely allreduce"))
        open(marker, "w").close()
        recovered = False
        for _ in range(40):  # the others join now: the collective completes after all
            try:
                result = handle.wait("the joined allreduce")
                recovered = bool(torch.equal(result, torch.full((4,), float(comm.size))))
                break
            except Exception:
                continue
        emit(kind="timeout", rank=0, error=error, recovered=recovered)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        comm.allreduce_(t, "the late allreduce")


def main(argv=None) -> int:
    global _OUT
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="auto")
    p.add_argument("--mode", default="train", choices=["train", "collectives", "init"])
    p.add_argument("--compressors", default=COMPRESSORS)
    p.add_argument("--schemes", default="default",
                   help="comma list of the optimizer's scheme option per training run (default: None)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", help="folder for rank<r>.jsonl with the full records (stdout lines of two "
                                 "ranks can interleave when long)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        comm = mc.init(engine=args.engine)
    except Exception as err:  # report it: the test asserts on the message
        emit(kind="error", error=f"{type(err).__name__}: {err}")
        return 3
    rank = comm.rank
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _OUT = os.path.join(args.out, f"rank{rank}.jsonl")
    if args.mode == "init":
        emit(kind="init", engine=comm.engine, rank=rank, size=comm.size, local_rank=mc.local_rank())
    else:
        emit(kind="collectives", engine=comm.engine, rank=rank, size=comm.size,
             local_rank=mc.local_rank(), failures=check_collectives(comm))
    if args.mode == "train":
        for scheme in args.schemes.split(","):
            for name in args.compressors.split(","):
                flat = train(name, args.steps, args.seed, None if scheme == "default" else scheme)
                emit(kind="train", engine=comm.engine, rank=rank, compressor=name, scheme=scheme,
                     params=flat.tolist(), checksum=float(flat.double().sum()))
        flat = train_diloco(args.steps)
        emit(kind="diloco", engine=comm.engine, rank=rank, params=flat.tolist())
        if args.out:
            check_timeout(comm, os.path.join(args.out, "rank0-timed-out"))
    mc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
