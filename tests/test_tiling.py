"""The verifier's exact tiling check (``ir.tiling``) against a numpy count grid, and on the
hostile shapes that made the old sweep quadratic and its gap search a dense grid.

The oracle counts, for every point of the anchor, how many boxes hold it; the check must say
"tiles" exactly when every count is one, and otherwise name the lexicographically least point
whose count is not one, with the right kind (gap or overlap) and boxes that really cover it.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from dynatrain.ir.box import Box
from dynatrain.ir.tiling import (RUNS_PER_BOX, Fault, _chain_of_runs, inside,
                                 tiling_fault, well_formed)


def _holds(b: Box, p: tuple[int, ...]) -> bool:
    return all(l <= x < h for l, h, x in zip(b.lo, b.hi, p))


def _oracle(anchor: Box, boxes: list[Box]) -> Fault | None:
    """The fault ``tiling_fault`` must return, found by brute force."""
    ndim = len(anchor.lo)
    for i, b in enumerate(boxes):
        if not well_formed(b, ndim):
            return Fault("empty", tuple(b.lo), (i,))
        if not inside(b, anchor):
            return Fault("outside", (), (i,))  # any point of b outside the anchor will do
    count = np.zeros(anchor.shape, dtype=np.int64)
    for b in boxes:
        count[tuple(slice(l - a, h - a) for l, h, a in zip(b.lo, b.hi, anchor.lo))] += 1
    bad = np.argwhere(count != 1)  # row-major order: the first is the least point
    if not len(bad):
        return None
    cell = tuple(int(x) for x in bad[0])
    point = tuple(a + x for a, x in zip(anchor.lo, cell))
    return Fault("missing" if count[cell] == 0 else "twice", point, ())


def _agrees(anchor: Box, boxes: list[Box]) -> None:
    got, want = tiling_fault(anchor, boxes), _oracle(anchor, boxes)
    assert (got is None) == (want is None), (got, want)
    if got is None:
        return
    assert got.what == want.what, (got, want)
    if got.what in ("empty", "outside"):
        assert got.boxes == want.boxes, (got, want)
    if got.what == "outside":
        (i,) = got.boxes
        assert _holds(boxes[i], got.point)
        assert not _holds(anchor, got.point)
    else:
        assert got.point == want.point, (got, want)
    if got.what == "twice":
        i, j = got.boxes
        assert i < j and _holds(boxes[i], got.point) and _holds(boxes[j], got.point)
    if got.what == "missing":
        assert got.boxes == () and not any(_holds(b, got.point) for b in boxes)


# ---- random boxes and random tilings against the count grid ---------------------------------

@st.composite
def anchors(draw, max_ndim: int = 4) -> Box:
    ndim = draw(st.integers(0, max_ndim))
    lo = tuple(draw(st.integers(-2, 3)) for _ in range(ndim))
    return Box(lo, tuple(l + draw(st.integers(1, 5)) for l in lo))


@st.composite
def box_in(draw, anchor: Box, wild: bool = False) -> Box:
    """A box inside ``anchor``, or (``wild``) maybe empty or sticking out by one."""
    lo, hi = [], []
    for a, z in zip(anchor.lo, anchor.hi):
        x = draw(st.integers(a - 1, z) if wild else st.integers(a, z - 1))
        lo.append(x)
        hi.append(draw(st.integers(x, z + 1) if wild else st.integers(x + 1, z)))
    return Box(tuple(lo), tuple(hi))


@st.composite
def loose_boxes(draw):
    """Any boxes near an anchor: overlapping, leaving gaps, now and then empty or outside."""
    anchor = draw(anchors())
    n = draw(st.integers(0, 6))
    return anchor, [draw(box_in(anchor, wild=draw(st.integers(0, 5)) == 0)) for _ in range(n)]


def _split(draw, box: Box, depth: int) -> list[Box]:
    cuttable = [d for d, (l, h) in enumerate(zip(box.lo, box.hi)) if h - l > 1]
    if not cuttable or depth == 0 or draw(st.integers(0, 4)) == 0:
        return [box]
    d = draw(st.sampled_from(cuttable))
    at = draw(st.integers(box.lo[d] + 1, box.hi[d] - 1))
    left = Box(box.lo, box.hi[:d] + (at,) + box.hi[d + 1:])
    right = Box(box.lo[:d] + (at,) + box.lo[d + 1:], box.hi)
    return _split(draw, left, depth - 1) + _split(draw, right, depth - 1)


def _broken(draw, anchor: Box, boxes: list[Box], how: str) -> list[Box]:
    """``boxes`` broken the way a bad plan is (``how``): a box dropped, duplicated, shifted
    by one, shrunk by one, or an extra box added; kept as they are otherwise."""
    i = draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    if how == "drop":
        return boxes[:i] + boxes[i + 1:]
    if how == "duplicate":
        return boxes + [b]
    if how in ("shift", "shrink") and b.lo:
        d = draw(st.integers(0, len(b.lo) - 1))
        step = draw(st.sampled_from([-1, 1])) if how == "shift" else 0
        lo = b.lo[:d] + (b.lo[d] + step,) + b.lo[d + 1:]
        hi = b.hi[:d] + (b.hi[d] + (step or -1),) + b.hi[d + 1:]
        return boxes[:i] + [Box(lo, hi)] + boxes[i + 1:]
    if how == "extra":  # overlaps some piece
        return boxes + [draw(box_in(anchor))]
    return boxes


@st.composite
def near_tilings(draw):
    """A guillotine tiling of an anchor, shuffled, then maybe broken (``_broken``)."""
    anchor = draw(anchors())
    boxes = draw(st.permutations(_split(draw, anchor, 6)))
    how = draw(st.sampled_from(["keep", "drop", "duplicate", "shift", "shrink", "extra"]))
    return anchor, _broken(draw, anchor, boxes, how)


@given(loose_boxes())
def test_loose_boxes_agree_with_the_count_grid(case) -> None:
    _agrees(*case)


@given(near_tilings())
def test_near_tilings_agree_with_the_count_grid(case) -> None:
    _agrees(*case)


# ---- row-major runs: the planner's own cuts, confirmed without corner counts -----------------

def _interval_boxes(lo: tuple[int, ...], shape: tuple[int, ...], s: int, e: int) -> list[Box]:
    """Boxes covering numbers [s, e) of the row-major order of the box at ``lo`` of ``shape``,
    as the planner cuts a part: a partial head index, whole indices, a partial tail index."""
    if s >= e:
        return []
    if not shape:
        return [Box((), ())]
    inner = int(np.prod(shape[1:]))
    i0, r0 = divmod(s, inner)
    i1, r1 = divmod(e, inner)

    def sub(i: int, a: int, b: int) -> list[Box]:
        return [Box((lo[0] + i,) + x.lo, (lo[0] + i + 1,) + x.hi)
                for x in _interval_boxes(lo[1:], shape[1:], a, b)]
    if i0 == i1:
        return sub(i0, r0, r1)
    out = []
    if r0:
        out += sub(i0, r0, inner)
        i0 += 1
    if i0 < i1:
        out.append(Box((lo[0] + i0,) + lo[1:], (lo[0] + i1,) + tuple(
            l + n for l, n in zip(lo[1:], shape[1:]))))
    return out + (sub(i1, 0, r1) if r1 else [])


@st.composite
def run_tilings(draw):
    """An anchor cut at random numbers of its row-major order into runs, shuffled, then maybe
    broken (``_broken``); now and then cut instead into a block of several runs (a few
    layers by part of the experts), the rest of its rows, and what lies below."""
    anchor = draw(anchors())
    shape, total = anchor.shape, anchor.numel
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, total - 1)), max_size=6))))
    edges = [0, *[c for c in cuts if 0 < c < total], total]
    boxes = [b for s, e in zip(edges, edges[1:]) for b in _interval_boxes(anchor.lo, shape, s, e)]
    if len(shape) >= 2 and shape[0] > 1 and shape[1] > 1 and draw(st.booleans()):
        # [lo0, lo0 + k) x [lo1, lo1 + j) x whole: k runs, then the rest of those rows
        k, j = draw(st.integers(1, shape[0])), draw(st.integers(1, shape[1] - 1))
        tail = anchor.lo[2:], anchor.hi[2:]
        block = Box((anchor.lo[0], anchor.lo[1]) + tail[0],
                    (anchor.lo[0] + k, anchor.lo[1] + j) + tail[1])
        rest = Box((anchor.lo[0], anchor.lo[1] + j) + tail[0],
                   (anchor.lo[0] + k, anchor.hi[1]) + tail[1])
        below = [Box((anchor.lo[0] + k,) + anchor.lo[1:], anchor.hi)] if k < shape[0] else []
        boxes = [block, rest, *below]
    boxes = draw(st.permutations(boxes))
    how = draw(st.sampled_from(["keep", "keep", "drop", "duplicate", "shift", "shrink"]))
    return anchor, _broken(draw, anchor, boxes, how), how == "keep"


@given(run_tilings())
def test_run_tilings_agree_with_the_count_grid(case) -> None:
    """Cut as the planner cuts, kept or broken: the verdict and the witness are the count
    grid's, and an unbroken cut is confirmed by the runs alone."""
    anchor, boxes, kept = case
    _agrees(anchor, boxes)
    if kept:
        assert _chain_of_runs(anchor, boxes)


def test_a_box_of_too_many_runs_is_left_to_the_corner_count() -> None:
    """A column of a matrix is a run per row: beyond RUNS_PER_BOX of them the runs are not
    listed, and the corner count decides (rightly) either way."""
    n = RUNS_PER_BOX + 1
    anchor = Box((0, 0), (n, 4))
    columns = [Box((0, 0), (n, 1)), Box((0, 1), (n, 4))]
    assert not _chain_of_runs(anchor, columns)
    assert tiling_fault(anchor, columns) is None
    short = [Box((0, 0), (n - 1, 1)), Box((0, 1), (n - 1, 4)), Box((n - 1, 0), (n, 4))]
    assert _chain_of_runs(anchor, short[1:]) is False  # not all of the anchor
    assert tiling_fault(anchor, short) is None
    assert tiling_fault(anchor, short[:2]) == Fault("missing", (n - 1, 0), ())


def test_scalars_are_written_once() -> None:
    scalar = Box((), ())
    assert tiling_fault(scalar, [scalar]) is None
    assert tiling_fault(scalar, []) == Fault("missing", (), ())
    assert tiling_fault(scalar, [scalar, scalar, scalar]) == Fault("twice", (), (0, 1))


def test_the_witness_is_the_least_miscovered_point_gap_or_overlap() -> None:
    """A gap before an overlap is named first (the old sweep named any overlap first)."""
    row = Box((0, 0), (1, 6))
    assert tiling_fault(row, [Box((0, 2), (1, 6)), Box((0, 3), (1, 4))]) == Fault(
        "missing", (0, 0), ())
    assert tiling_fault(row, [Box((0, 0), (1, 4)), Box((0, 2), (1, 3))]) == Fault(
        "twice", (0, 2), (0, 1))


def test_whole_dims_are_left_out_without_losing_the_witness() -> None:
    anchor = Box((3, 0, 0), (5, 4, 8))
    boxes = [Box((3, 0, 0), (5, 4, 8)), Box((3, 0, 0), (5, 4, 8))]
    assert tiling_fault(anchor, boxes) == Fault("twice", (3, 0, 0), (0, 1))
    half = [Box((3, 0, 0), (5, 2, 8))]
    assert tiling_fault(anchor, half) == Fault("missing", (3, 2, 0), ())


# ---- hostile shapes: bounded time and memory, same verdicts ----------------------------------

# The old sweep took ~4 s on a 2,000-box staircase and is quadratic: 2 minutes and more here.
N = 10_000


def _staircase(n: int) -> list[Box]:
    """Column i of an n x n square, cut at the diagonal: the lower part is long along dim 0
    and no two boxes overlap, so a sweep along dim 0 keeps all of them active."""
    return ([Box((i, i), (n, i + 1)) for i in range(n)]
            + [Box((0, i), (i, i + 1)) for i in range(1, n)])


def test_a_staircase_tiling_is_checked_in_linear_time() -> None:
    square = Box((0, 0), (N, N))
    boxes = _staircase(N)
    assert tiling_fault(square, boxes) is None
    boxes.append(Box((N // 2, N // 2), (N // 2 + 1, N // 2 + 1)))  # one element written again
    assert tiling_fault(square, boxes) == Fault("twice", (N // 2, N // 2), (N // 2, 2 * N - 1))


def test_a_staircase_with_a_gap_names_it_without_a_dense_grid() -> None:
    """Only the lower parts: N**2 / 2 elements unwritten; the old gap search built an N x N
    grid of the boxes' boundaries (100 M cells here) after the quadratic sweep."""
    square = Box((0, 0), (N, N))
    lower = [Box((i, i), (N, i + 1)) for i in range(N)]
    assert _agrees_small_witness(square, lower) == Fault("missing", (0, 1), ())


def test_diagonal_unit_cubes_name_a_gap_without_a_cubic_grid() -> None:
    """n unit cubes on the diagonal of an n**3 cube: the old grid had n**3 cells (27 G)."""
    n = 3000
    cube = Box((0, 0, 0), (n, n, n))
    diagonal = [Box((i, i, i), (i + 1, i + 1, i + 1)) for i in range(n)]
    assert _agrees_small_witness(cube, diagonal) == Fault("missing", (0, 0, 1), ())
    diagonal.append(Box((n - 2, n - 2, n - 2), (n, n, n)))  # overlaps the last two cubes
    assert _agrees_small_witness(cube, diagonal) == Fault("missing", (0, 0, 1), ())
    diagonal.append(cube)  # now every point is written, the diagonal ones twice
    assert _agrees_small_witness(cube, diagonal) == Fault("twice", (0, 0, 0), (0, n + 1))


def _agrees_small_witness(anchor: Box, boxes: list[Box]) -> Fault | None:
    """``tiling_fault``, with its witness checked against the boxes directly (the region is too
    big for the count grid): a gap point lies in no box, an overlap point in both named."""
    got = tiling_fault(anchor, boxes)
    assert got is not None and _holds(anchor, got.point)
    covering = [i for i, b in enumerate(boxes) if _holds(b, got.point)]
    assert (got.what, got.boxes) == (("missing", ()) if not covering else
                                     ("twice", tuple(covering[:2])))
    return got
