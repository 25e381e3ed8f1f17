"""No compression: the gradient in its own dtype, summed by one fused allreduce (Horovod/DDP style)."""
from mergecomp.compressors.base.cast import CastCompressor
from mergecomp.registry import register_compressor


@register_compressor("none")
class NoneCompressor(CastCompressor):
    wire_dtype = None
