"""mergecomp: merged gradient compression for communication-efficient data-parallel training.

Core (framework-agnostic, torch tensors): the :class:`Compressor` and :class:`Memory`
interfaces and their registries, merge plans, communicators and the per-group exchange.
Front ends: ``mergecomp.torch`` (Horovod-shaped API).
"""
from mergecomp.compressors.base.compressor import Compressor, Payload, bits_per_element
from mergecomp.compressors.base.memory import Memory
from mergecomp.registry import (compressor_class, compressor_names, get_compressor, get_memory, memory_names,
                                register_compressor, register_memory)

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "bits_per_element",
    "Memory",
    "Payload",
    "compressor_class",
    "compressor_names",
    "get_compressor",
    "get_memory",
    "memory_names",
    "register_compressor",
    "register_memory",
]
