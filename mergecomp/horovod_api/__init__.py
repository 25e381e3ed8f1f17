"""Horovod's API, shared by both front ends: process set-up (``init``, ``rank``, ...), tensor
collectives, and the arguments Horovod's functions take."""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["elastic_on_first_use"]


def elastic_on_first_use(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for front end ``package`` (``mergecomp.torch``,
    ``mergecomp.tensorflow``, ...) that imports ``<package>.elastic`` (Horovod's elastic API) the
    first time ``package.elastic`` is read: it needs Horovod, which the rest does not."""
    def __getattr__(name: str) -> Any:
        if name == "elastic":
            import importlib

            return importlib.import_module(f"{package}.elastic")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
