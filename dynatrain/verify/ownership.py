"""Unique expert ownership in a layout: within each expert-data-parallel replica, every element
of every expert weight is held by exactly one rank.

An EDP replica is the set of ranks with one expert-data-parallel coordinate: between them, the
pipeline, expert-parallel and expert-tensor-parallel ranks must hold each (layer, expert) once.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.box import Box
from ..ir.state import StateView
from .data import Emit, expert_keys
from .report import Violation
from ..ir.tiling import tiling_fault


def check_expert_ownership(view: StateView, devices: tuple[str, ...], emit: Emit) -> int:
    """Emit a violation per expert weight not held exactly once in some replica.

    Returns the number of (replica, expert weight) pairs checked.
    """
    L = view.layout
    experts = expert_keys(view)
    if not experts:
        return 0
    replicas: dict[int, list[int]] = defaultdict(list)
    for rank in range(L.world):
        replicas[L.coords(rank).edp].append(rank)
    tensors = view.tensors()
    checked = 0
    clean: set[tuple[int, ...]] = set()
    for edp, ranks in sorted(replicas.items()):
        # Replicas made of the same (cached, shared) parts hold the same boxes: check once.
        parts = tuple(view.param_part(rank) for rank in ranks)
        signature = tuple(map(id, parts))
        if signature in clean:
            checked += len(experts)
            continue
        found = False
        held: dict[str, list[tuple[Box, int]]] = defaultdict(list)
        for rank, part in zip(ranks, parts):
            for s in part:
                if s.key in experts and "param" in s.kinds:
                    held[s.key].append((s.box, rank))
        for key in sorted(experts):
            full = Box.of((0,) * len(tensors[(key, "param")].shape), tensors[(key, "param")].shape)
            boxes = held.get(key, [])
            checked += 1
            fault = tiling_fault(full, [b for b, _ in boxes])
            if fault is None:
                continue
            found = True
            owners = tuple(boxes[i][1] for i in fault.boxes)
            what = {"twice": f"has two owners (ranks {list(owners)})",
                    "missing": "has no owner", "outside": "is held beyond the tensor",
                    "empty": "is held as an empty box"}[fault.what]
            emit(Violation("expert", f"{what} in expert-data-parallel replica {edp}",
                           key, "param", owners, tuple(devices[r] for r in owners),
                           fault.point))
        if not found:
            clean.add(signature)
    return checked
