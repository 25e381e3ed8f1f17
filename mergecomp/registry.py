"""Name -> class registries for compressors and error-feedback memories.

Built-in compressors register with ``@register_compressor("name")`` in their module under
``mergecomp.compressors``.  Third-party packages either use the same decorator or declare an
entry point in the group ``mergecomp.compressors`` (``name = package.module:Class``); entry points
are loaded lazily the first time a name is not found.

``Compression`` (Horovod's name for the choice of compressor) lives here so that both front
ends export the same class.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Callable, Dict, List, Type, TypeVar

import torch

ENTRY_POINT_GROUP = "mergecomp.compressors"

T = TypeVar("T", bound=type)

_COMPRESSORS: Dict[str, type] = {}
_MEMORIES: Dict[str, type] = {}
_builtins_loaded = False
_entry_points_loaded = False


def _register(table: Dict[str, type], kind: str, name: str) -> Callable[[T], T]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(cls: T) -> T:
        known = table.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"{kind} {name!r} is already registered by {known.__module__}.{known.__qualname__}")
        cls.name = name
        table[name] = cls
        return cls

    return decorator


def register_compressor(name: str) -> Callable[[T], T]:
    """Class decorator: make a :class:`~mergecomp.Compressor` available as ``name``."""
    return _register(_COMPRESSORS, "compressor", name)


def register_memory(name: str) -> Callable[[T], T]:
    """Class decorator: make a :class:`~mergecomp.Memory` available as ``name``."""
    return _register(_MEMORIES, "memory", name)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module("mergecomp.compressors")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = entry.load()
        if entry.name not in _COMPRESSORS:
            register_compressor(entry.name)(cls)


def compressor_names() -> list:
    """Sorted names of all known compressors (built-in, decorated and entry points)."""
    _load_builtins()
    _load_entry_points()
    return sorted(_COMPRESSORS)


def memory_names() -> list:
    _load_builtins()
    return sorted(_MEMORIES)


def compressor_class(name: str) -> Type:
    """The class registered as ``name``; ValueError listing the known names otherwise."""
    _load_builtins()
    if name not in _COMPRESSORS:
        _load_entry_points()
    try:
        return _COMPRESSORS[name]
    except KeyError:
        raise ValueError(
            f"unknown compressor {name!r}; known compressors: {', '.join(compressor_names())}"
        ) from None


def get_compressor(name: str, **kwargs):
    """Instantiate the compressor registered as ``name`` with ``kwargs``.

    Raises ValueError listing the known names when ``name`` is unknown.
    """
    return compressor_class(name)(**kwargs)


def get_memory(name: str, **kwargs):
    """Instantiate the error-feedback memory registered as ``name``."""
    _load_builtins()
    try:
        cls = _MEMORIES[name]
    except KeyError:
        raise ValueError(f"unknown memory {name!r}; known memories: {', '.join(memory_names())}") from None
    return cls(**kwargs)


class _CompressionNames(type):
    def __getattr__(cls, name: str) -> str:
        if not name.startswith("_") and name in compressor_names():
            return name
        raise AttributeError(f"Compression has no {name!r}; compressors: {compressor_names()}")

    def __dir__(cls) -> List[str]:
        return sorted(set(super().__dir__()) | set(compressor_names()))


class _HorovodCodec(str):
    """A compressor's name that also keeps Horovod's compressor contract for the tensor
    collectives: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    def compress(self, tensor):
        if self == "fp16" and tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression(metaclass=_CompressionNames):
    """Horovod's ``Compression``: ``Compression.none`` (lossless, the default),
    ``Compression.fp16``, and every registered compressor by name (``Compression.topk``,
    ``Compression.powersgd``...).  Each attribute is the compressor's name, which
    ``compression=`` accepts like the name itself; ``none`` and ``fp16`` also have Horovod's
    ``compress``/``decompress`` (float tensors as float16, others unchanged)."""

    none = _HorovodCodec("none")
    fp16 = _HorovodCodec("fp16")
