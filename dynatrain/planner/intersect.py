"""Intersect: every box a destination rank must hold, cut by the boxes the source layout holds.

Source boxes are indexed per (tensor key, kinds held together); identical boxes held by several
ranks (DP replicas, TP-replicated norms) collapse into one entry listing every holder. A
destination box is then cut into parts, each inside exactly one source box.

Ranks of the same class hold the same things (``StateView.parts`` returns the same cached
tuples), so the work is done once per distinct part, not once per rank: the result
maps each destination rank to the answers of its parts, shared between ranks.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..ir.box import Box, new_box
from ..ir.errors import DynatrainError
from ..ir.slots import Slot
from ..ir.state import StateView, Stored
from ..ir.tiling import tiling_fault
from .lost import subtract


class PlanError(DynatrainError):
    """A transition cannot be planned (incompatible layouts, impossible budget, ...)."""


@dataclass(frozen=True, slots=True)
class Holders:
    """Source ranks that hold one box in the same slot (ranks of one class)."""

    ranks: tuple[int, ...]
    slot: Slot
    anchor: Box  # the box stored in ``slot``


Part = tuple[Box, tuple[Holders, ...]]  # a piece of a destination box and who holds it


@dataclass(frozen=True, slots=True)
class Answer:
    """One destination entry (box, slot) for ``kinds``, cut into parts held by the source."""

    entry: Stored
    kinds: tuple[str, ...]
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Intersection:
    """Per destination rank, the answers for everything it must hold (tuples shared by class).

    ``lost``: with failed source ranks, the pieces (key, kinds, box) of destination entries
    that no surviving rank holds; they are left out of the answers' parts. Pieces repeat
    where destination ranks need the same state.
    """

    per_rank: tuple[tuple[tuple[Answer, ...], ...], ...]
    lost: tuple[tuple[str, tuple[str, ...], Box], ...] = ()

    def answers(self, rank: int):
        for group in self.per_rank[rank]:
            yield from group


class _Sorted:
    """Boxes sorted along one dim for range queries."""

    def __init__(self, entries: list[tuple[Box, tuple[Holders, ...]]], dim: int) -> None:
        entries.sort(key=lambda e: (e[0].lo, e[0].hi))
        self.dim = dim
        self.entries = entries
        self.los = [b.lo[dim] for b, _ in entries]
        # The largest end along ``dim`` up to each entry: entries before the first one past a
        # query's start all end before it (tighter than a start minus the longest extent).
        self.ends = list(itertools.accumulate((b.hi[dim] for b, _ in entries), max))
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def query(self, box: Box) -> list[Part]:
        d = self.dim
        i = bisect.bisect_right(self.ends, box.lo[d])
        j = bisect.bisect_left(self.los, box.hi[d], i)
        entries = self.entries
        if j - i > _SCAN:  # many candidates (boxes of other columns, say): filter in numpy
            lo, hi = self._bounds()
            hits = np.flatnonzero((lo[i:j] < box.hi).all(1) & (hi[i:j] > box.lo).all(1))
            candidates = [entries[i + k] for k in hits.tolist()]
        else:
            candidates = entries[i:j]
        out = []
        for b, holders in candidates:
            part = box if b == box else box & b
            if part is not None:
                out.append((part, holders))
        return out

    def _bounds(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = (np.array([b.lo for b, _ in self.entries], np.int64),
                            np.array([b.hi for b, _ in self.entries], np.int64))
        return self._arrays


_SCAN = 12  # candidate boxes a query tests one by one; past this, numpy filters them first


class _Index:
    """Distinct source boxes of one tensor.

    Leading dims in which every box has extent 1 (the layer and expert axes of stacked
    tensors) are hashed; the first other dim is sorted for range queries. A query thus only
    looks at boxes of the same layer and expert.
    """

    def __init__(self, entries: dict[Box, list[Holders]]) -> None:
        boxes = list(entries)
        ndim = len(boxes[0].lo) if boxes else 0
        k = 0
        while k < ndim - 1 and all(b.hi[k] - b.lo[k] == 1 for b in boxes):
            k += 1
        self.k = k
        groups: dict[tuple[int, ...], list[tuple[Box, tuple[Holders, ...]]]] = defaultdict(list)
        for b, h in entries.items():
            groups[b.lo[:k]].append((b, tuple(h)))
        self.groups = {g: _Sorted(v, k) for g, v in groups.items()} if ndim else {}
        self.scalar = [(b, tuple(h)) for b, h in entries.items()] if not ndim else []

    def query(self, box: Box) -> list[Part]:
        if not box.lo:
            return self.scalar[:1] and [(box, self.scalar[0][1])]
        k = self.k
        if all(h - l == 1 for l, h in zip(box.lo[:k], box.hi[:k])):
            idx = self.groups.get(box.lo[:k])
            return idx.query(box) if idx is not None else []
        out = []
        for head in itertools.product(*(range(l, h) for l, h in zip(box.lo[:k], box.hi[:k]))):
            idx = self.groups.get(head)
            if idx is None:
                continue
            sub = new_box(head + box.lo[k:], tuple(x + 1 for x in head) + box.hi[k:])
            out.extend(idx.query(sub))
        return out


def _parts_by_rank(view: StateView) -> dict[int, tuple[tuple[Stored, ...], list[int]]]:
    """Distinct cached parts of a view (by identity) and the ranks that hold each."""
    parts: dict[int, tuple[tuple[Stored, ...], list[int]]] = {}
    for rank in range(view.layout.world):
        for part in view.parts(rank):
            if part:
                parts.setdefault(id(part), (part, []))[1].append(rank)
    return parts


def build_index(view: StateView, primary: bool = True
                ) -> dict[tuple[str, tuple[str, ...]], _Index]:
    """Source index: (key, kinds held together) -> distinct boxes with their holders.

    ``primary=False`` indexes the tied copies instead (the last stage's output layer, which
    duplicates the first stage's embedding and its optimizer state).
    """
    entries: dict[tuple[str, tuple[str, ...]], dict[Box, list[Holders]]] = defaultdict(
        lambda: defaultdict(list))
    for part, ranks in _parts_by_rank(view).values():
        holders_ranks = tuple(ranks)
        for s in part:
            if s.primary == primary:  # a tied copy duplicates the first stage's data
                entries[(s.key, s.kinds)][s.box].append(Holders(holders_ranks, s.slot, s.box))
    return {k: _Index(v) for k, v in entries.items()}


def intersect(src: StateView, dst: StateView, derived: tuple[str, ...] = (),
              failed: frozenset[int] = frozenset()) -> Intersection:
    """Cut every destination box by the source boxes; raise if they do not tile it exactly.

    Kinds in ``derived`` are rebuilt by the destination itself and are not asked for.
    Source ranks in ``failed`` hold nothing: parts only they hold are taken from a tied copy
    if one survives, else recorded in ``Intersection.lost`` and left out.
    """
    if failed:
        return _intersect_survivors(src, dst, derived, failed)
    index = build_index(src)
    group_of: dict[tuple[str, str], tuple[str, ...]] = {}
    for key, kinds in index:
        for k in kinds:
            group_of[(key, k)] = kinds
    # Keyed by identity; the value keeps the part alive so its id cannot be reused.
    answered: dict[int, tuple[tuple[Stored, ...], tuple[Answer, ...]]] = {}
    per_rank = []
    for rank in range(dst.layout.world):
        groups = []
        for part in dst.parts(rank):
            got = answered.get(id(part))
            if got is None:
                got = answered[id(part)] = (part, _answer(part, index, group_of, rank,
                                                              derived))
            groups.append(got[1])
        per_rank.append(tuple(groups))
    return Intersection(tuple(per_rank))


def _answer(part: tuple[Stored, ...], index: dict[tuple[str, tuple[str, ...]], _Index],
            group_of: dict[tuple[str, str], tuple[str, ...]], rank: int,
            derived: tuple[str, ...]) -> tuple[Answer, ...]:
    out = []
    for s in part:
        by_group: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for k in s.kinds:
            if k in derived:
                continue
            g = group_of.get((s.key, k))
            if g is None:
                raise PlanError(f"{s.key} [{k}]: the destination needs state the source "
                                "layout does not have")
            by_group[g].append(k)
        for g, sub in by_group.items():
            parts = index[(s.key, g)].query(s.box)
            # Exact tiling, not a count of elements: source boxes that overlap (a part held
            # twice) and a hole would cancel out in a count, and the plan would write the
            # overlap twice and the hole never. One part that is the box: the common case.
            if not (len(parts) == 1 and parts[0][0] == s.box):
                fault = tiling_fault(s.box, [p for p, _ in parts])
                if fault is not None:
                    where = list(fault.point)
                    boxes = " and ".join(str(parts[i][0]) for i in fault.boxes)
                    why = (f"element {where} is held by no source rank"
                           if fault.what == "missing" else
                           f"element {where} is in two different source boxes ({boxes})"
                           if fault.what == "twice" else f"a part ({boxes}) is {fault.what}")
                    raise PlanError(f"{s.key} {s.box} [{','.join(sub)}] on rank {rank}: the "
                                    f"source layout does not tile it: {why}")
            out.append(Answer(s, tuple(sub), tuple(parts)))
    return tuple(out)


def _intersect_survivors(src: StateView, dst: StateView, derived: tuple[str, ...],
                         failed: frozenset[int]) -> Intersection:
    """``intersect`` when some source ranks failed: the same cuts, survivors only."""
    index = build_index(src)
    group_of = {(key, k): kinds for key, kinds in index for k in kinds}
    alive = _Survivors(failed)
    tied: list = []  # the tied-copy index, built the first time a part has no survivor
    lost: list[tuple[str, tuple[str, ...], Box]] = []
    answered: dict[int, tuple[tuple[Stored, ...], tuple[Answer, ...]]] = {}
    per_rank = []
    for rank in range(dst.layout.world):
        groups = []
        for part in dst.parts(rank):
            got = answered.get(id(part))
            if got is None:
                full = _answer(part, index, group_of, rank, derived)  # raises if uncovered
                got = answered[id(part)] = (part, tuple(
                    _surviving(a, alive, src, tied, lost) for a in full))
            groups.append(got[1])
        per_rank.append(tuple(groups))
    return Intersection(tuple(per_rank), tuple(lost))


class _Survivors:
    """Holders with the failed ranks taken out, memoized per holder tuple (shared by parts)."""

    def __init__(self, failed: frozenset[int]) -> None:
        self.failed = failed
        self.one: dict[int, tuple[Holders, Holders | None]] = {}
        self.many: dict[int, tuple[tuple[Holders, ...], tuple[Holders, ...]]] = {}

    def __call__(self, holders: tuple[Holders, ...]) -> tuple[Holders, ...]:
        hit = self.many.get(id(holders))
        if hit is None:  # the key tuple rides along to keep its id from being reused
            kept = tuple(h for h in map(self._holder, holders) if h is not None)
            hit = self.many[id(holders)] = (holders, kept)
        return hit[1]

    def _holder(self, h: Holders) -> Holders | None:
        hit = self.one.get(id(h))
        if hit is None:
            ranks = tuple(r for r in h.ranks if r not in self.failed)
            same = len(ranks) == len(h.ranks)
            hit = self.one[id(h)] = (h, h if same else Holders(ranks, h.slot, h.anchor)
                                     if ranks else None)
        return hit[1]


def _surviving(a: Answer, alive: _Survivors, src: StateView, tied: list,
               lost: list[tuple[str, tuple[str, ...], Box]]) -> Answer:
    """``a`` with each part taken from survivors: its primary holders, else a surviving tied
    copy; what neither has goes to ``lost``."""
    parts: list[Part] = []
    key, kinds = a.entry.key, a.kinds
    changed = False
    for box, holders in a.parts:
        kept = alive(holders)
        if kept:
            changed |= kept is not holders
            parts.append((box, kept))
            continue
        changed = True
        if not tied:
            index = build_index(src, primary=False)
            tied.append((index, {(key_, k): g for key_, g in index for k in g}))
        index, group_of = tied[0]
        g = group_of.get((key, kinds[0]))
        rest = [box]
        if g is not None and set(kinds) <= set(g):
            for sub, copy_holders in index[(key, g)].query(box):
                kept = alive(copy_holders)
                if kept:
                    parts.append((sub, kept))
                    rest = [p for r in rest for p in subtract(r, sub)]
        lost.extend((key, kinds, r) for r in rest)
    return Answer(a.entry, kinds, tuple(parts)) if changed else a
