"""What the scheduler's cost model is fitted on: micro-benchmarks, and the record the ranks agree on.

:func:`probe_sizes` picks the gradient sizes to time; :func:`time_codec` times a codec's encode
and decode on them, :func:`time_network` the engine's collective on their payloads;
:func:`time_two_phase` and :func:`time_two_phase_network` do both for the two-phase scheme, whose
work between its two collectives (aggregate, encode again) counts as part of its network time;
:func:`time_in_host` times the hierarchical schemes' collectives inside the host, around the
flat scheme's work on each rank's shard across hosts.
:func:`measure` runs them all for a profile step into a :class:`Measurements` record;
:meth:`Measurements.agree` gives every rank the same record, the slowest rank's number
everywhere, with one allgather; :meth:`Measurements.cost_profile` turns it into the
:class:`~mergecomp.scheduler.costmodel.Profile` the search runs on.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor, Payload
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.communicator import Communicator
from mergecomp.kernels.workspace import Workspace
from mergecomp.scheduler.costmodel import CodecCost, Profile, fit_affine
from mergecomp.schemes import SCHEMES, TWO_PHASE
from mergecomp.schemes.hierarchical import across_hosts_of
from mergecomp.schemes.two_phase import ShardMemory, shard_bounds

__all__ = ["CodecProbe", "Measurements", "encode_alone", "measure", "probe_sizes", "time_codec", "time_in_host",
           "time_network", "time_two_phase", "time_two_phase_network"]


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


def _settle(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks time it (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def encode_alone(compressor: Compressor, memory: Optional[Memory], tensor: torch.Tensor, name: str,
                 shapes: Optional[Sequence[torch.Size]] = None) -> List[Tuple[Payload, Any]]:
    """Every round's ``(payload, ctx)`` of group ``name``'s flat ``tensor`` encoded as the
    exchange encodes it on one rank, ``memory``'s work included (None: no memory): by the
    compressor's fused encode where it offers one, else compensate (in place), compress, each
    later round from this rank's payload (the sum over one rank), and the memory's update."""
    fused = None if memory is None else compressor.compress_fused(tensor, name, shapes, memory)
    if fused is not None:
        payload, ctx, update = fused
        update()
        return [(payload, ctx)]
    compensated = _compensate(memory, tensor, name)
    rounds = [compressor.compress(compensated, name, shapes)]
    for _ in range(compressor.rounds - 1):
        rounds.append(compressor.next_round(*rounds[-1]))
    _remember(memory, compressor, compensated, name, *rounds[-1])
    return rounds


def time_codec(compressor: Compressor, samples: Sequence[Tuple[int, int]], shapes: Sequence[torch.Size],
               dtype: torch.dtype, device: torch.device, world_size: int, memory: Optional[Memory] = None
               ) -> Tuple[List[float], List[float], float]:
    """Seconds to encode and to decode (aggregating ``world_size`` payloads) random gradients of
    each ``(bytes, leading tensor count)`` sample, and the payload/input byte ratio.  With an
    error-feedback ``memory``, the encode includes its work as the exchange does it
    (:func:`encode_alone`).

    Timed in steady state, as training runs: each sample runs once untimed first, and on CPU
    the compressor gets a private workspace (as the exchange attaches one), advanced before
    every run, so the timed runs reuse scratch instead of touching fresh pages.  (Cold, a
    100 MB TernGrad decode took 0.15-0.19 s against 0.035-0.039 s warm, which made every
    plan's tail look alike.)
    """
    encode, decode, wire = [], [], 1.0
    element = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator(device="cpu").manual_seed(0)
    name = "__scheduler_probe__"
    attached = compressor.workspace
    compressor.workspace = Workspace() if torch.device(device).type == "cpu" else None
    runs = 0
    try:
        for nbytes, count in samples:
            data = torch.randn(nbytes // element, generator=generator).to(dtype=dtype, device=device)
            times = []
            for _ in range(1 + (2 if nbytes < 2**22 else 1)):  # small calls are noisy: keep the faster
                runs += 1
                if compressor.workspace is not None:
                    compressor.workspace.advance(runs)
                flat = data.clone()  # a compressor may work in place on its input
                _settle(device)
                began = time.perf_counter()
                payload, ctx = encode_alone(compressor, memory, flat, name, shapes[:count])[-1]
                _settle(device)
                middle = time.perf_counter()
                arrived = [payload] if compressor.summable else [payload] * world_size
                compressor.aggregate(arrived, ctx, world_size, True)
                _settle(device)
                times.append((middle - began, time.perf_counter() - middle))
                _forget(name, compressor, memory)
            times = times[1:]  # the first run warmed the pool and caches
            encode.append(min(t[0] for t in times))
            decode.append(min(t[1] for t in times))
            wire = sum(t.numel() * t.element_size() for t in payload) / max(nbytes, 1)
    finally:
        compressor.workspace = attached
    return encode, decode, wire


def time_two_phase(compressor: Compressor, samples: Sequence[Tuple[int, int]], dtype: torch.dtype,
                   device: torch.device, world_size: int, memory: Optional[Memory] = None
                   ) -> Tuple[List[float], List[float], List[float], float, float]:
    """The two-phase scheme's CPU work on random gradients of each sample's bytes, as
    :func:`time_codec` times it (steady state, the fastest run): seconds to encode the N shards
    (with ``memory``'s compensate and update, as :func:`time_codec`); between the collectives,
    to aggregate N payloads of one shard, encode the aggregate and, where the memory feeds back,
    update the second-stage residual; after them, to decode N aggregated shards.  Also the
    phase-1 and phase-2 payload bytes per input byte."""
    encode, middle, decode = [], [], []
    ratios = (1.0, 1.0)
    element = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator(device="cpu").manual_seed(0)
    name = "__scheduler_probe__"
    second = compressor.second_phase()
    shard_memory = ShardMemory() if memory is not None and memory.feeds_back and not second.lossless \
        else None
    attached = compressor.workspace
    runs = 0
    try:
        for nbytes, _ in samples:
            data = torch.randn(nbytes // element, generator=generator).to(dtype=dtype, device=device)
            bounds = shard_bounds(data.numel(), world_size, compressor.shard_alignment)
            times = []
            for _ in range(1 + (2 if nbytes < 2**22 else 1)):
                runs += 1
                compressor.workspace = second.workspace = Workspace() if torch.device(device).type == "cpu" else None
                flat = data.clone()
                _settle(device)
                began = time.perf_counter()
                flat = _compensate(memory, flat, name)
                shards = [compressor.compress_shard(flat[a:b], name, a, flat.numel()) for a, b in bounds]
                if memory is not None and memory.feeds_back:
                    memory.feed_parts(compressor, flat, name,
                                      [(payload, ctx, start) for (payload, ctx), (start, _) in zip(shards, bounds)])
                _settle(device)
                encoded = time.perf_counter()
                payload, ctx = shards[0]
                total = _compensate(shard_memory, compressor.aggregate([payload] * world_size, ctx, world_size, True),
                                    name)
                again, ctx2 = second.compress(total, name)
                _remember(shard_memory, second, total, name, again, ctx2)
                _settle(device)
                aggregated = time.perf_counter()
                for _ in bounds:
                    second.decompress(again, ctx2)
                _settle(device)
                times.append((encoded - began, aggregated - encoded, time.perf_counter() - aggregated))
                _forget(name, compressor, second, memory, shard_memory)
            times = times[1:]
            encode.append(min(t[0] for t in times))
            middle.append(min(t[1] for t in times))
            decode.append(min(t[2] for t in times))
            first = sum(t.numel() * t.element_size() for payload, _ in shards for t in payload)
            ratios = (first / max(nbytes, 1),
                      len(bounds) * sum(t.numel() * t.element_size() for t in again) / max(nbytes, 1))
    finally:
        compressor.workspace = attached
        second.workspace = None
    return encode, middle, decode, ratios[0], ratios[1]


def time_two_phase_network(comm: Communicator, payload_bytes: Sequence[float], second_bytes: Sequence[float],
                           device: torch.device) -> Tuple[List[float], List[float]]:
    """Wall and CPU seconds of an all-to-all of each ``payload_bytes`` (what one rank sends in
    phase 1) followed by an allgather of ``second_bytes / size`` (its aggregated shard), as
    :func:`time_network` times them.  A collective: every rank calls it with the same sizes."""
    wall, cpu = [], []
    size = comm.size
    for first, second in zip(payload_bytes, second_bytes):
        block = -(-max(8, int(first)) // size)
        scattered = torch.zeros(block * size, dtype=torch.uint8, device=device)
        gathered = torch.zeros(max(8, int(second) // size), dtype=torch.uint8, device=device)

        def both() -> None:
            comm.alltoall_async(scattered).wait("scheduler network probe")
            comm.allgather_async(gathered).wait("scheduler network probe")

        seconds, cpu_seconds = _fastest(both, device)
        wall.append(seconds)
        cpu.append(cpu_seconds)
    return wall, cpu


def time_in_host(local: Communicator, group_bytes: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> Tuple[List[float], List[float]]:
    """Wall and CPU seconds of the hierarchical schemes' work inside the host for groups of each
    of ``group_bytes`` (uncompressed, ``dtype``): the all-to-all of the group cut in one block per
    local rank, the sum of the blocks received, and the allgather of one block; as
    :func:`time_network` times them.  A collective on ``local``."""
    wall, cpu = [], []
    size, element = local.size, torch.empty((), dtype=dtype).element_size()
    for nbytes in group_bytes:
        block = -(-max(1, int(nbytes) // element) // size)
        group = torch.zeros(block * size, dtype=dtype, device=device)
        shard = torch.zeros(block, dtype=dtype, device=device)

        def both() -> None:
            rows = local.alltoall_async(group).wait("scheduler probe inside the host")
            torch.sum(rows.view(size, block), dim=0, out=shard)
            local.allgather_async(shard).wait("scheduler probe inside the host")

        seconds, cpu_seconds = _fastest(both, device)
        wall.append(seconds)
        cpu.append(cpu_seconds)
    return wall, cpu


def _fastest(run: Callable[[], None], device: torch.device) -> Tuple[float, float]:
    """``(wall, CPU)`` seconds of the faster of two calls of ``run`` (collectives: the first
    may pay for connections and buffers)."""
    times = []
    for _ in range(2):
        _settle(device)
        began, began_cpu = time.perf_counter(), time.process_time()
        run()
        _settle(device)
        times.append((time.perf_counter() - began, time.process_time() - began_cpu))
    return min(times)


def _compensate(memory: Optional[Memory], tensor: torch.Tensor, name: str) -> torch.Tensor:
    return memory.compensate(tensor, name) if memory is not None else tensor


def _remember(memory: Optional[Memory], codec: Compressor, compensated: torch.Tensor, name: str,
              payload, ctx) -> None:
    if memory is not None and memory.feeds_back:
        memory.feed(codec, compensated, name, payload, ctx)


def _forget(name: str, *holders) -> None:
    """Drop the probe's state from each holder (None: skipped)."""
    for holder in holders:
        if holder is not None:
            holder.state.pop(name, None)


def time_network(comm: Communicator, compressor: Compressor, payload_bytes: Sequence[float],
                 device: torch.device) -> Tuple[List[float], List[float]]:
    """Wall seconds of ``compressor``'s collective on ``comm`` for each payload size, and the
    CPU seconds this process spent meanwhile (the engine's threads; waiting does not spin).
    A collective: every rank must call it with the same sizes."""
    wall, cpu = [], []
    for nbytes in payload_bytes:
        nbytes = max(8, int(nbytes))
        if compressor.summable:
            tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            run = comm.allreduce_async
        else:
            tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            run = comm.allgather_async
        seconds, cpu_seconds = _fastest(lambda: run(tensor).wait("scheduler network probe"), device)
        wall.append(seconds)
        cpu.append(cpu_seconds)
    return wall, cpu


@dataclass
class CodecProbe:
    """One codec at the probe sizes: its payload/input byte ratio, and seconds per size to
    encode, to decode, and of its collective (wall time, and this process's CPU time)."""

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


def _levels(comm: Communicator, name: str) -> Tuple[str, Communicator, Optional[Communicator]]:
    """Where codec ``name`` compresses: ``(flat scheme, its communicator, the host's
    communicator)``, the last None unless a hierarchical codec runs on several hosts of several
    processes (elsewhere it is its flat scheme, as the exchange sends it)."""
    fallback = SCHEMES[name].fallback if name in SCHEMES else None
    if fallback is None:
        return name, comm, None
    hosts = across_hosts_of(comm)
    if hosts is None:
        return fallback, comm, None
    local, cross = hosts
    return fallback, cross, local


def measure(comm: Communicator, codecs: Mapping[str, Compressor], samples: Sequence[Tuple[int, int]],
            shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, ready: Sequence[float],
            step_seconds: float, memory: Optional[Memory] = None) -> Measurements:
    """This rank's record of a profile step: its ``ready`` times and ``step_seconds``, and each
    codec timed on ``samples`` (see :func:`probe_sizes`), with the exchange's error-feedback
    ``memory`` where it takes part (every codec of :data:`~mergecomp.pipeline.plan.CODECS`).  A
    hierarchical codec is timed as its flat scheme on this rank's 1/L shard of each sample
    across hosts (its ratio: payload bytes per byte of the whole group), plus
    :func:`time_in_host` on the whole sample.  Every codec is encoded and decoded before the
    first collective runs; the collectives run in the order of ``codecs``, which must be the
    same on every rank."""
    levels = {name: _levels(comm, name) for name in codecs}
    timed = {}  # name -> (bytes of each sample's shard, the codec's timings)
    for name, compressor in codecs.items():
        flat, across, local = levels[name]
        shard = 1 if local is None else local.size
        parts = [(max(1, nbytes // shard), count) for nbytes, count in samples]
        timed[name] = ([n for n, _ in parts],
                       time_two_phase(compressor, parts, dtype, device, across.size, memory) if flat == TWO_PHASE
                       else time_codec(compressor, parts, shapes, dtype, device, across.size, memory))
    probes = {}
    for name, (parts, times) in timed.items():
        flat, across, local = levels[name]
        shard = 1 if local is None else local.size
        if flat == TWO_PHASE:
            encode, middle, decode, ratio, second = times
            wall, cpu = time_two_phase_network(across, [n * ratio for n in parts], [n * second for n in parts],
                                               device)
            wall = [w + m for w, m in zip(wall, middle)]
            cpu = [c + m for c, m in zip(cpu, middle)]
        else:
            encode, decode, ratio = times
            wall, cpu = time_network(across, codecs[name], [n * ratio for n in parts], device)
        if local is not None:
            inside, inside_cpu = time_in_host(local, [nbytes for nbytes, _ in samples], dtype, device)
            wall = [w + i for w, i in zip(wall, inside)]
            cpu = [c + i for c, i in zip(cpu, inside_cpu)]
        probes[name] = CodecProbe(ratio / shard, encode, decode, wall, cpu)
    return Measurements(list(ready), probes, step_seconds)
