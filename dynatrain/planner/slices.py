"""One device's part of a plan, computed without planning anyone else's.

``plan_slice(src, dst, budget, device)`` returns the messages the device sends or receives
(local copies included) in every round, equal to that device's part of ``plan_transition``'s
global plan: the same transfers, messages, rounds and per-round order. It relies on every
decision of the global planner being local:

- **Intersect**: a destination box is cut by the source boxes that overlap it, whoever else
  needs them. The slice indexes only the source ranks that hold something overlapping the
  boxes it asks about: whole model-parallel classes for module parameters (their DP replicas
  share them), and for DistributedOptimizer shards only the optimizer ranks whose bucket
  shards cover those parameters (arithmetic on the DDP buffer layout).
- **Sources**: a receiver's pick depends on the part, its holders and the receiver alone
  (``sources``). The device's receives are its own picks; its sends are the picks of the
  destination ranks that need something it holds, each recomputed from that rank's own parts.
- **Rounds**: each pair's traffic is spread over R rounds from its own bytes (``spread``). The
  only global numbers are the cut unit (from the most pairs any device has) and R: a live job
  agrees on them with three or more all-reduces of one integer (``agree``); without ``agree``
  the caller gives them (``spread=(unit, R)``, e.g. from the global plan).

Why the union of per-device checks verifies the plan: every rule of ``verify`` is about one
device or one pair. Coverage: a destination region is written only by transfers to its
device, all of which are in that device's slice. Source: a transfer reads what its sender
holds, checked where it is sent. Memory: a device's staging is its own messages. Deadlock:
within a round every device runs its messages in one global (source, destination) order, so
two devices agree on the order of what they share when each sorts its own messages that way
(``plan.message_order``), which each slice checks of itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..ir.box import Box
from ..ir.layout import Layout
from ..ir.slots import members
from ..ir.state import StateView, Stored, transition_views
from .intersect import Answer, Holders, PlanError, _answer, _Index
from .plan import Plan, Transfer
from .sources import CandidateCache, elem_bytes_of, node_of, part_transfers
from .spread import Agree, Pair, agree_spread, canonical, rounds_of

Model = tuple[int, int, int, int]  # (pp, tp, ep, etp): ranks that hold the same parameters


class _Side:
    """One layout's ranks, found by what they hold: who holds something overlapping given
    boxes, without listing what every rank holds."""

    def __init__(self, view: StateView) -> None:
        self.view = view
        L = view.layout
        self.layout = L
        self.classes, self.class_of = _classes(L)
        self.distopt = bool(L.parallel.use_distributed_optimizer and len(view.kinds) > 1)
        self._names: dict[Model, dict[str, list[tuple[int, object]]]] = {}
        self._opt: dict[tuple[Model, bool], dict[int, list[int]]] = {}

    def params_of(self, model: Model) -> tuple[Stored, ...]:
        return self.view.param_part(self.classes[model][0])

    def _buffer_params(self, model: Model) -> dict[str, list[tuple[int, object]]]:
        """Per parameter name, (buffer index, BufferParam) of every buffer holding it."""
        hit = self._names.get(model)
        if hit is None:
            hit = self._names[model] = defaultdict(list)
            for bi, buf in enumerate(self.layout._buffers(*model)):
                for p in buf.params:
                    hit[p.name].append((bi, p))
        return hit

    def _by_opt_rank(self, model: Model, expert: bool) -> dict[int, list[int]]:
        hit = self._opt.get((model, expert))
        if hit is None:
            hit = self._opt[(model, expert)] = defaultdict(list)
            for r in self.classes[model]:
                hit[self.layout.optimizer_rank(r, expert)].append(r)
        return hit

    def holders(self, wanted: dict[str, list[Box]]) -> tuple[set[Model], set[int]]:
        """Classes whose parameters, and ranks whose optimizer shards, overlap ``wanted``
        (boxes per tensor key). Parameters are held by whole classes; a shard by the ranks of
        a class with the optimizer ranks whose bucket shards cover an overlapping parameter."""
        param_classes: set[Model] = set()
        shard_ranks: set[int] = set()
        for model in self.classes:
            hit = False
            for s in self.params_of(model):
                boxes = wanted.get(s.key)
                if not boxes:
                    continue
                over = [b for b in boxes if (s.box & b) is not None] if s.box.lo else boxes
                if not over:
                    continue
                hit = True
                if self.distopt:
                    shard_ranks.update(self._shard_holders(model, s, over))
            if hit:
                param_classes.add(model)
        return param_classes, shard_ranks

    def _shard_holders(self, model: Model, s: Stored, boxes: list[Box]) -> set[int]:
        names = set()
        n = getattr(s.slot, "axes", 0)  # a family: its members are its leading indices
        seen_lead: set[tuple] = set()
        for b in boxes:
            sub = (s.box & b) if s.box.lo else s.box
            if sub is None:
                continue
            lead = (sub.lo[:n], sub.hi[:n])
            if n and lead in seen_lead:  # same members as a box already seen
                continue
            seen_lead.add(lead)
            for slot, _, _ in members(s.slot, s.box, sub):
                names.add(slot.name)
        bufs = self.layout._buffers(*model)
        out: set[int] = set()
        for name in names:
            for bi, p in self._buffer_params(model).get(name, ()):
                buf = bufs[bi]
                bs, be = buf.buckets[p.bucket]
                size = (be - bs) // buf.dp_size
                lo, hi = (p.start - bs) // size, (p.end - 1 - bs) // size
                by_opt = self._by_opt_rank(model, buf.is_expert)
                for i in range(lo, hi + 1):
                    out.update(by_opt.get(i, ()))
        return out

    def index(self, wanted: dict[str, list[Box]]) -> dict[tuple[str, tuple[str, ...]], _Index]:
        """``intersect.build_index`` over the ranks that hold something in ``wanted``: every
        box overlapping it, with all its holders (the same answers as the global index)."""
        classes, shard_ranks = self.holders(wanted)
        entries: dict[tuple[str, tuple[str, ...]], dict[Box, dict]] = defaultdict(
            lambda: defaultdict(dict))
        seen: dict[int, tuple[tuple[Stored, ...], list[int]]] = {}
        for model in classes:
            for r in self.classes[model]:
                part = self.view.param_part(r)
                seen.setdefault(id(part), (part, []))[1].append(r)
        for r in shard_ranks:
            part = self.view.shard_part(r)
            seen.setdefault(id(part), (part, []))[1].append(r)
        for part, ranks in seen.values():
            for s in part:
                if s.primary and s.key in wanted:
                    slots = entries[(s.key, s.kinds)][s.box]
                    slots.setdefault(s.slot, []).extend(ranks)
        return {k: _Index({box: [Holders(tuple(sorted(rs)), slot, box)
                                 for slot, rs in slots.items()]
                           for box, slots in v.items()}) for k, v in entries.items()}


def _classes(L: Layout) -> tuple[dict[Model, list[int]], list[Model]]:
    """Ranks per model-parallel class, and each rank's class: the mesh's arithmetic on all
    ranks at once (a per-rank ``coords`` call costs seconds at 100k ranks)."""
    ranks = np.arange(L.world, dtype=np.int64)

    def coords(grid) -> dict[str, np.ndarray]:
        return {t: (ranks // st) % n for t, n, st in zip(grid.order, grid.sizes, grid.strides())}

    d, e = coords(L.mesh.dense), coords(L.mesh.expert)
    cols = (d["pp"], d["tp"], e["ep"], e["tp"])
    keys = np.stack(cols, axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    models = [tuple(int(x) for x in row) for row in uniq]
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(models) + 1))
    classes = {m: order[bounds[i]:bounds[i + 1]].tolist() for i, m in enumerate(models)}
    return classes, [models[i] for i in inverse.tolist()]


def _wanted(entries) -> dict[str, list[Box]]:
    """Distinct boxes per tensor key (replicas repeat the same boxes many times)."""
    out: dict[str, dict[Box, None]] = defaultdict(dict)
    for s in entries:
        out[s.key][s.box] = None
    return {k: list(v) for k, v in out.items()}


def slice_transfers(src: Layout, dst: Layout, device: str, dtypes: dict,
                    replica_of: Callable[[int], int], sv: StateView, dv: StateView
                    ) -> tuple[list[Transfer], list[Transfer]]:
    """(receives, sends) of ``device``: transfers into its destination rank (local copies
    included), and transfers from its source rank to other devices."""
    derived = ("param",) if dst.spec.state.derive_param else ()
    s_side, d_side = _Side(sv), _Side(dv)
    src_nodes = [node_of(d) for d in src.devices]
    cands = CandidateCache(src_nodes)
    rank_on_device = {d: r for r, d in enumerate(src.devices)}
    ebytes: dict[tuple[str, tuple[str, ...]], int] = {}

    def receives(dst_rank: int, entries: tuple[Stored, ...], index) -> list[Transfer]:
        dev = dst.devices[dst_rank]
        here = rank_on_device.get(dev, -1)
        group_of = {(key, k): kinds for key, kinds in index for k in kinds}
        out: list[Transfer] = []
        for ans in _answer(entries, index, group_of, dst_rank, derived):
            out.extend(_transfers(ans, dst_rank, here, node_of(dev), replica_of(dst_rank),
                                  cands, dtypes, ebytes))
        return out

    recv: list[Transfer] = []
    if device in dst.devices:
        d = dst.devices.index(device)
        mine = dv.stored(d)
        recv = receives(d, mine, s_side.index(_wanted(mine)))
    sends: list[Transfer] = []
    if device in src.devices:
        s = src.devices.index(device)
        held = _wanted(sv.stored(s))
        classes, shard_ranks = d_side.holders(held)
        me = dst.devices.index(device) if device in dst.devices else -1
        # The destination ranks whose entries touch what this device holds: parameters of
        # the overlapping classes, shards of the overlapping optimizer ranks (each rank's
        # shards are only built when they may touch).
        touching: dict[int, list[Stored]] = defaultdict(list)
        for m in classes:
            got = [e for e in d_side.params_of(m) if _touches(e, held)]
            covered: dict[Model, list[Stored]] = {}  # per class of the taker's own device
            for r in d_side.classes[m]:
                h = rank_on_device.get(dst.devices[r], -1)
                if r == me or h == s:
                    continue
                if h >= 0:  # what the taker's own device holds it copies (sources, rule 1)
                    hm = s_side.class_of[h]
                    rest = covered.get(hm)
                    if rest is None:
                        rest = covered[hm] = [e for e in got
                                              if not _holds(s_side.params_of(hm), e)]
                else:
                    rest = got
                touching[r].extend(rest)
        for r in shard_ranks:
            if r != me:
                touching[r].extend(e for e in dv.shard_part(r) if _touches(e, held))
        asked = _wanted(e for got in touching.values() for e in got)
        index = s_side.index(asked)  # every source box those entries overlap
        for r in sorted(touching):
            if touching[r]:
                sends.extend(t for t in receives(r, tuple(touching[r]), index)
                             if t.src_rank == s)
    return recv, sends


def _holds(entries: tuple[Stored, ...], e: Stored) -> bool:
    """Whether ``entries`` (a source rank's parameters) hold all of ``e`` for all its kinds,
    in one box (then every part of ``e`` comes from that rank: ``sources``' first rule)."""
    for s in entries:
        if s.key == e.key and s.primary and set(e.kinds) <= set(s.kinds) and (
                not e.box.lo or (s.box & e.box) == e.box):
            return True
    return False


def _touches(e: Stored, wanted: dict[str, list[Box]]) -> bool:
    boxes = wanted.get(e.key)
    if not boxes:
        return False
    if not e.box.lo:
        return True
    return any((e.box & b) is not None for b in boxes)


def _transfers(ans: Answer, dst_rank: int, here: int, dst_node: str, replica: int,
               cands: CandidateCache, dtypes: dict, ebytes: dict) -> list[Transfer]:
    e = ans.entry
    eb = ebytes.get((e.key, ans.kinds))
    if eb is None:
        eb = ebytes[(e.key, ans.kinds)] = elem_bytes_of(dtypes, e.key, ans.kinds)
    out: list[Transfer] = []
    for box, holders in ans.parts:
        out.extend(part_transfers(e.key, ans.kinds, box, box.numel * eb, cands(holders),
                                  dst_rank, here, dst_node, replica, e.slot, e.box))
    return out


@dataclass(frozen=True)
class SlicePairs:
    """A device's traffic before it is cut into rounds: its remote pairs in each direction
    and its local copies (``slice_pairs``; ``finish_slice`` cuts them)."""

    device: str
    outs: tuple[Pair, ...]
    ins: tuple[Pair, ...]
    local: tuple[Transfer, ...]
    seconds: float


def slice_pairs(src: Layout, dst: Layout, device: str) -> SlicePairs:
    """The expensive part of ``plan_slice``, which needs no other device: intersect and pick
    for everything ``device`` sends or receives, grouped into pairs.

    Raises:
        PlanError: the layouts are not the same model, or ``device`` is in neither.
    """
    from .pipeline import check_compatible, replica_of  # pipeline imports this module's users
    if device not in src.devices and device not in dst.devices:
        raise PlanError(f"--device {device} is in neither layout")
    t0 = time.perf_counter()
    sv, dv = transition_views(src, dst)
    dtypes = check_compatible(sv, dv)
    recv, sends = slice_transfers(src, dst, device, dtypes, replica_of(dst), sv, dv)
    out_pairs: dict[str, list[Transfer]] = defaultdict(list)
    in_pairs: dict[str, list[Transfer]] = defaultdict(list)
    local: list[Transfer] = []
    for t in recv:
        s_dev = src.devices[t.src_rank]
        (local if s_dev == device else in_pairs[s_dev]).append(t)
    for t in sends:
        out_pairs[dst.devices[t.dst_rank]].append(t)
    return SlicePairs(device, tuple(Pair(device, d, ts) for d, ts in sorted(out_pairs.items())),
                      tuple(Pair(s, device, ts) for s, ts in sorted(in_pairs.items())),
                      tuple(canonical(local)), time.perf_counter() - t0)


def finish_slice(src: Layout, dst: Layout, budget_bytes: int, pairs: SlicePairs, *,
                 agree: Agree | None = None, spread: tuple[int, int] | None = None) -> Plan:
    """``pairs`` cut into the plan's rounds: with ``spread`` = (unit, rounds) given, or agreed
    with the other devices through ``agree`` (see ``plan_slice``)."""
    if (agree is None) == (spread is None):
        raise PlanError("plan_slice needs exactly one of agree= or spread=")
    if budget_bytes <= 0:
        raise PlanError(f"--budget must be positive (got {budget_bytes})")
    t0 = time.perf_counter()
    outs, ins = list(pairs.outs), list(pairs.ins)
    if spread is None:
        assert agree is not None
        spread = agree_spread(outs, ins, budget_bytes, agree)
    unit, n = spread
    dev = pairs.device
    rounds = rounds_of([*outs, *ins], {dev: list(pairs.local)} if pairs.local else {}, unit, n)
    plan = Plan(src.spec.name or "src", dst.spec.name or "dst", src.devices, dst.devices,
                tuple(rounds), budget_bytes, ("param",) if dst.spec.state.derive_param else ())
    plan.stats.update(device=dev, spread=[unit, n], rounds=n, budget_bytes=budget_bytes,
                      transfers=sum(len(m.transfers) for m in plan.messages()),
                      messages=sum(1 for m in plan.messages() if not m.local),
                      slice_seconds=pairs.seconds + time.perf_counter() - t0)
    return plan


def plan_slice(src: Layout, dst: Layout, budget_bytes: int, device: str, *,
               agree: Agree | None = None, spread: tuple[int, int] | None = None) -> Plan:
    """``device``'s part of ``plan_transition(src, dst, budget_bytes)``, computed alone.

    Give ``agree`` (this device's integer -> its maximum over every device of the switch,
    e.g. an all-reduce MAX; called the same number of times on every device) or ``spread``
    (the plan's (unit, rounds), e.g. ``plan.stats["spread"]`` of the global plan). The
    result holds every message ``device`` sends or receives, in rounds numbered as in the
    global plan; ``stats["device"]`` names the device (``verify`` then checks it as a slice)
    and ``stats["slice_seconds"]`` says what it took.

    Raises:
        PlanError: the layouts are not the same model, the arguments are wrong, or the budget
            cannot be met.
    """
    if (agree is None) == (spread is None):
        raise PlanError("plan_slice needs exactly one of agree= or spread=")
    if budget_bytes <= 0:
        raise PlanError(f"--budget must be positive (got {budget_bytes})")
    return finish_slice(src, dst, budget_bytes, slice_pairs(src, dst, device), agree=agree,
                        spread=spread)
