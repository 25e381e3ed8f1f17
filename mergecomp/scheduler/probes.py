"""What the scheduler's cost model is fitted on: the real exchange of probe groups, timed, and the
record the ranks agree on.

:func:`probe_sizes` picks the gradient sizes to time.  :func:`rehearse` runs the exchange itself
(:class:`~mergecomp.exchange.exchange.Exchange` and the group's scheme, the same code a training
step runs) on a probe group of each size over a :class:`Rehearsal`: a communicator that stands
for ranks which all send what this process sends, and answers at once.  It times the exchange's
own work (before the first collective, between its collectives, after the last) and records
the collectives the scheme issued; :func:`replay` times those on the real communicators.
:func:`measure` does both for every codec of a profile step into a :class:`Measurements`
record; :meth:`Measurements.agree` gives every rank the same record, the slowest rank's number
everywhere, with one allgather; :meth:`Measurements.cost_profile` turns it into the
:class:`~mergecomp.scheduler.costmodel.Profile` the search runs on.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.capabilities import shard_alignment
from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.compressors.memories import NoMemory
from mergecomp.engines.communicator import Communicator, Handle
from mergecomp.exchange.exchange import Exchange
from mergecomp.exchange.plan import Group
from mergecomp.exchange.schemes import SCHEMES
from mergecomp.scheduler.clock import settle
from mergecomp.scheduler.costmodel import CodecCost, Profile, fit_affine

__all__ = ["Call", "CodecProbe", "Measurements", "Rehearsal", "Rehearsed", "exchange_within", "exchanges_within",
           "measure", "probe_sizes", "rehearse", "replay", "replay_within"]

#: the name of the probe group in the compressor's and the memory's state while it is timed
PROBE = "__scheduler_probe__"


def probe_sizes(sizes: Sequence[int]) -> List[Tuple[int, int]]:
    """(bytes, number of leading tensors) for the first tensor and prefixes of about 1/16, 1/4
    and all of ``sizes``: the small one pins the per-call cost, the large ones the per-byte cost."""
    total = sum(sizes)
    out, prefix, count = [], 0, 0
    for fraction in (0.0, 1 / 16, 1 / 4, 1.0):
        while count < len(sizes) and (prefix < total * fraction or count == 0):
            prefix += sizes[count]
            count += 1
        if not out or out[-1][1] != count:
            out.append((prefix, count))
    return out


class Call(NamedTuple):
    """One collective a scheme issued: on which communicator (``"world"``, or ``"local"`` and
    ``"cross"`` of :meth:`~mergecomp.engines.communicator.Communicator.split_hosts`), which
    operation, and this rank's tensor's numel and dtype."""

    level: str
    op: str
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class Rehearsal(Communicator):
    """``size`` ranks in hosts of ``per_host`` that all send what this process (rank 0) sends:
    every collective returns at once what rank 0 would receive, and is recorded in ``calls``
    (:class:`Call`).  An allreduce leaves its tensor as it is (the sum's values do not change
    the work that follows), an allgather gives ``size`` rows of this rank's tensor, an
    all-to-all ``size`` rows of its first block."""

    engine = "rehearsal"

    def __init__(self, size: int, device: torch.device, per_host: int = 1, level: str = "world",
                 calls: Optional[List[Call]] = None) -> None:
        super().__init__(0, size, timeout=1.0)
        self.device = torch.device(device)
        self.per_host = per_host
        self.level = level
        self.calls: List[Call] = [] if calls is None else calls

    def _record(self, op: str, tensor: torch.Tensor, result: torch.Tensor) -> Handle:
        self.calls.append(Call(self.level, op, tensor.numel(), tensor.dtype))
        return Handle(lambda _: result, self.timeout)

    def allreduce_async(self, tensor: torch.Tensor) -> Handle:
        return self._record("allreduce", tensor, tensor)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        return self._record("allgather", tensor, tensor.reshape(1, -1).expand(self.size, -1))

    def alltoall_async(self, tensor: torch.Tensor) -> Handle:
        block = self._block(tensor)
        return self._record("alltoall", tensor, tensor[:block].reshape(1, block).expand(self.size, block))

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        return tensor

    def split_hosts(self) -> Tuple[Communicator, Communicator]:
        if self._hosts is None:
            if self.per_host in (1, self.size):
                one = Rehearsal(1, self.device, level="local" if self.per_host == 1 else "cross", calls=self.calls)
                self._hosts = (one, self) if self.per_host == 1 else (self, one)
            else:
                self._hosts = (Rehearsal(self.per_host, self.device, self.per_host, "local", self.calls),
                               Rehearsal(self.size // self.per_host, self.device, 1, "cross", self.calls))
        return self._hosts


@dataclass
class Rehearsed:
    """A codec's exchange of each probe size on one rank: seconds of its work before its first
    collective (``encode``), between its collectives (``middle``) and after its last
    (``decode``); the collectives it issued for each size; and ``ratio``, the bytes of its last
    collective that is not inside a host (its last round's or phase's payload) per gradient byte."""

    encode: List[float]
    middle: List[float]
    decode: List[float]
    calls: List[List[Call]]
    ratio: float


def rehearse(compressor: Compressor, memory: Optional[Memory], codec: str, samples: Sequence[Tuple[int, int]],
             shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, world_size: int,
             per_host: int = 1) -> Rehearsed:
    """The exchange of a group sent with ``codec`` (``compressor`` configured, ``memory`` None:
    no error feedback) on ``world_size`` ranks in hosts of ``per_host``, for random gradients
    of each ``(bytes, leading tensor count)`` sample (of the leading ``shapes``; a sample cut in
    shards gets a numel that divides into equal shards and one flat shape).

    Timed in steady state, as training runs: each sample runs once untimed first, then once
    (large) or twice (small, the faster kept), each run one step of the rehearsal exchange's own
    workspace, so the timed runs reuse scratch instead of touching fresh pages.  The compressor
    and the memory keep no state of the probe group, and the compressor gets its workspace back.
    """
    comm = Rehearsal(world_size, device, per_host)
    attached = compressor.workspace
    exchange = Exchange(compressor, memory or NoMemory(), comm)
    element = torch.empty((), dtype=dtype).element_size()
    unit = world_size * shard_alignment(compressor) if codec in SCHEMES and SCHEMES[codec].sharded else 1
    generator = torch.Generator(device="cpu").manual_seed(0)
    encode, middle, decode, calls, ratio = [], [], [], [], 1.0
    try:
        for nbytes, count in samples:
            numel = max(1, nbytes // element)
            group_shapes = list(shapes[:count])
            if numel % unit or sum(math.prod(s) for s in group_shapes) != numel:
                numel, group_shapes = max(unit, numel // unit * unit), [torch.Size([max(unit, numel // unit * unit)])]
            group = Group(PROBE, tuple(range(len(group_shapes))), tuple(itertools.accumulate(
                [0] + [math.prod(s) for s in group_shapes[:-1]])), tuple(group_shapes), numel)
            data = torch.randn(numel, generator=generator).to(dtype=dtype, device=device)
            runs = []
            for _ in range(1 + (2 if nbytes < 2**22 else 1)):  # small calls are noisy: keep the faster
                del comm.calls[:]
                runs.append(_timed_exchange(exchange, group, data.clone(), codec, device))
                exchange.end_step()
                for holder in exchange.holders().values():
                    holder.state.pop(PROBE, None)
            runs = runs[1:]  # the first run warmed the pool and caches
            encode.append(min(r[0] for r in runs))
            middle.append(min(r[1] for r in runs))
            decode.append(min(r[2] for r in runs))
            calls.append(list(comm.calls))
            ratio = next(c for c in reversed(comm.calls) if c.level != "local").nbytes / max(nbytes, 1)
    finally:
        compressor.workspace = attached
    return Rehearsed(encode, middle, decode, calls, ratio)


def _timed_exchange(exchange: Exchange, group: Group, flat: torch.Tensor, codec: str,
                    device: torch.device) -> Tuple[float, float, float]:
    """Seconds of ``exchange``'s start, its stages, and its finish of ``group`` from ``flat``."""
    settle(device)
    began = time.perf_counter()
    job = exchange.start(group, flat, exchange.route(codec), finite=True)
    settle(device)
    started = time.perf_counter()
    while exchange.advance(job):
        pass
    settle(device)
    advanced = time.perf_counter()
    exchange.finish(job)
    settle(device)
    return started - began, advanced - started, time.perf_counter() - advanced


def replay(comm: Communicator, calls: Sequence[Call], device: torch.device) -> Tuple[float, float]:
    """Wall seconds of the collectives ``calls`` on ``comm`` (and its :meth:`split_hosts`
    communicators), each waited for before the next, and the CPU seconds this process spent
    meanwhile (the engine's threads; waiting does not spin): the faster of two runs (the first
    may pay for connections and buffers).  A collective: every rank replays the same calls."""
    levels = {"world": comm}
    if any(call.level != "world" for call in calls):
        levels["local"], levels["cross"] = comm.split_hosts()
    started = [(getattr(levels[call.level], f"{call.op}_async"), torch.zeros(call.numel, dtype=call.dtype,
                                                                              device=device)) for call in calls]

    def run() -> None:
        for start, tensor in started:
            start(tensor).wait("scheduler network probe")

    return _fastest(run, device)


def replay_within(comm: Communicator, calls_by_size: Sequence[Sequence[Call]], device: torch.device,
                  budget: float) -> List[Tuple[float, float]]:
    """:func:`replay` of each probe size's ``calls`` (ascending sizes), the slowest rank's
    ``(wall, CPU)`` seconds on every rank, while the affine fit over the bytes sent of the sizes
    replayed so far (two at least) puts the next one within ``budget`` seconds; that size and
    the larger ones get the fit's seconds instead.  On a 10 Mbit/s link a 14 MB fp32 group's
    allreduce takes 11 s, and each size is replayed twice.  A collective: every rank decides
    alike from the same agreed numbers."""
    sent = [float(sum(call.nbytes for call in calls)) for calls in calls_by_size]
    timed: List[Tuple[float, float]] = []
    for k, calls in enumerate(calls_by_size):
        if k >= 2:
            wall, cpu = (fit_affine(sent[:k], [t[i] for t in timed]) for i in (0, 1))
            if wall(sent[k]) > budget:
                return timed + [(wall(nbytes), cpu(nbytes)) for nbytes in sent[k:]]
        own = torch.tensor(replay(comm, calls, device), dtype=torch.float64, device=device)
        wall_s, cpu_s = comm.allgather(own, "scheduler network probe").max(dim=0).values.tolist()
        timed.append((wall_s, cpu_s))
    return timed


def exchanges_within(comm: Communicator, compressor: Compressor, codec: str, sizes: Sequence[int],
                     dtype: torch.dtype, device: torch.device, budget: float) -> Dict[int, Tuple[float, float]]:
    """``{numel: (own work, collectives)}`` seconds of the exchange of one flat group of each of
    ``sizes`` elements of ``dtype`` sent with plan codec ``codec`` of ``compressor``'s exchange (no
    error feedback) on ``comm``'s ranks: :func:`measure` at 1/64 and 1/8 of the smallest and at
    each size (a size the affine fit puts beyond ``budget`` seconds gets the fit's,
    :func:`replay_within`), agreed (:meth:`Measurements.agree`: the slowest rank's, the same on
    every rank); the work between collectives counts with them, as in the scheduler's profile.
    A collective: every rank calls it with the same arguments."""
    element = torch.empty((), dtype=dtype).element_size()
    smallest = min(sizes)
    numels = sorted({max(1, smallest // 64), max(1, smallest // 8), *sizes})
    probe = measure(comm, compressor, [codec], [(n * element, 1) for n in numels], [], dtype, device, [], 0.0,
                    budget=budget).agree(comm, device).codecs[codec]
    return {n: (probe.encode[i] + probe.decode[i], probe.network[i]) for i, n in enumerate(numels) if n in sizes}


def exchange_within(comm: Communicator, compressor: Compressor, codec: str, numel: int, dtype: torch.dtype,
                    device: torch.device, budget: float) -> Tuple[float, float]:
    """:func:`exchanges_within` of the one size ``numel``."""
    return exchanges_within(comm, compressor, codec, [numel], dtype, device, budget)[numel]


def _fastest(run: Callable[[], None], device: torch.device) -> Tuple[float, float]:
    """``(wall, CPU)`` seconds of the faster of two calls of ``run``."""
    times = []
    for _ in range(2):
        settle(device)
        began, began_cpu = time.perf_counter(), time.process_time()
        run()
        settle(device)
        times.append((time.perf_counter() - began, time.process_time() - began_cpu))
    return min(times)


@dataclass
class CodecProbe:
    """One codec at the probe sizes: its wire/input byte ratio (the x-axis of its network fit),
    and seconds per size to encode, to decode, and of its collectives with the work between them
    (wall time, and this process's CPU time)."""

    ratio: float
    encode: List[float]
    decode: List[float]
    network: List[float]
    network_cpu: List[float]


@dataclass
class Measurements:
    """What one rank measured in a profile step.

    Attributes:
        ready: seconds from the first gradient to each tensor's, in backward order.
        codecs: each codec's probe, in the same order on every rank.
        step_seconds: the wall time of the profiled step.
    """

    ready: List[float]
    codecs: Dict[str, CodecProbe]
    step_seconds: float

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        """Every number, flat, in field order (float64)."""
        return torch.tensor(_numbers(self), dtype=torch.float64, device=device)

    def from_tensor(self, flat: torch.Tensor) -> "Measurements":
        """The record laid out like this one that holds ``flat``: the inverse of :meth:`to_tensor`."""
        expected = len(_numbers(self))
        if flat.numel() != expected:
            raise ValueError(f"{flat.numel()} numbers do not fill a record of {expected}")
        return _refill(self, iter(flat.tolist()))

    def agree(self, comm: Communicator, device: torch.device) -> "Measurements":
        """Every number's maximum over ranks, so that every rank gets the same record (one
        allgather: every rank calls it, with a record of the same layout)."""
        gathered = comm.allgather(self.to_tensor(device), "scheduler profile")
        return self.from_tensor(gathered.max(dim=0).values)

    def cost_profile(self, sizes: Sequence[int], sample_bytes: Sequence[int]) -> Profile:
        """The cost model's inputs for gradients of ``sizes`` bytes (backward order) that were
        probed at ``sample_bytes``: ready times made non-decreasing (gradients become ready in
        backward order) and each codec's affine fits (the network's over payload bytes)."""
        costs = {}
        for name, probe in self.codecs.items():
            payload = [b * probe.ratio for b in sample_bytes]
            costs[name] = CodecCost(probe.ratio, fit_affine(sample_bytes, probe.encode),
                                    fit_affine(sample_bytes, probe.decode), fit_affine(payload, probe.network),
                                    fit_affine(payload, probe.network_cpu))
        return Profile(list(sizes), list(itertools.accumulate(self.ready, max)), costs)


def _numbers(record) -> List[float]:
    """The numbers of a record (a dataclass, a dict of them, a list of numbers or a number)."""
    if isinstance(record, (int, float)):
        return [record]
    if isinstance(record, list):
        return list(record)
    if isinstance(record, dict):
        return [x for value in record.values() for x in _numbers(value)]
    return [x for f in dataclasses.fields(record) for x in _numbers(getattr(record, f.name))]


def _refill(record, numbers: Iterator[float]):
    """``record`` with its numbers replaced by the next ones of ``numbers`` (see :func:`_numbers`)."""
    if isinstance(record, (int, float)):
        return next(numbers)
    if isinstance(record, list):
        return [next(numbers) for _ in record]
    if isinstance(record, dict):
        return {key: _refill(value, numbers) for key, value in record.items()}
    return type(record)(**{f.name: _refill(getattr(record, f.name), numbers) for f in dataclasses.fields(record)})


def measure(comm: Communicator, compressor: Compressor, codecs: Sequence[str], samples: Sequence[Tuple[int, int]],
            shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, ready: Sequence[float],
            step_seconds: float, memory: Optional[Memory] = None, budget: float = math.inf) -> Measurements:
    """This rank's record of a profile step: its ``ready`` times and ``step_seconds``, and each
    of ``codecs`` (plan codecs of the exchange of ``compressor`` and ``memory``) rehearsed on
    ``samples`` (see :func:`probe_sizes`, :func:`rehearse`) on ``comm``'s ranks and hosts, its
    collectives then replayed on ``comm`` (:func:`replay`; the work between them counts as
    network time; a size longer than ``budget`` seconds is predicted, see :func:`replay_within`).
    Every codec is rehearsed before the first collective runs; the collectives run in the order
    of ``codecs``, which must be the same on every rank."""
    hierarchical = any(SCHEMES[name].fallback is not None for name in codecs if name in SCHEMES)
    per_host = comm.split_hosts()[0].size if hierarchical else 1
    rehearsed = {name: rehearse(compressor, memory, name, samples, shapes, dtype, device, comm.size, per_host)
                 for name in codecs}
    probes = {}
    for name, run in rehearsed.items():
        wall, cpu = zip(*replay_within(comm, run.calls, device, budget))
        probes[name] = CodecProbe(run.ratio, run.encode, run.decode, [w + m for w, m in zip(wall, run.middle)],
                                  [c + m for c, m in zip(cpu, run.middle)])
    return Measurements(list(ready), probes, step_seconds)
