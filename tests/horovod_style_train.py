"""A training script written as for Horovod, with mergecomp imported in its place (used by
tests/test_horovod_script.py; not a test module)::

    torchrun --nproc_per_node 2 tests/horovod_style_train.py OUT_DIR
    horovodrun --gloo -np 2 -H localhost:2 python tests/horovod_style_train.py OUT_DIR

For each of ``hvd.Compression.none``, ``fp16`` and ``topk`` it trains a tiny classifier for
``STEPS`` steps, each rank on its shard of one fixed batch (``DistributedSampler``), and writes
``OUT_DIR/rank<r>.json``: rank, size, local rank, the engine mergecomp chose, and per
compression the flat parameters after training and the rank-averaged loss of every step.
"""
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mergecomp.torch as hvd

BATCH = 32  # the whole data set: one step per epoch on every rank
STEPS = 6
LR = 0.1
MOMENTUM = 0.9


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def train(compression, loader) -> dict:
    model = make_model(seed=1 + hvd.rank())  # rank 0's weights reach every rank by broadcast
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    losses = []
    for _ in range(STEPS):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # the first one accumulates into the zeros broadcast_optimizer_state left
            opt.step()
            opt.zero_grad()
            losses.append(hvd.allreduce(loss.detach(), name="loss").item())
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
            "losses": losses}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    hvd.init()
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = DataLoader(data, batch_size=BATCH // hvd.size(), sampler=sampler)
    runs = {name: train(getattr(hvd.Compression, name), loader) for name in ("none", "fp16", "topk")}
    record = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
              "engine": hvd.communicator().engine,  # mergecomp's own (not a Horovod name), for the test
              "runs": runs}
    path = os.path.join(out_dir, f"rank{hvd.rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    # no hvd.shutdown(), as in Horovod's examples: mergecomp leaves the group at exit


if __name__ == "__main__":
    main(sys.argv[1])
