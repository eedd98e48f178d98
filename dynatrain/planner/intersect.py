"""Intersect: every box a destination rank must hold, cut by the boxes the source layout holds.

Source regions are indexed per (tensor key, kind group); identical boxes held by several ranks
(DP replicas, TP-replicated norms) collapse into one entry with all their holders. A destination
region is then cut into parts, each inside exactly one source box, with every rank holding it.
Kinds that share boxes and slots (main_param, exp_avg, exp_avg_sq) travel together.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from dataclasses import dataclass

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.state import Region, Slot, StateView


class PlanError(DynatrainError):
    """A transition cannot be planned (incompatible layouts, impossible budget, ...)."""


@dataclass(frozen=True, slots=True)
class Holder:
    rank: int
    slot: Slot
    anchor: Box  # the box stored in ``slot``


@dataclass(frozen=True, slots=True)
class Need:
    """A part of a destination region and every source holder of it."""

    key: str
    kinds: tuple[str, ...]
    box: Box
    dst: Holder
    holders: tuple[Holder, ...]


class _Sorted:
    """Boxes sorted along one dim for range queries (``reach``: their largest extent there)."""

    def __init__(self, entries: list[tuple[Box, tuple[Holder, ...]]], dim: int) -> None:
        entries.sort(key=lambda e: e[0])
        self.dim = dim
        self.entries = entries
        self.los = [b.lo[dim] for b, _ in entries]
        self.reach = max((b.hi[dim] - b.lo[dim] for b, _ in entries), default=1)

    def query(self, box: Box) -> list[tuple[Box, tuple[Holder, ...]]]:
        d = self.dim
        i = bisect.bisect_right(self.los, box.lo[d] - self.reach)
        j = bisect.bisect_left(self.los, box.hi[d])
        out = []
        for b, holders in self.entries[i:j]:
            part = box & b
            if part is not None:
                out.append((part, holders))
        return out


class _Index:
    """Distinct source boxes of one tensor.

    Leading dims in which every box has extent 1 (the layer and expert axes of stacked
    tensors) are hashed; the first other dim is sorted for range queries. A query thus only
    looks at boxes of the same layer and expert.
    """

    def __init__(self, entries: dict[Box, list[Holder]]) -> None:
        boxes = list(entries)
        ndim = len(boxes[0].lo) if boxes else 0
        k = 0
        while k < ndim - 1 and all(b.hi[k] - b.lo[k] == 1 for b in boxes):
            k += 1
        self.k = k
        groups: dict[tuple[int, ...], list[tuple[Box, tuple[Holder, ...]]]] = defaultdict(list)
        for b, h in entries.items():
            groups[b.lo[:k]].append((b, tuple(h)))
        self.groups = {g: _Sorted(v, k) for g, v in groups.items()} if ndim else {}
        self.scalar = [(b, tuple(h)) for b, h in entries.items()] if not ndim else []

    def query(self, box: Box) -> list[tuple[Box, tuple[Holder, ...]]]:
        if not box.lo:
            return self.scalar[:1] and [(box, self.scalar[0][1])]
        out = []
        for head in itertools.product(*(range(l, h) for l, h in zip(box.lo[:self.k],
                                                                     box.hi[:self.k]))):
            idx = self.groups.get(head)
            if idx is None:
                continue
            sub = Box(head + box.lo[self.k:], tuple(x + 1 for x in head) + box.hi[self.k:])
            out.extend(idx.query(sub))
        return out


def _group_kinds(regions: list[Region]) -> dict[tuple, list[str]]:
    """(key, box, slot, primary) -> kinds stored there."""
    grouped: dict[tuple, list[str]] = defaultdict(list)
    for r in regions:
        grouped[(r.key, r.box, r.slot, r.primary)].append(r.kind)
    return grouped


def build_index(view: StateView) -> dict[tuple[str, tuple[str, ...]], _Index]:
    """Source index: (key, kinds held together) -> distinct boxes with their holders."""
    entries: dict[tuple[str, tuple[str, ...]], dict[Box, list[Holder]]] = defaultdict(
        lambda: defaultdict(list))
    for rank in range(view.layout.world):
        for (key, box, slot, primary), kinds in _group_kinds(view.regions(rank)).items():
            if primary:  # a tied copy duplicates the first stage's data under other bounds
                entries[(key, tuple(kinds))][box].append(Holder(rank, slot, box))
    return {k: _Index(v) for k, v in entries.items()}


def intersect(src: StateView, dst: StateView) -> list[Need]:
    """Cut every destination region by the source boxes; raise if anything is not covered."""
    index = build_index(src)
    group_of: dict[tuple[str, str], tuple[str, ...]] = {}
    for key, kinds in index:
        for k in kinds:
            group_of[(key, k)] = kinds
    needs: list[Need] = []
    answers: dict[tuple, list[tuple[Box, tuple[Holder, ...]]]] = {}
    for rank in range(dst.layout.world):
        for (key, box, slot, _), kinds in _group_kinds(dst.regions(rank)).items():
            by_group: dict[tuple[str, ...], list[str]] = defaultdict(list)
            for k in kinds:
                g = group_of.get((key, k))
                if g is None:
                    raise PlanError(f"{key} [{k}]: the destination needs state the source "
                                    "layout does not have")
                by_group[g].append(k)
            for g, sub in by_group.items():
                # DP replicas ask for the same box: answer each distinct question once.
                q = (key, g, box)
                parts = answers.get(q)
                if parts is None:
                    parts = answers[q] = index[(key, g)].query(box)
                covered = sum(p.numel for p, _ in parts)
                if covered != box.numel:
                    raise PlanError(f"{key} {box} [{','.join(sub)}] on rank {rank}: the source "
                                    f"layout holds {covered} of its {box.numel} elements")
                dst_holder = Holder(rank, slot, box)
                needs.extend(Need(key, tuple(sub), p, dst_holder, h) for p, h in parts)
    return needs
