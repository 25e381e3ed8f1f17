"""Run Horovod's own torch test suite against mergecomp.torch, with only the import changed.

Takes a Horovod checkout (``git clone https://github.com/horovod/horovod``); nothing of it is
kept here.  Its ``test/parallel/test_torch.py`` is copied into a temporary folder with
``import horovod.torch as hvd`` replaced by ``import mergecomp.torch as hvd``, and each test runs
on its own in a fresh ``torchrun --nproc_per_node N`` (gloo, CPU) with ``HOROVOD_RANK`` and
``HOROVOD_SIZE`` set as ``horovodrun --gloo`` sets them (so the tests take their gloo branches and
tear down with a barrier and ``shutdown``) and ``MERGECOMP_ENGINE=torch``.  Needs pytest, and
``mock`` and ``cloudpickle`` for the suite's helpers, and Horovod itself importable (the helpers
import ``horovod.runner``).

    python scripts/horovod_test_suite.py ~/horovod --out results.txt
    python scripts/horovod_test_suite.py ~/horovod --tests test_horovod_join_allreduce,test_horovod_reinit

Prints one line per test (``name status seconds``) and the counts; a test's output is kept in
``--logs``.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

RUNNER = '''import os, sys
os.environ["HOROVOD_RANK"] = os.environ["RANK"]
os.environ["HOROVOD_SIZE"] = os.environ["WORLD_SIZE"]
os.environ["MERGECOMP_ENGINE"] = "torch"
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "utils"))
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", os.path.join(here, "test_torch.py") + "::TorchTests::" + sys.argv[1]]))
'''

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("horovod", help="a Horovod checkout")
parser.add_argument("--tests", default=None, help="comma list of test names (default: all)")
parser.add_argument("--ranks", type=int, default=2)
parser.add_argument("--timeout", type=float, default=120, help="seconds per test")
parser.add_argument("--out", default=None, help="also write the per-test lines here")
parser.add_argument("--logs", default=None, help="folder for each test's output (default: a temporary one)")


def prepare(horovod: str, folder: str) -> list:
    """The suite in ``folder`` with the import changed; returns its test names in file order."""
    source = open(os.path.join(horovod, "test", "parallel", "test_torch.py")).read()
    changed = source.replace("import horovod.torch as hvd", "import mergecomp.torch as hvd")
    if changed == source:
        raise SystemExit("test_torch.py does not `import horovod.torch as hvd`: not the expected file")
    with open(os.path.join(folder, "test_torch.py"), "w") as f:
        f.write(changed)
    shutil.copytree(os.path.join(horovod, "test", "utils"), os.path.join(folder, "utils"))
    with open(os.path.join(folder, "run_one.py"), "w") as f:
        f.write(RUNNER)
    return re.findall(r"^    def (test_\w+)\(self", changed, flags=re.M)


def status(returncode: int, output: str) -> str:
    if returncode in (124, -9):
        return "timeout"
    if returncode == 0:
        return "skip" if re.search(r"\b1 skipped\b", output) and " passed" not in output else "pass"
    return "fail"


def main() -> None:
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="horovod_suite_")
    logs = args.logs or os.path.join(folder, "logs")
    os.makedirs(logs, exist_ok=True)
    names = prepare(args.horovod, folder)
    if args.tests:
        names = [n for n in args.tests.split(",") if n]
    lines, counts = [], {}
    for i, name in enumerate(names):
        start = time.monotonic()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                   "--master_port", str(29500 + 7 + i % 400), os.path.join(folder, "run_one.py"), name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "MERGECOMP_TIMEOUT": "30"}, cwd=tempfile.gettempdir())
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code, output = 124, str(err.stdout or "") + str(err.stderr or "")
        with open(os.path.join(logs, f"{name}.log"), "w") as f:
            f.write(output)
        result = status(code, output)
        counts[result] = counts.get(result, 0) + 1
        line = f"{name} {result} {time.monotonic() - start:.1f}"
        lines.append(line)
        print(line, flush=True)
    print(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())), f"of {len(names)}; logs in {logs}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
