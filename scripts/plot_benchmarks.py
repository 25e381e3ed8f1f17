"""Plots for docs/benchmarks.md from the JSON-lines records the benchmarks append.

    pip install matplotlib
    python scripts/plot_benchmarks.py                 # reads docs/img/data/*.jsonl, writes docs/img/*.png

Figures:

* ``throughput_vs_bandwidth.png``: ResNet-50 step time -> samples/s total on 2 workers per link
  rate, DDP anchors and mergecomp (auto, layer-wise, fused fp32), from ``throughput.jsonl``
  and ``scheduler_*.jsonl``;
* ``scheduler_1gbit.png``: per compressor, layer-wise / 1 group / sweep best / auto at 1 Gbit/s;
* ``scaling.png``: scaling factor vs workers (``throughput.jsonl`` records with ``label`` scaling);
* ``workers4_1gbit.png``: per compressor, layer-wise and ``auto`` on 4 workers at 1 Gbit/s (newest
  records), DDP fp32 and the fused fp32 allreduce as lines;
* ``convergence.png``: test accuracy vs step per compressor (``convergence.jsonl``).
"""
import argparse
import collections
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
parser.add_argument("--tables", action="store_true", help="print markdown tables of throughput.jsonl instead")
args = parser.parse_args()


def load(name):
    path = os.path.join(args.data, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


RATES = ["1gbit", "10gbit", "unlimited", "loopback"]
RATE_LABEL = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "unlimited": "veth, no limit", "loopback": "loopback"}


def median_by(records, key):
    groups = collections.defaultdict(list)
    for r in records:
        if r.get("status") == "ok":
            groups[key(r)].append(r["step_s"])
    return {k: statistics.median(v) for k, v in groups.items()}


def throughput_vs_bandwidth():
    """The newest measurement campaign only (the ``label`` of the last 2-worker record), so
    code changes and the machine load of older campaigns do not mix into one figure."""
    thr = [r for r in load("throughput.jsonl") if r.get("model") == "resnet50" and r.get("status") == "ok"]
    two = [r for r in thr if r.get("world_size") == 2]
    if not two:
        return None
    campaign = two[-1].get("label", "")
    thr = [r for r in thr if r.get("label", "") == campaign]
    series = collections.defaultdict(dict)
    for (mode, plan, comp, rate), step in median_by([r for r in thr if r.get("world_size") == 2],
                                                    lambda r: (r["mode"], r.get("plan"), r.get("compressor"),
                                                               r.get("rate"))).items():
        name = {"ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook"}.get(mode)
        if mode == "mergecomp":
            name = f"mergecomp {comp} {plan}" if plan == "auto" else ("mergecomp fused fp32" if plan == "fp32" else None)
        if name and rate in RATES:
            series[name][rate] = step
    local = median_by([r for r in thr if r.get("mode") == "local"], lambda r: "local").get("local")
    if not series:
        return None
    rates = [r for r in RATES if any(r in s for s in series.values())]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    names = sorted(series, key=lambda n: (not n.startswith("DDP"), n))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - len(names) / 2 + 0.5) * width for i, r in enumerate(rates) if r in series[name]]
        ys = [2 * 8 / series[name][r] for r in rates if r in series[name]]
        ax.bar(xs, ys, width, label=name)
    if local:
        ax.axhline(2 * 8 / local, color="k", ls="--", lw=1, label="2 x single worker (ideal)")
    ax.set_xticks(range(len(rates)), [RATE_LABEL[r] for r in rates])
    ax.set_ylabel("samples/s, 2 workers total")
    ax.set_title(f"ResNet-50 shapes, 32x32, batch 8/worker, 1 thread/worker (2-core machine; '{campaign}' runs)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = os.path.join(args.out, "throughput_vs_bandwidth.png")
    fig.savefig(path, dpi=110)
    return path


def scheduler(rate):
    recs = [r for r in load(f"scheduler_{rate}.jsonl") if r.get("status") == "ok"]
    if not recs:
        return None
    by = {}
    for r in recs:  # last run of each compressor wins
        by[r["compressor"]] = r["step_s"]
    names = list(by)
    kinds = [("layerwise", "layer-wise"), ("1", "1 group"), ("sweep", "best 2/3-group cut"), ("auto", "auto (scheduler)"),
             ("fp32", "fused fp32 allreduce")]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(kinds)
    for j, (key, label) in enumerate(kinds):
        ys = []
        for n in names:
            s = by[n]
            ys.append(min(v for k, v in s.items() if k.startswith("cut") or k == "1") if key == "sweep" else s[key])
        ax.bar([i + (j - len(kinds) / 2 + 0.5) * width for i in range(len(names))], ys, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=30)
    ax.set_ylabel("step time, s (lower is better)")
    ax.set_title(f"Merge plans on 2 ranks, {RATE_LABEL.get(rate, rate)}, ResNet-50 shapes (2-core machine)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(args.out, f"scheduler_{rate}.png")
    fig.savefig(path, dpi=110)
    return path


def scaling():
    every = [r for r in load("throughput.jsonl") if r.get("status") == "ok" and r.get("model") == "resnet50"]
    scaling_recs = [r for r in every if r.get("label") == "scaling"]
    if not scaling_recs:
        return None
    comps = {r.get("compressor") for r in scaling_recs if r["mode"] == "mergecomp"}
    # 2-worker points at 1 Gbit/s come from the main (headline) runs as well
    recs = scaling_recs + [r for r in every if r.get("label", "") == "" and r.get("world_size") == 2
                           and (r["mode"] == "ddp" or (r["mode"] == "mergecomp" and r.get("compressor") in comps))]
    local = median_by([r for r in every if r["mode"] == "local"], lambda r: r["model"])
    panels = {}
    for rate in ("1gbit", "unlimited"):
        series = collections.defaultdict(dict)
        for (mode, plan, comp, n), step in median_by(
                [r for r in recs if r["rate"] == rate and r["mode"] in ("ddp", "mergecomp")],
                lambda r: (r["mode"], r.get("plan"), r.get("compressor"), r["world_size"])).items():
            series["DDP fp32" if mode == "ddp" else f"mergecomp {comp} {plan}"][n] = step
        panels[rate] = series
    names = sorted({name for series in panels.values() for name in series})
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    base = local.get("resnet50")
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.9), sharey=True)
    for ax, (rate, series) in zip(axes, panels.items()):
        for name in names:
            if name in series:
                ns = sorted(series[name])
                ax.plot([1] + ns, [1.0] + [base / series[name][n] for n in ns], marker="o", color=colors[name],
                        label=name)
        ax.set_title(RATE_LABEL[rate])
        ax.set_xlabel("workers (1 thread each)")
        ax.set_xticks([1, 2, 4])
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=colors[n], marker="o") for n in names]
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=7)
    fig.subplots_adjust(bottom=0.3)
    axes[0].set_ylabel("scaling factor")
    fig.suptitle("Scaling factor = total throughput / (N x single worker); 2 cores: 4 workers oversubscribe", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = os.path.join(args.out, "scaling.png")
    fig.savefig(path, dpi=110)
    return path


def four_workers():
    """Per compressor, the newest 4-worker 1 Gbit/s steps of layer-wise and ``auto``; the newest
    DDP fp32 and fused fp32 steps as lines."""
    newest = {}
    for r in load("throughput.jsonl"):  # later records win
        if r.get("status") == "ok" and r.get("model") == "resnet50" and r.get("world_size") == 4 \
                and r.get("rate") == "1gbit":
            plan = r.get("plan")  # the fused fp32 plan is the same whatever the compressor
            newest[(r["mode"], None if plan == "fp32" else r.get("compressor"), plan)] = r["step_s"]
    names = sorted({c for m, c, p in newest if m == "mergecomp" and p == "auto" and ("mergecomp", c, "layerwise") in newest},
                   key=lambda c: newest[("mergecomp", c, "auto")])
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, (plan, label) in enumerate((("layerwise", "layer-wise"), ("auto", "auto (scheduler)"))):
        ax.bar([i + (j - 0.5) * 0.4 for i in range(len(names))], [newest[("mergecomp", c, plan)] for c in names], 0.4,
               label=label)
    ddp = newest.get(("ddp", None, "ddp"))
    if ddp:
        ax.axhline(ddp, color="k", ls="--", lw=1, label="DDP fp32")
    fused = newest.get(("mergecomp", None, "fp32"))
    if fused:
        ax.axhline(fused, color="0.5", ls=":", lw=1, label="mergecomp fused fp32")
    ax.set_xticks(range(len(names)), names, rotation=30)
    ax.set_ylabel("step time, s (lower is better)")
    ax.set_title("4 workers, 1 Gbit/s, ResNet-50 shapes, batch 8, 1 thread/worker (2-core machine: oversubscribed)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(args.out, "workers4_1gbit.png")
    fig.savefig(path, dpi=110)
    return path


def convergence():
    recs = [r for r in load("convergence.jsonl") if r.get("status") == "ok"]
    if not recs:
        return None
    curves = collections.defaultdict(list)
    for r in recs:
        curves[r["compressor"]].append(r["curve"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for name, runs in curves.items():
        steps = [p["step"] for p in runs[0]]
        acc = [100 * statistics.median(run[i]["test_acc"] for run in runs) for i in range(len(steps))]
        ax.plot(steps, acc, label="fp32" if name == "none" else name, lw=2.2 if name == "none" else 1.1,
                color="k" if name == "none" else None)
    ax.set_ylim(80, 100)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy, % (median over seeds)")
    ax.set_title("digits, MLP, 2 workers x batch 32, default error-feedback memory")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(args.out, "convergence.png")
    fig.savefig(path, dpi=110)
    return path


def ddp_name(r):
    hook = r.get("hook") or r["mode"]
    if hook == "none":
        return "DDP fp32 (bucket_cap_mb=25)"
    if hook.startswith("fp16"):
        return "DDP + fp16_compress_hook"
    rank = hook.split("rank=")[1].split(")")[0].split(",")[0] if "rank=" in hook else "?"
    return f"DDP + powerSGD_hook rank {rank}"


def tables():
    """Markdown tables of throughput.jsonl: medians over runs (each run's own median step)."""
    recs = load("throughput.jsonl")
    local = {}
    for label in ("", "scaling"):
        steps = [r["step_s"] for r in recs if r.get("mode") == "local" and r.get("status") == "ok"
                 and r.get("label", "") == label and r.get("model") == "resnet50"]
        if steps:
            local[label] = statistics.median(steps)
    groups = collections.defaultdict(list)
    for r in recs:
        if r.get("mode") == "local" or r.get("model") != "resnet50":
            continue
        name = ddp_name(r) if r["mode"].startswith("ddp") else f"mergecomp {r.get('compressor')} {r.get('plan')}"
        groups[(r.get("label", ""), r.get("rate"), r.get("world_size"), name)].append(r)
    print("| set | link | workers | configuration | runs ok / crashed | step s (median) | samples/s total | "
          "vs single worker | scaling factor | loadavg (1 min) |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---|")
    for (label, rate, n, name), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2] or 0,
                                                                              kv[0][3] or "")):
        ok = [r for r in rs if r.get("status") == "ok"]
        runs = [x for r in ok for x in r.get("step_s_runs", [r["step_s"]])]
        bad = sum(1 for r in rs if r.get("status") != "ok") + sum(r.get("repeats_failed", 0) for r in ok)
        base = local.get(label) or local.get("")
        if runs:
            step = statistics.median(runs)
            total = n * 8 / step
            cells = [f"{step:.3f}", f"{total:.1f}", f"{step / base:.2f}x" if base else "-",
                     f"{100 * base / step:.0f}%" if base else "-"]
        else:
            cells = ["crashed", "-", "-", "-"]
        loads = sorted({(r.get("loadavg") or "?").split()[0] for r in rs})
        print(f"| {label or 'main'} | {rate} | {n} | {name} | {len(runs)} / {bad} | " + " | ".join(cells)
              + f" | {', '.join(loads)} |")
    print()
    print("single worker (local, no exchange): " + ", ".join(f"{k or 'main'} {v:.3f} s" for k, v in local.items()))


if __name__ == "__main__":
    if args.tables:
        tables()
        sys.exit(0)
    os.makedirs(args.out, exist_ok=True)
    for make in (throughput_vs_bandwidth, lambda: scheduler("1gbit"), lambda: scheduler("loopback"), scaling,
                 four_workers, convergence):
        path = make()
        if path:
            print("wrote", path)
