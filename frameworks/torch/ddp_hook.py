"""A DDP communication hook: DDP's gradient buckets go through mergecomp's compressors.

Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    state, hook = mc.ddp_comm_hook(compression="powersgd",
                                   named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, hook)
    ...
    torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)   # per rank

Each bucket is one merged group of :class:`mergecomp.exchange.Exchange` (check finite ->
error feedback -> compress -> collective -> decode); nothing is re-implemented here.

When collectives are issued.  DDP calls the hook once per bucket, in bucket order, from the
backward pass.  The hook starts the bucket's first round (async) and returns a pending
``torch.futures.Future``; the call for the last bucket (``bucket.is_last()``) then finishes every
bucket in order on the same thread — waits, further rounds (PowerSGD's second allreduce),
decode, average over ranks — and sets the futures' results.  So every rank issues every
collective from one thread in one order.  PyTorch's own ``powerSGD_hook`` issues its later
rounds from completion callbacks on gloo's thread while the next bucket starts from the backward
thread, and crashed in 10 of 10 runs on gloo (docs/frontends.md).

Error feedback across bucket rebuilds.  A bucket's state (residuals, momenta) is keyed by the
parameters it holds (a :class:`~mergecomp.plan.Group` with their offsets), not by the bucket's
index.  When DDP rebuilds its buckets after the first iteration (or after a restart), each new
bucket's per-element state is assembled from the old buckets' pieces
(:func:`mergecomp.plan.remap_state`); low-rank state (PowerSGD's Q) is re-drawn.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations with the real types.
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from mergecomp.agreement import check_ranks_agree
from mergecomp.compressor import Compressor
from mergecomp.exchange import Exchange, InFlight, NonfiniteCheck
from mergecomp.memory import Memory
from mergecomp.plan import Group, GroupPlan, layout, remap_state

__all__ = ["ddp_comm_hook", "DDPHookState", "mergecomp_hook"]

_NONFINITE = ("raise", "ignore")


class DDPHookState:
    """Settings and state of :func:`mergecomp_hook`: the exchange, the bucket layout, the step.

    Args:
        exchange: compresses and communicates each bucket (average over ranks).
        named_parameters: optional ``model.named_parameters()``; gives each parameter a stable
            index and a name for error messages.  Without it, parameters are numbered in the
            order the first backward pass hands them over (the same on every rank, as DDP builds
            the same buckets everywhere): register the hook before the first backward pass.
        nonfinite: ``"raise"`` (default): one small allreduce per step agrees on NaN/Inf and
            every rank's backward raises FloatingPointError naming the rank and bucket; NaN/Inf
            never enters the error-feedback memory.  ``"ignore"``: no check (like DDP's own
            allreduce, NaN propagates).
    """

    def __init__(self, exchange: Exchange, named_parameters=None, nonfinite: str = "raise") -> None:
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE} for a DDP hook (a hook cannot skip the "
                             f"optimizer step), got {nonfinite!r}")
        self.exchange = exchange
        self.nonfinite = nonfinite
        self._index: Dict[int, int] = {}  # id(parameter) -> index
        self._names: List[str] = []
        self._shapes: Dict[int, torch.Size] = {}
        if named_parameters is not None:
            for name, p in named_parameters:
                if p.requires_grad:
                    self._add_param(p, name)
        self._named = named_parameters is not None
        #: groups of the last completed step, in bucket order
        self.layout: List[Group] = []
        self._groups: Dict[Tuple[int, ...], Group] = {}
        self._current: List[Group] = []
        self._before: Optional[List[Dict[str, Dict[str, torch.Tensor]]]] = None
        self._pending: List[Tuple[InFlight, torch.futures.Future, torch.Tensor]] = []  # job, future, bucket buffer

    @property
    def compressor(self) -> Compressor:
        return self.exchange.compressor

    @property
    def memory(self) -> Memory:
        return self.exchange.memory

    @property
    def step(self) -> int:
        return self.exchange.step

    # -- buckets as groups -----------------------------------------------------------------
    def _add_param(self, p: torch.Tensor, name: str) -> int:
        i = self._index[id(p)] = len(self._names)
        self._names.append(name)
        self._shapes[i] = p.shape
        return i

    def _param_index(self, p: torch.Tensor) -> int:
        i = self._index.get(id(p))
        if i is None:
            if self._named:
                raise ValueError(f"DDP bucket holds a parameter of shape {tuple(p.shape)} that is not among "
                                 f"the named_parameters given to ddp_comm_hook")
            i = self._add_param(p, f"param.{len(self._names)}")
        return i

    def group_of(self, bucket: dist.GradBucket) -> Group:
        """The group (parameter indices and offsets) of the bucket's flat buffer."""
        indices = tuple(self._param_index(p) for p in bucket.parameters())
        group = self._groups.get(indices)
        if group is None:
            group = self._groups[indices] = layout(GroupPlan((indices,)), self._shapes)[0]
        if group.numel != bucket.buffer().numel():
            raise RuntimeError(f"DDP bucket {bucket.index()} holds {bucket.buffer().numel()} elements but its "
                               f"parameters {self.names(group)[:4]} have {group.numel}: unexpected bucket layout")
        return group

    def names(self, group: Group) -> List[str]:
        return [self._names[i] for i in group.indices]

    def _adopt(self, group: Group) -> None:
        """Give a new or changed bucket the state of its parameters from the last layout."""
        if not self.layout:
            return
        holders = (self.exchange.memory, self.exchange.compressor)
        if self._before is None:  # first change this step: later buckets remap from the same snapshot
            self._before = [holder.state_dict() for holder in holders]
        for holder, before in zip(holders, self._before):
            holder.state.pop(group.name, None)
            holder.state.update(remap_state(before, self.layout, [group]))

    def _end_layout(self) -> None:
        if self._current != self.layout:
            keep = {group.name for group in self._current}
            for holder in (self.exchange.memory, self.exchange.compressor):
                holder.state = {name: fields for name, fields in holder.state.items() if name in keep}
        self.layout, self._current, self._before = self._current, [], None

    # -- one step ----------------------------------------------------------------------------
    def start(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if bucket.index() == 0 and self._pending:
            self._fail(RuntimeError("the previous step's buckets were never finished (its backward pass "
                                    "was interrupted); the ranks' collectives are out of step"))
        group = self.group_of(bucket)
        if group not in self.layout:
            self._adopt(group)
        self._current.append(group)
        future: torch.futures.Future = torch.futures.Future()
        # Exchange.start compensates and encodes DDP's bucket buffer in place; finish decodes the
        # result back into it, which DDP then takes as the future's value.
        buffer = bucket.buffer()
        self._pending.append((self.exchange.start(group, buffer), future, buffer))
        return future

    def finish(self) -> None:
        """Finish every pending bucket in bucket order and complete their futures."""
        jobs = [job for job, _, _ in self._pending]
        check = NonfiniteCheck(self.exchange.comm, [job.finite for job in jobs], self.exchange.step) \
            if self.nonfinite == "raise" else None
        results = [self.exchange.finish(job, out=buffer) for job, _, buffer in self._pending]
        bad = check.culprits([job.group.name for job in jobs]) if check else []
        step = self.exchange.step
        self.exchange.step += 1
        self._end_layout()
        if bad:
            by_name = {job.group.name: job.group for job in jobs}
            where = "; ".join(f"rank {rank}, bucket of {self.names(by_name[name])[:4]}" for rank, name in bad)
            self._fail(FloatingPointError(f"non-finite gradient at step {step} ({where})"))
            return
        for (_, future, _), result in zip(self._pending, results):
            future.set_result(result)
        self._pending = []

    def _fail(self, error: BaseException) -> None:
        for _, future, _ in self._pending:
            if not future.done():
                future.set_exception(error)
        self._pending, self._current, self._before = [], [], None
        raise error

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's step, compressor state, error-feedback memory and bucket layout."""
        return {**self.exchange.state_dict(),
                "layout": [{"name": g.name, "indices": list(g.indices), "offsets": list(g.offsets),
                            "shapes": [list(s) for s in g.shapes], "numel": g.numel} for g in self.layout]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (between steps).  If DDP's buckets differ from the saved
        layout (a fresh DDP starts with its initial buckets), the state is remapped on use."""
        if self._pending:
            raise RuntimeError("load_state_dict() must be called between steps")
        self.exchange.load_state_dict(state)
        self.layout = [Group(g["name"], tuple(g["indices"]), tuple(g["offsets"]),
                             tuple(torch.Size(s) for s in g["shapes"]), int(g["numel"])) for g in state["layout"]]
        self._current, self._before = [], None

    def __repr__(self) -> str:
        return (f"DDPHookState(compressor={self.compressor!r}, memory={self.memory!r}, "
                f"buckets={len(self.layout)}, step={self.step})")


def mergecomp_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook; see the module docstring.  Register with ``state``."""
    try:
        future = state.start(bucket)
        if bucket.is_last():
            state.finish()
    except BaseException as error:
        if state._pending:
            state._fail(error)
        raise
    return future


def ddp_comm_hook(
    compression: Union[str, Compressor] = "powersgd",
    memory: Union[str, Memory, None] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
    nonfinite: str = "raise",
    timeout: Optional[float] = None,
) -> Tuple[DDPHookState, Any]:
    """Make ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        compression: compressor name (``mergecomp.compressor_names()``) or instance, e.g.
            ``mergecomp.get_compressor("powersgd", rank=4)``.
        memory: error-feedback memory name or instance; ``None`` = the compressor's default.
        process_group: the DDP model's process group (default: the world).  The hook's
            collectives run on it through :class:`~mergecomp.engines.torch_dist.TorchCommunicator`.
        named_parameters: ``model.named_parameters()`` (recommended: stable indices across
            restarts, names in errors).
        nonfinite: ``"raise"`` or ``"ignore"``, see :class:`DDPHookState`.
        timeout: seconds any one collective may take (default ``MERGECOMP_TIMEOUT`` or 300).

    The hook returns each bucket's gradient averaged over ranks, in the bucket's dtype.
    """
    from mergecomp.engines.torch_dist import TorchCommunicator

    if not dist.is_initialized():
        raise RuntimeError("ddp_comm_hook needs torch.distributed to be initialized (as DDP does)")
    comm = TorchCommunicator(process_group, timeout=timeout)
    exchange = Exchange.create(compression, memory, comm, average=True, check_finite=nonfinite != "ignore")
    state = DDPHookState(exchange, named_parameters, nonfinite)
    check_ranks_agree(exchange, {"parameters (names, shapes)": [(n, tuple(state._shapes[i]))
                                                                for i, n in enumerate(state._names)],
                                 "nonfinite": nonfinite}, "ddp_comm_hook")
    return state, mergecomp_hook
