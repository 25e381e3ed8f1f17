"""The result tables' own rules (mergecomp_bench.results): rounds, signs, a summary that quotes
the tables below it, and every record's provenance."""
import json
import re

import pytest

from mergecomp_bench import results
from mergecomp_bench.results import adam, data, markdown, step_time


def _run(mode, step, label="", compressor=None):
    return {"mode": mode, "compressor": compressor, "plan": "auto" if compressor else mode, "rate": "1gbit",
            "step_s": step, "label": label, "status": "ok"}


def test_a_round_ends_where_a_configuration_comes_again_and_runs_before_a_change_are_left_out(tmp_path, monkeypatch):
    runs = [_run("ddp", 1.0), _run("mergecomp", 0.5, compressor="onebit"),
            _run("mergecomp", 0.6, "round 1, before (commit abc)", "onebit"),
            _run("ddp", 1.2), _run("mergecomp", 0.4, compressor="onebit")]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(run) + "\n" for run in runs))
    monkeypatch.setattr(data, "DATA", tmp_path)
    assert step_time.steps("r.jsonl") == {("1gbit", "ddp", "ddp"): [1.0, 1.2], ("1gbit", "onebit", "auto"): [0.5, 0.4]}


def test_a_difference_that_rounds_to_zero_has_no_minus_sign():
    assert markdown.signed(-0.0004) == "+0.00 %"
    assert markdown.signed(-0.5, 1, "pp") == "−0.5 pp"
    assert markdown.signed(float("nan")) == "diverged"


def test_the_summary_quotes_the_tables_it_points_at():
    rows = {row.split(" | ")[0].strip("| "): row for row in results.summary().splitlines()[2:]}
    quoted = {"SGD": results.every_compressor(), "FSDP2 with AdamW": results.fsdp2_step(),
              "anything": results.own_work()}
    for row, table in quoted.items():
        ratios = re.findall(r"\d+\.\d\dx", rows[row])
        assert ratios and all(ratio in table for ratio in ratios), (row, ratios)


def test_the_readme_headline_quotes_the_table_of_its_runs():
    ratio = re.search(r"(\d+\.\d\dx) sooner", results.TABLES["readme-headline"]()).group(1)
    assert f"**{ratio}**" in results.TABLES["readme-time-to-accuracy"]()


def test_a_stopped_run_is_projected_at_its_last_pace_not_its_mean():
    """A run that sent 8-bit warm-up steps first (4 s each) and 1-bit steps after (1 s each),
    stopped at step 300: 750 s so far, and the 700 steps left to a target at step 1000 at 1 s each."""
    from mergecomp_bench.results.time_to_target import projected

    curve = [{"step": 150, "seconds": 600.0}, {"step": 250, "seconds": 700.0}, {"step": 300, "seconds": 750.0}]
    assert projected({"stop": 300, "train_s": 750.0, "curve": curve}, 1000) == pytest.approx(1450.0)
    one_point = {"stop": 10, "train_s": 20.0, "curve": [{"step": 10, "seconds": 20.0}]}
    assert projected(one_point, 1850) == pytest.approx(3700.0), "one evaluation: the mean step"


def _curve(losses, pace):
    return [{"step": 100 * (i + 1), "seconds": pace * 100 * (i + 1), "test_loss": loss} for i, loss in enumerate(losses)]


def test_the_slow_links_table_takes_each_seed_s_target_and_shows_the_median_of_its_seeds(tmp_path, monkeypatch):
    """Two seeds, each with its own DDP fp32 loss curve (target: its final loss + 1 %): DDP fp32
    stopped after 100 steps at 10 s a step is projected to its seed's steps to target; the
    DiLoCo configuration reaches seed 0's target at step 300 (30 s) and seed 1's at step 200
    (20 s): a speed-up per seed, and the row their median and range; a stopped run that reaches
    one seed's target and not the other's says which."""
    from mergecomp_bench.results import time_to_target as ttt

    config = "onebit@averaging/10~2~auto~auto*2"
    common = {"status": "ok", "bits_per_element": 0.1, "compute_s": 0.07, "world": 2, "batch": 2}
    stretched = [{**common, "config": "ddp", "seed": 0, "steps": 400, "stop": None, "bits_per_element": 32,
                  "train_s": 40.0, "curve": _curve([3.0, 2.5, 2.1, 2.0], 0.1), "final_test_loss": 2.0},
                 {**common, "config": "ddp", "seed": 1, "steps": 400, "stop": None, "bits_per_element": 32,
                  "train_s": 40.0, "curve": _curve([3.0, 2.6, 2.2, 2.2], 0.1), "final_test_loss": 2.2}]
    slow = [{**common, "config": "ddp", "seed": seed, "rate": "10mbit", "steps": 400, "stop": 100, "train_s": 1000.0,
             "curve": _curve([3.0], 10.0)} for seed in (0, 1)]
    slow += [{**common, "config": config, "seed": 0, "rate": "10mbit", "steps": 800, "stop": None, "train_s": 80.0,
              "curve": _curve([2.5, 2.1, 2.0, 1.9], 0.1), "sync_delay": 3, "fragment_codecs": ["compressed"] * 2},
             {**common, "config": config, "seed": 1, "rate": "10mbit", "steps": 800, "stop": None, "train_s": 80.0,
              "curve": _curve([2.5, 2.2, 2.0, 1.9], 0.1), "sync_delay": 2, "fragment_codecs": ["compressed"] * 2}]
    # the momentum exchange, stopped after 100 steps at 5 s a step: on loopback it reaches seed 1's target, not seed 0's
    stretched += [{**common, "config": "onebit@auto", "seed": seed, "steps": 400, "stop": None, "train_s": 40.0,
                   "curve": _curve(losses, 0.1), "final_test_loss": losses[-1]}
                  for seed, losses in ((0, [3.0, 2.8, 2.6, 2.5]), (1, [3.0, 2.5, 2.2, 2.1]))]
    slow += [{**common, "config": "onebit@auto", "seed": seed, "rate": "10mbit", "steps": 400, "stop": 100,
              "train_s": 500.0, "curve": _curve([3.0], 5.0)} for seed in (0, 1)]
    for name, runs in ((ttt.STRETCHED, stretched), (ttt.SLOW_LINKS, slow)):
        (tmp_path / name).write_text("".join(json.dumps(run) + "\n" for run in runs))
    monkeypatch.setattr(data, "DATA", tmp_path)
    timed = ttt.slow_link_runs()["10mbit"]
    assert {seed: run.steps for seed, run in timed["ddp"].items()} == {0: 400, 1: 300}
    assert timed["ddp"][1].reached == pytest.approx(3000.0), "seed 1's steps at the stopped run's pace"
    assert {seed: run.steps for seed, run in timed[config].items()} == {0: 300, 1: 200}
    assert ttt.slow_link_speed_ups(timed)[config] == [pytest.approx(4000 / 30), pytest.approx(3000 / 20)]
    rows = ttt.diloco_slow_links().splitlines()
    ddp = next(line for line in rows if "| DDP fp32, seeds 0, 1 |" in line)
    assert "| 350 (300 to 400) | 3,500 s (3,000 s to 4,000 s) (projected: 100 steps timed) | – |" in ddp, ddp
    row = next(line for line in rows if "delay and codecs" in line)
    assert "(chose 3; the compressor, the compressor) / (chose 2; the compressor, the compressor)" in row
    assert "| 250 (200 to 300) | 25 s (20 s to 30 s) | 141.67x (133.33x to 150.00x) |" in row, row
    exchange = next(line for line in rows if "momentum exchanged every step" in line and "Mbit" in line)
    assert ("| 300 (seed 1); not reached (seed 0) | 1,500 s (projected: 100 steps timed) (seed 1); not reached (seed 0) "
            "(its 400 steps: 2,000 s projected) | 2.00x (seed 1) |") in exchange, exchange


def test_the_four_hosts_table_takes_each_seed_s_target_and_its_dense_diloco(tmp_path, monkeypatch):
    """Two seeds: each configuration's steps to its own seed's DDP fp32 final loss + 1 %, its
    final loss against its own seed's dense DiLoCo, each the median and range over the seeds; a
    seed whose target a configuration missed is named."""
    from mergecomp_bench.results import time_to_target as ttt

    def run(config, seed, losses, steps=400, bits=3.2):
        return {"status": "ok", "config": config, "seed": seed, "steps": steps, "bits_per_element": bits,
                "curve": _curve(losses, 0.1), "final_test_loss": losses[-1]}

    runs = [run("ddp", 0, [3.0, 2.5, 2.0, 2.0], steps=200, bits=32), run("ddp", 1, [3.0, 2.6, 2.2, 2.2], steps=200, bits=32),
            run(ttt._DENSE, 0, [2.5, 2.1, 2.0, 1.9]), run(ttt._DENSE, 1, [2.5, 2.2, 2.0, 2.0]),
            run("onebit@averaging/10*2", 0, [2.6, 2.4, 2.1, 2.09], bits=0.1),
            run("onebit@averaging/10*2", 1, [2.6, 2.2, 2.1, 2.1], bits=0.1)]
    (tmp_path / ttt.FOUR_HOSTS).write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(data, "DATA", tmp_path)
    rows = ttt.diloco_four_hosts().splitlines()
    dense = next(line for line in rows if "dense, seeds 0, 1" in line)
    assert "| 250 (200 to 300) | 1.950 (1.900 to 2.000) | – | – |" in dense, dense
    onebit = next(line for line in rows if "1-bit SGD, seeds 0, 1" in line)
    assert "| 200 (seed 1); not reached (seed 0) |" in onebit, onebit
    assert "| +7.50 % (+5.00 % to +10.00 %) | 1/32 |" in onebit, onebit


def test_the_fragment_count_table_sets_auto_beside_two_fragments_on_each_link(tmp_path, monkeypatch):
    """Each link's two configurations with what they chose, against each seed's DDP fp32 target
    (the stretched record's): 2 fragments' time to it over fragments="auto"'s, seed by seed."""
    from mergecomp_bench.results import time_to_target as ttt

    common = {"status": "ok", "bits_per_element": 0.1, "compute_s": 0.04, "steps": 400, "stop": None}
    stretched = [{**common, "config": "ddp", "seed": seed, "train_s": 40.0, "curve": _curve([3.0, 2.5, 2.0, 2.0], 0.1),
                  "final_test_loss": 2.0} for seed in (0, 1)]
    auto, two = "onebit@averaging/10~auto~auto~auto*2", "onebit@averaging/10~2~auto~auto*2"
    runs = [{**common, "config": two, "seed": 0, "rate": "10mbit", "step_s": 0.05, "train_s": 40.0,
             "curve": _curve([2.5, 2.1, 2.0, 1.9], 0.1), "final_test_loss": 1.9, "fragments": 2, "sync_delay": 4,
             "fragment_codecs": ["compressed"] * 2},
            {**common, "config": auto, "seed": 0, "rate": "10mbit", "step_s": 0.04, "train_s": 40.0,
             "curve": _curve([2.5, 2.0, 1.9, 1.8], 0.1), "final_test_loss": 1.8, "fragments": 5, "sync_delay": 1,
             "fragment_codecs": ["compressed"] * 5},
            {**common, "config": auto, "seed": 1, "rate": "10mbit", "step_s": 0.04, "train_s": 40.0,
             "curve": _curve([2.5, 2.3, 2.1, 2.1], 0.1), "final_test_loss": 2.1, "fragments": 4, "sync_delay": 1,
             "fragment_codecs": ["compressed"] * 4}]
    for name, records in ((ttt.STRETCHED, stretched), (ttt.FRAGMENT_COUNT, runs)):
        (tmp_path / name).write_text("".join(json.dumps(run) + "\n" for run in records))
    monkeypatch.setattr(data, "DATA", tmp_path)
    rows = ttt.diloco_fragment_count().splitlines()[2:]
    assert rows[0].startswith("| 10 Mbit/s | 2 | 4 | the compressor (all) | 0 |"), rows[0]
    assert rows[0].endswith("| 300 | 30 s | 1.900 | – |"), rows[0]
    assert rows[1].startswith("| 10 Mbit/s | `\"auto\"`: 5 / 4 | 1 | the compressor (all) | 0, 1 |"), rows[1]
    assert rows[1].endswith("| 200 (seed 0); not reached (seed 1) | 20 s (seed 0); not reached (seed 1) "
                            "| 1.950 (1.800 to 2.100) | 1.50x |"), rows[1]


def test_the_staleness_table_orders_fragments_and_delays_against_the_undelayed_run(tmp_path, monkeypatch):
    """One row per (fragments, delay), sorted, the unfragmented undelayed run first, over the
    seeds that ran it: steps to the seed's DDP fp32 final loss + 1 % and the final loss against
    the same seed's first run (median and range)."""
    from mergecomp_bench.results import time_to_target as ttt

    def run(config, losses, seed=0):
        return {"status": "ok", "config": config, "seed": seed, "steps": 400, "curve": _curve(losses, 0.1),
                "final_test_loss": losses[-1]}

    runs = [run("onebit@averaging/10~2~4*2", [2.6, 2.3, 2.2, 2.2]), run("ddp", [3.0, 2.5, 2.0, 2.0]),
            run("onebit@averaging/10~1~3*2", [2.6, 2.0, 2.0, 2.1]), run("onebit@averaging/10*2", [2.6, 2.4, 2.0, 2.0]),
            run("ddp", [3.0, 2.5, 2.4, 2.4], seed=1), run("onebit@averaging/10*2", [2.6, 2.4, 2.4, 2.4], seed=1),
            run("onebit@averaging/10~1~3*2", [2.6, 2.5, 2.5, 2.64], seed=1)]
    (tmp_path / ttt.STALENESS).write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(data, "DATA", tmp_path)
    rows = ttt.diloco_staleness().splitlines()[2:]
    assert rows == ["| 1 | 0 | 0, 1 | 250 (200 to 300) | 2.200 (2.000 to 2.400) | – |",
                    "| 1 | 3 | 0, 1 | 200 (seed 0); not reached (seed 1) | 2.370 (2.100 to 2.640) | +7.50 % (+5.00 % to +10.00 %) |",
                    "| 2 | 4 | 0 | not reached | 2.200 | +10.00 % |"], rows


def test_a_table_of_named_records_reads_only_their_runs():
    """The same configurations in the same setting, before and after the variance floor: each
    table keeps to its record."""
    without_floor = results.TABLES["adam-without-variance-floor"]()
    with_floor = adam.adam_momentum_exchange(adam.WITHOUT_FLOOR_ROWS, adam.BETA2_095, 600, (adam.BETA2_095_RECORD,))
    assert "diverged" in without_floor and "diverged" not in with_floor


def test_the_adam_noise_column_compares_fp16_gradients_with_adamw_on_each_seed_of_its_setting(tmp_path, monkeypatch):
    """fp16@grad against none@grad seed by seed (median and range); another setting's or run
    length's fp16 runs are not this row's; without any, a dash."""
    setting = {"layers": 3, "lr": 3e-3}

    def run(config, seed, loss, steps=600, **differs):
        return {"config": config, "seed": seed, "final_test_loss": loss, "steps": steps, "status": "ok",
                "setting": {**setting, **differs}}
    runs = [run("fp16@grad", 0, 1.01), run("fp16@grad", 1, 1.98), run("fp16@grad", 2, 3.09),
            run("fp16@grad", 0, 9.0, steps=300), run("fp16@grad", 1, 9.0, batch=16)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    (tmp_path / "none.jsonl").write_text(json.dumps(run("fp16@grad", 0, 1.0, beta2=0.95)) + "\n")
    monkeypatch.setattr(data, "DATA", tmp_path)
    full = {**adam._ADAM_DEFAULTS, **setting}
    baseline = {0: 1.0, 1: 2.0, 2: 3.0}
    assert adam._noise_cell(full, 600, "r.jsonl", baseline) == "+1.00 % (−1.00 % to +3.00 %)"
    assert adam._noise_cell(full, 300, "r.jsonl", baseline) == "+800.00 % (seed 0)"
    assert adam._noise_cell(full, 600, "none.jsonl", baseline) == "–"


def test_an_adam_auto_row_reads_the_runs_of_todays_warm_up_codec_and_names_another(tmp_path, monkeypatch):
    """Runs of today's K and R in two warm-up codecs: the cell reads those of the codec "auto"
    gives today (4-bit QSGD for 1-bit SGD's 600-update run); with only another codec's runs, it
    reads those and the row names their codec."""
    from mergecomp.registry import get_compressor

    setting = {"layers": 3, "lr": 1.5e-3, "clip": 1.0}
    eight, four = (repr(get_compressor("qsgd", levels=levels)) for levels in (127, 7))

    def run(config, seed, loss, codec=None, bits=32.0):
        return {"config": config, "seed": seed, "final_test_loss": loss, "steps": 600, "status": "ok",
                "after": codec and 150, "refresh": codec and 32, "warmup_codec": codec, "bits_per_element": bits,
                "setting": setting}
    old = [run("onebit@auto", seed, 2.2, eight, 3.0) for seed in (0, 1)]
    new = [run("onebit@auto", seed, 1.98, four, 1.9) for seed in (0, 1)]
    for name, runs in (("both.jsonl", old + new), ("old.jsonl", old)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(data, "DATA", tmp_path)
    full, baseline = {**adam._ADAM_DEFAULTS, **setting}, {0: 2.0, 1: 2.0}
    read = []
    for name in ("both.jsonl", "old.jsonl"):
        runs = adam._auto_runs(full, 600, name)
        assert runs["onebit"][1] == "qsgd4"
        read.append((adam._auto_cell(runs["onebit"][0], baseline, name, {0, 1}), adam._other_codecs(runs)))
    assert read == [("**−1.00 %** (worst −1.00 %; 1.90 bits)", ""),
                    ("+10.00 % (worst +10.00 %; 3.00 bits)",
                     ", measured with the 8-bit QSGD warm-up (`\"auto\"`'s today: 4-bit QSGD)")]


# Records older than provenance in every row (mergecomp_bench/records.py) for which neither the docs
# nor the commit messages give a command (docs/img/data/provenance.json says what they give instead).
# A gap may be filled; a new record must carry its command.
_NO_COMMAND_FOUND = {"adam_gpt2_3x256_beta2_095_without_variance_floor_2workers.jsonl",
                     "adam_gpt2_3x256_warmup_length_2workers.jsonl", "adam_gpt2_qsgd4_warmup_2workers.jsonl",
                     "convergence_digits_averaged_memory_2workers.jsonl"}


def test_every_record_carries_its_provenance_in_its_rows_or_in_the_index():
    names = sorted(path.name for path in data.DATA.iterdir() if path.is_file() and path.name != data.INDEX)
    without_command = set()
    for name in names:
        made = data.provenance(name)
        if made["source"] == "rows":
            assert made["runs"] and all(run["command"] and run["commit"] for run in made["runs"]), name
            continue
        assert set(made) >= {"command", "recorded_in", "machine", "note"}, name
        assert re.fullmatch(r"[0-9a-f]{7,40}", made["recorded_in"]), name
        assert made["note"], name
        if made["command"] is None:
            without_command.add(name)
        else:
            assert isinstance(made["command"], str) and made["command"].strip(), name
    assert without_command <= _NO_COMMAND_FOUND, without_command - _NO_COMMAND_FOUND


def test_every_index_entry_names_a_record_that_exists_and_lacks_its_own():
    index = data.provenance_index()
    assert "about" in json.loads(data.read(data.INDEX))
    for name in index:
        assert (data.DATA / name).is_file(), f"{data.INDEX} names {name}, which is not in {data.DATA}"
        assert data.provenance(name)["source"] == "index", f"{name}'s rows carry their own: drop its index entry"


def test_a_record_without_provenance_is_named(tmp_path, monkeypatch):
    made_by = {"command": "python scripts/bench_adam.py --json r.jsonl", "commit": "abc1234", "cpu": "AMD EPYC"}
    (tmp_path / "inline.jsonl").write_text(json.dumps({**made_by, "step_s": 1.0}) + "\n")
    (tmp_path / "bare.jsonl").write_text(json.dumps({"step_s": 1.0}) + "\n")
    (tmp_path / "indexed.jsonl").write_text(json.dumps({"step_s": 1.0}) + "\n")
    entry = {"command": "python x.py", "recorded_in": "abc1234", "machine": None, "note": "n"}
    (tmp_path / data.INDEX).write_text(json.dumps({"about": "a", "indexed.jsonl": entry}))
    monkeypatch.setattr(data, "DATA", tmp_path)
    assert data.provenance("inline.jsonl") == {"source": "rows", "runs": [made_by]}
    assert data.provenance("indexed.jsonl") == {"source": "index", **entry}
    with pytest.raises(KeyError, match="bare.jsonl"):
        data.provenance("bare.jsonl")
