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
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..ir.box import Box
from ..ir.layout import Layout
from ..ir.model import chunk_params
from ..ir.slots import flat_index, members
from ..ir.state import STEP_KEY, StateView, Stored, transition_views
from .intersect import Answer, Holders, PlanError, _answer, _Index
from .plan import Plan, Transfer
from .sources import (CandidateCache, ElemBytes, PartChoice, ReplicaIndex, node_of,
                      part_transfers, spread_takers)
from .spread import Agree, Pair, PairPhase, agree_spread, canonical, link_twins, rounds_of

Model = tuple[int, int, int, int]  # (pp, tp, ep, etp): ranks that hold the same parameters


class _Side:
    """One layout's ranks, found by what they hold: who holds something overlapping given
    boxes, without listing what every rank holds."""

    def __init__(self, view: StateView) -> None:
        self.view = view
        L = view.layout
        self.layout = L
        self.classes, self.class_of, self.replica, self.edp = _classes(L)
        self.distopt = bool(L.parallel.use_distributed_optimizer and len(view.kinds) > 1)
        self._names: dict[Model, dict[str, list[tuple[int, object]]]] = {}
        self._opt: dict[tuple[Model, bool], dict[int, list[int]]] = {}
        self._shapes: dict[Model, dict[str, tuple[int, ...]]] = {}

    def params_of(self, model: Model) -> tuple[Stored, ...]:
        return self.view.model_part(model)

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
        """The class's ranks by their optimizer rank (``Layout.optimizer_rank``, at once)."""
        hit = self._opt.get((model, expert))
        if hit is None:
            hit = self._opt[(model, expert)] = defaultdict(list)
            L, ranks = self.layout, np.array(self.classes[model], dtype=np.int64)
            inst = L.parallel.num_distributed_optimizer_instances
            opt = (self.edp[ranks] % (L.edp // inst) if expert
                   else self.replica[ranks] % (L.dp * L.parallel.cp // inst))
            for o, r in zip(opt.tolist(), ranks.tolist()):
                hit[o].append(r)
        return hit

    def _may_hold(self, stage: tuple[int, int], sets: dict[str, "_BoxSet"]) -> bool:
        """Whether the parameters of classes of ``stage`` (pp, ep) may overlap ``sets``, judged
        by keys and leading indices alone (never False where they do: ``params_of`` then
        decides)."""
        leads = _stage_leads(self.layout, *stage)
        for key, boxes in sets.items():
            if key in leads and (leads[key] is None or boxes.meets_leads(leads[key])):
                return True
        return False

    def holders(self, wanted: dict[str, list[Box]]) -> tuple[set[Model], set[int]]:
        """Classes whose parameters, and ranks whose optimizer shards, overlap ``wanted``
        (boxes per tensor key). Parameters are held by whole classes; a shard by the ranks of
        a class with the optimizer ranks whose bucket shards cover an overlapping parameter."""
        param_classes: set[Model] = set()
        shard_ranks: set[int] = set()
        # Every rank holds the step: ``index`` lists its holders without visiting classes.
        sets = {k: _BoxSet(v) for k, v in wanted.items() if v and k != STEP_KEY}
        may: dict[tuple[int, int], bool] = {}  # by (pp, ep): the filter looks at no more
        for model in self.classes:
            stage = (model[0], model[2])
            ok = may.get(stage)
            if ok is None:
                ok = may[stage] = self._may_hold(stage, sets)
            if not ok:
                continue
            hit = False
            for s in self.params_of(model):
                boxes = sets.get(s.key)
                if boxes is None:
                    continue
                over = boxes.overlapping(s.box)
                if not over:
                    continue
                hit = True
                if self.distopt:
                    shard_ranks.update(self._shard_holders(model, s, over))
            if hit:
                param_classes.add(model)
        return param_classes, shard_ranks

    def _shard_holders(self, model: Model, s: Stored, boxes: list[Box]) -> set[int]:
        """Optimizer ranks of ``model`` whose bucket shards cover a part of ``s`` overlapping
        ``boxes``: the overlap's row-major range in each parameter's local tensor, mapped
        through the parameter's place in its buffers."""
        spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
        shapes = self._local_shapes(model)
        for b in boxes:
            sub = (s.box & b) if s.box.lo else s.box
            if sub is None:
                continue
            for slot, anchor, part in members(s.slot, s.box, sub):
                off = getattr(slot, "local_offset", None)
                shape = shapes.get(slot.name)
                if off is None or shape is None or not part.lo:
                    spans[slot.name].append((0, 1 << 62))  # not a local tensor's region: all
                    continue
                k = len(part.lo) - len(off)  # leading global axes the local tensor lacks
                first = tuple(o + a - z for o, a, z in zip(off, part.lo[k:], anchor.lo[k:]))
                last = tuple(o + a - 1 - z for o, a, z in zip(off, part.hi[k:], anchor.lo[k:]))
                spans[slot.name].append((flat_index(shape, first), flat_index(shape, last) + 1))
        bufs = self.layout._buffers(*model)
        out: set[int] = set()
        for name, ranges in spans.items():
            for bi, p in self._buffer_params(model).get(name, ()):
                buf = bufs[bi]
                bs, be = buf.buckets[p.bucket]
                size = (be - bs) // buf.dp_size
                by_opt = self._by_opt_rank(model, buf.is_expert)
                for a, z in ranges:
                    a, z = p.start + a, min(p.start + z, p.end)
                    for i in range((a - bs) // size, (z - 1 - bs) // size + 1):
                        out.update(by_opt.get(i, ()))
        return out

    def _local_shapes(self, model: Model) -> dict[str, tuple[int, ...]]:
        hit = self._shapes.get(model)
        if hit is None:
            hit = self._shapes[model] = {sh.param.name: sh.local_shape
                                         for cs in self.layout._shards(*model)
                                         for sh in cs.shards}
        return hit

    def index(self, entries: Iterable[Stored], opt_kinds: set[str]
              ) -> dict[tuple[str, tuple[str, ...]], _Index]:
        """``intersect.build_index`` over the ranks that hold something ``entries`` (another
        layout's) ask for: every box overlapping them, with all its holders (the same answers
        as the global index). Optimizer shards hold only ``opt_kinds``, so only entries asking
        for one of those search them."""
        asked = tuple(entries)
        wanted = _wanted(asked)
        classes, _ = self.holders(wanted)
        shard_ranks: set[int] = set()
        if self.distopt:
            _, shard_ranks = self.holders(_wanted(e for e in asked if opt_kinds & set(e.kinds)))
        table: dict[tuple[str, tuple[str, ...]], dict[Box, dict]] = defaultdict(
            lambda: defaultdict(dict))
        step = self.step() if STEP_KEY in wanted else None
        if step is not None:  # held by every rank, in the same slot
            table[(step.key, step.kinds)][step.box][step.slot] = list(range(self.layout.world))
        seen: dict[int, tuple[tuple[Stored, ...], list[int]]] = {}
        for model in classes:  # a class's ranks share one parameter part
            part = self.params_of(model)
            seen.setdefault(id(part), (part, []))[1].extend(self.classes[model])
        for r in shard_ranks:
            part = self.view.shard_part(r)
            seen.setdefault(id(part), (part, []))[1].append(r)
        for part, ranks in seen.values():
            for s in part:
                if s.primary and s.key in wanted and s.key != STEP_KEY:
                    slots = table[(s.key, s.kinds)][s.box]
                    slots.setdefault(s.slot, []).extend(ranks)
        return {k: _Index({box: [Holders(tuple(sorted(rs)), slot, box)
                                 for slot, rs in slots.items()]
                           for box, slots in v.items()}) for k, v in table.items()}

    def step(self) -> Stored | None:
        """The Adam step's entry (every rank holds the same one), None without optimizer state."""
        first = next(iter(self.classes))
        return next((e for e in self.params_of(first) if e.key == STEP_KEY), None)


@lru_cache(maxsize=1024)
def _stage_leads(layout: Layout, pp: int, ep: int) -> dict[str, np.ndarray | None]:
    """Per tensor key that classes of stage ``pp`` and EP rank ``ep`` hold, the leading
    (layer, expert) indices of its boxes; None where it has no leading axes (any box of the
    key may overlap). From the model's parameter list alone: compiling a class's shards costs
    far more, and a slice would compile every class. (A filter on the TP split would rarely
    help: every stage holds TP-replicated norms.) Cached per layout: a live job's slices of
    later switches reuse it.

    Where layers are stacked (``homogeneous_layers``), a layer's keys and trailing leading
    indices depend only on whether it is an MoE layer, so one layer of each kind is read and
    the stage's layer indices are put in front (``stage_leads_exact`` reads every layer;
    a test checks that both agree)."""
    m, p = layout.model, layout.parallel
    # With MTP the final norm sits with the last decoder layer, not with the stage's edges.
    if not m.homogeneous_layers or m.mtp_num_layers:
        return stage_leads_exact(layout, pp, ep)
    leads: dict[str, set[tuple[int, ...]] | None] = {}
    moe = m.moe_pattern()
    for ch in layout.chunks(pp):
        edge_defs, edge_bufs = chunk_params(m, p.tp, p.ep, ep, (), ch.pre_process,
                                            ch.post_process, p.pp > 1,
                                            megatron_core=layout.spec.megatron_core)
        _add_leads(leads, (*edge_defs, *edge_bufs))
        for layer in ch.layers:
            for key, rests in _layer_leads(m, layout.spec.megatron_core, p.ep, ep, moe[layer]):
                got = leads.get(key, ())
                if rests is None:
                    leads[key] = None
                elif got is not None:
                    if not got:
                        got = leads[key] = set()
                    got.update((layer, *r) for r in rests)
    return {k: None if v is None else np.array(sorted(v), dtype=np.int64)
            for k, v in leads.items()}


@lru_cache(maxsize=256)
def _layer_leads(m, megatron_core: str, ep_size: int, ep: int, is_moe: bool
                 ) -> tuple[tuple[str, tuple[tuple[int, ...], ...] | None], ...]:
    """Per key of a stacked layer of this kind on EP rank ``ep``: its leading indices after
    the layer's own (the experts' for expert weights, ``()`` otherwise), None for a key
    without leading axes."""
    layer = m.moe_pattern().index(is_moe)
    defs, bufs = chunk_params(m, 1, ep_size, ep, (layer,), False, False, False,
                              megatron_core=megatron_core)
    out: dict[str, dict[tuple[int, ...], None] | None] = {}
    for d in (*defs, *bufs):
        if not d.prepend:
            out[d.key] = None
        elif out.get(d.key, ()) is not None:
            out.setdefault(d.key, {})[tuple([i for i, _ in d.prepend[1:]])] = None
    return tuple((k, None if v is None else tuple(v)) for k, v in out.items())


def stage_leads_exact(layout: Layout, pp: int, ep: int) -> dict[str, np.ndarray | None]:
    """``_stage_leads`` from every parameter definition of the stage."""
    leads: dict[str, set[tuple[int, ...]] | None] = {}
    for defs, bufs in layout.chunk_defs(pp, ep):
        _add_leads(leads, (*defs, *bufs))
    return {k: None if v is None else np.array(sorted(v), dtype=np.int64)
            for k, v in leads.items()}


def _add_leads(leads: dict[str, set[tuple[int, ...]] | None], defs) -> None:
    for d in defs:
        if not d.prepend:
            leads[d.key] = None
            continue
        got = leads.get(d.key, ())
        if got is not None:
            if not got:
                got = leads[d.key] = set()
            got.add(tuple([i for i, _ in d.prepend]))


_FEW = 16


class _NodeOf:
    """``node_of`` of each device, computed for the ranks asked about (a slice meets a few
    holders, not the world)."""

    __slots__ = ("devices", "memo")

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices = devices
        self.memo: dict[int, str] = {}

    def __getitem__(self, rank: int) -> str:
        n = self.memo.get(rank)
        if n is None:
            n = self.memo[rank] = node_of(self.devices[rank])
        return n


class _BoxSet:
    """Boxes of one tensor, asked which overlap a given box: one numpy comparison instead of a
    ``Box.__and__`` per box (the sends side asks about thousands of boxes per class)."""

    __slots__ = ("boxes", "lo", "hi")

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = boxes
        self.lo = np.array([b.lo for b in boxes], dtype=np.int64)
        self.hi = np.array([b.hi for b in boxes], dtype=np.int64)

    def meets_leads(self, leads: np.ndarray) -> bool:
        """Whether some box contains one of ``leads`` (rows of leading indices) in its
        leading axes."""
        n = leads.shape[1]
        lo, hi = self.lo[:, None, :n], self.hi[:, None, :n]
        return bool(((lo <= leads[None]) & (leads[None] < hi)).all(axis=2).any())

    def overlapping(self, box: Box) -> list[Box]:
        if not box.lo:
            return self.boxes
        if len(self.boxes) <= _FEW:  # numpy's call overhead exceeds a few tuple compares
            return [b for b in self.boxes if box.meets(b)]
        hit = ((self.lo < np.array(box.hi)) & (self.hi > np.array(box.lo))).all(axis=1)
        return [self.boxes[i] for i in np.flatnonzero(hit).tolist()]


def _classes(L: Layout) -> tuple[dict[Model, list[int]], list[Model], np.ndarray, np.ndarray]:
    """Ranks per model-parallel class, each rank's class, and each rank's replica index (its
    rank in the dense data-parallel-with-context group, ``RankCoords.dp_cp``) and expert-DP
    index (``RankCoords.edp``): the mesh's
    arithmetic on all ranks at once (a per-rank ``coords`` call costs seconds at 100k
    ranks)."""
    ranks = np.arange(L.world, dtype=np.int64)

    def coords(grid) -> dict[str, np.ndarray]:
        return {t: (ranks // st) % n for t, n, st in zip(grid.order, grid.sizes, grid.strides())}

    d, e = coords(L.mesh.dense), coords(L.mesh.expert)
    replica, acc = np.zeros(L.world, dtype=np.int64), 1
    for t, n in zip(L.mesh.dense.order, L.mesh.dense.sizes):  # as ``Grid.group_rank``
        if t in ("cp", "dp"):
            replica += d[t] * acc
            acc *= n
    cols = (d["pp"], d["tp"], e["ep"], e["tp"])
    key = np.zeros(L.world, dtype=np.int64)  # one integer per class: a 1-D unique is fast
    for c in cols:
        key = key * (int(c.max()) + 1) + c
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    models = [tuple(int(c[r]) for c in cols) for r in first.tolist()]
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(models) + 1))
    classes = {m: order[bounds[i]:bounds[i + 1]].tolist() for i, m in enumerate(models)}
    return classes, [models[i] for i in inverse.tolist()], replica, e["dp"]


def _wanted(entries) -> dict[str, list[Box]]:
    """Distinct boxes per tensor key (replicas repeat the same boxes many times)."""
    out: dict[str, dict[Box, None]] = defaultdict(dict)
    for s in entries:
        out[s.key][s.box] = None
    return {k: list(v) for k, v in out.items()}


def slice_transfers(src: Layout, dst: Layout, device: str, dtypes: dict,
                    replica_of: ReplicaIndex, sv: StateView, dv: StateView
                    ) -> tuple[list[Transfer], list[Transfer]]:
    """(receives, sends) of ``device``: transfers into its destination rank (local copies
    included), and transfers from its source rank to other devices."""
    derived = ("param",) if dst.spec.state.derive_param else ()
    s_side, d_side = _Side(sv), _Side(dv)
    cands = CandidateCache(_NodeOf(src.devices))
    rank_on_device = {d: r for r, d in enumerate(src.devices)}
    ebytes = ElemBytes(dtypes)
    opt = set(dv.kinds) - {"param"}  # what optimizer shards hold

    def receives(dst_rank: int, entries: tuple[Stored, ...], index) -> list[Transfer]:
        dev = dst.devices[dst_rank]
        here = rank_on_device.get(dev, -1)
        group_of = {(key, k): kinds for key, kinds in index for k in kinds}
        out: list[Transfer] = []
        for ans in _answer(entries, index, group_of, dst_rank, derived):
            out.extend(_transfers(ans, dst_rank, here, node_of(dev), replica_of, cands,
                                  ebytes))
        return out

    recv: list[Transfer] = []
    if device in dst.devices:
        d = dst.devices.index(device)
        mine = dv.stored(d)
        recv = receives(d, mine, s_side.index(mine, opt))
    sends: list[Transfer] = []
    if device in src.devices:
        s = src.devices.index(device)
        mine = sv.stored(s)
        me = dst.devices.index(device) if device in dst.devices else -1
        # Receivers grouped by the destination entries they ask about (touching what this
        # device holds, kind by kind): one group per overlapping parameter class, and one
        # per overlapping optimizer shard. Shards are searched only with what this device
        # holds of the optimizer's kinds: a shard of another replica's range needs none of
        # the parameters every replica holds.
        classes, _ = d_side.holders(_wanted(mine))
        _, shard_ranks = d_side.holders(_wanted(e for e in mine if opt & set(e.kinds)))
        by_kind = _held_by_kind(mine, derived)
        groups: list[tuple[tuple[Stored, ...], list[int]]] = []
        for m in classes:
            got = tuple(e for e in d_side.params_of(m)
                        if e.key != STEP_KEY and _touches(e, by_kind))
            if got:
                groups.append((got, [r for r in d_side.classes[m] if r != me]))
        for r in sorted(shard_ranks):
            got = tuple(e for e in dv.shard_part(r) if _touches(e, by_kind))
            if got and r != me:
                groups.append((got, [r]))
        # The step: every device that was a source device holds its own; new devices pick
        # it by rotation over every source rank.
        step = d_side.step() if any(e.key == STEP_KEY for e in mine) else None
        if step is not None:
            groups.extend(((step,), [r]) for r, dev in enumerate(dst.devices)
                          if dev not in rank_on_device and r != me)
        index = s_side.index((e for got, _ in groups for e in got), opt)
        group_of = {(key, k): kinds for key, kinds in index for k in kinds}
        taker = _Takers(src, dst, s, rank_on_device, replica_of, d_side.replica, d_side.edp)
        for entries, ranks in groups:
            if len(ranks) == 1:
                sends.extend(t for t in receives(ranks[0], entries, index) if t.src_rank == s)
            elif ranks:
                answers = _answer(entries, index, group_of, ranks[0], derived)
                sends.extend(taker.sends(answers, ranks, cands, ebytes))
    return recv, sends


def _held_by_kind(entries: tuple[Stored, ...], derived: tuple[str, ...]
                  ) -> dict[str, dict[str, _BoxSet]]:
    """Per state kind (those not derived), the boxes per tensor key held in ``entries``."""
    out: dict[str, dict[str, dict[Box, None]]] = defaultdict(lambda: defaultdict(dict))
    for e in entries:
        for k in e.kinds:
            if k not in derived:
                out[k][e.key][e.box] = None
    return {k: {key: _BoxSet(list(v)) for key, v in keys.items()} for k, keys in out.items()}


def _touches(e: Stored, held: dict[str, dict[str, _BoxSet]]) -> bool:
    """Whether some kind of ``e`` overlaps what ``held`` (``_held_by_kind``) holds of it."""
    for k in e.kinds:
        boxes = held.get(k, {}).get(e.key)
        if boxes is not None and boxes.overlapping(e.box):
            return True
    return False


class _Takers:
    """The transfers one source rank sends to a group of destination ranks that ask about the
    same entries (the DP replicas of a class), without picking for every replica: a receiver
    whose node holds none of a part takes each slab from the holder ``sources.spread_index``
    gives, and the replicas that take a slab from this rank are one run of replica indices
    (``spread_takers``). Only the receivers on this rank's own node (which pick among their
    node's holders) are picked one by one."""

    def __init__(self, src: Layout, dst: Layout, s: int, rank_on_device: dict[str, int],
                 replica_of: ReplicaIndex, replicas: np.ndarray, expert: np.ndarray) -> None:
        self.dst, self.s = dst, s
        self.node = node_of(src.devices[s])
        self.rank_on_device = rank_on_device
        self.replica_of = replica_of
        # every destination rank's replica index, at once: dense, and for expert weights
        self.replicas, self.expert = replicas, expert

    def sends(self, answers, ranks: list[int], cands: CandidateCache,
              ebytes: ElemBytes) -> list[Transfer]:
        dst, s = self.dst, self.s
        dense = dict(zip(self.replicas[ranks].tolist(), ranks))
        expert = dict(zip(self.expert[ranks].tolist(), ranks))
        if len(dense) != len(ranks) or len(expert) != len(ranks):
            raise PlanError("internal: a destination class repeats a replica index")
        experts = self.replica_of.expert_keys
        node = {r: node_of(dst.devices[r]) for r in ranks}
        near = [r for r in ranks if node[r] == self.node]  # takers on this rank's node
        out: list[Transfer] = []
        for ans in answers:
            e = ans.entry
            eb = ebytes(e.key, ans.kinds)
            if e.key in experts:
                by_replica, m = expert, self.replica_of.expert_count
            else:
                by_replica, m = dense, self.replica_of.count
            for box, holders in ans.parts:
                c = cands(holders)
                if s not in c.members:
                    continue
                nbytes = box.numel * eb
                for r in near:
                    here = self.rank_on_device.get(dst.devices[r], -1)
                    rep, _ = self.replica_of.of(r, e.key)
                    out.extend(t for t in part_transfers(
                        e.key, ans.kinds, box, nbytes, c, r, here, self.node, rep, e.slot,
                        e.box, m) if t.src_rank == s)
                n = len(c.ranks)
                i = bisect_left(c.ranks, s)
                h = c.group[s]
                # Per taker, the slabs it takes from this rank: one run of consecutive slabs
                # (its holder is monotone in the slab's fraction but for one wrap), or two.
                runs: dict[int, list[list]] = {}
                for k, (sub, sub_bytes, shift, fraction) in enumerate(
                        PartChoice(e.key, box, nbytes, c).pieces):
                    for rep in spread_takers(i, m, fraction, n, shift):
                        r = by_replica.get(rep)
                        # A taker on a node holding the part picks there (its own device
                        # first); those on this rank's node were picked above.
                        if r is None or node[r] in c.by_node:
                            continue
                        mine = runs.setdefault(r, [])
                        if mine and mine[-1][0] == k - 1:
                            mine[-1][0], mine[-1][2] = k, mine[-1][2] + sub_bytes
                            mine[-1][1] = Box(mine[-1][1].lo, sub.hi)
                        else:
                            mine.append([k, sub, sub_bytes])
                for r, got in runs.items():
                    out.extend(Transfer(e.key, ans.kinds, sub, s, r, h.slot, h.anchor, e.slot,
                                        e.box, sub_bytes) for _, sub, sub_bytes in got)
        return out


def _transfers(ans: Answer, dst_rank: int, here: int, dst_node: str, replica_of: ReplicaIndex,
               cands: CandidateCache, ebytes: ElemBytes) -> list[Transfer]:
    e = ans.entry
    eb = ebytes(e.key, ans.kinds)
    replica, replicas = replica_of.of(dst_rank, e.key)
    out: list[Transfer] = []
    for box, holders in ans.parts:
        out.extend(part_transfers(e.key, ans.kinds, box, box.numel * eb, cands(holders),
                                  dst_rank, here, dst_node, replica, e.slot, e.box, replicas))
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
    dtypes = _SameModelDtypes(dv) if _same_model(sv, dv) else check_compatible(sv, dv)
    recv, sends = slice_transfers(src, dst, device, dtypes, replica_of(dst), sv, dv)
    out_pairs: dict[str, list[Transfer]] = defaultdict(list)
    in_pairs: dict[str, list[Transfer]] = defaultdict(list)
    local: list[Transfer] = []
    for t in recv:
        s_dev = src.devices[t.src_rank]
        (local if s_dev == device else in_pairs[s_dev]).append(t)
    for t in sends:
        out_pairs[dst.devices[t.dst_rank]].append(t)
    phase = PairPhase(src, dst)

    def pair(s: str, d: str, ts: list[Transfer]) -> Pair:
        return Pair(s, d, ts, phase(ts[0].src_rank, ts[0].dst_rank))
    outs = tuple(pair(device, d, ts) for d, ts in sorted(out_pairs.items()))
    ins = tuple(pair(s, device, ts) for s, ts in sorted(in_pairs.items()))
    link_twins((*outs, *ins))
    return SlicePairs(device, outs, ins,
                      tuple(canonical(local)), time.perf_counter() - t0)


def _same_model(sv: StateView, dv: StateView) -> bool:
    """Both specs name the same model and state dtypes: the logical tensors are then the same
    by construction (they come from the model's parameter definitions, vocab padding removed),
    so the slice need not list every tensor of both sides to compare them
    (``pipeline.check_compatible``, which also catches everything else)."""
    return (sv.layout.model == dv.layout.model and sv.kinds == dv.kinds
            and sv.vocab_rows == dv.vocab_rows)


class _SameModelDtypes(dict):
    """``check_compatible``'s dtypes of two views of one model, each looked up when asked:
    a state kind's dtype from the spec, fp32 router buffers, the int64 Adam step (as
    ``StateView.tensors``)."""

    def __init__(self, view: StateView) -> None:
        super().__init__()
        self.kinds = {**view.kinds, "buffer": "fp32", "step": "int64"}

    def __missing__(self, tk: tuple[str, str]) -> str:
        return self.kinds[tk[1]]


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
