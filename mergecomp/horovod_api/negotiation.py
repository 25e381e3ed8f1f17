"""Horovod's negotiation of tensor collectives by name, for one process set.

A collective (:mod:`mergecomp.horovod_api.operations`) is submitted under a name
(``"allreduce.grad"``, or ``"allreduce.noname.<n>"`` counted per kind) and runs once every rank of
the set has submitted that name, whatever else each rank submitted in between: ranks may start
asynchronous collectives in different orders, and a rank that has joined stands in for the others'
reductions.  A background thread per process set runs *rounds*: each rank sends what it submitted
since its last round (name, kind, meta) and which of its collectives it is blocked on, by one
``allgather_object`` on a communicator of its own (so the rounds never interleave with the
training's collectives); every rank then holds the same table of names and who submitted them,
and runs the complete ones in the same order, after checking that every rank's meta agrees.

Guarantees, the same on every rank: a dtype, shape, root or op that differs between ranks fails
that collective with :class:`MismatchError` naming two ranks; a name submitted twice before it
finished raises ValueError at once on the rank that did it; a name some ranks submitted and others
did not for ``timeout`` seconds (rank 0's clock decides) fails with :class:`MismatchError` naming
the missing ranks; a round that cannot complete (a rank gone) fails every waiting collective with
:class:`~mergecomp.engines.communicator.CommunicationError` after the timeout.  The threads stop
once everything any rank sent has run, and start again at the next submission.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from mergecomp.engines.communicator import CommunicationError, Communicator
from mergecomp.horovod_api.operations import Operation

__all__ = ["Coordinator", "Request", "MismatchError", "describe"]

#: kinds a joined rank stands in for are those whose Operation.stand_in returns one; these map
#: a kind name to its Operation class (filled by :func:`register`)
_KINDS: Dict[str, type] = {}
JOIN = "join"


def register(*classes: type) -> None:
    for cls in classes:
        _KINDS[cls.kind] = cls


def describe(name: str) -> str:
    """A negotiation name as error messages show it: ``allreduce of 'grad'``, ``allreduce #3 (unnamed)``."""
    kind, _, rest = name.partition(".")
    if not rest:
        return kind
    return f"{kind} #{rest[7:]} (unnamed)" if rest.startswith("noname.") else f"{kind} of {rest!r}"


class MismatchError(RuntimeError, ValueError):
    """Ranks asked for one collective with arguments that do not agree (dtype, shape, root, op),
    or not every rank asked for it.  Raised on every rank that asked."""


class Request:
    """One rank's submitted collective: its name, the Operation, and its outcome.

    ``wait()`` blocks until it finished and returns the result or raises its error; ``done()``
    says whether it finished, without blocking (Horovod's ``poll``)."""

    def __init__(self, name: str, operation: Optional[Operation], kind: str) -> None:
        self.name, self.operation, self.kind = name, operation, kind
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None

    @property
    def meta(self) -> tuple:
        return self.operation.meta if self.operation is not None else ()

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._done.wait(timeout):
            raise CommunicationError(f"{describe(self.name)} did not finish within {timeout:g}s")
        if self._error is not None:
            raise self._error
        return self._result


class Coordinator:
    """The negotiation for the ranks of ``comm`` (a communicator used for nothing else).

    ``submit(kind, operation, name)`` returns a :class:`Request`; ``timeline`` (optional) gets
    ``event(name, phase, begin)`` and ``cycle()`` calls."""

    #: seconds between rounds that found nothing to run (the first retry is at once)
    IDLE_SLEEP = 0.001

    def __init__(self, comm: Communicator, timeout: float, label: str = "") -> None:
        self.comm, self.timeout, self.label = comm, timeout, label
        self.timeline = None
        self._lock = threading.Lock()
        self._new: List[Request] = []
        self._mine: Dict[str, Request] = {}  # submitted here, not finished
        self._table: Dict[str, Dict[int, Tuple[str, tuple]]] = {}  # name -> rank -> (kind, meta); same everywhere
        self._first_seen: Dict[str, float] = {}  # rank 0 only: when a name entered the table
        self._joined: Dict[int, int] = {}  # rank -> round it joined in
        self._waited: Counter = Counter()  # names this rank's threads are blocked on
        self._stuck_rounds = 0  # consecutive rounds in which every rank was blocked and nothing could run
        self._counters: Counter = Counter()
        self._round = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._broken: Optional[BaseException] = None

    # -- the submitting side --------------------------------------------------------------------
    def name(self, kind: str, name: Optional[str]) -> str:
        """The negotiation name: ``kind.name``, or ``kind.noname.<n>`` (the n-th unnamed one)."""
        if kind == JOIN:
            return JOIN
        if name is None:
            with self._lock:
                self._counters[kind] += 1
                return f"{kind}.noname.{self._counters[kind]}"
        return f"{kind}.{name}"

    def submit(self, kind: str, operation: Optional[Operation], name: Optional[str] = None) -> Request:
        """Queue ``operation`` under ``name`` (see :meth:`name`); ValueError if that name is still
        in flight on this rank; CommunicationError if an earlier round failed."""
        request = Request(self.name(kind, name), operation, kind)
        with self._lock:
            if self._broken is not None:
                raise CommunicationError(f"{describe(request.name)}: the collectives of this process set failed earlier: "
                                         f"{self._broken}") from self._broken
            if request.name in self._mine:
                raise ValueError(f"{describe(request.name)}: a collective of that name is already in flight on rank "
                                 f"{self.comm.rank}; names must be unique among unfinished collectives")
            self._mine[request.name] = request
            self._new.append(request)
            if self.timeline is not None:
                self.timeline.event(request.name, f"NEGOTIATE_{kind.upper()}", True)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"mergecomp negotiation{self.label}",
                                                daemon=True)
                self._thread.start()
        return request

    def wait(self, request: Request) -> Any:
        """``request``'s result; the coordinator's own timeouts end every wait, this bound is a
        backstop for a thread that died."""
        with self._lock:
            self._waited[request.name] += 1
        try:
            return request.wait(None if request.kind == JOIN else 3 * self.timeout + 60)
        finally:
            with self._lock:
                self._waited[request.name] -= 1
                if not self._waited[request.name]:
                    del self._waited[request.name]

    def close(self) -> None:
        """At shutdown: let the rounds end as they do when no rank waits on anything (every rank
        shuts down, so the last round completes everywhere; at most ``min(timeout, 30)`` s), then
        fail what is still waiting."""
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while time.monotonic() < deadline:
            with self._lock:
                thread = self._thread
            if thread is None:
                break
            thread.join(0.05)
        with self._lock:
            self._broken = self._broken or CommunicationError("mergecomp was shut down")
            waiting, self._mine, self._new = list(self._mine.values()), {}, []
        for request in waiting:
            request.finish(error=CommunicationError(f"{describe(request.name)}: mergecomp was shut down before it ran"))

    # -- the rounds -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._broken is not None:
                        self._thread = None
                        return
                    new, self._new = self._new, []
                    waited = sorted(n for n in self._waited if n in self._mine)
                message = ([(r.name, r.kind, r.meta) for r in new], self._expired(), waited)
                if self.timeline is not None:
                    self.timeline.cycle()
                messages = self.comm.allgather_object(message, f"the negotiation of collectives{self.label}")
                ran = self._apply(messages)
                with self._lock:  # nothing any rank sent is unfinished (the same on every rank), nothing to send
                    if not self._table and not self._joined and not self._new:
                        self._thread = None
                        return
                if not ran and not any(m[0] for m in messages):
                    time.sleep(self.IDLE_SLEEP)
        except BaseException as err:  # noqa: BLE001 - every waiting collective must hear of it
            self._fail_all(err)

    def _expired(self) -> List[str]:
        """Rank 0: the names in the table longer than the timeout (every rank fails them)."""
        if self.comm.rank != 0:
            return []
        now = time.monotonic()
        return [name for name, since in self._first_seen.items() if now - since > self.timeout]

    def _apply(self, messages: List[tuple]) -> bool:
        """Enter every rank's submissions, then run what is complete; True if anything ran."""
        round_index = next(self._round)
        for rank, (entries, _, _) in enumerate(messages):
            for name, kind, meta in entries:
                if kind == JOIN:
                    self._joined[rank] = round_index
                else:
                    self._table.setdefault(name, {})[rank] = (kind, meta)
                    if self.comm.rank == 0:
                        self._first_seen.setdefault(name, time.monotonic())
        ran = False
        for name in messages[0][1]:
            if name in self._table:
                self._finish_missing(name)
                ran = True
        everyone = set(range(self.comm.size))
        for name in [n for n, by in self._table.items() if set(by) | set(self._joined) >= everyone]:
            self._run(name)
            ran = True
        self._stuck_rounds = 0 if ran or any(m[0] for m in messages) or not all(m[2] for m in messages) \
            else self._stuck_rounds + 1
        if self._stuck_rounds >= 2 and self._table:
            self._fail_stuck([m[2] for m in messages])
            ran = True
        if len(self._joined) == self.comm.size:
            last = max(self._joined, key=lambda r: (self._joined[r], r))
            self._joined.clear()
            self._finish(JOIN, result=last)
            ran = True
        return ran

    def _finish(self, name: str, result: Any = None, error: Optional[BaseException] = None) -> None:
        with self._lock:
            request = self._mine.pop(name, None)
        if request is not None:
            request.finish(result, error)

    def _take(self, name: str) -> Dict[int, Tuple[str, tuple]]:
        """Remove ``name`` from the table (it runs or fails now): who asked for it, and how."""
        self._first_seen.pop(name, None)
        return self._table.pop(name)

    def _finish_missing(self, name: str) -> None:
        by = self._take(name)
        missing = sorted(set(range(self.comm.size)) - set(by) - set(self._joined))
        self._finish(name, error=MismatchError(
            f"{describe(name)}: ranks {sorted(by)} asked for it but ranks {missing} did not within {self.timeout:g}s "
            f"(set MERGECOMP_TIMEOUT to change the limit)"))

    def _fail_stuck(self, waited: List[List[str]]) -> None:
        """Every rank is blocked on a collective that some other rank has not asked for and, being
        blocked, never will: fail every incomplete one (a user error such as ranks calling
        different collectives at the same point), naming what each rank waits for."""
        waits = "; ".join(f"rank {r} waits for {', '.join(describe(n) for n in names)}"
                          for r, names in enumerate(waited))
        for name in list(self._table):
            by = self._take(name)
            self._finish(name, error=MismatchError(
                f"{describe(name)}: only ranks {sorted(by)} asked for it, and every rank is blocked waiting "
                f"({waits}); ranks must call the same collectives"))
        self._stuck_rounds = 0

    def _run(self, name: str) -> None:
        by = self._take(name)
        kinds = {rank: kind for rank, (kind, _) in by.items()}
        metas = {rank: meta for rank, (_, meta) in by.items()}
        with self._lock:
            request = self._mine.get(name)
        error = self._disagreement(name, kinds, metas)
        if error is None and self._joined:
            stand_in = _KINDS[kinds[min(kinds)]].stand_in(metas[min(metas)])
            if stand_in is None:
                error = (f"{describe(name)}: ranks {sorted(self._joined)} have joined, and a joined rank takes part in "
                         f"Sum/Average reductions and barriers only")
            elif request is None:  # this rank has joined: its zeros stand in
                metas.update({rank: stand_in.meta for rank in self._joined})
                self._execute(name, stand_in, metas)
                return
            else:
                metas.update({rank: stand_in.meta for rank in self._joined})
        if error is not None:
            self._finish(name, error=MismatchError(error))
            return
        if request is not None:
            self._finish(name, *self._execute(name, request.operation, metas))

    @staticmethod
    def _disagreement(name: str, kinds: Dict[int, str], metas: Dict[int, tuple]) -> Optional[str]:
        if len(set(kinds.values())) > 1:
            ranks = sorted(kinds)
            other = next(r for r in ranks if kinds[r] != kinds[ranks[0]])
            return f"{describe(name)}: rank {ranks[0]} asked for {kinds[ranks[0]]} but rank {other} for {kinds[other]}"
        problem = _KINDS[next(iter(kinds.values()))].check(metas)
        return f"{describe(name)}: {problem}" if problem else None

    def _execute(self, name: str, operation: Operation, metas: Dict[int, tuple]) -> Tuple[Any, Optional[BaseException]]:
        """Run ``operation``: ``(result, None)``; a failed collective breaks the coordinator (the
        ranks may now disagree on what ran), so it is raised to the loop."""
        if self.timeline is not None:
            self.timeline.event(name, f"NEGOTIATE_{operation.kind.upper()}", False)
            self.timeline.event(name, operation.kind.upper(), True)
        try:
            return operation.run(self.comm, metas), None
        except CommunicationError:
            raise
        except Exception as err:  # noqa: BLE001 - an error before any communication (a bad root, a dtype)
            err.args = (f"{describe(name)}: {err}",) + err.args[1:]
            return None, err
        finally:
            if self.timeline is not None:
                self.timeline.event(name, operation.kind.upper(), False)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            self._broken = err
            waiting, self._mine, self._new = list(self._mine.values()), {}, []
            self._thread = None
        for request in waiting:
            request.finish(error=CommunicationError(f"{describe(request.name)}: {err}"))
