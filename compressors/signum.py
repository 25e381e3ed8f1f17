"""Signum: sign of the momentum, with majority vote (Bernstein et al., 2018).

Each rank keeps a momentum per group, ``m = beta * m + (1 - beta) * x`` (flat, the group's
numel, in ``state[name]["momentum"]``), and sends ``sign(m)``: 1 bit per element packed in uint8,
zeros sent as ``+``.  Aggregation is the majority vote of :mod:`signsgd` (0 on a tie).
Two-phase: each shard's bits come from its slice of the group's momentum.
Defaults: ``beta=0.9``; no error-feedback memory.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

import torch

from mergecomp.compressors.signsgd import PartCode, SignSGDCompressor
from mergecomp.kernels.codecs import momentum_sign_parts, momentum_signs, parts_served
from mergecomp.registry import register_compressor


@register_compressor("signum")
class SignumCompressor(SignSGDCompressor):
    def __init__(self, beta: float = 0.9) -> None:
        super().__init__()
        beta = float(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"signum beta must be in [0, 1), got {beta}")
        self.beta = beta
        self._spares: Dict[str, torch.Tensor] = {}  # per group: the momentum of the step before, reused
        self._kept: Set[str] = set()  # groups whose momentum a step keeps for a rollback

    def sign_bits(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return momentum_signs(tensor, self._writable_momentum(name, tensor.numel(), tensor), self.beta,
                              empty=self.scratch)

    def part_code(self, like: torch.Tensor, name: str) -> Optional[PartCode]:
        """Where a kernel serves the momentum: each gradient's pass steps its slice of the
        momentum as it arrives (:func:`~mergecomp.kernels.codecs.momentum_sign_parts`) into a second
        buffer, which becomes the group's state once every part was found finite (a part with
        NaN/Inf leaves the state for the whole-group route); the buffer it replaces is the next
        step's.  The same bits and momentum as :meth:`compress`."""
        momentum = self._momentum(name, like.numel(), like)
        if not parts_served(momentum):
            return None
        self._spares = {group: spare for group, spare in self._spares.items() if group in self.state}
        spare = self._spares.get(name)
        if spare is None or spare.shape != momentum.shape or spare.dtype != momentum.dtype:
            spare = torch.empty_like(momentum)

        def kernel(bits: torch.Tensor, sums: torch.Tensor) -> Tuple[Any, None]:
            return momentum_sign_parts(like.numel(), momentum, 1.0 - self.beta, spare, bits, sums), None

        def done() -> None:
            self.group_state(name)["momentum"] = spare
            self._spares[name] = momentum

        return kernel, done

    def compress_shard(self, tensor: torch.Tensor, name: str, start: int, total: int):
        momentum = self._writable_momentum(name, total, tensor)[start:start + tensor.numel()]
        return (momentum_signs(tensor, momentum, self.beta, empty=self.scratch),), (tensor.numel(), tensor.dtype)

    def keep(self, name: str) -> Dict[str, torch.Tensor]:
        """The group's momentum itself, not a copy: while kept it is not written in place (the
        parts write a second buffer; the whole-group and shard routes copy it first)."""
        self._kept.add(name)
        return dict(self.state.get(name, {}))

    def restore(self, name: str, kept: Dict[str, torch.Tensor]) -> None:
        self._kept.discard(name)
        super().restore(name, kept)
        if kept and self._spares.get(name) is kept.get("momentum"):
            del self._spares[name]  # live again: not the next step's second buffer

    def _writable_momentum(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """:meth:`_momentum`, copied first where a step keeps it (:meth:`keep`)."""
        momentum = self._momentum(name, numel, like)
        if name in self._kept:
            self._kept.discard(name)
            momentum = self.group_state(name)["momentum"] = momentum.clone()
        return momentum

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
