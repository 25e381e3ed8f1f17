"""Plots for docs/benchmarks.md from the JSON records the benchmarks write.

    pip install matplotlib
    python scripts/plot_benchmarks.py            # reads docs/img/data/*, writes docs/img/*.png
    python scripts/plot_benchmarks.py --tables   # the throughput and scaling records as one table

Each figure is named after what it shows and reads the data file of the same question:

* ``throughput_vs_bandwidth_resnet50_2workers.png``: samples/s of 2 workers per link rate for the
  DDP anchors and mergecomp (``throughput_vs_bandwidth_resnet50_2workers.jsonl``), and the speed-up
  over DDP fp32 at 1 Gbit/s for ResNet-50, VGG-16 and GPT-2 small
  (``throughput_vgg16_gpt2small_1gbit_2workers.jsonl``);
* ``scaling_vs_workers_1gbit_resnet50.png``: scaling factor at 1, 2 and 4 workers
  (``throughput_vs_bandwidth_resnet50_2workers.jsonl`` + ``scaling_4workers_resnet50.jsonl``);
* ``auto_vs_layerwise_4workers_resnet50.png``: per compressor, layer-wise and ``auto`` on
  4 workers at 1 Gbit/s and on unlimited links (``scaling_4workers_resnet50.jsonl``);
* ``scheduler_vs_sweep_<link>_resnet50_batch<N>.png``: per compressor, layer-wise / 1 group / the
  best cut of the sweep / ``auto`` / fused fp32 (``scheduler_vs_sweep_<link>_resnet50_batch<N>.jsonl``);
* ``convergence_digits_mlp_2workers.png``: test accuracy vs step per compressor;
* ``convergence_stdlib_bytes_gpt2_2workers.png``: validation loss vs step per compressor (byte-level GPT-2);
* ``codec_encode_decode_resnet50.png``: encode + decode time per compressor, layer-wise and the best
  merged plan, each with its default error-feedback memory, against one memcpy
  (``codec_encode_decode_resnet50_memory.json``);
* ``schemes_bytes_vs_ranks_resnet50_loopback.png``: bytes per rank and exchange time vs ranks,
  allgather and two-phase, per compressor (``schemes_bytes_vs_ranks_resnet50_loopback.jsonl``).
"""
import argparse
import collections
import glob
import json
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", default="docs/img/data")
parser.add_argument("--out", default="docs/img")
parser.add_argument("--tables", action="store_true",
                    help="print a markdown table of the throughput and scaling records instead")
args = parser.parse_args()

THROUGHPUT = "throughput_vs_bandwidth_resnet50_2workers.jsonl"
LARGER_MODELS = "throughput_vgg16_gpt2small_1gbit_2workers.jsonl"
SCALING = "scaling_4workers_resnet50.jsonl"
CONVERGENCE = "convergence_digits_mlp_2workers.jsonl"
CONVERGENCE_LM = "convergence_stdlib_bytes_gpt2_2workers.jsonl"
CODECS = "codec_encode_decode_resnet50_memory.json"
SCHEMES = "schemes_bytes_vs_ranks_resnet50_loopback.jsonl"
MACHINE = "2-core machine"

RATES = ["1gbit", "10gbit", "unlimited", "loopback"]
RATE_LABEL = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "unlimited": "veth, no limit", "loopback": "loopback"}


def load(name):
    path = os.path.join(args.data, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ok(records):
    return [r for r in records if r.get("status") == "ok"]


def runs(r):
    """Every cluster run's step time of a record (a record may hold several repeats)."""
    return r.get("step_s_runs") or [r["step_s"]]


def median_step(records, **match):
    steps = [s for r in ok(records) if all(r.get(k) == v for k, v in match.items()) for s in runs(r)]
    return statistics.median(steps) if steps else None


def single_worker(records, model="resnet50"):
    return median_step([r for r in records if r.get("mode") == "local"], model=model)


def save(fig, name):
    path = os.path.join(args.out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def config_name(r):
    if r["mode"] == "ddp":
        return "DDP fp32"
    if r["mode"] == "ddp-fp16":
        return "DDP + fp16 hook"
    if r["mode"] == "ddp-powersgd":
        return "DDP + PowerSGD hook"
    if r["mode"] == "ddp-powersgd-serial":
        return "DDP + PowerSGD hook (serialized)"
    if r.get("plan") == "fp32":
        return "mergecomp fused fp32"
    return f"mergecomp {r.get('compressor')} {r.get('plan')}"


def throughput_vs_bandwidth():
    recs = [r for r in load(THROUGHPUT) if r.get("model") == "resnet50"]
    two = [r for r in recs if r.get("world_size") == 2]
    if not ok(two):
        return None
    steps = collections.defaultdict(dict)
    for r in ok(two):
        if r["mode"] == "mergecomp" and r.get("plan") not in ("auto", "fp32"):
            continue
        steps[config_name(r)].setdefault(r["rate"], []).extend(runs(r))
    series = {name: {rate: statistics.median(v) for rate, v in by_rate.items()} for name, by_rate in steps.items()}
    crashed = sorted({config_name(r) for r in two if r.get("status") != "ok"} - set(series))
    rates = [r for r in RATES if any(r in s for s in series.values())]
    first = ["DDP fp32", "DDP + fp16 hook", "mergecomp fused fp32"]
    names = sorted(series, key=lambda n: (first.index(n) if n in first else len(first), n))
    batch = two[0].get("batch_size", 8)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1.6, 1]})
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    width = 0.8 / max(sum(rate in series[n] for n in names) for rate in rates)
    for i, rate in enumerate(rates):  # the bars of each link side by side, without gaps
        here = [n for n in names if rate in series[n]]
        for j, name in enumerate(here):
            ax.bar(i + (j - len(here) / 2 + 0.5) * width, 2 * batch / series[name][rate], width,
                   color=colors[name], label=name if i == 0 or all(rate_ not in series[name] for rate_ in rates[:i])
                   else None)
    local = single_worker(recs)
    if local:
        ax.axhline(2 * batch / local, color="k", ls="--", lw=1, label="2 x single worker (ideal)")
    ax.set_xticks(range(len(rates)), [RATE_LABEL[r] for r in rates])
    ax.set_ylabel("samples/s, 2 workers total")
    ax.set_title(f"ResNet-50, batch {batch}/worker, 2 workers x 1 thread", fontsize=9)
    if crashed:
        ax.text(0.01, 0.98, ", ".join(crashed) + ": crashed (gloo)", transform=ax.transAxes, fontsize=7,
                va="top", color="firebrick")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)

    # speed-up over DDP fp32 at 1 Gbit/s, per model
    every = recs + load(LARGER_MODELS)
    models = [m for m in ("resnet50", "vgg16", "gpt2-small") if median_step(every, model=m, mode="ddp", rate="1gbit")]
    plans = [("auto", "mergecomp top-k auto"), ("fp32", "mergecomp fused fp32")]
    for j, (plan, label) in enumerate(plans):
        ys = []
        for m in models:
            ddp = median_step(every, model=m, mode="ddp", rate="1gbit", world_size=2)
            kw = {"compressor": "topk"} if plan == "auto" else {}
            mine = median_step(every, model=m, mode="mergecomp", plan=plan, rate="1gbit", world_size=2, **kw)
            ys.append(ddp / mine if mine else 0)
        ax2.bar([i + (j - 0.5) * 0.4 for i in range(len(models))], ys, 0.4, label=label)
    ax2.axhline(1.0, color="k", lw=1, label="DDP fp32")
    ax2.set_xticks(range(len(models)), models)
    ax2.set_ylabel("speed-up over DDP fp32 (step time)")
    ax2.set_title("1 Gbit/s, 2 workers, per model", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(f"Throughput vs DDP on a namespace cluster ({MACHINE}, gloo)", fontsize=10)
    fig.tight_layout()
    return save(fig, "throughput_vs_bandwidth_resnet50_2workers.png")


def scaling_vs_workers():
    two = load(THROUGHPUT)
    four = load(SCALING)
    base = single_worker(two)
    if not base or not four:
        return None
    recs = [r for r in ok(two + four) if r.get("rate") == "1gbit" and r.get("model") == "resnet50"]
    four_auto = {r.get("compressor") for r in recs if r["world_size"] == 4 and r.get("plan") == "auto"}
    two_auto = {r.get("compressor") for r in recs if r["world_size"] == 2 and r.get("plan") == "auto"}
    compressors = sorted(four_auto & two_auto)
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    colors = plt.get_cmap("tab10").colors
    lines = [("DDP fp32", dict(mode="ddp"), "k", "-"), ("mergecomp fused fp32", dict(mode="mergecomp", plan="fp32"), "0.5", "-")]
    for i, c in enumerate(compressors):
        lines.append((f"{c} auto", dict(mode="mergecomp", compressor=c, plan="auto"), colors[i], "-"))
        lines.append((f"{c} layer-wise", dict(mode="mergecomp", compressor=c, plan="layerwise"), colors[i], ":"))
    for label, match, color, ls in lines:
        xs, ys = [1], [1.0]
        for n in (2, 4):
            step = median_step(recs, world_size=n, **match)
            if step:
                xs.append(n)
                ys.append(base / step)
        if len(xs) > 1:
            ax.plot(xs, ys, marker="o", color=color, ls=ls, label=label)
    ax.plot([3.6, 4.1], [0.5, 0.5], color="firebrick", lw=1.5, label="bound at 4 workers: 2 cores / 4")
    ax.set_xticks([1, 2, 4])
    ax.set_xlabel("workers (1 thread each; 4 workers oversubscribe the 2 cores)")
    ax.set_ylabel("scaling factor = throughput / (N x single worker)")
    ax.set_title(f"ResNet-50, batch 8/worker, 1 Gbit/s links ({MACHINE})", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return save(fig, "scaling_vs_workers_1gbit_resnet50.png")


def auto_vs_layerwise_4workers():
    recs = [r for r in ok(load(SCALING)) if r.get("world_size") == 4]
    if not recs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, rate in zip(axes, ("1gbit", "unlimited")):
        here = [r for r in recs if r["rate"] == rate]
        newest = {}
        for r in here:  # later records win
            newest[(r["mode"], r.get("compressor"), r.get("plan"))] = r["step_s"]
        names = sorted({c for m, c, p in newest if p == "auto" and (m, c, "layerwise") in newest},
                       key=lambda c: newest[("mergecomp", c, "auto")])
        for j, (plan, label) in enumerate((("layerwise", "layer-wise"), ("auto", "auto (scheduler)"))):
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(names))], [newest[("mergecomp", c, plan)] for c in names],
                   0.4, label=label)
        ddp = median_step(here, mode="ddp")
        if ddp:
            ax.axhline(ddp, color="k", ls="--", lw=1, label="DDP fp32")
        fused = median_step(here, mode="mergecomp", plan="fp32")
        if fused:
            ax.axhline(fused, color="0.5", ls=":", lw=1.2, label="mergecomp fused fp32")
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.set_title(RATE_LABEL[rate], fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("step time, s (lower is better)")
    fig.suptitle(f"4 workers, ResNet-50, batch 8/worker, 1 thread/worker ({MACHINE}: oversubscribed)", fontsize=10)
    fig.tight_layout()
    return save(fig, "auto_vs_layerwise_4workers_resnet50.png")


def scheduler_vs_sweep(path):
    recs = ok(load(os.path.basename(path)))
    if not recs:
        return None
    by = {r["compressor"]: r["step_s"] for r in recs}  # the last run of each compressor wins
    names = list(by)
    kinds = [("layerwise", "layer-wise"), ("1", "1 group"), ("sweep", "best 2/3-group cut"),
             ("auto", "auto (scheduler)"), ("fp32", "fused fp32 allreduce")]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(kinds)
    for j, (key, label) in enumerate(kinds):
        ys = []
        for n in names:
            s = by[n]
            ys.append(min(v for k, v in s.items() if k.startswith("cut")) if key == "sweep" else s[key])
        ax.bar([i + (j - len(kinds) / 2 + 0.5) * width for i in range(len(names))], ys, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30)
    ax.set_ylabel("step time, s (lower is better)")
    stem = os.path.basename(path)[:-len(".jsonl")]
    rate = recs[0].get("rate")
    batch = stem.rsplit("_batch", 1)[1] if "_batch" in stem else "?"
    ax.set_title(f"Merge plans on 2 workers, {RATE_LABEL.get(rate, rate)}, ResNet-50, batch {batch}/worker ({MACHINE})",
                 fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=7, ncol=len(kinds), loc="upper center")
    fig.tight_layout()
    return save(fig, stem + ".png")


def convergence(data=CONVERGENCE, key="test_acc", title="digits, MLP, 2 workers x batch 32", percent=True,
                ylim=(80, 100)):
    """Held-out metric vs step per compressor, median over seeds (default memory, no warm-up or exemptions)."""
    recs = [r for r in ok(load(data)) if not r.get("warmup_steps") and not r.get("uncompressed")]
    if not recs:
        return None
    curves = collections.defaultdict(list)
    for r in recs:
        curves[r["compressor"]].append(r["curve"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    scale = 100 if percent else 1
    for name, runs_ in curves.items():
        steps = [p["step"] for p in runs_[0]]
        ys = [scale * statistics.median(run[i][key] for run in runs_) for i in range(len(steps))]
        ax.plot(steps, ys, label="fp32" if name == "none" else name, lw=2.2 if name == "none" else 1.1,
                color="k" if name == "none" else None)
    failed = sorted({r["compressor"] for r in load(data) if r.get("status") != "ok"} - set(curves))
    if failed:
        ax.text(0.99, 0.03, ", ".join(failed) + ": diverged (non-finite gradients)", transform=ax.transAxes,
                fontsize=7, ha="right", color="firebrick")
    ax.set_ylim(*ylim)
    ax.set_xlabel("step")
    ax.set_ylabel(("test accuracy, %" if percent else "validation loss, nats/byte") + " (median over seeds)")
    ax.set_title(title + ", default error-feedback memory")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, data[:-len(".jsonl")] + ".png")


def convergence_lm():
    return convergence(CONVERGENCE_LM, "test_loss", "stdlib bytes, GPT-2 2x96, 2 workers x 8 x 64 bytes",
                       percent=False, ylim=(2.0, 3.5))


def codec_times():
    path = os.path.join(args.data, CODECS)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data["results"] if r["compressor"] != "none"]
    rows.sort(key=lambda r: r["ms"]["layerwise"] / r["memcpy_ms"])
    names = [r["compressor"] for r in rows]
    layerwise = [r["ms"]["layerwise"] / r["memcpy_ms"] for r in rows]
    best = [min(v for k, v in r["ms"].items() if k.startswith("merged")) / r["memcpy_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.bar([i - 0.2 for i in range(len(names))], layerwise, 0.4, label="layer-wise (161 tensors)")
    ax.bar([i + 0.2 for i in range(len(names))], best, 0.4, label="best merged plan (1, 2 or 4 groups)")
    for i, r in enumerate(rows):
        if r.get("target_x_memcpy"):
            ax.plot([i - 0.4, i + 0.4], [r["target_x_memcpy"]] * 2, color="firebrick", lw=1)
    ax.plot([], [], color="firebrick", lw=1, label="target for merged (x memcpy)")
    ax.set_xticks(range(len(names)), names, rotation=30)
    ax.set_ylabel("encode + memory + decode / memcpy")
    machine = data.get("machine", {})
    ax.set_title(f"Codecs on ResNet-50's 25.6 M fp32 gradients, {machine.get('threads', '?')} threads, "
                 f"median of {data.get('repeats', '?')} ({MACHINE})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, "codec_encode_decode_resnet50.png")


def schemes_vs_ranks():
    records = load(SCHEMES)
    if not records:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for compressor in dict.fromkeys(r["compressor"] for r in records):
        for scheme, style in (("allgather", "--"), ("two-phase", "-")):
            rs = sorted((r for r in records if r["compressor"] == compressor and r["scheme"] == scheme),
                        key=lambda r: r["ranks"])
            ranks = [r["ranks"] for r in rs]
            label = f"{compressor} {scheme}"
            line, = left.plot(ranks, [r["bytes_per_rank"] / 2**20 for r in rs], style, marker="o", label=label)
            right.plot(ranks, [r["exchange_s"] for r in rs], style, marker="o", color=line.get_color(), label=label)
    left.set(xlabel="ranks", ylabel="MB sent per rank per step", yscale="log",
             title="bytes on the wire (loopback counters)")
    right.set(xlabel="ranks", ylabel="exchange s (max over ranks)", title=f"exchange time ({MACHINE}, oversubscribed)")
    left.legend(fontsize=7, ncol=2)
    fig.suptitle("ResNet-50 gradients, allgather (dashed) vs two-phase (solid)")
    fig.tight_layout()
    return save(fig, SCHEMES[:-len(".jsonl")] + ".png")


def ddp_name(r):
    hook = r.get("hook") or r["mode"]
    if hook == "none":
        return "DDP fp32 (bucket_cap_mb=25)"
    if hook.startswith("fp16"):
        return "DDP + fp16_compress_hook"
    rank = hook.split("rank=")[1].split(")")[0].split(",")[0] if "rank=" in hook else "?"
    return f"DDP + powerSGD_hook rank {rank}"


def tables():
    """One markdown table of every throughput and scaling record: medians over runs."""
    print("| data file | model | link | workers | configuration | runs ok / crashed | step s (median) | "
          "samples/s total | scaling factor | loadavg (1 min) |")
    print("|---|---|---|---:|---|---|---:|---:|---:|---|")
    local = {}
    for name in (THROUGHPUT, LARGER_MODELS, SCALING):
        for r in ok(load(name)):
            if r.get("mode") == "local":
                local.setdefault(r["model"], []).extend(runs(r))
    local = {m: statistics.median(v) for m, v in local.items()}
    for name in (THROUGHPUT, LARGER_MODELS, SCALING):
        groups = collections.defaultdict(list)
        for r in load(name):
            if r.get("mode") == "local":
                continue
            label = ddp_name(r) if r["mode"].startswith("ddp") else f"mergecomp {r.get('compressor')} {r.get('plan')}"
            groups[(r.get("model"), r.get("rate"), r.get("world_size"), label)].append(r)
        for (model, rate, n, label), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
            steps = [s for r in ok(rs) for s in runs(r)]
            bad = sum(1 for r in rs if r.get("status") != "ok") + sum(r.get("repeats_failed", 0) for r in ok(rs))
            base = local.get(model)
            if steps:
                step = statistics.median(steps)
                batch = rs[0].get("batch_size", 8)
                cells = [f"{step:.3f}", f"{n * batch / step:.1f}", f"{100 * base / step:.0f}%" if base else "-"]
            else:
                cells = ["crashed", "-", "-"]
            loads = sorted({(r.get("loadavg") or "?").split()[0] for r in rs})
            print(f"| {name} | {model} | {rate} | {n} | {label} | {len(steps)} / {bad} | " + " | ".join(cells)
                  + f" | {', '.join(loads)} |")
    print()
    print("single worker (local, no exchange): " + ", ".join(f"{m} {v:.3f} s" for m, v in local.items()))


if __name__ == "__main__":
    if args.tables:
        tables()
        sys.exit(0)
    os.makedirs(args.out, exist_ok=True)
    makers = [throughput_vs_bandwidth, scaling_vs_workers, auto_vs_layerwise_4workers]
    makers += [lambda p=p: scheduler_vs_sweep(p)
               for p in sorted(glob.glob(os.path.join(args.data, "scheduler_vs_sweep_*.jsonl")))]
    makers += [convergence, convergence_lm, codec_times, schemes_vs_ranks]
    for make in makers:
        path = make()
        if path:
            print("wrote", path)
