"""Merge plans: which parameters share one flat buffer, and where each one lives in it.

A :class:`GroupPlan` is a plain value — a tuple of groups, each a tuple of parameter indices in
backward (gradient-ready) order — so a scheduler can build, compare, broadcast and replace it
between steps.  :func:`layout` turns a plan plus the parameters' shapes into :class:`Group`
records with offsets.  :func:`remap_state` moves per-element state (error-feedback residuals,
momenta) from one plan's buffers onto another's, so switching plans loses nothing.
:class:`Exemptions` says which tensors are sent uncompressed; :func:`build_plan` puts them in
trailing groups of their own with the codec :data:`EXEMPT`.
"""
from __future__ import annotations

import fnmatch
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    from mergecomp.compressors.base.compressor import Compressor

__all__ = ["CODECS", "COMPRESSED", "EXEMPT", "UNFED", "WARMUP_FP16", "WARMUP_QSGD", "WARMUP_QSGD4", "Exemptions", "GroupPlan",
           "Group", "has_codec_choice", "layout", "remap_state", "build_plan", "group_name", "cut_evenly"]

PlanSpec = Union[str, int, Sequence[Sequence[str]], "GroupPlan"]

#: the configured compressor, sent by allreduce where its payloads add up, else by allgather
COMPRESSED = "compressed"
#: codec names a group may use besides the sharded schemes' (:data:`mergecomp.exchange.schemes.SHARDED`):
#: the configured compressor, a cast to fp16, or nothing
CODECS = (COMPRESSED, "fp16", "none")
#: codec of the groups of exempt tensors (:class:`Exemptions`), and of every group during the
#: compression warm-up: a plain allreduce of the gradient as it is, outside error feedback and
#: compressor state (the scheduler never picks it)
EXEMPT = "exempt"
#: route of every group in a compression warm-up under ``compression_warmup_codec="fp16"``
#: (the uncompressed tensors' groups excepted): a cast to fp16, outside error feedback and
#: compressor state as :data:`EXEMPT` is
WARMUP_FP16 = "warm-up-fp16"
#: the same under ``compression_warmup_codec="qsgd"``: QSGD's 8-bit codes at the most levels
#: they hold (``levels=127``; unbiased, allgathered), outside error feedback and compressor state
WARMUP_QSGD = "warm-up-qsgd"
#: the same under ``compression_warmup_codec="qsgd4"``: QSGD's 4-bit codes (``levels=7``)
WARMUP_QSGD4 = "warm-up-qsgd4"
#: the routes outside error feedback and compressor state, by the compressor that encodes them
#: (its registered name and arguments)
UNFED = {EXEMPT: ("none", {}), WARMUP_FP16: ("fp16", {}), WARMUP_QSGD: ("qsgd", {"levels": 127}),
         WARMUP_QSGD4: ("qsgd", {"levels": 7})}


def has_codec_choice(compressor: "Compressor") -> bool:
    """Whether groups may be sent with another codec of :data:`CODECS` than ``compressor``:
    not when it is ``none`` (exact gradients, which fp16 would not keep), nor when it
    :attr:`~mergecomp.compressors.base.compressor.Compressor.votes` (every group must then take
    part in the vote)."""
    return compressor.name != "none" and not compressor.votes


@dataclass(frozen=True)
class Exemptions:
    """Which tensors are sent uncompressed: those whose name matches one of ``patterns``
    (:func:`fnmatch.fnmatchcase`: ``"*.bias"``, ``"*norm*"``) and those with fewer than
    ``min_numel`` elements.  Build with :meth:`create` (validates the options)."""

    patterns: Tuple[str, ...] = ()
    min_numel: int = 0

    @classmethod
    def create(cls, uncompressed: Union[str, Iterable[str], None] = (), min_compress_numel: int = 0) -> "Exemptions":
        """From the front ends' options: ``uncompressed`` (a pattern or patterns) and
        ``min_compress_numel``; ValueError naming the option for anything else."""
        patterns = (uncompressed,) if isinstance(uncompressed, str) else tuple(uncompressed or ())
        if not all(isinstance(p, str) and p for p in patterns):
            raise ValueError(f"uncompressed must be name patterns (non-empty strings), got {uncompressed!r}")
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be an int >= 0, got {min_compress_numel!r}")
        return cls(patterns, min_compress_numel)

    def exempt(self, name: str, numel: int) -> bool:
        return numel < self.min_numel or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def flags(self, names: Sequence[str], numels: Sequence[int]) -> List[bool]:
        """:meth:`exempt` of every tensor; warns naming each pattern that matches no name."""
        unmatched = [p for p in self.patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched and names:
            warnings.warn(f"uncompressed: the pattern(s) {unmatched} match none of the {len(names)} names "
                          f"(e.g. {list(names[:3])})", UserWarning, stacklevel=4)
        return [self.exempt(n, k) for n, k in zip(names, numels)]


@dataclass(frozen=True)
class GroupPlan:
    """Groups of parameter indices; concatenating the groups gives the backward order.

    ``codecs`` optionally names what each group is sent with: one of :data:`CODECS`, the name
    of a sharded scheme (the configured compressor by that scheme,
    :data:`mergecomp.exchange.schemes.SHARDED`) or :data:`EXEMPT`; empty means every group uses the
    configured compressor, and all-``"compressed"`` is stored as empty, so plans that send the
    same groups the same way compare equal.
    """

    groups: Tuple[Tuple[int, ...], ...]
    codecs: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(len(g) == 0 for g in self.groups):
            raise ValueError("a merge plan cannot contain an empty group")
        if self.codecs and len(self.codecs) != len(self.groups):
            raise ValueError(f"a merge plan with {len(self.groups)} groups needs as many codecs, got {len(self.codecs)}")
        if all(c == COMPRESSED for c in self.codecs):
            object.__setattr__(self, "codecs", ())

    def codec(self, g: int) -> str:
        return self.codecs[g] if self.codecs else COMPRESSED

    def codec_names(self) -> Tuple[str, ...]:
        """The codec of every group, in order."""
        return tuple(self.codec(g) for g in range(len(self.groups)))

    @property
    def order(self) -> Tuple[int, ...]:
        return tuple(i for g in self.groups for i in g)

    @classmethod
    def from_cuts(cls, order: Sequence[int], cuts: Sequence[int], codecs: Sequence[str] = ()) -> "GroupPlan":
        """The plan that cuts ``order`` (parameter indices in backward order) before each
        position in ``cuts`` (increasing, inside ``(0, len(order))``), with a codec per group or
        none; :meth:`cuts` is its inverse."""
        edges = [0, *cuts, len(order)]
        return cls(tuple(tuple(order[a:b]) for a, b in zip(edges, edges[1:])), tuple(codecs))

    def cuts(self) -> Tuple[int, ...]:
        """The positions in :attr:`order` where groups 1.. start."""
        return tuple(itertools.accumulate(len(g) for g in self.groups[:-1]))

    def __len__(self) -> int:
        return len(self.groups)

    def to_json(self) -> Dict[str, list]:
        return {"groups": [list(g) for g in self.groups], "codecs": list(self.codecs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Sequence]) -> "GroupPlan":
        return cls(tuple(tuple(int(i) for i in g) for g in data["groups"]),
                   tuple(str(c) for c in data.get("codecs", ())))


@dataclass(frozen=True)
class Group:
    """One merged buffer: parameter ``indices`` at ``offsets`` with ``shapes``; ``numel`` total."""

    name: str
    indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    shapes: Tuple[torch.Size, ...]
    numel: int

    def numels(self) -> Tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)


def group_name(indices: Sequence[int]) -> str:
    """Stable name of a group: the same on every rank for the same parameters."""
    return f"g{indices[0]}-{indices[-1]}x{len(indices)}"


def layout(plan: GroupPlan, shapes: Sequence[torch.Size]) -> List[Group]:
    """Offsets of each parameter inside its group's flat buffer."""
    groups = []
    for members in plan.groups:
        offsets, offset = [], 0
        for i in members:
            offsets.append(offset)
            offset += math.prod(shapes[i])
        groups.append(Group(group_name(members), tuple(members), tuple(offsets),
                            tuple(torch.Size(shapes[i]) for i in members), offset))
    return groups


def cut_evenly(order: Sequence[int], sizes: Sequence[int], k: int) -> List[List[int]]:
    """Split ``order`` into ``min(k, len(order))`` contiguous runs of about equal total
    ``sizes`` (bytes for a plan's groups, elements for DiLoCo's fragments), none empty.

    Cut ``j`` goes at the tensor boundary whose prefix of sizes is nearest ``j / k`` of the
    total, leaving room for one tensor in every later run.
    """
    n = len(order)
    k = min(k, n)
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + sizes[i])
    cuts = [0]
    for j in range(1, k):
        target = prefix[-1] * j / k
        candidates = range(cuts[-1] + 1, n - (k - j) + 1)
        cuts.append(min(candidates, key=lambda b: abs(prefix[b] - target)))
    cuts.append(n)
    return [list(order[a:b]) for a, b in zip(cuts, cuts[1:])]


def build_plan(
    spec: PlanSpec,
    order: Sequence[int],
    names: Sequence[str],
    nbytes: Sequence[int],
    kinds: Sequence[object] = (),
    exempt: Sequence[bool] = (),
) -> GroupPlan:
    """Make a plan from a user spec.

    Args:
        spec: ``"layerwise"`` (one group per tensor), an int ``k`` (k groups of about equal bytes
            along ``order``), a list of lists of parameter names, or a :class:`GroupPlan`.
        order: parameter indices in backward order.
        names: parameter names by index (for name lists and error messages).
        nbytes: gradient bytes by index.
        kinds: optional per-index key (dtype, device); a group never mixes two kinds, so
            runs are additionally cut where the kind changes.
        exempt: optional per-index flag: these tensors leave the groups ``spec`` gives (a
            ``"layerwise"`` or int spec cuts the others only) and form trailing groups of their
            own (one per kind) with the codec :data:`EXEMPT`; no other group keeps that codec.
    """
    codecs: List[str] = []
    exempt = list(exempt) or [False] * len(names)
    sent = [i for i in order if not exempt[i]]
    if isinstance(spec, GroupPlan):
        groups = [list(g) for g in spec.groups]
        codecs = list(spec.codecs)
    elif isinstance(spec, str):
        if spec != "layerwise":
            raise ValueError(f"groups must be 'layerwise', an int, a list of name lists or a GroupPlan; got {spec!r}")
        groups = [[i] for i in sent]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"groups must be a positive number of groups, got {spec}")
        groups = cut_evenly(sent, nbytes, spec) if sent else []
    else:
        groups = _groups_from_names(spec, order, names)
    held = [i for i in order if exempt[i]]
    runs = [[i for i in g if not exempt[i]] for g in groups]
    codecs = [COMPRESSED if c == EXEMPT else c for c, run in zip(codecs, runs) if run]
    groups = [run for run in runs if run]
    if kinds:
        runs = [_split_kinds(g, kinds) for g in groups]
        if codecs:
            codecs = [c for c, split in zip(codecs, runs) for _ in split]
        groups = [run for split in runs for run in split]
    if held:
        tail = _split_kinds(held, kinds) if kinds else [held]
        codecs = (codecs or [COMPRESSED] * len(groups)) + [EXEMPT] * len(tail)
        groups += tail
    plan = GroupPlan(tuple(tuple(g) for g in groups), tuple(codecs))
    _check_covers(plan, order, names)
    return plan


def _groups_from_names(spec, order: Sequence[int], names: Sequence[str]) -> List[List[int]]:
    index = {name: i for i, name in enumerate(names)}
    try:
        groups = [[index[n] for n in group] for group in spec]
    except KeyError as err:
        raise ValueError(f"groups names parameter {err.args[0]!r}, which is not among the optimizer's "
                         f"named parameters") from None
    except TypeError:
        raise ValueError(f"groups must be 'layerwise', an int, a list of name lists or a GroupPlan; got {spec!r}") from None
    listed = {i for g in groups for i in g}
    missing = [i for i in order if i not in listed]
    if missing:
        # Parameters nobody listed form one trailing group, like Horovod's `groups=` option.
        groups.append(missing)
    return [g for g in groups if g]


def _split_kinds(group: Sequence[int], kinds: Sequence[object]) -> List[List[int]]:
    runs: List[List[int]] = []
    for i in group:
        if runs and kinds[runs[-1][-1]] == kinds[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _check_covers(plan: GroupPlan, order: Sequence[int], names: Sequence[str]) -> None:
    seen: Dict[int, int] = {}
    for i in plan.order:
        if i in seen:
            raise ValueError(f"parameter {names[i]!r} appears in more than one group")
        seen[i] = 1
    missing = set(order) - set(seen)
    extra = set(seen) - set(order)
    if missing or extra:
        bad = sorted(missing | extra)
        raise ValueError(f"merge plan does not match the parameters: {[names[i] for i in bad]}")


def remap_state(
    state: Mapping[str, Mapping[str, torch.Tensor]],
    old: Sequence[Group],
    new: Sequence[Group],
) -> Dict[str, Dict[str, torch.Tensor]]:
    """Move per-element state fields from ``old`` groups' buffers into ``new`` groups' buffers.

    A flat (1-D) field as long as its group is per-element and follows its parameters; any
    other field (low-rank factors, a 0-d counter, even in a group of one element) is dropped.
    Parameters with no old state get zeros.
    """
    pieces: Dict[str, Dict[int, torch.Tensor]] = {}
    templates: Dict[str, torch.Tensor] = {}
    for group in old:
        for field, tensor in state.get(group.name, {}).items():
            if tensor.dim() != 1 or tensor.numel() != group.numel:
                continue
            templates.setdefault(field, tensor)
            for i, offset, n in zip(group.indices, group.offsets, group.numels()):
                pieces.setdefault(field, {})[i] = tensor[offset:offset + n]
    remapped: Dict[str, Dict[str, torch.Tensor]] = {}
    for group in new:
        for field, by_param in pieces.items():
            template = templates[field]
            parts = [by_param[i] if i in by_param else template.new_zeros(n)
                     for i, n in zip(group.indices, group.numels())]
            remapped.setdefault(group.name, {})[field] = torch.cat(parts)
    return remapped
