"""Per-group state shared by compressors and memories: ``self.state[group][field] -> tensor``."""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["GroupStateful"]

GroupState = Dict[str, Dict[str, torch.Tensor]]


class GroupStateful:
    """Holds ``state`` (group name -> field -> tensor) and the hyperparameters in ``vars(self)``.

    ``state_dict()`` returns copies (the live buffers are updated in place every step), so a
    checkpoint taken in memory does not change afterwards.
    """

    def __init__(self) -> None:
        self.state: GroupState = {}

    def group_state(self, name: str) -> Dict[str, torch.Tensor]:
        """The mutable state dict of group ``name`` (created empty on first use)."""
        return self.state.setdefault(name, {})

    def state_dict(self) -> GroupState:
        return {name: {k: v.clone() for k, v in fields.items()} for name, fields in self.state.items()}

    def load_state_dict(self, state: GroupState) -> None:
        """Copies of ``state``'s tensors; an integer scalar (a step counter, read on the host
        every step) on the CPU, wherever the checkpoint was mapped to (on a CUDA device each
        read would wait for it)."""
        self.state = {name: {k: v.to("cpu", copy=True) if v.dim() == 0 and not v.is_floating_point() else v.clone()
                             for k, v in fields.items()} for name, fields in state.items()}

    def keep(self, name: str) -> Any:
        """Called before group ``name``'s state may change this step: what :meth:`restore`
        needs to undo that change (here a copy of the group's tensors; subclasses may keep
        something cheaper)."""
        return {k: v.clone() for k, v in self.state.get(name, {}).items()}

    def restore(self, name: str, kept: Any) -> None:
        """Put group ``name``'s state back as it was when :meth:`keep` returned ``kept``."""
        if kept:
            self.state[name] = kept
        else:
            self.state.pop(name, None)

    def settings(self) -> Dict[str, Any]:
        """The hyperparameters (every public attribute but ``state`` and ``workspace``): all
        ranks must agree."""
        return {k: v for k, v in vars(self).items()
                if k not in ("state", "workspace") and not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"
