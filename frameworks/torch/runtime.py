"""Process-wide state of the PyTorch front end: which engine, which rank, which communicator."""
from __future__ import annotations

import os
from typing import Optional

from mergecomp.comm import Communicator, LocalCommunicator, default_timeout

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "communicator"]

_comm: Optional[Communicator] = None
_ENGINES = ("auto", "torch", "local")


def init(engine: str = "auto", backend: Optional[str] = None, timeout: Optional[float] = None,
         comm: Optional[Communicator] = None) -> Communicator:
    """Start mergecomp in this process (idempotent).

    Args:
        engine: ``"torch"`` (torch.distributed, as launched by ``torchrun``), ``"local"`` (one
            process, no communication) or ``"auto"``: torch when torchrun's ``WORLD_SIZE`` is set
            or a default process group exists, local otherwise.
        backend: torch.distributed backend; default NCCL when CUDA is available, else gloo.
        timeout: seconds any one collective may take (default ``MERGECOMP_TIMEOUT`` or 300).
        comm: use this communicator instead (advanced: a sub-group, a custom engine).
    """
    global _comm
    if comm is not None:
        _comm = comm
        return _comm
    if _comm is not None:
        return _comm
    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {_ENGINES}, got {engine!r}")
    timeout = default_timeout() if timeout is None else float(timeout)
    if engine == "auto":
        import torch.distributed as dist

        engine = "torch" if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()) else "local"
    if engine == "torch":
        from mergecomp.engines.torch_dist import TorchCommunicator, init_process_group

        init_process_group(backend, timeout)
        _comm = TorchCommunicator(timeout=timeout)
    else:
        _comm = LocalCommunicator(timeout)
    return _comm


def shutdown() -> None:
    """Forget the communicator and destroy the torch.distributed group if this module made it."""
    global _comm
    if _comm is not None and _comm.engine == "torch":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _comm = None


def is_initialized() -> bool:
    return _comm is not None


def communicator() -> Communicator:
    if _comm is None:
        raise RuntimeError("mergecomp is not initialized: call mergecomp.torch.init() first")
    return _comm


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    """This process's index on its host (``LOCAL_RANK`` as set by the launcher; else the rank)."""
    communicator()
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if var in os.environ:
            return int(os.environ[var])
    return rank()
