"""Horovod's elastic API (``mc.elastic``): a real ``horovodrun`` elastic job that grows from 2 to 3
workers and loses the third (tests/elastic_train.py; TensorFlow's ``hvd.elastic``:
tests/elastic_train_tf.py), with mergecomp's state checked after every change; the same script under torchrun (no elasticity: it runs once); and the state each
rank keeps across a reset (:func:`mergecomp.pipeline.resharding.rejoined`)."""
import importlib.util
import json
import os
import stat
import sys

import pytest
import torch

from mergecomp.pipeline.resharding import differing_fields, rejoined
from test_engines import HOROVODRUN, _env, launch, needs_horovod

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "elastic_train.py")
SCRIPT_TF = os.path.join(HERE, "elastic_train_tf.py")
needs_tensorflow = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None
                                      or importlib.util.find_spec("keras") is None, reason="TensorFlow not installed")
GROW_AT, FAIL_AT, STEPS = 4, 10, 16


def _root(step=5, q=1.0, momentum=None):
    compressor = {"g0": {"q": torch.full((3,), q)}}
    if momentum is not None:
        compressor["g0"]["momentum"] = torch.full((4,), momentum)
    return {"plan": "p", "shapes": [[4]], "step": step, "world_size": 2, "skipped_steps": 0, "scheduler": {"s": 1},
            "compressor": compressor, "shard_memory": {"g0": {"r": torch.ones(2)}}}


def _own(step=5, q=1.0, momentum=None, residual=7.0):
    return {**_root(step, q, momentum), "memory": {"g0": {"residual": torch.full((4,), residual)}}}


HOLDERS = ["memory", "compressor", "shard_memory"]


def test_a_rank_that_stayed_keeps_its_own_memory_and_takes_the_roots_replicated_state():
    state = rejoined(_own(q=1.0, momentum=2.0, residual=7.0), _root(q=1.0, momentum=3.0), [1, 0], HOLDERS, 3)
    assert torch.equal(state["memory"]["g0"]["residual"], torch.full((4,), 7.0))
    assert torch.equal(state["compressor"]["g0"]["q"], torch.ones(3))                 # replicated: the root's
    assert torch.equal(state["compressor"]["g0"]["momentum"], torch.full((4,), 2.0))  # per rank: its own
    assert state["shard_memory"] == {} and state["scheduler"] is None                 # cut by N; timed for N


def test_a_rank_that_joined_holds_no_other_ranks_state():
    fresh = {"plan": "p", "shapes": [[4]], "step": 0, "memory": {}, "compressor": {}}
    for own in (None, fresh, _own(step=4)):  # a new process; a fresh optimizer; a rank a step behind
        state = rejoined(own, _root(momentum=3.0), [1, 0], HOLDERS, 3)
        assert state["memory"] == {}
        assert list(state["compressor"]["g0"]) == ["q"]  # the root's Q, not its momentum


def test_per_rank_fields_are_the_ones_that_differ_from_the_roots():
    root = _root(q=1.0, momentum=3.0)
    assert differing_fields(_own(q=1.0, momentum=2.0), root) == [1, 0]  # fields sorted: momentum, q
    assert differing_fields(_own(q=1.0, momentum=3.0), root) == [0, 0]
    assert differing_fields(None, root) == [0, 0]
    assert differing_fields(_own(step=4, momentum=2.0), root) == [0, 0]  # not the root's run: tells nothing


def test_the_scheduler_is_kept_where_the_world_kept_its_size():
    assert rejoined(_own(), _root(), [0], HOLDERS, 2)["scheduler"] == {"s": 1}


def _records(out):
    rows = [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["step"], r["at"] != "commit", r["pid"]))


def _elastic_job(tmp_path, script, setting, gloo_timeout):
    """``script`` under ``horovodrun``'s elastic mode (module docstring's schedule): its records."""
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/bash\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    cmd = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "3", "--network-interface", "lo",
           "--host-discovery-script", str(discover), sys.executable, script, str(out), str(hosts),
           *setting, "--steps", str(STEPS), "--grow-at", str(GROW_AT), "--fail-at", str(FAIL_AT)]
    rc, _, text = launch(cmd, env=_env(HOROVOD_GLOO_TIMEOUT_SECONDS=str(gloo_timeout)), timeout=300)
    assert rc == 0, text[-4000:]
    return _records(out)


def _check_changes(rows, rejoined_at_sync=True):
    """Every sync: the sizes and the reset callback's learning rate as scheduled, parameters and
    replicated compressor state from rank 0, each rank its own residual (one that joined: none;
    one that stayed: its last commit's).  ``rejoined_at_sync``: the merged step agrees at the
    sync itself (torch), else at the first step after it (TensorFlow's reducers rejoin at their
    next exchange)."""
    syncs = [r for r in rows if r["at"] == "sync"]
    assert [(r["step"], r["size"]) for r in syncs] == \
        [(0, 2), (0, 2), (GROW_AT, 3), (GROW_AT, 3), (GROW_AT, 3), (FAIL_AT, 2), (FAIL_AT, 2)]
    per_rank = syncs[0]["lr"] / syncs[0]["size"]
    assert [r["lr"] for r in syncs] == pytest.approx([per_rank * r["size"] for r in syncs])  # the reset callback ran
    commits = {(r["pid"], r["step"], r["size"]): r for r in rows if r["at"] == "commit"}
    for step in (0, GROW_AT, FAIL_AT):
        world = [r for r in syncs if r["step"] == step]
        assert len({r["params"] for r in world}) == 1, world      # parameters from rank 0
        after = world if rejoined_at_sync else [r for r in rows if r["at"] == "commit" and r["step"] == step + 1]
        assert len(after) == len(world)
        assert len({r["compressor"] for r in after}) == 1, after  # PowerSGD's Q: replicated
        assert {r["merged_step"] for r in after} == {step + (not rejoined_at_sync)}
        memories = [r["memory"] for r in world if r["memory"]]
        assert len(set(memories)) == len(memories), world  # no rank holds another's residual
        for r in world:
            before = [c for (pid, s, size), c in commits.items() if pid == r["pid"] and s == step and size != r["size"]]
            if r["joined"] and step == GROW_AT:
                assert r["memory"] == 0.0, r  # a joining worker starts with no residual
            elif before:  # stayed through the change: its own memory as it committed it
                assert r["memory"] == before[0]["memory"], (r, before)
    last = [r for r in rows if r["at"] == "commit" and r["step"] == STEPS - 1]
    assert len(last) == 2 and len({r["params"] for r in last}) == 1


@needs_horovod
@pytest.mark.parametrize("setting", [["--compression", "powersgd"], ["--compression", "onebit", "--adamw"]],
                         ids=["powersgd", "onebit-adamw-momentum"])
def test_horovodrun_elastic_job_grows_and_loses_a_worker(tmp_path, setting):
    """2 workers on "localhost", a third added on "127.0.0.1" at step 4 (the discovery script's
    hosts file), which exits at step 10 without a word; the job ends on 2 workers at step 16.
    PowerSGD (its ``Q`` replicated, a residual per rank) with SGD; 1-bit SGD exchanging AdamW's
    momentum (the variance frozen after 2 updates)."""
    _check_changes(_elastic_job(tmp_path, SCRIPT, setting, gloo_timeout=30))  # the joining worker imports torch


@needs_horovod
@needs_tensorflow
@pytest.mark.parametrize("setting", [["--compression", "powersgd"], ["--compression", "topk", "--fit"]],
                         ids=["tape-powersgd", "keras-fit-topk"])
def test_horovodrun_elastic_tensorflow_job_grows_and_loses_a_worker(tmp_path, setting):
    """The same schedule with ``mergecomp.tensorflow``'s ``hvd.elastic``: Horovod's TensorFlow 2
    pattern (a ``tf.function`` wrapping its tape in ``DistributedGradientTape``, PowerSGD) and
    ``model.fit`` with a compiled ``DistributedOptimizer`` and the Keras elastic callbacks
    (top-k).  A joining worker imports TensorFlow before it meets the others: a longer gloo
    timeout."""
    _check_changes(_elastic_job(tmp_path, SCRIPT_TF, setting, gloo_timeout=30), rejoined_at_sync=False)


@needs_horovod
def test_elastic_script_under_torchrun_runs_once(tmp_path):
    """Without Horovod's driver the training function runs once after the sync."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, str(out),
           str(tmp_path / "hosts"), "--steps", "3", "--grow-at", "0", "--fail-at", "0"]
    rc, _, text = launch(cmd, timeout=120)
    assert rc == 0, text[-4000:]
    rows = _records(out)
    assert [r["step"] for r in rows if r["at"] == "sync"] == [0, 0]
    assert len({r["params"] for r in rows if r["step"] == 2}) == 1


@pytest.mark.parametrize("own_store", [False, True])
def test_torchrun_restarts_on_a_shared_store_are_warned_of(tmp_path, own_store):
    """torchrun with --max-restarts shares one TCPStore across its restarts unless its agents run
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a restarted worker can read an earlier attempt's
    addresses): ``mc.init()`` warns on rank 0 then, and only then."""
    script = tmp_path / "init_only.py"
    script.write_text("import warnings\nwarnings.simplefilter('always')\nimport mergecomp.torch as mc\n"
                      "mc.init()\nmc.shutdown()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", str(script)]
    rc, _, text = launch(cmd, env=_env(**({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if own_store else {})),
                         timeout=120)
    assert rc == 0, text[-4000:]
    assert text.count("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment") == (0 if own_store else 1), text[-4000:]
