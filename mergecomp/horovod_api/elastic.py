"""Horovod's elastic loop (``hvd.elastic.run``), shared by the torch and TensorFlow front ends:
the training function runs after ``state.sync()``; a collective that failed because a worker was
lost (Horovod's ``HorovodInternalError``) sends every rank back to its last ``commit()``; a
change of hosts (``HostsUpdatedInterrupt``, raised at the same ``commit()`` on every rank) keeps
the state as committed; either way every rank then leaves the old world and joins the new one
(``shutdown()``, ``init()`` with the same engine and timeout) and ``state.on_reset()`` runs.

Only the horovod engine runs under Horovod's elastic driver: another engine's failures end the
job (the function runs once after the sync).  Needs Horovod's notifications and exceptions.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

try:
    from horovod.common.elastic import ObjectState, notification_manager
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError("Horovod's elastic API runs on Horovod's elastic driver and notifications, which cannot be "
                      f"imported ({err}); install Horovod with: bash scripts/install_horovod.sh") from err

from mergecomp.horovod_api.runtime import communicator, init, shutdown

__all__ = ["run", "ObjectState", "HorovodInternalError", "HostsUpdatedInterrupt"]


@contextlib.contextmanager
def _failures_as_horovod(lost_worker: Callable[[BaseException], bool]) -> Iterator[None]:
    """An error for which ``lost_worker(error)`` holds, under the horovod engine, raised as
    Horovod's ``HorovodInternalError``, which :func:`run` answers with a reset."""
    try:
        yield
    except HorovodInternalError:
        raise
    except Exception as err:
        if communicator().engine != "horovod" or not lost_worker(err):
            raise
        raise HorovodInternalError(str(err)) from err


def _reset() -> None:
    """Leave the old world and join the new one, with the same engine and timeout."""
    comm = communicator()
    engine, timeout = comm.engine, comm.timeout
    shutdown()
    init(engine=engine, timeout=timeout)


def run(func: Callable, lost_worker: Callable[[BaseException], bool]) -> Callable:
    """``func(state, ...)`` decorated as the module docstring says; ``lost_worker(error)``: the
    front end's test for an error that a lost worker's collectives raise."""
    @functools.wraps(func)
    def wrapper(state: Any, *args, **kwargs):
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    with _failures_as_horovod(lost_worker):
                        if not skip_sync:
                            state.sync()
                        return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as interrupt:
                    skip_sync = interrupt.skip_sync
                _reset()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper
