"""A plan as text a person can read: rounds, messages, and every transfer in them."""

from __future__ import annotations

from ..ir.state import BufferSlot, FlatSlot, ParamSlot, Slot
from .plan import Plan


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def slot_text(slot: Slot) -> str:
    """Where a region sits in a rank's local storage, e.g. ``c0:decoder...weight@[0,16]``."""
    if isinstance(slot, ParamSlot):
        return f"c{slot.chunk}:{slot.name}@{list(slot.local_offset)}"
    if isinstance(slot, FlatSlot):
        return f"c{slot.chunk}:optim[{slot.buffer}]:{slot.name}+{slot.offset}"
    assert isinstance(slot, BufferSlot)
    return f"c{slot.chunk}:{slot.name}"


def plan_to_text(plan: Plan, transfers: bool = True) -> str:
    """Every round and message of ``plan``; with ``transfers``, every transfer too."""
    lines = [f"plan {plan.src_name} -> {plan.dst_name}, budget {_size(plan.budget_bytes)}"
             f", {len(plan.rounds)} rounds"]
    if plan.derived:
        lines.append(f"derived on the destination: {', '.join(plan.derived)}")
    for i, rnd in enumerate(plan.rounds):
        lines.append(f"round {i}: {len(rnd.messages)} messages")
        for m in rnd.messages:
            how = "local copy" if m.local else "send"
            lines.append(f"  {how} {m.src_device} -> {m.dst_device}: {_size(m.nbytes)}, "
                         f"{len(m.transfers)} transfers")
            if transfers:
                for t in m.transfers:
                    lines.append(f"    {t.key}{t.box} [{','.join(t.kinds)}] "
                                 f"r{t.src_rank} {slot_text(t.src_slot)} -> "
                                 f"r{t.dst_rank} {slot_text(t.dst_slot)}  {_size(t.nbytes)}")
    return "\n".join(lines) + "\n"
