"""One merged group's trip through compression and communication, framework-agnostic.

:class:`Exchange` chains, for each group::

    check finite -> memory.compensate -> compressor.compress -> collective (async)
                 -> memory.update          ...later: wait -> [next rounds] -> aggregate

A group sent with the codec :data:`~mergecomp.plan.TWO_PHASE` goes compensate -> compress
each shard -> all-to-all -> aggregate its own shard -> second-stage memory -> compress ->
allgather -> decode (:mod:`mergecomp.twophase`); :meth:`Exchange.advance` runs the middle part.

A group sent with the codec :data:`~mergecomp.plan.EXEMPT` skips the memory: its gradient is
allreduced as it is, and neither the memory nor the compressor state of any group changes.

``start`` returns an :class:`InFlight` right after the first collective is issued; ``finish``
waits for it, runs any further rounds, and returns the reduced flat gradient.  All collectives
of a step must be started in the same order on every rank: callers start groups in plan order,
and a multi-round compressor's later rounds are issued from ``finish``, again in plan order.

Allgathered payloads travel as one byte buffer per group (one collective, not one per payload
tensor; :mod:`mergecomp.wire`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .comm import Communicator, Handle
from .compressor import Compressor, Payload
from .memory import Memory
from .plan import CODECS, EXEMPT, TWO_PHASE, Group
from .registry import get_compressor, get_memory
from .twophase import Sharded, ShardLayouts, ShardMemory, VoteCodec, feed_shards, shard_bounds
from .wire import Spec, pack_payload, pack_rows, unpack_payload
from .workspace import Workspace

__all__ = ["Exchange", "InFlight", "NONFINITE_POLICIES", "NonfiniteCheck", "resolve"]

NONFINITE_POLICIES = ("propagate", "raise", "skip", "ignore")
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

    def __init__(self, group: Group, compressor: Compressor, compensated: torch.Tensor,
                 finite: torch.Tensor, feedback: bool = True) -> None:
        self.group = group
        self.compressor = compressor
        self.compensated = compensated
        self.finite = finite
        self.feedback = feedback  # the error-feedback memory takes part
        self.round = 1
        self.ctx: Any = None
        self.payload: Payload = ()
        self.specs: Optional[List[Spec]] = None
        self.handle: Optional[Handle] = None
        #: the two-phase scheme's shards, while the group is in it
        self.sharded: Optional[Sharded] = None
        #: seconds spent encoding (compensate, compress, start) and decoding on this process
        self.encode_seconds = 0.0
        self.decode_seconds = 0.0


class Exchange:
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
        recycle: on a CPU engine, attach a :class:`~mergecomp.workspace.Workspace` to the
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

    @classmethod
    def create(cls, compression, memory, comm: Communicator, average: bool = True,
               check_finite: bool = True, recycle: bool = True, keep_state: bool = False) -> "Exchange":
        """Build from names or instances (see :func:`resolve`)."""
        return cls(*resolve(compression, memory), comm, average=average, check_finite=check_finite,
                   recycle=recycle, keep_state=keep_state)

    def codec(self, name: str) -> Compressor:
        """The compressor behind codec ``name`` (``"compressed"``, ``"two-phase"``, ``"fp16"``,
        ``"none"`` or ``"exempt"``)."""
        if name == TWO_PHASE:
            if self.compressor.rounds > 1:
                raise ValueError(f"the two-phase scheme needs a single-round compressor; "
                                 f"{self.compressor.name!r} takes {self.compressor.rounds} rounds")
            return self.compressor
        if name not in self.codecs:
            if name not in (*CODECS, EXEMPT):
                raise ValueError(f"codec must be one of {(*CODECS, TWO_PHASE, EXEMPT)}, got {name!r}")
            self.codecs[name] = get_compressor("none" if name == EXEMPT else name)
            self.codecs[name].workspace = self.workspace
        return self.codecs[name]

    def start(self, group: Group, flat: torch.Tensor, codec: str = "compressed",
              finite: Optional[bool] = None) -> InFlight:
        """Compress ``flat`` (the group's gradients; modified in place) and start round 1.

        ``finite``: whether ``flat`` holds no NaN/Inf, when the caller already knows (e.g. from
        :func:`mergecomp.codecs.copy_finite` while filling it); None: checked here.
        """
        began = time.perf_counter()
        if self.workspace is not None:
            self.workspace.advance(self.step)
        compressor = self.codec(codec)
        if not self.check_finite:
            finite = flat.new_ones((), dtype=torch.bool)
        else:
            finite = _all_finite(flat) if finite is None else flat.new_tensor(bool(finite))
            if flat.device.type == "cpu":  # no device to sync with: branch instead of a full pass
                if not finite:
                    flat.zero_()
            else:
                flat.masked_fill_(finite.logical_not(), 0)
        feedback = codec != EXEMPT
        name = group.name
        if self.keep_state and feedback:
            self._kept += [(holder, name, holder.keep(name)) for holder in (self.memory, compressor, self.shard_memory)]
        compensated = flat
        if feedback:
            compensated = self.memory.compensate(flat, name)
            carry = self.shard_memory.take_carry(name)
            if carry is not None:
                compensated.add_(carry)
        job = InFlight(group, compressor, compensated, finite, feedback)
        if codec == TWO_PHASE and self.comm.size > 1:
            self._scatter_shards(job)
        else:
            job.payload, job.ctx = compressor.compress(compensated, name, group.shapes)
            self._launch(job)
        job.encode_seconds = time.perf_counter() - began
        return job

    def advance(self, job: InFlight) -> None:
        """A two-phase group whose all-to-all was started: wait for it, aggregate this rank's
        shard and start the allgather (nothing for other groups, or when done already).
        Callers advance every started group, in plan order, before finishing the first."""
        sharded = job.sharded
        if sharded is None or sharded.gathering:
            return
        began = time.perf_counter()
        rows = job.handle.wait(self._what(job, "all-to-all"))
        arrived = [unpack_payload(row, sharded.specs) for row in rows]
        total = job.compressor.aggregate(arrived, sharded.ctx, self.comm.size, self.average)
        name, second = job.group.name, self.second
        feedback = job.feedback and self.memory.feeds_back and not isinstance(second, VoteCodec)
        compensated = self.shard_memory.compensate(total, name) if feedback else total
        payload, ctx = second.compress(compensated, name)
        raw, _ = pack_payload(payload)
        job.handle = self.comm.allgather_async(sharded.pad(raw))
        sharded.gathering = True
        if feedback:
            self.shard_memory.feed(second, compensated, name, payload, ctx)
        job.decode_seconds += time.perf_counter() - began

    def finish(self, job: InFlight, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Wait for ``job``, run its remaining rounds, and return the reduced flat gradient.

        With ``out`` (flat, the group's numel and dtype; typically the buffer passed to
        :meth:`start`, whose contents are no longer needed) the result is written there and
        ``out`` is returned: the codec decodes straight into it when it takes its output from
        the workspace, else the result is copied in.
        """
        compressor, size = job.compressor, self.comm.size
        if job.sharded is not None:
            return self._gather_shards(job, out)
        while True:
            arrived = self._wait(job)
            if job.round == compressor.rounds:
                began = time.perf_counter()
                lend = (self.workspace.serving(out) if out is not None and self.workspace is not None
                        else contextlib.nullcontext())
                with lend:
                    result = compressor.aggregate(arrived, job.ctx, size, self.average)
                if out is not None and result.data_ptr() != out.data_ptr():
                    result = out.copy_(result)
                job.decode_seconds += time.perf_counter() - began
                return result
            job.payload, job.ctx = compressor.next_round(arrived[0], job.ctx)
            job.round += 1
            self._launch(job)

    def commit(self) -> None:
        """The step's state changes stand (``keep_state``)."""
        self._kept = []

    def rollback(self) -> None:
        """Undo the memory and compressor state changes of the groups started since the last
        :meth:`commit` (``keep_state``), as if this step had not happened."""
        for holder, name, kept in reversed(self._kept):
            holder.restore(name, kept)
        self._kept = []

    def fold_shards(self, groups: Sequence[Group]) -> None:
        """Before the plan changes away from ``groups``: turn each one's second-stage residual
        into a carry at its elements (:meth:`ShardMemory.fold`), which moves with them."""
        size, align = self.comm.size, self.compressor.shard_alignment
        for group in groups:
            self.shard_memory.fold(group.name, group.numel, shard_bounds(group.numel, size, align),
                                   self.comm.rank, size if self.average else 1)

    # -- internals ---------------------------------------------------------------------------
    def _what(self, job: InFlight, phase: str = "") -> str:
        step = f"the {phase} of" if phase else f"round {job.round} of"
        return (f"{step} group {job.group.name!r} ({len(job.group.indices)} tensors, "
                f"{job.group.numel} elements) at step {self.step} on rank {self.comm.rank}")

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
            job.handle = self.comm.allreduce_async(buffer)
        else:
            buffer, job.specs = pack_payload(job.payload)
            job.handle = self.comm.allgather_async(buffer)
            if last_round:
                self._remember(job)

    def _remember(self, job: InFlight) -> None:
        if job.feedback and self.memory.feeds_back:
            self.memory.feed(job.compressor, job.compensated, job.group.name, job.payload, job.ctx)

    def _scatter_shards(self, job: InFlight) -> None:
        """Phase 1 of the two-phase scheme: compress each shard, start the all-to-all, feed the
        first-stage memory."""
        compressor, compensated, name = job.compressor, job.compensated, job.group.name
        numel, rank = compensated.numel(), self.comm.rank
        bounds = shard_bounds(numel, self.comm.size, compressor.shard_alignment)
        shards = [compressor.compress_shard(compensated[a:b], name, a, numel) for a, b in bounds]
        rows, specs = pack_rows([payload for payload, _ in shards])
        job.sharded = Sharded.create(bounds, shards[rank][1], specs[rank], self._layouts, compensated)
        job.handle = self.comm.alltoall_async(rows.reshape(-1))
        if job.feedback and self.memory.feeds_back:
            feed_shards(self.memory, compressor, shards, bounds, compensated, name)

    def _gather_shards(self, job: InFlight, out: Optional[torch.Tensor]) -> torch.Tensor:
        """Phase 2's end: decode every rank's aggregated shard into the group's result."""
        self.advance(job)
        rows = job.handle.wait(self._what(job, "allgather"))
        began = time.perf_counter()
        sharded, second = job.sharded, self.second
        result = out if out is not None else job.compressor.scratch(job.compensated.numel(), job.compensated.dtype,
                                                                     job.compensated.device)
        for row, (start, stop), (ctx, specs) in zip(rows, sharded.bounds, sharded.layouts):
            target = result[start:stop]
            lend = self.workspace.serving(target) if self.workspace is not None else contextlib.nullcontext()
            with lend:
                decoded = second.decompress(unpack_payload(row, specs), ctx)
            if decoded.data_ptr() != target.data_ptr():
                target.copy_(decoded)
        job.sharded = None
        job.decode_seconds += time.perf_counter() - began
        return result

    def _wait(self, job: InFlight) -> List[Payload]:
        result = job.handle.wait(self._what(job))
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


class NonfiniteCheck:
    """Agree across ranks on which (rank, group) pairs held NaN/Inf this step.

    ``finite`` holds one 0-d bool tensor per group, in plan order (the same on every rank).
    One small allreduce of a ``(size, groups)`` matrix, started now; :meth:`culprits` waits and
    gives the same answer on every rank.
    """

    def __init__(self, comm: Communicator, finite: Sequence[torch.Tensor], step: int) -> None:
        device = finite[0].device if finite else torch.device("cpu")
        flags = torch.zeros(comm.size, len(finite), dtype=torch.int32, device=device)
        if finite:
            flags[comm.rank] = torch.stack([f.logical_not() for f in finite]).to(torch.int32)
        self._what = f"non-finite gradient check at step {step} on rank {comm.rank}"
        self._handle = comm.allreduce_async(flags)

    def culprits(self, names: Sequence[str]) -> List[Tuple[int, str]]:
        flags = self._handle.wait(self._what)
        return [(rank, names[g]) for rank, g in flags.nonzero().tolist()]
