"""A single-process numpy executor of plans: the oracle that plans are checked against.

``materialize`` builds every rank's local storage (module params, optimizer shards, buffers) of a
layout from global tensors, through the IR's regions. ``execute`` runs a plan's transfers from a
source storage into a fresh destination storage. A correct plan gives a destination storage equal,
bit for bit, to ``materialize`` of the destination layout from the same global tensors.
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.box import Box
from ..ir.slots import BufferSlot, FlatSlot, ParamSlot, Slot, members, slot_key
from ..ir.state import StateView, storage_tensors
from ..planner.plan import Plan

Storage = dict[tuple, np.ndarray]  # per rank: (kind, slot kind, chunk, name) -> array


def allocate(view: StateView, rank: int) -> Storage:
    """Zero-filled local storage of ``rank`` (padding stays zero, as Megatron fills it)."""
    return {k: np.zeros(shape, np.float32) for k, (shape, _) in storage_tensors(view, rank).items()}


def region(store: Storage, kind: str, slot: Slot, anchor: Box) -> np.ndarray:
    """A writable view of ``anchor`` inside the storage of ``slot``."""
    arr = store[slot_key(kind, slot)]
    if isinstance(slot, ParamSlot):
        local = anchor.shape[len(anchor.shape) - arr.ndim:]
        sl = tuple(slice(o, o + n) for o, n in zip(slot.local_offset, local))
        return arr[sl].reshape(anchor.shape)
    if isinstance(slot, FlatSlot):
        return arr[slot.offset:slot.offset + math.prod(anchor.shape)].reshape(anchor.shape)
    assert isinstance(slot, BufferSlot)
    return arr.reshape(anchor.shape)


def _within(box: Box, anchor: Box) -> tuple[slice, ...]:
    return tuple(slice(l - a, h - a) for l, h, a in zip(box.lo, box.hi, anchor.lo))


def materialize(view: StateView, tensors: dict[tuple[str, str], np.ndarray]) -> list[Storage]:
    """Every rank's storage for ``view``'s layout, filled from global ``tensors``."""
    out = []
    for rank in range(view.layout.world):
        store = allocate(view, rank)
        for reg in view.regions(rank):
            g = np.asarray(tensors[(reg.key, reg.kind)])
            sl = tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
            region(store, reg.kind, reg.slot, reg.box)[...] = g[sl]
        out.append(store)
    return out


def execute(plan: Plan, src: list[Storage], dst_view: StateView) -> list[Storage]:
    """Run ``plan`` round by round; returns the destination storages."""
    dst = [allocate(dst_view, r) for r in range(dst_view.layout.world)]
    # Round chunks of one region come back many times: its view is built once per side.
    views: dict[tuple, np.ndarray] = {}

    def view(side: list[Storage], tag: int, rank: int, kind: str, slot: Slot,
             anchor: Box) -> np.ndarray:
        k = (tag, rank, kind, slot, anchor)
        v = views.get(k)
        if v is None:
            v = views[k] = region(side[rank], kind, slot, anchor)
        return v

    for rnd in plan.rounds:
        for msg in rnd.messages:
            for t in msg.transfers:
                pairs = zip(members(t.src_slot, t.src_anchor, t.box),
                            members(t.dst_slot, t.dst_anchor, t.box), strict=True)
                for (s_slot, s_anchor, box), (d_slot, d_anchor, d_box) in pairs:
                    if d_box != box:
                        raise ValueError(f"{t}: source and destination members differ "
                                         f"({box} and {d_box})")
                    into, out = _within(box, d_anchor), _within(box, s_anchor)
                    for kind in t.kinds:
                        s = view(src, 0, t.src_rank, kind, s_slot, s_anchor)
                        view(dst, 1, t.dst_rank, kind, d_slot, d_anchor)[into] = s[out]
    if "param" in plan.derived:
        _derive_params(dst, dst_view)
    return dst


def _derive_params(dst: list[Storage], view: StateView) -> None:
    """Rebuild every param from the main params the destination's optimizers hold.

    The simulator keeps everything in float32, so the cast is the identity here; what it
    checks is that the main params cover every param element (the DP all-gather's sources).
    """
    main: dict[str, np.ndarray] = {}
    tensors = view.tensors()
    for rank, store in enumerate(dst):
        for reg in view.regions(rank):
            if reg.kind == "main_param":
                g = main.setdefault(reg.key, np.full(tensors[(reg.key, "main_param")].shape,
                                                     np.nan, np.float32))
                g[tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))] = region(
                    store, reg.kind, reg.slot, reg.box)
    for rank, store in enumerate(dst):
        for reg in view.regions(rank):
            if reg.kind == "param":
                sl = tuple(slice(l, h) for l, h in zip(reg.box.lo, reg.box.hi))
                region(store, "param", reg.slot, reg.box)[...] = main[reg.key][sl]
