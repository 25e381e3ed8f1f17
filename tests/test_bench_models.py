"""Benchmark models (transformers' ResNets and GPT-2, a VGG-16): the zoo's gradient sets at full width,
a working forward/backward scaled down."""
import pytest
import torch

from mergecomp.scheduler import zoo
from mergecomp_bench.models import MODELS, build_model, loss


@pytest.mark.parametrize("name", list(MODELS))
def test_full_width_parameters_match_the_model_zoo(name):
    with torch.device("meta"):  # names and shapes only: no memory, no initialisation
        model, _ = build_model(name)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert named == zoo.named_shapes(name)
    assert sum(p.numel() for p in model.parameters()) == zoo.numel(name)


def test_zoo_counts_are_the_published_ones():
    assert [zoo.numel(n) for n in ("resnet50", "resnet18", "vgg16", "gpt2-small")] == [
        25_557_032, 11_689_512, 138_357_544, 124_439_808]
    assert [len(zoo.named_shapes(n)) for n in ("resnet50", "resnet18", "vgg16", "gpt2-small")] == [161, 62, 32, 148]


@pytest.mark.parametrize("name,input_size", [("resnet50", 16), ("resnet18", 16), ("vgg16", 32), ("gpt2-small", 8)])
def test_forward_backward_at_small_scale(name, input_size):
    torch.set_num_threads(1)
    model, make_batch = build_model(name, width=0.125, input_size=input_size)
    data, target = make_batch(2, torch.Generator().manual_seed(0))
    value = loss(model(data), target)
    value.backward()
    assert torch.isfinite(value)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_same_seed_same_weights():
    first, _ = build_model("resnet18", width=0.125, seed=3)
    second, _ = build_model("resnet18", width=0.125, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


def test_unknown_model_bad_width_and_too_long_a_sequence():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("alexnet")
    with pytest.raises(ValueError, match="width"):
        build_model("resnet18", width=0)
    with pytest.raises(ValueError, match="1024"):
        build_model("gpt2-small", input_size=1025)


def test_without_transformers_the_error_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ImportError, match=r'pip install -e "\.\[bench\]"'):
        build_model("resnet18", width=0.125)
    build_model("vgg16", width=0.125)  # written here: no transformers needed


def test_bench_cli_runs_in_one_process(tmp_path):
    """`mergecomp-bench` with a tiny model, one process (local engine): every plan gets a record
    with its step breakdown and the optimizer's nonfinite policy."""
    import json
    import subprocess
    import sys

    out_json = tmp_path / "bench.jsonl"
    out = subprocess.run([sys.executable, "-m", "mergecomp_bench", "--model", "resnet18", "--width", "0.125",
                          "--input-size", "16", "--batch-size", "2", "--compressor", "topk",
                          "--plan", "auto,layerwise,1,fp32", "--steps", "1", "--rounds", "1", "--warmup", "1",
                          "--nonfinite", "ignore", "--json", str(out_json)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out_json.read_text().splitlines()]
    assert [r["plan"] for r in records] == ["auto", "layerwise", "1", "fp32"]
    assert all(r["status"] == "ok" and r["step_s"] > 0 for r in records)
    assert all(r["nonfinite"] == "ignore" for r in records)  # as the optimizer was built
    assert records[0]["search_steps_total"] <= 30
    assert records[3]["codecs"] == ["none"]
    assert all(r["breakdown"]["steps"] == 1 and r["breakdown"]["groups"] for r in records)  # 1 round x 1 step
    assert "Where a step's time goes" in out.stdout


def test_cluster_runs_one_worker_per_namespace_and_tears_down():
    """mergecomp_bench.cluster (needs root and iproute2; skipped otherwise): the workers get torchrun's
    variables, a timeout kills them, and no namespace survives the run."""
    import os
    import shutil
    import subprocess
    import sys

    from mergecomp_bench.cluster import Cluster, ClusterError

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root and iproute2")
    check = ("import os, sys; e = os.environ; sys.exit(0 if e['MASTER_ADDR'] == '10.77.0.1' and "
             "e['GLOO_SOCKET_IFNAME'] == 'eth0' and e['WORLD_SIZE'] == '2' else 3)")
    try:
        with Cluster(2, "1gbit") as cluster:
            names = [*cluster.host_ns, cluster.bridge_ns]
            assert cluster.run([sys.executable, "-c", check], timeout=60) == [0, 0]
            assert cluster.run(["sleep", "30"], timeout=1) == [124, 124]
    except ClusterError as err:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(str(err))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def _serialized_powersgd_worker(rank):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mergecomp_bench.runner import one_bucket_at_a_time

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]), bucket_cap_mb=0.02)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    calls = []

    def watched(state, bucket):
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        calls.append((bucket.index(), future))
        return future

    model.register_comm_hook(state, one_bucket_at_a_time(watched))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
        opt.step()
    # every bucket's hook ran after the previous bucket's result was ready
    done_before_next = all(calls[i][1].done() for i in range(len(calls) - 1) if calls[i + 1][0] != 0)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, params)
    return len({c[0] for c in calls}), done_before_next, all(torch.equal(r, rows[0]) for r in rows)


def test_serialized_powersgd_anchor_runs_on_gloo_and_keeps_ranks_identical():
    from distributed import run_workers

    for buckets, ordered, identical in run_workers(_serialized_powersgd_worker, 2):
        assert buckets > 2 and ordered and identical


def test_the_cluster_links_bucket_is_ten_milliseconds_of_the_rate_within_bounds():
    from mergecomp_bench.cluster import tbf_burst

    assert tbf_burst("10mbit") == "65536b"     # 12.5 KB: at least a GSO segment
    assert tbf_burst("100mbit") == "125000b"   # 10 ms
    assert tbf_burst("1gbit") == tbf_burst("10Gbit") == "1048576b"  # tc's "1mb", as before
    with pytest.raises(ValueError, match="'10mbps'"):
        tbf_burst("10mbps")  # bytes per second in tc's units
