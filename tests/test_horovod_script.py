"""A training script written for Horovod (tests/horovod_style_train.py, ``import mergecomp.torch
as hvd``) launched as a user would: ``torchrun --nproc_per_node 2`` and Horovod's own
``horovodrun --gloo -np 2 -H localhost:2``.  Per launch, for Compression.none, fp16 and topk:
both ranks end with identical, finite parameters and the same averaged losses; the loss goes
down for none and fp16; none equals one process training on the whole batch."""
import json
import os
import sys

import horovod_style_train as script
import pytest
import torch
from test_engines import HOROVODRUN, launch

from mergecomp.horovod_api.runtime import importable

TIMEOUT = 120
COMPRESSIONS = ("none", "fp16", "topk")


def torchrun_cmd():
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    torchrun = [beside] if os.access(beside, os.X_OK) else [sys.executable, "-m", "torch.distributed.run"]
    return torchrun + ["--standalone", "--nproc_per_node", "2", script.__file__]  # --standalone: a free port


def single_process_params():
    """The script's training on the whole batch in one process, without mergecomp."""
    x, y = script.make_data().tensors
    model = script.make_model(seed=1)  # rank 0's initial weights
    opt = torch.optim.SGD(model.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    for _ in range(script.STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_and_check(cmd, out_dir, engine):
    rc, _, text = launch(cmd + [str(out_dir)], timeout=TIMEOUT)
    output = f"{cmd[0]} output:\n{text[-4000:]}"
    assert rc == 0, f"exit status {rc}; {output}"
    files = sorted(os.listdir(out_dir))
    assert files == ["rank0.json", "rank1.json"], f"{files}; {output}"
    records = [json.loads((out_dir / name).read_text()) for name in files]
    assert [(r["rank"], r["local_rank"], r["size"], r["engine"]) for r in records] == \
        [(0, 0, 2, engine), (1, 1, 2, engine)], output
    for name in COMPRESSIONS:
        (p0, l0), (p1, l1) = [(torch.tensor(r["runs"][name]["params"]), r["runs"][name]["losses"]) for r in records]
        assert torch.equal(p0, p1), f"{name}: the ranks' parameters differ; {output}"
        assert torch.isfinite(p0).all(), f"{name}: non-finite parameters; {output}"
        assert l0 == l1 and len(l0) == script.STEPS, f"{name}: losses {l0} vs {l1}; {output}"
        if name != "topk":
            assert l0[-1] < l0[0], f"{name}: the loss did not go down: {l0}; {output}"
    none = torch.tensor(records[0]["runs"]["none"]["params"])
    diff = (none - single_process_params()).abs().max().item()
    assert diff < 1e-6, f"none differs from one process on the whole batch by {diff}; {output}"


def test_horovod_style_script_under_torchrun(tmp_path):
    run_and_check(torchrun_cmd(), tmp_path, "torch")


def test_horovod_style_script_under_horovodrun_gloo(tmp_path):
    if HOROVODRUN is None or not importable("horovod.torch"):
        pytest.skip("horovodrun or horovod.torch not installed: bash scripts/install_horovod.sh")
    cmd = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, script.__file__]
    run_and_check(cmd, tmp_path, "horovod")
