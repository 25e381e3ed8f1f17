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


def test_a_table_of_named_records_reads_only_their_runs():
    """The same configurations in the same setting, before and after the variance floor: each
    table keeps to its record."""
    without_floor = results.TABLES["adam-without-variance-floor"]()
    with_floor = adam.adam_momentum_exchange(adam.WITHOUT_FLOOR_ROWS, adam.BETA2_095, 600, (adam.BETA2_095_RECORD,))
    assert "diverged" in without_floor and "diverged" not in with_floor


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
