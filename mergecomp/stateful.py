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
        self.state = {name: {k: v.clone() for k, v in fields.items()} for name, fields in state.items()}

    def settings(self) -> Dict[str, Any]:
        """The hyperparameters (every public attribute but ``state`` and ``workspace``): all
        ranks must agree."""
        return {k: v for k, v in vars(self).items()
                if k not in ("state", "workspace") and not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"
