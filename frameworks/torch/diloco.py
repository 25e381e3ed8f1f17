"""DiLoCo: local steps, and every ``sync_every`` of them one compressed exchange of the
parameters' change (Douillard et al., 2023), for links too slow for an exchange per step.

Each rank takes ``sync_every`` (H) steps of its own optimizer (the *inner* one, AdamW in the
papers) with no communication.  Then its pseudo-gradient, the global parameters minus its local
ones, goes through the same merged groups, compressor and error-feedback memory as any
gradient (:class:`~mergecomp.pipeline.planned.PlannedStep`; the memory keeps this rank's
residual of the pseudo-gradient), is averaged over the ranks, and the *outer* optimizer
(Nesterov SGD, lr 0.7, momentum 0.9, as the paper) steps the global parameters with it; every
rank continues from them::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=100, compression="topk")
    for x, y in data:                       # the training loop is unchanged
        loss_fn(model(x), y).backward()
        opt.step()                          # every 100th step also synchronizes (a step hook)
        opt.zero_grad()

Bytes per rank: one pseudo-gradient per ``sync_every`` steps, at the compressor's bits per
element.  Memory per rank: the global parameters and the outer optimizer's state besides the
model's (:meth:`DiLoCo.state_bytes`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.horovod_api.runtime import communicator
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.planned import PlannedStep
from mergecomp.pipeline.step import HoldsMergedStep

from .functions import broadcast_parameters

__all__ = ["DiLoCo", "nesterov"]

Params = Union[Iterable[torch.nn.Parameter], Iterable[Tuple[str, torch.nn.Parameter]]]


def nesterov(params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """The papers' outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _named(params: Params) -> Tuple[List[str], List[torch.nn.Parameter]]:
    items = list(params)
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):
        named = [(name, p) for name, p in items if p.requires_grad]
    elif all(isinstance(item, torch.Tensor) for item in items):
        named = [(f"param.{i}", p) for i, p in enumerate(items) if p.requires_grad]
    else:
        raise TypeError("DiLoCo: params must be parameters or (name, parameter) pairs, e.g. model.named_parameters()")
    if not named:
        raise ValueError("DiLoCo: no parameter requires a gradient")
    return [name for name, _ in named], [p for _, p in named]


class DiLoCo(HoldsMergedStep):
    """Synchronize ``params`` every ``sync_every`` steps of ``inner_optimizer`` (module docstring).

    Args:
        params: the parameters the inner optimizer trains, or ``model.named_parameters()`` (the
            names serve ``groups`` and ``uncompressed`` specs and errors); frozen ones are left
            alone.  Every rank starts from rank 0's values (broadcast here).
        inner_optimizer: the optimizer of the local steps; each of its ``step()`` calls counts
            (a post-step hook), and the ``sync_every``-th synchronizes before it returns.
        sync_every: H, the local steps between synchronizations (an int >= 1, the same on
            every rank).
        compression, memory: what the pseudo-gradients travel with, as for
            :class:`~frameworks.torch.optimizer.DistributedOptimizer` (default ``"none"``: the
            exact average, dense DiLoCo).
        outer_optimizer: a function of the global parameters (a list of tensors) returning the
            outer optimizer; default :func:`nesterov`.
        options: the merged step's (:data:`~mergecomp.pipeline.options.FRONT_ENDS` ``"DiLoCo"``):
            ``groups``, ``nonfinite`` (default ``"skip"``: a NaN/Inf pseudo-gradient on any rank
            skips the outer step on every rank, which all go back to the global parameters;
            counted in ``skipped_steps``; or ``"raise"``), ``scheme``, ``uncompressed``,
            ``min_compress_numel``, ``compression_warmup_steps`` (synchronizations sent exactly
            first), ``compression_warmup_codec``, ``scheduler``.
    """

    def __init__(self, params: Params, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                 outer_optimizer: Optional[Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = None,
                 **options: Any) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        names, self.params = _named(params)
        self.sync_every = sync_every
        step_options = StepOptions.create("DiLoCo", options)
        self.merged = PlannedStep(
            compression, memory, communicator(), names, [p.shape for p in self.params],
            [p.dtype for p in self.params], self.params[0].device, step_options,
            FrontEnd("DiLoCo", "parameters", observe_order=False, timed=False, in_place=True,
                     agree=(("sync_every", sync_every),)))
        broadcast_parameters(list(zip(names, (p.data for p in self.params))), root_rank=0)
        #: the parameters every rank last agreed on, which the outer optimizer steps
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer_optimizer = (outer_optimizer or nesterov)(self.global_params)
        #: the inner steps taken so far (checkpointed)
        self.inner_steps = 0
        self._hook = inner_optimizer.register_step_post_hook(self._counted)

    def _counted(self, *_: Any) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> bool:
        """Average the ranks' pseudo-gradients and step the global parameters with them; every
        rank's parameters become the new global ones.  Returns False where the step was skipped
        (NaN/Inf under ``nonfinite="skip"``: the parameters go back to the old global ones)."""
        for i, (g, p) in enumerate(zip(self.global_params, self.params)):  # once per sync_every steps
            self.merged.add(i, g - p)
        reduced = self.merged.finish()
        if reduced is not None:
            for g, averaged in zip(self.global_params, reduced.tensors(len(self.params))):
                g.grad = averaged.view_as(g)
            self.outer_optimizer.step()
        for p, g in zip(self.params, self.global_params):
            p.copy_(g)
        return reduced is not None

    def state_bytes(self) -> int:
        """Bytes this rank keeps for DiLoCo besides the model: the global parameters, the outer
        optimizer's state and the error-feedback memory."""
        tensors = [*self.global_params, *(t for s in self.outer_optimizer.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor))]
        memory = [t for fields in self.memory.state_dict().values() for t in fields.values()]
        return sum(t.numel() * t.element_size() for t in tensors + memory)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The global parameters, the outer optimizer's state, the inner steps counted and the
        merged step's (plan, compressor state, this rank's memory); save it beside the model's
        and the inner optimizer's."""
        return {"global_params": [g.clone() for g in self.global_params],
                "outer_optimizer": self.outer_optimizer.state_dict(), "inner_steps": self.inner_steps,
                "mergecomp": self.merged.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s, on every rank with its own, between steps."""
        saved = state["global_params"]
        if [tuple(t.shape) for t in saved] != [tuple(g.shape) for g in self.global_params]:
            raise ValueError("DiLoCo.load_state_dict: the checkpoint's global parameters do not match these "
                             "parameters' shapes")
        for g, t in zip(self.global_params, saved):
            g.copy_(t)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.merged.load_state_dict(state["mergecomp"])

    def close(self) -> None:
        """Stop counting the inner optimizer's steps."""
        self._hook.remove()
