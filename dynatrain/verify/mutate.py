"""Mutation testing for the verifier: corrupt a good plan in one way, know which rule must fail.

Each operator takes a plan that verifies clean, its two layouts and a ``random.Random``, and
returns a ``Mutant`` (the plan with exactly one fault, everything else kept consistent) or None
when the fault cannot be made in this plan. The fault classes are those a planner bug could
produce:

============================  ==========  =======================================================
operator                      rule        fault
============================  ==========  =======================================================
``drop_transfer``             coverage    a transfer is missing (an element is never written)
``duplicate_transfer``        coverage    a transfer runs twice (an element is written twice)
``shift_box``                 coverage    a transfer's box is off by one along one dimension
``shrink_box``                coverage    a transfer's box lost its last slab along a dimension
``swap_kind``                 coverage    a transfer carries the wrong state kind
``wrong_device``              coverage    a message goes to a device that does not run its ranks
``swap_placement``            coverage    two destination ranks swap devices, messages do not
``false_derive``              coverage    a kind is declared derived on the destination, not sent
``wrong_source``              source      a transfer reads from a rank that does not hold it
``expert_second_owner``       expert      expert state is written to a rank that does not own it
``reorder_cycle``             deadlock    two devices disagree on the order of their messages
``drop_from_order``           deadlock    a device never runs one of its messages
``overflow_budget``           memory      a round stages more than the budget on some device
``wrong_nbytes``              memory      a transfer declares the wrong byte count
============================  ==========  =======================================================

A mutant also carries ``focus``: where a correct witness must point (see ``Mutant``), so a test
can check not only that the verifier objects but that its evidence names the fault.

Everything here is deterministic given the ``random.Random``; what each rank holds comes from
the layouts (``StateView``), never from the verifier, so a verifier bug cannot hide its own
mutants.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from ..ir.box import Box
from ..ir.layout import Layout
from ..ir.state import StateView, switch_vocab_rows
from ..planner.plan import Message, Plan, Round, Transfer

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8}
PER_PARAM_KINDS = ("param", "main_param", "exp_avg", "exp_avg_sq")

Where = tuple[int, int, int]  # (round, message, transfer) indices into a plan


@dataclass(frozen=True)
class Mutant:
    """A plan with one fault, the rule the verifier must report for it, and where.

    ``focus`` says where a correct witness points: ``(key, box)`` for faults in data (the
    witness coordinate of a violation of ``expected_rule`` on tensor ``key`` lies in ``box``);
    ``(round, message)`` for deadlock faults (the violation's witness names that message);
    ``((round, device), ...)`` for staging over the budget (a violation's round and device is
    one of these). Empty when there is nothing more specific to check.
    """

    operator: str
    expected_rule: str
    description: str
    plan: Plan
    focus: tuple = ()


# ---- facts about the layouts (cached per layout) ------------------------------------------------

class _Facts:
    """What each rank of a layout holds, looked up by region, and its expert weights."""

    def __init__(self, layout: Layout, vocab_rows: int | None) -> None:
        self.view = StateView(layout, vocab_rows)
        self._held: dict[int, dict[tuple, tuple[str, ...]]] = {}
        self._by_key: dict[int, dict[str, list[Box]]] = {}
        keys: set[str] = set()
        for rank in range(layout.world):
            for cs in layout.rank_shards(rank):
                keys.update(sh.param.key for sh in cs.shards if sh.param.expert)
        self.expert_keys = frozenset(keys)

    def held(self, rank: int) -> dict[tuple, tuple[str, ...]]:
        """(key, slot, box) -> kinds, for everything ``rank`` holds."""
        hit = self._held.get(rank)
        if hit is None:
            hit = self._held[rank] = {}
            for s in self.view.stored(rank):
                hit[(s.key, s.slot, s.box)] = hit.get((s.key, s.slot, s.box), ()) + s.kinds
        return hit

    def boxes(self, rank: int, key: str) -> list[Box]:
        """Every box of tensor ``key`` that ``rank`` holds (any slot, any kind)."""
        hit = self._by_key.get(rank)
        if hit is None:
            hit = self._by_key[rank] = {}
            for s in self.view.stored(rank):
                hit.setdefault(s.key, []).append(s.box)
        return hit.get(key, [])

    def holds(self, rank: int, key: str, slot: object, anchor: Box, kinds: tuple[str, ...]) -> bool:
        return set(kinds) <= set(self.held(rank).get((key, slot, anchor), ()))

    def dtype(self, key: str, kind: str) -> str | None:
        t = self.view.tensors().get((key, kind))
        return t.dtype if t is not None else None


@lru_cache(maxsize=16)  # a few layouts at a time; a Layout hashes by identity
def _layout_facts(layout: Layout, vocab_rows: int | None) -> _Facts:
    return _Facts(layout, vocab_rows)


def _facts(layout: Layout, src: Layout, dst: Layout) -> _Facts:
    """Facts of ``layout`` as the switch from ``src`` to ``dst`` sees it (its vocab rows)."""
    return _layout_facts(layout, switch_vocab_rows(src, dst))


# ---- plan surgery: immutable edits that keep everything else consistent -------------------------

def _order(rnd: Round) -> dict[str, list[int]]:
    return {d: list(ix) for d, ix in rnd.device_order().items()}


def _round(messages: list[Message] | tuple[Message, ...], order: dict[str, list[int]]) -> Round:
    # Keep devices whose list became empty: an empty ``order`` would mean the default one.
    return Round(tuple(messages), tuple((d, tuple(ix)) for d, ix in order.items()))


def _devices(m: Message) -> tuple[str, ...]:
    return (m.src_device,) if m.local else (m.src_device, m.dst_device)


def _global_position(rnd: Round) -> dict[int, int]:
    """Each message's place in one global order that every device's order follows (exists
    for a round free of deadlock; Kahn's algorithm, ties by index)."""
    after: dict[int, set[int]] = {i: set() for i in range(len(rnd.messages))}
    for ix in rnd.device_order().values():
        for a, b in zip(ix, ix[1:]):
            after[a].add(b)
    waiting = {i: 0 for i in after}
    for bs in after.values():
        for b in bs:
            waiting[b] += 1
    ready = [i for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    pos: dict[int, int] = {}
    while ready:
        a = heapq.heappop(ready)
        pos[a] = len(pos)
        for b in after[a]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, b)
    if len(pos) != len(after):
        raise ValueError("the round's device orders already form a cycle")
    return pos


def _remove_message(rnd: Round, i: int) -> Round:
    """The round without message ``i``; every device's order reindexed."""
    order = {d: [j - (j > i) for j in ix if j != i] for d, ix in _order(rnd).items()}
    return _round(rnd.messages[:i] + rnd.messages[i + 1:], order)


def _append_message(rnd: Round, m: Message) -> tuple[Round, int]:
    """The round with ``m`` run last by both its devices (it precedes no other message, so
    no cycle of waits can pass through it)."""
    order = _order(rnd)
    i = len(rnd.messages)
    for d in _devices(m):
        order.setdefault(d, []).append(i)
    return _round(rnd.messages + (m,), order), i


def _set_transfers(rnd: Round, i: int, transfers: tuple[Transfer, ...]) -> Round:
    """Message ``i`` with new transfers (removed from the round if none are left)."""
    if not transfers:
        return _remove_message(rnd, i)
    m = rnd.messages[i]
    new = Message(m.src_device, m.dst_device, transfers)
    return Round(rnd.messages[:i] + (new,) + rnd.messages[i + 1:], rnd.order)


def _add_transfer(rnd: Round, src_device: str, dst_device: str, t: Transfer) -> Round:
    """``t`` added to the round's message between the two devices (made if there is none)."""
    for i, m in enumerate(rnd.messages):
        if m.src_device == src_device and m.dst_device == dst_device:
            return _set_transfers(rnd, i, m.transfers + (t,))
    return _append_message(rnd, Message(src_device, dst_device, (t,)))[0]


def _with_rounds(plan: Plan, rounds: dict[int, Round]) -> Plan:
    """The plan with some rounds replaced; rounds left without messages are dropped."""
    new = [rounds.get(r, rnd) for r, rnd in enumerate(plan.rounds)]
    return replace(plan, rounds=tuple(rnd for rnd in new if rnd.messages), stats=dict(plan.stats))


def _take_transfer(rnd: Round, i: int, j: int) -> Round:
    ts = rnd.messages[i].transfers
    return _set_transfers(rnd, i, ts[:j] + ts[j + 1:])


def _transfers(plan: Plan, rng: random.Random) -> list[Where]:
    """Every transfer's position, in a random order."""
    out = [(r, i, j) for r, rnd in enumerate(plan.rounds) for i, m in enumerate(rnd.messages)
           for j in range(len(m.transfers))]
    rng.shuffle(out)
    return out


def _at(plan: Plan, w: Where) -> Transfer:
    r, i, j = w
    return plan.rounds[r].messages[i].transfers[j]


def _bytes_per_element(dst: Layout, key: str, kinds: tuple[str, ...]) -> int:
    f = _layout_facts(dst, None)  # dtypes only: the same for any vocab rows
    return sum(ITEMSIZE.get(f.dtype(key, k) or "", 8) for k in kinds)


def _staging(rnd: Round) -> dict[str, int]:
    used: dict[str, int] = {}
    for m in rnd.messages:
        if not m.local:
            for d in (m.src_device, m.dst_device):
                used[d] = used.get(d, 0) + m.nbytes
    return used


def _over_budget(plan: Plan) -> tuple[tuple[int, str], ...]:
    """(round, device) pairs whose staging exceeds the plan's budget."""
    return tuple((r, d) for r, rnd in enumerate(plan.rounds)
                 for d, n in sorted(_staging(rnd).items()) if n > plan.budget_bytes)


# ---- operators: coverage ------------------------------------------------------------------------

def drop_transfer(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Remove one transfer (and its message, if it was the last): an element is never written."""
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        if set(t.kinds) <= set(plan.derived):
            continue
        r, i, j = w
        mutated = _with_rounds(plan, {r: _take_transfer(plan.rounds[r], i, j)})
        return Mutant("drop_transfer", "coverage", f"round {r}: dropped {t}", mutated,
                      (t.key, t.box))
    return None


def duplicate_transfer(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Add a copy of one transfer, in its own message or in another round: written twice."""
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        r, i, _ = w
        m = plan.rounds[r].messages[i]
        others = [q for q in range(len(plan.rounds)) if q != r]
        if others and rng.random() < 0.5:
            q = rng.choice(others)
            rnd = _add_transfer(plan.rounds[q], m.src_device, m.dst_device, t)
            where = f"again in round {q}"
        else:
            q, rnd = r, _set_transfers(plan.rounds[r], i, m.transfers + (t,))
            where = "twice in its message"
        return Mutant("duplicate_transfer", "coverage", f"round {r}: {t} sent {where}",
                      _with_rounds(plan, {q: rnd}), (t.key, t.box))
    return None


def shift_box(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Move one transfer's box by +1 or -1 along one dimension (same shape, same bytes)."""
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        if not t.box.lo:
            continue
        d = rng.randrange(len(t.box.lo))
        step = rng.choice((-1, 1))
        lo = t.box.lo[:d] + (t.box.lo[d] + step,) + t.box.lo[d + 1:]
        hi = t.box.hi[:d] + (t.box.hi[d] + step,) + t.box.hi[d + 1:]
        box = Box(lo, hi)
        r, i, j = w
        span = Box(tuple(map(min, t.box.lo, lo)), tuple(map(max, t.box.hi, hi)))
        return _replaced("shift_box", "coverage", plan, w, t._replace(box=box),
                         f"round {r}: {t} shifted by {step:+d} along dim {d} to {box}",
                         (t.key, span))
    return None


def shrink_box(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Cut the last slab off one transfer's box along a dimension of extent > 1 (bytes kept
    consistent with the smaller box)."""
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        dims = [d for d, (l, h) in enumerate(zip(t.box.lo, t.box.hi)) if h - l > 1]
        if not dims:
            continue
        d = rng.choice(dims)
        box = Box(t.box.lo, t.box.hi[:d] + (t.box.hi[d] - 1,) + t.box.hi[d + 1:])
        nbytes = t.nbytes // t.box.numel * box.numel
        r = w[0]
        return _replaced("shrink_box", "coverage", plan, w, t._replace(box=box, nbytes=nbytes),
                         f"round {r}: {t} shrunk along dim {d} to {box}", (t.key, t.box))
    return None


def swap_kind(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Relabel one state kind of a transfer as another (exp_avg as exp_avg_sq, param as
    main_param, ...): one kind is never written, the other twice or where it is not held.

    Prefers a kind the destination holds in that slot and the transfer does not carry, of the
    same dtype; otherwise any per-parameter kind the destination has. Bytes follow the dtypes.
    """
    f = _facts(dst, src, dst)
    best: list[tuple[int, Where, str, str]] = []
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        if not set(t.kinds) <= set(PER_PARAM_KINDS):
            continue
        slot_kinds = f.held(t.dst_rank).get((t.key, t.dst_slot, t.dst_anchor), ())
        for old in t.kinds:
            for new in PER_PARAM_KINDS:
                if new in t.kinds or f.dtype(t.key, new) is None:
                    continue
                rank = (new in slot_kinds) * 2 + (f.dtype(t.key, new) == f.dtype(t.key, old))
                best.append((rank, w, old, new))
        if len(best) > 64:
            break
    if not best:
        return None
    top = max(b[0] for b in best)
    _, w, old, new = rng.choice([b for b in best if b[0] == top])
    t = _at(plan, w)
    kinds = tuple(new if k == old else k for k in t.kinds)
    nbytes = t.box.numel * _bytes_per_element(dst, t.key, kinds)
    return _replaced("swap_kind", "coverage", plan, w, t._replace(kinds=kinds, nbytes=nbytes),
                     f"round {w[0]}: {t} carries {new} instead of {old}", (t.key, t.box))


def wrong_device(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Address one message to another destination device than the one running its ranks
    (a wrong placement); each device's order follows the message."""
    cands = [(r, i) for r, rnd in enumerate(plan.rounds) for i in range(len(rnd.messages))]
    rng.shuffle(cands)
    for r, i in cands:
        rnd = plan.rounds[r]
        m = rnd.messages[i]
        taken = {x.dst_device for x in rnd.messages if x.src_device == m.src_device}
        others = [d for d in sorted(set(plan.dst_devices)) if d not in taken] or [
            d for d in sorted(set(plan.dst_devices)) if d != m.dst_device]
        if not others:
            continue
        new_dst = rng.choice(others)
        order = _order(rnd)
        if not m.local:
            order[m.dst_device] = [j for j in order[m.dst_device] if j != i]
        if new_dst != m.src_device:
            # Where one global order of the round puts it, so no cycle of waits is made.
            pos = _global_position(rnd)
            order[new_dst] = sorted(order.get(new_dst, []) + [i], key=pos.__getitem__)
        moved = Message(m.src_device, new_dst, m.transfers)
        new = _round(rnd.messages[:i] + (moved,) + rnd.messages[i + 1:], order)
        t = m.transfers[0]
        return Mutant("wrong_device", "coverage",
                      f"round {r}: message {i} ({m.src_device} -> {m.dst_device}) sent to "
                      f"{new_dst}", _with_rounds(plan, {r: new}), (t.key, t.box))
    return None


def _replaced(op: str, rule: str, plan: Plan, w: Where, t: Transfer, text: str,
              focus: tuple) -> Mutant:
    r, i, j = w
    rnd = plan.rounds[r]
    ts = rnd.messages[i].transfers
    new = _set_transfers(rnd, i, ts[:j] + (t,) + ts[j + 1:])
    return Mutant(op, rule, text, _with_rounds(plan, {r: new}), focus)


def swap_placement(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Swap the devices of two destination ranks that hold different state in the plan's
    placement table, leaving the messages addressed as before (a placement bug)."""
    f = _facts(dst, src, dst)
    pairs = [(a, b) for a in range(dst.world) for b in range(a + 1, dst.world)
             if plan.dst_devices[a] != plan.dst_devices[b] and f.held(a).keys() != f.held(b).keys()]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    first = next((t for m in plan.messages() for t in m.transfers if t.dst_rank in (a, b)), None)
    if first is None:
        return None
    devices = list(plan.dst_devices)
    devices[a], devices[b] = devices[b], devices[a]
    mutated = replace(plan, dst_devices=tuple(devices), stats=dict(plan.stats))
    return Mutant("swap_placement", "coverage",
                  f"destination ranks {a} and {b} swapped devices ({plan.dst_devices[a]}, "
                  f"{plan.dst_devices[b]}); messages still go to the old ones", mutated,
                  (first.key, first.box))


def false_derive(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Claim that the destination derives a state kind it does not (``Plan.derived``) and send
    none of it: the param when the destination spec has ``state.derive_param`` off, or an
    optimizer kind, which nothing can derive. That kind is then never written."""
    f = _facts(dst, src, dst)
    derive_param = dst.spec.state.derive_param
    sent = {k for m in plan.messages() for t in m.transfers for k in t.kinds}
    cands = [k for k in f.view.kinds if k not in plan.derived and k in sent
             and (k != "param" or not derive_param)]
    if not cands:
        return None
    kind = rng.choice(sorted(cands))
    rounds = {r: _strip_kind(rnd, kind, dst) for r, rnd in enumerate(plan.rounds)}
    mutated = replace(_with_rounds(plan, rounds), derived=tuple(sorted({*plan.derived, kind})))
    return Mutant("false_derive", "coverage",
                  f"plan claims the destination derives {kind} (state.derive_param="
                  f"{derive_param}) and sends none of it", mutated)


def _strip_kind(rnd: Round, kind: str, dst: Layout) -> Round:
    """The round without ``kind`` in any transfer (bytes follow; empty messages go)."""
    keep: list[Message] = []
    new_index: dict[int, int] = {}
    for i, m in enumerate(rnd.messages):
        ts = []
        for t in m.transfers:
            if kind in t.kinds:
                kinds = tuple(k for k in t.kinds if k != kind)
                if not kinds:
                    continue
                t = t._replace(kinds=kinds,
                               nbytes=t.box.numel * _bytes_per_element(dst, t.key, kinds))
            ts.append(t)
        if ts:
            new_index[i] = len(keep)
            keep.append(Message(m.src_device, m.dst_device, tuple(ts)))
    order = {d: [new_index[i] for i in ix if i in new_index] for d, ix in _order(rnd).items()}
    return _round(keep, order)


# ---- operators: source and expert ---------------------------------------------------------------

def _move_transfer(plan: Plan, w: Where, t: Transfer, src_device: str, dst_device: str) -> Plan:
    """The plan with transfer ``w`` replaced by ``t``, carried between the given devices in
    the same round (in their message, made if there is none)."""
    r, i, j = w
    rnd = _take_transfer(plan.rounds[r], i, j)
    return _with_rounds(plan, {r: _add_transfer(rnd, src_device, dst_device, t)})


def wrong_source(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Re-point a transfer at a source rank that does not hold its region for its kinds; it
    moves to a message from that rank's device."""
    f = _facts(src, src, dst)
    ranks = list(range(src.world))
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        rng.shuffle(ranks)
        for sr in ranks:
            if sr == t.src_rank or f.holds(sr, t.key, t.src_slot, t.src_anchor, t.kinds):
                continue
            moved = t._replace(src_rank=sr)
            m = plan.rounds[w[0]].messages[w[1]]
            mutated = _move_transfer(plan, w, moved, plan.src_devices[sr], m.dst_device)
            return Mutant("wrong_source", "source",
                          f"round {w[0]}: {t} read from source rank {sr} "
                          f"({plan.src_devices[sr]}), which does not hold {t.src_anchor} in "
                          f"{t.src_slot}", mutated, (t.key, t.box))
    return None


def expert_second_owner(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Redirect an expert-weight transfer to a destination rank of the same expert-data-
    parallel replica that does not own any of its elements (a second owner in that replica).
    Applies only to plans that move expert weights."""
    f = _facts(dst, src, dst)
    if not f.expert_keys:
        return None
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        if t.key not in f.expert_keys:
            continue
        edp = dst.coords(t.dst_rank).edp
        cands = [r for r in range(dst.world) if r != t.dst_rank and dst.coords(r).edp == edp
                 and not any(b & t.box for b in f.boxes(r, t.key))]
        if not cands:
            continue
        dr = rng.choice(cands)
        m = plan.rounds[w[0]].messages[w[1]]
        mutated = _move_transfer(plan, w, t._replace(dst_rank=dr), m.src_device,
                                 plan.dst_devices[dr])
        return Mutant("expert_second_owner", "expert",
                      f"round {w[0]}: {t} written to destination rank {dr} "
                      f"({plan.dst_devices[dr]}) of replica {edp}, which does not own it",
                      mutated, (t.key, t.box))
    return None


# ---- operators: deadlock ------------------------------------------------------------------------

def _reaches(edges: dict[int, set[int]], a: int, b: int) -> bool:
    seen, todo = {a}, [a]
    while todo:
        x = todo.pop()
        for y in edges.get(x, ()):
            if y == b:
                return True
            if y not in seen:
                seen.add(y)
                todo.append(y)
    return False


def reorder_cycle(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Edit one device's order within a round so that the devices' orders form a cycle of waits.

    Picks a device X running message ``a`` before ``b`` where the other devices' orders already
    force ``a`` before ``b`` (e.g. both are X<->Y messages and Y runs ``a`` first), and has X
    run ``b`` just before ``a``. Only ``Round.order`` changes. None if no round has such a pair.
    """
    rounds = list(range(len(plan.rounds)))
    rng.shuffle(rounds)
    for r in rounds:
        order = _order(plan.rounds[r])
        devs = sorted(order)
        rng.shuffle(devs)
        for x in devs:
            ix = order[x]
            if len(ix) < 2:
                continue
            edges: dict[int, set[int]] = {}
            for d, other in order.items():
                if d != x:
                    for u, v in zip(other, other[1:]):
                        edges.setdefault(u, set()).add(v)
            pairs = [(p, q) for p in range(len(ix)) for q in range(p + 1, len(ix))]
            rng.shuffle(pairs)
            for p, q in pairs:
                a, b = ix[p], ix[q]
                if not _reaches(edges, a, b):
                    continue
                new = ix[:p] + [b] + [k for k in ix[p:] if k != b]
                order[x] = new
                rnd = _round(plan.rounds[r].messages, order)
                ma, mb = rnd.messages[a], rnd.messages[b]
                return Mutant("reorder_cycle", "deadlock",
                              f"round {r}: {x} runs message {b} ({mb.src_device} -> "
                              f"{mb.dst_device}) before message {a} ({ma.src_device} -> "
                              f"{ma.dst_device}); its peers run them the other way",
                              _with_rounds(plan, {r: rnd}), (r, b))
    return None


def drop_from_order(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Remove one message from one of its devices' order: its peer waits forever."""
    cands = [(r, d, k) for r, rnd in enumerate(plan.rounds)
             for d, ix in sorted(rnd.device_order().items()) for k in range(len(ix))]
    if not cands:
        return None
    r, d, k = rng.choice(cands)
    order = _order(plan.rounds[r])
    i = order[d].pop(k)
    m = plan.rounds[r].messages[i]
    rnd = _round(plan.rounds[r].messages, order)
    return Mutant("drop_from_order", "deadlock",
                  f"round {r}: {d} never runs message {i} ({m.src_device} -> {m.dst_device})",
                  _with_rounds(plan, {r: rnd}), (r, i))


# ---- operators: memory --------------------------------------------------------------------------

def overflow_budget(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """Move a remote message into another round where its devices' staging then exceeds the
    budget; where no move does, declare a budget below the plan's real peak staging. None for
    plans that stage nothing (only local copies)."""
    staging = [_staging(rnd) for rnd in plan.rounds]
    remote = [(a, i) for a, rnd in enumerate(plan.rounds) for i, m in enumerate(rnd.messages)
              if not m.local]
    rng.shuffle(remote)
    for a, i in remote:
        m = plan.rounds[a].messages[i]
        # Spread plans fill every round alike: most messages fit wherever they go.
        over = [b for b, used in enumerate(staging) if b != a and max(
            used.get(m.src_device, 0), used.get(m.dst_device, 0)) + m.nbytes > plan.budget_bytes]
        if over:
            b = rng.choice(over)
            into, _ = _append_message(plan.rounds[b], m)
            mutated = _with_rounds(plan, {a: _remove_message(plan.rounds[a], i), b: into})
            return Mutant("overflow_budget", "memory",
                          f"message {i} of round {a} ({m.src_device} -> {m.dst_device}, "
                          f"{m.nbytes} bytes) moved into round {b}, over the budget of "
                          f"{plan.budget_bytes}", mutated, _over_budget(mutated))
    peak = max((n for used in staging for n in used.values()), default=0)
    if peak <= 0:
        return None
    budget = rng.randint(peak // 2, peak - 1)
    mutated = replace(plan, budget_bytes=budget, stats=dict(plan.stats))
    return Mutant("overflow_budget", "memory",
                  f"budget declared as {budget} bytes, below the peak staging of {peak}",
                  mutated, _over_budget(mutated))


def wrong_nbytes(plan: Plan, src: Layout, dst: Layout, rng: random.Random) -> Mutant | None:
    """One transfer declares a byte count that its box and dtypes do not give."""
    for w in _transfers(plan, rng):
        t = _at(plan, w)
        size = _bytes_per_element(dst, t.key, t.kinds)
        choices = {t.nbytes + size, t.nbytes - size, t.nbytes + 1, t.nbytes * 2, 0} - {t.nbytes}
        n = rng.choice(sorted(c for c in choices if c >= 0))
        return _replaced("wrong_nbytes", "memory", plan, w, t._replace(nbytes=n),
                         f"round {w[0]}: {t} declares {n} bytes instead of {t.nbytes}",
                         (t.key, t.box))
    return None


Operator = Callable[[Plan, Layout, Layout, random.Random], Mutant | None]

OPERATORS: dict[str, Operator] = {
    "drop_transfer": drop_transfer,
    "duplicate_transfer": duplicate_transfer,
    "wrong_source": wrong_source,
    "shift_box": shift_box,
    "shrink_box": shrink_box,
    "swap_kind": swap_kind,
    "wrong_device": wrong_device,
    "swap_placement": swap_placement,
    "false_derive": false_derive,
    "expert_second_owner": expert_second_owner,
    "reorder_cycle": reorder_cycle,
    "drop_from_order": drop_from_order,
    "overflow_budget": overflow_budget,
    "wrong_nbytes": wrong_nbytes,
}

# Operators that apply only to plans that move expert weights.
MOE_ONLY = ("expert_second_owner",)


def mutants(plan: Plan, src: Layout, dst: Layout, rng: random.Random, n: int) -> list[Mutant]:
    """Up to ``n`` mutants of ``plan``, drawing the operators round-robin.

    An operator that does not apply (returns None) leaves the rotation; fewer than ``n`` come
    back only when no operator applies. The result depends only on the arguments and ``rng``'s
    state.
    """
    active = list(OPERATORS.items())
    out: list[Mutant] = []
    while len(out) < n and active:
        for name, op in list(active):
            if len(out) >= n:
                break
            m = op(plan, src, dst, rng)
            if m is None:
                active.remove((name, op))
            else:
                out.append(m)
    return out
