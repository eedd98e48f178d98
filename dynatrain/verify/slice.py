"""Verify one device's slice of a plan (``planner.slices``): the rules of ``check.verify``
that concern that device, checked from its own messages.

Every rule of ``verify`` is about one device or one pair of devices, so the union of these
checks over all devices is the global verification:

- coverage: the device's destination regions are tiled exactly once by what it receives
  (every write to them comes from its own slice);
- source: everything it sends reads a region it holds, of the same tensor, kinds and dtype;
- memory: what it stages in each round fits the budget;
- deadlock: within each round it and each peer run what they share in the same order
  (the slice lists every message between them, so its own order check covers the pair).

Live device memory (state plus staging against the capacity) is not checked here.
"""

from __future__ import annotations

import time

from ..ir.layout import Layout
from ..ir.state import transition_views
from ..planner.plan import Plan
from .check import _devices_match
from .data import Declared, check_data
from .memory import check_memory
from .order import check_deadlock
from .report import Collector, Violation, VerifyReport


def verify_slice(plan: Plan, src: Layout, dst: Layout, device: str,
                 budget_bytes: int | None = None, limit: int = 50) -> VerifyReport:
    """Every violation, by ``device``'s slice ``plan``, of the rules that concern it."""
    t0 = time.perf_counter()
    found = Collector(limit)
    emit = found.emit

    sv, dv = transition_views(src, dst)
    checked: dict = {"rounds": len(plan.rounds), "device": device}
    for r, rnd in enumerate(plan.rounds):
        for m in rnd.messages:
            if device not in (m.src_device, m.dst_device):
                emit(Violation("source", f"round {r}: the slice of {device} holds a message "
                               f"{m.src_device} -> {m.dst_device} it takes no part in",
                               devices=(m.src_device, m.dst_device)))
    if _devices_match(plan, src, dst, emit):
        rank = plan.dst_devices.index(device) if device in plan.dst_devices else -1
        checked["transfers"], staging = check_data(plan, sv, dv, emit, Declared(),
                                                   only_rank=rank)
        mine = [{device: u.get(device, 0)} for u in staging]
        budget = plan.budget_bytes if budget_bytes is None else budget_bytes
        checked.update(check_memory(plan, sv, dv, mine, budget, None, emit))
    check_deadlock(plan, emit)
    return found.report(checked, time.perf_counter() - t0)
