"""The data rules: coverage, source validity and expert ownership of a plan's writes.

Everything is recomputed from the two layouts (``StateView``) and the plan's transfers; nothing
the planner derived (its intersection, its holders, its byte counts) is trusted. Layout parts are
shared by ranks of one class, so their lookup tables are built once per distinct part.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.state import StateView, Stored
from ..planner.lost import LostState
from ..planner.plan import Message, Plan, Transfer
from ..planner.sums import sum_by_index
from ..planner.text import slot_text
from .report import Violation
from ..ir.tiling import inside, outside_point, tiling_fault, well_formed

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8}

Emit = Callable[[Violation], None]
Target = tuple[str, object, Box]  # (key, slot, anchor): one region of a rank's storage


@dataclass(frozen=True, slots=True)
class Declared:
    """What a plan says about failures: the source devices that died and the state it leaves
    unwritten because no survivor holds it (``planner.lost``)."""

    failed: frozenset[str] = frozenset()
    lost: LostState = LostState(())

    @classmethod
    def of(cls, plan: Plan, failed: frozenset[str] | None = None) -> "Declared":
        """From ``plan.stats`` (``failed``: the caller's list instead of the plan's).

        Raises:
            DynatrainError: the plan's ``lost`` or ``failed`` is malformed.
        """
        doc = plan.stats.get("lost")
        lost = doc if isinstance(doc, LostState) else (
            LostState.from_json(doc) if doc is not None else LostState(()))
        if failed is None:
            named = plan.stats.get("failed", ())
            if not isinstance(named, (list, tuple)) or not all(isinstance(d, str) for d in named):
                raise DynatrainError("summary.failed: must be a list of device names")
            failed = frozenset(named)
        return cls(frozenset(failed), lost)


class Holdings:
    """What each rank of a layout holds, as (key, slot, anchor) -> ``Stored``.

    Each part's table is kept twice: by the identities of a region's slot and anchor, then
    by their values. A plan's targets are nearly always the layout's own objects (the
    planner cut them from these parts), found with one cheap hash; equal values in other
    objects (a plan read from a file) are found by value. A rank's parts hold disjoint
    storage, so no target is in two of its parts and the order of the two passes changes
    no answer."""

    def __init__(self, view: StateView) -> None:
        self.view = view
        self._tables: dict[int, tuple[tuple[Stored, ...], dict, dict[Target, Stored]]] = {}
        self._by_rank: dict[int, tuple[tuple[dict, dict[Target, Stored]], ...]] = {}

    def tables(self, rank: int) -> tuple[tuple[dict, dict[Target, Stored]], ...]:
        """Per part of ``rank``: (its table by identity, its table by value)."""
        hit = self._by_rank.get(rank)
        if hit is None:
            hit = self._by_rank[rank] = self._build(rank)
        return hit

    def _build(self, rank: int) -> tuple[tuple[dict, dict[Target, Stored]], ...]:
        out = []
        for part in self.view.parts(rank):
            hit = self._tables.get(id(part))
            if hit is None:  # the value keeps ``part`` alive, so its ids stay unique
                hit = self._tables[id(part)] = (
                    part, {(s.key, id(s.slot), id(s.box)): s for s in part},
                    {(s.key, s.slot, s.box): s for s in part})
            out.append(hit[1:])
        return tuple(out)

    def find(self, rank: int, target: Target) -> Stored | None:
        tables = self.tables(rank)
        by_id = (target[0], id(target[1]), id(target[2]))
        for ids, _ in tables:
            s = ids.get(by_id)
            if s is not None:
                return s
        for _, values in tables:
            s = values.get(target)
            if s is not None:
                return s
        return None

    def find_at(self, rank: int, target: Target) -> int:
        """The index in ``view.parts(rank)`` of the first part holding ``target``; -1: none."""
        tables = self.tables(rank)
        by_id = (target[0], id(target[1]), id(target[2]))
        for j, (ids, _) in enumerate(tables):
            if by_id in ids:
                return j
        for j, (_, values) in enumerate(tables):
            if target in values:
                return j
        return -1

    def holds_point(self, rank: int, key: str, point: tuple[int, ...]) -> bool:
        return any(s.key == key and inside(Box(point, tuple(x + 1 for x in point)), s.box)
                   for s in self.view.stored(rank))


def expert_keys(view: StateView) -> frozenset[str]:
    """Checkpoint keys of expert weights (the EP/ETP grid) in a layout."""
    L = view.layout
    keys = set()
    seen: dict[int, object] = {}  # the value keeps each tuple alive, so ids stay unique
    for rank in range(L.world):
        shards = L.rank_shards(rank)  # cached per model-parallel class: look at each once
        if id(shards) in seen:
            continue
        seen[id(shards)] = shards
        for cs in shards:
            keys.update(sh.param.key for sh in cs.shards if sh.param.expert)
        if L.parallel.ep == 1:  # without EP every rank holds every expert: one rank is enough
            break
    return frozenset(keys)


def check_data(plan: Plan, src: StateView, dst: StateView, emit: Emit,
               declared: Declared = Declared(), only_rank: int | None = None
               ) -> tuple[int, list[dict[str, int]]]:
    """Check every transfer's source and the tiling of every destination region.

    Returns the number of transfers checked and, per round, the bytes each device stages
    (remote messages, sent plus received), counted from the boxes and dtypes while here.
    Transfers are the plan's records, local copies included: what the plan file and ``--text``
    list, after the planner cut the parts it picked sources for to fit messages (a stacked
    layer/expert family is one transfer (``_Transfers`` checks each). A plan kept as classes
    of pairs cut alike is checked a class at a time (``_check_classes``).

    ``declared``: failed source devices (nothing may be read from them or written to them)
    and the state the plan declares lost (left unwritten, if truly no survivor holds it).
    ``only_rank``: check the tiling of this destination rank's regions only (-1: none), for
    one device's slice of a plan; what it writes elsewhere is checked by the receivers.
    """
    failed = declared.failed
    if failed:
        _check_failed_destination(plan.dst_devices, failed, emit)
    if declared.lost:
        _check_declared_lost(src, plan.src_devices, declared, emit)
    s_hold, d_hold = Holdings(src), Holdings(dst)
    body = plan.classes
    if body is not None and not failed and only_rank is None:
        # The fast path proves a correct plan; a plan it finds any fault in is checked again
        # message by message, so that its report is the explicit one (same order, witnesses).
        found: list[Violation] = []
        out = _check_classes(plan, body, src, dst, _Transfers(plan, src, dst, s_hold,
                                                              found.append),
                             d_hold, declared, found.append)
        if not found:
            return out
    checker = _Transfers(plan, src, dst, s_hold, emit)
    writes = checker.writes
    count = 0
    staging: list[dict[str, int]] = []
    for r, rnd in enumerate(plan.rounds):
        staged: dict[str, int] = defaultdict(int)
        staging.append(staged)
        for m in rnd.messages:
            if failed and m.src_device in failed and m.transfers:
                t = m.transfers[0]
                emit(Violation("source", f"round {r}: reads from failed device {m.src_device} "
                               f"({len(m.transfers)} transfer(s) to {m.dst_device})", t.key,
                               ",".join(t.kinds), (t.src_rank,), (m.src_device,), t.box.lo))
            count += len(m.transfers)
            moved = checker.run(r, m.src_device, m.dst_device, m.transfers)
            if m.src_device != m.dst_device:  # local copies go slot to slot: no staging
                staged[m.src_device] += moved
                staged[m.dst_device] += moved
    unfilled: dict[tuple[str, str], tuple[Box, ...]] = {
        (e.key, e.kind): e.boxes for e in declared.lost.entries}
    ranks: range | tuple[int, ...] = range(dst.layout.world)
    if only_rank is not None:
        ranks = (only_rank,) if only_rank >= 0 else ()
        writes = defaultdict(list, {k: v for k, v in writes.items() if k[0] == only_rank})
    _check_coverage(dst, d_hold, writes, _derivable(plan, dst, emit), expert_keys(dst),
                    plan.dst_devices, emit, unfilled, ranks)
    return count, staging


class _Writes(defaultdict):
    """Transfers per (destination rank, target region), the coverage rule's input.

    ``by_id`` finds a region's list by the identities of its slot and anchor objects, so
    that ``_Transfers.run`` hashes a region's value (a slot and a box, both dataclasses) once
    per region, not once per transfer: the chunks of one part share those objects. Equal
    values in other objects miss ``by_id`` and meet in the same list through the value.
    Nothing is removed (``_check_coverage`` marks the lists it takes), so ``by_id`` never
    points at a list the mapping no longer holds.
    """

    def __init__(self) -> None:
        super().__init__(list)
        self.by_id: dict[tuple[int, str, int, int], list[Transfer]] = {}

    def add(self, rank: int, target: Target, ws: list[Transfer]) -> None:
        """``ws`` written into ``target`` of ``rank``, found by identity first."""
        at = (rank, target[0], id(target[1]), id(target[2]))
        mine = self.by_id.get(at)
        if mine is None:
            mine = self.by_id[at] = self[(rank, target)]
        mine.extend(ws)


class _Transfers:
    """The per-transfer rules: each transfer's source, declared size and device, recording
    what it writes where (``writes``, for the coverage rule). The loop runs once per transfer
    of plans with hundreds of thousands of them, so the common case is inlined and the rest
    memoized: element sizes per (key, kinds), source lookups per (rank, region)."""

    def __init__(self, plan: Plan, src: StateView, dst: StateView, s_hold: Holdings,
                 emit: Emit) -> None:
        self.s_hold, self.emit = s_hold, emit
        self.elem_bytes = _ElementBytes(src, dst)
        self.s_world, self.d_world = src.layout.world, dst.layout.world
        self.s_dev, self.d_dev = plan.src_devices, plan.dst_devices
        # Per source region read (rank, key, slot and anchor by identity, kinds): (element
        # bytes, anchor lo, anchor hi) where it is held for those kinds and their size is
        # known, else None (each such transfer takes ``_slow``, which reports it).
        self.fast: dict[tuple, tuple[int, tuple[int, ...], tuple[int, ...]] | None] = {}
        # (source device, destination device) -> the last ranks found on them
        self.ok_ranks: dict[tuple[str, str], tuple[int, int]] = {}
        self.writes = _Writes()

    def run(self, r: int, m_src: str, m_dst: str, transfers: tuple[Transfer, ...],
            writes: _Writes | None = None) -> int:
        """Check ``transfers`` of one message of round ``r``; the bytes they stage (those
        whose size is known). Writes go to ``writes`` (default: ``self.writes``)."""
        return self.run_rounds(m_src, m_dst, (transfers,), writes, r)[0]

    def run_rounds(self, m_src: str, m_dst: str, messages, writes: _Writes | None = None,
                   first: int = 0, reads: dict | None = None) -> list[int]:
        """``run`` on the transfers of one pair of devices in rounds ``first``, ``first`` + 1,
        ... (one sequence of transfers each); the bytes staged in each. ``reads``, if given,
        gets one transfer per source region read, keyed (key, id(slot), id(anchor))."""
        emit, fast = self.emit, self.fast
        s_world, d_world, s_dev, d_dev = self.s_world, self.d_world, self.s_dev, self.d_dev
        writes = self.writes if writes is None else writes
        by_id = writes.by_id
        # A message's transfers nearly always share one pair of ranks, and a pair's chunks
        # come one after another: ranks checked right for these devices are not checked again.
        ok_sr, ok_dr = self.ok_ranks.get((m_src, m_dst), (-1, -1))
        # The pieces of one part follow each other (a part cut at a round's edge ends one
        # chunk and starts the next): the last source region's answer and the last written
        # region's list serve the next transfer when its objects are the very same.
        l_key = l_kinds = l_slot = l_anchor = l_wkey = l_dslot = l_danchor = None
        l_sr = l_dr = -1
        got: tuple | None = None
        ws: list = []
        out = []
        for r, transfers in enumerate(messages, first):
            moved = 0
            for t in transfers:
                key, kinds_t, box, sr, dr, s_slot, anchor, d_slot, d_anchor, nbytes = t
                if sr != ok_sr or dr != ok_dr:
                    if not (0 <= sr < s_world and 0 <= dr < d_world):
                        emit(Violation("source", f"is sent from rank {sr} to rank {dr}, "
                                       f"outside the layouts (source world {s_world}, "
                                       f"destination world {d_world})", key, ",".join(kinds_t),
                                       (sr, dr), (), box.lo))
                        if reads is not None:
                            reads[(key, id(s_slot), id(anchor))] = t
                        continue
                    if s_dev[sr] != m_src or d_dev[dr] != m_dst:
                        _wrong_device(r, Message(m_src, m_dst, ()), t, s_dev, d_dev, emit)
                    else:
                        ok_sr, ok_dr = self.ok_ranks[(m_src, m_dst)] = sr, dr
                if not (anchor is l_anchor and s_slot is l_slot and key is l_key
                        and kinds_t is l_kinds and sr == l_sr):
                    # Keyed by identity: the plan keeps the slot and anchor objects alive, and
                    # transfers cut from one source region share them (equal copies only miss).
                    where = (sr, key, id(s_slot), id(anchor), kinds_t)
                    got = fast.get(where, ())
                    if got == ():
                        got = self._known(where, t)
                    # (an unknown size is looked up again: ``_slow`` may have learnt it)
                    l_key, l_kinds, l_slot, l_sr = key, kinds_t, s_slot, sr
                    l_anchor = anchor if got is not None else None
                    if reads is not None:
                        reads[(key, id(s_slot), id(anchor))] = t
                if got is None:
                    moved += self._slow(r, m_src, m_dst, t)
                else:
                    size, a_lo, a_hi = got
                    lo, hi = box.lo, box.hi
                    n = 1
                    fits = len(lo) == len(a_lo) == len(hi)
                    if fits:
                        for l, h, a, z in zip(lo, hi, a_lo, a_hi):
                            if not a <= l < h <= z:
                                fits = False
                                break
                            n *= h - l
                    if fits:
                        moved += size * n
                        if nbytes != size * n:
                            emit(Violation("memory", f"round {r}: a transfer {box} declares "
                                           f"{nbytes} bytes but moves {size * n}", key,
                                           ",".join(kinds_t), (sr, dr), (m_src, m_dst), lo))
                    else:
                        moved += self._slow(r, m_src, m_dst, t)
                if not (d_anchor is l_danchor and d_slot is l_dslot and key is l_wkey
                        and dr == l_dr):
                    at = (dr, key, id(d_slot), id(d_anchor))
                    ws = by_id.get(at)
                    if ws is None:
                        ws = by_id[at] = writes[(dr, (key, d_slot, d_anchor))]
                    l_wkey, l_dslot, l_danchor, l_dr = key, d_slot, d_anchor, dr
                ws.append(t)
            out.append(moved)
        return out

    def _known(self, where: tuple, t: Transfer) -> tuple | None:
        """``fast``'s entry for ``where``; None, unrecorded, while the element size of the
        transfer's kinds is not known yet (``_slow`` finds it and reports any fault)."""
        size = self.elem_bytes.memo.get((t.key, t.kinds), -1)
        if size == -1:
            return None
        s = self.s_hold.find(t.src_rank, (t.key, t.src_slot, t.src_anchor))
        got = self.fast[where] = (
            (size, t.src_anchor.lo, t.src_anchor.hi) if s is not None and size is not None
            and set(t.kinds) <= set(s.kinds) else None)
        return got

    def _slow(self, r: int, m_src: str, m_dst: str, t: Transfer) -> int:
        """One transfer's source and size rules, every fault reported; the bytes it stages."""
        key, kinds_t, box, sr, dr, s_slot, anchor, _, _, nbytes = t
        s = self.s_hold.find(sr, (key, s_slot, anchor))
        kinds = s.kinds if s is not None and set(kinds_t) <= set(s.kinds) else None
        lo, hi = box.lo, box.hi
        n = 1
        fits = kinds is not None and len(lo) == len(anchor.lo) == len(hi)
        if fits:
            for l, h, a, z in zip(lo, hi, anchor.lo, anchor.hi):
                if not a <= l < h <= z:
                    fits = False
                    break
                n *= h - l
        if not fits:
            _check_source(t, m_src, s.kinds if s is not None else None, self.emit)
        size = self.elem_bytes.memo.get((key, kinds_t), -1)
        if size == -1:  # the first transfer of these kinds: reported once if unknown
            size = self.elem_bytes.get(t, self.emit)
        if fits and size is not None:
            if nbytes != size * n:
                self.emit(Violation("memory", f"round {r}: a transfer {box} declares {nbytes} "
                                    f"bytes but moves {size * n}", key, ",".join(kinds_t),
                                    (sr, dr), (m_src, m_dst), lo))
            return size * n
        return 0


class _Parts(dict):
    """``view.parts(rank)`` per rank, asked once (it computes the rank's coordinates)."""

    def __init__(self, view: StateView) -> None:
        super().__init__()
        self.view = view

    def __missing__(self, rank: int) -> tuple:
        p = self[rank] = self.view.parts(rank)
        return p


def _add_staging(staging: list[dict[str, int]], class_sizes: list[list[int]], ks: np.ndarray,
                 srcs: np.ndarray, dsts: np.ndarray, names: tuple[str, ...]) -> None:
    """Add to each round's staging what the members that follow their class stage: their
    class's checked bytes on both their devices (``names[i]``: device index i)."""
    if not len(ks):
        return
    sizes = np.array(class_sizes, dtype=np.int64)[ks]
    for i, staged in enumerate(staging):
        b = sizes[:, i]
        on = b > 0
        acc = (sum_by_index(srcs[on], b[on], len(names))
               + sum_by_index(dsts[on], b[on], len(names)))
        for j, n in zip(np.flatnonzero(acc).tolist(), acc[acc > 0].tolist()):
            staged[names[j]] += n


class _PrefixIds:
    """Per rank and depth d, one int for the identities of the rank's first d parts: ranks
    with equal ints there hold the very same first d parts (-1: fewer than d parts)."""

    def __init__(self, parts: _Parts) -> None:
        self.parts = parts

    def table(self, ranks: np.ndarray, depth: int) -> np.ndarray:
        """A (depth + 1) x (max rank + 1) table for ``ranks`` (others: -1)."""
        width = int(ranks.max()) + 1 if len(ranks) else 0
        out = np.full((depth + 1, width), -1, np.int64)
        out[0] = 0  # no parts read: every rank answers alike
        ids: dict[tuple[int, ...], int] = {}
        for r in np.unique(ranks).tolist():
            own = tuple(map(id, self.parts[r]))
            for d in range(1, min(depth, len(own)) + 1):
                out[d, r] = ids.setdefault(own[:d], len(ids))
        return out


class _Members:
    """Every member of a ``ClassRounds``, class by class, as arrays: its class, its place in
    the class, its two ranks and its two devices (indices into ``devices``)."""

    def __init__(self, body, plan: Plan, s_world: int, d_world: int) -> None:
        sized = body.sized  # the classes' members as arrays (built once, shared with the stats)
        self.klass, self.s_rank, self.d_rank = sized.klass, sized.src_rank, sized.dst_rank
        self.s_dev, self.d_dev, self.devices = sized.src, sized.dst, sized.devices
        starts = np.cumsum([0] + [len(c.members) for c in body.classes])[:-1]
        self.pos = np.arange(len(self.klass), dtype=np.int64) - starts[self.klass]
        self.s_world, self.d_world = s_world, d_world
        index = {d: i for i, d in enumerate(self.devices)}
        # Each rank's device as an index (-1: a device no member names, so none matches it).
        self.s_dev_of = _device_indices(plan.src_devices, s_world, index)
        self.d_dev_of = _device_indices(plan.dst_devices, d_world, index)

    def follow(self, s_depths: np.ndarray, d_depths: np.ndarray, heads: np.ndarray,
               s_prefix: _PrefixIds, d_prefix: _PrefixIds) -> np.ndarray:
        """Which members get their class's answers: both ranks inside the layouts and on
        the member's devices, the class followable (depth >= 0), and each rank holding the
        very same leading parts as the first member's, as deep as the class reads them."""
        sr, dr, k = self.s_rank, self.d_rank, self.klass
        ok = (sr >= 0) & (sr < self.s_world) & (dr >= 0) & (dr < self.d_world) \
            & (s_depths[k] >= 0)
        sr0, dr0 = np.where(ok, sr, 0), np.where(ok, dr, 0)
        if not (self.s_world and self.d_world):
            return ok & False
        ok &= (self.s_dev_of[sr0] == self.s_dev) & (self.d_dev_of[dr0] == self.d_dev)
        for prefix, depths, col, ranks in ((s_prefix, s_depths, 0, sr0),
                                           (d_prefix, d_depths, 1, dr0)):
            if not ok.any():
                break
            table = prefix.table(np.concatenate([ranks, heads[:, col]]),
                                 int(depths.max(initial=0)))
            dep = np.maximum(depths[k], 0)
            ok &= table[dep, ranks] == table[dep, heads[k, col]]
        return ok


def _device_indices(devices: tuple[str, ...], world: int, index: dict[str, int]) -> np.ndarray:
    """Each rank's device as an index into ``index`` (-1: none, or a device no member names,
    so that no member matches it)."""
    out = np.full(world, -1, np.int64)
    for r, d in enumerate(devices[:world]):
        out[r] = index.get(d, -1)
    return out


class _Fed:
    """Destination rank -> [(class, place in class)] of the members that follow their class
    and write into it, in class order (one sort of the members, not a list per rank)."""

    def __init__(self, members: _Members, follows: np.ndarray) -> None:
        idx = np.flatnonzero(follows)
        order = idx[np.argsort(members.d_rank[idx], kind="stable")]
        self.start = np.searchsorted(members.d_rank[order],
                                     np.arange(members.d_world + 1)).tolist()
        self.klass = members.klass[order].tolist()
        self.pos = members.pos[order].tolist()

    def get(self, dr: int, default=()) -> list[tuple[int, int]] | tuple:
        a, b = self.start[dr], self.start[dr + 1]
        return list(zip(self.klass[a:b], self.pos[a:b])) if a < b else default


def _depth(hold: Holdings, rank: int, targets: list[Target]) -> int | None:
    """How many of ``rank``'s parts answer every one of ``targets`` (None: some target is in
    none of them, so a rank answers alike only with all of its parts the same)."""
    depth = 0
    for target in targets:
        j = hold.find_at(rank, target)
        if j < 0:
            return None
        depth = max(depth, j + 1)
    return depth


class _Shapes:
    """Interned write shapes: what a class writes into one destination part, ranks aside."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def of(self, ts: list[Transfer]) -> int:
        key = tuple((t.key, t.kinds, t.box.lo, t.box.hi, id(t.dst_slot), id(t.dst_anchor))
                    for t in ts)
        return self.ids.setdefault(key, len(self.ids))


def _check_classes(plan: Plan, body, src: StateView, dst: StateView, checker: _Transfers,
                   d_hold: Holdings, declared: Declared, emit: Emit
                   ) -> tuple[int, list[dict[str, int]]]:
    """``check_data`` of a plan kept as classes of pairs cut alike (``planner.classes``).

    A class's chunks are checked once, as its first member sends them. Every other member
    sends the same transfers with its own two ranks, so every rule gives it the same answer
    where it reads those ranks only through their holdings: if its source rank holds the very
    same parts as the first member's, up to the last part its reads are found in, its source
    checks are the first member's; if its destination rank does the same up to the last part
    written, its writes land in the same regions (else its transfers are checked one by one,
    and its destination rank's coverage on its own). Coverage is a property of each part of a
    destination rank and of what is written into it: a part fed the same write shapes is
    checked once (a failing one is checked and reported for every rank it belongs to)."""
    s_world, d_world = src.layout.world, dst.layout.world
    d_dev = plan.dst_devices
    s_parts, d_parts = _Parts(src), _Parts(dst)
    staging: list[dict[str, int]] = [defaultdict(int) for _ in range(body.rounds)]
    count = 0
    shapes = _Shapes()
    class_sizes: list[list[int]] = []
    # Per class: how many leading parts of its first member's source and destination ranks
    # its answers read (-1: none do, so no other member can follow it), and those two ranks.
    s_depths: list[int] = []
    d_depths: list[int] = []
    heads: list[tuple[int, int]] = []
    # class -> {destination part index: write shape}; and the writes of that shape, keyed by
    # region, as the class's first member makes them
    part_shapes: list[dict[int, int]] = []
    part_writes: list[dict[int, list[tuple[Target, list[Transfer]]]]] = []
    for c in body.classes:
        head = c.members[0]
        mine = _Writes()
        # Each read region once (by identity first: chunks of one part share them).
        read: dict[tuple[str, int, int], Transfer] = {}
        sizes = checker.run_rounds(head.src_device, head.dst_device, c.chunks, mine,
                                   reads=read)
        n = sum(len(ch) for ch in c.chunks)
        h_sr, h_dr = head.src_rank, head.dst_rank
        s_depth = d_depth = None
        by_part: dict[int, list[Transfer]] = defaultdict(list)
        if 0 <= h_sr < s_world and 0 <= h_dr < d_world:
            s_depth = _depth(checker.s_hold, h_sr, [(t.key, t.src_slot, t.src_anchor)
                                                    for t in read.values()])
            # Each written region's part, found once: it gives the depth and the grouping.
            found_at = [(d_hold.find_at(h_dr, target), target, ws)
                        for (_, target), ws in mine.items()]
            if all(j >= 0 for j, _, _ in found_at):
                d_depth = max((j + 1 for j, _, _ in found_at), default=0)
                for j, target, ws in found_at:
                    by_part[j].append((target, ws))
        part_shapes.append({j: shapes.of([t for _, w in tws for t in w])
                            for j, tws in by_part.items()})
        part_writes.append(by_part)
        count += n * len(c.members)
        followable = s_depth is not None and d_depth is not None
        s_depths.append(s_depth if followable else -1)
        d_depths.append(d_depth if followable else -1)
        heads.append((h_sr, h_dr) if followable else (0, 0))
        class_sizes.append(sizes)
    members = _Members(body, plan, s_world, d_world)
    follows = members.follow(np.array(s_depths, np.int64), np.array(d_depths, np.int64),
                             np.array(heads, np.int64).reshape(-1, 2), _PrefixIds(s_parts),
                             _PrefixIds(d_parts))
    # Members that follow their class stage its checked bytes on their two devices (numpy:
    # millions of members x rounds); the others are checked transfer by transfer.
    remote = follows & (members.s_dev != members.d_dev)
    _add_staging(staging, class_sizes, members.klass[remote], members.s_dev[remote],
                 members.d_dev[remote], members.devices)
    explicit: dict[int, _Writes] = defaultdict(_Writes)
    for j in np.flatnonzero(~follows).tolist():
        k = int(members.klass[j])
        c = body.classes[k]
        m = c.members[int(members.pos[j])]
        dr = m.dst_rank
        own = explicit[dr] if 0 <= dr < d_world else _Writes()
        sizes_m = checker.run_rounds(m.src_device, m.dst_device,
                                     [c.transfers_of(i, m) if ch else () for i, ch in
                                      enumerate(c.chunks)], own)
        if m.src_device != m.dst_device:
            for i, b in enumerate(sizes_m):
                if b:
                    staging[i][m.src_device] += b
                    staging[i][m.dst_device] += b
    # dst rank -> (class, place in class) of the members that write as their first does
    fed = _Fed(members, follows)
    local: dict[int, dict[tuple[int, Target], list[Transfer]]] = defaultdict(
        lambda: defaultdict(list))  # dst rank -> the local copies' writes
    for d, ts in body.local:
        count += len(ts)
        own = _Writes()
        checker.run(0, d, d, ts, own)
        for (dr, target), ws in own.items():
            if 0 <= dr < d_world:
                local[dr][(dr, target)].extend(ws)
    derivable = _derivable(plan, dst, emit)
    experts = expert_keys(dst)
    unfilled = {(e.key, e.kind): e.boxes for e in declared.lost.entries}
    ok: set[tuple] = set()  # (part id, write shapes) whose coverage holds
    for dr in range(d_world):
        feeds = fed.get(dr, ())
        copies = local.get(dr, {})
        parts = d_parts[dr]
        # The local copies' writes by the part they land in (-1: in none).
        copied: dict[int, dict[tuple[int, Target], list[Transfer]]] = defaultdict(dict)
        for key, ws in copies.items():
            copied[d_hold.find_at(dr, key[1])][key] = ws
        if dr in explicit or -1 in copied:  # writes that did not follow a class: rank alone
            writes = explicit[dr]
            for key, ws in copies.items():
                writes[key].extend(ws)
            for k, pos in feeds:
                _instantiate(body.classes[k], body.classes[k].members[pos], writes)
            _check_coverage(dst, d_hold, writes, derivable, experts, d_dev, emit, unfilled,
                            (dr,))
            continue
        into: list[list[int]] = [[] for _ in parts]
        for k, _ in feeds:
            for j, shape in part_shapes[k].items():
                into[j].append(shape)
        for j, ws in copied.items():
            into[j].append(shapes.of([t for w in ws.values() for t in w]))
        for j, part in enumerate(parts):
            sig = (id(part), tuple(sorted(into[j])))
            if sig in ok:
                continue
            # Tiling reads no rank: check the first members' writes, and only where that
            # fails build this rank's own, for a report that names its senders.
            mine = _Writes()
            for k, _ in feeds:
                for target, ws in part_writes[k].get(j, ()):
                    mine.add(dr, target, ws)
            for key, ws in copied.get(j, {}).items():
                mine[key].extend(ws)
            failures = [0]

            def counted(_: Violation) -> None:
                failures[0] += 1
            _check_coverage(dst, d_hold, mine, derivable, experts, d_dev, counted, unfilled,
                            (dr,), part)
            if not failures[0]:
                ok.add(sig)
                continue
            own = defaultdict(list)
            for k, pos in feeds:
                if j in part_shapes[k]:
                    _instantiate(body.classes[k], body.classes[k].members[pos], own)
            mine = defaultdict(list, {key: ws for key, ws in own.items()
                                      if d_hold.find_at(dr, key[1]) == j})
            for key, ws in copied.get(j, {}).items():
                mine[key].extend(ws)
            _check_coverage(dst, d_hold, mine, derivable, experts, d_dev, emit, unfilled,
                            (dr,), part)
    return count, [dict(x) for x in staging]


def _instantiate(c, m, writes: dict[tuple[int, Target], list[Transfer]]) -> None:
    """Add what member ``m`` of class ``c`` writes, with its own ranks, to ``writes``."""
    for i in range(len(c.chunks)):
        for t in c.transfers_of(i, m):
            writes[(t.dst_rank, (t.key, t.dst_slot, t.dst_anchor))].append(t)


def _check_failed_destination(devices: tuple[str, ...], failed: frozenset[str],
                              emit: Emit) -> None:
    """No destination rank may run on a failed device."""
    for rank, d in enumerate(devices):
        if d in failed:
            emit(Violation("coverage", f"destination rank {rank} is placed on failed device {d}",
                           ranks=(rank,), devices=(d,)))


def _check_declared_lost(src: StateView, devices: tuple[str, ...], declared: Declared,
                         emit: Emit) -> None:
    """State declared lost must really be lost: no surviving source rank holds any of it (in
    any slot, tied copies included), or the plan skips state it could have moved."""
    want = {(e.key, e.kind) for e in declared.lost.entries}
    if not want:
        return
    held: dict[tuple[str, str], list[tuple[Box, int]]] = defaultdict(list)
    seen: dict[int, object] = {}  # the value keeps each part alive, so ids stay unique
    for rank in range(src.layout.world):
        if rank < len(devices) and devices[rank] in declared.failed:
            continue
        for part in src.parts(rank):
            if id(part) in seen:
                continue
            seen[id(part)] = part
            for s in part:
                for k in s.kinds:
                    if (s.key, k) in want:
                        held[(s.key, k)].append((s.box, rank))
    for e in declared.lost.entries:
        hit = next(((b & h, r) for b in e.boxes for h, r in held.get((e.key, e.kind), ())
                    if b & h is not None), None)
        if hit is not None:
            cut, rank = hit
            emit(Violation("coverage", f"is declared lost, but surviving source rank {rank} "
                           f"({devices[rank] if rank < len(devices) else '?'}) holds it",
                           e.key, e.kind, (rank,), (), tuple(cut.lo)))


def _derivable(plan: Plan, dst: StateView, emit: Emit) -> set[str]:
    """The kinds the plan may leave unsent: only params, only where the destination spec asks
    for them to be cast from main params it holds (``state.derive_param``)."""
    allowed = {"param"} if dst.layout.spec.state.derive_param and "main_param" in dst.kinds \
        else set()
    for k in sorted(set(plan.derived) - allowed):
        # Witness: the first element of that kind the destination holds (nothing rebuilds it).
        rank, s = next(((r, s) for r in range(dst.layout.world) for s in dst.stored(r)
                        if k in s.kinds), (0, None))
        emit(Violation("coverage", "is declared derived (not sent), but the destination "
                       "derives only param, and only with state.derive_param and main params",
                       s.key if s else "plan.derived", k, (rank,), (), s.box.lo if s else ()))
    return set(plan.derived) & allowed


class _ElementBytes:
    """Bytes per element of a transfer (summed over its kinds); None if some kind has no
    tensor of one dtype on both sides (reported at the first transfer that has it)."""

    def __init__(self, src: StateView, dst: StateView) -> None:
        self.s, self.d = src.tensors(), dst.tensors()
        self.memo: dict[tuple[str, tuple[str, ...]], int | None] = {}

    def get(self, t: Transfer, emit: Emit) -> int | None:
        k = (t.key, t.kinds)
        if k not in self.memo:
            if len(set(t.kinds)) != len(t.kinds):  # the same storage would be written twice
                emit(Violation("coverage", "is sent with a state kind listed twice", t.key,
                               ",".join(t.kinds), (t.src_rank, t.dst_rank), (), t.box.lo))
            size: int | None = 0
            for kind in t.kinds:
                a, b = self.s.get((t.key, kind)), self.d.get((t.key, kind))
                if a is None or b is None or a.dtype != b.dtype or a.dtype not in ITEMSIZE:
                    size = None
                    break
                size += ITEMSIZE[a.dtype]
            self.memo[k] = size
        size = self.memo[k]
        if size is None:
            emit(Violation("source", "has no tensor of one dtype for each of these kinds on both "
                           "sides", t.key, ",".join(t.kinds), (t.src_rank, t.dst_rank), (),
                           t.box.lo))
        return size


def _wrong_device(r: int, m: Message, t: Transfer, s_dev: tuple[str, ...],
                  d_dev: tuple[str, ...], emit: Emit) -> None:
    if s_dev[t.src_rank] != m.src_device:
        emit(Violation("source", f"round {r}: is sent by {m.src_device} for source rank "
                       f"{t.src_rank}, which runs on {s_dev[t.src_rank]}", t.key,
                       ",".join(t.kinds), (t.src_rank,), (m.src_device,), t.box.lo))
    if d_dev[t.dst_rank] != m.dst_device:
        emit(Violation("coverage", f"round {r}: is sent to {m.dst_device} for destination rank "
                       f"{t.dst_rank}, which runs on {d_dev[t.dst_rank]}", t.key,
                       ",".join(t.kinds), (t.dst_rank,), (m.dst_device,), t.box.lo))


def _check_source(t: Transfer, device: str, kinds: tuple[str, ...] | None, emit: Emit) -> None:
    """The slow path: say exactly what is wrong with a transfer's source."""
    what = ",".join(t.kinds)
    if kinds is None:
        emit(Violation("source", f"is read from source rank {t.src_rank} ({device}), which holds "
                       f"no region {t.src_anchor} in {slot_text(t.src_slot)}", t.key, what,
                       (t.src_rank,), (device,), t.box.lo))
        return
    missing = [k for k in t.kinds if k not in kinds]
    if missing:
        emit(Violation("source", f"is read from source rank {t.src_rank} ({device}), which holds "
                       f"{t.src_anchor} for {','.join(kinds)}, not {','.join(missing)}", t.key, what,
                       (t.src_rank,), (device,), t.box.lo))
    if not well_formed(t.box, len(t.src_anchor.lo)):
        emit(Violation("source", f"is read as box {t.box}, empty or of the wrong rank", t.key,
                       what, (t.src_rank,), (device,), t.box.lo))
    elif not inside(t.box, t.src_anchor):
        emit(Violation("source", f"is read from source rank {t.src_rank} ({device}), outside the "
                       f"region {t.src_anchor} it holds there", t.key, what, (t.src_rank,),
                       (device,), outside_point(t.box, t.src_anchor)))


def _check_coverage(dst: StateView, hold: Holdings,
                    writes: dict[tuple[int, Target], list[Transfer]], derived: set[str],
                    experts: frozenset[str], devices: tuple[str, ...], emit: Emit,
                    unfilled: dict[tuple[str, str], tuple[Box, ...]] | None = None,
                    ranks: range | tuple[int, ...] | None = None,
                    regions: tuple[Stored, ...] | None = None) -> None:
    """``unfilled``: per (key, kind), boxes declared lost; they count as written once.
    ``ranks``: the destination ranks whose regions to check (default: all). ``regions``: check
    these of the (one) rank's regions only, not all it holds."""
    needed_of: dict[tuple[str, ...], tuple[str, ...]] = {}
    lost_keys = {key for key, _ in unfilled} if unfilled else set()
    # The writes of each region, by the identities of its slot and anchor first (``_Writes``);
    # those taken are left out of the final pass, which reports writes into no region.
    by_id = writes.by_id if isinstance(writes, _Writes) else {}
    taken: set[int] = set()
    for rank in (range(dst.layout.world) if ranks is None else ranks):
        for s in dst.stored(rank) if regions is None else regions:
            ws = by_id.get((rank, s.key, id(s.slot), id(s.box)))
            if ws is None:
                ws = writes.get((rank, (s.key, s.slot, s.box)))
            if ws is None:
                ws = []
            else:
                taken.add(id(ws))
            needed = needed_of.get(s.kinds)
            if needed is None:
                needed = needed_of[s.kinds] = tuple(k for k in s.kinds if k not in derived)
            if len(ws) == 1 and ws[0].kinds == needed and ws[0].box == s.box:
                continue  # the common case: one transfer writes the whole region
            kind_sets = {t.kinds for t in ws}
            gaps = _unfilled_in(s.key, s.box, needed, unfilled) if s.key in lost_keys else {}
            if gaps:  # declared lost: each kind's writes and lost boxes must tile the region
                groups = [((k,), [t.box for t in ws if k in t.kinds] + gaps.get(k, []))
                          for k in needed]
            elif len(kind_sets) == 1 and set(next(iter(kind_sets))) == set(needed):
                groups = [(needed, [t.box for t in ws])]  # common case: one check for all kinds
            else:
                groups = [((k,), [t.box for t in ws if k in t.kinds]) for k in needed]
            faults: dict[tuple, list[str]] = {}  # one line for kinds that fail alike
            for kinds, boxes in groups:
                fault = tiling_fault(s.box, boxes)
                if fault is not None:
                    senders = tuple(sorted({ws[i].src_rank for i in fault.boxes})) if (
                        len(boxes) == len(ws)) else ()
                    faults.setdefault((fault.what, fault.point, senders), []).extend(kinds)
            for (what, point, senders), kinds in faults.items():
                text = {"empty": "is written as an empty or malformed box",
                        "outside": f"is written outside its region {s.box}",
                        "twice": "is written twice", "missing": "is never written"}[what]
                if senders:
                    text += f" (by transfers from source ranks {list(senders)})"
                emit(Violation("coverage", f"{text} on destination rank {rank} ({devices[rank]})",
                               s.key, ",".join(kinds), (rank,), (devices[rank],), point))
            extra = {k for t in ws for k in t.kinds} - set(needed)
            for k in sorted(extra):
                why = "is derived, never sent" if k in derived else "is not held in this slot"
                emit(Violation("coverage", f"is sent to destination rank {rank} as kind {k}, which "
                               f"{why}", s.key, k, (rank,), (devices[rank],), s.box.lo))
    for (rank, (key, slot, anchor)), ws in writes.items():  # targets the layout does not have
        if id(ws) in taken or not ws:
            continue
        t = ws[0]
        point = tuple(t.box.lo)
        if key in experts and not hold.holds_point(rank, key, point):
            emit(Violation("expert", f"is written to destination rank {rank} ({devices[rank]}), "
                           "which does not own this expert",
                           key, ",".join(t.kinds), (rank,), (devices[rank],), point))
        else:
            emit(Violation("coverage", f"is written to destination rank {rank} ({devices[rank]}), "
                           f"which has no region {anchor} in {slot_text(slot)}", key,
                           ",".join(t.kinds), (rank,), (devices[rank],), point))


def _unfilled_in(key: str, box: Box, kinds: tuple[str, ...],
                 unfilled: dict[tuple[str, str], tuple[Box, ...]] | None) -> dict[str, list[Box]]:
    """Per kind, the parts of ``box`` declared lost (kinds with none left out)."""
    out: dict[str, list[Box]] = {}
    for k in kinds:
        cuts = [c for b in (unfilled or {}).get((key, k), ()) if (c := b & box) is not None]
        if cuts:
            out[k] = cuts
    return out
