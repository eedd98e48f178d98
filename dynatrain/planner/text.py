"""A plan as text a person can read: rounds, messages, and every transfer in them."""

from __future__ import annotations

from collections.abc import Iterator

from ..ir.box import Box
from ..ir.slots import BufferSlot, FlatSlot, ParamSlot, Slot, StackSlot, members
from .classes import each_round
from .plan import Plan


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def slot_text(slot: Slot, anchor: Box | None = None, box: Box | None = None) -> str:
    """Where a region sits in a rank's local storage, e.g. ``c0:decoder...weight@[0,16]``.

    With ``anchor`` (the box stored in the slot) and ``box`` inside it, the position is the
    box's own: its local offset, or its start in the flat optimizer shard.
    """
    if isinstance(slot, StackSlot):  # a family: its first member here, and how many
        if anchor is None or box is None:
            return f"{slot_text(slot.member)} (x{len(slot.names)})"
        ms = members(slot, anchor, box)
        return f"{slot_text(*ms[0])} (x{len(ms)})"
    rel = (tuple(b - a for a, b in zip(anchor.lo, box.lo))
           if anchor is not None and box is not None else None)
    if isinstance(slot, ParamSlot):
        at = list(slot.local_offset)
        if rel:
            at = [o + r for o, r in zip(at, rel[len(rel) - len(at):])]
        return f"c{slot.chunk}:{slot.name}@{at}"
    if isinstance(slot, FlatSlot):
        at = slot.offset
        if rel and anchor is not None:
            flat = 0
            for size, r in zip(anchor.shape, rel):
                flat = flat * size + r
            at += flat
        return f"c{slot.chunk}:optim[{slot.buffer}]:{slot.name}+{at}"
    assert isinstance(slot, BufferSlot)
    return f"c{slot.chunk}:{slot.name}"


def plan_to_text(plan: Plan, transfers: bool = True) -> str:
    """Every round and message of ``plan``; with ``transfers``, every transfer too."""
    return "".join(plan_text_lines(plan, transfers))


def plan_text_lines(plan: Plan, transfers: bool = True) -> Iterator[str]:
    """``plan_to_text`` a line at a time (each ending in a newline), for writing a plan with
    millions of transfers without holding its text."""
    yield (f"plan {plan.src_name} -> {plan.dst_name}, budget {_size(plan.budget_bytes)}"
           f", {len(plan.rounds)} round{'' if len(plan.rounds) == 1 else 's'}\n")
    if plan.derived:
        yield f"derived on the destination: {', '.join(plan.derived)}\n"
    for i, rnd in enumerate(each_round(plan.rounds)):  # a round's messages at a time
        yield f"round {i}: {len(rnd.messages)} messages\n"
        for m in rnd.messages:
            how = "local copy" if m.local else "send"
            yield (f"  {how} {m.src_device} -> {m.dst_device}: {_size(m.nbytes)}, "
                   f"{len(m.transfers)} transfers\n")
            if transfers:
                for t in m.transfers:
                    yield (f"    {t.key}{t.box} [{','.join(t.kinds)}] "
                           f"r{t.src_rank} {slot_text(t.src_slot, t.src_anchor, t.box)} -> "
                           f"r{t.dst_rank} {slot_text(t.dst_slot, t.dst_anchor, t.box)}  "
                           f"{_size(t.nbytes)}\n")
