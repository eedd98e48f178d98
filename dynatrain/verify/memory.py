"""Memory: per device and round, staging within the budget and live state within capacity.

A runtime posts a round's messages together, so a device stages every remote message it sends
or receives in that round at once (local copies go slot to slot and stage nothing). Bytes are
recomputed from each transfer's box and the tensors' dtypes, not read from the plan. Live state
is everything the device holds in the source layout plus everything it will hold in the
destination (source state is freed only after the switch commits).
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.state import StateView
from ..planner.plan import Plan
from .data import ITEMSIZE, Emit
from .report import Violation


def held_bytes(view: StateView, devices: tuple[str, ...]) -> dict[str, int]:
    """Bytes of state each device holds in a layout (per class part, computed once)."""
    tensors = view.tensors()
    sizes: dict[int, tuple[tuple, int]] = {}
    out: dict[str, int] = defaultdict(int)
    for rank, dev in enumerate(devices):
        for part in view.parts(rank):
            hit = sizes.get(id(part))
            if hit is None:
                n = sum(s.box.numel * ITEMSIZE.get(tensors[(s.key, k)].dtype, 8)
                        for s in part for k in s.kinds)
                hit = sizes[id(part)] = (part, n)
            out[dev] += hit[1]
    return out


def check_memory(plan: Plan, src: StateView, dst: StateView, rounds: list[dict[str, int]],
                 budget: int, capacity: int | None, emit: Emit) -> dict[str, int]:
    """Emit a violation per (round, device) over ``budget`` or the capacity.

    ``rounds``: per round, the bytes each device stages (``data.check_data`` counts them from
    the transfers' boxes and dtypes). Returns the peak staging and live bytes.
    """
    live: dict[str, int] = defaultdict(int)
    if capacity is not None:
        for part in (held_bytes(src, plan.src_devices), held_bytes(dst, plan.dst_devices)):
            for dev, n in part.items():
                live[dev] += n
    peak_staging = peak_live = 0
    for r, used in enumerate(rounds):
        for dev, n in sorted(used.items()):
            peak_staging = max(peak_staging, n)
            if n > budget:
                emit(Violation("memory", f"round {r}: {dev} stages {n} bytes, over the budget of "
                               f"{budget}", devices=(dev,), witness=(r, n, budget)))
    if capacity is not None:
        for dev in sorted(set(live) | {d for u in rounds for d in u}):
            n = live[dev] + max((u.get(dev, 0) for u in rounds), default=0)
            peak_live = max(peak_live, n)
            if n > capacity:
                r = max(range(len(rounds)), key=lambda i: rounds[i].get(dev, 0), default=0)
                emit(Violation("memory", f"round {r}: {dev} needs {n} bytes (source and "
                               f"destination state plus staging), over its {capacity} bytes",
                               devices=(dev,), witness=(r, n, capacity)))
    return {"peak_staging_bytes": peak_staging, "peak_live_bytes": peak_live}
