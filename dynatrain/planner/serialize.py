"""Plans to and from versioned JSON (plain data: no pickle, nothing executable)."""

from __future__ import annotations

from typing import Any

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.slots import BufferSlot, FlatSlot, ParamSlot, Slot, StackSlot
from .plan import Message, Plan, Round, Transfer

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


def _unslot(v: list) -> Slot:
    if v[0] == "param":
        return ParamSlot(int(v[1]), str(v[2]), tuple(int(x) for x in v[3]))
    if v[0] == "flat":
        return FlatSlot(int(v[1]), int(v[2]), str(v[3]), int(v[4]))
    if v[0] == "buffer":
        return BufferSlot(int(v[1]), str(v[2]))
    if v[0] == "stack":
        if not isinstance(v[2], list) or v[2][:1] not in (["param"], ["flat"]) or not (
                isinstance(v[3], list)):
            raise DynatrainError("plan: a stack slot's member must be a param or flat slot")
        return StackSlot(_unslot(v[2]), int(v[1]), tuple(str(n) for n in v[3]))
    raise DynatrainError(f"plan: unknown slot type {v[0]!r}")


def _box(b: Box) -> list:
    return [list(b.lo), list(b.hi)]


def _unbox(v: list) -> Box:
    return Box(tuple(int(x) for x in v[0]), tuple(int(x) for x in v[1]))


def plan_to_json(plan: Plan, src_spec: dict | None = None,
                 dst_spec: dict | None = None) -> dict[str, Any]:
    """A JSON-able document of ``plan`` (format ``dynatrain.plan/3``).

    Slots are listed once, in ``slots``, and transfers name them by index: a stacked slot
    carries the names of every layer and expert it stands for, and repeating them in each
    transfer made the 235B MoE plan's file 0.4 GB. ``src_spec``/``dst_spec`` (plain spec
    documents, the destination with the devices the plan placed it on) make the file
    self-contained: ``dynatrain verify`` needs nothing else.
    """
    slots: list[list] = []
    index: dict[Slot, int] = {}

    def slot_ref(sl: Slot) -> int:
        i = index.get(sl)
        if i is None:
            i = index[sl] = len(slots)
            slots.append(_slot(sl))
        return i

    doc: dict[str, Any] = {
        "format": FORMAT,
        "src": plan.src_name, "dst": plan.dst_name,
        "src_devices": list(plan.src_devices), "dst_devices": list(plan.dst_devices),
        "budget_bytes": plan.budget_bytes,
        "derived": list(plan.derived),
        "summary": dict(plan.stats),
        "order": [{d: list(ix) for d, ix in r.device_order().items()} for r in plan.rounds],
        "rounds": [[{
            "src_device": m.src_device, "dst_device": m.dst_device,
            "transfers": [[t.key, list(t.kinds), _box(t.box), t.src_rank, t.dst_rank,
                           slot_ref(t.src_slot), _box(t.src_anchor), slot_ref(t.dst_slot),
                           _box(t.dst_anchor), t.nbytes] for t in m.transfers],
        } for m in r.messages] for r in plan.rounds],
        "slots": slots,
    }
    if src_spec is not None:
        doc["src_spec"] = src_spec
    if dst_spec is not None:
        doc["dst_spec"] = dst_spec
    return doc


def plan_from_json(doc: dict[str, Any]) -> Plan:
    """Read a plan back; raises ``DynatrainError`` on a document of another format."""
    if not isinstance(doc, dict) or doc.get("format") not in READABLE:
        raise DynatrainError(f"plan: not a {FORMAT} document")
    try:
        orders = doc.get("order") or [{}] * len(doc["rounds"])
        if len(orders) != len(doc["rounds"]):
            raise ValueError(f"{len(orders)} orders for {len(doc['rounds'])} rounds")
        if doc["format"] == FORMAT:  # slots listed once, named by index
            table = [_unslot(v) for v in doc["slots"]]

            def unslot(v: Any) -> Slot:
                if type(v) is not int or not 0 <= v < len(table):  # bool is no index
                    raise ValueError(f"slot index {v!r} is not one of the {len(table)} slots")
                return table[v]
        else:  # /1 and /2 give each slot in place
            unslot = _unslot
        rounds = tuple(Round(tuple(Message(m["src_device"], m["dst_device"], tuple(
            Transfer(str(t[0]), tuple(t[1]), _unbox(t[2]), int(t[3]), int(t[4]), unslot(t[5]),
                     _unbox(t[6]), unslot(t[7]), _unbox(t[8]), int(t[9]))
            for t in m["transfers"])) for m in r),
            tuple((str(d), tuple(int(i) for i in ix)) for d, ix in sorted(o.items())))
            for r, o in zip(doc["rounds"], orders))
        plan = Plan(str(doc["src"]), str(doc["dst"]), tuple(doc["src_devices"]),
                    tuple(doc["dst_devices"]), rounds, int(doc["budget_bytes"]),
                    tuple(str(k) for k in doc.get("derived", ())))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise DynatrainError(f"plan: malformed document ({err.__class__.__name__}: {err})") from None
    plan.stats.update(doc.get("summary", {}))
    return plan
