"""Top-k sparsification: send the k = ratio * n largest-magnitude elements (values + int32 indices).

The values go in the gradient's dtype, or with ``value_dtype="fp16"`` / ``"bf16"`` cast to it
(48 bits per kept element instead of 64 for fp32 gradients; the rounding stays in the error-feedback
memory, and an fp16 value beyond its range is an overflow as for the fp16 cast).  The indices go
as int32 or, where that is smaller (a ratio above 1/32, as DiLoCo's pseudo-gradients at 10 %), as
a bitmap of one bit per element (``index_format="auto"``, the default; ``"int32"``, ``"bitmap"``:
always that one); either decodes to the same tensor.

``selection="exact"`` uses ``torch.topk``; ``"threshold"`` (default) estimates the k-th largest
magnitude from a sample and runs the exact top-k only among the candidates above it, which keeps
a merged 25 M-element buffer fast (see :func:`mergecomp.compressors.base.sparse.topk_indices`).  Error feedback:
residual memory by default, so what is not sent now is sent later.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from mergecomp.compressors.base.capabilities import NOT_FINITE, Fused, FusedEncode, NotFinite
from mergecomp.compressors.base.compressor import Payload
from mergecomp.compressors.base.memory import Residual
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.sparse import (SparseCompressor, candidate_capacity, num_selected, sample_rank,
                                               sample_stride, sample_threshold, topk_abs_indices)
from mergecomp.kernels.codecs import (compensated_above, fused_scan_served, keep_largest, sampled_threshold,
                                      with_first_zeros)
from mergecomp.registry import register_compressor

_SELECTIONS = ("exact", "threshold")
#: ``value_dtype`` names and the dtypes they send
_VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


#: the smallest positive fp32 (a subnormal): ``|x| >= _SMALLEST`` holds for every nonzero ``x``
_SMALLEST = float(torch.finfo(torch.float32).smallest_normal) * 2.0 ** -23


@register_compressor("topk")
class TopKCompressor(SparseCompressor, FusedEncode):
    checks_finite = True
    clears = True

    def __init__(self, ratio: float = 0.01, selection: str = "threshold", value_dtype: Optional[str] = None,
                 index_format: str = "auto") -> None:
        super().__init__(ratio, index_format)
        if selection not in _SELECTIONS:
            raise ValueError(f"topk selection must be one of {_SELECTIONS}, got {selection!r}")
        if value_dtype is not None and value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"topk value_dtype must be None or one of {tuple(_VALUE_DTYPES)}, got {value_dtype!r}")
        self.selection = selection
        self.value_dtype = value_dtype
        #: the dtype the values are cast to on the wire (None: sent as they are)
        self._wire_dtype = None if value_dtype is None else _VALUE_DTYPES[value_dtype]
        # compress: the threshold scan (the sample and the k values are small); exact: ``abs``
        # and ``topk``.  The fused encode: one pass, which writes the residual too.
        self._passes = CodecPasses(compress=1 if selection == "threshold" else 2, aggregate=1, fused_update=0)

    @property
    def passes(self) -> CodecPasses:
        return self._passes

    @property
    def may_overflow(self) -> bool:
        """Values cast to fp16 or bf16, whose largest values are below fp32's."""
        return self._wire_dtype is not None

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, Tuple[int, torch.dtype]]:
        (values, indices), ctx = super().compress(tensor, name, shapes)
        return (self._on_wire(values), indices), ctx

    def _on_wire(self, values: torch.Tensor) -> torch.Tensor:
        """The values as sent: cast to ``value_dtype`` (when it is set and not theirs)."""
        wire = self._wire_dtype
        return values if wire is None or values.dtype == wire else values.to(wire)

    def select(self, tensor: torch.Tensor, k: int, name: str) -> torch.Tensor:
        return topk_abs_indices(tensor, k, self.selection)

    def compress_fused(self, tensor: torch.Tensor, name: str, shapes: Optional[Sequence[torch.Size]],
                       residual: Residual, check: bool = False, clear: bool = False) -> Union[None, Fused, NotFinite]:
        """With the ``residual`` of the residual memory or DGC's and the threshold selection,
        where the kernel serves the tensors (:func:`mergecomp.kernels.codecs.compensated_above`):
        one pass reads the gradient and the memory and writes the memory's new state, setting the
        candidates above the sampled threshold aside (and masking their momentum, with DGC's);
        :func:`mergecomp.kernels.codecs.keep_largest` keeps the k largest and puts the others back.
        Compensate, compress and feed make three passes with the residual (the add, the
        threshold scan, the residual's copy), six with DGC's memory (momentum, velocity, the
        copy out, the scan, the velocity's copy, the masking).  The same payload and state, bit
        for bit.  With ``check`` the scan is also the gradient's NaN/Inf check; with ``clear``
        it zeroes the gradient as it reads it (the zeros a decode into it scatters into)."""
        n = tensor.numel()
        k = num_selected(n, self.ratio)
        if self.selection != "threshold" or k >= n:
            return None
        old, momentum = residual.old, residual.momentum
        operands = [t for t in (tensor, old, None if momentum is None else momentum.old) if t is not None]
        if type(self).select is not TopKCompressor.select or not fused_scan_served(*operands):
            return None  # a subclass's own selection, or no kernel
        stride = sample_stride(n, k)
        if momentum is None:
            threshold = sampled_threshold(tensor, old, stride, sample_rank(-(-n // stride), k, n))
        else:
            sample = momentum.old[::stride].mul(momentum.factor).add_(tensor[::stride])
            if old is not None:
                sample = old[::stride] + sample
            threshold = float(sample_threshold(sample.abs(), k, n))
        # a sample of zeros only: the nonzero elements are the candidates, and the rest are zeros
        threshold = threshold or _SMALLEST
        corrected = None if momentum is None else momentum.target()
        out = residual.target()  # every element written below
        indices, values, count, momenta, finite = compensated_above(
            tensor, old, threshold, out, candidate_capacity(k),
            None if momentum is None else (momentum.factor, momentum.old, corrected), clear)
        if check and not finite:
            return NOT_FINITE
        if k <= count <= indices.numel():  # the k largest among the candidates; the others go back
            indices, values = keep_largest(indices, values, k, out,
                                                  None if momenta is None else (momenta, corrected))
        elif count < k and threshold == _SMALLEST:  # every nonzero, and the first zeros after them
            indices, values = with_first_zeros(indices, values, k, out)
        else:  # too few or too many candidates: ``out`` (and the momentum) as before the scan took them
            out[indices] = values
            if corrected is not None:
                corrected[indices] = momenta
            indices = self.select(out, k, name)
            values = out.index_select(0, indices)
            out[indices] = 0
            if corrected is not None:  # momentum factor masking where a value went out
                corrected.index_fill_(0, indices[values != 0], 0)
        sent = self._on_wire(values)
        if sent is not values:  # the cast's rounding stays in the residual (k entries)
            out.index_put_((indices.long(),), values - sent.to(values.dtype))
        return self._payload(sent, indices, n), (n, tensor.dtype), lambda: None
