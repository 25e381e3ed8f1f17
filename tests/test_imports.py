"""The packages' import structure, read from their source with ``ast`` (nothing is imported):
the core never imports a front end, the library never imports the benchmark tooling, no module
imports itself through others (no cycle), and the core's folders import one way (pipeline,
scheduler, exchange, compressors, kernels and engines).

The modules are whatever setup.py's ``package_dir`` folders hold; the core is every module of
``mergecomp`` outside the front ends (``mergecomp.torch``, ``mergecomp.tensorflow``); the
benchmark tooling (``mergecomp_bench``, a package of its own) may use any of it.
"""
import ast
import graphlib
import os
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = ("mergecomp.torch", "mergecomp.tensorflow")
TOOLING = ("mergecomp_bench",)


def within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def package_dirs() -> Dict[str, str]:
    """setup.py's ``package_dir``: package name -> source folder."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    setup = next(node for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    return ast.literal_eval(next(k.value for k in setup.keywords if k.arg == "package_dir"))


def source_files() -> Dict[str, Path]:
    """Module name -> source file, for every module of the package (symlinks are not followed:
    a checkout may link a mapped folder into another package's folder)."""
    modules = {}
    for package, folder in package_dirs().items():
        base = ROOT / folder
        for directory, _, files in os.walk(base):
            inner = Path(directory).relative_to(base).parts
            for file in files:
                if file.endswith(".py"):
                    parts = inner if file == "__init__.py" else (*inner, file[:-3])
                    modules[".".join((package, *parts))] = Path(directory) / file
    return modules


def imported(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """Names of the package's modules that ``module`` imports, at any depth of its code;
    ``from X import y`` counts as importing ``X.y`` where that is a module, else ``X``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module
            if node.level:  # relative: from the package, or level - 1 packages up
                base = package.rsplit(".", node.level - 1)[0]
                source = f"{base}.{source}" if source else base
            names.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                         for alias in node.names)
    return {name for name in names if within(name, ("mergecomp",) + TOOLING)}


MODULES = source_files()
IMPORTS = {module: imported(module, path, MODULES) for module, path in MODULES.items()}
CORE = sorted(m for m in MODULES if not within(m, FRONT_ENDS + TOOLING))


def test_the_package_is_found_and_imports_only_its_own_modules():
    assert {"mergecomp", "mergecomp.exchange.plan", "mergecomp.torch", "mergecomp.tensorflow",
            "mergecomp_bench.runner"} <= set(MODULES)
    unknown = {(m, name) for m, names in IMPORTS.items() for name in names if name not in MODULES}
    assert not unknown, f"imports of modules that do not exist: {sorted(unknown)}"


def test_the_library_never_imports_the_benchmark_tooling():
    offending = sorted((m, name) for m in MODULES if not within(m, TOOLING) for name in IMPORTS[m]
                       if within(name, TOOLING))
    assert not offending, f"library modules importing the benchmark tooling: {offending}"


def test_the_core_never_imports_a_front_end():
    offending = sorted((m, name) for m in CORE for name in IMPORTS[m] if within(name, FRONT_ENDS))
    assert not offending, f"core modules importing a front end: {offending}"


def test_no_import_cycle():
    """Over the whole package: a cycle through the tooling or a front end counts too."""
    try:
        tuple(graphlib.TopologicalSorter(IMPORTS).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None


def role_of(module: str) -> str:
    """The folder directly under ``mergecomp`` that holds a module (``mergecomp.exchange.schemes.base``:
    ``mergecomp.exchange``), or the module itself for the package's top-level files."""
    return ".".join(module.split(".")[:2])


def test_role_folders_import_one_way():
    """pipeline -> scheduler -> exchange -> compressors -> kernels, never back: a folder whose
    modules import another folder's is never imported by that folder's modules."""
    folders = {}
    for module, names in IMPORTS.items():
        folders.setdefault(role_of(module), set()).update(role_of(n) for n in names if role_of(n) != role_of(module))
    try:
        order = tuple(graphlib.TopologicalSorter(folders).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"folders importing each other: {' -> '.join(err.args[1])}") from None
    position = order.index
    assert position("mergecomp.exchange") < position("mergecomp.scheduler") < position("mergecomp.pipeline")


def test_front_ends_never_import_each_other():
    """TensorFlow users need no PyTorch front end, and the reverse: shared set-up is the core's."""
    torch_side, tf_side = FRONT_ENDS
    offending = sorted((m, name) for m in MODULES for name in IMPORTS[m]
                       if (within(m, (tf_side,)) and within(name, (torch_side,)))
                       or (within(m, (torch_side,)) and within(name, (tf_side,))))
    assert not offending, f"front ends importing each other: {offending}"
