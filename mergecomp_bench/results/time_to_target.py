"""Time to accuracy (``scripts/bench_time_to_accuracy.py``): training seconds until DDP fp32's
final validation loss + :data:`TARGET` of the same seed, against DDP fp32's and its fp16 hook's."""
from __future__ import annotations

import statistics
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from mergecomp.scheduler.fragment_codecs import NAMES
from mergecomp_bench.cluster import bits_per_second
from mergecomp_bench.results.data import finished
from mergecomp_bench.results.markdown import link, median_span, seed_list, signed, table, times

__all__ = ["TARGET", "TTA", "HEADLINE", "HEADLINE_LABELS", "TTA_LABELS", "TRAINER_ROUTE", "TRAINER_ROUTE_LABELS",
           "DILOCO", "DILOCO_LABELS", "STRETCHED", "SLOW_LINKS", "SLOW_LABELS", "diloco_slow_links",
           "FOUR_HOSTS", "FOUR_HOSTS_LABELS", "diloco_four_hosts", "STALENESS", "diloco_staleness",
           "FRAGMENT_COUNT", "diloco_fragment_count",
           "time_to", "runs_by_seed", "speed_ups", "median_or_dash", "headline_speed_ups", "headline",
           "time_to_accuracy", "time_to_accuracy_recipes", "SlowRun", "slow_link_runs", "slow_link_speed_ups"]

#: the target of time to accuracy: DDP fp32's final validation loss plus this share
TARGET = 0.01
_DDP_LABELS = {"ddp": "DDP fp32", "ddp-fp16": "DDP + fp16 hook"}
TTA = "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_warmup.jsonl"
#: the time-to-accuracy configuration the docs quote
HEADLINE = "onebit@momentum/64^qsgd"
#: the configurations of :data:`TTA` the docs show, as they name them
HEADLINE_LABELS = {HEADLINE: "mergecomp 1-bit SGD, momentum exchanged"}
TTA_LABELS = {**HEADLINE_LABELS,
              "terngrad:packing=base3@momentum+residual/40^qsgd": "mergecomp TernGrad (base 3), momentum exchanged"}
#: mergecomp's DDP hook beside DistributedOptimizer, both with "auto"
TRAINER_ROUTE = "time_to_accuracy_gpt2_4x256_batch2_1gbit_trainer_route.jsonl"
TRAINER_ROUTE_LABELS = {"hook:onebit@auto": "1-bit SGD `\"auto\"` through the DDP hook",
                        "onebit@auto": "1-bit SGD `\"auto\"` through `DistributedOptimizer`"}
#: DiLoCo beside the momentum exchange
DILOCO = "time_to_accuracy_gpt2_4x256_batch2_1gbit_diloco.jsonl"
DILOCO_LABELS = {HEADLINE: "mergecomp 1-bit SGD, momentum exchanged every step",
                 "none@diloco/50": "DiLoCo, H = 50, dense", "topk@diloco/50": "DiLoCo, H = 50, top-k 1 %",
                 "none@diloco/10": "DiLoCo, H = 10, dense", "topk:ratio=0.1@diloco/10": "DiLoCo, H = 10, top-k 10 %",
                 "none@averaging/10": "outer SGD lr 1 (averaging), H = 10, dense",
                 "none@averaging/50": "outer SGD lr 1 (averaging), H = 50, dense"}


#: DiLoCo with its schedule stretched to twice DDP's steps, on loopback: the losses, step by step
STRETCHED = "time_to_accuracy_gpt2_4x256_batch2_loopback_diloco_stretched.jsonl"
#: the same configurations on 10 and 100 Mbit/s links, and 1 Gbit/s (DDP fp32 over its first steps only)
SLOW_LINKS = "time_to_accuracy_gpt2_4x256_batch2_slow_links_diloco.jsonl"
SLOW_LABELS = {"ddp": "DDP fp32", "none@averaging/10*2": "DiLoCo, averaging, H = 10, dense",
               "topk:ratio=0.1@averaging/10*2": "DiLoCo, averaging, H = 10, top-k 10 %",
               "topk:ratio=0.1@averaging/10~2~1*2": "the same, Streaming: 2 fragments, delay 1",
               "topk:ratio=0.1;value_dtype=fp16@averaging/10*2": "DiLoCo, averaging, H = 10, top-k 10 % in fp16",
               "topk:ratio=0.1;value_dtype=fp16@averaging/10~2~4*2": "the same, Streaming: 2 fragments, delay 4",
               "onebit@averaging/10*2": "DiLoCo, averaging, H = 10, 1-bit SGD",
               "onebit@averaging/10~2~4*2": "the same, Streaming: 2 fragments, delay 4",
               "onebit@averaging/40~2~auto*2": "DiLoCo, averaging, H = 40, 1-bit SGD, Streaming: 2 fragments, "
                                               "delay `\"auto\"`",
               "onebit@averaging/64~2~auto*2": "the same, H = 64",
               "onebit@averaging/10~2~auto~auto*2": "DiLoCo, averaging, H = 10, 1-bit SGD, Streaming: 2 fragments, "
                                                    "delay and codecs `\"auto\"`",
               "onebit@auto": "1-bit SGD, AdamW's momentum exchanged every step (`\"auto\"`)"}


def steps_to(record: dict, target: float) -> Optional[int]:
    """The step of ``record``'s first evaluation at or below ``target``, or None."""
    return next((point["step"] for point in record["curve"] if point["test_loss"] <= target), None)


def _stretched() -> Dict[int, Tuple[Dict[str, dict], float]]:
    """:data:`STRETCHED`'s runs by seed, then configuration, with each seed's target: its DDP
    fp32 run's final loss + 1 %."""
    seeds: Dict[int, Dict[str, dict]] = {}
    for run in finished(STRETCHED):
        seeds.setdefault(run["seed"], {})[run["config"]] = run
    return {seed: (curves, curves["ddp"]["final_test_loss"] * (1 + TARGET)) for seed, curves in sorted(seeds.items())}


class SlowRun(NamedTuple):
    """One run of :data:`SLOW_LINKS`: the record, its mean step (s), its steps to its seed's
    target and the seconds to it (None where not reached)."""

    run: dict
    step: float
    steps: Optional[int]
    reached: Optional[float]


def slow_link_runs() -> Dict[str, Dict[str, Dict[int, SlowRun]]]:
    """:data:`SLOW_LINKS` by rate (slowest first), then configuration, then seed; a run stopped
    early (DDP fp32, the momentum exchange) takes its steps from its seed's :data:`STRETCHED`
    run (losses do not depend on the link) and is projected (:func:`projected`)."""
    stretched = _stretched()
    by_rate: Dict[str, Dict[str, Dict[int, SlowRun]]] = {}
    for run in sorted(finished(SLOW_LINKS), key=lambda r: bits_per_second(r["rate"])):
        curves, target = stretched[run["seed"]]
        step = run["train_s"] / min(run["steps"], run["stop"] or run["steps"])
        steps = steps_to(curves[run["config"]] if run["stop"] else run, target)
        reached = None if steps is None else projected(run, steps) if run["stop"] else time_to(run, target)
        by_rate.setdefault(run["rate"], {}).setdefault(run["config"], {})[run["seed"]] = SlowRun(run, step, steps,
                                                                                                  reached)
    return by_rate


def projected(run: dict, steps: int) -> float:
    """Seconds a run stopped after ``run["stop"]`` steps would take for ``steps``: its time so
    far plus the steps left at the pace of its last evaluation interval (where it has two
    evaluations; a warm-up at other bytes per step stays out of that pace), else at its mean step."""
    curve, stop = run["curve"], run["stop"]
    if len(curve) >= 2:
        pace = (curve[-1]["seconds"] - curve[-2]["seconds"]) / (curve[-1]["step"] - curve[-2]["step"])
    else:
        pace = run["train_s"] / stop
    return run["train_s"] + (steps - stop) * pace


def slow_link_speed_ups(timed: Dict[str, Dict[int, SlowRun]]) -> Dict[str, List[float]]:
    """DDP fp32's (projected) time to the target over each DiLoCo configuration's, seed by seed
    where both reached it, on one link (``timed``: one rate of :func:`slow_link_runs`)."""
    ddp = timed.get("ddp", {})
    return {config: [ddp[seed].reached / run.reached for seed, run in runs.items()
                     if run.reached is not None and seed in ddp and ddp[seed].reached is not None]
            for config, runs in timed.items() if config != "ddp"}


def _bits(bits: float) -> str:
    """Bits per element per step: two decimals, three below 0.1 (DiLoCo's longest intervals)."""
    return f"{bits:.2f}" if bits >= 0.1 else f"{bits:.3f}"


def _chosen(config: str, run: dict) -> str:
    """`` (chose 4)``, or `` (chose 4; 8-bit QSGD, fp16)`` with the codecs chosen per fragment,
    where the configuration leaves them to ``"auto"``; else nothing."""
    if "~auto" not in config or run.get("sync_delay") is None:
        return ""
    codecs = run.get("fragment_codecs")
    return f" (chose {run['sync_delay']}" + (f"; {', '.join(NAMES[c] for c in codecs)})" if codecs else ")")


def _reached_cell(by_seed: Dict[int, Optional[float]], write: Callable[[float], str]) -> str:
    """The values of the seeds that reached the target (None: not reached) as ``median (lo to
    hi)``, then ``not reached``; each list of seeds named where only some reached it."""
    hit = {seed: value for seed, value in by_seed.items() if value is not None}
    missed = [seed for seed in by_seed if seed not in hit]
    if not hit:
        return "not reached"
    cell = median_span(list(hit.values()), write)
    return f"{cell} ({seed_list(hit)}); not reached ({seed_list(missed)})" if missed else cell


def _reach(by_seed: Dict[int, SlowRun]) -> Tuple[str, str, str]:
    """A row's steps to the target, time to it (median and range over the seeds that reached
    it; a stopped run's whole schedule, projected, where one did not) and, where only some
    seeds reached it, `` (seeds 1, 2)`` naming them (else "")."""
    first = next(iter(by_seed.values())).run
    reached = {seed: s for seed, s in by_seed.items() if s.reached is not None}
    missed = [seed for seed in by_seed if seed not in reached]
    some = f" ({seed_list(reached)})" if missed and reached else ""
    projected_note = f" (projected: {first['stop']} steps timed)" if first["stop"] else ""
    steps = _reached_cell({seed: None if s.reached is None else s.steps for seed, s in by_seed.items()},
                          "{:.0f}".format)
    times_to = []
    if reached:
        times_to.append(median_span([s.reached for s in reached.values()], _seconds) + projected_note + some)
    if missed:
        not_reached = "not reached" + (f" ({seed_list(missed)})" if reached else "")
        if first["stop"]:  # its whole schedule's time instead
            whole = [projected(by_seed[seed].run, by_seed[seed].run["steps"]) for seed in missed]
            not_reached += f" (its {first['steps']:,} steps: {median_span(whole, _seconds)} projected)"
        times_to.append(not_reached)
    return steps, "; ".join(times_to), some


def _seconds(seconds: float) -> str:
    return f"{seconds:,.0f} s"


def diloco_slow_links() -> str:
    """DiLoCo trained twice DDP's steps (its LR schedule stretched) against DDP fp32, by link:
    the steps each needs to reach DDP fp32's final loss + 1 % (from :data:`STRETCHED`: losses do
    not depend on the link), the mean step on each link and the time to that loss
    (:data:`SLOW_LINKS`, :func:`slow_link_runs`; over several seeds: the median, and the range
    where they differ); a stopped run's bits per element are its full run's on loopback."""
    stretched = _stretched()
    curves, target = stretched[0]
    rows = [["loopback (losses)", SLOW_LABELS[config], f"{run['steps']:,}",
             "32" if config == "ddp" else _bits(run["bits_per_element"]), "–", "–",
             str(steps_to(run, target) or "not reached"), "–", "–"] for config, run in curves.items()]
    for rate, timed in slow_link_runs().items():
        speed_ups = slow_link_speed_ups(timed)
        for config, by_seed in timed.items():
            seeds = list(by_seed.values())
            first = seeds[0].run
            steps_cell, time_cell, some = _reach(by_seed)
            bits = [(stretched[seed][0][config] if s.run["stop"] else s.run)["bits_per_element"]
                    for seed, s in by_seed.items()]
            label = SLOW_LABELS[config] + " /".join(dict.fromkeys(_chosen(config, s.run) for s in seeds))
            rows.append([link(rate), label + (f", seeds {', '.join(map(str, by_seed))}" if len(seeds) > 1 else ""),
                         f"{first['steps']:,}", "32" if config == "ddp" else median_span(bits, _bits),
                         f"{statistics.median(s.step for s in seeds):.3f}",
                         f"{statistics.median(s.run['compute_s'] for s in seeds):.3f}",
                         steps_cell, time_cell,
                         median_span(speed_ups[config], times) + some if speed_ups.get(config) else "–"])
    header = ["link", "configuration", "schedule (steps)", "bits per element per step", "mean step (s)",
              "one worker's step (s)", "steps to target", "time to target", "vs DDP fp32"]
    return table(header, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


#: DiLoCo on 4 hosts (losses on loopback): DDP fp32 over 1,000 steps, DiLoCo stretched to 2,000
FOUR_HOSTS = "time_to_accuracy_gpt2_4x256_batch2_loopback_diloco_4hosts.jsonl"
FOUR_HOSTS_LABELS = {"ddp": "DDP fp32", "none@averaging/10*2": "DiLoCo, averaging, H = 10, dense",
                     "onebit@averaging/10*2": "DiLoCo, averaging, H = 10, 1-bit SGD"}
_DENSE = "none@averaging/10*2"


def diloco_four_hosts() -> str:
    """:data:`FOUR_HOSTS`: each configuration's steps to its seed's DDP fp32 final loss + 1 %,
    its final loss against dense DiLoCo's of the same seed, and its bits per element over the run
    as a fraction of dense DiLoCo's (over several seeds: the median, and the range where they
    differ)."""
    seeds: Dict[int, Dict[str, dict]] = {}
    for run in finished(FOUR_HOSTS):
        seeds.setdefault(run["seed"], {})[run["config"]] = run

    def over_run(run: dict) -> float:
        return (32 if run["config"] == "ddp" else run["bits_per_element"]) * run["steps"]

    rows = []
    for config, label in FOUR_HOSTS_LABELS.items():
        runs = [by_config[config] for by_config in seeds.values()]
        bytes_vs_dense = statistics.median(over_run(by_config[config]) / over_run(by_config[_DENSE])
                                           for by_config in seeds.values())
        shown_bytes = times(bytes_vs_dense) if bytes_vs_dense >= 1 else f"1/{1 / bytes_vs_dense:.0f}"
        vs_dense = [100 * (by_config[config]["final_test_loss"] / by_config[_DENSE]["final_test_loss"] - 1)
                    for by_config in seeds.values()]
        rows.append([label + (f", {seed_list(seeds)}" if len(seeds) > 1 else ""), f"{runs[0]['steps']:,}",
                     "32" if config == "ddp" else median_span([run["bits_per_element"] for run in runs], _bits),
                     _reached_cell({seed: steps_to(by_config[config],
                                                   by_config["ddp"]["final_test_loss"] * (1 + TARGET))
                                    for seed, by_config in seeds.items()}, "{:,.0f}".format),
                     median_span([run["final_test_loss"] for run in runs], "{:.3f}".format),
                     "–" if config in ("ddp", _DENSE) else median_span(vs_dense, signed),
                     "–" if config == _DENSE else shown_bytes])
    header = ["configuration (4 hosts)", "schedule (steps)", "bits per element per step", "steps to target",
              "final loss", "vs dense DiLoCo's", "bytes over the run vs dense DiLoCo's"]
    return table(header, ["---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


#: 1-bit SGD DiLoCo (averaging, H = 10, stretched) with P fragments and each exchange in flight
#: for D inner steps (losses on loopback), beside DDP fp32 on the same seed
STALENESS = "time_to_accuracy_gpt2_4x256_batch2_loopback_diloco_staleness.jsonl"


def _fragments_and_delay(config: str) -> Tuple[int, int]:
    """P and D of a ``...~P~D*F`` configuration (1 and 0 without ``~``)."""
    streaming = config.split("*")[0].split("~")[1:]
    return (int(streaming[0]), int(streaming[1])) if streaming else (1, 0)


def diloco_staleness() -> str:
    """:data:`STALENESS`, one row per (fragments, delay), over the seeds that ran it (median and
    range): the steps to the seed's DDP fp32 final loss + :data:`TARGET`, and the final loss and
    its difference to the same seed's unfragmented, undelayed run."""
    seeds: Dict[int, Dict[Tuple[int, int], dict]] = {}
    targets: Dict[int, float] = {}
    for run in finished(STALENESS):
        if run["config"] == "ddp":
            targets[run["seed"]] = run["final_test_loss"] * (1 + TARGET)
        else:
            seeds.setdefault(run["seed"], {})[_fragments_and_delay(run["config"])] = run
    rows = []
    for key in sorted({key for by_key in seeds.values() for key in by_key}):
        runs = {seed: by_key[key] for seed, by_key in seeds.items() if key in by_key}
        vs = [100 * (run["final_test_loss"] / seeds[seed][(1, 0)]["final_test_loss"] - 1) for seed, run in runs.items()]
        rows.append([str(key[0]), str(key[1]), ", ".join(map(str, sorted(runs))),
                     _reached_cell({seed: steps_to(run, targets[seed]) for seed, run in runs.items()},
                                   "{:,.0f}".format),
                     median_span([run["final_test_loss"] for run in runs.values()], "{:.3f}".format),
                     "–" if key == (1, 0) else median_span(vs, signed)])
    header = ["fragments (P)", "delay (inner steps)", "seeds", "steps to target", "final loss", "vs P = 1, no delay"]
    return table(header, ["---:", "---:", "---", "---:", "---:", "---:"], rows)


#: fragments="auto" beside 2 fragments (delay and codecs "auto" in both), each link's two in one run
FRAGMENT_COUNT = "time_to_accuracy_gpt2_4x256_batch2_diloco_fragment_count.jsonl"
_TWO_FRAGMENTS = "onebit@averaging/10~2~auto~auto*2"


def _codecs(run: dict) -> str:
    """The codecs a run's fragments chose: ``fp16 (all)``, or each fragment's in order."""
    codecs = run["fragment_codecs"]
    return f"{NAMES[codecs[0]]} (all)" if len(set(codecs)) == 1 else ", ".join(NAMES[c] for c in codecs)


def diloco_fragment_count() -> str:
    """:data:`FRAGMENT_COUNT` by link (slowest first): each configuration's fragments, delay and
    codecs (as chosen; ``/`` between seeds that chose differently), bits per element per step,
    mean step and one worker's, steps and seconds to the seed's DDP fp32 final loss +
    :data:`TARGET` (:data:`STRETCHED`'s DDP run), final loss, and 2 fragments' time to it over
    this row's (median and range over the seeds)."""
    stretched = _stretched()
    by_rate: Dict[str, Dict[str, Dict[int, dict]]] = {}
    for run in sorted(finished(FRAGMENT_COUNT), key=lambda r: bits_per_second(r["rate"])):
        by_rate.setdefault(run["rate"], {}).setdefault(run["config"], {})[run["seed"]] = run
    rows = []
    for rate, configs in by_rate.items():
        for config, by_seed in configs.items():
            def chosen(write: Callable[[dict], str]) -> str:
                return " / ".join(dict.fromkeys(write(run) for run in by_seed.values()))
            reached = {seed: time_to(run, stretched[seed][1]) for seed, run in by_seed.items()}
            two = {seed: time_to(run, stretched[seed][1]) for seed, run in configs.get(_TWO_FRAGMENTS, {}).items()}
            ratios = [two[seed] / seconds for seed, seconds in reached.items() if seconds and two.get(seed)]
            counted = config.split("*")[0].split("~")[1:2] == ["auto"]  # fragments="auto"
            rows.append([link(rate), ("`\"auto\"`: " if counted else "")
                         + chosen(lambda r: str(r["fragments"])), chosen(lambda r: str(r["sync_delay"])),
                         chosen(_codecs),
                         ", ".join(map(str, sorted(by_seed))),
                         median_span([r["bits_per_element"] for r in by_seed.values()], _bits),
                         median_span([r["step_s"] for r in by_seed.values()], "{:.3f}".format),
                         median_span([r["compute_s"] for r in by_seed.values()], "{:.3f}".format),
                         _reached_cell({seed: steps_to(run, stretched[seed][1]) for seed, run in by_seed.items()},
                                       "{:,.0f}".format),
                         _reached_cell(reached, _seconds),
                         median_span([r["final_test_loss"] for r in by_seed.values()], "{:.3f}".format),
                         "–" if config == _TWO_FRAGMENTS or not ratios else median_span(ratios, times)])
    header = ["link", "fragments", "delay (inner steps)", "codecs", "seeds", "bits per element per step",
              "mean step (s)", "one worker's step (s)", "steps to target", "time to target", "final loss",
              "2 fragments' time to target over this"]
    return table(header, ["---", "---", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"],
                 rows)


def time_to(record: dict, target: float) -> Optional[float]:
    """Training seconds of ``record``'s first evaluation at or below ``target``, or None."""
    return next((point["seconds"] for point in record["curve"] if point["test_loss"] <= target), None)


def runs_by_seed(record: str) -> Dict[int, Dict[str, dict]]:
    """A bench_time_to_accuracy.py record's finished runs by seed, then configuration; every seed
    has its DDP fp32 run."""
    seeds: Dict[int, Dict[str, dict]] = {}
    for run in finished(record):
        seeds.setdefault(run["seed"], {})[run["config"]] = run
    for seed, by in seeds.items():
        if "ddp" not in by:
            raise LookupError(f"{record}: no DDP fp32 run for seed {seed}")
    return dict(sorted(seeds.items()))


def speed_ups(by: Dict[str, dict], config: str) -> Tuple[Optional[float], List[Optional[float]]]:
    """``config``'s time to DDP fp32's final loss + :data:`TARGET` of the same seed, and DDP fp32's
    and the fp16 hook's times over it (None where one is missing or never reached it)."""
    target = by["ddp"]["final_test_loss"] * (1 + TARGET)
    reached = time_to(by[config], target)
    anchors = [time_to(by[c], target) if c in by else None for c in _DDP_LABELS]
    return reached, [None if reached is None or anchor is None else anchor / reached for anchor in anchors]


def headline_speed_ups() -> List[str]:
    """:data:`HEADLINE`'s speed-ups over DDP fp32 and the fp16 hook: the medians over the seeds of
    :data:`TTA`."""
    seeds = [speed_ups(by, HEADLINE)[1] for by in runs_by_seed(TTA).values()]
    return [median_or_dash(ratios[i] for ratios in seeds) for i in range(len(_DDP_LABELS))]


def headline() -> str:
    """The README's opening result: :data:`HEADLINE` against DDP fp32 (its time-to-accuracy table
    is in the README's results)."""
    vs_ddp, _ = headline_speed_ups()
    return (f"With AdamW it exchanges Adam's momentum: on a GPT-2 over 1 Gbit/s links 1-bit SGD reached uncompressed "
            f"AdamW's loss {vs_ddp} sooner than DDP (median of {len(runs_by_seed(TTA))} seeds, "
            f"[Results](#time-to-accuracy-a-transformer-with-adamw)).\n")


def time_to_accuracy(record: str, labels: Dict[str, str], bold: Sequence[str] = ()) -> str:
    """Each seed's runs of one ``bench_time_to_accuracy.py`` record (those ``labels`` names, in the
    record's order): step time, the share of it above the step without exchange, bits per
    element, final validation loss, and the time to DDP fp32's final loss + 1 % of the same seed,
    against DDP fp32's and the fp16 hook's; ``bold``: configurations whose times are bold."""
    names = {**_DDP_LABELS, **labels}
    rows = []
    for seed, by in runs_by_seed(record).items():
        base = by["ddp"]["final_test_loss"]
        for config, run in by.items():
            if config not in names:
                continue
            reached, ratios = speed_ups(by, config)
            cells = ["not reached" if reached is None else f"{reached:.0f} s",
                     *("–" if ratio is None else times(ratio) for ratio in ratios)]
            if config in bold:
                cells = [f"**{t}**" if reached is not None else t for t in cells]
            bits = {"ddp": "32", "ddp-fp16": "16"}.get(config) or f"{run['bits_per_element']:.2f}"
            loss = run["final_test_loss"]
            rows.append([str(seed), names[config], f"{run['step_s']:.3f}",
                         f"{round(100 * (1 - run['compute_s'] / run['step_s']))} %", bits, f"{loss:.4f}",
                         "–" if config == "ddp" else signed(100 * (loss / base - 1)), *cells])
    header = ["seed", "configuration", "step (s)", "exchange share", "bits per element (run)", "validation loss",
              "vs DDP fp32", "time to target", "vs DDP fp32", "vs DDP fp16 hook"]
    return table(header, ["---", "---", *["---:"] * 8], rows)


#: the rows of :func:`time_to_accuracy_recipes`: label, record, configuration
_TTA_RECIPES: Tuple[Tuple[str, str, str], ...] = (
    ("1-bit SGD, fp16 warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_fp16_warmup.jsonl",
     "onebit@momentum/64^fp16"),
    ("1-bit SGD, exact warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_fp16_warmup.jsonl", "onebit@momentum/64"),
    ("1-bit SGD, fp16 warm-up, R = 32", "time_to_accuracy_gpt2_4x256_batch2_1gbit_onebit_refresh32.jsonl",
     "onebit@momentum/32^fp16"),
    ("EF-signSGD, fp16 warm-up, R = 32", "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_efsignsgd.jsonl",
     "efsignsgd@momentum/32^fp16"),
    ("4-bit QSGD, fp16 warm-up", "time_to_accuracy_gpt2_4x256_batch2_1gbit_qsgd_efsignsgd.jsonl",
     "qsgd:levels=7@momentum/64^fp16"),
    ("1-bit SGD, exact warm-up shorter than the LR warm-up",
     "time_to_accuracy_gpt2_4x256_batch2_1gbit_momentum_search.jsonl", "onebit@momentum/64"),
    ("the same with `groups=2`", "time_to_accuracy_gpt2_4x256_batch2_1gbit_groups_2.jsonl", "onebit@momentum/64"),
)


def median_or_dash(values: Iterable[Optional[float]]) -> str:
    """The median speed-up of the known ``values``; ``–`` where none is."""
    known = [v for v in values if v is not None]
    return times(statistics.median(known)) if known else "–"


def time_to_accuracy_recipes(rows: Sequence[Tuple[str, str, str]] = _TTA_RECIPES) -> str:
    """Further recipes on the time-to-accuracy benchmark, each from its record: seeds, warm-up K,
    bits per element, final loss against DDP fp32 (median), the time to DDP fp32's loss + 1 %
    against DDP fp32's and the fp16 hook's (medians of the seeds that reached it), and the seeds
    that did not."""
    found = []
    for label, record, config in rows:
        seeds = {seed: by for seed, by in runs_by_seed(record).items() if config in by}
        if not seeds:
            raise LookupError(f"{record}: no run of {config}")
        results = {seed: speed_ups(by, config) for seed, by in seeds.items()}
        losses = [100 * (by[config]["final_test_loss"] / by["ddp"]["final_test_loss"] - 1) for by in seeds.values()]
        run = next(iter(seeds.values()))[config]
        missed = ", ".join(str(seed) for seed, (reached, _) in results.items() if reached is None)
        found.append([label, f"`{config}`", ", ".join(map(str, seeds)), str(run["after"]),
                      f"{run['bits_per_element']:.2f}", signed(statistics.median(losses)),
                      *(median_or_dash(ratios[i] for _, ratios in results.values()) for i in range(len(_DDP_LABELS))),
                      missed or "–", f"`{record}`"])
    header = ["recipe", "`--configs`", "seeds", "K", "bits per element", "vs DDP fp32's loss", "time: vs DDP fp32",
              "vs DDP fp16 hook", "target missed on seed", "record (`docs/img/data/`)"]
    return table(header, ["---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---", "---"], found)
