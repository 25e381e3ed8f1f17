"""DiLoCo: local steps, and every ``sync_every`` of them one compressed exchange of the
parameters' change (Douillard et al., 2023), for links too slow for an exchange per step;
Streaming DiLoCo (Douillard et al., 2025) where the parameters are split into fragments.

Each rank takes ``sync_every`` (H) steps of its own optimizer (the *inner* one, AdamW in the
papers) with no communication.  Then its pseudo-gradient, the global parameters minus its local
ones, goes through the same merged groups, compressor and error-feedback memory as any
gradient (:class:`~mergecomp.pipeline.planned.PlannedStep`; the memory keeps this rank's
residual of the pseudo-gradient), is averaged over the ranks, and the *outer* optimizer
(Nesterov SGD, lr 0.7, momentum 0.9, as the paper) steps the global parameters with it; every
rank continues from them::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    diloco = mc.DiLoCo(model.named_parameters(), opt, sync_every=100, compression="topk")
    for x, y in data:                       # the training loop is unchanged
        loss_fn(model(x), y).backward()
        opt.step()                          # every 100th step also synchronizes (a step hook)
        opt.zero_grad()

Streaming (``fragments=P``): the parameters split into P fragments, each with its own merged
step, memory and outer optimizer; fragment ``p`` sends its pseudo-gradient at the steps
``(p + 1) * H // P`` modulo H, so a sync moves 1/P of the model and the link is busy P times
as often with a P-th of the bytes.  With ``fragment_sync_delay=d`` the exchange stays in flight
over the next d inner steps (the collectives progress while the model computes) and the outer
step lands then; the fragment's local parameters, which went on training meanwhile, become
``alpha * local + (1 - alpha) * global`` (``fragment_update_alpha``; 0: the global ones).
``fragment_sync_delay="auto"`` times the first round (each fragment's exchange waited for at
once) and then keeps each exchange in flight for the fewest inner steps that cover it.
``fragment_codecs="auto"`` times the same round and then gives each fragment the least lossy
codec whose exchange fits the inner steps it is in flight: the exact average on a fast link,
fp16, 8- or 4-bit QSGD, down to ``compression`` on a slow one
(:mod:`mergecomp.scheduler.fragment_codecs`), so one configuration serves every link.
``fragments="auto"`` chooses P for the link before the first send: the smallest delay, at most a
quarter of H, behind which some count's exchange hides, and the fewest fragments (two at least
where H >= 4) that hide it there (the loss follows the delay;
:mod:`mergecomp.scheduler.fragment_count`), and with it the delay and codecs, from predictions
instead of a timed round.

Bytes per rank: one pseudo-gradient per ``sync_every`` steps, at the compressor's bits per
element.  Memory per rank: the global parameters and the outer optimizer's state besides the
model's, and the memories (:meth:`DiLoCo.state_bytes`).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from mergecomp.compressors.base.compressor import Compressor, bits_per_element
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.torch_dist import TorchCommunicator
from mergecomp.exchange.plan import COMPRESSED, EXEMPT, GroupPlan, cut_evenly
from mergecomp.horovod_api.runtime import communicator
from mergecomp.pipeline.options import FrontEnd, StepOptions
from mergecomp.pipeline.planned import PlannedStep
from mergecomp.pipeline.resharding import to_fold
from mergecomp.scheduler import fragment_count
from mergecomp.scheduler.fragment_codecs import FIT_SHARE, LADDER, NAMES, Candidate, choose
from mergecomp.scheduler.probes import exchange_within, exchanges_within

from .functions import broadcast_tensors

__all__ = ["DiLoCo", "averaging", "nesterov"]

logger = logging.getLogger("mergecomp")

Params = Union[Iterable[torch.nn.Parameter], Iterable[Tuple[str, torch.nn.Parameter]]]


def nesterov(params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """The papers' outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def averaging(params: List[torch.Tensor]) -> torch.optim.Optimizer:
    """Local SGD's outer step: SGD at lr 1 without momentum, which sets the global parameters to
    the ranks' average (``outer_optimizer=mc.averaging``; what the slow-link benchmarks ran)."""
    return torch.optim.SGD(params, lr=1.0)


def _named(params: Params) -> Tuple[List[str], List[torch.nn.Parameter]]:
    items = list(params)
    if all(isinstance(item, tuple) and len(item) == 2 for item in items):
        named = [(name, p) for name, p in items if p.requires_grad]
    elif all(isinstance(item, torch.Tensor) for item in items):
        named = [(f"param.{i}", p) for i, p in enumerate(items) if p.requires_grad]
    else:
        raise TypeError("DiLoCo: params must be parameters or (name, parameter) pairs, e.g. model.named_parameters()")
    if not named:
        raise ValueError("DiLoCo: no parameter requires a gradient")
    return [name for name, _ in named], [p for _, p in named]


def _split(params: List[torch.nn.Parameter], fragments: Union[int, Sequence[torch.nn.Module]]) -> List[List[int]]:
    """The indices of ``params`` in each fragment: ``fragments`` consecutive runs of about equal
    elements, or each module's parameters (every parameter in exactly one module)."""
    if isinstance(fragments, bool) or not isinstance(fragments, (int, list, tuple)):
        raise TypeError(f"DiLoCo: fragments must be an int, a list of modules or 'auto', got {fragments!r}")
    if isinstance(fragments, int):
        if not 1 <= fragments <= len(params):
            raise ValueError(f"DiLoCo: fragments must be between 1 and the {len(params)} parameters, got {fragments}")
        return cut_evenly(range(len(params)), [p.numel() for p in params], fragments)
    position = {id(p): i for i, p in enumerate(params)}
    split, seen = [], {}
    for k, module in enumerate(fragments):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DiLoCo: fragments[{k}] must be a torch.nn.Module, got {type(module).__name__}")
        mine = [position[id(p)] for p in module.parameters() if id(p) in position]
        twice = [i for i in mine if i in seen]
        if twice:
            raise ValueError(f"DiLoCo: parameter {twice[0]} is in fragments {seen[twice[0]]} and {k}")
        if not mine:
            raise ValueError(f"DiLoCo: fragments[{k}] holds none of the parameters DiLoCo synchronizes")
        seen.update((i, k) for i in mine)
        split.append(sorted(mine))
    left = [i for i in range(len(params)) if i not in seen]
    if left:
        raise ValueError(f"DiLoCo: parameters {left[:8]} (by position) are in no fragment")
    return split


@dataclass
class _Fragment:
    """One fragment: its parameters (indices), merged step and outer optimizer, and the step
    within each round of H at which it sends."""

    indices: List[int]
    merged: PlannedStep
    outer_optimizer: torch.optim.Optimizer
    offset: int


@dataclass
class _InFlight:
    """A fragment's exchange between its send and the inner step ``due`` that applies it;
    ``averaged``: its result once received (None before; an empty list for a skipped round)."""

    fragment: int
    due: int
    averaged: Optional[List[torch.Tensor]] = None


#: ``fragments="auto"`` replays a probe size on the link while its exchange would take at most this
#: many inner steps; longer ones are extrapolated (an exchange is affine in its bytes)
PROBE_STEPS = 4


def covering_delay(exchange_s: float, step_s: float, limit: int) -> int:
    """The fewest inner steps of ``step_s`` seconds that cover a timed exchange of ``exchange_s``
    seconds (:func:`~mergecomp.scheduler.fragment_count.covering` of the whole steps), at least 1
    and at most ``limit``."""
    return min(limit, fragment_count.covering(exchange_s, step_s, share=1.0))


class _FirstRoundClock:
    """The first round's measurements on this rank, for ``fragment_sync_delay="auto"`` and
    ``fragment_codecs="auto"``: each fragment's first exchange (sent and waited for at once:
    send to result, seconds; ``codecs``: the plan codec it went by) and the inner steps between
    the step hooks (seconds, DiLoCo's own work left out)."""

    def __init__(self, fragments: int, saved: Optional[Dict[str, list]] = None) -> None:
        self.exchange_s: List[Optional[float]] = list(saved["exchange_s"]) if saved else [None] * fragments
        self.codecs: List[str] = list(saved.get("codecs", [COMPRESSED] * fragments)) if saved else [COMPRESSED] * fragments
        self.step_s: List[float] = list(saved["step_s"]) if saved else []
        self._hook_left: Optional[float] = None
        self._sent_at = 0.0

    def state_dict(self) -> Dict[str, list]:
        return {"exchange_s": list(self.exchange_s), "codecs": list(self.codecs), "step_s": list(self.step_s)}

    def step_began(self) -> None:
        if self._hook_left is not None:
            self.step_s.append(time.perf_counter() - self._hook_left)

    def step_ended(self) -> None:
        self._hook_left = time.perf_counter()

    def sent(self, k: int, codec: str) -> None:
        self.codecs[k] = codec
        self._sent_at = time.perf_counter()

    def landed(self, k: int) -> None:
        self.exchange_s[k] = time.perf_counter() - self._sent_at

    @property
    def timed(self) -> bool:
        """Whether every fragment's exchange and at least one inner step were timed."""
        return all(s is not None for s in self.exchange_s) and bool(self.step_s)


class DiLoCo:
    """Synchronize ``params`` every ``sync_every`` steps of ``inner_optimizer`` (module docstring).

    Args:
        params: the parameters the inner optimizer trains, or ``model.named_parameters()`` (the
            names serve ``groups`` and ``uncompressed`` specs and errors); frozen ones are left
            alone.  Every rank starts from rank 0's values (broadcast here).
        inner_optimizer: the optimizer of the local steps; each of its ``step()`` calls counts
            (a post-step hook), and a fragment's send or outer step happens before it returns.
        sync_every: H, the local steps between a fragment's synchronizations (an int >= 1, the
            same on every rank).
        compression, memory: what the pseudo-gradients travel with, as for
            :class:`~frameworks.torch.optimizer.DistributedOptimizer` (default ``"none"``: the
            exact average, dense DiLoCo).  Each fragment holds its own copy of an instance.
        outer_optimizer: a function of a fragment's global parameters (a list of tensors)
            returning its outer optimizer; default :func:`nesterov`.
        fragments: Streaming DiLoCo's fragments: an int P (consecutive parameters, about equal
            elements each; 1 <= P <= H) or a list of modules (each one's parameters; every
            parameter in exactly one), as ``model_fragments`` in torchft; or ``"auto"`` (with a
            ``fragment_sync_delay`` of ``"auto"`` or >= 1): at the second inner step, before any
            fragment sends, the smallest delay, at most a quarter of H (or the delay given),
            behind which some count's exchange hides and the fewest fragments (two at least
            where H >= 4) that hide it there, each count's exchange predicted on the link with
            ``compression``; where none does, the count that holds the inner steps up least
            (:mod:`mergecomp.scheduler.fragment_count`; :attr:`fragment_choice`; logged; a
            warning where no count hides it).  One fragment
            until then; a :meth:`sync` before the choice keeps one.
        fragment_sync_delay: inner steps a fragment's exchange stays in flight before its outer
            step (0 <= d < H // P), or ``"auto"`` (H // P >= 2; with ``fragments="auto"`` chosen
            with them, from the predicted exchanges, not timed): the first round is sent and
            waited for at once and timed, then every rank takes the fewest inner steps that
            cover the slowest rank's slowest exchange at the fastest rank's median step, at
            least 1 and at most H // P - 1 (:attr:`sync_delay`; logged; one allgather).
        fragment_update_alpha: how much of its local parameters a fragment keeps when its outer
            step lands (0 <= alpha < 1; 0: it takes the global ones, and every rank's are equal).
        fragment_codecs: None (every fragment sends with ``compression``) or ``"auto"``: the
            first round is sent with ``compression``, waited for at once and timed; then each
            fragment takes the least lossy of the exact average, fp16, 8-bit and 4-bit QSGD
            (unbiased, outside error feedback) whose exchange fits 3/4 of the inner steps it
            is in flight (``fragment_sync_delay``, or with ``"auto"`` H // P - 1 of them, at the
            fastest rank's median step; with ``fragments="auto"`` the delay chosen, at its step
            time, right away), never one of fewer bits than ``compression``, which is
            kept where none fits.  Each candidate's exchange is predicted by probing it (its
            work rehearsed at the fragment's size, its collectives replayed on the link, from
            the fewest bits up until one overruns: a slow link probes the small codecs only);
            :attr:`fragment_codecs`, :attr:`codec_choices` (with the probing's seconds); logged.
            Needs a delay (``"auto"`` or >= 1) and fixed ``groups`` (default 1 per fragment).
        grad_scaler: the ``torch.amp.GradScaler`` of the inner steps, if any: a step it skips
            for Inf/NaN is skipped on that rank alone (no gradient is exchanged), so the steps
            are counted at its ``update()``, which every rank calls every iteration, and the
            ranks stay in step.
        process_group: a ``torch.distributed`` group to run on (a framework's, as a DDP model's);
            default: the engine of ``mc.init()``.
        options: the merged step's (:data:`~mergecomp.pipeline.options.FRONT_ENDS` ``"DiLoCo"``):
            ``groups`` (within each fragment), ``nonfinite`` (default ``"skip"``: a NaN/Inf
            pseudo-gradient on any rank skips the fragment's outer step on every rank, whose
            parameters go back to its old global ones; counted in ``skipped_steps``; or
            ``"raise"``), ``scheme``, ``uncompressed``, ``min_compress_numel``,
            ``compression_warmup_steps`` (each fragment's first synchronizations sent exactly),
            ``compression_warmup_codec``, ``scheduler``.
    """

    def __init__(self, params: Params, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 compression: Union[str, Compressor] = "none", memory: Union[str, Memory, None] = None,
                 outer_optimizer: Optional[Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = None,
                 fragments: Union[int, Sequence[torch.nn.Module]] = 1, fragment_sync_delay: Union[int, str] = 0,
                 fragment_update_alpha: float = 0.0, fragment_codecs: Optional[str] = None, grad_scaler: Any = None,
                 process_group: Any = None, **options: Any) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        names, self.params = _named(params)
        #: the optimizer of the inner steps
        self.inner_optimizer = inner_optimizer
        #: whether ``fragments="auto"`` has yet to choose (one fragment until then)
        self._count_auto = fragments == "auto"
        split = [list(range(len(self.params)))] if self._count_auto else _split(self.params, fragments)
        if len(split) > sync_every:
            raise ValueError(f"DiLoCo: {len(split)} fragments cannot each sync at its own step of sync_every="
                             f"{sync_every}")
        limit = sync_every // len(split)
        if fragment_sync_delay == "auto":
            if limit < 2:
                raise ValueError(f"DiLoCo: fragment_sync_delay='auto' needs sync_every // fragments >= 2 (a delay "
                                 f"of at least 1), got sync_every={sync_every} with {len(split)} fragment(s)")
        elif (isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int)
                or not 0 <= fragment_sync_delay < limit):
            raise ValueError(f"DiLoCo: fragment_sync_delay must be an int in [0, sync_every // fragments = "
                             f"{limit}) or 'auto', got {fragment_sync_delay!r}")
        if self._count_auto and fragment_sync_delay == 0:
            raise ValueError("DiLoCo: fragments='auto' chooses how many fragments hide their exchange behind the "
                             "inner steps: give fragment_sync_delay >= 1 or 'auto'")
        if not isinstance(fragment_update_alpha, (int, float)) or not 0 <= fragment_update_alpha < 1:
            raise ValueError(f"DiLoCo: fragment_update_alpha must be in [0, 1), got {fragment_update_alpha!r}")
        if fragment_codecs not in (None, "auto"):
            raise ValueError(f"DiLoCo: fragment_codecs must be None or 'auto', got {fragment_codecs!r}")
        self._codecs_auto = fragment_codecs == "auto"
        if self._codecs_auto:
            if fragment_sync_delay == 0:
                raise ValueError("DiLoCo: fragment_codecs='auto' fits each fragment's codec into the inner steps its "
                                 "exchange is in flight: give fragment_sync_delay >= 1 or 'auto'")
            if options.get("groups", 1) == "auto":
                raise ValueError("DiLoCo: groups='auto' searches each fragment's groups and codecs for the fastest "
                                 "exchange, fragment_codecs='auto' the codec that fits the inner steps: give one "
                                 "(fragment_codecs='auto' takes 1 group per fragment unless groups= says otherwise)")
            options.setdefault("groups", 1)
        self.sync_every, self.update_alpha = sync_every, float(fragment_update_alpha)
        self._auto = auto = fragment_sync_delay == "auto"
        #: inner steps a fragment's exchange stays in flight; None while ``"auto"`` times the first round
        self.sync_delay: Optional[int] = None if auto else fragment_sync_delay
        self._clock = _FirstRoundClock(len(split)) if auto or self._codecs_auto or self._count_auto else None
        #: each fragment's codec (a plan codec name) once ``fragment_codecs="auto"`` chose; None before
        self.fragment_codecs: Optional[List[str]] = None
        #: ``fragment_codecs="auto"``'s decision per fragment: the codec, its predicted exchange
        #: and every candidate's (seconds), the timed exchange and the window
        self.codec_choices: List[Dict[str, Any]] = []
        #: ``fragments="auto"``'s decision: the fragments, the delay, the step time and each
        #: fragment count's predicted exchange (empty before, and where ``fragments`` was given)
        self.fragment_choice: Dict[str, Any] = {}
        self._names, self._step_options = names, StepOptions.create("DiLoCo", options)
        self._given = (compression, memory, outer_optimizer or nesterov)
        self._agree = (("sync_every", sync_every), ("fragment_sync_delay", fragment_sync_delay),
                       ("fragment_update_alpha", self.update_alpha), ("fragment_codecs", fragment_codecs))
        self._comm = comm = communicator() if process_group is None else TorchCommunicator(process_group)
        broadcast_tensors(comm, list(zip(names, (p.data for p in self.params))), root_rank=0)
        #: the parameters every rank last agreed on, which the outer optimizers step
        self.global_params = [p.detach().clone() for p in self.params]
        self.fragments = self._built(split, "auto" if self._count_auto else None)
        #: the inner steps taken so far (checkpointed)
        self.inner_steps = 0
        self._in_flight: Optional[_InFlight] = None
        self._scaler = grad_scaler
        if grad_scaler is None:
            self._hook = inner_optimizer.register_step_post_hook(self._counted)
        else:
            update = grad_scaler.update

            def counted_update(*args: Any, **kwargs: Any) -> None:
                update(*args, **kwargs)
                self._counted()
            grad_scaler.update = counted_update  # on the instance; close() removes it

    def _built(self, split: List[List[int]], described: Optional[str] = None) -> List[_Fragment]:
        """The fragments of ``split`` (parameter indices), each with its merged step (agreeing on
        the split, or on ``described`` where given) and outer optimizer, sending at its offset."""
        compression, memory, outer_optimizer = self._given
        copies = len(split) > 1 or self._count_auto  # "auto" may build them twice

        def own(given: Any) -> Any:  # each fragment its own instance (names build fresh ones)
            return copy.deepcopy(given) if copies and given is not None and not isinstance(given, str) else given
        agree = (("fragments", described or [[self._names[i] for i in f] for f in split]), *self._agree)
        built = []
        for k, indices in enumerate(split):
            merged = PlannedStep(
                own(compression), own(memory), self._comm, [self._names[i] for i in indices],
                [self.params[i].shape for i in indices], [self.params[i].dtype for i in indices],
                self.params[0].device, self._step_options,
                FrontEnd("DiLoCo", "parameters", observe_order=False, timed=False, in_place=True, agree=agree))
            outer = outer_optimizer([self.global_params[i] for i in indices])
            built.append(_Fragment(indices, merged, outer, (k + 1) * self.sync_every // len(split) % self.sync_every))
        return built

    _delay_limit = property(lambda self: self.sync_every // len(self.fragments) - 1,
                            doc="the longest delay the fragments leave room for: H // P - 1")
    compressor = property(lambda self: self.fragments[0].merged.exchange.compressor,
                          doc="the configured compressor (the first fragment's)")
    outer_optimizer = property(lambda self: self.fragments[0].outer_optimizer,
                               doc="the first fragment's outer optimizer (the only one without fragments)")
    skipped_steps = property(lambda self: sum(f.merged.skipped_steps for f in self.fragments),
                             doc="fragments' outer steps skipped for NaN/Inf")
    in_flight = property(lambda self: None if self._in_flight is None else self._in_flight.fragment,
                         doc="the fragment whose exchange is in flight, or None")

    def _counted(self, *_: Any) -> None:
        clock = self._clock
        if clock is not None:
            clock.step_began()
        self.inner_steps += 1
        if self._count_auto and clock.step_s:
            self._choose_fragments()
        for k, fragment in enumerate(self.fragments):
            if self.inner_steps % self.sync_every == fragment.offset:
                self._send(k)
        if self._in_flight is not None and self._in_flight.due == self.inner_steps:
            self._land()
        if clock is not None:
            clock.step_ended()

    @torch.no_grad()
    def _send(self, k: int) -> None:
        """Start fragment ``k``'s exchange of its pseudo-gradient (global minus local)."""
        fragment = self.fragments[k]
        timing = self._clock is not None  # the first round: waited for at once
        if timing:
            self._clock.sent(k, fragment.merged.route(COMPRESSED).name)
        for slot, i in enumerate(fragment.indices):  # once per fragment's sync
            out = fragment.merged.slot(slot)
            torch.sub(self.global_params[i], self.params[i], out=out)
            fragment.merged.add(slot, out)
        self._in_flight = _InFlight(k, self.inner_steps + (0 if timing else self.sync_delay))

    def _receive(self) -> None:
        """Wait for the fragment in flight: its averaged pseudo-gradient (empty where skipped)."""
        flight = self._in_flight
        if flight.averaged is None:
            fragment = self.fragments[flight.fragment]
            reduced = fragment.merged.finish()
            flight.averaged = [] if reduced is None else reduced.tensors(len(fragment.indices))

    @torch.no_grad()
    def _land(self, alpha: Optional[float] = None) -> bool:
        """The fragment in flight's outer step, and its local parameters merged with the new
        global ones (keeping ``alpha`` of theirs; default ``fragment_update_alpha``).  False where
        its round was skipped (its global parameters unchanged)."""
        self._receive()
        flight, self._in_flight = self._in_flight, None
        if self._clock is not None:
            self._clock.landed(flight.fragment)
            if self._clock.timed:
                self._choose()
        fragment = self.fragments[flight.fragment]
        globals_ = [self.global_params[i] for i in fragment.indices]
        if flight.averaged:
            for g, averaged in zip(globals_, flight.averaged):
                g.grad = averaged.view_as(g)
            fragment.outer_optimizer.step()
            for g in globals_:
                g.grad = None
        locals_ = [self.params[i].data for i in fragment.indices]
        alpha = self.update_alpha if alpha is None else alpha
        if alpha:
            torch._foreach_lerp_(locals_, globals_, 1.0 - alpha)
        else:
            torch._foreach_copy_(locals_, globals_)
        return bool(flight.averaged)

    @torch.no_grad()
    def _choose_fragments(self) -> None:
        """``fragments="auto"``, before the first send: every fragment count P whose first
        fragment has yet to send (H // P >= this step) and that leaves room for the delay, its
        largest fragment's exchange with ``compression`` predicted on the link
        (:func:`~mergecomp.scheduler.probes.exchanges_within`, sizes whose exchange would take
        over :data:`PROBE_STEPS` inner steps extrapolated), against the fastest rank's last inner
        step (one allgather); :func:`~mergecomp.scheduler.fragment_count.choose` picks P and,
        with ``fragment_sync_delay="auto"``, the delay; ``fragment_codecs="auto"`` then fits each
        fragment's codec into that delay's inner steps (the delay then what the codecs chosen
        need, if fewer).  The same on every rank."""
        began, clock, fixed = time.perf_counter(), self._clock, None if self._auto else self.sync_delay
        step_s = float(self._comm.allgather(torch.tensor([clock.step_s[-1]], dtype=torch.float64).to(
            self._comm.device), "DiLoCo's inner step time").min())
        sync_every, numels = self.sync_every, [p.numel() for p in self.params]
        least = max((fixed or 1) + 1, self.inner_steps)
        candidates = [1, *range(2, min(len(numels), sync_every // least) + 1)]
        splits = {p: _split(self.params, p) for p in candidates}
        largest = {p: max(sum(numels[i] for i in f) for f in split) for p, split in splits.items()}
        first = self.params[0]
        probed = exchanges_within(self._comm, self.compressor, COMPRESSED, sorted(set(largest.values())), first.dtype,
                                  first.device, PROBE_STEPS * FIT_SHARE * step_s)
        exchange_s = {p: sum(probed[size]) for p, size in largest.items()}
        choice = fragment_count.choose(exchange_s, step_s, sync_every, fixed)
        count, delay = choice["fragments"], choice["delay"]
        if count > 1:
            self.fragments = self._built(splits[count])
        self._count_auto, self._clock = False, None
        if self._codecs_auto:
            predicted = [self._choose_codec(k, delay * step_s, exchange_s[count]) for k in range(count)]
            self.fragment_codecs = [c["codec"] for c in self.codec_choices]
            if self._auto:
                delay = min(delay, fragment_count.covering(max(predicted), step_s))
        self.sync_delay = delay
        self.fragment_choice = {**choice, "delay": delay, "exchange_s": exchange_s, "step_s": step_s,
                                "probe_s": time.perf_counter() - began}
        logger.info("DiLoCo: fragments='auto' syncs %d fragment(s), each exchange in flight for %d inner step(s)%s: "
                    "the largest fragment's exchange predicted %s s by fragment count, the fastest rank's inner step "
                    "%.3f s (probed in %.2f s)", count, delay,
                    "" if self.fragment_codecs is None else f", sent with {[NAMES[c] for c in self.fragment_codecs]}",
                    {p: round(s, 4) for p, s in exchange_s.items()}, step_s, self.fragment_choice["probe_s"])
        if not choice["hidden"]:
            logger.warning("DiLoCo: fragments='auto': no fragment count hides the exchange behind the inner steps "
                           "(the whole model's takes %.3f s, a round of %d inner steps %.3f s): %d fragments %d "
                           "step(s) late are predicted to hold each round up %.3f s; raise sync_every or choose a "
                           "compressor of fewer bits", exchange_s[1], sync_every, sync_every * step_s, count, delay,
                           choice["wait_s"])

    def _choose(self) -> None:
        """After the timed first round: ``fragment_codecs="auto"``'s codecs, then
        ``fragment_sync_delay="auto"``'s delay covering the slowest fragment's exchange with its
        codec, from every rank's timings (one allgather), the same on every rank."""
        clock, self._clock = self._clock, None
        median_step = sorted(clock.step_s)[len(clock.step_s) // 2]
        mine = torch.tensor([*clock.exchange_s, median_step], dtype=torch.float64)
        every = self._comm.allgather(mine.to(self._comm.device), "DiLoCo's first-round timings").cpu()
        exchange_s, step_s = every[:, :-1].max(dim=0).values.tolist(), float(every[:, -1].min())
        if self._codecs_auto:
            window_s = (self._delay_limit if self._auto else self.sync_delay) * step_s
            timed_route = [f.merged.route(COMPRESSED, compressing=True).name for f in self.fragments]
            exchange_s = [self._choose_codec(k, window_s, seconds if clock.codecs[k] == timed_route[k] else None)
                          for k, seconds in enumerate(exchange_s)]
            self.fragment_codecs = [choice["codec"] for choice in self.codec_choices]
            logger.info("DiLoCo: fragment_codecs='auto' sends the fragments with %s (predicted exchanges %s s, "
                        "window %.3f s: the fastest rank's median inner step %.3f s)",
                        [NAMES[c] for c in self.fragment_codecs],
                        ", ".join(f"{t:.3f}" for t in exchange_s), window_s, step_s)
        if self._auto:
            self.sync_delay = covering_delay(max(exchange_s), step_s, self._delay_limit)
            logger.info("DiLoCo: fragment_sync_delay='auto' keeps each exchange in flight for %d inner step(s): the "
                        "slowest exchange takes %.3f s, the fastest rank's median inner step %.3f s (at most %d)",
                        self.sync_delay, max(exchange_s), step_s, self._delay_limit)

    def _choose_codec(self, k: int, window_s: float, floor_s: Optional[float]) -> float:
        """Fragment ``k``'s codec (:func:`~mergecomp.scheduler.fragment_codecs.choose`, each
        candidate probed by :func:`~mergecomp.scheduler.probes.exchange_within` as one flat group
        of the fragment's elements; ``floor_s``: the compressor's exchange, timed or predicted,
        None: probed too), set in its plan; returns its predicted exchange in seconds."""
        merged = self.fragments[k].merged
        first = self.params[self.fragments[k].indices[0]]
        shapes = [self.params[i].shape for i in self.fragments[k].indices]
        numel = sum(shape.numel() for shape in shapes)

        def candidate(codec: str) -> Candidate:  # bits_per_element encodes a fragment of zeros: once per codec
            return Candidate(codec, bits_per_element(merged.exchange.route(codec).compressor, numel, shapes=shapes))

        def predict(c: Candidate) -> Tuple[float, float]:
            return exchange_within(self._comm, merged.exchange.compressor, c.codec, numel, first.dtype, first.device,
                                   FIT_SHARE * window_s)
        began = time.perf_counter()
        floor = candidate(COMPRESSED)
        floor_s = sum(predict(floor)) if floor_s is None else floor_s
        choice = choose(floor_s, [*map(candidate, LADDER), floor], predict, window_s)
        self.codec_choices.append({**choice, "window_s": window_s, "probe_s": time.perf_counter() - began})
        plan = merged.plan
        merged.set_plan(GroupPlan(plan.groups, tuple(EXEMPT if c == EXEMPT else choice["codec"]
                                                     for c in plan.codec_names())))
        return choice["predicted_s"]

    def sync(self) -> bool:
        """Land the fragment in flight, then synchronize every fragment now, every rank's
        parameters becoming the global ones whatever ``fragment_update_alpha`` (at the end of
        training: one model on every rank).  False where any fragment's round was skipped."""
        if self._count_auto:  # nothing timed yet: the fragments stay one, the rest is timed as with fragments=1
            self._count_auto = False
            self._clock = self._clock if self._auto or self._codecs_auto else None
            logger.info("DiLoCo: fragments='auto': sync() before the choice keeps one fragment")
        landed = self._land() if self._in_flight is not None else True
        for k in range(len(self.fragments)):
            self._send(k)
            landed = self._land(alpha=0.0) and landed
        return landed

    def state_bytes(self) -> int:
        """Bytes this rank keeps for DiLoCo besides the model: the global parameters, the outer
        optimizers' state and the error-feedback memories."""
        outer = [t for f in self.fragments for s in f.outer_optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        memory = [t for f in self.fragments for fields in f.merged.exchange.memory.state_dict().values()
                  for t in fields.values()]
        return sum(t.numel() * t.element_size() for t in self.global_params + outer + memory)

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The global parameters, the outer optimizers' state, the inner steps counted,
        ``fragment_sync_delay="auto"``'s choice (or its timings so far), each fragment's merged
        step (plan, compressor state, this rank's memory) and a fragment's exchange in flight
        (received first: every rank must call this at the same step); save it beside the
        model's and the inner optimizer's."""
        flight = self._in_flight
        if flight is not None:
            self._receive()
        return {"global_params": [g.clone() for g in self.global_params], "inner_steps": self.inner_steps,
                "fragment_count": None if self._count_auto else len(self.fragments),
                "fragment_choice": dict(self.fragment_choice),
                "fragment_sync_delay": self.sync_delay, "fragment_codecs": self.fragment_codecs,
                "codec_choices": list(self.codec_choices),
                "delay_timings": None if self._clock is None else self._clock.state_dict(),
                "fragments": [{"parameters": len(f.indices), "outer_optimizer": f.outer_optimizer.state_dict(),
                               "mergecomp": f.merged.state_dict()} for f in self.fragments],
                "in_flight": None if flight is None else {"fragment": flight.fragment, "due": flight.due,
                                                          "averaged": [t.clone() for t in flight.averaged]}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s, on every rank with its own, between steps."""
        saved = state["global_params"]
        if [tuple(t.shape) for t in saved] != [tuple(g.shape) for g in self.global_params]:
            raise ValueError("DiLoCo.load_state_dict: the checkpoint's global parameters do not match these "
                             "parameters' shapes")
        count = state.get("fragment_count")
        if self._count_auto and count is not None:  # what the saving run chose
            if count > 1:
                self.fragments = self._built(_split(self.params, count))
            self._count_auto = False
            self.fragment_choice = dict(state.get("fragment_choice", {}))
        if [f["parameters"] for f in state["fragments"]] != [len(f.indices) for f in self.fragments]:
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint has fragments of "
                             f"{[f['parameters'] for f in state['fragments']]} parameters, this DiLoCo "
                             f"{[len(f.indices) for f in self.fragments]}")
        if self._in_flight is not None:
            raise RuntimeError("DiLoCo.load_state_dict: a fragment's exchange is in flight; load before training")
        for g, t in zip(self.global_params, saved):
            g.copy_(t)
        for fragment, saved_fragment in zip(self.fragments, state["fragments"]):
            fragment.outer_optimizer.load_state_dict(saved_fragment["outer_optimizer"])
            fragment.merged.load_state_dict(saved_fragment["mergecomp"])
        self.inner_steps = int(state["inner_steps"])
        if self._auto or self._codecs_auto:  # what the saving run chose, else its timings so far (none: afresh)
            delay, codecs = state.get("fragment_sync_delay"), state.get("fragment_codecs")
            chosen = (not self._auto or delay is not None) and (not self._codecs_auto or codecs is not None)
            if self._auto:
                self.sync_delay = delay if chosen else None
            if self._codecs_auto:
                self.fragment_codecs = codecs if chosen else None
                self.codec_choices = list(state.get("codec_choices", [])) if chosen else []
            # once chosen, the plans with their codecs came with the merged steps' state
            self._clock = None if chosen else _FirstRoundClock(len(self.fragments), state.get("delay_timings"))
        if self._count_auto:  # saved before the choice: timed afresh, from here to the next step on
            self._clock = _FirstRoundClock(1, state.get("delay_timings"))
            self._clock.step_ended()
        flight = state["in_flight"]
        self._in_flight = None if flight is None else _InFlight(flight["fragment"], flight["due"], flight["averaged"])

    def load_every_rank(self, states: Sequence[Dict[str, Any]], residuals: str = "fold") -> None:
        """Resume from every rank's :meth:`state_dict` of the job that saved them (in rank
        order), on this world whatever its size (a torchrun elastic restart), between steps,
        every rank: the global parameters, the outer optimizers' state, the inner steps and a
        fragment in flight from rank 0's (the ranks' are equal); each fragment's error-feedback
        memory this rank's own where the world kept its size, else the mean of the old ranks'
        (``"fold"``) or none (``"drop"``).  The local parameters and the inner optimizer's
        state, which differ between the ranks until the next sync, are the caller's to load: on
        another number of ranks, one rank's on every rank (e.g. rank 0's)."""
        self.load_state_dict(self.every_rank_state(states, residuals))

    @staticmethod
    def every_rank_state(states: Sequence[Dict[str, Any]], residuals: str = "fold") -> Dict[str, Any]:
        """One :meth:`state_dict` standing for every rank's ``states`` (in rank order), which
        :meth:`load_state_dict` loads as :meth:`load_every_rank` says: rank 0's but for each
        fragment's merged step, which holds every rank's
        (:func:`~mergecomp.pipeline.resharding.to_fold`, folded where it is loaded)."""
        first = states[0]
        return {**first, "fragments": [
            {**fragment, "mergecomp": to_fold([state["fragments"][k]["mergecomp"] for state in states], residuals)}
            for k, fragment in enumerate(first["fragments"])]}

    def close(self) -> None:
        """Stop counting the inner steps."""
        if self._scaler is None:
            self._hook.remove()
        else:
            del self._scaler.update
