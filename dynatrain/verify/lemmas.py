"""Symbolic lemmas behind the IR's and planner's region arithmetic, proved with z3.

The plan verifier checks concrete plans by exact integer sort-and-scan; the region arithmetic
those plans come from (shard offsets, vocab padding, flat-range boxes, optimizer shard ranges,
expert placement, box algebra) is proved here once, for all sizes and ranks.

Each lemma is a function building a z3 formula over free integers; ``prove`` checks that its
negation is unsat. The formulas are built from *model functions* (``even_shard``, ``flat_pieces``,
``padded_vocab_rows``, ...) that restate the IR's formulas and evaluate on plain ints as well as
on z3 terms, so tests can check the very same functions against the IR code on concrete grids.
A lemma builder takes the model function as a parameter: a wrong variant is the same lemma over a
wrong model, and ``prove`` returns its counterexample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import z3
from z3.z3util import get_vars

Num = Any  # an int, or a z3 integer term
Cond = Any  # a bool, or a z3 boolean term
Span = tuple[tuple[Num, ...], tuple[Num, ...]]  # a box as (lo, hi)

# A lemma: one formula, or goals proved one by one; the lemma is their conjunction, so a
# goal may take the conclusions of the goals before it as hypotheses.
Formula = z3.BoolRef | tuple[z3.BoolRef, ...]

TIMEOUT_MS = 10_000  # per lemma


@dataclass(frozen=True, slots=True)
class LemmaResult:
    """The outcome of one proof attempt.

    ``proved`` is False both when z3 finds a counterexample (``counterexample`` holds the model of
    the negation, every free variable of the formula) and when it gives up (``None``).
    """

    name: str
    proved: bool
    seconds: float
    counterexample: dict[str, int] | None


# ---- int-or-z3 helpers: the model functions below run on both --------------------------------

def _sym(*xs: Any) -> bool:
    return any(isinstance(x, z3.ExprRef) for x in xs)


def _div(x: Num, y: Num) -> Num:
    # z3's div floors for a positive divisor, as Python's // does; every divisor here is > 0.
    return x / y if _sym(x, y) else x // y


def _if(c: Cond, t: Any, e: Any) -> Any:
    return z3.If(c, t, e) if _sym(c, t, e) else (t if c else e)


def _max(x: Num, y: Num) -> Num:
    return _if(x >= y, x, y)


def _min(x: Num, y: Num) -> Num:
    return _if(x <= y, x, y)


def _and(*cs: Cond) -> Cond:
    return z3.And(*cs) if _sym(*cs) else all(cs)


def _ints(names: str) -> list[z3.ArithRef]:
    return list(z3.Ints(names))


def _between(lo: Num, x: Num, hi: Num) -> Cond:
    return _and(lo <= x, x < hi)


# ---- model functions: the IR's formulas, statement for statement -----------------------------

def even_shard(rank: Num, n: Num, k: Num) -> tuple[Num, Num]:
    """Rows ``[lo, hi)`` that ``shard`` gives TP rank ``rank`` of ``k`` for a dim of size ``n``."""
    local = _div(n, k)
    return rank * local, rank * local + local


def glu_pieces(rank: Num, rows: Num, tp: Num) -> tuple[tuple[Num, Num, Num], ...]:
    """``shard``'s two SwiGLU pieces of ``[gate; up]``: (local lo, global lo, length) each."""
    half = _div(rows, 2)
    chunk = _div(half, tp)
    return tuple((k * chunk, k * half + rank * chunk, chunk) for k in (0, 1))


def glu_global_row(rank: Num, j: Num, rows: Num, tp: Num) -> Num:
    """The global row that local row ``j`` of TP rank ``rank`` holds (through its piece)."""
    (l0, g0, _), (l1, g1, _) = glu_pieces(rank, rows, tp)
    return _if(j < l1, g0 + j - l0, g1 + j - l1)


def box_and(a: Span, b: Span) -> tuple[Cond, tuple[Num, ...], tuple[Num, ...]]:
    """``Box.__and__``: (not None, lo, hi) of the intersection of boxes ``(lo, hi)``."""
    lo = tuple(_max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(_min(x, y) for x, y in zip(a[1], b[1]))
    return _and(*(x < y for x, y in zip(lo, hi))), lo, hi


def box_has(lo: tuple[Num, ...], hi: tuple[Num, ...], p: tuple[Num, ...]) -> Cond:
    """Point ``p`` lies in the half-open box ``[lo, hi)``."""
    return _and(*(_between(l, x, h) for l, x, h in zip(lo, p, hi)))


Piece2 = tuple[Cond, Num, Num, Num, Num]  # (emitted, row lo, row hi, col lo, col hi)


def flat_pieces(cols: Num, a: Num, b: Num) -> tuple[Piece2, Piece2, Piece2]:
    """``flat_boxes((rows, cols), a, b)`` for ``a < b``: head, middle and tail box, in order."""
    row = _div(a, cols)
    head = a % cols != 0
    end = _min(b, (row + 1) * cols)
    head_box = (head, row, row + 1, a % cols, end - row * cols)
    a1, row1 = _if(head, end, a), _if(head, row + 1, row)
    middle = _div(b, cols) > row1
    mid_box = (middle, row1, _div(b, cols), 0, cols)
    a2 = _if(middle, _div(b, cols) * cols, a1)
    tail_row = _div(a2, cols)
    tail_box = (a2 < b, tail_row, tail_row + 1, 0, b - a2)
    return head_box, mid_box, tail_box


def padded_vocab_rows(vocab: Num, multiple: Num, tp: Num) -> Num:
    """``padded_vocab``: ``vocab`` rounded up to a multiple of ``multiple * tp``."""
    mult = multiple * tp
    return -_div(-vocab, mult) * mult


def pad_up(i: Num, d: Num) -> Num:
    """``layout_buffer``'s pad_param/pad_bucket: ``i`` rounded up to a multiple of ``d``."""
    return -_div(-i, d) * d


def owned_range(bs: Num, be: Num, dp: Num, rank: Num) -> tuple[Num, Num]:
    """``owned_ranges``: the buffer range optimizer rank ``rank`` of ``dp`` owns in ``[bs, be)``."""
    size = _div(be - bs, dp)
    return bs + rank * size, bs + (rank + 1) * size


def owned_piece(start: Num, end: Num, lo: Num, hi: Num) -> tuple[Cond, Num, Num]:
    """``owned_ranges``: (kept, a, z) for param ``[start, end)`` cut by a rank's ``[lo, hi)``."""
    a, z = _max(start, lo), _min(end, hi)
    return a < z, a, z


def expert_global(ep_rank: Num, j: Num, experts: Num, ep: Num) -> Num:
    """``chunk_params``: the global expert index of local expert ``j`` on EP rank ``ep_rank``."""
    return ep_rank * _div(experts, ep) + j


def expert_home(e: Num, experts: Num, ep: Num) -> tuple[Num, Num]:
    """(EP rank, local index) that holds global expert ``e`` (the inverse of expert_global)."""
    per_rank = _div(experts, ep)
    return _div(e, per_rank), e % per_rank


def index_window(entry_lo: Num, run_end: Num, query_lo: Num, query_hi: Num) -> Cond:
    """``_Sorted.query`` scans the entries whose running end (the largest end along the sorted
    dim up to and including the entry) passes ``query_lo`` and whose start lies before
    ``query_hi`` (its two bisections)."""
    return _and(query_lo < run_end, entry_lo < query_hi)


# ---- lemmas ------------------------------------------------------------------------------------

def even_split_tiles(split: Callable[..., tuple[Num, Num]] = even_shard) -> z3.BoolRef:
    """For k | n the k shards lie in [0, n) and each x in [0, n) is in exactly one, x div (n/k)."""
    n, k, x, r, r1, r2 = _ints("n k x r r1 r2")

    def has(rank: Num) -> Cond:
        lo, hi = split(rank, n, k)
        return _between(lo, x, hi)

    lo, hi = split(r, n, k)
    home = x / (n / k)
    return z3.Implies(
        z3.And(k > 0, n > 0, n % k == 0),
        z3.And(
            z3.Implies(_between(0, r, k), z3.And(0 <= lo, lo < hi, hi <= n)),
            z3.Implies(_between(0, x, n), z3.And(_between(0, home, k), has(home))),
            z3.Implies(z3.And(has(r1), has(r2)), r1 == r2),
        ))


def glu_shard_bijective(row_of: Callable[..., Num] = glu_global_row) -> tuple[z3.BoolRef, ...]:
    """SwiGLU: (TP rank, local row) -> global row is a bijection onto [0, rows) for 2*tp | rows.

    ``shard`` rejects other sizes, so ``rows = 2 * tp * f``. First goal: half, chunk and the
    local size are tp*f, f and 2*f, so the two pieces tile the local rows; the later goals
    assume it (z3 finds those quotients reliably only as a goal of their own).
    """
    rows, tp, f, r, j, r2, j2, x = _ints("rows tp f r j r2 j2 x")
    half, chunk, local = rows / 2, rows / 2 / tp, rows / tp  # as shard() computes them
    sizes = z3.And(tp > 0, f > 0, rows == 2 * tp * f)
    known = z3.And(sizes, half == tp * f, chunk == f, local == 2 * f)
    valid = lambda rr, jj: z3.And(_between(0, rr, tp), _between(0, jj, local))  # noqa: E731
    # A preimage of x: its half, then its rank and offset within that half.
    k = x / half
    xr, xj = (x - k * half) / chunk, k * chunk + (x - k * half) % chunk
    return (
        z3.Implies(sizes, z3.And(half == tp * f, chunk == f, local == 2 * f)),
        z3.Implies(z3.And(known, valid(r, j)), _between(0, row_of(r, j, rows, tp), rows)),
        z3.Implies(z3.And(known, valid(r, j), valid(r2, j2),
                          row_of(r, j, rows, tp) == row_of(r2, j2, rows, tp)),
                   z3.And(r == r2, j == j2)),
        z3.Implies(z3.And(known, _between(0, x, rows)),
                   z3.And(valid(xr, xj), row_of(xr, xj, rows, tp) == x)),
    )


def box_and_exact(ndim: int, inter: Callable[..., tuple] = box_and) -> z3.BoolRef:
    """``Box.__and__`` in ``ndim`` dims holds a point iff both boxes do (None iff none does)."""
    vs = _ints(" ".join(f"{n}{d}" for n in ("alo", "ahi", "blo", "bhi", "p") for d in range(ndim)))
    alo, ahi, blo, bhi, p = (tuple(vs[i * ndim:(i + 1) * ndim]) for i in range(5))
    ok, lo, hi = inter((alo, ahi), (blo, bhi))
    return z3.And(ok, box_has(lo, hi, p)) == z3.And(box_has(alo, ahi, p), box_has(blo, bhi, p))


def _row_major_lex(C: Num, i: Num, j: Num, i2: Num, j2: Num) -> z3.BoolRef:
    """For C > 0 and columns j, j2 in [0, C): i*C + j >= i2*C + j2 iff (i, j) >= (i2, j2)."""
    return z3.Implies(
        z3.And(C > 0, _between(0, j, C), _between(0, j2, C)),
        (i * C + j >= i2 * C + j2) == z3.Or(i > i2, z3.And(i == i2, j >= j2)))


def row_major_lex() -> z3.BoolRef:
    """Row-major flat order is lexicographic order on (row, column)."""
    C, i, j, i2, j2 = _ints("C i j i2 j2")
    return _row_major_lex(C, i, j, i2, j2)


def flat_boxes_2d(pieces: Callable[..., tuple] = flat_pieces) -> z3.BoolRef:
    """``flat_boxes((R, C), a, b)``: non-empty in-bounds boxes, each cell of {a <= i*C+j < b} once.

    Assumes ``row_major_lex`` at the cells of ``a`` and ``b`` (a proved lemma): with it z3 needs
    about 0.2 s, without it anything from 0.3 s to over 10 s depending on its random seed.
    """
    R, C, a, b, i, j = _ints("R C a b i j")
    boxes = pieces(C, a, b)
    count = z3.Sum([z3.If(z3.And(on, box_has((r0, c0), (r1, c1), (i, j))), 1, 0)
                    for on, r0, r1, c0, c1 in boxes])
    flat = i * C + j
    lex = z3.And(_row_major_lex(C, i, j, a / C, a % C), _row_major_lex(C, i, j, b / C, b % C))
    return z3.Implies(
        z3.And(R > 0, C > 0, 0 <= a, a < b, b <= R * C, lex),
        z3.And(
            *(z3.Implies(on, z3.And(0 <= r0, r0 < r1, r1 <= R, 0 <= c0, c0 < c1, c1 <= C))
              for on, r0, r1, c0, c1 in boxes),
            z3.Implies(z3.And(_between(0, i, R), _between(0, j, C)),
                       count == z3.If(z3.And(a <= flat, flat < b), 1, 0)),
        ))


def vocab_padding(pad: Callable[..., Num] = padded_vocab_rows) -> z3.BoolRef:
    """Padded vocab P: V <= P < V + m*tp and tp | P; padding rows only end a rank's shard.

    Rank r holds rows [lo, hi) = [r*P/tp, (r+1)*P/tp). ``logical_box`` clips hi to V: the
    result is exactly the shard's real rows, starts at lo (local offsets stay valid) and is
    empty (None) iff lo >= V.
    """
    V, m, tp, r, x = _ints("V m tp r x")
    P = pad(V, m, tp)
    lo, hi = r * (P / tp), (r + 1) * (P / tp)
    clipped = _min(hi, V)
    return z3.Implies(
        z3.And(V > 0, m > 0, tp > 0),
        z3.And(
            V <= P, P - V < m * tp, P % tp == 0,
            z3.Implies(_between(0, r, tp),
                       z3.And(_between(lo, x, clipped) == z3.And(_between(lo, x, hi), x < V),
                              (lo < clipped) == (lo < V))),
        ))


def param_start_alignment(pad: Callable[..., Num] = pad_up) -> z3.BoolRef:
    """pad_param: a param starts on the first multiple of 64 at or after the previous end."""
    prev, = _ints("prev")
    s = pad(prev, 64)
    return z3.Implies(prev >= 0, z3.And(s % 64 == 0, prev <= s, s < prev + 64))


def bucket_padding_divides(pad: Callable[..., Num] = pad_up) -> tuple[z3.BoolRef, ...]:
    """pad_bucket to a common multiple ``div`` of D and 128 leaves buckets D splits exactly.

    A bucket starts at 0 or at the previous (padded) bucket end, so at ``kb * div``. ``div``
    (lcm(D, 128) in the code) is written once as D*u and once as 128*w: the same set of
    numbers, but z3 proves "D divides" only from the first and "128 divides" from the second,
    and each goal alone in under a second but not their conjunction in 10 s.
    """
    D, u, w, kb, bs, pe = _ints("D u w kb bs pe")
    by_d, by_128 = D * u, 128 * w
    be_d, be_128 = pad(pe, by_d), pad(pe, by_128)
    return (
        z3.Implies(z3.And(D > 0, u > 0, kb >= 0, bs == kb * by_d, pe >= bs, by_d % 128 == 0),
                   z3.And(pe <= be_d, be_d - pe < by_d, (be_d - bs) % D == 0)),
        z3.Implies(z3.And(D > 0, w > 0, kb >= 0, bs == kb * by_128, pe >= bs, by_128 % D == 0),
                   be_128 % 128 == 0),
    )


def _split_by_dp(bs: Num, be: Num, dp: Num) -> Cond:
    return (be - bs) % dp == 0  # what bucket_padding_divides guarantees


def optimizer_ranges_tile(ranges: Callable[..., tuple[Num, Num]] = owned_range,
                          bucket_ok: Callable[..., Cond] = _split_by_dp) -> z3.BoolRef:
    """For D | be - bs, the D rank ranges lie in [bs, be) and each index has exactly one owner.

    ``bucket_ok(bs, be, D)`` is what is known of a bucket's size (a variant may weaken it).
    """
    D, bs, be, r, r1, r2, x = _ints("D bs be r r1 r2 x")

    def has(rank: Num) -> Cond:
        lo, hi = ranges(bs, be, D, rank)
        return _between(lo, x, hi)

    lo, hi = ranges(bs, be, D, r)
    home = (x - bs) / ((be - bs) / D)
    return z3.Implies(
        z3.And(D > 0, 0 <= bs, bs < be, bucket_ok(bs, be, D)),
        z3.And(
            z3.Implies(_between(0, r, D), z3.And(bs <= lo, lo < hi, hi <= be)),
            z3.Implies(_between(bs, x, be), z3.And(_between(0, home, D), has(home))),
            z3.Implies(z3.And(has(r1), has(r2)), r1 == r2),
        ))


def optimizer_param_pieces(piece: Callable[..., tuple] = owned_piece) -> z3.BoolRef:
    """A param [s, e) in bucket [bs, be): every element in exactly one rank's kept piece.

    Kept pieces lie in [s, e) and in the rank's range, so their gbuf_local and param offsets
    are in bounds; with disjointness this is: the pieces' lengths sum to e - s.
    """
    D, bs, be, s, e, r, r1, r2, x = _ints("D bs be s e r r1 r2 x")
    size = (be - bs) / D

    def has(rank: Num) -> Cond:
        lo, hi = owned_range(bs, be, D, rank)
        on, a, z = piece(s, e, lo, hi)
        return z3.And(_between(0, rank, D), on, _between(a, x, z))

    lo, hi = owned_range(bs, be, D, r)
    on, a, z = piece(s, e, lo, hi)
    return z3.Implies(
        z3.And(D > 0, 0 <= bs, bs <= s, s <= e, e <= be, (be - bs) % D == 0),
        z3.And(
            z3.Implies(z3.And(_between(0, r, D), on),
                       z3.And(s <= a, z <= e, 0 <= a - lo, z - lo <= size)),
            z3.Implies(_between(s, x, e), has((x - bs) / size)),
            z3.Implies(z3.And(has(r1), has(r2)), r1 == r2),
        ))


def optimizer_piece_lengths_sum(piece: Callable[..., tuple] = owned_piece,
                                max_dp: int = 8) -> z3.BoolRef:
    """For D <= max_dp, the lengths of a param's kept pieces over all D ranks sum to e - s."""
    D, bs, be, s, e = _ints("D bs be s e")
    total = []
    for r in range(max_dp):  # unrolled: ranks past D contribute nothing
        on, a, z = piece(s, e, *owned_range(bs, be, D, r))
        total.append(z3.If(z3.And(r < D, on), z - a, 0))
    return z3.Implies(
        z3.And(D > 0, D <= max_dp, 0 <= bs, bs <= s, s <= e, e <= be, (be - bs) % D == 0),
        z3.Sum(total) == e - s)


def expert_owner_unique(home: Callable[..., tuple[Num, Num]] = expert_home) -> z3.BoolRef:
    """For ep | E, expert e sits on exactly one EP rank, at a local index in [0, E/ep)."""
    E, ep, e, r, j = _ints("E ep e r j")
    owner, local = home(e, E, ep)
    return z3.Implies(
        z3.And(E > 0, ep > 0, E % ep == 0, _between(0, e, E)),
        z3.And(
            _between(0, owner, ep), _between(0, local, E / ep),
            expert_global(owner, local, E, ep) == e,
            z3.Implies(z3.And(_between(0, r, ep), _between(0, j, E / ep),
                              expert_global(r, j, E, ep) == e),
                       z3.And(r == owner, j == local)),
        ))


def grid_radix_step() -> z3.BoolRef:
    """(c, q) -> c + s*q is a bijection [0, s) x [0, W) -> [0, s*W), inverted by (mod s, div s).

    ``Grid.rank`` is c0 + s0 * (rank of the other tokens) and ``Grid.coords`` peels
    (rank mod s0, rank div s0) the same way, so by induction on the tokens they are inverse
    bijections between coordinates and [0, world). A group that fixes every token but one
    (an EDP replica's EP group) thus has exactly one rank per value of that token.
    """
    s, W, c, q, rank = _ints("s W c q rank")
    joined = c + s * q
    return z3.Implies(
        z3.And(s > 0, W > 0),
        z3.And(
            z3.Implies(z3.And(_between(0, c, s), _between(0, q, W)),
                       z3.And(_between(0, joined, s * W), joined % s == c, joined / s == q)),
            z3.Implies(_between(0, rank, s * W),
                       z3.And(_between(0, rank % s, s), _between(0, rank / s, W),
                              rank % s + s * (rank / s) == rank)),
        ))


def _box2(name: str) -> tuple[tuple[z3.ArithRef, ...], tuple[z3.ArithRef, ...]]:
    v = _ints(f"{name}lo0 {name}lo1 {name}hi0 {name}hi1")
    return (v[0], v[1]), (v[2], v[3])


def _subset(inner: tuple, outer: tuple) -> z3.BoolRef:
    return z3.And(*(z3.And(o <= i, j <= p) for i, j, o, p in zip(*inner, *outer)))


def box_subset_transitive_2d() -> z3.BoolRef:
    """part <= box <= anchor gives part <= anchor, and simulate's ``_within`` slices fit anchor."""
    part, box, anchor = _box2("part"), _box2("box"), _box2("anchor")
    nonempty = z3.And(*(l < h for l, h in zip(*part)))
    slices_fit = z3.And(*(z3.And(0 <= l - a, l - a <= h - a, h - a <= ah - a)
                          for l, h, a, ah in zip(*part, *anchor)))
    return z3.Implies(z3.And(nonempty, _subset(part, box), _subset(box, anchor)),
                      z3.And(_subset(part, anchor), slices_fit))


def box_split_volume_2d() -> z3.BoolRef:
    """Cutting a 2-D box at lo < c < hi along either dim keeps its volume (numel)."""
    (l0, l1), (h0, h1) = _box2("b")
    c, = _ints("c")
    vol = lambda a0, a1, b0, b1: (b0 - a0) * (b1 - a1)  # noqa: E731  Box.numel
    full = vol(l0, l1, h0, h1)
    return z3.And(
        z3.Implies(z3.And(l0 < c, c < h0, l1 < h1),
                   vol(l0, l1, c, h1) + vol(c, l1, h0, h1) == full),
        z3.Implies(z3.And(l1 < c, c < h1, l0 < h0),
                   vol(l0, l1, h0, c) + vol(l0, c, h0, h1) == full))


def index_query_window(window: Callable[..., Cond] = index_window) -> z3.BoolRef:
    """An entry that meets the query along the sorted dim is in the scan (its running end is
    at least its own end)."""
    elo, ehi, run_end, qlo, qhi = _ints("elo ehi run_end qlo qhi")
    meets = z3.And(elo < qhi, qlo < ehi, elo < ehi, qlo < qhi)
    return z3.Implies(z3.And(meets, run_end >= ehi), window(elo, run_end, qlo, qhi))


LEMMAS: dict[str, Callable[[], Formula]] = {
    "even_split_tiles": even_split_tiles,
    "glu_shard_bijective": glu_shard_bijective,
    "box_and_1d": partial(box_and_exact, 1),
    "box_and_2d": partial(box_and_exact, 2),
    "row_major_lex": row_major_lex,
    "flat_boxes_2d": flat_boxes_2d,
    "vocab_padding": vocab_padding,
    "param_start_alignment": param_start_alignment,
    "bucket_padding_divides": bucket_padding_divides,
    "optimizer_ranges_tile": optimizer_ranges_tile,
    "optimizer_param_pieces": optimizer_param_pieces,
    "optimizer_piece_lengths_sum": optimizer_piece_lengths_sum,
    "expert_owner_unique": expert_owner_unique,
    "grid_radix_step": grid_radix_step,
    "box_subset_transitive_2d": box_subset_transitive_2d,
    "box_split_volume_2d": box_split_volume_2d,
    "index_query_window": index_query_window,
}


def purify_divisions(formula: z3.BoolRef) -> z3.BoolRef:
    """Name every ``x div y`` and ``x mod y`` by fresh q, r with y > 0 -> x == q*y + r, 0 <= r < y.

    Valid iff ``formula`` is: the real quotient and remainder are one choice of q and r, and for
    y > 0 the only one. z3 reasons about the product q*y much faster than about div and mod.
    """
    seen, found, stack = set(), [], [formula]
    while stack:
        e = stack.pop()
        if e.get_id() in seen or not z3.is_app(e):
            continue
        seen.add(e.get_id())
        if e.decl().kind() in (z3.Z3_OP_IDIV, z3.Z3_OP_MOD):
            found.append(e)
        stack.extend(e.children())
    names: dict[tuple[int, int], tuple[z3.ArithRef, z3.ArithRef]] = {}
    pairs, facts = [], []
    for e in found:
        x, y = e.children()
        key = (x.get_id(), y.get_id())
        if key not in names:
            q, r = names[key] = z3.Int(f"_q{len(names)}"), z3.Int(f"_r{len(names)}")
            facts.append(z3.Implies(y > 0, z3.And(x == q * y + r, 0 <= r, r < y)))
        q, r = names[key]
        pairs.append((e, q if e.decl().kind() == z3.Z3_OP_IDIV else r))
    if not pairs:
        return formula
    # One simultaneous substitution: a nested x div y inside a fact is renamed as well.
    return z3.substitute(z3.Implies(z3.And(*facts), formula), *pairs)


def _check(formula: z3.BoolRef, timeout_ms: int) -> tuple[z3.CheckSatResult, z3.ModelRef | None]:
    solver = z3.Solver()
    solver.set("timeout", max(timeout_ms, 1))
    solver.add(z3.Not(formula))
    verdict = solver.check()
    return verdict, solver.model() if verdict == z3.sat else None


def _falsifies(formula: z3.BoolRef, model: z3.ModelRef) -> dict[str, int] | None:
    """The model's values of ``formula``'s variables, if they really make it false."""
    values = {v: model.eval(v, model_completion=True) for v in get_vars(formula)}
    if not z3.is_false(z3.simplify(z3.substitute(formula, *values.items()))):
        return None  # e.g. a model that chose a quotient for a division by zero
    return {str(v): x.as_long() for v, x in sorted(values.items(), key=lambda kv: str(kv[0]))}


def prove(lemma: str | Callable[[], Formula], timeout_ms: int = TIMEOUT_MS) -> LemmaResult:
    """Prove a registered lemma (by name) or any formula builder: its negation must be unsat.

    A builder returns one formula, or a tuple of goals proved one by one (their conjunction
    is the lemma); each goal has its divisions purified. The timeout is for the whole lemma.
    A counterexample is checked by evaluating the original formula at it; one that does not
    falsify it sends the search to the unpurified formula for the rest of the time.
    """
    name, build = (lemma, LEMMAS[lemma]) if isinstance(lemma, str) else (
        getattr(lemma, "__name__", repr(lemma)), lemma)
    t0 = time.perf_counter()
    proved, cex = True, None
    built = build()
    for goal in built if isinstance(built, tuple) else (built,):
        left = timeout_ms - int((time.perf_counter() - t0) * 1000)
        verdict, cex = _prove_goal(goal, left)
        if verdict != z3.unsat:
            proved = False
            break
    return LemmaResult(name, proved, time.perf_counter() - t0, cex)


def _prove_goal(goal: z3.BoolRef, timeout_ms: int) -> tuple[z3.CheckSatResult, dict | None]:
    t0 = time.perf_counter()
    verdict, model = _check(purify_divisions(goal), timeout_ms)
    cex = _falsifies(goal, model) if model is not None else None
    if verdict == z3.sat and cex is None:  # spurious: retry on the formula as written
        left = timeout_ms - int((time.perf_counter() - t0) * 1000)
        verdict, model = _check(goal, left)
        cex = _falsifies(goal, model) if model is not None else None
        if verdict == z3.sat and cex is None:
            verdict = z3.unknown
    return verdict, cex


def prove_all(timeout_ms: int = TIMEOUT_MS) -> list[LemmaResult]:
    """Every registered lemma, in registry order."""
    return [prove(name, timeout_ms) for name in LEMMAS]
