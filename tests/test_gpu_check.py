"""``scripts/gpu_check.sh`` without a CUDA device (``CUDA_VISIBLE_DEVICES=""``, so the same on
any machine): every CUDA test skips, the other stages are skipped, the verdict line comes last,
the summary files are written, exit 0.  And the verdict and JUnit reading on made-up results."""
import json
import os
import re
import subprocess
import time
from pathlib import Path

from mergecomp_bench.gpu_check.cuda_tests import read_junit, read_log
from mergecomp_bench.gpu_check.report import markdown, verdict
from mergecomp_bench.gpu_check.run import BUDGET_S

ROOT = Path(__file__).resolve().parents[1]


def test_the_check_without_a_cuda_device_skips_every_cuda_test_and_says_so_last(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"gpu_check: no CUDA device: (\d+) tests skipped", last)
    assert match, done.stdout
    summary = json.loads((out / "summary.json").read_text())
    tests = summary["stages"]["tests"]
    assert summary["status"] == "no-cuda" and summary["verdict"] == last
    assert tests["tests"] == tests["skipped"] == int(match[1]) > 0  # nothing ran, nothing failed
    assert "no CUDA device: torch.cuda.is_available() is False" in tests["skip_reasons"]
    assert summary["stages"]["codecs"]["skipped_stage"] == summary["stages"]["training"]["skipped_stage"]
    assert last in (out / "summary.md").read_text()
    assert (out / "cuda_tests.xml").is_file() and (out / "cuda_tests.log").is_file()


def summary_of(tests, cuda=True, codecs=None, training=None):
    return {"device": {"cuda": cuda, "name": "GPU X" if cuda else None, "count": int(cuda), "torch": "2",
                       "cuda_version": None}, "budget_s": BUDGET_S, "seconds": 300.0,
            "stages": {"tests": {"command": "pytest", "seconds": 1.0, **tests},
                       "codecs": codecs or {"seconds": 1.0}, "training": training or {"seconds": 1.0}}}


COUNTS = {"tests": 10, "passed": 8, "failed": 0, "errors": 0, "skipped": 2, "failing": [], "skip_reasons": []}


def test_the_verdict_passes_quoting_the_numbers_and_fails_naming_what_failed():
    codecs = {"seconds": 1.0, "repeats": 5, "best": {"ratio": 3.5, "model": "resnet50", "compressor": "topk"},
              "models": {}}
    training = {"seconds": 1.0, "steps": 15, "warmup": 5, "models": {"resnet50": {"batch": 64, "rows": [
        {"config": "torch sgd", "median_ms": 10.0, "x": 1.0, "aten_ops": 900, "peak_gib": 1.0, "loss": 1.0},
        {"config": "none", "median_ms": 11.0, "x": 1.1, "aten_ops": 950, "groups": 4, "peak_gib": 1.0, "loss": 1.0}]}}}
    status, line = verdict(summary_of(COUNTS, codecs=codecs, training=training))
    assert status == "pass"
    assert line == ("gpu_check: PASS on GPU X: 8 CUDA tests passed, 2 skipped; merged vs layer-wise up to 3.50x "
                    "(topk, resnet50); resnet50 step vs torch: none 1.10x; 300 s")
    failing = {**COUNTS, "passed": 6, "failed": 1, "errors": 1, "failing": ["m::test_a", "m::test_b"]}
    status, line = verdict(summary_of(failing, training={"error": "RuntimeError: boom", "seconds": 1.0}))
    assert status == "fail"
    assert line == "gpu_check: FAIL on GPU X: 2 of 10 CUDA tests failed (test_a, test_b); training: RuntimeError: boom"
    status, line = verdict(summary_of({"problem": "timed out after 210 s"}))
    assert (status, line) == ("fail", "gpu_check: FAIL on GPU X: CUDA tests: timed out after 210 s")
    skipped = {**COUNTS, "passed": 0, "skipped": 10}
    assert verdict(summary_of(skipped, cuda=False)) == ("no-cuda", "gpu_check: no CUDA device: 10 tests skipped")
    summary = summary_of(COUNTS, codecs=codecs, training=training)
    summary["verdict"] = verdict(summary)[1]
    assert "| none | 11.00 | 1.10x | 950 | 4 |" in markdown(summary)


def test_junit_results_are_counted_by_outcome(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="4">'
                   '<testcase classname="m" name="ok"/>'
                   '<testcase classname="m" name="bad"><failure message="x"/></testcase>'
                   '<testcase classname="m" name="broken"><error message="y"/></testcase>'
                   '<testcase classname="m" name="later"><skipped message="no CUDA device"/></testcase>'
                   '</testsuite></testsuites>')
    assert read_junit(xml) == {"tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                               "failing": ["m::bad", "m::broken"], "skip_reasons": ["no CUDA device"]}


def test_a_run_stopped_before_its_junit_xml_is_counted_from_its_log(tmp_path):
    log = tmp_path / "cuda_tests.log"
    log.write_text("tests/cuda/test_a.py::test_ok[fp16] PASSED                    [  1%]\n"
                   "tests/cuda/test_a.py::test_bad FAILED                         [  2%]\n"
                   "tests/cuda/test_b.py::test_skip SKIPPED (no CUDA)             [  3%]\n"
                   "tests/cuda/test_b.py::test_broken ERROR                       [  4%]\n"
                   "FAILED tests/cuda/test_a.py::test_bad - AssertionError\n")
    assert read_log(log) == {"tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                             "failing": ["tests/cuda/test_a.py::test_bad", "tests/cuda/test_b.py::test_broken"],
                             "skip_reasons": []}


def test_a_run_past_its_budget_is_interrupted_and_still_reports_its_failures(tmp_path, monkeypatch):
    """The stage's pytest is stopped as by Ctrl-C when its time is up: the failure so far
    and its traceback reach the JUnit XML and the log (a kill would leave neither).  The time
    is up here once the slow test has begun, however long pytest took to get there."""
    from mergecomp_bench.gpu_check import cuda_tests

    (tmp_path / "tests" / "cuda").mkdir(parents=True)
    (tmp_path / "tests" / "cuda" / "test_slow.py").write_text(
        "import pathlib, time\n\n"
        "def test_bad():\n    assert 1 == 2, 'the reason'\n\n"
        "def test_slow():\n    pathlib.Path('slow_began').touch()\n    time.sleep(3600)\n")
    out = tmp_path / "out"
    out.mkdir()
    wait = cuda_tests.wait_or_interrupt

    def when_the_slow_test_began(process, seconds):
        while not (tmp_path / "slow_began").exists():
            assert process.poll() is None, (out / "cuda_tests.log").read_text()
            time.sleep(0.05)
        return wait(process, 0)

    monkeypatch.setattr(cuda_tests, "wait_or_interrupt", when_the_slow_test_began)
    result = cuda_tests.run(tmp_path, out, 3600)
    assert result["problem"].startswith("timed out") and result["exit_code"] is None
    assert result["failing"] == ["tests.cuda.test_slow::test_bad"] and "junit" in result, result
    assert "the reason" in (out / "cuda_tests.log").read_text()


def test_a_configuration_that_fails_leaves_the_others_rows_and_fails_the_verdict_by_name():
    """Stage 3 builds each configuration per round: one that raises (here a compressor that does
    not exist) gets its error, the others their times, and the verdict names it."""
    import torch

    from mergecomp_bench.host_overhead import Config, build, compare

    model = build("gpt2-2x8", torch.device("cpu"))
    rows = compare(model, [Config("torch sgd"), Config("bad", "sgd", "mergecomp", "no-such-compressor"),
                           Config("none", "sgd", "mergecomp", "none")], rounds=1, steps=1, warmup=1, resident=False,
                   log=lambda line: None, count_ops=False)
    by = {row["config"]: row for row in rows}
    assert "no-such-compressor" in by["bad"]["error"] and "median_ms" not in by["bad"]
    assert by["none"]["median_ms"] > 0 and by["none"]["x"] > 0 and "error" not in by["none"]
    training = {"seconds": 1.0, "steps": 1, "warmup": 1, "models": {"gpt2-2x8": {"batch": 2, "rows": rows}}}
    summary = summary_of(COUNTS, training=training)
    status, line = verdict(summary)
    assert status == "fail" and "training: gpt2-2x8/bad: " in line
    summary["verdict"] = line
    assert "| bad | ValueError: " in markdown(summary)
