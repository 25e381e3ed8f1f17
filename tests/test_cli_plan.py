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


def test_plan_prints_the_fp16_baseline_and_a_row_per_host_size(tmp_path):
    path = tmp_path / "plan.json"
    out = run_plan("--model", "resnet18", "--compressor", "onebit", "--world-sizes", "2,16,512",
                   "--host-size", "1,8", "--max-groups", "2", "--codec-gbps", "200", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert "| workers | per host | best plan" in out.stdout and "| best fp16/bf16 plan ms | vs fp16 |" in out.stdout
    data = json.loads(path.read_text())
    assert [(row["world_size"], row["host_size"]) for row in data] == [(2, 1), (16, 1), (512, 1), (16, 8), (512, 8)]
    for row in data:
        assert set(row["fp16"]["codecs"]) <= {"fp16", "none"}
        assert row["best"]["total_s"] <= row["fp16"]["total_s"] + 1e-12
    flat, hosts = data[2], data[4]
    assert set(flat["best"]["codecs"]) == {"two-phase"}  # allgather loses at 512 ranks
    assert set(hosts["best"]["codecs"]) <= {"hierarchical", "hierarchical-two-phase"}


def test_exchange_codecs_follow_the_compressor_and_the_cluster():
    import mergecomp
    from mergecomp.scheduler.costmodel import Cluster
    from mergecomp.scheduler.offline import exchange_codecs

    topk, randk = mergecomp.get_compressor("topk"), mergecomp.get_compressor("randk")
    assert exchange_codecs(topk, Cluster(2, 0.0, 1e9)) == ("compressed",)
    assert exchange_codecs(topk, Cluster(3, 0.0, 1e9)) == ("compressed", "two-phase")
    assert exchange_codecs(topk, Cluster(16, 0.0, 1e9, 8)) == ("compressed", "two-phase", "hierarchical")
    assert exchange_codecs(topk, Cluster(24, 0.0, 1e9, 8)) == ("compressed", "two-phase", "hierarchical",
                                                                "hierarchical-two-phase")
    assert exchange_codecs(randk, Cluster(64, 0.0, 1e9, 8)) == ("compressed",)  # summed by allreduce


def test_votes_compressors_never_get_fp16_or_none(monkeypatch):
    from mergecomp.scheduler.zoo import backward_shapes
    from mergecomp.scheduler import offline as planner

    def plain_codecs(name):
        rows = planner.plan_table(backward_shapes("resnet18"), name, {}, [2, 64], 100.0, 50.0, 100.0, 2, 200.0,
                                  (1, 8))
        assert len(rows) == 3
        return {codec for row in rows for codec in row["best"].codecs} & {"fp16", "none"}

    for name in ("signsgd", "signum"):
        assert not plain_codecs(name)
    monkeypatch.setattr(planner, "has_codec_choice", lambda compressor: True)
    assert plain_codecs("signsgd")  # on 100 Gbit/s they would win groups
