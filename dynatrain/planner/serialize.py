"""Plans to and from versioned JSON (plain data: no pickle, nothing executable)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from operator import le
from typing import Any, NoReturn, TextIO

from ..ir.box import Box
from ..ir.slots import FlatSlot, ParamSlot, Slot, StackSlot
from ..ir.units import MAX_BYTES
from . import plan_schema as schema
from .classes import ClassRounds, LazyRounds, device_orders, each_round
from .gcpause import cycle_collector_paused
from .plan import Message, Plan, Round, Transfer
from .plan_schema import MAX_INT, TRANSFER_FIELDS, fail

FORMAT = "dynatrain.plan/3"
# /1 had no per-device order (read as the message order) and no embedded specs; /2 no
# stacked (expert family) slots. Older documents read as they are.
READABLE = ("dynatrain.plan/1", "dynatrain.plan/2", FORMAT)


def _slot(s: Slot) -> list:
    if isinstance(s, StackSlot):
        return ["stack", s.axes, _slot(s.member), list(s.names)]
    if isinstance(s, ParamSlot):
        return ["param", s.chunk, s.name, list(s.local_offset)]
    if isinstance(s, FlatSlot):
        return ["flat", s.chunk, s.buffer, s.name, s.offset]
    return ["buffer", s.chunk, s.name]


def _box(b: Box) -> list:
    return [list(b.lo), list(b.hi)]


def _message_doc(m: Message, slot_ref) -> dict[str, Any]:
    return {"src_device": m.src_device, "dst_device": m.dst_device,
            "transfers": [[t.key, list(t.kinds), _box(t.box), t.src_rank, t.dst_rank,
                           slot_ref(t.src_slot), _box(t.src_anchor), slot_ref(t.dst_slot),
                           _box(t.dst_anchor), t.nbytes] for t in m.transfers]}


class _SlotTable:
    """Slots listed once, in order of first use; transfers name them by index."""

    def __init__(self) -> None:
        self.slots: list[list] = []
        self.index: dict[Slot, int] = {}
        # By identity first: a plan's transfers share a few slot objects, and a lookup by
        # value hashes a slot's fields and compares them on every hit (1M comparisons
        # writing the 24576-GPU plan).
        self.by_id: dict[int, tuple[Slot, int]] = {}

    def __call__(self, sl: Slot) -> int:
        hit = self.by_id.get(id(sl))
        if hit is not None and hit[0] is sl:
            return hit[1]
        i = self.index.get(sl)
        if i is None:
            i = self.index[sl] = len(self.slots)
            self.slots.append(_slot(sl))
        self.by_id[id(sl)] = (sl, i)  # the entry keeps ``sl`` alive, so its id stays its own
        return i


def _head(plan: Plan) -> dict[str, Any]:
    return {"format": FORMAT,
            "src": plan.src_name, "dst": plan.dst_name,
            "src_devices": list(plan.src_devices), "dst_devices": list(plan.dst_devices),
            "budget_bytes": plan.budget_bytes,
            "derived": list(plan.derived),
            "summary": dict(plan.stats),
            "order": [{d: list(ix) for d, ix in o.items()} for o in device_orders(plan.rounds)]}


def plan_to_json(plan: Plan, src_spec: dict | None = None,
                 dst_spec: dict | None = None) -> dict[str, Any]:
    """A JSON-able document of ``plan`` (format ``dynatrain.plan/3``).

    Slots are listed once, in ``slots``, and transfers name them by index: a stacked slot
    carries the names of every layer and expert it stands for, and repeating them in each
    transfer made the 235B MoE plan's file 0.4 GB. ``src_spec``/``dst_spec`` (plain spec
    documents, the destination with the devices the plan placed it on) make the file
    self-contained: ``dynatrain verify`` needs nothing else.
    """
    table = _SlotTable()
    doc = _head(plan)
    with cycle_collector_paused():
        doc["rounds"] = [[_message_doc(m, table) for m in r.messages] for r in plan.rounds]
    doc["slots"] = table.slots
    if src_spec is not None:
        doc["src_spec"] = src_spec
    if dst_spec is not None:
        doc["dst_spec"] = dst_spec
    return doc


class _TransferText:
    """``_message_doc`` encoded straight to its compact JSON text (the same characters as
    ``json.dumps``: keys, kinds and devices through it, memoized; integers as ``str``; a
    box's text memoized per object, since a region's anchor repeats in every transfer cut
    from it). Building the lists and encoding them took longer than planning."""

    def __init__(self, table: _SlotTable, enc) -> None:
        self.table, self.enc = table, enc
        self.strings: dict[object, str] = {}
        self.boxes: dict[int, tuple[Box, str]] = {}

    def _s(self, x: object) -> str:
        t = self.strings.get(x)
        if t is None:
            t = self.strings[x] = self.enc(list(x) if isinstance(x, tuple) else x)
        return t

    def _box(self, b: Box) -> str:
        hit = self.boxes.get(id(b))
        if hit is None or hit[0] is not b:  # the entry keeps ``b`` alive: its id stays its
            text = f"[[{_ints(b.lo)}],[{_ints(b.hi)}]]"
            if len(self.boxes) > 1 << 16:  # anchors repeat nearby; bound the memo
                self.boxes.clear()
            self.boxes[id(b)] = (b, text)
            return text
        return hit[1]

    def message(self, m: Message) -> str:
        s, ref = self._s, self.table
        ts = ",".join([
            f"[{s(t.key)},{s(t.kinds)},[[{_ints(t.box.lo)}],"
            f"[{_ints(t.box.hi)}]],{t.src_rank},{t.dst_rank},{ref(t.src_slot)},"
            f"{self._box(t.src_anchor)},{ref(t.dst_slot)},{self._box(t.dst_anchor)},{t.nbytes}]"
            for t in m.transfers])
        return (f'{{"src_device":{s(m.src_device)},"dst_device":{s(m.dst_device)},'
                f'"transfers":[{ts}]}}')

    def class_round(self, body: ClassRounds, i: int) -> Iterator[str]:
        """``message`` of each message of ``body.round(i)``, in its order, without building
        them: every member of a class sends the same chunk but for its two ranks, so the
        chunk's text is made once, as the pieces between the ranks (slots get their numbers
        there, at the class's first message, as ``message`` would give them), and each
        member's text is its ranks joined between those pieces."""
        s = self._s
        pieces: dict[int, list[str]] = {}
        for src, dst, k, m in body.message_ends(i):
            if k < 0:
                yield self.message(Message(src, dst, m))
                continue
            between = pieces.get(k)
            if between is None:
                between = pieces[k] = self._between_ranks(body.classes[k].chunks[i])
            yield (f'{{"src_device":{s(src)},"dst_device":{s(dst)},"transfers":['
                   f'{f"{m.src_rank},{m.dst_rank}".join(between)}]}}')

    def _between_ranks(self, ts: tuple[Transfer, ...]) -> list[str]:
        """The text of ``ts`` (one pair's transfers) cut at each transfer's two ranks."""
        s, ref, box = self._s, self.table, self._box
        out, before = [], "["
        # The pieces of one part follow each other and share its four region objects: the
        # text of those (and of the key and kinds) is made once per run of them.
        key = kinds = ss = sa = ds = da = None
        head = mid = ""
        for t in ts:
            if t[0] is not key or t[1] is not kinds:
                key, kinds = t[0], t[1]
                head = f"{s(key)},{s(kinds)},[["
            if not (t[6] is sa and t[5] is ss and t[8] is da and t[7] is ds):
                ss, sa, ds, da = t[5], t[6], t[7], t[8]
                mid = f",{ref(ss)},{box(sa)},{ref(ds)},{box(da)},"
            b = t[2]
            out.append(f"{before}{head}{_ints(b.lo)}],[{_ints(b.hi)}]],")
            before = f"{mid}{t[9]}],["
        out.append(before[:-2])
        return out


# "%d,%d,%d" per length: one C call per tuple of ints, half the time of joining str()s
_INT_FORMATS = tuple(",".join(["%d"] * n) for n in range(17))


def _ints(t: tuple[int, ...]) -> str:
    """``t`` as the inside of its compact JSON list (``json.dumps``'s text of each int)."""
    return _INT_FORMATS[len(t)] % t if len(t) < len(_INT_FORMATS) else ",".join(map(str, t))


STREAM_BATCH = 1024  # messages encoded per json.dumps call while streaming


def write_plan_json(plan: Plan, out: TextIO, src_spec: dict | None = None,
                    dst_spec: dict | None = None) -> None:
    """Write ``plan_to_json(plan, src_spec, dst_spec)`` to ``out`` as compact JSON (the same
    bytes as ``json.dump(..., separators=(",", ":"))``), a batch of messages at a time: the
    whole document of a plan with millions of transfers is never held in memory."""
    with cycle_collector_paused():  # millions of short-lived acyclic lists
        _write_plan_json(plan, out, src_spec, dst_spec)


def _write_plan_json(plan: Plan, out: TextIO, src_spec: dict | None,
                     dst_spec: dict | None) -> None:
    def enc(x: Any) -> str:
        return json.dumps(x, separators=(",", ":"))

    table = _SlotTable()
    head = _head(plan)
    text = _TransferText(table, enc)
    out.write("{" + ",".join(f"{enc(k)}:{enc(v)}" for k, v in head.items()) + ',"rounds":[')
    body = plan.rounds.body if isinstance(plan.rounds, LazyRounds) else None
    classes = body is not None
    for i, r in enumerate(range(len(plan.rounds)) if classes else each_round(plan.rounds)):
        # a round's messages at a time; a plan kept as classes, straight from them
        texts = text.class_round(body, i) if classes else map(text.message, r.messages)
        out.write(",[" if i else "[")
        for j, batch in enumerate(iter(lambda: list(islice(texts, STREAM_BATCH)), [])):
            out.write(("," if j else "") + ",".join(batch))
        out.write("]")
    out.write('],"slots":' + enc(table.slots))
    for key, spec in (("src_spec", src_spec), ("dst_spec", dst_spec)):
        if spec is not None:
            out.write(f",{enc(key)}:{enc(spec)}")
    out.write("}")


def plan_from_json(doc: Any) -> Plan:
    """Read a plan back from its JSON document (any of ``READABLE``), checking it strictly.

    Every field must have its exact JSON type and range (``plan_schema``); the reader also
    guarantees what later code relies on to not crash (ranks, slot and message indices in
    range, boxes of one rank with lo <= hi, senders among the source devices, receivers among
    the destination's). Unknown keys are refused, not ignored: a misspelt ``budget_byte`` would
    otherwise silently fall back to nothing. ``derived``, ``summary`` and the embedded specs may
    be left out. ``order`` is required from /2 on (an empty list: every round in message
    order), ``slots`` in /3; /1 has neither.

    Raises:
        PlanFormatError: naming the path of the first offending field and the rule.
    """
    if type(doc) is not dict:
        fail("plan", f"must be a JSON object (a {FORMAT} document)", doc)
    if "format" not in doc:
        fail("plan.format", f"is missing; a plan document names its format ({FORMAT})")
    fmt = doc["format"]
    if type(fmt) is not str or fmt not in READABLE:
        fail("plan.format", f"must be one of {', '.join(READABLE)}; not a {FORMAT} document",
             fmt)
    _check_keys(doc, fmt)
    src_name = schema.need_type(doc["src"], str, "plan.src", "a string (the source's name)")
    dst_name = schema.need_type(doc["dst"], str, "plan.dst", "a string (the destination's name)")
    src_devices = schema.devices(doc["src_devices"], "plan.src_devices")
    dst_devices = schema.devices(doc["dst_devices"], "plan.dst_devices")
    budget = schema.need_int(doc["budget_bytes"], "plan.budget_bytes", "budget_bytes", 1,
                             MAX_BYTES)
    derived = schema.kinds(doc.get("derived", []), "plan.derived", "a derived kind")
    stats = schema.summary(doc.get("summary", {}), "plan.summary")
    rounds = schema.need_list(doc["rounds"], "plan.rounds", "rounds")
    if fmt == "dynatrain.plan/1":  # no per-device order: each round runs in message order
        orders: list = [{}] * len(rounds)
    else:
        orders = schema.need_list(doc["order"], "plan.order", "per-device orders, one per round")
        if not orders:  # as in /1: every round runs in message order
            orders = [{}] * len(rounds)
        elif len(orders) != len(rounds):
            fail("plan.order", f"must give one per-device order per round ({len(rounds)}), or "
                               "none (every round in message order)", orders)
    table = None
    if fmt == FORMAT:  # slots listed once, named by index
        table = [schema.slot(v, f"plan.slots[{i}]")
                 for i, v in enumerate(schema.need_list(doc["slots"], "plan.slots", "slots"))]
    reader = _Reader(src_devices, dst_devices, table)
    with cycle_collector_paused():  # tens of thousands of acyclic records: nothing to collect
        read = tuple(reader.round(r, o, i) for i, (r, o) in enumerate(zip(rounds, orders)))
    plan = Plan(src_name, dst_name, src_devices, dst_devices, read, budget, derived)
    plan.stats.update(stats)
    plan.stats.update(_recounted(plan, stats))
    return plan


def _recounted(plan: Plan, stats: dict[str, Any]) -> dict[str, int]:
    """The summary's counts that the plan read gives, recounted from it (where the summary
    has them): a hand-edited summary must not tell a reader (``load_plan(...).stats``)
    numbers the plan does not have, and an edited plan is judged by the verifier, not
    refused for a summary it did not update."""
    remote = local = messages = transfers = 0
    for rnd in plan.rounds:
        for m in rnd.messages:
            transfers += len(m.transfers)
            if m.local:
                local += m.nbytes
            else:
                remote += m.nbytes
                messages += 1
    counted = {"rounds": len(plan.rounds), "budget_bytes": plan.budget_bytes,
               "messages": messages, "transfers": transfers, "bytes_moved": remote,
               "bytes_local": local}
    return {k: v for k, v in counted.items() if k in stats}


_KEYS = ("format", "src", "dst", "src_devices", "dst_devices", "budget_bytes", "derived",
         "summary", "order", "rounds", "slots", "src_spec", "dst_spec")
_OPTIONAL = {"derived", "summary", "src_spec", "dst_spec"}
_NOT_IN = {"dynatrain.plan/1": {"order", "slots"}, "dynatrain.plan/2": {"slots"}, FORMAT: set()}


def _check_keys(doc: dict, fmt: str) -> None:
    known = [k for k in _KEYS if k not in _NOT_IN[fmt]]
    for k in doc:
        if k not in known:
            fail("plan", f"unknown key for {fmt}; the keys are {', '.join(known)}", k)
    for k in known:
        if k not in doc and k not in _OPTIONAL:
            fail(f"plan.{k}", f"is missing; a {fmt} document needs it")
    for side in ("src_spec", "dst_spec"):  # read by ``dynatrain verify`` (spec_from_dict)
        if side in doc and type(doc[side]) is not dict:
            fail(f"plan.{side}", "must be an object (a layout spec document)", doc[side])


class _Reader:
    """Builds rounds out of JSON, checking each record; boxes and kind tuples are interned.

    The loop over transfers is the reader's whole cost (the 235B plan has ~67k): each record is
    checked with type tests and C-level ``map``s only, and only one that fails them is walked
    field by field to say where and why. Interning equal boxes also lets the verifier's
    per-region memo (keyed by identity) hit across transfers cut from one region.
    """

    def __init__(self, src_devices: tuple[str, ...], dst_devices: tuple[str, ...],
                 table: list[Slot] | None) -> None:
        self.src_devices, self.dst_devices = src_devices, dst_devices
        self.src_set, self.dst_set = frozenset(src_devices), frozenset(dst_devices)
        self.table = table
        self.boxes: dict[tuple[int, ...], Box] = {}
        self.kinds: dict[tuple, tuple[str, ...]] = {}
        self.inline: dict[int, Slot] = {}  # /1 and /2: the slot of each record, by identity

    def round(self, r: Any, order: Any, i: int) -> Round:
        field = f"plan.rounds[{i}]"
        schema.need_list(r, field, "messages")
        messages = tuple(self.message(m, f"{field}[{j}]") for j, m in enumerate(r))
        return Round(messages, self.order(order, f"plan.order[{i}]", len(messages)))

    def message(self, m: Any, field: str) -> Message:
        schema.need_type(m, dict, field, "an object {src_device, dst_device, transfers}")
        for k in m:
            if k not in ("src_device", "dst_device", "transfers"):
                fail(field, "unknown message key; the keys are src_device, dst_device, transfers",
                     k)
        for k in ("src_device", "dst_device", "transfers"):
            if k not in m:
                fail(f"{field}.{k}", "is missing; every message needs it")
        src, dst = m["src_device"], m["dst_device"]
        if type(src) is not str or src not in self.src_set:
            fail(f"{field}.src_device", "must be one of plan.src_devices", src)
        if type(dst) is not str or dst not in self.dst_set:
            fail(f"{field}.dst_device", "must be one of plan.dst_devices", dst)
        transfers = schema.need_list(m["transfers"], f"{field}.transfers", "transfers")
        fast = self.transfer
        out = []
        for t in transfers:
            x = fast(t)
            if x is None:
                self.explain(t, f"{field}.transfers[{len(out)}]")
            out.append(x)
        return Message(src, dst, tuple(out))

    def transfer(self, t: Any) -> Transfer | None:
        """The transfer a record stands for, or None if any check fails (``explain`` says
        which). Must refuse whatever ``explain`` refuses.

        One ``set(map(type, ...))`` over every integer of the record checks them all at C
        speed; equal boxes and kind lists are built once.
        """
        if type(t) is not list or len(t) != 10:
            return None
        key, kinds, box, sr, dr, ss, sa, ds, da, nb = t
        try:  # unpacking a non-pair, or hashing a list among the kinds: refused
            (bl, bh), (al, ah), (dl, dh) = box, sa, da
            if {type(box), type(sa), type(da), type(bl), type(bh), type(al), type(ah),
                    type(dl), type(dh), type(kinds)} != _LIST:
                return None
            n = len(bl)
            if not n == len(bh) == len(al) == len(ah) == len(dl) == len(dh):
                return None
            kb, ka, kd = (*bl, *bh), (*al, *ah), (*dl, *dh)
            ints = (*kb, *ka, *kd, sr, dr, nb)
            if set(map(type, ints)) != _INT or type(key) is not str:
                return None
            k = self.kinds.get(tuple(kinds))
        except (TypeError, ValueError):
            return None
        if (min(ints) < 0 or max(ints) > MAX_INT or sr >= len(self.src_devices)
                or dr >= len(self.dst_devices) or not all(map(le, kb[:n], kb[n:]))
                or not all(map(le, ka[:n], ka[n:])) or not all(map(le, kd[:n], kd[n:]))):
            return None
        if k is None and (k := self._kinds(kinds)) is None:
            return None
        table = self.table
        if table is not None:  # bool is no index
            if type(ss) is not int or type(ds) is not int or not (
                    0 <= ss < len(table) and 0 <= ds < len(table)):
                return None
            s_slot, d_slot = table[ss], table[ds]
        else:  # /1 and /2 give each slot in place
            s_slot, d_slot = self._inline_slot(ss), self._inline_slot(ds)
            if s_slot is None or d_slot is None:
                return None
        boxes = self.boxes
        b = boxes.get(kb) or boxes.setdefault(kb, Box(tuple(bl), tuple(bh)))
        a = boxes.get(ka) or boxes.setdefault(ka, Box(tuple(al), tuple(ah)))
        d = boxes.get(kd) or boxes.setdefault(kd, Box(tuple(dl), tuple(dh)))
        return Transfer(key, k, b, sr, dr, s_slot, a, d_slot, d, nb)

    def _kinds(self, kinds: list) -> tuple[str, ...] | None:
        if not kinds or not all(type(x) is str and x in schema.KINDS for x in kinds):
            return None
        k = self.kinds[tuple(kinds)] = tuple(kinds)
        return k

    def _inline_slot(self, v: Any) -> Slot | None:
        s = self.inline.get(id(v))
        if s is None:
            try:
                s = schema.slot(v, "")
            except schema.PlanFormatError:
                return None
            self.inline[id(v)] = s  # ``v`` lives in the document: its id stays unique
        return s

    def explain(self, t: Any, field: str) -> NoReturn:
        """Raise for the first field of record ``t`` that breaks a rule."""
        if type(t) is not list or len(t) != 10:
            fail(field, f"a transfer must be a list of 10 fields [{', '.join(TRANSFER_FIELDS)}]",
                 t)
        schema.need_type(t[0], str, f"{field}[0]", "a string (the tensor's key)")
        if not schema.kinds(t[1], f"{field}[1]"):
            fail(f"{field}[1]", "kinds must list at least one state kind", t[1])
        boxes = [schema.box(t[i], f"{field}[{i}]", TRANSFER_FIELDS[i]) for i in (2, 6, 8)]
        schema.need_int(t[3], f"{field}[3]", "src_rank", 0, len(self.src_devices))
        schema.need_int(t[4], f"{field}[4]", "dst_rank", 0, len(self.dst_devices))
        for i in (5, 7):
            if self.table is not None:
                if type(t[i]) is not int or not 0 <= t[i] < len(self.table):
                    fail(f"{field}[{i}]", f"{TRANSFER_FIELDS[i]} is a malformed slot reference: "
                         f"must be an index into plan.slots, in [0, {len(self.table)})", t[i])
            else:
                schema.slot(t[i], f"{field}[{i}]")
        schema.need_int(t[9], f"{field}[9]", "nbytes")
        ranks = [len(b.lo) for b in boxes]
        if len(set(ranks)) != 1:
            fail(field, "box, src_anchor and dst_anchor must have one rank (they are regions of "
                        f"one tensor; got {ranks[0]}, {ranks[1]} and {ranks[2]})")
        fail(field, "is not a well-formed transfer")  # unreachable while both agree

    def order(self, o: Any, field: str, n: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Per device, indices of the round's ``n`` messages."""
        schema.need_type(o, dict, field, "an object of device -> message indices")
        for d in o:
            if type(d) is not str:
                fail(field, "device names must be strings", d)
        out = []
        for d, ix in sorted(o.items()):
            schema.need_list(ix, schema.key_field(field, d), "message indices")
            if not set(map(type, ix)) <= _INT or ix and not (min(ix) >= 0 and max(ix) < n):
                for j, i in enumerate(ix):
                    schema.need_int(i, f"{schema.key_field(field, d)}[{j}]", "a message index",
                                    0, n)
            out.append((d, tuple(ix)))
        return tuple(out)


_INT = {int}
_LIST = {list}
