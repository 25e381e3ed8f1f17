"""One merged group's trip through compression and communication, framework-agnostic.

:class:`Exchange` chains, for each group::

    check finite -> memory.compensate -> compressor.compress -> collective (async)
                 -> memory.update          ...later: wait -> [next rounds] -> aggregate

or, for a group sent whole whose compressor fuses the memory's work into its own passes
(:meth:`~mergecomp.compressors.base.compressor.Compressor.compress_fused`: 1-bit SGD and EF-SignSGD with the
residual memory on fp32 CPU tensors), check finite -> fused compress -> collective (async) ->
the memory's update.

A group sent with the codec :data:`~mergecomp.pipeline.plan.TWO_PHASE` goes compensate -> compress
each shard -> all-to-all -> aggregate its own shard -> second-stage memory -> compress ->
allgather -> decode (:mod:`mergecomp.schemes.two_phase`).  A group sent with
:data:`~mergecomp.pipeline.plan.HIERARCHICAL` (or :data:`~mergecomp.pipeline.plan.HIERARCHICAL_TWO_PHASE`) goes
compensate -> reduce-scatter inside the host -> compress this rank's shard of the host's sum ->
allgather (or the two-phase scheme) across hosts -> aggregate -> allgather inside the host
(:mod:`mergecomp.schemes.hierarchical`).
:meth:`Exchange.advance` runs the stages between the first collective and the last.

A group sent with the codec :data:`~mergecomp.pipeline.plan.EXEMPT` skips the memory: its gradient is
allreduced as it is, and neither the memory nor the compressor state of any group changes.

``start`` returns an :class:`InFlight` right after the first collective is issued; ``finish``
waits for it, runs any further rounds, and returns the reduced flat gradient.  All collectives
of a step must be started in the same order on every rank: callers start groups in plan order,
and a multi-round compressor's later rounds are issued from ``finish``, again in plan order.

Allgathered payloads travel as one byte buffer per group (one collective, not one per payload
tensor; :mod:`mergecomp.kernels.wire`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, FusedParts, Payload
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.communicator import Communicator, Handle
from mergecomp.kernels.wire import Spec, pack_payload, pack_rows, unpack_payload
from mergecomp.kernels.workspace import Workspace
from mergecomp.pipeline.breakdown import DECODE, ENCODE, MEMORY, STAGES, WAIT, Stopwatch
from mergecomp.pipeline.plan import CODECS, EXEMPT, HIERARCHICAL, HIERARCHICAL_TWO_PHASE, TWO_PHASE, Group
from mergecomp.registry import get_compressor, get_memory
from mergecomp.schemes import hierarchical as hierarchy
from mergecomp.schemes.two_phase import Bounds, Sharded, ShardLayouts, ShardMemory, VoteCodec, shard_bounds

__all__ = ["Exchange", "InFlight", "NONFINITE_GRADIENT", "NONFINITE_POLICIES", "NonfiniteCheck", "OVERFLOWED", "SHARDED",
           "resolve"]

NONFINITE_POLICIES = ("propagate", "raise", "skip", "ignore")
#: codecs that send the configured compressor's payloads in shards (single-round compressors)
SHARDED = (TWO_PHASE, HIERARCHICAL, HIERARCHICAL_TWO_PHASE)


def _all_finite(flat: torch.Tensor) -> torch.Tensor:
    """0-d bool: no NaN/Inf in ``flat``.  NaN propagates through min/max and an Inf is an
    extreme, so one fused min/max pass decides (16x faster than ``isfinite(flat).all()`` on
    25.6 M floats on this 2-core CPU: 38 ms vs 608 ms)."""
    if flat.numel() == 0:
        return flat.new_ones((), dtype=torch.bool)
    low, high = torch.aminmax(flat)
    return torch.isfinite(low) & torch.isfinite(high)


def resolve(compression, memory) -> Tuple[Compressor, Memory]:
    """The compressor and memory named (or given as instances): ``memory`` None means the
    compressor's ``default_memory``.  Every front end resolves names through this."""
    if isinstance(compression, str):
        compression = get_compressor(compression)
    if memory is None and isinstance(compression, Compressor):
        memory = compression.default_memory
    if isinstance(memory, str):
        memory = get_memory(memory)
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be a compressor name or a mergecomp.Compressor, got {compression!r}")
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a memory name or a mergecomp.Memory, got {memory!r}")
    return compression, memory


class InFlight:
    """A group whose collective has been started; :meth:`Exchange.finish` completes it."""

    def __init__(self, group: Group, codec: str, compressor: Compressor, flat: torch.Tensor,
                 comm: Communicator) -> None:
        self.group = group
        #: the codec it travels with (as :meth:`Exchange.sent_as` gives it)
        self.codec = codec
        self.compressor = compressor
        #: what is compressed: the group's gradient, error-compensated once the memory has taken
        #: part (as given after a fused encode, :meth:`Exchange._compress_fused`)
        self.compensated = flat
        self.finite: Optional[torch.Tensor] = None
        #: 0-d bool: the payload of the finite, error-compensated gradient overflowed (e.g. its
        #: cast to fp16); None: not checked (:attr:`Compressor.may_overflow`)
        self.overflowed: Optional[torch.Tensor] = None
        #: the gradient's NaN/Inf check is left to the encode (a cast that checks its payload in
        #: its own pass, with no error feedback to keep NaN out of): :meth:`Exchange._compress`
        self.checked_by_encode = False
        self.feedback = codec != EXEMPT  # the error-feedback memory takes part
        #: the memory's update after a fused encode (:meth:`Compressor.compress_fused`), run in
        #: place of :meth:`Memory.feed`
        self.update: Optional[Callable[[], None]] = None
        #: the payload's tensors are the encoder's own, written by nothing until the next step
        #: (:class:`FusedParts`): a one-tensor payload is sent without a copy
        self.owned = False
        self.round = 1
        self.ctx: Any = None
        self.payload: Payload = ()
        self.specs: Optional[List[Spec]] = None
        self.handle: Optional[Handle] = None
        #: where the compressor's collectives run: the exchange's communicator, or across hosts
        self.comm = comm
        #: the elements ``[start, stop)`` of the group this rank compresses: all of them, or in
        #: the hierarchical scheme its shard of the host's sum (``compensated`` is then zero
        #: elsewhere)
        self.span = (0, group.numel)
        #: the stages :meth:`Exchange.advance` runs before :meth:`Exchange.finish` waits
        self.stages: List[Callable[["InFlight"], None]] = []
        #: the two-phase scheme's shards, while the group is in it
        self.sharded: Optional[Sharded] = None
        #: the hierarchical scheme's host level, while the group is in it
        self.hosts: Optional[hierarchy.Hosts] = None
        #: passes over the group's elements so far, by stage (:mod:`mergecomp.pipeline.breakdown`)
        self.passes: Dict[str, float] = {}

    def count(self, stage: str, passes: float, numel: Optional[int] = None) -> None:
        """Tally ``passes`` over ``numel`` of the group's elements (default: all of them) in
        ``stage`` (one of :data:`~mergecomp.pipeline.breakdown.STAGES`), as passes over the whole group."""
        total = self.group.numel
        if total and passes and numel != 0:
            self.passes[stage] = self.passes.get(stage, 0.0) + passes * (total if numel is None else numel) / total

    def describe(self) -> Dict[str, Any]:
        """The group as a step breakdown lists it (:meth:`~mergecomp.pipeline.breakdown.Breakdown.end_step`)."""
        return {"name": self.group.name, "codec": self.codec,
                "bytes": self.group.numel * self.compensated.element_size(),
                "passes_by_stage": {stage: self.passes[stage] for stage in STAGES if stage in self.passes}}


class Exchange(hierarchy.HostLevel):
    """Compress and communicate merged groups with one compressor and one memory.

    Besides the configured compressor (codec ``"compressed"``), a group may be sent with the
    codec ``"fp16"`` or ``"none"`` (a plain allreduce): the scheduler picks per group; or with
    ``"exempt"`` (a plain allreduce that bypasses the memory: exempt tensors, warm-up steps).

    Args:
        compressor: encodes each group's flat buffer.
        memory: error feedback, per group.
        comm: the engine.
        average: divide the sum over ranks by the world size (ignored by majority votes).
        check_finite: zero a group holding NaN/Inf before it reaches the memory or the
            compressor state, and report it through :attr:`InFlight.finite`.
        recycle: on a CPU engine, attach a :class:`~mergecomp.kernels.workspace.Workspace` to the
            codecs, so their full-size outputs are reused from step to step instead of being
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
        self.codecs: Dict[str, Compressor] = {"compressed": compressor}
        self.memory = memory
        self.comm = comm
        self.average = average
        self.check_finite = check_finite
        self.step = 0
        self.keep_state = keep_state
        self._kept: List[Tuple[Any, str, Any]] = []  # (state holder, group, what it kept)
        self.workspace = Workspace() if recycle and torch.device(comm.device).type == "cpu" else None
        compressor.workspace = self.workspace
        #: the two-phase scheme's second-stage residuals (and carries after a plan change)
        self.shard_memory = ShardMemory()
        self.second = compressor.second_phase()
        self.second.workspace = self.workspace
        self._layouts = ShardLayouts(self.second)
        #: the seconds each group spends in each part of the step (:mod:`mergecomp.pipeline.breakdown`)
        self.clock = Stopwatch()

    @classmethod
    def create(cls, compression, memory, comm: Communicator, average: bool = True,
               check_finite: bool = True, recycle: bool = True, keep_state: bool = False) -> "Exchange":
        """Build from names or instances (see :func:`resolve`)."""
        return cls(*resolve(compression, memory), comm, average=average, check_finite=check_finite,
                   recycle=recycle, keep_state=keep_state)

    def codec(self, name: str) -> Compressor:
        """The compressor behind codec ``name`` (``"compressed"``, ``"two-phase"``,
        ``"hierarchical"``, ``"hierarchical-two-phase"``, ``"fp16"``, ``"none"`` or ``"exempt"``)."""
        if name in SHARDED:
            if self.compressor.rounds > 1:
                raise ValueError(f"the {name} scheme needs a single-round compressor; "
                                 f"{self.compressor.name!r} takes {self.compressor.rounds} rounds")
            return self.compressor
        if name not in self.codecs:
            if name not in (*CODECS, EXEMPT):
                raise ValueError(f"codec must be one of {(*CODECS, *SHARDED, EXEMPT)}, got {name!r}")
            self.codecs[name] = get_compressor("none" if name == EXEMPT else name)
            self.codecs[name].workspace = self.workspace
        return self.codecs[name]

    def sent_as(self, codec: str) -> str:
        """The codec a group given ``codec`` travels with: a hierarchical codec becomes its flat
        counterpart (``"compressed"``, ``"two-phase"``) on one host or on hosts of one process,
        where the two agree.  The first hierarchical codec asks every rank for the hosts' layout
        (:meth:`~mergecomp.engines.communicator.Communicator.split_hosts`; every rank gets there at once)."""
        if codec in hierarchy.FLAT and hierarchy.across_hosts_of(self.comm) is None:
            return hierarchy.FLAT[codec]
        return codec

    def begin(self, group: Group, flat: torch.Tensor, codec: str = "compressed") -> Optional[FusedParts]:
        """Where ``group`` (sent with ``codec``; ``flat``: its buffer, not read) can be encoded
        tensor by tensor as its gradients arrive (:meth:`Compressor.compress_fused_parts`: the
        sign codes with the residual memory on fp32 CPU): its :class:`FusedParts`, for the caller
        to :meth:`~FusedParts.add` each gradient to and pass to :meth:`start`; the group's state
        is kept meanwhile (a part found not finite puts it back).  Else None: the caller fills
        ``flat`` and starts it."""
        name = group.name
        if (self.sent_as(codec) != "compressed" or group.numel == 0 or self.compressor.rounds != 1
                or self.shard_memory.has_carry(name)):
            return None
        if self.workspace is not None:
            self.workspace.advance(self.step)
        parts = self.compressor.compress_fused_parts(flat, name, len(group.indices), self.memory)
        if parts is not None and self.check_finite:
            holders = (self.memory, self.compressor, self.shard_memory) if self.keep_state else (self.memory,)
            parts.kept = [(holder, name, holder.keep(name)) for holder in holders]
        return parts

    def cancel(self, parts: FusedParts) -> None:
        """Put back the state ``parts`` (from :meth:`begin`, not started) kept."""
        for holder, name, kept in reversed(parts.kept):
            holder.restore(name, kept)
        parts.kept = []

    def start(self, group: Group, flat: torch.Tensor, codec: str = "compressed",
              finite: Optional[bool] = None, parts: Optional[FusedParts] = None) -> InFlight:
        """Compress ``flat`` (the group's gradients; modified in place) and start round 1.

        ``finite``: whether ``flat`` holds no NaN/Inf, when the caller already knows (e.g. from
        :func:`mergecomp.kernels.codecs.copy_finite` while filling it); None: checked here.  ``parts``:
        what :meth:`begin` gave, every gradient added (``finite``: whether all were; ``flat``
        then holds no gradients): its payload is sent, or, for a part not finite, the group's
        state is put back and the group goes on as one whose ``flat`` held NaN.
        """
        with self.clock(ENCODE, group.name):
            if self.workspace is not None:
                self.workspace.advance(self.step)
            codec = self.sent_as(codec)
            job = InFlight(group, codec, self.codec(codec), flat, self.comm)
            if parts is not None:
                if finite or not self.check_finite:
                    job.finite = flat.new_ones((), dtype=torch.bool)
                    self._kept += parts.kept if self.keep_state else []
                    job.owned = True
                    self._launch_fused(job, parts.finish())
                    return job
                self.cancel(parts)
                finite = False
            whole = codec not in hierarchy.FLAT and not (codec == TWO_PHASE and self.comm.size > 1)  # not in shards
            job.checked_by_encode = (finite is None and whole and self.check_finite and job.compressor.may_overflow
                                     and flat.device.type == "cpu" and (not job.feedback or self.memory.passthrough))
            job.finite = flat.new_ones((), dtype=torch.bool) if job.checked_by_encode else self._check(job, finite)
            if job.feedback:
                name = group.name
                if self.keep_state:
                    self._kept += [(holder, name, holder.keep(name))
                                   for holder in (self.memory, job.compressor, self.shard_memory)]
                carry = self.shard_memory.take_carry(name)
                if whole and carry is None and self._compress_fused(job):
                    return job
                self._compensate(job, carry)
            if codec in hierarchy.FLAT:
                self._reduce_in_host(job, codec == HIERARCHICAL_TWO_PHASE)
            elif not whole:
                self._scatter_shards(job)
                job.stages = [self._second_phase]
            else:
                self._compress(job)
            return job

    def _check(self, job: InFlight, finite: Optional[bool]) -> torch.Tensor:
        """0-d bool: whether ``job``'s gradient is finite (``finite``: known from its copy-in;
        None: one pass checks it); a non-finite gradient is zeroed."""
        flat = job.compensated
        if not self.check_finite:
            return flat.new_ones((), dtype=torch.bool)
        if finite is None:
            finite = _all_finite(flat)
            job.count("check", 1)
        else:
            finite = flat.new_tensor(bool(finite))
        if flat.device.type == "cpu":  # no device to sync with: branch instead of a full pass
            if not finite:
                flat.zero_()
        else:
            flat.masked_fill_(finite.logical_not(), 0)
            job.count("check", 1)
        return finite

    def _compensate(self, job: InFlight, carry: Optional[torch.Tensor]) -> None:
        """Fold the memory and ``carry`` (what a plan change left; None: nothing) into ``job``'s
        gradient."""
        name, memory = job.group.name, self.memory
        with self.clock(MEMORY, name):
            job.compensated = memory.compensate(job.compensated, name)
            job.count("compensate", memory.compensate_passes_of(name))
            if carry is not None:
                job.compensated.add_(carry)
                job.count("compensate", 1)

    def advance(self, job: InFlight) -> bool:
        """Run ``job``'s next stage between its first collective and its last: wait for the one
        in flight and start the next (the two-phase allgather; the hierarchical scheme's
        exchange across hosts, then its allgather inside the host).  Returns whether stages are
        left.  Callers advance every started group in plan order, and again while any has
        stages left, before finishing the first: every rank then starts each communicator's
        collectives in the same order."""
        if job.stages:
            with self.clock(DECODE, job.group.name):
                job.stages.pop(0)(job)
        return bool(job.stages)

    def finish(self, job: InFlight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Wait for ``job``, run its remaining stages and rounds, and return the reduced flat
        gradient.

        With ``out`` (flat, the group's numel and dtype; typically the buffer passed to
        :meth:`start`, whose contents are no longer needed) the result is written there and
        ``out`` is returned: the codec decodes straight into it when it takes its output from
        the workspace, else the result is copied in.
        """
        with self.clock(DECODE, job.group.name):
            while self.advance(job):
                pass
            if job.hosts is not None:
                return self._gather_hosts(job, out)
            return self._reduce(job, out)

    def commit(self) -> None:
        """The step's state changes stand (``keep_state``)."""
        self._kept = []

    def forget(self, names: Sequence[str]) -> None:
        """The memory of groups ``names`` starts afresh: their error-compensated gradient
        overflowed its payload (:attr:`InFlight.overflowed`), so the residual kept for them
        (whose last update holds Inf) would overflow the next step's payload again."""
        for name in names:
            self.memory.restore(name, {})

    def rollback(self) -> None:
        """Undo the memory and compressor state changes of the groups started since the last
        :meth:`commit` (``keep_state``), as if this step had not happened."""
        for holder, name, kept in reversed(self._kept):
            holder.restore(name, kept)
        self._kept = []

    def fold_shards(self, groups: Sequence[Group], codecs: Sequence[str]) -> None:
        """Before the plan changes away from ``groups``, last started with ``codecs``: turn each
        one's second-stage residual into a carry at its elements (:meth:`ShardMemory.fold`),
        which moves with them."""
        scale = self.comm.size if self.average else 1
        for group, codec in zip(groups, codecs):
            codec = self.sent_as(codec)
            if codec in (TWO_PHASE, HIERARCHICAL_TWO_PHASE):
                comm, span = self._level(group.numel, codec)
                start, _ = self._shards(comm, span)[comm.rank]
                self.shard_memory.fold(group.name, group.numel, start, scale)

    # -- internals ---------------------------------------------------------------------------
    def _what(self, job: InFlight, phase: str = "") -> str:
        step = f"the {phase} of" if phase else f"round {job.round} of"
        return (f"{step} group {job.group.name!r} ({len(job.group.indices)} tensors, "
                f"{job.group.numel} elements) at step {self.step} on rank {self.comm.rank}")

    def _level(self, numel: int, codec: str) -> Tuple[Communicator, Tuple[int, int]]:
        """Where a group of ``numel`` elements sent with ``codec`` (as :meth:`sent_as` gives it)
        is compressed: the communicator of its compressed collectives, and the elements this
        rank compresses (the hierarchical scheme: this local rank's shard, across hosts)."""
        if codec in hierarchy.FLAT:
            hosts = self._host_level(numel)
            return hosts.cross, hosts.span
        return self.comm, (0, numel)

    def _shards(self, comm: Communicator, span: Tuple[int, int]) -> Bounds:
        """The two-phase scheme's shards of the elements ``span`` on ``comm``."""
        start, stop = span
        return shard_bounds(stop - start, comm.size, self.compressor.shard_alignment, start)

    def _compress(self, job: InFlight) -> None:
        """Compress the elements of ``job.span`` and start the collective on ``job.comm``."""
        (start, stop), compensated = job.span, job.compensated
        job.count("encode", job.compressor.compress_passes, stop - start)
        finite = None
        if stop - start == compensated.numel():
            job.payload, job.ctx, finite = job.compressor.compress_checked(compensated, job.group.name,
                                                                           job.group.shapes)
        else:
            job.payload, job.ctx = job.compressor.compress_shard(compensated[start:stop], job.group.name, start,
                                                                 compensated.numel())
        if job.checked_by_encode or (job.compressor.may_overflow and self.check_finite and job.feedback
                                     and self.memory.feeds_back):
            if finite is None:
                finite = _all_finite(job.payload[0])
                job.count("check", 1, stop - start)
            job.overflowed = torch.as_tensor(finite, device=compensated.device).logical_not()
            if job.checked_by_encode and job.overflowed:  # on the CPU; a NaN/Inf gradient, or one beyond the cast
                job.finite = _all_finite(compensated)
                job.overflowed &= job.finite
                for t in job.payload:
                    t.zero_()
        self._launch(job)

    def _compress_fused(self, job: InFlight) -> bool:
        """Compensate and compress the whole of ``job.compensated`` (the gradient) by the
        compressor's fused encode (:meth:`Compressor.compress_fused`) and start the collective,
        where the compressor offers one for this memory; :meth:`_remember` then runs its update.
        Returns whether it did (``job.compensated`` stays the gradient as given)."""
        return self._launch_fused(job, job.compressor.compress_fused(job.compensated, job.group.name,
                                                                     job.group.shapes, self.memory))

    def _launch_fused(self, job: InFlight, fused: Optional[Tuple[Payload, Any, Callable[[], None]]]) -> bool:
        """Start ``job`` with a fused encode's ``(payload, ctx, update)``; None: returns False."""
        if fused is None:
            return False
        job.payload, job.ctx, job.update = fused
        job.count("encode", job.compressor.fused_compress_passes)
        self._launch(job)
        return True

    def _launch(self, job: InFlight) -> None:
        compressor = job.compressor
        last_round = job.round == compressor.rounds
        if compressor.summable:
            if last_round:
                # The allreduce sums in place: decode this rank's part for the memory first.
                self._remember(job)
            if len(job.payload) == 1:
                buffer = job.payload[0]
            else:
                buffer = torch.cat([t.reshape(-1) for t in job.payload])
            job.handle = job.comm.allreduce_async(buffer)
        else:
            buffer, job.specs = pack_payload(job.payload, borrow=job.owned)
            job.handle = job.comm.allgather_async(buffer)
            if last_round:
                self._remember(job)

    def _remember(self, job: InFlight) -> None:
        if job.update is not None:
            with self.clock(MEMORY, job.group.name):
                job.update()
                job.count("memory", job.compressor.fused_update_passes)
            job.update = None
        elif job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, job.group.name):
                job.count("memory", self.memory.feed(job.compressor, job.compensated, job.group.name, job.payload,
                                                     job.ctx, job.span[0]))

    def _scatter_shards(self, job: InFlight) -> None:
        """Phase 1 of the two-phase scheme on ``job.comm``: compress each shard of
        ``job.span``, start the all-to-all, feed the first-stage memory."""
        compressor, compensated, name, comm = job.compressor, job.compensated, job.group.name, job.comm
        numel = compensated.numel()
        bounds = self._shards(comm, job.span)
        job.count("encode", compressor.compress_passes, job.span[1] - job.span[0])
        shards = [compressor.compress_shard(compensated[a:b], name, a, numel) for a, b in bounds]
        rows, specs = pack_rows([payload for payload, _ in shards])
        job.sharded = Sharded.create(bounds, shards[comm.rank][1], specs[comm.rank], self._layouts, compensated)
        job.handle = comm.alltoall_async(rows.reshape(-1))
        if job.feedback and self.memory.feeds_back:
            with self.clock(MEMORY, name):
                job.count("memory", self.memory.feed_parts(
                    compressor, compensated, name,
                    [(payload, ctx, start) for (payload, ctx), (start, _) in zip(shards, bounds)]))

    def _second_phase(self, job: InFlight) -> None:
        """Phase 2 of the two-phase scheme: wait for the all-to-all, aggregate this rank's
        shard, feed the second-stage memory and start the allgather of its compressed aggregate."""
        sharded, compressor, name, second = job.sharded, job.compressor, job.group.name, self.second
        rows = self._collected(job, "all-to-all")
        arrived = [unpack_payload(row, sharded.specs) for row in rows]
        total = compressor.aggregate(arrived, sharded.ctx, self.comm.size, self.average)
        shard = total.numel()
        job.count("decode", compressor.aggregate_passes(len(arrived), self.average), shard)
        feedback = job.feedback and self.memory.feeds_back and not isinstance(second, VoteCodec)
        compensated = total
        if feedback:
            with self.clock(MEMORY, name):
                compensated = self.shard_memory.compensate(total, name)
                job.count("compensate", self.shard_memory.compensate_passes, shard)
        with self.clock(ENCODE, name):
            payload, ctx = second.compress(compensated, name)
            job.count("encode", second.compress_passes, shard)
            raw, _ = pack_payload(payload)
            job.handle = job.comm.allgather_async(sharded.pad(raw))
        if feedback:
            with self.clock(MEMORY, name):
                job.count("memory", self.shard_memory.feed(second, compensated, name, payload, ctx), shard)

    def _reduce(self, job: InFlight, out: Optional[torch.Tensor]) -> torch.Tensor:
        """Wait for the collective on ``job.comm`` (and run any later rounds) and return the
        aggregate of ``job.span``: in ``out`` when given, else in the codec's scratch."""
        if job.sharded is not None:
            return self._gather_shards(job, out)
        compressor, size = job.compressor, self.comm.size
        while True:
            arrived = self._wait(job)
            if job.round == compressor.rounds:
                start, stop = job.span
                job.count("decode", compressor.aggregate_passes(len(arrived), self.average), stop - start)
                return self._into(job, out, compressor.aggregate, arrived, job.ctx, size, self.average)
            with self.clock(ENCODE, job.group.name):
                job.payload, job.ctx = compressor.next_round(arrived[0], job.ctx)
                job.count("encode", compressor.next_round_passes)
                job.round += 1
                self._launch(job)

    def _into(self, job: InFlight, out: Optional[torch.Tensor], decode: Callable[..., torch.Tensor],
              *args) -> torch.Tensor:
        """``decode(*args)``, in ``out`` when given: the codec decodes straight into it when it
        takes its output from the workspace, else the result is copied there (``copy-out``)."""
        lend = (self.workspace.serving(out) if out is not None and self.workspace is not None
                else contextlib.nullcontext())
        with lend:
            result = decode(*args)
        if out is not None and result.data_ptr() != out.data_ptr():
            result = out.copy_(result)
            job.count("copy-out", 1, out.numel())
        return result

    def _gather_shards(self, job: InFlight, out: Optional[torch.Tensor]) -> torch.Tensor:
        """Phase 2's end: decode every rank's aggregated shard into the aggregate of ``job.span``."""
        rows = self._collected(job, "allgather")
        sharded, second, like = job.sharded, self.second, job.compensated
        offset, end = job.span
        result = out if out is not None else job.compressor.scratch(end - offset, like.dtype, like.device)
        for row, (start, stop), (ctx, specs) in zip(rows, sharded.bounds, sharded.layouts):
            job.count("decode", second.decompress_passes, stop - start)
            self._into(job, result[start - offset:stop - offset], second.decompress, unpack_payload(row, specs), ctx)
        job.sharded = None
        return result

    def _collected(self, job: InFlight, phase: str = ""):
        """Wait for ``job``'s collective in flight (the ``wait`` part) and return its result."""
        with self.clock(WAIT, job.group.name):
            return job.handle.wait(self._what(job, phase))

    def _wait(self, job: InFlight) -> List[Payload]:
        result = self._collected(job)
        if job.compressor.summable:
            if len(job.payload) == 1:
                return [(result,)]
            parts, offset = [], 0
            for t in job.payload:
                parts.append(result[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            return [tuple(parts)]
        return [unpack_payload(row, job.specs) for row in result]

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "compressor": self.compressor.state_dict(),
                "memory": self.memory.state_dict(), "shard_memory": self.shard_memory.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        self.shard_memory.load_state_dict(state.get("shard_memory", {}))


#: why a group is a culprit of :class:`NonfiniteCheck` (bits of its flag)
NONFINITE_GRADIENT, OVERFLOWED = 1, 2


class NonfiniteCheck:
    """Agree across ranks on which (rank, group) pairs held NaN/Inf this step, and why.

    ``jobs``: this step's groups, in plan order (the same on every rank); a group is a culprit
    when its gradient was not finite (:attr:`InFlight.finite`) or its payload overflowed
    (:attr:`InFlight.overflowed`).  One small allreduce of a ``(size, groups)`` int32 matrix of
    those bits, started now; :meth:`culprits` waits and gives the same answer on every rank.
    """

    def __init__(self, comm: Communicator, jobs: Sequence[InFlight], step: int) -> None:
        device = jobs[0].finite.device if jobs else torch.device("cpu")
        flags = torch.zeros(comm.size, len(jobs), dtype=torch.int32, device=device)
        if jobs:
            row = torch.stack([job.finite for job in jobs]).logical_not().to(torch.int32) * NONFINITE_GRADIENT
            checked = [g for g, job in enumerate(jobs) if job.overflowed is not None]  # casts' payloads only
            if checked:
                row[checked] += OVERFLOWED * torch.stack([jobs[g].overflowed for g in checked]).to(torch.int32)
            flags[comm.rank] = row
        self._what = f"non-finite gradient check at step {step} on rank {comm.rank}"
        self._handle = comm.allreduce_async(flags)

    def culprits(self, names: Sequence[str]) -> List[Tuple[int, str, int]]:
        """``(rank, group name, bits)`` of every culprit (:data:`NONFINITE_GRADIENT`, :data:`OVERFLOWED`)."""
        flags = self._handle.wait(self._what).cpu()
        return [(rank, names[g], int(flags[rank, g])) for rank, g in flags.nonzero().tolist()]
