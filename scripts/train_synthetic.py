"""
Synthetic data-parallel training with merged gradient compression (after Horovod's
pytorch_synthetic_benchmark.py).  Each rank trains on one fixed random batch of 32x32 images,
so the loss falls (the model memorises it) and the throughput reflects compute + exchange only.
By default (--groups auto) the merge scheduler searches the plan during the untimed first steps;
the timed steps run the plan it chose, and the last lines say which.

Two workers on one machine (gloo on CPU, NCCL on GPUs):

    torchrun --nproc_per_node 2 scripts/train_synthetic.py
    torchrun --nproc_per_node 2 scripts/train_synthetic.py --model convnet --compression dgc --groups 2
    torchrun --nproc_per_node 2 scripts/train_synthetic.py --compression topk -C ratio=0.05 --groups layerwise

One process (mc.init() picks the local engine, no communication):

    python scripts/train_synthetic.py
"""
import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mergecomp
import mergecomp.torch as mc
from mergecomp.compressor_args import keyword_args

# -----------------------------------------------------------------------------
# defaults
model_name = "mlp"          # mlp | convnet
compression = "topk"        # any of mergecomp.compressor_names()
memory = None               # None = the compressor's default error-feedback memory
groups = "auto"             # auto (scheduler) | layerwise | <int> number of merged groups | default (25 MB groups)
batch_size = 32             # per worker
steps = 40                  # timed steps
warmup_steps = 5            # untimed steps first (with --groups auto: until the scheduler's search ends)
max_search_steps = 100      # --groups auto: give up waiting for the search after this many steps
lr = 0.01                   # scaled by the world size
threads = 1                 # torch.set_num_threads per worker
seed = 1337
num_classes = 10
# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=model_name, choices=["mlp", "convnet"])
    p.add_argument("--compression", default=compression,
                   help=f"compressor name, one of: {', '.join(mergecomp.compressor_names())}")
    p.add_argument("-C", "--compressor-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the compressor, e.g. -C ratio=0.05 (repeatable)")
    p.add_argument("--memory", default=memory,
                   help=f"error-feedback memory, one of: {', '.join(mergecomp.memory_names())} "
                        f"(default: the compressor's own)")
    p.add_argument("--groups", default=groups,
                   help="'auto' (the scheduler searches the plan online), 'layerwise', a number of groups, "
                        "or 'default' (groups of about 25 MB)")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup-steps", type=int, default=warmup_steps)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--seed", type=int, default=seed)
    args = p.parse_args(argv)
    if args.groups == "default":
        args.groups = None
    elif args.groups not in ("auto", "layerwise"):
        try:
            args.groups = int(args.groups)
        except ValueError:
            p.error(f"--groups must be 'auto', 'layerwise', an int or 'default', got {args.groups!r}")
    args.compressor_kwargs = keyword_args(args.compressor_arg)
    return args


# -----------------------------------------------------------------------------
# models (32x32x3 inputs)

class MLP(nn.Module):
    def __init__(self, num_classes=num_classes, hidden=1024):
        super().__init__()
        self.fc1 = nn.Linear(3 * 32 * 32, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    """A small ResNet (ResNet-18 layout, 1 block per stage, narrow widths) for 32x32 inputs."""

    def __init__(self, num_classes=num_classes, widths=(16, 32, 64, 128)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(BasicBlock(cin, w, stride=1 if i == 0 else 2))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


MODELS = {"mlp": MLP, "convnet": ConvNet}


# -----------------------------------------------------------------------------
# what the scheduler chose

def group_codecs(optimizer, compression):
    """The codec of every current group: the compressor's name, 'fp16' or 'none'."""
    chosen = optimizer.schedule_report().get("chosen") or {}
    codecs = list(chosen.get("codecs") or [])
    if len(codecs) != len(optimizer.groups):
        codecs = ["compressed"] * len(optimizer.groups)
    return [compression if c == "compressed" else c for c in codecs]


def wire_bits_per_element(compressor, codec, numel):
    if codec == "fp16":
        return 16
    if codec == "none":
        return 32
    return mergecomp.bits_per_element(compressor, numel)


def describe_schedule(report, compression):
    """Two lines on the scheduler's search and the plan it chose (``opt.schedule_report()``)."""
    chosen = report.get("chosen")
    if not chosen:
        return f"scheduler: phase {report['phase']} after {report['steps']} steps, no plan chosen yet"
    sizes = " + ".join(f"{b / 1e6:.1f}" for b in chosen["sizes"])
    codecs = ", ".join(compression if c == "compressed" else c for c in chosen["codecs"])
    predicted = chosen.get("predicted_s")
    return (f"scheduler: searched {report['search_steps']} steps, measured {len(report['candidates'])} "
            f"candidate plans, now in phase '{report['phase']}'\n"
            f"scheduler chose: {chosen['groups']} group{'s' if chosen['groups'] != 1 else ''} of {sizes} MB, "
            f"codecs [{codecs}], "
            f"{1e3 * chosen['measured_s']:.1f} ms/step measured"
            + (f" ({1e3 * predicted:.1f} predicted)" if predicted else "")
            + f"; candidate '{chosen['source']}'")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    mc.init()
    rank, world = mc.rank(), mc.size()
    master = rank == 0

    def log(*parts):
        if master:
            print(*parts, flush=True)

    torch.manual_seed(args.seed)  # same initial weights everywhere (broadcast below anyway)
    model = MODELS[args.model]()
    compressor = mergecomp.get_compressor(args.compression, **args.compressor_kwargs)
    memory_name = args.memory or compressor.default_memory
    # The 'dgc' memory applies momentum correction itself: no second momentum in the optimizer.
    momentum = 0.0 if memory_name == "dgc" else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=momentum)
    optimizer = mc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression=compressor, memory=memory_name, groups=args.groups)
    mc.broadcast_parameters(model.state_dict(), root_rank=0)
    mc.broadcast_optimizer_state(optimizer, root_rank=0)

    # One fixed synthetic batch per rank (different on each rank).
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    data = torch.randn(args.batch_size, 3, 32, 32, generator=gen)
    target = torch.randint(num_classes, (args.batch_size,), generator=gen)

    def train_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    comm = mc.communicator()
    nparams = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"model: {args.model}, {nparams / 1e6:.2f}M parameters, batch size {args.batch_size} per worker")
    log(f"engine: {comm.engine}, world size: {world}, threads per worker: {args.threads}")
    log(f"compressor: {optimizer.compressor!r}")
    log(f"memory: {optimizer.memory!r}")

    first_loss = train_step()
    warm = 1
    if args.groups == "auto":
        # The scheduler profiles, predicts and measures its candidate plans during the first
        # ~30 steps; every rank leaves its search at the same step, so the loops stay in step.
        while optimizer.schedule_report()["phase"] != "monitor" and warm < max_search_steps:
            train_step()
            warm += 1
    while warm < args.warmup_steps:
        train_step()
        warm += 1
    codecs = group_codecs(optimizer, args.compression)
    log(f"groups: {len(optimizer.groups)} (--groups {args.groups if args.groups is not None else 'default'}), "
        f"sizes {[g.numel for g in optimizer.groups]}")
    wire_bits = sum(wire_bits_per_element(compressor, codec, g.numel) * g.numel
                    for g, codec in zip(optimizer.groups, codecs))
    log(f"wire bytes per step per worker: {wire_bits / 8 / 1e3:.1f} kB "
        f"(fp32 gradients: {4 * nparams / 1e3:.1f} kB)")

    log(f"warm-up: {warm} steps{' (scheduler search included)' if args.groups == 'auto' else ''}; "
        f"timing {args.steps} steps")
    times = []
    loss = first_loss
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step()
        times.append(time.perf_counter() - t0)
        if master and (step + 1) % max(1, args.steps // 4) == 0:
            print(f"step {step + 1:4d}: loss {loss.item():.4f}, {1e3 * times[-1]:.1f} ms/step", flush=True)

    # Mean over ranks of the final loss and of the timing (every rank takes part).
    stats = torch.tensor([first_loss.item(), loss.item(), sum(times)], dtype=torch.float64)
    comm.allreduce_(stats, "final statistics")
    stats /= world
    per_step = [args.batch_size / t for t in times]
    mean = sum(per_step) / len(per_step)
    std = math.sqrt(sum((s - mean) ** 2 for s in per_step) / max(1, len(per_step) - 1))
    per_worker = args.batch_size * args.steps / stats[2].item()
    log(f"samples/s per worker: {per_worker:.1f} (per step on rank 0: {mean:.1f} +- {std:.1f})")
    log(f"samples/s total on {world} worker(s): {per_worker * world:.1f}")
    log(f"loss (mean over workers): {stats[0].item():.4f} at step 1 -> {stats[1].item():.4f} "
        f"after {warm + args.steps} steps")
    if optimizer.skipped_steps:
        log(f"skipped steps (non-finite gradients): {optimizer.skipped_steps}")
    if args.groups == "auto":
        log(describe_schedule(optimizer.schedule_report(), args.compression))
    mc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
