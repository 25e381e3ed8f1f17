"""The result tables' own rules (mergecomp_bench.results): rounds, signs, and a summary that quotes
the tables below it."""
import json
import re

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


def test_a_table_of_named_records_reads_only_their_runs():
    """The same configurations in the same setting, before and after the variance floor: each
    table keeps to its record."""
    without_floor = results.TABLES["adam-without-variance-floor"]()
    with_floor = adam.adam_momentum_exchange(adam.WITHOUT_FLOOR_ROWS, adam.BETA2_095, 600, (adam.BETA2_095_RECORD,))
    assert "diverged" in without_floor and "diverged" not in with_floor
