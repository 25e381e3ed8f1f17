"""Signum: sign of the momentum, with majority vote (Bernstein et al., 2018).

Each rank keeps a momentum per group, ``m = beta * m + (1 - beta) * x`` (flat, the group's
numel, in ``state[name]["momentum"]``), and sends ``sign(m)``: 1 bit per element packed in uint8,
zeros sent as ``+``.  Aggregation is the majority vote of :mod:`signsgd` (0 on a tie).
Two-phase: each shard's bits come from its slice of the group's momentum.
Defaults: ``beta=0.9``; no error-feedback memory.
"""
import torch

from mergecomp.codecs import momentum_signs
from mergecomp.memory import Memory
from mergecomp.registry import register_compressor

from .signsgd import SignSGDCompressor


@register_compressor("signum")
class SignumCompressor(SignSGDCompressor):
    def __init__(self, beta: float = 0.9) -> None:
        super().__init__()
        beta = float(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"signum beta must be in [0, 1), got {beta}")
        self.beta = beta

    def sign_bits(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return momentum_signs(tensor, self._momentum(name, tensor.numel(), tensor), self.beta, empty=self.scratch)

    def compress_fused_parts(self, like: torch.Tensor, name: str, parts: int, memory: Memory) -> None:
        return None  # the bits are the momentum's: the group's gradients are gathered first

    def compress_shard(self, tensor: torch.Tensor, name: str, start: int, total: int):
        momentum = self._momentum(name, total, tensor)[start:start + tensor.numel()]
        return (momentum_signs(tensor, momentum, self.beta, empty=self.scratch),), (tensor.numel(), tensor.dtype)

    def _momentum(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Group ``name``'s momentum (``numel`` elements in ``like``'s dtype and device; zeros
        when there is none of that size)."""
        state = self.group_state(name)
        momentum = state.get("momentum")
        if momentum is None or momentum.numel() != numel:
            momentum = like.new_zeros(numel)
        elif momentum.dtype != like.dtype or momentum.device != like.device:
            momentum = momentum.to(dtype=like.dtype, device=like.device)
        state["momentum"] = momentum
        return momentum
