"""Exact integer check that boxes tile a box in linear time: signed corner counts, no solver.

Boxes tile an anchor exactly when each lies inside it and their coverage count ``f`` (how many
boxes hold each point) equals the anchor's indicator. A box's indicator is the sum, over its
``2**d`` corners ``c``, of the orthant ``{x >= c}`` with sign ``(-1)**(hi coordinates in c)``,
and a function's signed-corner form is unique (``f(x)`` is the sum of the signs at corners
``<= x``). So the boxes tile the anchor iff their signed corners, counted per point, cancel to
the anchor's own: a hash count, ``O(n * 2**d)`` whatever the boxes' shapes, where a sweep is
quadratic on staircases and a dense grid of the boxes' boundaries needs ``n**d`` cells. If they
do not cancel, the lexicographically least corner ``c`` left with a nonzero sum ``s`` is the
least point of the anchor not covered once: no other leftover corner is ``<= c``, so ``f(c)`` is
exactly ``1 + s`` (0: a gap, >= 2: an overlap) and every earlier point is covered once.
"""

from __future__ import annotations

from collections import Counter
from operator import lt
from typing import NamedTuple

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
    """None if ``boxes`` tile ``anchor`` exactly, else a fault with a witness point.

    Faults are looked for in this order: the first malformed box (``empty``) or box sticking
    out of the anchor (``outside``), then the lexicographically least point of the anchor whose
    coverage is not one: ``twice`` (with the first two boxes covering it) or ``missing``. Time
    and memory are linear in ``len(boxes)`` (times ``2**ndim``), whatever the boxes' shapes.

    Example:
        >>> tiling_fault(Box((0,), (4,)), [Box((0,), (2,)), Box((3,), (4,))])
        Fault(what='missing', point=(2,), boxes=())
    """
    if len(boxes) == 1 and boxes[0] == anchor:
        return None
    cols = _columns(anchor, boxes)
    if cols is None:  # some box is malformed or sticks out: name the first one
        ndim = len(anchor.lo)
        for i, b in enumerate(boxes):
            if not well_formed(b, ndim):
                return Fault("empty", tuple(b.lo), (i,))
            if not inside(b, anchor):
                return Fault("outside", outside_point(b, anchor), (i,))
        raise AssertionError("unreachable: the screen found a bad box the loop did not")
    found = _first_miscovered(anchor, len(boxes), *cols)
    if found is None:
        return None
    point, count = found
    if count == 0:
        return Fault("missing", point, ())
    return Fault("twice", point, tuple([i for i, b in enumerate(boxes) if contains(b, point)][:2]))


def contains(b: Box, point: tuple[int, ...]) -> bool:
    """Whether ``point`` lies in ``b``."""
    return all(l <= x < h for l, h, x in zip(b.lo, b.hi, point))


_Columns = tuple[list[tuple[int, ...]], list[tuple[int, ...]]]


def _columns(anchor: Box, boxes: list[Box]) -> _Columns | None:
    """Per dim, the boxes' lo and hi bounds, or None if a box is malformed or not inside.

    The loops run in C (zip, map, min, max): this screen is most of the check's time on the
    planner's own plans, with tens of thousands of small regions.
    """
    ndim = len(anchor.lo)
    lo_rows, hi_rows = [b.lo for b in boxes], [b.hi for b in boxes]
    if {*map(len, lo_rows), *map(len, hi_rows)} - {ndim}:
        return None
    los, his = list(zip(*lo_rows)), list(zip(*hi_rows))
    for lo, hi, a, z in zip(los, his, anchor.lo, anchor.hi):
        if min(lo) < a or max(hi) > z or not all(map(lt, lo, hi)):
            return None
    return los, his


def _first_miscovered(anchor: Box, n: int, los: list[tuple[int, ...]],
                      his: list[tuple[int, ...]]) -> tuple[tuple[int, ...], int] | None:
    """The least point of ``anchor`` not covered exactly once by the ``n`` boxes with bounds
    ``los``/``his`` (per dim; well formed, inside the anchor) and how many boxes cover it, or
    None if every point is covered once."""
    # Dims every box spans whole do not change the count: leave them out (slab tilings of
    # [layer, rows, cols] tensors keep one or two dims, so 2 or 4 corners a box). The boxes
    # are inside the anchor, so "all start at its lo" is "the largest start is its lo".
    dims = [d for d, (a, z) in enumerate(zip(anchor.lo, anchor.hi))
            if max(los[d]) != a or min(his[d]) != z] if n else []
    if not dims:  # no boxes, or every box is the anchor
        return None if n == 1 else (tuple(anchor.lo), n)
    # Corners with an even number of hi coordinates count +1, odd ones -1; the anchor's count
    # the other way. Tiling exactly <=> the two multisets are equal.
    even: Counter[tuple[int, ...]] = Counter()
    odd: Counter[tuple[int, ...]] = Counter()
    for mask in range(1 << len(dims)):
        cols = [his[d] if mask >> j & 1 else los[d] for j, d in enumerate(dims)]
        corner = tuple(anchor.hi[d] if mask >> j & 1 else anchor.lo[d]
                       for j, d in enumerate(dims))
        parity = bin(mask).count("1") & 1
        (odd if parity else even).update(zip(*cols))
        (even if parity else odd)[corner] += 1
    # No zero counts on either side, so plain dict equality is exact, and the (corner, count)
    # pairs on one side only are the corners whose counts differ (kept in C on hostile inputs).
    if dict.__eq__(even, odd):
        return None
    least = min(set(even.items()) ^ set(odd.items()))[0]
    point = list(anchor.lo)
    for d, x in zip(dims, least):
        point[d] = x
    return tuple(point), 1 + even[least] - odd[least]
