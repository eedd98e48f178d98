"""The planner's named pass pipeline: intersect -> pick_sources -> budget -> pairs -> agree_rounds ->
rounds (classes of pairs cut alike, ``classes.ClassRounds``; the plan's rounds are built from
them on first use).

``plan_transition(src, dst, budget_bytes)`` returns a ``Plan`` plus its summary numbers. Each pass
is a pure function of the previous pass's output; ``trace(name, value, seconds)`` sees each one.
The budget check bounds the rounds and messages from the transfers alone, so that a budget tiny
against the state is refused in the time the transfers took, not after cutting millions of pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..ir.layout import Layout
from ..ir.state import StateView, transition_views
from .cost import H100, Topology, lower_bound_seconds, predicted_seconds
from .gcpause import cycle_collector_paused
from .intersect import Intersection, PlanError, intersect
from .lost import StateLost, check_failed, lost_state
from .place import auto_place
from .plan import Plan
from .schedule import Demand, check_demand
from .sources import ReplicaIndex, pick_sources
from .classes import LazyRounds, class_rounds
from .spread import PairPhase, global_spread, pairs_by_device

Trace = Callable[[str, Any, float], None]


def check_compatible(src: StateView, dst: StateView) -> dict[tuple[str, str], str]:
    """Same logical tensors on both sides (padding aside); returns each tensor's dtype."""
    s, d = src.tensors(), dst.tensors()
    for tk, t in d.items():
        if tk not in s:
            raise PlanError(f"{tk[0]} [{tk[1]}]: the destination has it, the source does not "
                            "(are both specs the same model?)")
        if s[tk].shape != t.shape:
            raise PlanError(f"{tk[0]} [{tk[1]}]: shape {list(s[tk].shape)} in the source but "
                            f"{list(t.shape)} in the destination (are both specs the same model?)")
        if s[tk].dtype != t.dtype:
            raise PlanError(f"{tk[0]} [{tk[1]}]: dtype {s[tk].dtype} in the source but {t.dtype} "
                            "in the destination; dtype changes are not a layout switch")
    return {tk: t.dtype for tk, t in d.items()}


def plan_transition(src: Layout, dst: Layout, budget_bytes: int, topology: Topology = H100,
                    trace: Trace | None = None, place: str = "naive", *,
                    failed: frozenset[str] = frozenset(), allow_lost: bool = False) -> Plan:
    """Plan moving every piece of ``dst``'s state from where ``src`` holds it.

    ``place="auto"`` first reassigns ``dst``'s devices to its ranks (``planner.place``) and
    records what the naive placement would have cost in the stats (``naive_*``).

    ``failed``: source devices that died; they send nothing, and the destination must not use
    them. State only they held is lost: by default that raises ``StateLost`` with the exact
    report; ``allow_lost=True`` instead plans everything that survives and declares the lost
    state in ``plan.stats["lost"]`` (``LostState.to_json()``), for the caller to refill. A plan
    with failures records them in ``plan.stats["failed"]``, so ``verify`` checks that no byte
    comes from them.

    Raises:
        PlanError: the layouts are not the same model.
        DynatrainError: a failed device is not a source device, or the destination uses one.
        StateLost: some state the destination needs has no surviving copy (exit status 3).
        BudgetTooSmall (a PlanError): the budget cannot stage one element, or the plan would need
            more rounds or messages x rounds than ``schedule.MAX_ROUNDS`` and
            ``schedule.MAX_SCHEDULE_STEPS`` allow; it names the smallest budget that fits.
    """
    if budget_bytes <= 0:
        raise PlanError(f"--budget must be positive (got {budget_bytes})")
    if place not in ("naive", "auto"):
        raise PlanError(f"--place must be naive or auto (got {place!r})")
    failed_ranks = check_failed(frozenset(failed), src.devices, dst.devices) if failed else \
        frozenset()
    with cycle_collector_paused():
        return _plan(src, dst, budget_bytes, topology, trace, place, failed_ranks, allow_lost)


def _plan(src: Layout, dst: Layout, budget_bytes: int, topology: Topology, trace: Trace | None,
          place: str, failed: frozenset[int] = frozenset(), allow_lost: bool = False) -> Plan:
    t0 = time.perf_counter()
    sv, dv = transition_views(src, dst)
    dtypes = check_compatible(sv, dv)

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = fn()
        if trace:
            trace(name, out, time.perf_counter() - t)
        return out

    # The intersection is in rank terms, so it serves any placement of the same layout.
    derived = ("param",) if dst.spec.state.derive_param else ()
    inter = step("intersect", lambda: intersect(sv, dv, derived, failed))
    lost = None
    if failed:
        lost = lost_state(inter.lost, dtypes, (src.devices[r] for r in failed))
        if lost and not allow_lost:
            raise StateLost(lost)
    naive = None
    if place == "auto":
        naive = _schedule(inter, src, dst, dtypes, budget_bytes, topology, step)
        dst = step("place", lambda: auto_place(src, dst, inter, dtypes))
    plan = _schedule(inter, src, dst, dtypes, budget_bytes, topology, step)
    plan.stats["placement"] = place
    if naive is not None:
        plan.stats.update(naive_bytes_moved=naive.stats["bytes_moved"],
                          naive_predicted_seconds=naive.stats["predicted_seconds"])
    if lost is not None:
        plan.stats.update(failed=list(lost.failed), lost=lost.to_json())
    plan.stats["plan_seconds"] = time.perf_counter() - t0
    return plan


def replica_of(dst: Layout) -> ReplicaIndex:
    """A destination rank's replica index: its rank in the data-parallel-with-context group
    (``sources`` lays the replicas of one position over the holders)."""
    return ReplicaIndex(dst)


def _schedule(inter: Intersection, src: Layout, dst: Layout, dtypes: dict[tuple[str, str], str],
              budget_bytes: int, topology: Topology, step: Callable[[str, Callable[[], Any]], Any]
              ) -> Plan:
    """The passes after intersect, for one placement of ``dst``."""
    transfers, lower_bytes = step("pick_sources", lambda: pick_sources(
        inter, src.devices, dst.devices, dtypes, replica_of(dst)))
    pairs, local = step("pairs", lambda: pairs_by_device(transfers, src.devices, dst.devices,
                                                         PairPhase(src, dst)))
    # Before anything is cut; from the pairs, as grouping the transfers again costs a pass.
    step("budget", lambda: check_demand(Demand.of_pairs(pairs.values()), budget_bytes))
    unit, n = step("agree_rounds", lambda: global_spread(pairs, budget_bytes))
    body = step("rounds", lambda: class_rounds(pairs.values(), local, unit, n))
    # Rounds are built from the classes when first read; the statistics need only sizes.
    plan = Plan(src.spec.name or "src", dst.spec.name or "dst", src.devices, dst.devices,
                LazyRounds(body), budget_bytes,
                ("param",) if dst.spec.state.derive_param else (), classes=body)
    totals = body.sized.totals()  # millions of messages on the largest switches: numpy's sums
    plan.stats.update(
        bytes_moved=totals["bytes_moved"],
        bytes_lower_bound=lower_bytes,
        bytes_local=totals["bytes_local"],
        messages=totals["messages"],
        # Records of the plan, as its JSON, --text and `verify` count them; parts are what
        # pick_sources chose a sender for, before spread cut them into round chunks.
        transfers=totals["transfers"],
        parts=len(transfers),
        # Remote pairs of devices, and the classes of them cut alike (``classes``): the
        # global plan keeps each class's chunks once.
        pairs=sum(len(c.members) for c in body.classes),
        pair_classes=len(body.classes),
        rounds=n,
        peak_staging_bytes=plan.link_table.staging_peak(),
        budget_bytes=budget_bytes,
        spread=[unit, n],  # what a device's slice needs besides the layouts (``slices``)
        predicted_seconds=predicted_seconds(plan, topology),
        lower_bound_seconds=lower_bound_seconds(plan, topology),
        topology=topology.name,
    )
    return plan
