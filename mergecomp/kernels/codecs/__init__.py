"""One path per codec operation: each function runs its fused kernel from :mod:`mergecomp.kernels.native`
where the kernel serves the tensors (contiguous fp32 CPU, :func:`mergecomp.kernels.native.usable`) and
its plain-torch version otherwise, so the compressors call one function and never branch on the
kernels themselves.  Both paths write the same layouts; :func:`mergecomp.kernels.native.disabled` forces
the torch path.

* :mod:`.signs`: sign bits (packing with their sums, also of a gradient plus its residual without
  writing that sum, and the residual left once it is sent; Signum's momentum step; decoding; the
  majority vote; the sum of the ranks' two-valued decodes);
* :mod:`.levels`: quantization codes (stochastic rounding, QSGD's encode and decode, decoding
  packed codes through a table);
* :mod:`.sums`: the reductions a kernel computes in its pass (the sums of each sign, min, max,
  squared deviations from the mean), each reduced only when read on the torch path;
* :mod:`.scans`: the finite check, the gradient copy with its prescale and finite check, the
  cast to fp16 with its finite check, and the indices above a threshold;
* :mod:`.products`: a low-rank product written once, alone or subtracted from a matrix
  (PowerSGD's decode and its residual);
* :mod:`.selection`: the k largest of a set of candidates, top-k's sampled threshold and its fused
  scan.

Some encodes exist only as kernels (a sign code part by part, top-k's fused scan): the
compressor asks :func:`parts_served` or :func:`fused_scan_served` and takes its plain path
where they are not.  Compressors reach the kernels only through this package.
"""
from mergecomp.kernels.codecs.levels import (codes_sum, decode_codes, levels_sum, qsgd_encode, scale_levels,
                                             stochastic_codes, stochastic_trits, trits_sum)
from mergecomp.kernels.codecs.products import low_rank
from mergecomp.kernels.codecs.scans import all_finite, cast_finite, copy_finite, indices_above, zero_
from mergecomp.kernels.codecs.selection import (compensated_above, fused_scan_served, keep_largest, largest,
                                                sampled_threshold, with_first_zeros)
from mergecomp.kernels.codecs.signs import (compensated_sign_parts, compensated_signs, decode_signs, majority_vote,
                                            momentum_sign_parts, momentum_signs, pack_signs, parts_served,
                                            sign_remainder, sign_sum, streamed)
from mergecomp.kernels.codecs.sums import moments

__all__ = ["pack_signs", "compensated_signs", "sign_remainder", "momentum_signs", "decode_signs", "majority_vote",
           "sign_sum", "decode_codes", "codes_sum", "trits_sum", "levels_sum", "stochastic_codes", "stochastic_trits",
           "qsgd_encode", "scale_levels",
           "moments", "all_finite", "cast_finite", "copy_finite", "indices_above", "zero_", "low_rank",
           "compensated_sign_parts", "momentum_sign_parts", "parts_served", "streamed", "largest",
           "compensated_above", "keep_largest", "with_first_zeros", "fused_scan_served", "sampled_threshold"]
