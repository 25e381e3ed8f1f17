"""mergecomp's DDP communication hook on a model prepared by Hugging Face Accelerate::

    model, opt, loader = accelerator.prepare(model, opt, loader)
    register(accelerator, model, "topk")          # before the first backward pass
    # with AdamW, its momentum exchanged by the compressor's recipe over a 2,000-update run:
    # register(accelerator, model, "onebit", exchange_momentum_after="auto", total_steps=2000, optimizer=opt)

``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own hook names (any
other callable is dropped without a word), hence this function.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import accelerate  # noqa: F401  (this module is for Accelerate users: fail early without it)

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.pipeline.resharding import to_fold
from mergecomp.torch.ddp_hook import DDPHookState
from mergecomp.torch.momentum_exchange import OPTION as MOMENTUM_OPTION

from ._hook import attach
from ._ranks import AllRanks

__all__ = ["register"]


def register(accelerator: "accelerate.Accelerator", model: Any, compression: Union[str, Compressor] = "none",
             memory: Union[str, Memory, None] = None, checkpoint: bool = True,
             **options: Any) -> Optional[DDPHookState]:
    """Register mergecomp's hook on ``model``, the DistributedDataParallel that
    ``accelerator.prepare`` returned; every process calls it, before the first backward pass.

    Args:
        compression, memory, options: as :func:`mergecomp.torch.ddp_comm_hook` (``options``:
            ``nonfinite``, ``compression_warmup_steps``, ``uncompressed``, ...;
            ``exchange_momentum_after=K, optimizer=opt`` with the AdamW ``prepare`` returned:
            its momentum exchanged, in the loss scale of the accelerator's ``GradScaler`` under
            fp16; ``exchange_momentum_after="auto", total_steps=N``: the compressor's recipe).
        checkpoint: also ``accelerator.register_for_checkpointing`` every rank's hook state, so
            ``save_state`` writes it (one file, from the main process) and ``load_state`` gives
            each rank its own back.

    Returns the hook's state, or None on a single process (nothing to exchange).  TypeError when
    ``model`` is not a DistributedDataParallel (FSDP, DeepSpeed: not supported).
    """
    if accelerator.num_processes == 1:
        return None
    if options.get(MOMENTUM_OPTION) is not None and options.get("grad_scaler") is None:
        options["grad_scaler"] = accelerator.scaler  # None without fp16
    state = attach(model, compression, memory, options, who="mergecomp.torch.integrations.accelerate.register")
    if checkpoint:
        accelerator.register_for_checkpointing(AllRanks(state, accelerator.device, to_fold))
    return state
