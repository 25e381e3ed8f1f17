"""A compressor written for Horovod, used as a mergecomp compressor (not registered by name:
``DistributedOptimizer(compression=MyCompressor)`` wraps it).

Horovod's contract: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) ->
tensor``, as static methods of a class or methods of an object.  As in Horovod, the compressed
tensor is summed over ranks by allreduce and the sum is decompressed, so it must be one tensor
whose elementwise sum decompresses to the sum of the inputs (a cast, a scaling), of a size that
depends only on the input's, and ``ctx`` must be the same on every rank (a dtype, say).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, Payload

__all__ = ["HorovodCodec", "is_horovod_codec"]


def is_horovod_codec(obj: Any) -> bool:
    """Whether ``obj`` has Horovod's compressor methods (and is not a mergecomp compressor or name)."""
    return not isinstance(obj, (str, Compressor)) and callable(getattr(obj, "compress", None)) \
        and callable(getattr(obj, "decompress", None))


class HorovodCodec(Compressor):
    """``codec``'s ``compress`` on each merged group; its output summed by allreduce."""

    summable = True

    def __init__(self, codec: Any) -> None:
        super().__init__()
        self.codec = codec
        self.name = getattr(codec, "__name__", type(codec).__name__)

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Any]:
        wire, ctx = self.codec.compress(tensor)
        return (wire,), ctx

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return self.codec.decompress(payload[0], ctx)

    def __repr__(self) -> str:
        return f"HorovodCodec({self.name})"
