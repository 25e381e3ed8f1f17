"""Registering mergecomp's DDP communication hook on a model a framework wrapped in DDP, or
DiLoCo around the framework's optimizer under a hook that communicates nothing (its inner steps)."""
from __future__ import annotations

from typing import Any, Dict, Union

import torch
from torch.nn.parallel import DistributedDataParallel

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.torch.ddp_hook import DDPHookState, ddp_comm_hook
from mergecomp.torch.diloco import DiLoCo
from mergecomp.torch.named_parameters import inner_optimizer

__all__ = ["attach", "attach_diloco", "BUCKET_VIEWS"]

#: the DDP argument the integrations that build DDP pass unless the user gives it: each ``p.grad``
#: a view of its DDP bucket, so backward writes the gradients where the hook reads them and the
#: hook's result is where the optimizer reads it (no copy into the bucket and back, two passes
#: over the gradients per step; DDP's default copies)
BUCKET_VIEWS = {"gradient_as_bucket_view": True}


def _check_ddp(ddp: Any, who: str) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{who}: the mergecomp hook goes on a DistributedDataParallel model, got "
                        f"{type(ddp).__name__} (FSDP, DeepSpeed and other wrappers are not supported)")


def attach(ddp: DistributedDataParallel, compression: Union[str, Compressor] = "none",
           memory: Union[str, Memory, None] = None, options: Dict[str, Any] = None,
           who: str = "mergecomp") -> DDPHookState:
    """Register :func:`~mergecomp.torch.ddp_comm_hook` on ``ddp`` (on its process group, its
    module's parameter names) and bind it.  Every rank calls it before the first backward pass.
    RuntimeError naming ``who`` when ``ddp`` already has a communication hook."""
    _check_ddp(ddp, who)
    state, hook = ddp_comm_hook(compression, memory, process_group=ddp.process_group,
                                named_parameters=ddp.module.named_parameters(), **(options or {}))
    _register(ddp, state, hook, who)
    return state.bind()


def _local(_, bucket):  # no annotations: DDP checks them, and this module's are strings
    """A ``dist.GradBucket``'s gradients as this rank computed them (a completed future):
    nothing sent, nothing averaged."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def attach_diloco(ddp: DistributedDataParallel, optimizer: Any, sync_every: int,
                  compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                  options: Dict[str, Any] = None, grad_scaler: Any = None, who: str = "mergecomp") -> DiLoCo:
    """Register a hook on ``ddp`` under which every rank keeps its own gradients, and put
    :class:`~mergecomp.torch.DiLoCo` around ``optimizer`` (a framework's wrapper or the torch
    optimizer inside it) on ``ddp``'s module and process group; ``grad_scaler`` (counting the
    steps) where it is enabled.  Every rank calls it before the first backward pass.  TypeError
    when ``ddp`` is not a DistributedDataParallel, RuntimeError naming ``who`` when it already has
    a communication hook."""
    _check_ddp(ddp, who)
    _register(ddp, None, _local, who)
    enabled = grad_scaler is not None and grad_scaler.is_enabled()
    return DiLoCo(ddp.module.named_parameters(), inner_optimizer(optimizer), sync_every, compression, memory,
                  grad_scaler=grad_scaler if enabled else None, process_group=ddp.process_group, **(options or {}))


def _register(ddp: DistributedDataParallel, state: Any, hook: Any, who: str) -> None:
    try:
        ddp.register_comm_hook(state, hook)
    except RuntimeError as err:
        if "once" not in str(err):
            raise
        raise RuntimeError(f"{who}: this DDP model already has a communication hook (e.g. from "
                           f"DistributedDataParallelKwargs(comm_hook=...) or DDPStrategy(ddp_comm_hook=...)); "
                           f"mergecomp's replaces it: remove the other one") from err
