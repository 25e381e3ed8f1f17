"""bf16: cast to bfloat16 (fp32's range, 8-bit mantissa), 16 bits per element, summed by allreduce."""
import torch

from mergecomp.compressors.base.cast import CastCompressor
from mergecomp.registry import register_compressor


@register_compressor("bf16")
class BF16Compressor(CastCompressor):
    wire_dtype = torch.bfloat16
