"""`mergecomp plan`: the offline planner over the same predictor as the online scheduler."""
import json
import subprocess
import sys


def run_plan(*args):
    out = subprocess.run([sys.executable, "-m", "mergecomp.cli", "plan", *args],
                         capture_output=True, text=True, timeout=120)
    return out


def test_plan_prints_a_row_per_world_size_and_writes_json(tmp_path):
    path = tmp_path / "plan.json"
    out = run_plan("--model", "resnet18", "--compressor", "topk", "--world-sizes", "2,64",
                   "--bandwidth", "1", "--codec-gbps", "20", "--json", str(path))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 ") or line.startswith("| 64 ")]
    assert len(rows) == 2
    data = json.loads(path.read_text())
    assert [row["world_size"] for row in data] == [2, 64]
    for row in data:
        assert row["best"]["total_s"] <= row["fp32_fused"]["total_s"] + 1e-12
        assert row["best"]["total_s"] <= row["layerwise"]["total_s"] + 1e-12


def test_plan_accepts_a_json_list_of_shapes(tmp_path):
    sizes = tmp_path / "sizes.json"
    sizes.write_text(json.dumps([[512, 512], [512], 1000]))
    out = run_plan("--sizes", str(sizes), "--compressor", "fp16", "--world-sizes", "4", "--codec-gbps", "20")
    assert out.returncode == 0, out.stderr
    assert "3 tensors" in out.stdout


def test_plan_rejects_unknown_model_and_compressor():
    out = run_plan("--model", "nope", "--codec-gbps", "20")
    assert out.returncode != 0 and "unknown model 'nope'" in out.stderr
    out = run_plan("--compressor", "nope", "--codec-gbps", "20", "--model", "resnet18")
    assert out.returncode != 0 and "unknown compressor 'nope'" in out.stderr
