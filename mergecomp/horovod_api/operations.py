"""What each of Horovod's tensor collectives needs to agree on across ranks, and how it runs once
every rank of its process set has asked for it (see :mod:`mergecomp.horovod_api.negotiation`).

An :class:`Operation` holds one rank's side: its tensor and arguments, its ``meta`` (a small tuple
of plain values every rank sends in the negotiation: dtype, shape, op, root ...), ``check`` (a
mismatch between the ranks' metas, as one message that is the same on every rank, or None) and
``run`` (the collective itself on the communicator, given every rank's meta, so that shapes or
splits that differ by rank need no exchange of their own).  ``stand_in`` builds the side of a rank
that has joined (:func:`mergecomp.horovod_api.collectives.join`): a zero tensor for the
reductions; None where a joined rank cannot take part.

Reductions: ``Sum`` and ``Average`` by the engine's allreduce; ``Min``, ``Max`` and ``Product``
by an allgather and a local reduction (``size x`` the tensor's bytes per rank).  Integer tensors
are scaled (``prescale_factor``, ``postscale_factor``, the division of ``Average``) in float64
and truncated back, float16 on CPU in float32, as Horovod does.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from mergecomp.engines.communicator import Communicator

__all__ = ["Operation", "Allreduce", "Allgather", "Broadcast", "BroadcastObject", "Alltoall", "Reducescatter",
           "Barrier", "reducescatter_rows", "scale", "Average", "Sum", "Min", "Max", "Product",
           "REDUCTIONS"]

#: reduce over ranks and divide by their number (Horovod's default)
Average = "average"
#: reduce over ranks
Sum = "sum"
#: the elementwise minimum, maximum and product over ranks (tensor collectives only)
Min, Max, Product = "min", "max", "product"
#: the reductions of allreduce (reducescatter: Average and Sum)
REDUCTIONS = (Average, Sum, Min, Max, Product)
_BY_GATHER = {Min: torch.amin, Max: torch.amax, Product: torch.prod}

Metas = Dict[int, tuple]  # rank -> that rank's Operation.meta


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _differ(metas: Metas, key: Callable[[tuple], Any]) -> Optional[Tuple[int, int]]:
    """``(a, b)``: the lowest rank and the first other rank whose ``key(meta)`` differ, or None."""
    ranks = sorted(metas)
    first = key(metas[ranks[0]])
    other = next((r for r in ranks[1:] if key(metas[r]) != first), None)
    return None if other is None else (ranks[0], other)


def _dtype_problem(metas: Metas) -> Optional[str]:
    pair = _differ(metas, lambda m: m[0])
    return pair and f"rank {pair[0]} sends {metas[pair[0]][0]} but rank {pair[1]} sends {metas[pair[1]][0]}"


def _shape(meta: tuple) -> str:
    return str(list(meta[1]))


def _same_shape_problem(metas: Metas) -> Optional[str]:
    pair = _differ(metas, lambda m: m[1])
    return pair and (f"every rank must send the same shape, but rank {pair[0]} has shape {_shape(metas[pair[0]])} "
                     f"and rank {pair[1]} has {_shape(metas[pair[1]])}")


def _rows_problem(metas: Metas) -> Optional[str]:
    pair = _differ(metas, lambda m: (len(m[1]), m[1][1:]))
    return pair and (f"only the first dimension may differ between ranks, but rank {pair[0]} has shape "
                     f"{_shape(metas[pair[0]])} and rank {pair[1]} has {_shape(metas[pair[1]])}")


def _value_problem(metas: Metas, field: int, label: str) -> Optional[str]:
    pair = _differ(metas, lambda m: m[field])
    return pair and f"rank {pair[0]} gives {label} {metas[pair[0]][field]} but rank {pair[1]} gives {metas[pair[1]][field]}"


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in ``tensor``'s dtype, computed as Horovod does: integers in float64
    (truncated back), float16/bfloat16 on CPU in float32."""
    if factor == 1.0:
        return tensor
    if _integer(tensor.dtype):
        return (tensor.double() * factor).to(tensor.dtype)
    if tensor.dtype in (torch.float16, torch.bfloat16) and tensor.device.type == "cpu":
        return (tensor.float() * factor).to(tensor.dtype)
    return tensor * factor


class Operation:
    """One rank's side of one collective (see the module docstring)."""

    kind = ""

    def __init__(self, tensor: Optional[torch.Tensor]) -> None:
        self.tensor = tensor

    @property
    def meta(self) -> tuple:
        return (_dtype_name(self.tensor.dtype), tuple(self.tensor.shape))

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return _dtype_problem(metas) or _same_shape_problem(metas)

    def run(self, comm: Communicator, metas: Metas) -> Any:
        raise NotImplementedError

    @classmethod
    def stand_in(cls, meta: tuple) -> Optional["Operation"]:
        """The side of a joined rank, from another rank's ``meta``; None: it cannot stand in."""
        return None


def _zeros(meta: tuple) -> torch.Tensor:
    return torch.zeros(meta[1], dtype=getattr(torch, meta[0].replace("torch.", "")))


class Allreduce(Operation):
    """``op`` over ranks of a tensor of the same dtype and shape everywhere, into ``out``."""

    kind = "allreduce"

    def __init__(self, tensor: torch.Tensor, out: torch.Tensor, op: str = Average, prescale: float = 1.0,
                 postscale: float = 1.0) -> None:
        super().__init__(tensor)
        self.out, self.op, self.prescale, self.postscale = out, op, prescale, postscale

    @property
    def meta(self) -> tuple:
        return super().meta + (self.op,)

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return _value_problem(metas, 2, "op") or Operation.check(metas)

    @classmethod
    def stand_in(cls, meta: tuple) -> Optional["Allreduce"]:
        if meta[2] not in (Sum, Average):
            return None
        zeros = _zeros(meta)
        return cls(zeros, zeros, meta[2])

    def run(self, comm: Communicator, metas: Metas) -> torch.Tensor:
        work = scale(self.tensor, self.prescale).to(comm.device, memory_format=torch.contiguous_format, copy=True)
        if work.numel() and comm.size > 1:
            if self.op in _BY_GATHER:
                rows = comm.allgather(work.reshape(-1), f"{self.kind} ({self.op})")
                work = _BY_GATHER[self.op](rows, dim=0).reshape(work.shape)
            else:
                comm.allreduce_(work, self.kind)
        if self.op == Average:
            work = _averaged(work, comm.size)
        work = scale(work, self.postscale)
        with torch.no_grad():
            self.out.copy_(work)
        return self.out


class Allgather(Operation):
    """Every rank's tensor concatenated along dimension 0 (which may differ by rank)."""

    kind = "allgather"

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return _dtype_problem(metas) or _rows_problem(metas)

    def run(self, comm: Communicator, metas: Metas) -> torch.Tensor:
        firsts = [metas[r][1][0] for r in range(comm.size)]
        rest = tuple(self.tensor.shape[1:])
        longest = max(firsts)
        if longest * math.prod(rest) == 0:
            return self.tensor.new_empty((sum(firsts),) + rest)
        padded = self.tensor.new_zeros((longest,) + rest, device=comm.device)
        padded[:self.tensor.shape[0]] = self.tensor
        rows = comm.allgather(padded.reshape(-1), self.kind).view((comm.size, longest) + rest)
        return torch.cat([rows[r, :firsts[r]] for r in range(comm.size)]).to(self.tensor.device)


class Broadcast(Operation):
    """Rank ``root``'s tensor written into every rank's ``tensor``; ``root`` is a rank of the job,
    and one of the process set's ``ranks``."""

    kind = "broadcast"

    def __init__(self, tensor: torch.Tensor, root: int, ranks: List[int]) -> None:
        super().__init__(tensor)
        self.root, self.ranks = root, ranks

    def _set_root(self) -> int:
        """``root``'s rank within the process set (ValueError, on every rank, if it is not in it)."""
        if self.root not in self.ranks:
            raise ValueError(f"root_rank {self.root} is not a rank of the process set {self.ranks}")
        return self.ranks.index(self.root)

    @property
    def meta(self) -> tuple:
        return super().meta + (self.root,)

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return _value_problem(metas, 2, "root_rank") or Operation.check(metas)

    def run(self, comm: Communicator, metas: Metas) -> torch.Tensor:
        root = self._set_root()
        work = self.tensor if self.tensor.device == comm.device and self.tensor.is_contiguous() else \
            self.tensor.to(comm.device, memory_format=torch.contiguous_format, copy=True)
        if work.numel():
            comm.broadcast_(work, root)
        if work is not self.tensor:
            with torch.no_grad():
                self.tensor.copy_(work)
        return self.tensor


class BroadcastObject(Broadcast):
    """Rank ``root``'s bytes (a 1-D uint8 tensor, any length) on every rank: the length travels in
    the negotiation, so the other ranks give an empty tensor."""

    kind = "broadcast_object"

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return _value_problem(metas, 2, "root_rank")

    def run(self, comm: Communicator, metas: Metas) -> torch.Tensor:
        root = self._set_root()
        length = metas[root][1][0]
        work = self.tensor if comm.rank == root else torch.empty(length, dtype=torch.uint8)
        if length:
            work = work.to(comm.device)
            comm.broadcast_(work, root)
        return work.cpu()


class Alltoall(Operation):
    """Rank ``r`` sends ``splits[d]`` rows of its tensor to rank ``d``; returns the received rows
    in sender order and how many came from each sender (int64)."""

    kind = "alltoall"

    def __init__(self, tensor: torch.Tensor, splits: List[int]) -> None:
        super().__init__(tensor)
        self.splits = splits

    @property
    def meta(self) -> tuple:
        return super().meta + (tuple(self.splits),)

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return Allgather.check(metas)

    def run(self, comm: Communicator, metas: Metas) -> Tuple[torch.Tensor, torch.Tensor]:
        received = [metas[src][2][comm.rank] for src in range(comm.size)]
        longest = max(max(m[2]) for m in metas.values())
        blocks = _exchange_rows(comm, self.tensor, self.splits, longest, self.kind)
        out = torch.cat([blocks[src, :count] for src, count in enumerate(received)]).to(self.tensor.device)
        return out, torch.tensor(received, dtype=torch.int64)


def _exchange_rows(comm: Communicator, tensor: torch.Tensor, splits: List[int], longest: int,
                   what: str) -> torch.Tensor:
    """``tensor``'s ``splits[d]`` rows for each rank ``d``, padded to ``longest`` rows, sent by one
    all-to-all: a ``(size, longest, *tensor.shape[1:])`` tensor on ``comm.device``, block ``s``
    from rank ``s``."""
    padded = tensor.new_zeros((comm.size, longest) + tuple(tensor.shape[1:]), device=comm.device)
    for dest, part in enumerate(tensor.split(splits)):
        padded[dest, :splits[dest]] = part
    if not padded.numel() or comm.size == 1:
        return padded
    return comm.alltoall(padded.reshape(-1), what).view(padded.shape)


def _averaged(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """A sum over ``size`` ranks divided by it: truncated toward zero for integers, as Horovod."""
    return tensor.div(size, rounding_mode="trunc") if _integer(tensor.dtype) else scale(tensor, 1.0 / size)


def reducescatter_rows(rows: int, size: int) -> List[int]:
    """The rows of a reduce-scatter's result on each rank: ``rows // size``, one more on the first
    ``rows % size`` ranks (Horovod's split)."""
    return [rows // size + (r < rows % size) for r in range(size)]


class Reducescatter(Allreduce):
    """``op`` (``Sum`` or ``Average``) over ranks of a tensor of the same dtype and shape
    everywhere; rank ``r`` keeps its rows (:func:`reducescatter_rows`).  One all-to-all: each rank
    sends every other rank that rank's rows (padded to the longest part) and sums what it
    receives, in float32 for 16-bit floats."""

    kind = "reducescatter"

    def __init__(self, tensor: torch.Tensor, op: str = Average, prescale: float = 1.0,
                 postscale: float = 1.0) -> None:
        super().__init__(tensor, tensor, op, prescale, postscale)

    @classmethod
    def stand_in(cls, meta: tuple) -> Optional["Reducescatter"]:
        return cls(_zeros(meta), meta[2]) if meta[2] in (Sum, Average) else None

    def run(self, comm: Communicator, metas: Metas) -> torch.Tensor:
        parts = reducescatter_rows(self.tensor.shape[0], comm.size)
        work = scale(self.tensor, self.prescale)
        blocks = _exchange_rows(comm, work, parts, parts[0], self.kind)
        wide = torch.float32 if work.dtype in (torch.float16, torch.bfloat16) else work.dtype
        mine = blocks[:, :parts[comm.rank]].to(wide).sum(dim=0)
        if self.op == Average:
            mine = _averaged(mine, comm.size)
        return scale(mine.to(work.dtype), self.postscale).to(self.tensor.device)


class Barrier(Operation):
    """Returns once every rank has asked for it (a one-element allreduce)."""

    kind = "barrier"

    def __init__(self) -> None:
        super().__init__(None)

    @property
    def meta(self) -> tuple:
        return ()

    @staticmethod
    def check(metas: Metas) -> Optional[str]:
        return None

    @classmethod
    def stand_in(cls, meta: tuple) -> "Barrier":
        return cls()

    def run(self, comm: Communicator, metas: Metas) -> None:
        if comm.size > 1:
            comm.allreduce_(torch.zeros(1, device=comm.device), self.kind)
