"""An elastic Horovod training script (``hvd.elastic``), run by tests/test_elastic.py under
``horovodrun --min-np 1 --max-np 3 --host-discovery-script``.

    python elastic_train.py OUT HOSTS --compression topk --steps 16 --grow-at 4 --fail-at 10

Rank 0 rewrites the file ``HOSTS`` (which the discovery script prints) at ``--grow-at`` to add a
host of one slot: every rank raises HostsUpdatedInterrupt at that commit and a third worker
joins.  At ``--fail-at`` the worker that joined exits at once (``os._exit``, no goodbye), so
the others' collectives fail and they go back to their last commit.  Each process appends
JSON lines to ``OUT/<pid>.jsonl``: ``{"at": "commit", ...}`` with what each commit saves and
``{"at": "sync", ...}`` each time the training function starts (after a sync), with the step,
rank, size and digests of the parameters, of this rank's error-feedback memory and of the
compressor's state.
"""
import os

import torch
from elastic_schedule import digest, grow, options as elastic_options, parser, write

import mergecomp.torch as hvd

parser = parser()
parser.add_argument("--adamw", action="store_true", help="AdamW, its momentum exchanged")
args = parser.parse_args()

hvd.init()
joined = hvd.size() == 3  # the third worker starts in a world of three
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
options = elastic_options(args.compression)
if args.adamw:  # 1-bit Adam's scheme: AdamW's momentum exchanged after 2 updates, the variance frozen
    inner = torch.optim.AdamW(model.parameters(), lr=0.01 * hvd.size())
    options.update(exchange_momentum_after=2)
else:
    inner = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **options)
BASE_LR = opt.param_groups[0]["lr"] / hvd.size()


def record(state, at: str) -> None:
    merged = opt.merged.state_dict()
    line = {"at": at, "pid": os.getpid(), "joined": joined, "step": state.step, "rank": hvd.rank(),
            "size": hvd.size(), "params": float(sum(p.detach().double().sum() for p in model.parameters())),
            "memory": digest(merged["memory"]), "compressor": digest(merged["compressor"]),
            "merged_step": merged["step"], "lr": opt.param_groups[0]["lr"]}
    write(args.out, line)


@hvd.elastic.run
def train(state):
    record(state, "sync")
    while state.step < args.steps:
        if args.fail_at and state.step == args.fail_at and joined:
            os._exit(1)
        generator = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x = torch.randn(8, 16, generator=generator)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        if args.grow_at and state.step == args.grow_at and hvd.rank() == 0:
            grow(state, args.hosts)
        record(state, "commit")
        state.commit()


def on_reset():
    for group in opt.param_groups:
        group["lr"] = BASE_LR * hvd.size()


state = hvd.elastic.TorchState(model, opt, step=0)
state.register_reset_callbacks([on_reset])
train(state)
