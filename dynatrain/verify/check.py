"""``verify(plan, src, dst)``: check a plan against both layouts before any byte moves.

Five rules (``report.RULES``), each recomputed from the layouts and the plan's own records:

1. coverage — every element of every destination region is written exactly once;
2. source — every transfer reads a region its sending device holds, of the same tensor, state
   kind and dtype, and no byte comes from a device the plan (or the caller) names failed;
3. expert — each expert element has one owner per expert-data-parallel replica in the
   destination, and no transfer writes expert state to a device that does not own it;
4. deadlock — the per-device message orders of every round admit one global order;
5. memory — staging per device and round within the budget, live state within capacity.

The checks are exact integer work (``tiling``: signed corner counts, linear in the boxes);
``lemmas`` proves with z3 the region arithmetic they and the planner rely on, for all sizes.
"""

from __future__ import annotations

import time

from ..ir.layout import Layout
from ..ir.state import transition_views
from ..planner.cost import Topology
from ..planner.gcpause import cycle_collector_paused
from ..planner.plan import Plan
from .data import Declared, check_data
from .memory import check_memory, checked_reserve
from .order import check_deadlock
from .ownership import check_expert_ownership
from .report import Collector, VerificationError, Violation, VerifyReport


def verify(plan: Plan, src: Layout, dst: Layout, topology: Topology | None = None,
           budget_bytes: int | None = None, limit: int = 50, *,
           reserve_bytes: int = 0, failed: frozenset[str] | None = None) -> VerifyReport:
    """Every violation of the five rules by ``plan`` moving ``src``'s state into ``dst``.

    ``dst`` may place its ranks on other devices than the plan does (``--place auto``): the
    plan's device list must then be a permutation of ``dst``'s. ``topology`` gives the device
    memory capacity (None: only the staging budget is checked). ``budget_bytes``: the staging
    budget the user asked for (default: the one the plan declares; a plan cannot raise it).
    At most ``limit`` violations are kept per rule; the report counts the rest.
    ``reserve_bytes``: device memory the training job needs besides its state (activations,
    allocator cache, communicator buffers), counted on every device against the capacity.
    ``failed``: source devices that died (None: those the plan declares in
    ``stats["failed"]``). A transfer from one breaks the source rule, a destination rank on
    one the coverage rule. State the plan declares lost (``stats["lost"]``, see
    ``planner.lost``) is left unwritten, but only if no surviving source device holds it.

    Raises:
        DynatrainError: ``reserve_bytes`` is not a whole number of bytes >= 0, or is given
            without a device memory to count it against.
    """
    if plan.stats.get("device"):  # one device's slice (planner.slices): its own rules
        from .slice import verify_slice
        return verify_slice(plan, src, dst, plan.stats["device"], budget_bytes, limit)
    reserve_bytes = checked_reserve(reserve_bytes, topology)
    declared = Declared.of(plan, failed)
    with cycle_collector_paused():
        return _verify(plan, src, dst, topology, budget_bytes, limit, reserve_bytes, declared)


def _verify(plan: Plan, src: Layout, dst: Layout, topology: Topology | None,
            budget_bytes: int | None, limit: int, reserve_bytes: int,
            declared: Declared) -> VerifyReport:
    t0 = time.perf_counter()
    found = Collector(limit)
    emit = found.emit

    sv, dv = transition_views(src, dst)
    checked: dict = {"rounds": len(plan.rounds)}
    if _devices_match(plan, src, dst, emit):
        checked["transfers"], staging = check_data(plan, sv, dv, emit, declared)
        checked["expert_replicas"] = check_expert_ownership(dv, plan.dst_devices, emit)
        capacity = None
        if topology is not None and topology.memory_GB is not None:
            capacity = int(topology.memory_GB * 1e9)
        budget = plan.budget_bytes if budget_bytes is None else budget_bytes
        checked.update(check_memory(plan, sv, dv, staging, budget, capacity, emit,
                                    reserve_bytes))
    check_deadlock(plan, emit)
    return found.report(checked, time.perf_counter() - t0)


def check(plan: Plan, src: Layout, dst: Layout, topology: Topology | None = None,
          budget_bytes: int | None = None, *, reserve_bytes: int = 0,
          failed: frozenset[str] | None = None) -> VerifyReport:
    """``verify``, raising ``VerificationError`` (with every violation) if any rule fails."""
    report = verify(plan, src, dst, topology, budget_bytes, reserve_bytes=reserve_bytes,
                    failed=failed)
    if not report.ok:
        raise VerificationError(report)
    return report


def _devices_match(plan: Plan, src: Layout, dst: Layout, emit) -> bool:
    """The plan runs on the layouts' devices: the source's as they are, the destination's in
    any one-to-one placement. Without that, no transfer can be checked."""
    ok = True
    if tuple(plan.src_devices) != tuple(src.devices):
        emit(Violation("source", f"the plan's source devices ({len(plan.src_devices)}) are not "
                       f"the source layout's ({len(src.devices)})",
                       devices=tuple(sorted(set(plan.src_devices) ^ set(src.devices)))[:8]))
        ok = False
    if sorted(plan.dst_devices) != sorted(dst.devices):
        emit(Violation("coverage", f"the plan's destination devices ({len(plan.dst_devices)}) "
                       f"are not a placement of the destination layout's ({len(dst.devices)})",
                       devices=tuple(sorted(set(plan.dst_devices) ^ set(dst.devices)))[:8]))
        ok = False
    return ok
