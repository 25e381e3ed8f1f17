import os
import sys

# Spawned worker processes import the test modules by name: make this folder importable.
sys.path.insert(0, os.path.dirname(__file__))
# The suite's processes exchange CPU tensors, several ranks per host: gloo, also where CUDA is
# available (init would pick NCCL). Tests of NCCL ask for it (tests/cuda).
os.environ.setdefault("MERGECOMP_TORCH_BACKEND", "gloo")

# Build the native codec kernels once, before any multi-process test: ranks that first meet
# them inside a collective would otherwise spend the compile time (seconds) there.
import pytest  # noqa: E402
import torch  # noqa: E402

from mergecomp.kernels import native

native.usable(torch.zeros(1))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (tests/cuda); skipped without one")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, with the reason, where no CUDA device is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
