import os
import sys

# Spawned worker processes import the test modules by name: make this folder importable.
sys.path.insert(0, os.path.dirname(__file__))

# Build the native codec kernels once, before any multi-process test: ranks that first meet
# them inside a collective would otherwise spend the compile time (seconds) there.
import torch  # noqa: E402

from mergecomp.kernels import native

native.usable(torch.zeros(1))
