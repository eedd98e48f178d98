"""The rules a plan document must follow to be read back (``serialize.plan_from_json``).

A plan file may be hand-edited or hostile. The reader checks every field for its exact JSON
type (an integer is a JSON integer: not a bool, a float or a string), its range, and the
invariants later code needs so that it cannot crash: ranks, slot and message indices in range,
boxes with ``lo <= hi`` and one rank per transfer, senders among the source devices. Whether the
plan is *right* (coverage, sources, deadlock, memory) is the verifier's business, not this one.

Every refusal is a ``PlanFormatError``: one line that names the path of the offending field and
the rule, e.g. ``malformed plan: plan.rounds[3][0].transfers[7][2]: box coordinate lo[1] must be
an integer (got 0.5)``. Hand-written validators rather than pydantic: the 235B plan has tens of
thousands of positional transfer records, and the reader checks them in one tight loop.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from ..ir.box import Box
from ..ir.errors import DynatrainError
from ..ir.slots import BufferSlot, FlatSlot, ParamSlot, Slot, StackSlot
from ..ir.state import OPTIMIZER_KINDS

MAX_INT = (1 << 63) - 1  # counts, coordinates and sizes all fit int64 (numpy, torch)
KINDS = frozenset({"param", *OPTIMIZER_KINDS, "buffer", "step"})
MAX_SUMMARY_DEPTH = 4  # statistics are plain data: a number, or a small record of numbers
TRANSFER_FIELDS = ("key", "kinds", "box", "src_rank", "dst_rank", "src_slot", "src_anchor",
                   "dst_slot", "dst_anchor", "nbytes")
_ABSENT = object()


class PlanFormatError(DynatrainError, ValueError):
    """A plan document is malformed: a field of the wrong type or range, or missing.

    Attributes:
        field: path of the offending field, e.g. ``plan.rounds[3][0].transfers[7][2]``.
        rule: the rule that was broken, in words.
        value: the offending value (absent for a missing field).
    """

    def __init__(self, field: str, rule: str, value: object = _ABSENT) -> None:
        self.field, self.rule = field, rule
        self.value = None if value is _ABSENT else value
        got = "" if value is _ABSENT else f" (got {describe(value)})"
        super().__init__(f"malformed plan: {field}: {rule}{got}")


def describe(value: object) -> str:
    """A short one-line description of any value, safe for huge or deeply nested ones."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is int:  # str() of a 5000-digit int raises; its size says enough
        return str(value) if abs(value) < 10**24 else f"an integer of {value.bit_length()} bits"
    if type(value) is float:
        return repr(value)
    if type(value) is str:
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if type(value) is list:
        return f"a list of {len(value)} item(s)"
    if type(value) is dict:
        return f"an object of {len(value)} key(s)"
    return f"a {type(value).__name__}"


def fail(field: str, rule: str, value: object = _ABSENT) -> NoReturn:
    raise PlanFormatError(field, rule, value)


def need_type(v: Any, t: type, field: str, what: str) -> Any:
    if type(v) is not t:
        fail(field, f"must be {what}", v)
    return v


def need_int(v: Any, field: str, name: str, lo: int = 0, hi: int = MAX_INT + 1) -> int:
    """``v`` as an int in ``[lo, hi)``: a JSON integer, not a bool, float or string."""
    if type(v) is not int:
        fail(field, f"{name} must be an integer", v)
    if not lo <= v < hi:
        top = "2**63" if hi == MAX_INT + 1 else str(hi)
        fail(field, f"{name} must be an integer in [{lo}, {top})", v)
    return v


def need_list(v: Any, field: str, what: str) -> list:
    return need_type(v, list, field, f"a list of {what}")


def strings(v: Any, field: str, what: str) -> tuple[str, ...]:
    need_list(v, field, what)
    for i, x in enumerate(v):
        need_type(x, str, f"{field}[{i}]", "a string")
    return tuple(v)


def devices(v: Any, field: str) -> tuple[str, ...]:
    """A non-empty list of distinct device names."""
    out = strings(v, field, "device names")
    if not out:
        fail(field, "must list at least one device")
    seen: set[str] = set()
    for i, d in enumerate(out):
        if d in seen:
            fail(f"{field}[{i}]", "lists a device twice; each device runs one rank", d)
        seen.add(d)
    return out


def kinds(v: Any, field: str, name: str = "kinds") -> tuple[str, ...]:
    """State kinds, each one of ``KINDS``."""
    need_list(v, field, "state kinds")
    for i, k in enumerate(v):
        if type(k) is not str or k not in KINDS:
            fail(f"{field}[{i}]", f"{name} must be one of {', '.join(sorted(KINDS))}", k)
    return tuple(v)


def box(v: Any, field: str, name: str = "box") -> Box:
    """``[lo, hi]``: two equally long lists of integers in [0, 2**63) with lo <= hi."""
    if type(v) is not list or len(v) != 2:
        fail(field, f"{name} must be a list [lo, hi] of two coordinate lists", v)
    lo, hi = v
    for side, c in (("lo", lo), ("hi", hi)):
        if type(c) is not list:
            fail(field, f"{name} {side} must be a list of integers", c)
    if len(lo) != len(hi):
        fail(field, f"{name} lo and hi must have one rank (got {len(lo)} and {len(hi)})")
    for i, (a, b) in enumerate(zip(lo, hi)):
        need_int(a, field, f"{name} coordinate lo[{i}]")
        need_int(b, field, f"{name} coordinate hi[{i}]")
        if a > b:
            fail(field, f"{name} must have lo <= hi in every dimension "
                        f"(got lo[{i}] = {a} > hi[{i}] = {b})")
    return Box(tuple(lo), tuple(hi))


def _chunk(v: Any, field: str) -> int:  # -1: no model chunk (the optimizer's step)
    return need_int(v, field, "a slot's chunk", -1)


def slot(v: Any, field: str) -> Slot:
    """One slot record: ``["param", chunk, name, local_offset]``, ``["flat", chunk, buffer,
    name, offset]``, ``["buffer", chunk, name]`` or ``["stack", axes, member, names]`` (member a
    param or flat slot: families do not nest)."""
    if type(v) is not list or not v or type(v[0]) is not str:
        fail(field, "a slot must be a list starting with its type (param, flat, buffer, stack)", v)
    size = {"param": 4, "flat": 5, "buffer": 3, "stack": 4}.get(v[0])
    if size is None:
        fail(f"{field}[0]", "unknown slot type; expected param, flat, buffer or stack", v[0])
    if len(v) != size:
        fail(field, f"a {v[0]} slot must be a list of {size} items", v)
    if v[0] == "param":
        chunk = _chunk(v[1], f"{field}[1]")
        name = need_type(v[2], str, f"{field}[2]", "a string (the name)")
        offset = need_list(v[3], f"{field}[3]", "integers (the local offset)")
        for i, x in enumerate(offset):
            need_int(x, f"{field}[3][{i}]", "a local offset")
        return ParamSlot(chunk, name, tuple(offset))
    if v[0] == "flat":
        return FlatSlot(_chunk(v[1], f"{field}[1]"),
                        need_int(v[2], f"{field}[2]", "a buffer index"),
                        need_type(v[3], str, f"{field}[3]", "a string (the name)"),
                        need_int(v[4], f"{field}[4]", "a flat offset"))
    if v[0] == "buffer":
        return BufferSlot(_chunk(v[1], f"{field}[1]"),
                          need_type(v[2], str, f"{field}[2]", "a string (the name)"))
    axes = need_int(v[1], f"{field}[1]", "a stack slot's axes", 1)
    # Only now look inside the member: a stack of stacks is refused without recursing.
    if type(v[2]) is not list or v[2][:1] not in (["param"], ["flat"]):
        fail(f"{field}[2]", "a stack slot's member must be a param or flat slot", v[2])
    member = slot(v[2], f"{field}[2]")
    names = strings(v[3], f"{field}[3]", "member names")
    if not names:
        fail(f"{field}[3]", "a stack slot must name at least one member")
    return StackSlot(member, axes, names)  # type: ignore[arg-type]


def key_field(field: str, key: str) -> str:
    """The path of ``key`` in the object at ``field``, one short printable line whatever the key."""
    if key.isidentifier() and len(key) <= 40:
        return f"{field}.{key}"
    return f"{field}[{describe(key)}]"


def summary(v: Any, field: str) -> dict[str, Any]:
    """Plan statistics: an object of JSON data (numbers finite), nested at most
    ``MAX_SUMMARY_DEPTH`` levels (e.g. ``summary.predicted_downtime.excludes[0]``).

    Walked with a stack, not recursion: a hostile document cannot exhaust Python's stack.
    """
    need_type(v, dict, field, "an object of statistics")
    todo: list[tuple[str, Any, int]] = [(field, v, 0)]
    while todo:
        at, x, depth = todo.pop()
        if type(x) is dict or type(x) is list:
            if depth > MAX_SUMMARY_DEPTH:
                fail(at, f"statistics nest at most {MAX_SUMMARY_DEPTH} levels deep", x)
            if type(x) is list:
                todo.extend((f"{at}[{i}]", y, depth + 1) for i, y in enumerate(x))
                continue
            for k, y in x.items():
                if type(k) is not str:
                    fail(at, "statistic names must be strings", k)
                todo.append((key_field(at, k), y, depth + 1))
        elif type(x) is float and not math.isfinite(x):
            fail(at, "must be a finite number", x)
        elif x is not None and type(x) not in (bool, int, float, str):
            fail(at, "must be JSON data (a number, string, boolean, null, list or object)", x)
    return dict(v)
