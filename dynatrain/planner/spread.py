"""Rounds by spreading: every pair of devices spreads its traffic evenly over all R rounds.

The pass that replaces greedy round packing, chosen because each device can compute its own
part of it alone. A pair's transfers, in a canonical order, are cut at R - 1 byte positions
(multiples of a unit, shifted by a phase fixed per pair); chunk i runs in round i. Every
device then sends, and receives, about 1/R of its traffic in every round, so the sum over
rounds of the busiest link is the busiest link over the whole switch: the lower bound, up to
the unit and the latency of R rounds.

R is the only global number. Each device knows its own pairs, so it can say the fewest rounds
from a candidate R up in which its chunks fit its half budget per direction (``fit_from``);
R is the fixpoint of taking the maximum of those over all devices (``agree_rounds``), which
the global planner computes over all devices and live processes compute with an all-reduce.
"""

from __future__ import annotations

import zlib
from math import gcd
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from ..ir.box import new_box
from ..ir.layout import Layout
from .classes import class_rounds
from .intersect import PlanError
from .plan import Round, Transfer
from .schedule import MAX_ROUNDS, _new, _sub, unit_bytes
from .sums import sum_by_index


class PairPhase:
    """A per-pair phase in [0, 2**32), so that small pairs land in different rounds.

    A function of where the two ranks sit, not of device names: the (TP, PP) position of
    each and how their data-parallel-with-context indices si (of the source's n) and di (of
    the destination's m) relate: si m' - di n' mod n m', with n', m' the two counts divided by
    their greatest common divisor. A receiver's pairs all differ in that triple, and so do a
    sender's. ``sources`` lays the m replicas of a position over the n holders, so moving
    every receiver m' replicas along moves its senders n' along: every phase stays, the
    data-parallel replicas it feeds alike are cut into rounds alike, and ``link_twins`` cuts
    each shape once. (With n = m the triple's last entry is si - di mod n.)
    """

    def __init__(self, src: Layout, dst: Layout) -> None:
        self.src, self.dst = src, dst
        n, m = src.dp * src.parallel.cp, dst.dp * dst.parallel.cp
        g = gcd(n, m)
        self.n_step, self.m_step, self.period = n // g, m // g, n * (m // g)
        self._src: dict[int, tuple[str, int]] = {}  # rank -> (position, replica index)
        self._dst: dict[int, tuple[str, int]] = {}
        self._phases: dict[tuple[str, str, int], int] = {}

    @staticmethod
    def _where(layout: Layout, memo: dict[int, tuple[str, int]], rank: int) -> tuple[str, int]:
        w = memo.get(rank)
        if w is None:
            c = layout.coords(rank)
            w = memo[rank] = (f"{c.tp},{c.pp}", c.dp_cp)
        return w

    def __call__(self, src_rank: int, dst_rank: int) -> int:
        sp, si = self._where(self.src, self._src, src_rank)
        dp, di = self._where(self.dst, self._dst, dst_rank)
        key = (sp, dp, (si * self.m_step - di * self.n_step) % self.period)
        phase = self._phases.get(key)
        if phase is None:  # few distinct triples: the replicas of a position repeat them
            phase = self._phases[key] = zlib.crc32(f"{sp}>{dp}|{key[2]}".encode())
        return phase


def canonical(transfers: Iterable[Transfer]) -> list[Transfer]:
    """A pair's transfers in the order both its ends compute alone."""
    return sorted(transfers, key=lambda t: (t.dst_rank, t.key, t.kinds, t.box.lo, t.box.hi))


def bounds(total: int, rounds: int, unit: int, phase: int) -> list[int]:
    """Chunk boundaries: 0, R - 1 cut positions, ``total`` (integers, so exact everywhere)."""
    den = rounds * unit << 32
    cuts = [min(total, unit * ((i * total << 32) + phase * rounds * unit) // den)
            for i in range(1, rounds)]
    return [0, *cuts, total]


def fill(t: Transfer, room: int, tol: int) -> tuple[list[Transfer], list[Transfer]]:
    """Leading slabs of ``t`` holding ``room`` bytes give or take ``tol``, and the rest of
    ``t``, in ``t``'s order. Coarse cuts first: whole indices of ``t``'s outermost dim longer
    than 1 when a boundary of them lies within ``tol`` of room, else the whole indices that
    fit and the next index filled the same way one dim further in (fewer, larger transfers
    than cutting at the exact byte).

    The descent into that next index runs in place on the bounds: only the pieces it keeps
    are built as transfers (a 4-d expert slab cut mid-row passes three levels). The rest is
    the innermost level's rest, then each level's tail, innermost first."""
    if t.nbytes <= room + tol:
        return [t], []
    if room <= 0:
        return [], [t]
    key, kinds, box, sr, dr, s_slot, s_anchor, d_slot, d_anchor, n = t
    a, z = [*box.lo], [*box.hi]  # the index being filled: a[j] + 1 == z[j] for dims j < d

    def piece(d: int, x: int, y: int, nbytes: int) -> Transfer:
        lo, hi = a.copy(), z.copy()
        lo[d], hi[d] = x, y
        return _new(Transfer, (key, kinds, new_box((*lo,), (*hi,)), sr, dr, s_slot, s_anchor,
                               d_slot, d_anchor, nbytes))

    heads: list[Transfer] = []
    tails: list[Transfer] = []
    whole: Transfer | None = t  # the index being filled as a transfer, while it is ``t``
    nd, d = len(a), 0
    while True:
        while z[d] - a[d] == 1:
            d += 1
            if d == nd:  # one element larger than room + tol
                return heads, [whole or piece(0, a[0], z[0], n), *reversed(tails)]
        per = n // (z[d] - a[d])
        k = (room + tol) // per  # the most whole indices within tolerance
        x = a[d]
        if k and room - k * per <= tol:
            heads.append(piece(d, x, x + k, per * k))
            return heads, [piece(d, x + k, z[d], per * (z[d] - x - k)), *reversed(tails)]
        if k:
            heads.append(piece(d, x, x + k, per * k))
        if x + k + 1 < z[d]:
            tails.append(piece(d, x + k + 1, z[d], per * (z[d] - x - k - 1)))
        a[d], z[d] = x + k, x + k + 1  # the next index, one dim further in
        n, room, whole = per, room - k * per, None
        if n <= room + tol:
            heads.append(piece(d, a[d], z[d], n))
            return heads, tails[::-1]
        if room <= 0:
            return heads, [piece(d, a[d], z[d], n), *reversed(tails)]


def split(transfers: list[Transfer], edges: list[int], tol: int) -> list[list[Transfer]]:
    """``transfers`` (canonical order) cut into ``len(edges) - 1`` chunks at ``edges``; every
    cut lies within ``tol`` bytes of its edge (``fill``), so a chunk holds its edges'
    difference plus at most ``2 * tol`` bytes, and nothing where its edges are equal.

    A transfer crossing several edges is usually cut at whole indices of one dim at each of
    them; those cuts are made straight from the transfer (``_whole_index_cuts``), the same
    pieces as cutting the rest again at every edge, without building each rest."""
    n = len(edges) - 1
    chunks: list[list[Transfer]] = [[] for _ in range(n)]
    i, pos = 0, 0
    todo = deque(transfers)
    while todo:
        t = todo.popleft()
        while i < n - 1 and pos >= edges[i + 1]:
            i += 1
        end = edges[i + 1]
        if i == n - 1 or pos + t.nbytes <= end:
            chunks[i].append(t)
            pos += t.nbytes
            continue
        t, i, pos = _whole_index_cuts(t, chunks, edges, i, pos, tol)
        if t is None:
            continue
        end = edges[i + 1]
        heads, rest = fill(t, end - pos, tol) if end - pos > tol else ([], [t])
        chunks[i].extend(heads)
        pos += sum(h.nbytes for h in heads)
        i += 1  # the rest starts the next chunk
        todo.extendleft(reversed(rest))
    return chunks


def _whole_index_cuts(t: Transfer, chunks: list[list[Transfer]], edges: list[int], i: int,
                      pos: int, tol: int) -> tuple[Transfer | None, int, int]:
    """``split``'s steps on ``t`` (which crosses the end of chunk ``i``) for as long as each
    is a whole-index cut along ``t``'s first dim longer than 1 (``fill``'s coarse case) or
    moves the rest on: the rest is kept as an index range and only the pieces are built.
    Returns (None, i, pos) when ``t`` is placed, else the rest as a transfer, for ``fill``,
    with the chunk and position it starts at."""
    box = t.box
    lo, hi = box.lo, box.hi
    d = next((j for j in range(len(lo)) if hi[j] - lo[j] > 1), None)
    if d is None:
        return t, i, pos
    n = len(edges) - 1
    per = t.nbytes // (hi[d] - lo[d])
    a, z = lo[d], hi[d]

    def piece(x: int, y: int) -> Transfer:
        return t if (x, y) == (lo[d], z) else _sub(t, box, d, x, y)

    while True:
        left = per * (z - a)
        while i < n - 1 and pos >= edges[i + 1]:
            i += 1
        end = edges[i + 1]
        if i == n - 1 or pos + left <= end:  # the rest fits chunk i
            chunks[i].append(piece(a, z))
            return None, i, pos + left
        room = end - pos
        if room <= tol:  # no cut this close to the edge: the rest starts the next chunk
            i += 1
            continue
        if left <= room + tol:  # within tolerance: the whole rest ends chunk i
            chunks[i].append(piece(a, z))
            return None, i + 1, pos + left
        k = (room + tol) // per
        if z - a == 1 or not (k and room - k * per <= tol):
            return piece(a, z), i, pos  # a finer cut: ``fill`` makes it
        chunks[i].append(_sub(t, box, d, a, a + k))
        pos += k * per
        a += k
        i += 1


class Pair:
    """One remote (source device, destination device) pair and its transfers.

    ``twin``: an earlier pair of the same shape (``link_twins``), or None. A twin has the
    same edges and loads and is cut into the same chunks, with its own two ranks; only the
    first pair of each shape is split (``classes.class_rounds``)."""

    __slots__ = ("src", "dst", "transfers", "nbytes", "elem", "elem_key", "phase", "twin",
                 "_cache", "_edges", "_loads")

    def __init__(self, src: str, dst: str, transfers: list[Transfer], phase: int,
                 per_elem: dict[tuple[str, tuple[str, ...]], int] | None = None) -> None:
        self.src, self.dst = src, dst
        ts = self.transfers = canonical(transfers) if len(transfers) > 1 else list(transfers)
        self.phase = phase
        self.twin: Pair | None = None
        self._cache: tuple[int, list[list[Transfer]]] | None = None
        self._edges: tuple[int, int, list[int]] | None = None
        self._loads: tuple[int, int, list[int]] | None = None
        # Bytes per element: the same for every transfer of one (key, kinds), so one each
        # (``per_elem``: a memo that the pairs of one plan share).
        known = {} if per_elem is None else per_elem
        if len(ts) == 1:  # most pairs of the largest switches: no table to build
            t = ts[0]
            e = known.get((t.key, t.kinds))
            if e is None:
                e = known[(t.key, t.kinds)] = t.nbytes // t.box.numel
            self.nbytes, self.elem, self.elem_key = t.nbytes, e, t.key
            return
        self.nbytes = sum(t.nbytes for t in ts)
        per: dict[tuple[str, tuple[str, ...]], int] = {}
        for t in ts:
            k = (t.key, t.kinds)
            if k not in per:
                e = known.get(k)
                if e is None:
                    e = known[k] = t.nbytes // t.box.numel
                per[k] = e
        # The largest element and, among keys with one that large, the least (``Demand``).
        self.elem = max(per.values(), default=0)
        self.elem_key = min((k for (k, _), e in per.items() if e == self.elem), default="")

    def edges(self, rounds: int, unit: int) -> list[int]:
        """``bounds`` of this pair (asked by both its devices' ``_fits`` and by ``chunks``)."""
        if self.twin is not None:
            return self.twin.edges(rounds, unit)
        e = self._edges
        if e is None or e[0] != rounds or e[1] != unit:
            e = self._edges = (rounds, unit, bounds(self.nbytes, rounds, unit, self.phase))
        return e[2]

    def loads(self, rounds: int, unit: int) -> list[int]:
        """The most bytes each chunk may hold: its edges' difference plus twice the
        tolerance, at most the pair (``split``'s bound), 0 for an empty chunk."""
        if self.twin is not None:
            return self.twin.loads(rounds, unit)
        c = self._loads
        if c is None or c[0] != rounds or c[1] != unit:
            e = self.edges(rounds, unit)
            slack, n = 2 * self.tolerance(unit), self.nbytes
            c = self._loads = (rounds, unit, [min(b - a + slack, n) if b > a else 0
                                              for a, b in zip(e, e[1:])])
        return c[2]

    def tolerance(self, unit: int) -> int:
        """How far a cut may lie from its edge: half a unit, or one element if larger."""
        return max(unit // 2, self.elem)

    def chunks(self, rounds: int, unit: int) -> list[list[Transfer]]:
        """This pair's transfers cut into ``rounds`` chunks (``classes`` asks the first pair
        of each shape only; its twins send the same chunks with their own two ranks)."""
        if self._cache is None or self._cache[0] != rounds:
            self._cache = (rounds, split(self.transfers, self.edges(rounds, unit),
                                         self.tolerance(unit)))
        return self._cache[1]


def shape_of(p: Pair) -> tuple:
    """What ``split`` reads of a pair: its phase and its transfers but their two ranks (every
    transfer of a pair has the same two). Slots and anchors by identity: pairs of replicas
    fed from one answer share those objects; equal values in other objects only miss a
    twin."""
    return (p.phase, *[(t.key, t.kinds, t.box.lo, t.box.hi, id(t.src_slot), id(t.src_anchor),
                        id(t.dst_slot), id(t.dst_anchor)) for t in p.transfers])


def link_twins(pairs: Iterable[Pair]) -> None:
    """Point every pair at the first earlier pair of its shape (``Pair.twin``).

    Pairs of one shape are cut alike: ``split`` reads only a pair's transfers (ranks aside),
    its bytes and its phase. The data-parallel replicas of one position that ``sources``
    feeds alike have such pairs (``PairPhase``), so the symmetric
    ranks of a switch are cut once (a test compares with splitting every pair alone)."""
    first: dict[tuple, Pair] = {}
    for p in pairs:
        f = first.setdefault(shape_of(p), p)
        p.twin = None if f is p else f


def _fits(pairs: list[Pair], rounds: int, unit: int, half: int) -> bool:
    """Whether ``pairs`` (all of one device's pairs in one direction) fit ``half`` a round.

    From the edges alone: a chunk holds its edges' difference plus at most twice the pair's
    tolerance (``split``), so no pair is cut to decide this.
    """
    if not pairs:
        return True
    used = map(sum, zip(*(p.loads(rounds, unit) for p in pairs)))
    return max(used, default=0) <= half


def least_rounds(out_pairs: list[Pair], in_pairs: list[Pair], half: int) -> int:
    """The fewest rounds the device's busier direction allows (the fixpoint's start)."""
    busiest = max(sum(p.nbytes for p in out_pairs), sum(p.nbytes for p in in_pairs))
    return max(1, -(-busiest // max(1, half)))


def fit_from(out_pairs: list[Pair], in_pairs: list[Pair], rounds: int, budget: int,
             unit: int) -> int:
    """The fewest rounds >= ``rounds`` in which this device's chunks fit its budget
    (half for sending, half for receiving)."""
    return most_fit_from([(out_pairs, in_pairs)], rounds, budget, unit)


def most_fit_from(sides: list[tuple[list[Pair], list[Pair]]], rounds: int, budget: int,
                  unit: int) -> int:
    """The maximum of ``fit_from`` over devices given as (out pairs, in pairs), a round count
    at a time: every device is tried at R before any is tried at R + 1, so that a pair (or the
    first of its twins, asked by every twin's devices) computes its loads once per R rather
    than once per change of R between consecutive devices (at 98304 GPUs, 8M times)."""
    half = budget // 2
    r, pending = rounds, sides
    while True:
        pending = [(o, i) for o, i in pending
                   if not (_fits(o, r, unit, half) and _fits(i, r, unit, half))]
        if not pending:
            return r
        r += 1
        if r > MAX_ROUNDS:  # returned, not raised: every device must see it (``agree``)
            return MAX_ROUNDS + 1


def _too_many(rounds: int, budget: int) -> None:
    if rounds > MAX_ROUNDS:
        raise PlanError(f"the budget of {budget} bytes needs more than {MAX_ROUNDS} rounds "
                        "for this switch")


Agree = Callable[[int], int]  # this device's value -> the maximum over all devices


def agree_spread(out_pairs: list[Pair], in_pairs: list[Pair], budget: int, agree: Agree
                 ) -> tuple[int, int]:
    """(unit, R) for the whole switch, seen from one device: the most pairs any device has
    in one direction gives the unit; R is the fixpoint of ``agree`` (max over devices) of
    each device's ``fit_from``. Every device calls ``agree`` the same number of times."""
    unit = unit_bytes(budget, agree(max(len(out_pairs), len(in_pairs))))
    r = agree(least_rounds(out_pairs, in_pairs, budget // 2))
    while True:
        nxt = agree(fit_from(out_pairs, in_pairs, r, budget, unit))
        _too_many(nxt, budget)  # on every device alike
        if nxt == r:
            return unit, r
        r = nxt


def pairs_by_device(transfers: Iterable[Transfer], src_devices: tuple[str, ...],
                    dst_devices: tuple[str, ...], phase: Callable[[int, int], int]
                    ) -> tuple[dict[tuple[str, str], Pair], dict[str, list[Transfer]]]:
    """Remote pairs, and each device's local copies, from a list of transfers
    (``phase(src_rank, dst_rank)``: a ``PairPhase``)."""
    # By rank pair, one int each (a rank runs on one device on each side, so rank pairs are
    # device pairs): millions of transfers on the largest switches.
    by_ranks: dict[int, list[Transfer]] = {}
    w = len(dst_devices)
    for t in transfers:
        k = t.src_rank * w + t.dst_rank
        group = by_ranks.get(k)
        if group is None:
            by_ranks[k] = [t]
        else:
            group.append(t)
    pairs, local = {}, {}
    per_elem: dict[tuple[str, tuple[str, ...]], int] = {}
    for k, ts in by_ranks.items():
        s, d = src_devices[k // w], dst_devices[k % w]
        if s == d:
            local[s] = canonical(ts)
        else:
            pairs[(s, d)] = Pair(s, d, ts, phase(ts[0].src_rank, ts[0].dst_rank), per_elem)
    link_twins(pairs.values())
    return pairs, local


def global_spread(pairs: dict[tuple[str, str], Pair], budget: int) -> tuple[int, int]:
    """``agree_spread`` computed for every device at once: the global plan's (unit, R).

    The same fixpoint as every device's ``fit_from`` under ``agree``: the unit from the most
    pairs on a side, R from the busiest side up, each device dropped once it fits. A class of
    twins computes its chunk loads once per R (``Pair.loads``); numpy sums them per device
    and round (millions of pairs on the largest switches)."""
    plist = list(pairs.values())
    if not plist:
        return unit_bytes(budget, 1), 1
    dev: dict[str, int] = {}
    src = np.fromiter((dev.setdefault(p.src, len(dev)) for p in plist), np.int64, len(plist))
    dst = np.fromiter((dev.setdefault(p.dst, len(dev)) for p in plist), np.int64, len(plist))
    heads: dict[int, int] = {}  # id of a class's first pair -> its row
    first: list[Pair] = []
    klass = np.empty(len(plist), np.int64)
    for j, p in enumerate(plist):
        h = p.twin or p
        k = heads.get(id(h))
        if k is None:
            k = heads[id(h)] = len(first)
            first.append(h)
        klass[j] = k
    n = len(dev)
    peers = max(np.bincount(src, minlength=n).max(), np.bincount(dst, minlength=n).max())
    unit, half = unit_bytes(budget, int(peers)), budget // 2
    size = np.array([p.nbytes for p in plist], np.int64)
    busiest = np.maximum(sum_by_index(src, size, n), sum_by_index(dst, size, n))
    r = max(1, int((-(-busiest // max(1, half))).max()))
    while True:
        nxt = _most_fit(first, klass, src, dst, n, r, unit, half)
        _too_many(nxt, budget)
        if nxt == r:
            return unit, r
        r = nxt


def _most_fit(first: list[Pair], klass: np.ndarray, src: np.ndarray, dst: np.ndarray, n: int,
              rounds: int, unit: int, half: int) -> int:
    """``most_fit_from`` over every device, from R = ``rounds`` up."""
    pending = np.ones(n, bool)
    r = rounds
    while True:
        # Only pairs with a device still pending count; all R rounds at once (R x pairs is
        # bounded by the budget check's steps limit).
        live = pending[src] | pending[dst]
        k, s, d = klass[live], src[live], dst[live]
        rows = np.unique(k)
        loads = np.zeros((len(first), r), np.int64)
        loads[rows] = [first[j].loads(r, unit) for j in rows.tolist()]
        per = loads[k]
        out, into = sum_by_index(s, per, n), sum_by_index(d, per, n)
        pending &= (out.max(axis=1) > half) | (into.max(axis=1) > half)
        if not pending.any():
            return r
        r += 1
        if r > MAX_ROUNDS:  # as most_fit_from: returned, then refused by _too_many
            return MAX_ROUNDS + 1


def rounds_of(pairs: Iterable[Pair], local: dict[str, list[Transfer]], unit: int,
              rounds: int) -> list[Round]:
    """The plan's rounds: chunk i of every pair in round i, local copies in round 0 (every
    round kept, empty or not, so that a round's index is the same in every device's slice
    and in the global plan); built from the pairs' classes (``classes.ClassRounds.round``)."""
    body = class_rounds(pairs, local, unit, rounds)
    return [body.round(i) for i in range(rounds)]
