"""mergecomp's DDP communication hook on a model prepared by Hugging Face Accelerate::

    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    model, opt, loader = accelerator.prepare(model, opt, loader)
    register(accelerator, model, "topk")          # before the first backward pass
    # with AdamW given, its momentum exchanged by the compressor's recipe (the warm-up follows the LR's):
    # register(accelerator, model, "onebit", optimizer=opt)

or DiLoCo around the prepared optimizer (no exchange per step; every ``sync_every`` steps the
parameters' change, compressed)::

    diloco = register_diloco(accelerator, model, opt, sync_every=50, compression="topk")
    ...                                           # the training loop unchanged
    diloco.sync()                                 # at the end: every rank on the global parameters

``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own hook names (any
other callable is dropped without a word), hence this function.  ``gradient_as_bucket_view=True``
(not Accelerate's default, and set before ``prepare`` builds the DDP) lets backward write each
gradient where the hook reads it: DDP's default copies every gradient into its bucket and the
result back, two passes over the gradients per step.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import accelerate  # noqa: F401  (this module is for Accelerate users: fail early without it)

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.pipeline.resharding import to_fold
from mergecomp.torch.ddp_hook import DDPHookState
from mergecomp.torch.diloco import DiLoCo
from mergecomp.torch.momentum_exchange import OPTION as MOMENTUM_OPTION
from mergecomp.torch.momentum_recipes import momentum_by_default

from ._hook import attach, attach_diloco
from ._ranks import AllRanks, DiLoCoRank

__all__ = ["register", "register_diloco"]


def register(accelerator: "accelerate.Accelerator", model: Any, compression: Union[str, Compressor] = "none",
             memory: Union[str, Memory, None] = None, checkpoint: bool = True,
             **options: Any) -> Optional[DDPHookState]:
    """Register mergecomp's hook on ``model``, the DistributedDataParallel that
    ``accelerator.prepare`` returned; every process calls it, before the first backward pass.

    Args:
        compression, memory, options: as :func:`mergecomp.torch.ddp_comm_hook` (``options``:
            ``nonfinite``, ``compression_warmup_steps``, ``uncompressed``, ...;
            ``optimizer=opt``, the optimizer ``prepare`` returned: an Adam or AdamW whose
            gradients a lossy compressor with error feedback would send has its momentum
            exchanged instead, by the compressor's recipe (``exchange_momentum_after="auto"``,
            its warm-up following the learning rate, or scaled to ``total_steps=N`` where given;
            :func:`~mergecomp.torch.momentum_recipes.momentum_by_default`), in the loss scale of the
            accelerator's ``GradScaler`` under fp16; ``exchange_momentum_after=K`` sets the
            warm-up, None sends the gradients).
        checkpoint: also ``accelerator.register_for_checkpointing`` every rank's hook state, so
            ``save_state`` writes it (one file, from the main process) and ``load_state`` gives
            each rank its own back.

    Returns the hook's state, or None on a single process (nothing to exchange).  TypeError when
    ``model`` is not a DistributedDataParallel (FSDP, DeepSpeed: not supported).
    """
    if accelerator.num_processes == 1:
        return None
    who = "mergecomp.torch.integrations.accelerate.register"
    optimizer = options.get("optimizer")
    if optimizer is not None:
        options = momentum_by_default(compression, memory, [optimizer], options, who)
        if options.get(MOMENTUM_OPTION) is None:  # gradients: the hook has no use for it
            options = {name: value for name, value in options.items() if name != "optimizer"}
    if options.get(MOMENTUM_OPTION) is not None and options.get("grad_scaler") is None:
        options["grad_scaler"] = accelerator.scaler  # None without fp16
    state = attach(model, compression, memory, options, who=who)
    if checkpoint:
        accelerator.register_for_checkpointing(AllRanks(state, accelerator.device, to_fold))
    return state


def register_diloco(accelerator: "accelerate.Accelerator", model: Any, optimizer: Any, sync_every: int,
                    compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                    checkpoint: bool = True, **options: Any) -> Optional[DiLoCo]:
    """DiLoCo around the optimizer that ``accelerator.prepare`` returned, on ``model``, the
    DistributedDataParallel it returned: DDP's gradient exchange is replaced by a hook under
    which every rank keeps its own gradients, and every ``sync_every`` optimizer steps the
    parameters' change goes through ``compression`` (:class:`mergecomp.torch.DiLoCo`; its
    options: ``fragments``, ``fragment_sync_delay``, ``outer_optimizer``, ...).  Every process
    calls it, before the first backward pass.

    Args:
        checkpoint: also ``accelerator.register_for_checkpointing`` every rank's DiLoCo state,
            local parameters and inner optimizer state (Accelerate's ``save_state`` writes the
            main process's model and optimizer, and under DiLoCo the ranks' differ), so
            ``load_state`` gives each rank its own back (saved on another number of ranks:
            the mean of the saved ranks' error-feedback memories, the main process's parameters
            and inner optimizer state).

    Returns the :class:`~mergecomp.torch.DiLoCo` (call its ``sync()`` at the end of training),
    or None on a single process.  Under fp16 the accelerator's ``GradScaler`` counts the steps.
    TypeError when ``model`` is not a DistributedDataParallel; RuntimeError when it already has
    a communication hook."""
    if accelerator.num_processes == 1:
        return None
    diloco = attach_diloco(model, optimizer, sync_every, compression, memory, options, accelerator.scaler,
                           who="mergecomp.torch.integrations.accelerate.register_diloco")
    if checkpoint:
        accelerator.register_for_checkpointing(AllRanks(DiLoCoRank(diloco), accelerator.device, DiLoCoRank.reshard))
    return diloco
