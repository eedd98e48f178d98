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

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.slots import Slot
from ..ir.state import StateView, Stored


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
    """Per destination rank, the answers for everything it must hold (tuples shared by class)."""

    per_rank: tuple[tuple[tuple[Answer, ...], ...], ...]

    def answers(self, rank: int):
        for group in self.per_rank[rank]:
            yield from group


class _Sorted:
    """Boxes sorted along one dim for range queries (``reach``: their largest extent there)."""

    def __init__(self, entries: list[tuple[Box, tuple[Holders, ...]]], dim: int) -> None:
        entries.sort(key=lambda e: (e[0].lo, e[0].hi))
        self.dim = dim
        self.entries = entries
        self.los = [b.lo[dim] for b, _ in entries]
        self.reach = max((b.hi[dim] - b.lo[dim] for b, _ in entries), default=1)

    def query(self, box: Box) -> list[Part]:
        d = self.dim
        i = bisect.bisect_right(self.los, box.lo[d] - self.reach)
        j = bisect.bisect_left(self.los, box.hi[d])
        out = []
        for b, holders in self.entries[i:j]:
            part = box if b == box else box & b
            if part is not None:
                out.append((part, holders))
        return out


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
            sub = Box(head + box.lo[k:], tuple(x + 1 for x in head) + box.hi[k:])
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


def build_index(view: StateView) -> dict[tuple[str, tuple[str, ...]], _Index]:
    """Source index: (key, kinds held together) -> distinct boxes with their holders."""
    entries: dict[tuple[str, tuple[str, ...]], dict[Box, list[Holders]]] = defaultdict(
        lambda: defaultdict(list))
    for part, ranks in _parts_by_rank(view).values():
        holders_ranks = tuple(ranks)
        for s in part:
            if s.primary:  # a tied copy duplicates the first stage's data under other bounds
                entries[(s.key, s.kinds)][s.box].append(Holders(holders_ranks, s.slot, s.box))
    return {k: _Index(v) for k, v in entries.items()}


def intersect(src: StateView, dst: StateView, derived: tuple[str, ...] = ()) -> Intersection:
    """Cut every destination box by the source boxes; raise if anything is not covered.

    Kinds in ``derived`` are rebuilt by the destination itself and are not asked for.
    """
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
            covered = sum(p.numel for p, _ in parts)
            if covered != s.box.numel:
                raise PlanError(f"{s.key} {s.box} [{','.join(sub)}] on rank {rank}: the source "
                                f"layout holds {covered} of its {s.box.numel} elements")
            out.append(Answer(s, tuple(sub), tuple(parts)))
    return tuple(out)
