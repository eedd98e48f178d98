"""Exact integer check that boxes tile a box in linear time: signed corner counts, no solver.

Pure box geometry (in ``ir`` so that every layer can prove coverage with it: the verifier's
coverage rule, the planner's intersection, the checkpoint reader's chunks).

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

from .box import Box


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
    coverage is not one: ``twice`` (with the first two boxes covering it) or ``missing``. Boxes
    cut as the planner cuts are confirmed first as row-major runs chained end to end (a sort,
    ``_chain_of_runs``); otherwise time and memory are linear in ``len(boxes)`` (times
    ``2**ndim``), whatever the boxes' shapes.

    Example:
        >>> tiling_fault(Box((0,), (4,)), [Box((0,), (2,)), Box((3,), (4,))])
        Fault(what='missing', point=(2,), boxes=())
    """
    if len(boxes) == 1 and boxes[0] == anchor or _chain_of_runs(anchor, boxes):
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


# At most this many row-major runs per box before ``_chain_of_runs`` leaves the boxes to
# the corner count (a box of a few layers by a part of the experts is a run per layer; a
# column of a matrix, a run per row).
RUNS_PER_BOX = 64


def _chain_of_runs(anchor: Box, boxes: list[Box]) -> bool:
    """Whether ``boxes`` tile ``anchor`` as runs of its row-major order, chained end to end.

    Row-major order numbers the anchor's points 0 .. N - 1 one to one. A box inside it is a
    few runs of consecutive numbers (one, when past its first dim longer than one it spans
    whole dims only). The runs, sorted by start, tile the anchor exactly when each starts
    where the previous one ended, the first at 0 and the last ending at N: then every number
    is in exactly one run. A sort of integers, where the corner count hashes ``2**d`` corners
    a box; the planner's chunks are such runs (it cuts parts in row-major order). False
    means "not shown here" (a box outside, empty, of many runs, or not a tiling): the corner
    count then decides and finds the witness.
    """
    if not boxes:  # the corner count reports the gap
        return False
    a_lo, a_hi = anchor.lo, anchor.hi
    nd = len(a_lo)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * (a_hi[d + 1] - a_lo[d + 1])
    dims = tuple(zip(a_lo, a_hi, strides, range(1, nd + 1)))
    runs: list[tuple[int, int]] = []
    for b in boxes:
        lo, hi = b.lo, b.hi
        if len(lo) != nd or len(hi) != nd:
            return False
        start, first = 0, None  # first: its first dim longer than one, if it is several runs
        for a, z, s, nxt in dims:
            l, h = lo[nxt - 1], hi[nxt - 1]
            if not a <= l < h <= z:
                return False
            start += (l - a) * s
            if h - l > 1:  # the first dim longer than one: the rest must be whole
                if lo[nxt:] != a_lo[nxt:] or hi[nxt:] != a_hi[nxt:]:
                    first = nxt - 1
                break
        else:  # one point
            runs.append((start, 1))
            continue
        if first is None:
            runs.append((start, (h - l) * s))
            continue
        if not _box_runs(b, dims, first, start, runs):
            return False
    runs.sort()
    pos = 0
    for start, length in runs:
        if start != pos:
            return False
        pos += length
    return pos == (strides[0] * (a_hi[0] - a_lo[0]) if nd else 1)


def _box_runs(b: Box, dims: tuple, first: int, start: int, runs: list[tuple[int, int]]
              ) -> bool:
    """Append the runs of ``b``, whose first dim longer than one is ``first`` (``start``: its
    lo's number) and which spans some later dim in part: one run per index of the dims
    before its last partial one. False if a dim is out of the anchor or there are more than
    ``RUNS_PER_BOX`` runs."""
    lo, hi = b.lo, b.hi
    last = max(d for d, (a, z, _, _) in enumerate(dims) if lo[d] != a or hi[d] != z)
    for d in range(first + 1, last + 1):
        a, z = dims[d][0], dims[d][1]
        if not a <= lo[d] < hi[d] <= z:
            return False
        start += (lo[d] - a) * dims[d][2]
    starts = [start]
    for d in range(first, last):
        step, n = dims[d][2], hi[d] - lo[d]
        if len(starts) * n > RUNS_PER_BOX:
            return False
        starts = [x + i * step for x in starts for i in range(n)]
    length = (hi[last] - lo[last]) * dims[last][2]
    runs.extend([(x, length) for x in starts])
    return True


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
