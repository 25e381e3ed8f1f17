"""fp16: cast to IEEE half precision, 16 bits per element, summed by allreduce."""
import torch

from mergecomp.compressors.base.cast import CastCompressor
from mergecomp.registry import register_compressor


@register_compressor("fp16")
class FP16Compressor(CastCompressor):
    wire_dtype = torch.float16
