"""Compressed reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

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
compresses each chunk with the chosen compressor after its error feedback (the memory is keyed by
module and destination: a full gradient's worth of residual per rank, for compressors that keep
one), sends chunk ``d``'s payload to rank ``d`` by one all-to-all of packed payload bytes (and
one byte saying whether the sender's gradients were finite), and decodes and sums (or averages)
the payloads it receives into its shard: a reduce-scatter of ``(world - 1) / world`` of the
payload bytes per rank.  A non-finite gradient on any rank (a ``GradScaler`` overflow) makes
every rank's shard NaN, so every rank's scaler skips the step, and leaves the memories as they
were.  With the lossless compressor it is FSDP's own ``reduce_scatter_tensor``, bit for bit.

Refused with ValueError: compressors of several rounds (PowerSGD: a reduce-scatter has one) and
majority votes (signSGD, Signum: FSDP needs the average); reduce ops other than sum and average
(NCCL's pre-multiplied sum).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.torch_dist import TorchCommunicator
from mergecomp.exchange.exchange import resolve
from mergecomp.kernels.codecs import all_finite
from mergecomp.kernels.wire import pack_rows, unpack_payload

__all__ = ["CompressedReduceScatter", "compress"]

#: bytes after each packed payload row carrying "the sender's gradients were not finite"
_FLAG_BYTES = 8


class CompressedReduceScatter:
    """FSDP2's ``ReduceScatter`` interface (``allocate``, ``__call__``) for one FSDP module.

    ``state_dict()``/``load_state_dict()`` hold the compressor's and the memory's state (per
    rank: every rank saves its own)."""

    def __init__(self, compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                 name: str = "fsdp", timeout: Optional[float] = None) -> None:
        self.compressor, self.memory = resolve(compression, memory)
        if self.compressor.rounds > 1:
            raise ValueError(f"compression={self.compressor.name or compression!r} needs {self.compressor.rounds} "
                             f"rounds; FSDP's reduce-scatter has one")
        if self.compressor.votes:
            raise ValueError(f"compression={self.compressor.name or compression!r} takes a majority vote; FSDP "
                             f"needs the average of the gradients")
        self.name, self.timeout = name, timeout
        self._comms: Dict[Any, TorchCommunicator] = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _comm(self, group: dist.ProcessGroup) -> TorchCommunicator:
        if group not in self._comms:
            self._comms[group] = TorchCommunicator(group, self.timeout)
        return self._comms[group]

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        average = op == dist.ReduceOp.AVG
        if not average and op != dist.ReduceOp.SUM:
            raise ValueError(f"{self.name}: the compressed reduce-scatter sums or averages, not {op}")
        if self.compressor.lossless:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return None
        comm = self._comm(group)
        chunks = input_tensor.view(comm.size, -1)
        finite = bool(all_finite(input_tensor))
        sent = []  # (compensated chunk, its memory key, its payload) per destination
        for dest in range(comm.size):
            key = f"{self.name}.{dest}"
            compensated = self.memory.compensate(chunks[dest].clone(), key) if finite else \
                torch.zeros_like(chunks[dest])
            payload, ctx = self.compressor.compress(compensated, key)
            sent.append((compensated, key, tuple(t.clone() for t in payload)))  # scratch: reused by the next chunk
        rows, specs = pack_rows([payload for _, _, payload in sent])
        flag = torch.full((comm.size, _FLAG_BYTES), int(not finite), dtype=torch.uint8)  # keeps rows 8-aligned
        received = comm.alltoall(torch.cat([rows, flag], dim=1).reshape(-1),
                                 f"{self.name}: compressed reduce-scatter").view(comm.size, -1)
        if bool(received[:, -1].any()):  # a rank's gradients overflowed: every rank's shard is NaN,
            output_tensor.fill_(float("nan"))  # and every rank's memories stay as they were
            return None
        for compensated, key, payload in sent:
            self.memory.update(compensated, key, self.compressor.decompress(payload, ctx))
        payloads = [unpack_payload(received[src, :-_FLAG_BYTES], specs[comm.rank]) for src in range(comm.size)]
        output_tensor.copy_(self.compressor.aggregate(payloads, ctx, comm.size, average))
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])


def compress(model: torch.nn.Module, compression: Union[str, Compressor] = "none",
             memory: Union[str, Memory, None] = None, **options: Any) -> List[CompressedReduceScatter]:
    """Give every FSDP2 module of ``model`` (``fully_shard`` applied) its own
    :class:`CompressedReduceScatter`; returns them in ``model.modules()`` order.  ``compression``
    and ``memory`` are names or instances (a fresh instance per module when given by name)."""
    from torch.distributed.fsdp import FSDPModule

    CompressedReduceScatter(compression, memory, **options)  # refuses a codec it cannot carry, model untouched
    modules = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("mc.fsdp.compress: the model has no FSDP2 module; apply "
                         "torch.distributed.fsdp.fully_shard first")
    comms = [CompressedReduceScatter(compression, memory, name=name, **options) for name, _ in modules]
    for comm, (_, module) in zip(comms, modules):
        module.set_custom_reduce_scatter(comm)
    return comms
