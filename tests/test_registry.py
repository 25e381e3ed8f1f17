"""Compressor and memory registries: decorator registration, lookup errors, entry-point plugins."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mergecomp
from mergecomp import registry

PLUGIN_SRC = Path(__file__).parent / "plugin_pkg"


@pytest.fixture
def scratch_name():
    """A compressor name registered only for the duration of one test."""
    name = "test_registry_scaled"
    yield name
    registry._COMPRESSORS.pop(name, None)


def test_builtin_names():
    names = mergecomp.compressor_names()
    assert names == sorted(names)
    for name in ("none", "fp16", "topk", "dgc"):
        assert name in names
    for name in ("none", "residual", "dgc"):
        assert name in mergecomp.memory_names()


def test_decorator_registers_and_get_compressor_passes_kwargs(scratch_name):
    @mergecomp.register_compressor(scratch_name)
    class Scaled(mergecomp.Compressor):
        def __init__(self, factor=1.0):
            super().__init__()
            self.factor = factor

        def compress(self, tensor, name, shapes=None):
            return (tensor * self.factor,), self.factor

        def decompress(self, payload, ctx):
            return payload[0] / ctx

    assert Scaled.name == scratch_name
    assert scratch_name in mergecomp.compressor_names()
    assert mergecomp.compressor_class(scratch_name) is Scaled

    comp = mergecomp.get_compressor(scratch_name, factor=4.0)
    assert isinstance(comp, Scaled) and comp.factor == 4.0
    x = torch.arange(6, dtype=torch.float32)
    payload, ctx = comp.compress(x, "g")
    torch.testing.assert_close(comp.decompress(payload, ctx), x)

    # Registering the same class again is harmless; another class under the name is refused.
    mergecomp.register_compressor(scratch_name)(Scaled)

    class Other(Scaled):
        pass

    with pytest.raises(ValueError, match="already registered"):
        mergecomp.register_compressor(scratch_name)(Other)


def test_get_compressor_kwargs_builtin():
    comp = mergecomp.get_compressor("topk", ratio=0.25)
    assert comp.ratio == 0.25
    assert mergecomp.get_memory("residual", beta=0.5).beta == 0.5


def test_unknown_compressor_lists_known_names():
    with pytest.raises(ValueError) as info:
        mergecomp.get_compressor("no-such-compressor")
    message = str(info.value)
    assert "no-such-compressor" in message
    assert "topk" in message and "fp16" in message


def test_unknown_memory_lists_known_names():
    with pytest.raises(ValueError) as info:
        mergecomp.get_memory("no-such-memory")
    message = str(info.value)
    assert "no-such-memory" in message
    assert "residual" in message and "dgc" in message


def test_register_rejects_empty_name():
    with pytest.raises(ValueError):
        mergecomp.register_compressor("")


PLUGIN_CHECK = """
import torch
import mergecomp
assert "demo_plugin" in mergecomp.compressor_names(), mergecomp.compressor_names()
comp = mergecomp.get_compressor("demo_plugin")
assert type(comp).__name__ == "ScaledSign" and comp.name == "demo_plugin", comp
x = torch.tensor([1.0, -2.0, 3.0, -6.0])
payload, ctx = comp.compress(x, "g")
out = comp.decompress(payload, ctx)
assert torch.equal(out, torch.tensor([3.0, -3.0, 3.0, -3.0])), out
print("OK", type(comp).__module__, comp.default_memory)
"""


def test_entry_point_plugin(tmp_path):
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the repository.
    src = tmp_path / "src"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-deps", "--no-index", "--target", str(target), str(src)]
    try:
        import setuptools  # noqa: F401  (build offline with the installed setuptools)

        cmd.insert(cmd.index("--no-index"), "--no-build-isolation")
    except ImportError:  # no setuptools here: let pip fetch it into an isolated build env
        cmd.remove("--no-index")
    install = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout + install.stderr
    assert (target / "mergecomp_demo_plugin.py").exists()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "OK mergecomp_demo_plugin residual"


def test_plugin_not_visible_without_install():
    # The fixture package is only on the path in the subprocess above.
    assert "demo_plugin" not in mergecomp.compressor_names()
