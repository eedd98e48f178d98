"""The data rules: coverage, source validity and expert ownership of a plan's writes.

Everything is recomputed from the two layouts (``StateView``) and the plan's transfers; nothing
the planner derived (its intersection, its holders, its byte counts) is trusted. Layout parts are
shared by ranks of one class, so their lookup tables are built once per distinct part.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from ..ir.box import Box
from ..ir.state import StateView, Stored
from ..planner.plan import Plan, Transfer
from .report import Violation
from .tiling import inside, outside_point, tiling_fault, well_formed

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8}

Emit = Callable[[Violation], None]
Target = tuple[str, object, Box]  # (key, slot, anchor): one region of a rank's storage


class Holdings:
    """What each rank of a layout holds, as (key, slot, anchor) -> ``Stored``."""

    def __init__(self, view: StateView) -> None:
        self.view = view
        self._tables: dict[int, tuple[tuple[Stored, ...], dict[Target, Stored]]] = {}
        self._by_rank: dict[int, tuple[dict[Target, Stored], ...]] = {}

    def tables(self, rank: int) -> tuple[dict[Target, Stored], ...]:
        hit = self._by_rank.get(rank)
        if hit is None:
            hit = self._by_rank[rank] = self._build(rank)
        return hit

    def _build(self, rank: int) -> tuple[dict[Target, Stored], ...]:
        out = []
        for part in (self.view.param_part(rank), self.view.shard_part(rank)):
            hit = self._tables.get(id(part))
            if hit is None:  # the value keeps ``part`` alive, so its id stays unique
                hit = self._tables[id(part)] = (part, {(s.key, s.slot, s.box): s for s in part})
            out.append(hit[1])
        return tuple(out)

    def find(self, rank: int, target: Target) -> Stored | None:
        for table in self.tables(rank):
            s = table.get(target)
            if s is not None:
                return s
        return None

    def holds_point(self, rank: int, key: str, point: tuple[int, ...]) -> bool:
        return any(s.key == key and inside(Box(point, tuple(x + 1 for x in point)), s.box)
                   for s in self.view.stored(rank))


def expert_keys(view: StateView) -> frozenset[str]:
    """Checkpoint keys of expert weights (the EP/ETP grid) in a layout."""
    L = view.layout
    keys = set()
    for rank in range(L.world):
        for cs in L.rank_shards(rank):
            keys.update(sh.param.key for sh in cs.shards if sh.param.expert)
        if L.parallel.ep == 1:  # without EP every rank holds every expert: one rank is enough
            break
    return frozenset(keys)


def check_data(plan: Plan, src: StateView, dst: StateView, emit: Emit) -> int:
    """Check every transfer's source and the tiling of every destination region.

    Returns the number of transfers checked.
    """
    s_hold, d_hold = Holdings(src), Holdings(dst)
    s_tensors, d_tensors = src.tensors(), dst.tensors()
    experts = expert_keys(dst)
    derived = set(plan.derived)
    s_world, d_world = src.layout.world, dst.layout.world
    dtype_ok: dict[tuple[str, str], bool] = {}
    writes: dict[tuple[int, Target], list[Transfer]] = defaultdict(list)
    count = 0
    for r, rnd in enumerate(plan.rounds):
        for m in rnd.messages:
            for t in m.transfers:
                count += 1
                if not (0 <= t.src_rank < s_world and 0 <= t.dst_rank < d_world):
                    emit(Violation("source", f"transfer {t} names a rank outside the layouts "
                                   f"(source world {s_world}, destination world {d_world})",
                                   t.key, ",".join(t.kinds), (t.src_rank, t.dst_rank)))
                    continue
                if plan.src_devices[t.src_rank] != m.src_device:
                    emit(Violation("source", f"round {r}: message from {m.src_device} carries a "
                                   f"transfer from rank {t.src_rank}, which runs on "
                                   f"{plan.src_devices[t.src_rank]}", t.key, ",".join(t.kinds),
                                   (t.src_rank,), (m.src_device,), t.box.lo))
                if plan.dst_devices[t.dst_rank] != m.dst_device:
                    emit(Violation("coverage", f"round {r}: message to {m.dst_device} carries a "
                                   f"transfer for rank {t.dst_rank}, which runs on "
                                   f"{plan.dst_devices[t.dst_rank]}", t.key, ",".join(t.kinds),
                                   (t.dst_rank,), (m.dst_device,), t.box.lo))
                _check_source(t, m.src_device, s_hold, emit)
                size = 0
                for k in t.kinds:
                    ok = dtype_ok.get((t.key, k))
                    if ok is None:
                        a, b = s_tensors.get((t.key, k)), d_tensors.get((t.key, k))
                        ok = dtype_ok[(t.key, k)] = (a is not None and b is not None
                                                     and a.dtype == b.dtype
                                                     and a.dtype in ITEMSIZE)
                    if not ok:
                        emit(Violation("source", f"no tensor of this kind with one dtype on both "
                                       "sides", t.key, k, (t.src_rank, t.dst_rank), (),
                                       t.box.lo))
                        continue
                    size += ITEMSIZE[d_tensors[(t.key, k)].dtype]
                if well_formed(t.box, len(t.box.lo)) and t.nbytes != size * t.box.numel:
                    emit(Violation("memory", f"round {r}: transfer {t} declares {t.nbytes} "
                                   f"bytes but moves {size * t.box.numel}", t.key,
                                   ",".join(t.kinds), (t.src_rank, t.dst_rank),
                                   (m.src_device, m.dst_device), t.box.lo))
                writes[(t.dst_rank, (t.key, t.dst_slot, t.dst_anchor))].append(t)
    _check_coverage(dst, d_hold, writes, derived, experts, plan.dst_devices, emit)
    return count


def _check_source(t: Transfer, device: str, hold: Holdings, emit: Emit) -> None:
    s = hold.find(t.src_rank, (t.key, t.src_slot, t.src_anchor))
    kinds = ",".join(t.kinds)
    if s is None:
        emit(Violation("source", f"source rank {t.src_rank} ({device}) holds no region "
                       f"{t.src_anchor} in {t.src_slot}", t.key, kinds, (t.src_rank,),
                       (device,), t.box.lo))
        return
    missing = [k for k in t.kinds if k not in s.kinds]
    if missing:
        emit(Violation("source", f"source rank {t.src_rank} ({device}) holds {t.src_anchor} for "
                       f"{','.join(s.kinds)}, not {','.join(missing)}", t.key, kinds,
                       (t.src_rank,), (device,), t.box.lo))
    if not well_formed(t.box, len(t.src_anchor.lo)):
        emit(Violation("source", f"transfer box {t.box} is empty or of the wrong rank", t.key,
                       kinds, (t.src_rank,), (device,), t.box.lo))
    elif not inside(t.box, t.src_anchor):
        emit(Violation("source", f"reads {t.box} beyond the region {t.src_anchor} that source "
                       f"rank {t.src_rank} ({device}) holds", t.key, kinds, (t.src_rank,),
                       (device,), outside_point(t.box, t.src_anchor)))


def _check_coverage(dst: StateView, hold: Holdings,
                    writes: dict[tuple[int, Target], list[Transfer]], derived: set[str],
                    experts: frozenset[str], devices: tuple[str, ...], emit: Emit) -> None:
    for rank in range(dst.layout.world):
        for s in dst.stored(rank):
            ws = writes.pop((rank, (s.key, s.slot, s.box)), [])
            needed = tuple(k for k in s.kinds if k not in derived)
            kind_sets = {t.kinds for t in ws}
            if len(kind_sets) == 1 and set(next(iter(kind_sets))) == set(needed):
                groups = [(needed, [t.box for t in ws])]  # common case: one check for all kinds
            else:
                groups = [((k,), [t.box for t in ws if k in t.kinds]) for k in needed]
            for kinds, boxes in groups:
                fault = tiling_fault(s.box, boxes)
                if fault is None:
                    continue
                what = {"empty": "gets an empty or malformed box",
                        "outside": f"gets a box beyond its region {s.box}",
                        "twice": "is written twice", "missing": "is never written"}[fault.what]
                senders = tuple(sorted({ws[i].src_rank for i in fault.boxes})) if (
                    len(boxes) == len(ws)) else ()
                emit(Violation("coverage", f"destination rank {rank} ({devices[rank]}) element "
                               f"{what}" + (f" (from source ranks {list(senders)})"
                                            if senders else ""),
                               s.key, ",".join(kinds), (rank,), (devices[rank],), fault.point))
            extra = {k for t in ws for k in t.kinds} - set(needed)
            for k in sorted(extra):
                why = "is derived, never sent" if k in derived else "is not held in this slot"
                emit(Violation("coverage", f"destination rank {rank} is sent kind {k}, which "
                               f"{why}", s.key, k, (rank,), (devices[rank],), s.box.lo))
    for (rank, (key, slot, anchor)), ws in writes.items():  # targets the layout does not have
        t = ws[0]
        point = tuple(t.box.lo)
        if key in experts and not hold.holds_point(rank, key, point):
            emit(Violation("expert", f"expert state is written to destination rank {rank} "
                           f"({devices[rank]}), which does not own this expert",
                           key, ",".join(t.kinds), (rank,), (devices[rank],), point))
        else:
            emit(Violation("coverage", f"destination rank {rank} ({devices[rank]}) has no "
                           f"region {anchor} in {slot}", key, ",".join(t.kinds), (rank,),
                           (devices[rank],), point))
