"""Random-k sparsification with indices shared by all ranks: only the values travel.

Every rank draws the same ``k = num_selected(n, ratio)`` indices (uniform, with replacement) from
a generator seeded with ``stable_seed(name, step)``, ``step`` a per-group counter kept in
``state[name]["step"]`` (0-d int64, on the CPU) and advanced by each ``compress``.  The indices
ride in ``ctx``; the payload is the ``k`` values in the gradient's dtype (``32 * ratio`` bits per
element for fp32), summable by allreduce.

Decode: with ``unbiased=True`` the values are scatter-added (a repeated index counts each time)
and scaled by ``n / k``, an unbiased estimate of the gradient.  With ``unbiased=False`` (default,
GRACE style, meant for error feedback) the selected elements are kept as they are (a repeated
index is kept once).  Defaults: ``ratio=0.01``, ``unbiased=False``, memory ``residual``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import SparseEntries
from mergecomp.compressors.base.compressor import Compressor, Payload, check_ratio
from mergecomp.compressors.base.passes import CodecPasses
from mergecomp.compressors.base.sparse import num_selected, shared_random_indices, stable_seed
from mergecomp.kernels.codecs import zero_
from mergecomp.registry import register_compressor


class RandKCtx(NamedTuple):
    numel: int
    dtype: torch.dtype
    indices: torch.Tensor  # int64, the same on every rank


@register_compressor("randk")
class RandKCompressor(Compressor, SparseEntries):
    summable = True
    default_memory = "residual"

    def __init__(self, ratio: float = 0.01, unbiased: bool = False) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        if not isinstance(unbiased, bool):
            raise ValueError(f"randk unbiased must be a bool, got {unbiased!r}")
        self.unbiased = unbiased
        # compress: the k values are gathered at shared indices, no full pass; decompress:
        # zeroing the dense output, and unbiased, scaling it
        self._passes = CodecPasses(compress=0, decompress=2 if unbiased else 1)

    def _next_step(self, name: str) -> int:
        state = self.group_state(name)
        step = state.get("step")
        if step is None:
            step = state["step"] = torch.zeros((), dtype=torch.int64)
        current = int(step)  # a CPU scalar: no device synchronization
        step.add_(1)
        return current

    def compress(self, tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> Tuple[Payload, RandKCtx]:
        numel = tensor.numel()
        seed = stable_seed(name, self._next_step(name))
        if numel:
            k = num_selected(numel, self.ratio)
            indices = shared_random_indices(numel, k, seed, tensor.device)
        else:
            indices = torch.zeros(0, dtype=torch.int64, device=tensor.device)
        return (tensor[indices],), RandKCtx(numel, tensor.dtype, indices)

    def sent_entries(self, payload: Payload, ctx: RandKCtx):
        if self.unbiased:  # scaled and summed over repeats: not a plain put
            return None
        return ctx.indices, payload[0].to(ctx.dtype)

    @property
    def passes(self) -> CodecPasses:
        return self._passes

    def decompress(self, payload: Payload, ctx: RandKCtx) -> torch.Tensor:
        values = payload[0].to(ctx.dtype)
        dense = zero_(self.scratch(ctx.numel, ctx.dtype, values.device))
        if not self.unbiased:
            # All ranks share the indices, so a repeated index carries equal (summed) values.
            return dense.index_put_((ctx.indices,), values)
        dense.index_add_(0, ctx.indices, values)
        if ctx.indices.numel():
            dense.mul_(ctx.numel / ctx.indices.numel())
        return dense
