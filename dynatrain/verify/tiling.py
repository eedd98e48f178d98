"""Exact integer checks that boxes tile a box: sort and sweep, no solver.

Boxes tile an anchor exactly when each lies inside it, no two overlap, and their volumes add up
to the anchor's. The overlap test sweeps along the dimension where the boxes differ most, so a
typical tiling (slabs along one axis) costs a sort. When the check fails, a witness point is found
on a grid compressed to the boxes' own boundaries: cheap, and only paid on failure.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..ir.box import Box


class Fault(NamedTuple):
    """Why boxes do not tile an anchor: ``what`` in (empty, outside, twice, missing)."""

    what: str
    point: tuple[int, ...]
    boxes: tuple[int, ...]  # indices of the boxes involved (none for a gap)


def well_formed(b: Box, ndim: int) -> bool:
    return len(b.lo) == ndim == len(b.hi) and all(l < h for l, h in zip(b.lo, b.hi))


def inside(b: Box, anchor: Box) -> bool:
    return all(a <= l and h <= z for l, h, a, z in zip(b.lo, b.hi, anchor.lo, anchor.hi))


def outside_point(b: Box, anchor: Box) -> tuple[int, ...]:
    """A point of ``b`` that is not in ``anchor`` (``b`` must stick out)."""
    pt = list(b.lo)
    for d, (l, h, a, z) in enumerate(zip(b.lo, b.hi, anchor.lo, anchor.hi)):
        if l < a:
            pt[d] = l
            break
        if h > z:
            pt[d] = h - 1
            break
    return tuple(pt)


def tiling_fault(anchor: Box, boxes: list[Box]) -> Fault | None:
    """None if ``boxes`` tile ``anchor`` exactly, else the first fault with a witness point."""
    if len(boxes) == 1 and boxes[0] == anchor:
        return None
    ndim = len(anchor.lo)
    for i, b in enumerate(boxes):
        if not well_formed(b, ndim):
            return Fault("empty", tuple(b.lo), (i,))
        if not inside(b, anchor):
            return Fault("outside", outside_point(b, anchor), (i,))
    pair = first_overlap(boxes)
    if pair is not None:
        i, j = pair
        return Fault("twice", (boxes[i] & boxes[j]).lo, pair)
    if sum(b.numel for b in boxes) != anchor.numel:
        return Fault("missing", gap_point(anchor, boxes), ())
    return None


def first_overlap(boxes: list[Box]) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None.

    Boxes are first grouped by their leading dims of extent 1 (the layer and expert axes of
    stacked tensors: boxes of different layers cannot overlap), then each group is swept
    along the dimension where its boxes' starts differ most.
    """
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0].lo)
    if ndim == 0:
        return (0, 1)  # two writes of a scalar
    k = 0
    while k < ndim - 1 and all(b.hi[k] - b.lo[k] == 1 for b in boxes):
        k += 1
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, b in enumerate(boxes):
        groups.setdefault(b.lo[:k], []).append(i)
    found = None
    for members in groups.values():
        pair = _sweep(boxes, members, k)
        if pair is not None and (found is None or pair < found):
            found = pair
    return found


def _sweep(boxes: list[Box], members: list[int], k: int) -> tuple[int, int] | None:
    if len(members) < 2:
        return None
    d = max(range(k, len(boxes[0].lo)), key=lambda j: len({boxes[i].lo[j] for i in members}))
    members = sorted(members, key=lambda i: boxes[i].lo[d])
    active: list[int] = []
    for i in members:
        b = boxes[i]
        active = [j for j in active if boxes[j].hi[d] > b.lo[d]]
        for j in active:
            if boxes[j] & b is not None:
                return (min(i, j), max(i, j))
        active.append(i)
    return None


def gap_point(anchor: Box, boxes: list[Box]) -> tuple[int, ...]:
    """A point of ``anchor`` that no box covers (the boxes are inside it and disjoint)."""
    ndim = len(anchor.lo)
    if ndim == 0:
        return ()
    cuts = [sorted({anchor.lo[d], anchor.hi[d], *(b.lo[d] for b in boxes),
                    *(b.hi[d] for b in boxes)}) for d in range(ndim)]
    covered = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for b in boxes:
        covered[tuple(slice(c.index(l), c.index(h)) for c, l, h in zip(cuts, b.lo, b.hi))] = True
    cell = np.argwhere(~covered)
    if not len(cell):  # cannot happen for disjoint inside boxes with a volume shortfall
        return tuple(anchor.lo)
    return tuple(int(cuts[d][int(i)]) for d, i in enumerate(cell[0]))

