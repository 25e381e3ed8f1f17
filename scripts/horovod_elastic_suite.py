"""Run Horovod's own elastic torch tests against mergecomp.torch, with only the import changed.

Takes a Horovod checkout (``git clone https://github.com/horovod/horovod``); nothing of it is
kept here.  Its ``test/integration/test_elastic_torch.py`` and ``elastic_common.py`` are copied
into a temporary folder unchanged, and the training script they launch,
``data/elastic_torch_main.py``, with ``import horovod.torch as hvd`` replaced by
``import mergecomp.torch as hvd``.  The tests start real ``horovodrun`` elastic jobs (gloo, CPU,
the hosts ``localhost`` and ``127.0.0.1``), add and remove hosts and make workers fail.  Needs
pytest, ``mock`` and ``psutil``.

    python scripts/horovod_elastic_suite.py ~/horovod
    python scripts/horovod_elastic_suite.py ~/horovod --original   # the same tests on Horovod itself

Prints each test's result and pytest's summary line (Horovod skips four of its eight tests itself,
naming its issues).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("horovod", help="a Horovod checkout")
parser.add_argument("--original", action="store_true", help="keep horovod.torch (Horovod's own result)")
parser.add_argument("-k", default=None, help="pytest's -k expression")
parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole suite")


def prepare(horovod: str, folder: str, original: bool) -> str:
    """The suite in ``folder``, its training script's import changed unless ``original``;
    returns the folder of the tests."""
    integration = os.path.join(folder, "integration")
    os.makedirs(os.path.join(integration, "data"))
    for name in ("elastic_common.py", "test_elastic_torch.py"):
        shutil.copy(os.path.join(horovod, "test", "integration", name), integration)
    shutil.copytree(os.path.join(horovod, "test", "utils"), os.path.join(folder, "utils"))
    source = open(os.path.join(horovod, "test", "integration", "data", "elastic_torch_main.py")).read()
    changed = source if original else source.replace("import horovod.torch as hvd", "import mergecomp.torch as hvd")
    if changed == source and not original:
        raise SystemExit("elastic_torch_main.py does not `import horovod.torch as hvd`: not the expected file")
    with open(os.path.join(integration, "data", "elastic_torch_main.py"), "w") as f:
        f.write(changed)
    return integration


def main() -> None:
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="horovod_elastic_")
    integration = prepare(args.horovod, folder, args.original)
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_elastic_torch.py"]
    if args.k:
        command += ["-k", args.k]
    env = {**os.environ, "PYTHONPATH": os.path.join(folder, "utils"), "MERGECOMP_TIMEOUT": "60"}
    done = subprocess.run(command, cwd=integration, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = os.path.join(folder, "output.log")
    with open(log, "w") as f:
        f.write(done.stdout + done.stderr)
    summary = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "SKIPPED", "PASSED"))]
    print("\n".join(summary + done.stdout.strip().splitlines()[-1:]), f"\noutput: {log}")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
