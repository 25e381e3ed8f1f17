"""Engines under their own launchers: torchrun (torch), mpirun (mpi4py), horovodrun (Horovod).

The same script (tests/engine_train.py) runs under each launcher with 2 ranks; every engine must
produce bit-for-bit the parameters the torch.distributed engine produces (2 ranks: a + b is
exact whatever the algorithm), identical on all ranks, and pass a self-check of its collectives
(bf16 and fp16 sums, strided tensors, allgather, broadcast, all-to-all; the self-check also on 3
ranks).  Engine selection and its errors (missing library, mismatched launcher) are checked too.
MPI tests skip without mpi4py/mpirun, Horovod tests without horovod.torch/horovodrun.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import mergecomp.torch as mc
from mergecomp.horovod_api.runtime import detect_engine, launcher_mismatch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "engine_train.py")
COMPRESSORS = ["none", "fp16", "topk", "signsgd", "qsgd"]
TIMEOUT = 150
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "MERGECOMP_ENGINE", "_")


def _tool(name):
    """``name`` next to this Python (where pip puts horovodrun), or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else shutil.which(name)


def _has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


MPIRUN = _tool("mpirun")
HOROVODRUN = _tool("horovodrun")
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="no mpirun: pip install \"mergecomp[mpi]\"")
needs_mpi = pytest.mark.skipif(MPIRUN is None or not _has("mpi4py.MPI"),
                               reason="mpi4py or mpirun not installed: pip install \"mergecomp[mpi]\"")
needs_horovod = pytest.mark.skipif(HOROVODRUN is None or not _has("horovod.torch"),
                                   reason="horovod not installed: bash scripts/install_horovod.sh")


def _skip_without(launcher):
    """Skip unless ``launcher`` (``mpirun``, ``horovodrun ...``) and its engine's library are installed."""
    if launcher == "mpirun" and (MPIRUN is None or not _has("mpi4py.MPI")):
        pytest.skip("mpi4py or mpirun not installed")
    if launcher.startswith("horovodrun") and (HOROVODRUN is None or not _has("horovod.torch")):
        pytest.skip("horovod not installed")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("OMPI_", "PMI_", "PMIX_", "HOROVOD_"))}
    # Open MPI refuses root without these; harmless otherwise.
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "MERGECOMP_TIMEOUT": "60",
                "OMP_NUM_THREADS": "1", **extra})
    return env


def _mpirun_args(ranks=2):
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30)
    open_mpi = "Open MPI" in version.stdout + version.stderr or "prte" in version.stdout.lower()
    return [MPIRUN, "-np", str(ranks)] + (["--oversubscribe"] if open_mpi else [])


def launch(cmd, env=None, timeout=TIMEOUT):
    """Run ``cmd`` in its own process group (killed whole on timeout).

    Returns (exit status, the MCJSON records in order, the whole output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or _env(),
                            cwd=HERE, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout}s (a hang):\n"
                             f"{out.decode(errors='replace')[-4000:]}") from None
    text = out.decode(errors="replace")
    records = [json.loads(line.split("MCJSON ", 1)[1]) for line in text.splitlines() if "MCJSON " in line]
    return proc.returncode, records, text


def run_training(cmd, tmp_path_factory, compressors=COMPRESSORS):
    out = tmp_path_factory.mktemp("engine_run")
    rc, _, text = launch(cmd + ["--compressors", ",".join(compressors), "--out", str(out)])
    assert rc == 0, f"{cmd} exited with {rc}:\n{text[-4000:]}"
    records = [json.loads(line) for f in sorted(out.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    return records, text


def torchrun_cmd(script_args=()):
    # --standalone: torchrun binds its own free port (a port picked here could be taken by
    # another process before torchrun binds it)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
            *script_args]


def mpirun_cmd(script_args=(), ranks=2):
    return _mpirun_args(ranks) + [sys.executable, SCRIPT, *script_args]


def horovodrun_cmd(script_args=(), controller=("--gloo",), ranks=2):
    """horovodrun as users type it; ``controller=()`` is its default (MPI, Horovod being built with it)."""
    return [HOROVODRUN, "-np", str(ranks), *controller, sys.executable, SCRIPT, *script_args]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_training(torchrun_cmd(), tmp_path_factory)


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    return run_training(mpirun_cmd(), tmp_path_factory)


@pytest.fixture(scope="module")
def horovod_run(tmp_path_factory):
    return run_training(horovodrun_cmd(), tmp_path_factory)


def params_by(records):
    return {(r["compressor"], r["rank"]): r["params"] for r in records if r["kind"] == "train"}


def check_run(run, engine, reference_run, compressors=COMPRESSORS):
    records, text = run
    checks = [r for r in records if r["kind"] == "collectives"]
    assert sorted((r["rank"], r["local_rank"], r["engine"], r["size"]) for r in checks) == \
        [(0, 0, engine, 2), (1, 1, engine, 2)], text[-3000:]
    for r in checks:
        assert r["failures"] == [], f"{engine} rank {r['rank']}: {r['failures']}"
    got, want = params_by(records), params_by(reference_run[0])
    assert sorted(got) == sorted((c, r) for c in compressors for r in (0, 1))
    for name in compressors:
        assert got[(name, 0)] == got[(name, 1)], f"{engine}/{name}: the ranks' parameters differ"
        diff = max(abs(a - b) for a, b in zip(got[(name, 0)], want[(name, 0)]))
        assert diff <= 1e-6, f"{engine}/{name}: parameters differ from the torch engine's by {diff}"
    diloco = {r["rank"]: r["params"] for r in records if r["kind"] == "diloco"}
    assert sorted(diloco) == [0, 1] and diloco[0] == diloco[1], f"{engine}/DiLoCo: the ranks' parameters differ"
    want = next(r["params"] for r in reference_run[0] if r["kind"] == "diloco")
    diff = max(abs(a - b) for a, b in zip(diloco[0], want))
    assert diff <= 1e-6, f"{engine}/DiLoCo: parameters differ from the torch engine's by {diff}"


def check_timeout(run):
    """Rank 0's wait expired naming the operation and the rank, and the same handle completed
    later."""
    records, text = run
    reports = [r for r in records if r["kind"] == "timeout"]
    assert len(reports) == 1, text[-3000:]
    error = reports[0]["error"]
    assert error is not None and "CommunicationError" in error, error
    assert "the lonely allreduce" in error and "1.5s" in error, error
    assert "rank 0 of 2" in error, error
    assert reports[0]["recovered"], "waiting again on the timed-out handle did not complete it"


# -- the reference -----------------------------------------------------------------------------
def test_torch_engine_under_torchrun(reference):
    check_run(reference, "torch", reference)


def test_torch_wait_times_out_naming_the_operation(reference):
    check_timeout(reference)


# -- MPI ---------------------------------------------------------------------------------------
@needs_mpi
def test_mpi_engine_under_mpirun_matches_torch(mpi_run, reference):
    check_run(mpi_run, "mpi", reference)


@needs_mpi
def test_mpi_wait_times_out_naming_the_operation(mpi_run):
    check_timeout(mpi_run)


@needs_mpirun
def test_torch_engine_forced_under_mpirun_is_a_clear_error():
    rc, records, text = launch(mpirun_cmd(["--mode", "init", "--engine", "torch"]), timeout=60)
    assert rc != 0
    errors = [r["error"] for r in records if r["kind"] == "error"]
    assert errors, text[-3000:]
    assert all("engine 'torch' cannot join the processes that mpirun started" in e and "engine='auto'" in e
               for e in errors), errors


# -- Horovod -----------------------------------------------------------------------------------
@needs_horovod
def test_horovod_engine_under_horovodrun_gloo_matches_torch(horovod_run, reference):
    check_run(horovod_run, "horovod", reference)


@needs_horovod
def test_horovod_wait_times_out_naming_the_operation(horovod_run):
    check_timeout(horovod_run)


@needs_horovod
def test_horovodrun_mpi_controller_as_typed_matches_torch(reference, tmp_path_factory):
    """Plain ``horovodrun -np 2``, as users type it: its MPI controller (Horovod being built with
    MPI; ``--mpi`` picks the same one), so the mpirun found first on PATH must be the MPI Horovod
    was built against (one MPI installed), and the engine is detected from the process tree (no
    ``_`` naming horovodrun here)."""
    run = run_training(horovodrun_cmd(controller=()), tmp_path_factory, ["none"])
    check_run(run, "horovod", reference, ["none"])


# -- three ranks: the collectives self-check alone (all-to-all blocks to two peers) ---------------
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun --gloo"])  # the MPI controller: its 2-rank run checks all-to-all
def test_collectives_on_three_ranks_under_every_launcher(launcher):
    _skip_without(launcher)
    args = ["--mode", "collectives"]
    cmd = mpirun_cmd(args, ranks=3) if launcher == "mpirun" else \
        horovodrun_cmd(args, controller=(launcher.split()[1],), ranks=3)
    rc, records, text = launch(cmd)
    assert rc == 0, text[-4000:]
    checks = [r for r in records if r["kind"] == "collectives"]
    assert sorted((r["rank"], r["size"]) for r in checks) == [(0, 3), (1, 3), (2, 3)], text[-3000:]
    for r in checks:
        assert r["failures"] == [], f"{launcher} rank {r['rank']}: {r['failures']}"


# -- Horovod on two hosts of two: the hierarchical exchange on process sets -----------------------
@needs_horovod
def test_horovod_hierarchical_scheme_on_two_hosts_of_two(tmp_path):
    """horovodrun with two "hosts" (localhost and 127.0.0.1, 2 slots each; no ssh) and dynamic
    process sets: ``split_hosts()`` gives 2 x 2, and the hierarchical scheme trains with identical
    parameters on every rank (top-k), the exact codec to the plain average (another summation order)."""
    cmd = [HOROVODRUN, "-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", sys.executable, SCRIPT,
           "--compressors", "none,topk", "--schemes", "default,hierarchical", "--steps", "3",
           "--out", str(tmp_path)]
    rc, _, text = launch(cmd, env=_env(HOROVOD_DYNAMIC_PROCESS_SETS="1"))
    assert rc == 0, text[-4000:]
    records = [json.loads(line) for f in sorted(tmp_path.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    checks = [r for r in records if r["kind"] == "collectives"]
    assert sorted((r["rank"], r["local_rank"]) for r in checks) == [(0, 0), (1, 1), (2, 0), (3, 1)], text[-3000:]
    assert all(r["failures"] == [] for r in checks), [r["failures"] for r in checks]
    params = {(r["compressor"], r["scheme"], r["rank"]): r["params"] for r in records if r["kind"] == "train"}
    for name in ("none", "topk"):
        for scheme in ("default", "hierarchical"):
            assert all(params[(name, scheme, r)] == params[(name, scheme, 0)] for r in range(4)), (name, scheme)
    exact = zip(params[("none", "hierarchical", 0)], params[("none", "default", 0)])
    assert max(abs(a - b) for a, b in exact) <= 1e-6


# -- engine selection --------------------------------------------------------------------------
@pytest.mark.parametrize("env,engine", [
    ({}, "local"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"}, "torch"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}, "torch"),
    ({"WORLD_SIZE": "2"}, "torch"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0"}, "horovod"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "mpi"),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "_": "/usr/local/bin/horovodrun"}, "horovod"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "MERGECOMP_ENGINE": "torch"}, "torch"),
    ({"MERGECOMP_ENGINE": "auto", "PMI_SIZE": "2"}, "mpi"),
])
def test_detect_engine(env, engine):
    assert detect_engine(env, horovodrun_parent=False)[0] == engine


def test_detect_engine_horovodrun_parent_with_mpi_controller():
    assert detect_engine({"OMPI_COMM_WORLD_SIZE": "2"}, horovodrun_parent=True)[0] == "horovod"


def test_detect_engine_errors():
    with pytest.raises(RuntimeError, match="cannot tell which engine"):
        detect_engine({"SLURM_NTASKS": "4"}, horovodrun_parent=False)
    with pytest.raises(RuntimeError, match="MERGECOMP_ENGINE='nccl' is not one of"):
        detect_engine({"MERGECOMP_ENGINE": "nccl"})


@pytest.mark.parametrize("engine,env,launcher", [
    ("torch", {"OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
    ("torch", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovodrun"),
    ("mpi", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "torchrun"),
    ("mpi", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovodrun"),
    ("horovod", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "torchrun"),
])
def test_launcher_mismatch_is_named(engine, env, launcher):
    """MPI/Horovod would silently run one process per rank; torch would wait for a rendezvous."""
    problem = launcher_mismatch(engine, env)
    assert problem and f"engine {engine!r} cannot join the processes that {launcher} started" in problem


@pytest.mark.parametrize("engine,env", [
    ("torch", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}), ("torch", {}),
    ("torch", {"OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"}),
    ("mpi", {"PMI_SIZE": "2"}), ("mpi", {}), ("horovod", {"OMPI_COMM_WORLD_SIZE": "2"}),
    ("horovod", {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}), ("local", {"WORLD_SIZE": "2"}),
])
def test_launcher_match(engine, env):
    assert launcher_mismatch(engine, env) is None


@pytest.mark.parametrize("engine,module,hint", [
    ("horovod", "horovod", "bash scripts/install_horovod.sh"),
    ("mpi", "mpi4py", 'pip install "mergecomp[mpi]"'),
])
def test_missing_engine_library_says_how_to_install(monkeypatch, engine, module, hint):
    assert not mc.is_initialized()
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module...` raise ImportError
    with pytest.raises(RuntimeError, match="cannot be imported") as err:
        mc.init(engine=engine)
    assert hint in str(err.value) and f"engine {engine!r}" in str(err.value)
    assert not mc.is_initialized()


def test_unknown_engine():
    with pytest.raises(ValueError, match="engine must be one of"):
        mc.init(engine="nccl")


# -- a worker killed under each launcher ---------------------------------------------------------
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "horovodrun"])
def test_killed_worker_ends_the_job_nonzero_under_every_launcher(launcher, tmp_path):
    from test_reliability_dist import KILLED_WORKER

    _skip_without(launcher)
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WORKER.format(tests=HERE))
    cmd = {"torchrun": torchrun_cmd()[:-1], "mpirun": _mpirun_args(),
           "horovodrun": [HOROVODRUN, "-np", "2", "--gloo"]}[launcher]
    if launcher != "torchrun":
        cmd = cmd + [sys.executable]
    began = time.monotonic()
    rc, _, text = launch(cmd + [str(script)], timeout=90)
    assert rc != 0, text[-3000:]
    assert time.monotonic() - began < 60
    assert "finished without noticing" not in text
