"""Memory: per device and round, staging within the budget and live state within capacity.

A runtime posts a round's messages together, so a device stages every remote message it sends
or receives in that round at once (local copies go slot to slot and stage nothing). Bytes are
recomputed from each transfer's box and the tensors' dtypes, not read from the plan. Live state
is everything the device holds in the source layout plus everything it will hold in the
destination (source state is freed only after the switch commits), plus the ``reserve`` the
training job needs besides its state (activations, allocator cache, communicator buffers):
state alone would pass a device that the job has already filled.

Violations are summarised: at most one per kind (staging over the budget; live state over the
device memory), naming the worst device with its figures in one sentence and counting the rest,
so that an overflow on every device reads as one cause, not one line per device.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.errors import DynatrainError
from ..ir.state import StateView
from ..ir.units import MAX_BYTES, format_bytes
from ..planner.cost import Topology
from ..planner.plan import Plan
from .data import ITEMSIZE, Emit
from .report import Violation

MAX_DEVICES_LISTED = 8  # a violation's ``devices``: the worst first, then the next ones


def held_bytes(view: StateView, devices: tuple[str, ...]) -> dict[str, int]:
    """Bytes of state each device holds in a layout (per class part, computed once)."""
    tensors = view.tensors()
    sizes: dict[int, tuple[tuple, int]] = {}
    per_elem: dict[tuple[str, tuple[str, ...]], int] = {}  # bytes per element of (key, kinds)
    out: dict[str, int] = defaultdict(int)
    for rank, dev in enumerate(devices):
        for part in view.parts(rank):
            hit = sizes.get(id(part))
            if hit is None:
                n = 0
                for s in part:
                    e = per_elem.get((s.key, s.kinds))
                    if e is None:
                        e = per_elem[(s.key, s.kinds)] = sum(
                            ITEMSIZE.get(tensors[(s.key, k)].dtype, 8) for k in s.kinds)
                    n += s.box.numel * e
                hit = sizes[id(part)] = (part, n)
            out[dev] += hit[1]
    return out


def checked_reserve(reserve: object, topology: Topology | None) -> int:
    """``reserve`` as bytes, refused unless a whole number >= 0 with a capacity to count it in.

    A reserve without the topology's device memory would be silently ignored: refused instead.

    Raises:
        DynatrainError: naming ``reserve`` and the rule it breaks.
    """
    if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve < MAX_BYTES:
        raise DynatrainError(f"reserve: must be a whole number of bytes from 0 to below 1 EiB "
                             f"(got {reserve!r:.40})")
    if reserve and (topology is None or topology.memory_GB is None):
        raise DynatrainError(f"reserve: {format_bytes(reserve)} needs a device memory to count "
                             f"against, but the topology gives none (set memory_GB)")
    return reserve


def check_memory(plan: Plan, src: StateView, dst: StateView, rounds: list[dict[str, int]],
                 budget: int, capacity: int | None, emit: Emit,
                 reserve: int = 0) -> dict[str, int | str]:
    """Emit at most one violation for staging over ``budget`` and one for live state plus
    ``reserve`` over ``capacity``, each naming the worst device.

    ``rounds``: per round, the bytes each device stages (``data.check_data`` counts them from
    the transfers' boxes and dtypes). Returns the peak staging bytes and, when ``capacity`` is
    known, what the capacity check counted: ``peak_live_bytes`` (state plus staging on the
    fullest device), ``reserve_bytes``, ``capacity_bytes``, ``headroom_bytes`` (capacity minus
    both; negative when over) and ``fullest_device``.
    """
    _check_staging(rounds, budget, emit)
    out: dict[str, int | str] = {
        "peak_staging_bytes": max((n for u in rounds for n in u.values()), default=0)}
    if capacity is not None:
        out.update(_check_live(plan, src, dst, rounds, capacity, reserve, emit))
    return out


def _check_staging(rounds: list[dict[str, int]], budget: int, emit: Emit) -> None:
    over = [(n, r, dev) for r, used in enumerate(rounds) for dev, n in used.items() if n > budget]
    if not over:
        return
    # The most bytes first; ties to the earliest round, then the device name.
    over.sort(key=lambda x: (-x[0], x[1], x[2]))
    n, r, dev = over[0]
    stages, limit = _pair(n, budget)
    others = len(over) - 1
    more = (f" ({others} more (round, device) pair{'s' if others > 1 else ''} over)"
            if others else "")
    emit(Violation("memory", f"round {r}: {dev} stages {stages}, over the {limit} budget{more}",
                   devices=_listed(d for _, _, d in over), witness=(r, n, budget)))


def _check_live(plan: Plan, src: StateView, dst: StateView, rounds: list[dict[str, int]],
                capacity: int, reserve: int, emit: Emit) -> dict[str, int | str]:
    src_held = held_bytes(src, plan.src_devices)
    dst_held = held_bytes(dst, plan.dst_devices)
    staged: dict[str, tuple[int, int]] = {}  # device -> (most bytes it stages, in which round)
    for r, used in enumerate(rounds):
        for dev, n in used.items():
            if n > staged.get(dev, (0, 0))[0]:  # strictly more: the earliest round on ties
                staged[dev] = (n, r)
    live = {dev: src_held.get(dev, 0) + dst_held.get(dev, 0) + staged.get(dev, (0, 0))[0]
            for dev in set(src_held) | set(dst_held) | set(staged)}
    by_need = sorted(live, key=lambda d: (-live[d], d))
    fullest = by_need[0] if by_need else ""
    peak = live.get(fullest, 0)
    over = [d for d in by_need if live[d] + reserve > capacity]
    if over:
        emit(_over_capacity(over, src_held, dst_held, staged, capacity, reserve))
    return {"peak_live_bytes": peak, "reserve_bytes": reserve, "capacity_bytes": capacity,
            "headroom_bytes": capacity - peak - reserve, "fullest_device": fullest}


def _over_capacity(over: list[str], src_held: dict[str, int], dst_held: dict[str, int],
                   staged: dict[str, tuple[int, int]], capacity: int, reserve: int) -> Violation:
    """One sentence for every device over its memory: the worst one's sum, part by part."""
    dev = over[0]
    src_n, dst_n = src_held.get(dev, 0), dst_held.get(dev, 0)
    staged_n, r = staged.get(dev, (0, 0))
    need = src_n + dst_n + staged_n + reserve
    needs, has = _pair(need, capacity)
    parts = [f"source state {format_bytes(src_n)}", f"destination state {format_bytes(dst_n)}",
             f"staging {format_bytes(staged_n)}" + (f" in round {r}" if staged_n else "")]
    if reserve:
        parts.append(f"reserve {format_bytes(reserve)}")
    others = len(over) - 1
    more = (f"; {others} more device{'s are' if others > 1 else ' is'} over too"
            if others else "")
    fix = ("free memory, lower --reserve, or use a smaller --budget / more devices" if reserve
           else "use a smaller --budget or more devices")
    return Violation("memory", f"{dev} needs {needs} while switching ({' + '.join(parts)}) but "
                     f"has {has}{more} — {fix}",
                     devices=_listed(over), witness=(r, need, capacity))


def _pair(n: int, limit: int) -> tuple[str, str]:
    """``n`` and ``limit`` readable, in exact bytes where rounding would print them equal."""
    a, b = format_bytes(n), format_bytes(limit)
    return (a, b) if a != b else (f"{n} bytes", f"{limit} bytes")


def _listed(devices) -> tuple[str, ...]:
    """Distinct devices in the order given (the worst first), at most ``MAX_DEVICES_LISTED``."""
    return tuple(dict.fromkeys(devices))[:MAX_DEVICES_LISTED]
