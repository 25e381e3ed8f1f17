"""Online merge scheduler: profile, predict, verify a few plans, keep the measured best, re-tune.

Driven by a front end that calls :meth:`MergeScheduler.observe` once per completed step on
every rank (the same number of times everywhere), it goes through these phases::

    warmup (W steps, not measured)
      -> profile (1 step): gradient-ready times of that step, plus micro-benchmarks of each
         codec's encode/decode and of the engine's collectives at up to four sizes
         (:mod:`mergecomp.scheduler.probes`); one allgather keeps every number's slowest rank, so every
         rank builds the same cost model
      -> predict: :func:`mergecomp.scheduler.costmodel.search` ranks plans of 1..K groups x codecs;
         the top few plus the best uncompressed plan (plain fused allreduce) become candidates
      -> verify: each candidate runs ``settle + probe`` steps; the median of its probe steps,
         max over ranks, is its measured time
      -> run-off: when the runner-up measured within ``runoff_margin`` of the best, the two
         alternate for ``runoff_rounds`` more visits each (order reversed every round, so a
         drift of the machine weighs on both alike); each one's time is then the median of
         all its probe steps
      -> monitor: the measured best is kept (a retune must beat the incumbent by
         ``min_improvement``); every ``retune_window`` steps the ranks compare the window's
         median with the chosen plan's time, and all re-profile together if it drifted by more
         than ``retune_threshold``.

All decisions are taken from numbers every rank has after the same collective, so all ranks
switch plans at the same step.  Plans can be cached in a JSON file keyed by a model signature.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mergecomp.compressors.base.compressor import Compressor
from mergecomp.compressors.base.memory import Memory
from mergecomp.engines.communicator import Communicator
from mergecomp.exchange.compatibility import carries
from mergecomp.exchange.plan import CODECS, COMPRESSED, GroupPlan, has_codec_choice
from mergecomp.exchange.schemes import HIERARCHICAL, HIERARCHICAL_TWO_PHASE, SHARDED, TWO_PHASE
from mergecomp.scheduler.costmodel import Prediction, Profile, predict, search, search_by_scheme
from mergecomp.scheduler.probes import measure, probe_sizes

if TYPE_CHECKING:
    from mergecomp.exchange.exchange import Exchange

__all__ = ["MergeScheduler", "SchedulerConfig", "SEARCHED", "exchange_scheduler", "searched_codecs"]

logger = logging.getLogger("mergecomp")

MakePlan = Callable[[Sequence[int], Sequence[str]], GroupPlan]

#: the codecs a group may get from the search: the configured compressor by allgather (or
#: allreduce), by the two-phase scheme or by a hierarchical scheme, fp16, or plain
SEARCHED = (*CODECS, *SHARDED)


@dataclass
class SchedulerConfig:
    """Settings of the online search (all ranks must use the same)."""

    max_groups: int = 4
    warmup_steps: int = 4
    settle_steps: int = 1
    probe_steps: int = 2
    candidates: int = 3
    runoff_rounds: int = 2
    runoff_margin: float = 0.15
    min_improvement: float = 0.03
    retune_threshold: float = 0.15
    retune_window: int = 50
    codecs: Tuple[str, ...] = SEARCHED
    cache_path: Optional[str] = None
    #: seconds the profile may spend replaying one probe size's collectives (twice); a larger
    #: size is predicted from the smaller ones (:func:`~mergecomp.scheduler.probes.replay_within`)
    probe_budget: float = 1.0
    #: candidates predicted more than this many times the best prediction are not measured
    prune_ratio: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_groups", "probe_steps", "candidates", "retune_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler {name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "settle_steps", "runoff_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_improvement < 1 or self.retune_threshold <= 0 or self.runoff_margin < 0:
            raise ValueError("scheduler min_improvement must be in [0, 1), retune_threshold > 0 and "
                             "runoff_margin >= 0")
        if not self.probe_budget > 0 or not self.prune_ratio >= 1:
            raise ValueError(f"scheduler probe_budget must be > 0 and prune_ratio >= 1, got {self.probe_budget} "
                             f"and {self.prune_ratio}")
        bad = [c for c in self.codecs if c not in SEARCHED]
        if bad or not self.codecs:
            raise ValueError(f"scheduler codecs must be drawn from {SEARCHED}, got {self.codecs}")


def searched_codecs(codecs: Sequence[str], compressor: Compressor, world_size: int,
                    scheme: Optional[str] = None, per_host: int = 1) -> Tuple[str, ...]:
    """The codecs of ``codecs`` the search offers each group on ``world_size`` ranks in hosts of
    ``per_host`` processes: fp16 and none only where the compressor leaves a choice
    (:func:`~mergecomp.exchange.plan.has_codec_choice`); for a compressor whose payloads are
    allgathered, where it can travel so (:func:`~mergecomp.exchange.compatibility.carries`), also
    two-phase on 3 or more ranks (on 2 it moves the same bytes as the
    allgather, with a second encode), hierarchical with several processes on each of several
    hosts, and hierarchical-two-phase with 3 hosts or more.  ``scheme="allgather"`` keeps the
    allgather only; a sharded ``scheme`` (two-phase or hierarchical) sends every compressed
    group by it."""
    if not has_codec_choice(compressor):
        codecs = [c for c in codecs if c in (COMPRESSED, *SHARDED)]
    if scheme in SHARDED:
        return tuple(dict.fromkeys(scheme if c == COMPRESSED else c for c in codecs if c not in SHARDED))
    hosts = world_size // per_host
    offered = {TWO_PHASE: world_size >= 3, HIERARCHICAL: per_host > 1 and hosts > 1,
               HIERARCHICAL_TWO_PHASE: per_host > 1 and hosts >= 3}
    if scheme == "allgather" or compressor.summable:  # payloads that add up travel best by allreduce
        offered = {}
    return tuple(dict.fromkeys(c for c in codecs if c not in SHARDED or (offered.get(c) and carries(compressor, c))))


def _processes_per_host(comm: Communicator, compressor: Compressor, scheme: Optional[str]) -> int:
    """Processes per host as the engine splits them (a collective, so that the search may offer
    the hierarchical schemes), or 1 where they are not searched: a summable compressor or one
    they cannot carry, ``scheme`` set, or an engine that cannot split hosts or an irregular layout
    (which the scheme option, when asked for, reports)."""
    if scheme is not None or compressor.summable or not carries(compressor, HIERARCHICAL) or comm.size < 4:
        return 1
    try:
        local, _ = comm.split_hosts()
    except (NotImplementedError, ValueError):
        return 1
    return local.size


def exchange_scheduler(exchange: "Exchange", config: "SchedulerConfig", order: Sequence[int],
                       sizes: Sequence[int], shapes: Sequence[torch.Size], dtype: torch.dtype,
                       device: torch.device, build: Callable[[GroupPlan], GroupPlan],
                       model: Sequence[str], scheme: Optional[str] = None) -> "MergeScheduler":
    """The scheduler of a front end whose groups go through ``exchange``.

    ``order``: parameter indices in backward order; ``sizes`` (bytes) and ``shapes`` by parameter
    index; ``build(plan)`` completes a cut plan the way the front end builds its own (names,
    dtype checks).  ``model`` describes the parameters (e.g. ``"name:shape:dtype"`` each); with
    the compressor, memory, world size and engine it is hashed into the plan-cache signature.
    The codecs searched are :func:`searched_codecs` of the config's, for the front end's
    ``scheme`` and the hosts' layout.
    """
    compressor = exchange.compressor
    per_host = _processes_per_host(exchange.comm, compressor, scheme)
    config = dataclasses.replace(config, codecs=searched_codecs(config.codecs, compressor, exchange.comm.size,
                                                                  scheme, per_host))
    parts = [*model, repr(compressor), repr(exchange.memory), str(exchange.comm.size), exchange.comm.engine,
             *config.codecs]
    signature = hashlib.sha256("|".join(parts).encode()).hexdigest()
    return MergeScheduler(exchange.comm, compressor, order, sizes, shapes, dtype, device,
                          lambda cuts, names: build(GroupPlan.from_cuts(order, cuts, names)), signature, config,
                          exchange.memory)


@dataclass
class Candidate:
    plan: GroupPlan
    source: str
    predicted: Optional[float] = None
    measured: Optional[float] = None
    probes: List[float] = dataclasses.field(default_factory=list)  # this rank's probe step times


class MergeScheduler:
    """See the module docstring.

    Args:
        comm: the engine (used for the profile's micro-benchmarks and for agreement).
        compressor: the configured compressor (each codec of the config is probed with it).
        order: parameter indices in backward order.
        sizes: gradient bytes by parameter index.
        shapes: parameter shapes by parameter index (for realistic encode benchmarks).
        dtype, device: of the gradient buffers.
        make_plan: ``(cuts, codecs) -> GroupPlan`` over the backward order.
        signature: identifies model, compressor and world size for the plan cache.
        memory: the exchange's error-feedback memory, whose work the codec probes include.
    """

    def __init__(self, comm: Communicator, compressor: Compressor, order: Sequence[int],
                 sizes: Sequence[int], shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device,
                 make_plan: MakePlan, signature: str, config: Optional[SchedulerConfig] = None,
                 memory: Optional[Memory] = None) -> None:
        self.config = config or SchedulerConfig()
        self.comm = comm
        self.compressor = compressor
        self._size_of = dict(enumerate(sizes))
        self.sizes = [sizes[i] for i in order]
        self.shapes = [shapes[i] for i in order]
        self.dtype = dtype
        self.device = device
        self.make_plan = make_plan
        self.signature = signature
        self.memory = memory
        self.phase = "warmup"
        self.steps = 0
        self.search_steps = 0
        self.searches = 0
        self.chosen: Optional[Candidate] = None
        self.profile: Optional[Profile] = None  # the last search's cost model inputs
        self.profile_offset = 0.0  # seconds per step the timeline does not model
        self.candidates: List[Candidate] = []
        self.history: List[Dict] = []
        self._pending: List[Candidate] = []  # visits still to run, in order
        self._finalists: Optional[List[Candidate]] = None  # the run-off's pair; [] if none was held
        self._window: List[float] = []
        self._countdown = self.config.warmup_steps
        self._cached = self._load_cache()
        if self._cached is not None:
            self.phase = "monitor"

    # -- the front end's calls ---------------------------------------------------------------
    def initial_plan(self) -> Optional[GroupPlan]:
        """A cached plan to start from, if the cache holds one for this signature."""
        return self._cached.plan if self._cached is not None else None

    def observe(self, step_seconds: float, ready: Sequence[float], current: GroupPlan) -> Optional[GroupPlan]:
        """Record a finished step: its wall time, per-tensor ready times in backward order
        (seconds after the first) and the plan it ran.  Returns a plan to switch to before the
        next step, or None."""
        self.steps += 1
        if self.phase != "monitor":
            self.search_steps += 1
        self._current = current
        return self._PHASES[self.phase](self, step_seconds, list(ready))

    def report(self) -> Dict:
        """Candidates tried (predicted and measured seconds), the chosen plan and the search cost."""
        def describe(c: Candidate) -> Dict:
            return {"source": c.source, "groups": len(c.plan), "codecs": list(c.plan.codec_names()),
                    "sizes": [sum(self._size_of[i] for i in g) for g in c.plan.groups],
                    "predicted_s": c.predicted, "measured_s": c.measured, "probe_steps": len(c.probes)}

        return {"phase": self.phase, "steps": self.steps, "search_steps": self.search_steps,
                "searches": self.searches, "candidates": [describe(c) for c in self.candidates],
                "chosen": describe(self.chosen) if self.chosen else None, "history": self.history}

    def state_dict(self) -> Dict:
        """The chosen plan and counters; a search in progress restarts after a resume."""
        chosen = self.chosen
        return {"chosen": chosen.plan.to_json() if chosen else None,
                "chosen_source": chosen.source if chosen else None,
                "measured_s": chosen.measured if chosen else None,
                "steps": self.steps, "search_steps": self.search_steps, "searches": self.searches,
                "history": list(self.history)}

    def load_state_dict(self, state: Dict) -> None:
        self.steps, self.search_steps = int(state["steps"]), int(state["search_steps"])
        self.searches, self.history = int(state["searches"]), list(state["history"])
        self._window, self._pending = [], []
        if state["chosen"] is not None:
            self.chosen = Candidate(GroupPlan.from_json(state["chosen"]), state["chosen_source"],
                                    measured=state["measured_s"])
            self.phase = "monitor"
        else:
            self.chosen, self.phase, self._countdown = None, "warmup", self.config.warmup_steps

    # -- phases: each takes the finished step and may return the plan to run next ------------
    def _warmup(self, step_seconds: float, ready: List[float]) -> Optional[GroupPlan]:
        self._countdown -= 1
        if self._countdown > 0:
            return None
        self.phase = "profile"
        return None

    def _profile(self, step_seconds: float, ready: List[float]) -> Optional[GroupPlan]:
        self.searches += 1
        profile, offset = self._build_profile(ready, step_seconds)
        self.profile, self.profile_offset = profile, offset
        budget = self.config.candidates
        predictions = search_by_scheme(profile, self.config.max_groups, self.config.codecs, budget)
        pure = []
        schemes = [c for c in (COMPRESSED, *SHARDED) if c in self.config.codecs]
        if schemes and len(self.config.codecs) > 1:
            # Always verify the two best plans that use only the configured compressor (two
            # group counts; with several schemes, the best of each, fastest predicted first), in
            # the places of the last predicted candidates (same search cost).  While codecs were
            # timed cold, mixed plans measured 10-40 % above their prediction on the 1 Gbit/s
            # cluster and lost to these; timed warm, the median error of every kind of plan is
            # within 3 % (docs/scheduler.md), and these stay as insurance.
            each = 2 if len(schemes) == 1 else 1
            pure = [p for scheme in schemes for p in search(profile, self.config.max_groups, (scheme,), each)]
            pure = sorted(pure, key=lambda p: p.total)[:max(1, budget - 1)]
            chosen = {(p.cuts, p.codecs) for p in pure}
            predictions = [p for p in predictions if (p.cuts, p.codecs) not in chosen]
            predictions = predictions[:max(1, budget - len(pure))]  # at least one other plan
        candidates = [self._candidate(p, "predicted", offset) for p in predictions]
        candidates += [self._candidate(p, "compressor only", offset) for p in pure]
        if "none" in self.config.codecs:
            fused = search(profile, self.config.max_groups, ("none",), 1)[0]
            candidates.append(self._candidate(fused, "uncompressed", offset))
        if self.chosen is not None:
            candidates.append(Candidate(self.chosen.plan, "incumbent"))
        unique: Dict[GroupPlan, Candidate] = {}
        for c in candidates:
            unique.setdefault(c.plan, c)
        self.candidates = list(unique.values())
        # A plan predicted far slower than the best is not worth its probe steps: on a 10 Mbit/s
        # link the uncompressed plan's three would take half a minute.
        fastest = min(c.predicted for c in self.candidates if c.predicted is not None)
        self._pending = [c for c in self.candidates
                         if c.predicted is None or c.predicted <= fastest * self.config.prune_ratio]
        if len(self._pending) < len(self.candidates):
            logger.info("mergecomp: not measuring %d plan(s) predicted over %.1fx the fastest prediction (%.4fs)",
                        len(self.candidates) - len(self._pending), self.config.prune_ratio, fastest)
        self._finalists = None
        return self._next_candidate()

    def _verify(self, step_seconds: float, ready: List[float]) -> Optional[GroupPlan]:
        self._countdown -= 1
        if self._countdown >= self.config.probe_steps:
            return None  # settling
        current = self._pending[0]
        current.probes.append(step_seconds)
        if self._countdown > 0:
            return None
        self._pending.pop(0)
        current.measured = self._slowest(statistics.median(current.probes))
        if not self._pending and self._finalists is None:
            self._finalists, self._pending = self._runoff()
        if self._pending:
            return self._next_candidate()
        return self._decide()

    def _monitor(self, step_seconds: float, ready: List[float]) -> Optional[GroupPlan]:
        self._window.append(step_seconds)
        if len(self._window) < self.config.retune_window:
            return None
        recent = self._slowest(statistics.median(self._window))
        self._window = []
        reference = self.chosen.measured if self.chosen and self.chosen.measured else None
        if reference is None:
            self.chosen = self.chosen or Candidate(self._cached.plan, "cache")
            self.chosen.measured = recent
            return None
        if recent > reference * (1 + self.config.retune_threshold):
            logger.info("mergecomp: step time drifted from %.4fs to %.4fs; re-tuning the merge plan",
                        reference, recent)
            self.history.append({"step": self.steps, "event": "retune", "from_s": reference, "to_s": recent})
            self.phase = "profile"
        return None

    #: what :meth:`observe` runs in each phase; the names are public (``phase``, ``report()``)
    _PHASES: Dict[str, Callable[["MergeScheduler", float, List[float]], Optional[GroupPlan]]] = {
        "warmup": _warmup, "profile": _profile, "verify": _verify, "monitor": _monitor}

    # -- helpers -----------------------------------------------------------------------------
    def _runoff(self) -> Tuple[List[Candidate], List[Candidate]]:
        """The run-off's finalists and visits: the two best candidates alternate when they
        measured within ``runoff_margin`` of each other (a few probe steps each cannot tell them
        apart); none when the runner-up is clearly slower."""
        ranked = sorted((c for c in self.candidates if c.measured is not None), key=lambda c: c.measured)
        if len(ranked) < 2 or ranked[1].measured > ranked[0].measured * (1 + self.config.runoff_margin):
            return [], []
        pair = ranked[:2]
        if pair[1].plan == self._current:  # start with the plan already installed
            pair.reverse()
        return pair, [c for r in range(self.config.runoff_rounds) for c in (pair if r % 2 == 0 else pair[::-1])]

    def _next_candidate(self) -> GroupPlan:
        """Start the next visit; a plan already installed needs no settling step."""
        self.phase = "verify"
        plan = self._pending[0].plan
        self._countdown = self.config.probe_steps + (0 if plan == self._current else self.config.settle_steps)
        return plan

    def _decide(self) -> GroupPlan:
        measured = [c for c in self.candidates if c.measured is not None]
        # After a run-off only its finalists compete: the others lost on the first pass, and
        # their few early steps are not comparable with the finalists' later ones.
        best = min(self._finalists or measured, key=lambda c: c.measured)
        incumbent = next((c for c in measured if c.source == "incumbent"), None)
        if incumbent is not None and best.measured > incumbent.measured * (1 - self.config.min_improvement):
            best = incumbent
        self.chosen = best
        self.phase = "monitor"
        self._window = []
        self.history.append({"step": self.steps, "event": "chosen", "source": best.source,
                             "groups": len(best.plan), "measured_s": best.measured})
        logger.info("mergecomp: chose a %d-group plan (%s, codecs %s): %.4fs/step measured, %s predicted; "
                    "search took %d steps", len(best.plan), best.source, list(best.plan.codec_names()),
                    best.measured, "n/a" if best.predicted is None else f"{best.predicted:.4f}s",
                    self.search_steps)
        self._save_cache(best)
        return best.plan

    def _candidate(self, prediction: Prediction, source: str, offset: float) -> Candidate:
        plan = self.make_plan(prediction.cuts, prediction.codecs)
        return Candidate(plan, source, predicted=prediction.total + offset)

    def _slowest(self, value: float) -> float:
        """The maximum of ``value`` over ranks (every rank gets the same number)."""
        gathered = self.comm.allgather(torch.tensor([value], dtype=torch.float64, device=self.device),
                                       "scheduler agreement")
        return float(gathered.max())

    # -- profiling ---------------------------------------------------------------------------
    def _build_profile(self, ready: Sequence[float], step_seconds: float) -> Tuple[Profile, float]:
        """Measure codec and network costs; agree on everything by taking the max over ranks."""
        samples = probe_sizes(self.sizes)
        local = measure(self.comm, self.compressor, self.config.codecs, samples, self.shapes, self.dtype,
                        self.device, ready, step_seconds, self.memory, self.config.probe_budget)
        agreed = local.agree(self.comm, self.device)
        profile = agreed.cost_profile(self.sizes, [nbytes for nbytes, _ in samples])
        # What the timeline does not model (forward, optimizer, data) is the same for every plan:
        # calibrate it on the step just measured so predictions read as whole-step seconds.
        modelled = predict(profile, self._current.cuts(), self._current.codec_names()).total
        return profile, max(0.0, agreed.step_seconds - modelled)

    # -- plan cache --------------------------------------------------------------------------
    def _load_cache(self) -> Optional[Candidate]:
        path = self.config.cache_path
        if not path or not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        entry = entries.get(self.signature)
        if entry is None:
            logger.info("mergecomp: plan cache %s has no plan for this model/compressor/world size "
                        "(signature %s); searching", path, self.signature[:12])
            return None
        logger.info("mergecomp: using the cached merge plan from %s", path)
        return Candidate(GroupPlan.from_json(entry["plan"]), "cache", measured=entry.get("measured_s"))

    def _save_cache(self, best: Candidate) -> None:
        path = self.config.cache_path
        if not path or self.comm.rank != 0:
            return
        entries = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
        entries[self.signature] = {"plan": best.plan.to_json(), "measured_s": best.measured}
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
