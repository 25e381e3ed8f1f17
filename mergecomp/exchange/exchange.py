"""One merged group's trip, framework-agnostic: the check, the error compensation, and the
hand-over to the scheme that moves it.

:class:`Exchange` runs, for each group::

    check finite -> [keep state] -> memory.compensate (+ a carry) -> scheme.start
                 ... scheme.advance (the scheme's later stages) ... scheme.finish -> result

The group's codec resolves once into its :class:`~mergecomp.exchange.job.Route`
(:meth:`Exchange.route`): what encodes it (the configured compressor, or the ``"fp16"`` and
``"none"`` codecs) and how it travels (:mod:`mergecomp.exchange.schemes`): the configured
compressor's payloads by allreduce where they add up, else by allgather, or by a sharded scheme
the codec names (``"two-phase"``, ``"hierarchical"``, ``"hierarchical-two-phase"``).  The
scheme encodes through the exchange's :class:`~mergecomp.exchange.encoder.Encoder`, which feeds
the memory what was sent.  A group sent whole whose compressor fuses the memory's work into its
own passes (:class:`~mergecomp.compressors.base.capabilities.FusedEncode`) skips the
separate compensation, and the check where that pass makes it and the step keeps the state it
changes (``keep_state``); one whose gradients were encoded as they arrived
(:meth:`Exchange.begin`) skips the check too.

A group sent with the codec :data:`~mergecomp.exchange.plan.EXEMPT` skips the memory: its
gradient is allreduced as it is, and neither the memory nor the compressor state of any group
changes (:data:`~mergecomp.exchange.plan.WARMUP_FP16` and ``WARMUP_QSGD`` likewise, cast to fp16 or
quantized by QSGD and allgathered).

:meth:`Exchange.start` returns the group's :class:`~mergecomp.exchange.job.Job` right after its
first collective is issued; :meth:`Exchange.finish` waits for it, runs what is left, and returns
the reduced flat gradient.  All collectives of a step must be started in the same order on every
rank: callers start groups in plan order, advance them all in plan order while any has stages
left, and only then finish them, again in plan order.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import NOT_FINITE, FusedEncode, FusedParts, PartsEncode
from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.compressors.base.stateful import GroupStateful
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.breakdown import DECODE, ENCODE, Stopwatch
from mergecomp.exchange.compatibility import check
from mergecomp.exchange.encoder import Encoder
from mergecomp.exchange.job import Job, Route
from mergecomp.exchange.plan import CODECS, COMPRESSED, UNFED, Group
from mergecomp.exchange.schemes import ALLGATHER, ALLREDUCE, REDUCE_SCATTER, SCHEMES, SHARDED, Scheme
from mergecomp.compressors.horovod_codec import HorovodCodec, is_horovod_codec
from mergecomp.kernels.codecs import all_finite
from mergecomp.kernels.workspace import Workspace
from mergecomp.registry import get_compressor, get_memory

__all__ = ["Exchange", "resolve"]


def resolve(compression, memory) -> Tuple[Compressor, Memory]:
    """The compressor and memory named (or given as instances): ``memory`` None means the
    compressor's ``default_memory``.  Every front end resolves names through this."""
    if isinstance(compression, str):
        compression = get_compressor(compression)
    elif is_horovod_codec(compression):
        compression = HorovodCodec(compression)
    if memory is None and isinstance(compression, Compressor):
        memory = compression.default_memory
    if isinstance(memory, str):
        memory = get_memory(memory)
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be a compressor name, a mergecomp.Compressor or a compressor written "
                        f"for Horovod (compress/decompress), got {compression!r}")
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a memory name or a mergecomp.Memory, got {memory!r}")
    return compression, memory


class Exchange:
    """Compress and communicate merged groups with one compressor and one memory.

    Besides the configured compressor (codec ``"compressed"``, or a sharded scheme's name), a
    group may be sent with the codec ``"fp16"`` or ``"none"`` (a plain allreduce): the scheduler
    picks per group; or with ``"exempt"`` (a plain allreduce that bypasses the memory: exempt
    tensors, warm-up steps).

    Args:
        compressor: encodes each group's flat buffer.
        memory: error feedback, per group.
        comm: the engine.
        average: divide the sum over ranks by the world size (ignored by majority votes).
        check_finite: zero a group holding NaN/Inf before it reaches the memory or the
            compressor state, and report it through :attr:`Job.finite`.
        recycle: on a CPU engine, attach a :class:`~mergecomp.kernels.workspace.Workspace` to
            the codecs, so their full-size outputs are reused from step to step instead of being
            allocated (and page-faulted in) again.  A result returned by :meth:`finish` is then
            valid until the next step's :meth:`start`; front ends that hand results to user
            code which may keep them (TensorFlow) pass False.
        keep_state: each started group's memory and compressor state is kept as it was
            before the step until :meth:`commit` (nothing kept) or :meth:`rollback` (the
            state goes back), through their ``keep``/``restore`` (no copy for the residual
            memory or stateless codecs).
    """

    def __init__(self, compressor: Compressor, memory: Memory, comm: Communicator,
                 average: bool = True, check_finite: bool = True, recycle: bool = True,
                 keep_state: bool = False) -> None:
        self.compressor = compressor
        self.memory = memory
        self.comm = comm
        self.average = average
        self.check_finite = check_finite
        #: steps finished so far (checkpointed); :meth:`end_step` counts them
        self.step = 0
        self.keep_state = keep_state
        self._kept = []  # (state holder, group, what it kept)
        self.workspace = Workspace() if recycle and torch.device(comm.device).type == "cpu" else None
        compressor.workspace = self.workspace
        self._routes: Dict[str, Route] = {}
        #: the seconds each group spends in each part of the step (:mod:`mergecomp.exchange.breakdown`)
        self.clock = Stopwatch()
        self.encoder = Encoder(compressor, memory, self.clock, self.workspace, check_finite, average)
        #: one instance of every scheme, by name
        self.schemes: Dict[str, Scheme] = {name: scheme(comm, self.encoder, self.route)
                                           for name, scheme in SCHEMES.items()}
        self._stateful = [scheme for scheme in self.schemes.values() if scheme.holders]  # those with carries

    @classmethod
    def create(cls, compression, memory, comm: Communicator, average: bool = True,
               check_finite: bool = True, recycle: bool = True, keep_state: bool = False) -> "Exchange":
        """Build from names or instances (see :func:`resolve`)."""
        return cls(*resolve(compression, memory), comm, average=average, check_finite=check_finite,
                   recycle=recycle, keep_state=keep_state)

    # -- routes -------------------------------------------------------------------------------
    def route(self, codec: str) -> Route:
        """How a group given ``codec`` travels, resolved once per codec: ``"compressed"`` (the
        configured compressor, by allreduce where its payloads add up, else by allgather), a
        sharded scheme's name (the configured compressor by that scheme, where the scheme
        applies, else by its :attr:`~Scheme.fallback`: a hierarchical codec on one host, or on
        hosts of one process, asks every rank for the hosts' layout the first time, and every
        rank gets there at once), ``"fp16"``, ``"none"``, or a route outside error feedback
        (:data:`~mergecomp.exchange.plan.UNFED`: ``"exempt"``, ``"warm-up-fp16"``,
        ``"warm-up-qsgd"``, ``"warm-up-qsgd4"``); or ``"reduce-scatter"`` (the configured
        compressor by :mod:`~mergecomp.exchange.schemes.reduce_scatter`: no plan codec, what
        ``mc.fsdp`` sends by).  ValueError for another codec, or a scheme that cannot carry the
        compressor (:mod:`~mergecomp.exchange.compatibility`)."""
        route = self._routes.get(codec)
        if route is None:
            route = self._routes[codec] = self._resolve(codec)
        return route

    def _resolve(self, codec: str) -> Route:
        compressor = self.compressor
        if codec in (*SHARDED, REDUCE_SCATTER):  # the configured compressor by that scheme
            check(compressor, codec, f"codec {codec!r}")
            if SCHEMES[codec].applies(self.comm):
                return Route(codec, compressor, self.schemes[codec])
            if SCHEMES[codec].fallback is not None:
                return self.route(SCHEMES[codec].fallback)
        elif codec not in (*CODECS, *UNFED):
            raise ValueError(f"codec must be one of {(*CODECS, *SHARDED, *UNFED, REDUCE_SCATTER)}, got {codec!r}")
        elif codec != COMPRESSED:
            registered, arguments = UNFED.get(codec, (codec, {}))
            compressor = get_compressor(registered, **arguments)
            compressor.workspace = self.workspace
        return Route(codec, compressor, self.schemes[ALLREDUCE if compressor.summable else ALLGATHER])

    # -- one group ------------------------------------------------------------------------------
    @property
    def encodes_parts(self) -> bool:
        """Whether :meth:`begin` may encode a group part by part (a compressor of one round
        that offers it, :class:`~mergecomp.compressors.base.capabilities.PartsEncode`)."""
        return isinstance(self.compressor, PartsEncode) and self.compressor.rounds == 1

    def begin(self, group: Group, flat: torch.Tensor, route: Optional[Route] = None) -> Optional[FusedParts]:
        """Where ``group`` (sent by ``route``, default ``"compressed"``'s; ``flat``: its buffer,
        not read) can be encoded tensor by tensor as its gradients arrive
        (:meth:`Encoder.parts`: the sign codes on fp32 CPU): its :class:`FusedParts`, for the caller to
        :meth:`~FusedParts.add` each gradient to and pass to :meth:`start`; the group's state
        is kept meanwhile (a part found not finite puts it back).  Else None: the caller fills
        ``flat`` and starts it."""
        name = group.name
        if (not self.encodes_parts or (route is not None and route.name != COMPRESSED) or group.numel == 0
                or any(scheme.has_carry(name) for scheme in self._stateful)):
            return None
        if self.workspace is not None:
            self.workspace.advance(self.step)
        parts = self.encoder.parts(name, flat, len(group.indices))
        if parts is not None and self.check_finite:
            holders = self.holders().values() if self.keep_state else (self.memory,)
            parts.kept = [(holder, name, holder.keep(name)) for holder in holders]
        return parts

    def cancel(self, parts: FusedParts) -> None:
        """Put back the state ``parts`` (from :meth:`begin`, not started) kept."""
        for holder, name, kept in reversed(parts.kept):
            holder.restore(name, kept)
        parts.kept = []

    def start(self, group: Group, flat: torch.Tensor, route: Optional[Route] = None,
              finite: Optional[bool] = None, parts: Optional[FusedParts] = None, check: bool = True,
              scratch: bool = False) -> Job:
        """Check, compensate and hand ``flat`` (the group's gradients; modified in place) to the
        scheme of its ``route`` (:meth:`route`; default ``"compressed"``'s), which starts the
        first collective.  ``check`` False: no NaN/Inf check this step (:attr:`Job.finite` is
        True), even with ``check_finite``.

        ``finite``: whether ``flat`` holds no NaN/Inf, when the caller already knows (e.g. from
        :func:`mergecomp.kernels.codecs.copy_finite` while filling it); None: checked here.
        ``parts``: what :meth:`begin` gave, every gradient added (``finite``: whether all were;
        ``flat`` then holds no gradients): its payload is sent, or, for a part not finite, the
        group's state is put back and the group goes on as one whose ``flat`` held NaN.
        ``scratch``: the caller reads ``flat`` no more and finishes into it
        (``finish(job, out=flat)``): an encode that can may zero it as it reads it, for a decode
        that scatters into zeros (:attr:`Job.scratch`).
        """
        check = check and self.check_finite
        with self.clock(ENCODE, group.name):
            if self.workspace is not None:
                self.workspace.advance(self.step)
            job = Job(group, route or self.route(COMPRESSED), flat, self.comm, self.step)
            job.scratch = scratch and self.workspace is not None
            compressor, scheme = job.compressor, job.scheme
            if parts is not None:
                if finite or not check:
                    job.finite = flat.new_ones((), dtype=torch.bool)
                    self._kept += parts.kept if self.keep_state else []
                    job.owned = True
                    self.encoder.take(job, parts.finish())
                    scheme.start(job)
                    return job
                self.cancel(parts)
                finite = False
            job.checked_by_encode = (finite is None and scheme.whole and check and compressor.may_overflow
                                     and flat.device.type == "cpu" and (not job.feedback or self.memory.passthrough))
            # a fused encode may check the gradient in its own pass where the step keeps the state it writes
            checked_by_fuse = (finite is None and check and self.keep_state and job.feedback and scheme.whole
                               and isinstance(compressor, FusedEncode) and compressor.checks_finite)
            job.finite = (flat.new_ones((), dtype=torch.bool) if job.checked_by_encode or not check or checked_by_fuse
                          else self._check(job, finite))
            if job.feedback:
                name = group.name
                if self.keep_state and check:
                    self._kept += [(holder, name, holder.keep(name))
                                   for holder in (self.memory, compressor, *self._scheme_holders())]
                carry = next((c for s in self._stateful if (c := s.take_carry(name)) is not None), None)
                fused = scheme.whole and carry is None and self.encoder.fuse(job, check=checked_by_fuse)
                if fused is NOT_FINITE:  # the state as it was, and on from the gradient zeroed
                    self._restore_kept(name)
                    job.finite = self._check(job, False)
                    fused = self.encoder.fuse(job)
                elif checked_by_fuse and not fused:  # no fused encode after all: its own pass
                    job.finite = self._check(job, None)
                if not fused:
                    self.encoder.compensate(job, carry)
            scheme.start(job)
            return job

    def _restore_kept(self, name: str) -> None:
        """Group ``name``'s state put back as this step kept it, and kept again."""
        mine = [entry for entry in self._kept if entry[1] == name]
        self._kept = [entry for entry in self._kept if entry[1] != name]
        for holder, _, kept in reversed(mine):
            holder.restore(name, kept)
        self._kept += [(holder, name, holder.keep(name)) for holder, _, _ in mine]

    def _check(self, job: Job, finite: Optional[bool]) -> torch.Tensor:
        """0-d bool: whether ``job``'s gradient is finite (``finite``: known from its copy-in;
        None: one pass checks it); a non-finite gradient is zeroed."""
        flat = job.compensated
        if finite is None:
            finite = all_finite(flat)
            job.count("check", 1)
        else:  # filled in on the device (a tensor made from host data waits for a CUDA device)
            finite = flat.new_full((), bool(finite), dtype=torch.bool)
        if flat.device.type == "cpu":  # no device to sync with: branch instead of a full pass
            if not finite:
                flat.zero_()
        else:
            flat.masked_fill_(finite.logical_not(), 0)
            job.count("check", 1)
        return finite

    def advance(self, job: Job) -> bool:
        """Run ``job``'s next stage between its first collective and its last (its scheme's).
        Returns whether stages are left.  Callers advance every started group in plan order,
        and again while any has stages left, before finishing the first: every rank then
        starts each communicator's collectives in the same order."""
        return job.scheme.advance(job)

    def finish(self, job: Job, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Wait for ``job``, run its remaining stages and rounds, and return the reduced flat
        gradient.

        With ``out`` (flat, the group's numel and dtype; typically the buffer passed to
        :meth:`start`, whose contents are no longer needed) the result is written there and
        ``out`` is returned: the codec decodes straight into it when it takes its output from
        the workspace, else the result is copied in.
        """
        scheme = job.scheme
        with self.clock(DECODE, job.group.name):
            while scheme.advance(job):
                pass
            return scheme.finish(job, out)

    # -- the step's state ---------------------------------------------------------------------
    def end_step(self) -> int:
        """Count the step just finished; returns its number."""
        self.step += 1
        return self.step - 1

    def commit(self) -> None:
        """The step's state changes stand (``keep_state``)."""
        self._kept = []

    def forget(self, names: Sequence[str]) -> None:
        """The memory of groups ``names`` starts afresh: their error-compensated gradient
        overflowed its payload (:attr:`Job.overflowed`), so the residual kept for them
        (whose last update holds Inf) would overflow the next step's payload again."""
        for name in names:
            self.memory.restore(name, {})

    def clear_memories(self) -> None:
        """Every error-feedback memory (the worker's and the schemes' second stage) starts
        afresh, for every group: what is exchanged from now on is another quantity (the
        momentum instead of the gradient), whose errors the old residuals do not describe."""
        for holder in (self.memory, *self._scheme_holders()):
            holder.load_state_dict({})

    def rollback(self) -> None:
        """Undo the memory and compressor state changes of the groups started since the last
        :meth:`commit` (``keep_state``), as if this step had not happened."""
        for holder, name, kept in reversed(self._kept):
            holder.restore(name, kept)
        self._kept = []

    def fold(self, groups: Sequence[Group], routes: Sequence[Route]) -> None:
        """Before the plan changes away from ``groups``, last started by ``routes``: each
        route's scheme turns its state of them into what their elements carry to the new
        groups (:meth:`Scheme.fold`)."""
        for group, route in zip(groups, routes):
            route.scheme.fold(group, self.comm, (0, group.numel))

    def _scheme_holders(self) -> Tuple[GroupStateful, ...]:
        return tuple(holder for scheme in self.schemes.values() for holder in scheme.holders.values())

    def holders(self) -> Dict[str, GroupStateful]:
        """Everything that holds per-group state across steps, by checkpoint key: the memory,
        the compressor and the schemes' state (``"shard_memory"``)."""
        out: Dict[str, GroupStateful] = {"memory": self.memory, "compressor": self.compressor}
        for scheme in self.schemes.values():
            out.update(scheme.holders)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, **{key: holder.state_dict() for key, holder in self.holders().items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        for key, holder in self.holders().items():
            holder.load_state_dict(state.get(key, {}))
