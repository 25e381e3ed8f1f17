"""Compressed gradient reductions for FSDP2 (``torch.distributed.fsdp.fully_shard``), HSDP built
on it, and FSDP1 (``FullyShardedDataParallel``).

Example::

    from torch.distributed.fsdp import fully_shard
    import mergecomp.torch as mc

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    mc.fsdp.compress(model, compression="qsgd")      # every FSDP module of the model

FSDP2 hands each module's gradients to its reduce-scatter as one flat buffer: ``world`` equal
chunks, chunk ``d`` holding the rows of rank ``d``'s shard, in FSDP's ``reduce_dtype``.
:class:`CompressedReduceScatter` (plugged in with FSDP2's public ``set_custom_reduce_scatter``)
runs it on the same path as every other exchange (:class:`~mergecomp.exchange.exchange.Exchange`
with the :mod:`~mergecomp.exchange.schemes.reduce_scatter` scheme): each chunk compressed after
its error feedback (the memory keyed by module: a gradient per rank, zero at the own chunk, for
compressors that keep one), chunk ``d``'s payload sent to rank ``d`` by one all-to-all of packed
payload bytes (and a flag saying whether the sender's gradients were finite), and the payloads
received decoded and summed (or averaged), with the own chunk exact, into the shard: a
reduce-scatter of ``(world - 1) / world`` of the payload bytes per rank.  A non-finite gradient
on any rank (a ``GradScaler`` overflow) makes every rank's shard NaN, so every rank's scaler skips
the step, and leaves the memories as they were.  With the lossless compressor it is FSDP's own
``reduce_scatter_tensor``, bit for bit.

HSDP: shard each replica on a 1-D mesh and pass ``replicate_group=`` (the ranks holding the same
shard): each module's reduced shard is then averaged over the replicas by a
:class:`CompressedAllReduce` (FSDP2's ``set_all_reduce_hook``; one payload per rank, allgathered).
``all_gather="int8"``: the parameters' all-gather too, in int8 blocks (:class:`QuantizedAllGather`,
FSDP2's ``set_custom_all_gather``), as ZeRO++ quantizes weights.
FSDP1: one communication hook for every flat parameter (:class:`_FSDP1Hook`).

Refused with ValueError: compressors of several rounds (PowerSGD: a reduce-scatter has one),
low-rank ones (ACP-SGD: FSDP's flat shards cut the matrices) and majority votes (signSGD,
Signum: FSDP needs the average); reduce ops other than sum, average and a sum pre-multiplied by a
number (FSDP2's ``set_gradient_divide_factor``: the sum, then scaled, on gloo too).
"""
from __future__ import annotations

import functools
import io
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.torch_dist import TorchCommunicator
from mergecomp.exchange.compatibility import FSDP, check
from mergecomp.exchange.exchange import Exchange, resolve
from mergecomp.exchange.plan import COMPRESSED, Group
from mergecomp.exchange.schemes import REDUCE_SCATTER
from mergecomp.kernels.quantize import from_int8_blocks, int8_blocks, int8_blocks_nbytes
from mergecomp.pipeline.nonfinite import NonfiniteCheck

__all__ = ["CompressedAllReduce", "CompressedReduceScatter", "QuantizedAllGather", "Reductions", "compress"]

#: what ``compress(all_gather=...)`` accepts: the parameters' all-gather as FSDP's, or in int8
ALL_GATHERS = ("none", "int8")

#: the parameter dtypes the int8 all-gather quantizes (others travel as they are)
_INT8_GATHERED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: what each holder's part of a Reductions checkpoint holds
_PARTS = ("compressor", "memory")


class _Communicators:
    """One :class:`TorchCommunicator` (collectives with a timeout) per process group, made on
    first use: ``communicators(group)``."""

    def __init__(self, timeout: Optional[float]) -> None:
        self.timeout = timeout
        self._made: Dict[Any, TorchCommunicator] = {}

    def __call__(self, group: Optional[dist.ProcessGroup]) -> TorchCommunicator:
        if group not in self._made:
            self._made[group] = TorchCommunicator(group, self.timeout)
        return self._made[group]


class _CompressedCollective:
    """What the compressed reduce-scatter and all-reduce share: the compressor and memory, and
    the common path that runs them (:class:`~mergecomp.exchange.exchange.Exchange`: check,
    error compensation, encode, the scheme's collectives, the memory's update), one exchange
    per process group and reduction (sum or mean).  A non-finite gradient on any rank makes
    every rank's result NaN and puts every rank's state back as it was.
    ``state_dict()``/``load_state_dict()`` hold the compressor's and the memory's state (per
    rank: every rank saves its own)."""

    def __init__(self, compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                 name: str = "fsdp", timeout: Optional[float] = None) -> None:
        self.compressor, self.memory = resolve(compression, memory)
        check(self.compressor, FSDP, "mc.fsdp")
        self.name = name
        self._comm = _Communicators(timeout)
        self._exchanges: Dict[Tuple[Any, bool], Exchange] = {}

    def _reduce(self, flat: torch.Tensor, group: Optional[dist.ProcessGroup], average: bool, codec: str,
                key: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``flat`` (1-D, overwritten) reduced over ``group`` by the route ``codec`` of the
        exchange for ``(group, average)``, as the group named ``key``: the result (in ``out``
        when given); NaN, the state put back, where any rank's gradient was not finite."""
        exchange = self._exchanges.get((group, average))
        if exchange is None:
            exchange = self._exchanges[(group, average)] = Exchange(
                self.compressor, self.memory, self._comm(group), average=average, recycle=False, keep_state=True)
        job = exchange.start(Group(key, (0,), (0,), (flat.shape,), flat.numel()), flat, exchange.route(codec))
        check_ranks = NonfiniteCheck(exchange.comm, [job], exchange.step) if codec != REDUCE_SCATTER else None
        result = exchange.finish(job, out)
        finite = job.all_finite if check_ranks is None else not check_ranks.culprits([key])
        if finite:
            exchange.commit()
        else:
            exchange.rollback()
            result.fill_(float("nan"))
        return result

    def state_dict(self) -> Dict[str, Any]:
        return {part: getattr(self, part).state_dict() for part in _PARTS}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for part in _PARTS:
            getattr(self, part).load_state_dict(state[part])


def _reduction(op: Any, name: str) -> Tuple[bool, float]:
    """What reduce op ``op`` asks of a reduction: (average over the ranks, a factor the sum is
    multiplied by): SUM (False, 1), AVG (True, 1), ``PREMUL_SUM(f)`` (False, f: FSDP2's choice
    under ``set_gradient_divide_factor``); ValueError for any other."""
    if op == dist.ReduceOp.AVG or op == dist.ReduceOp.SUM:
        return op == dist.ReduceOp.AVG, 1.0
    factor = getattr(op, "factor", None)
    if op == dist.ReduceOp.PREMUL_SUM and isinstance(factor, (int, float)):
        return False, float(factor)
    raise ValueError(f"{name}: the compressed reduction sums, averages or sums pre-multiplied by a number, not {op}")


class CompressedReduceScatter(_CompressedCollective):
    """FSDP2's ``ReduceScatter`` interface (``allocate``, ``__call__``) for one FSDP module: the
    input's chunk ``d`` compressed after its error feedback and sent to rank ``d`` by one
    all-to-all, each rank reducing the payloads it received and its own chunk, exact, into its
    shard (:mod:`~mergecomp.exchange.schemes.reduce_scatter`); the memory holds the module's
    whole input, keyed by the module's name (zero at the own chunk)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False, key: Optional[str] = None) -> None:
        average, factor = _reduction(op, self.name)
        if self.compressor.lossless:  # a pre-multiplied sum as a sum then scaled: gloo has no PREMUL_SUM
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op if factor == 1.0 else dist.ReduceOp.SUM,
                                       group=group)
        else:
            self._reduce(input_tensor.view(-1), group, average, REDUCE_SCATTER, key or self.name,
                         out=output_tensor.view(-1))
        if factor != 1.0:
            output_tensor.mul_(factor)
        return None


class CompressedAllReduce(_CompressedCollective):
    """An in-place all-reduce of one flat tensor over a process group: the tensor compressed once
    (memory key ``<name>``), by allreduce where the compressor's payloads add up, else
    allgathered and each rank decoding them all.  HSDP's replica all-reduce (FSDP2's
    ``set_all_reduce_hook``) and FSDP1's ``NO_SHARD``."""

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor, group: Optional[dist.ProcessGroup], average: bool = True,
                 key: Optional[str] = None) -> None:
        if self.compressor.lossless:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            if average:
                tensor.div_(self._comm(group).size)
            return
        flat = tensor.view(-1)
        self._reduce(flat, group, average, COMPRESSED, key or self.name, out=flat)


class QuantizedAllGather:
    """FSDP2's ``AllGather`` interface (``allocate``, ``__call__``; FSDP2's
    ``set_custom_all_gather``) for one FSDP module: the parameters' all-gather in int8, as
    ZeRO++'s quantized weights.  Each rank's flat shard (FSDP's ``param_dtype``) travels as
    symmetric int8 codes in blocks of ``block`` elements, rounded to nearest, with an fp32 scale
    (``max |w| / 127``) per block: ``1 + 4 / block`` bytes per element.  Every rank, the owner
    included, decodes every shard, so the unsharded parameters that forward and backward use are
    identical on every rank, each within half its block's scale of the sharded parameter, which
    the optimizer keeps and updates exactly.  Shards of other dtypes (bytes: a module whose
    parameters mix dtypes; 8-bit floats) are gathered exactly."""

    def __init__(self, block: int = 256, name: str = "fsdp", timeout: Optional[float] = None) -> None:
        if block <= 0 or block % 4:
            raise ValueError(f"mc.fsdp: the int8 all-gather's block must be a positive multiple of 4, not {block}")
        self.block, self.name = block, name
        self._comm = _Communicators(timeout)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        comm = self._comm(group)
        rows = output_tensor.view(comm.size, -1)
        if input_tensor.dtype not in _INT8_GATHERED:
            rows.copy_(comm.allgather(input_tensor, f"{self.name}: parameter all-gather"))
            return None
        payload = input_tensor.new_empty(int8_blocks_nbytes(input_tensor.numel(), self.block), dtype=torch.uint8)
        int8_blocks(input_tensor.view(-1), self.block, payload)  # before the output, which holds the input, is written
        received = comm.allgather(payload, f"{self.name}: int8 parameter all-gather")
        from_int8_blocks(received, self.block, rows)
        return None


class _FSDP1Hook:
    """FSDP1's communication hook (``FullyShardedDataParallel.register_comm_hook``): the
    sharded strategies' ``hook(state, grad, output)`` through a :class:`CompressedReduceScatter`,
    ``NO_SHARD``'s ``hook(state, grad)`` through a :class:`CompressedAllReduce` (averaged: FSDP1
    leaves the division to a custom hook).  FSDP1 calls one hook with one state for every flat
    parameter, unnamed, so each call's memory is keyed by its place in the backward pass
    (counted from the root's forward); a place whose size changes raises."""

    def __init__(self, root: torch.nn.Module, compression, memory, options: Dict[str, Any]) -> None:
        self.all_reduce = CompressedAllReduce(compression, memory, name="fsdp1", **options)
        self.compressor, self.memory = self.all_reduce.compressor, self.all_reduce.memory  # shared by both
        self.reduce_scatter = CompressedReduceScatter(self.compressor, self.memory, name="fsdp1", **options)
        self._calls, self._sizes = 0, {}
        root.register_forward_pre_hook(self._new_pass)

    def _new_pass(self, *_: Any) -> None:
        self._calls = 0

    def state_dict(self) -> Dict[str, Any]:
        return self.all_reduce.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.all_reduce.load_state_dict(state)

    def __call__(self, group: Optional[dist.ProcessGroup], grad: torch.Tensor,
                 output: Optional[torch.Tensor] = None) -> None:
        key = f"fsdp1.{self._calls}"
        self._calls += 1
        if self._sizes.setdefault(key, grad.numel()) != grad.numel():
            raise RuntimeError(f"mc.fsdp: FSDP1's reduction number {self._calls} of this backward pass has "
                               f"{grad.numel()} elements, {self._sizes[key]} before: the flat parameters must "
                               f"reduce in the same order every step (their error feedback is kept by place)")
        if output is None:
            self.all_reduce(grad, group, average=True, key=key)
            return
        self.reduce_scatter(output, grad, group, dist.ReduceOp.SUM, key=key)
        output.div_(grad.numel() // output.numel())


class Reductions(list):
    """What :func:`compress` returns: the holders of the model's compressed reductions, in order
    (each with ``state_dict()``/``load_state_dict()``), and their checkpoint for FSDP's flows.

    The memories are every rank's own (a residual of what that rank sent), so a checkpoint keeps
    one entry per rank, ``"rank<r>"``: a ``BytesIO`` of that rank's states, which
    ``torch.distributed.checkpoint`` saves from each rank and loads back in place.  They resume
    on the same number of ranks only.  A compressor or memory instance the modules share (given
    to :func:`compress` as an instance) is saved once."""

    def state_dict(self) -> Dict[str, io.BytesIO]:
        """This rank's entry: save it beside FSDP's sharded state dicts
        (``dcp.save({"model": ..., "optim": ..., "mergecomp": reductions.state_dict()})``);
        to load, pass the same dict to ``dcp.load`` and its ``"mergecomp"`` value to
        :meth:`load_state_dict`."""
        blob = io.BytesIO()
        torch.save(self._states(), blob)
        blob.seek(0)
        return {f"rank{_rank()}": blob}

    def full_state_dict(self) -> Dict[str, bytes]:
        """Every rank's entry as bytes, on every rank (one ``all_gather_object``): for a
        checkpoint that rank 0 writes alone, beside a full state dict; every rank loads it
        (``torch.load(weights_only=True)`` reads bytes) and takes its own."""
        entries: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(entries, {name: blob.getvalue() for name, blob in self.state_dict().items()})
        return {name: blob for entry in entries for name, blob in entry.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load this rank's entry of ``state`` (from either method; a ``BytesIO`` or bytes)."""
        name = f"rank{_rank()}"
        if name not in state:
            raise KeyError(f"mc.fsdp: the checkpoint has no entry for {name} (it has {sorted(state)}): the "
                           f"memories resume on the ranks that saved them")
        blob = state[name]
        blob = io.BytesIO(blob) if isinstance(blob, (bytes, bytearray)) else blob
        blob.seek(0)
        states = torch.load(blob, weights_only=True)
        if len(states) != len(self):
            raise ValueError(f"mc.fsdp: {name}'s checkpoint holds {len(states)} reductions' states, the model "
                             f"has {len(self)}")
        for holder, held in zip(self, states):
            for part in _PARTS:
                if not isinstance(held[part], int):  # an int: the index of the holder that saved it
                    getattr(holder, part).load_state_dict(held[part])

    def _states(self) -> List[Dict[str, Any]]:
        """Each holder's compressor and memory state; an instance several holders share (given to
        :func:`compress` as an instance) saved by the first, the others holding its index."""
        first: Dict[int, int] = {}
        states = []
        for index, holder in enumerate(self):
            state = {}
            for part in _PARTS:
                shared = getattr(holder, part)
                owner = first.setdefault(id(shared), index)
                state[part] = shared.state_dict() if owner == index else owner
            states.append(state)
        return states


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def compress(model: torch.nn.Module, compression: Union[str, Compressor] = "none",
             memory: Union[str, Memory, None] = None, replicate_group: Optional[dist.ProcessGroup] = None,
             all_gather: str = "none", **options: Any) -> Reductions:
    """Compress the gradient reductions of ``model``'s FSDP modules; returns the objects holding
    their state, as :class:`Reductions` (checkpoints).

    * FSDP2 (``fully_shard`` applied): every FSDP module gets its own
      :class:`CompressedReduceScatter`, in ``model.modules()`` order; with ``replicate_group``
      (HSDP: ``fully_shard`` on a 1-D mesh of the ranks sharing a replica, the process group of
      the ranks holding the same shard), each module also gets a :class:`CompressedAllReduce` of
      its shard over that group, as FSDP2's all-reduce hook, right after its reduce-scatter.
    * FSDP1 (``FullyShardedDataParallel``): one communication hook on the root for every flat
      parameter; returns its one state holder.

    * ``all_gather="int8"`` (FSDP2): every FSDP module's parameter all-gather also goes through a
      :class:`QuantizedAllGather` (the forward and backward then compute with int8-rounded
      parameters; the optimizer's shards stay exact); ``"none"``, the default, leaves it FSDP's.

    ``compression`` and ``memory`` are names or instances (a fresh instance per module when
    given by name).  ValueError: a codec the reduction cannot carry, an ``all_gather`` not in
    :data:`ALL_GATHERS`, a model without FSDP, FSDP2 modules on a 2-D mesh (native HSDP: its
    replica all-reduce cannot be replaced; shard on a 1-D mesh and pass ``replicate_group``),
    FSDP1 with ``replicate_group`` or ``all_gather="int8"``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    CompressedReduceScatter(compression, memory, **options)  # refuses a codec it cannot carry, model untouched
    if all_gather not in ALL_GATHERS:
        raise ValueError(f"mc.fsdp.compress: all_gather={all_gather!r}; it takes one of {ALL_GATHERS}")
    if FullyShardedDataParallel.fsdp_modules(model):
        if replicate_group is not None:
            raise ValueError("mc.fsdp.compress: replicate_group is for FSDP2 (fully_shard); FSDP1 refuses "
                             "communication hooks under its hybrid strategies")
        if all_gather != "none":
            raise ValueError(f"mc.fsdp.compress: all_gather={all_gather!r} is for FSDP2 (fully_shard); FSDP1 has no "
                             f"hook for its parameter all-gather")
        hook = _FSDP1Hook(model, compression, memory, options)
        model.register_comm_hook(getattr(model, "process_group", None), hook)
        return Reductions([hook])
    modules = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("mc.fsdp.compress: the model has no FSDP2 module; apply "
                         "torch.distributed.fsdp.fully_shard first")
    for name, module in modules:
        meshes = {getattr(p, "device_mesh", None) for p in module.parameters(recurse=False)}
        if any(mesh is not None and mesh.ndim > 1 for mesh in meshes):
            raise ValueError(f"mc.fsdp.compress: FSDP module {name!r} is on a {max(m.ndim for m in meshes if m)}-D "
                             f"mesh (native HSDP), whose replica all-reduce cannot be replaced; shard on a 1-D "
                             f"mesh and pass replicate_group= (the ranks holding the same shard)")
    holders = Reductions()
    for name, module in modules:
        reduce_scatter = CompressedReduceScatter(compression, memory, name=name, **options)
        module.set_custom_reduce_scatter(reduce_scatter)
        holders.append(reduce_scatter)
        if all_gather == "int8":
            module.set_custom_all_gather(QuantizedAllGather(name=name, **options))
        if replicate_group is not None:
            replicas = CompressedAllReduce(compression, memory, name=f"{name}.replicas", **options)
            module.set_all_reduce_hook(functools.partial(replicas, group=replicate_group))
            holders.append(replicas)
    return holders
