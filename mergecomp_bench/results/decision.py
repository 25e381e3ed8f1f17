"""The decision table: which configuration for which optimizer and link, and what it gave, each
figure computed from the records behind the tables it links to."""
from __future__ import annotations

import statistics
from typing import Callable, Tuple

from mergecomp_bench.results import accuracy, adam, fsdp2, step_time, time_to_target
from mergecomp_bench.results.data import finished, records
from mergecomp_bench.results.host_work import NARROW, OWN_WORK
from mergecomp_bench.results.markdown import compressor_name, link, median_span, signed, span, table, times

__all__ = ["summary"]


def _gave_sgd_slow() -> str:
    mean = step_time.means(step_time.ANCHORS)
    fast = [("1gbit", c, "auto") for c in ("signsgd", "onebit", "efsignsgd")]
    digits = accuracy.runs_by_compressor(accuracy.DIGITS)
    vs = {c: accuracy.vs_fp32_text(accuracy.default_memory(digits, c), digits[accuracy.FP32])
          for c in ("onebit", "efsignsgd", "signsgd")}
    ddp, anchor = step_time.ddp_key("1gbit"), step_time.anchor_key("1gbit")
    return (f"ResNet-50, 2 workers: {span((mean[ddp] / mean[k] for k in fast), times)} DDP fp32's step, "
            f"up to {times(max(mean[anchor] / mean[k] for k in fast))} DDP with PyTorch's PowerSGD hook "
            f"([throughput](#throughput-against-the-ddp-anchors)); on digits 1-bit SGD {vs['onebit']} and EF-signSGD "
            f"{vs['efsignsgd']} from fp32's accuracy, signSGD {vs['signsgd']} ([convergence](#convergence))")


def _gave_sgd_fast() -> str:
    ddp, runs = step_time.auto_vs_ddp(step_time.TEN_GBIT)
    ratios = {c: statistics.mean(ddp) / run["step_s"] for c, run in runs}
    slow, fast = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    return (f"{times(ratios[slow])} ({compressor_name(slow)}) to {times(ratios[fast])} ({compressor_name(fast)}) "
            f"DDP fp32's step ([every compressor](#every-compressor-at-10-gbits))")


def _gave_adam() -> str:
    own_run = adam.recipes_on_their_own_run()
    vs_ddp, vs_fp16 = time_to_target.headline_speed_ups()
    return (f"{span((delta for delta, _ in own_run), signed)} from AdamW's loss at "
            f"{span((bits for _, bits in own_run), lambda b: f'{b:.2f}')} bits per element "
            f"([Adam](#adam-and-adamw-exchanging-the-momentum)); exchanging the momentum, 1-bit SGD reached DDP "
            f"fp32's loss {vs_ddp} sooner than DDP fp32 and {vs_fp16} sooner than its fp16 hook at 1 Gbit/s "
            f"([time to accuracy](#time-to-accuracy-adamw-on-the-1-gbits-cluster))")


def _gave_adam_gradients() -> str:
    runs = accuracy.runs_by_compressor(accuracy.LM)
    fp32 = runs[accuracy.FP32]
    vs = [accuracy.vs_fp32_text(accuracy.default_memory(runs, c), fp32) for c in ("fp16", "bf16", "qsgd")]
    feedback = [accuracy.vs_fp32(seeds, fp32) for (c, memory), seeds in runs.items() if memory != "none"]
    return (f"{' / '.join(vs)} from fp32's loss; error feedback on Adam's gradients ends {span(feedback, signed)} "
            f"([convergence](#byte-level-gpt-2-on-cpythons-standard-library-transformers-adam))")


def _gave_fsdp() -> str:
    runs = fsdp2.runs(fsdp2.STEP, 2)
    ratios = [times(fsdp2.speed_up(runs, "qsgd@int8", base)) for base in fsdp2.BASELINES]
    loss = {row["config"]: row["final_test_loss"] for row in finished(fsdp2.ACCURACY)}
    vs_fp32 = signed(100 * (loss["qsgd@int8"] / loss["fsdp"] - 1))
    return (f"{ratios[0]} FSDP2 fp32's step and {ratios[1]} its bf16 reduction's ({ratios[2]} / {ratios[3]} against "
            f"reduce-scatters sending NCCL's bytes), {vs_fp32} validation loss "
            f"([FSDP2](#fsdp2-compressed-reduce-scatter-at-1-gbits))")


#: the decision table's DiLoCo row: Streaming (2 fragments), the delay and each fragment's codec chosen for the link
_DILOCO = "onebit@averaging/10~2~auto~auto*2"


def _gave_diloco() -> str:
    """What :data:`_DILOCO` gave on each slow link."""
    runs = time_to_target.slow_link_runs()
    speed_ups = {rate: time_to_target.slow_link_speed_ups(runs[rate])[_DILOCO] for rate in ("10mbit", "100mbit")}
    gave = [f"{median_span(ratios, times)} sooner than DDP fp32 at {link(rate)} ("
            f"{'one seed' if len(ratios) == 1 else f'median of {len(ratios)} seeds'}; "
            f"{statistics.median(r.run['bits_per_element'] for r in runs[rate][_DILOCO].values()):.2f} bits per "
            f"element per step)" for rate, ratios in speed_ups.items()]
    return (f"GPT-2 4 x 256, 2 workers: DDP fp32's loss {' and '.join(gave)} "
            f"([slow links](#diloco-trained-longer-over-slow-links))")


def _gave_none() -> str:
    rows = records(OWN_WORK)
    x = {config: [r["x"] for r in rows if r["config"] == config and r["model"] in NARROW]
         for config in ("none", "ddp sgd")}
    return (f"our own work {span(x['none'], times)} torch's step, DDP's {span(x['ddp sgd'], times)} "
            f"([own work](#mergecomps-own-work-per-step-one-process-no-network))")


#: the decision table's rows: optimizer, link, what to use, what it gave
_SUMMARY: Tuple[Tuple[str, str, str, Callable[[], str]], ...] = (
    ("SGD (momentum)", "1 Gbit/s or slower",
     '`compression="signsgd"`, `"onebit"` or `"efsignsgd"`, `groups="auto"` (the default)', _gave_sgd_slow),
    ("SGD", "10 Gbit/s or faster", 'any compressor, `groups="auto"`', _gave_sgd_fast),
    ("Adam / AdamW", "any", '`exchange_momentum_after="auto"` with `onebit`, `topk` or `powersgd`', _gave_adam),
    ("Adam / AdamW, gradients exchanged", "any", "only `fp16`, `bf16` or `qsgd`", _gave_adam_gradients),
    ("AdamW", "10-100 Mbit/s", '`mc.DiLoCo(params, opt, sync_every=10, compression="onebit", '
     'outer_optimizer=mc.averaging, fragments=2, fragment_sync_delay="auto", fragment_codecs="auto")`', _gave_diloco),
    ("FSDP2 with AdamW", "1 Gbit/s", '`mc.fsdp.compress(model, compression="qsgd", all_gather="int8")`', _gave_fsdp),
    ("anything", "a fast link, no compression wanted", '`compression="none"`', _gave_none),
)


def summary() -> str:
    """The decision table: which configuration for which optimizer and link, and what it gave in
    the tables of docs/benchmarks.md, computed from their records."""
    rows = ([optimizer, link, use, gave()] for optimizer, link, use, gave in _SUMMARY)
    return table(["you train with", "over", "use", "what it gave here"], ["---", "---", "---", "---"], rows)
