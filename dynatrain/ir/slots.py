"""Slots: where a region of a logical tensor sits in a rank's local storage.

A ``ParamSlot`` is a TP-local module parameter (or, without the distributed optimizer, the
optimizer's tensor of the same shape), a ``FlatSlot`` the DistributedOptimizer's flat shard of
one parameter, a ``BufferSlot`` a module buffer. A ``StackSlot`` is a family of param or flat
slots that differ in name only, one per layer (and expert) of a stage: ``members`` expands a box
of it into one (slot, anchor, box) per storage tensor, and ``grid_boxes`` cuts a set of
(layer, expert) indices into the boxes families are made of.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .box import Box
from .errors import LayoutError


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Elements sit in a TP-local tensor of the parameter's local shape, at ``local_offset``.

    For kind ``param`` that tensor is the module parameter ``name`` of chunk ``chunk``; for the
    optimizer kinds without the distributed optimizer, the optimizer's per-parameter tensor.
    """

    chunk: int
    name: str
    local_offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatSlot:
    """Elements sit contiguously in the DistributedOptimizer's shard of parameter ``name``.

    ``offset`` counts from the start of this rank's slice of ``param.view(-1)`` (the slice that
    Megatron's fp32 main param and Adam moments for that parameter cover).
    """

    chunk: int
    buffer: int  # index into Layout.rank_buffers(rank)
    name: str
    offset: int


@dataclass(frozen=True, slots=True)
class BufferSlot:
    """Elements sit in the module buffer ``name`` (e.g. the router's expert_bias)."""

    chunk: int
    name: str


@dataclass(frozen=True, slots=True)
class StackSlot:
    """A family of slots that differ in name only, one per index of the anchor's leading axes.

    Each layer's weight (and each expert's) is its own module parameter and DistributedOptimizer
    shard, but the layers and experts of a stage hold congruent boxes at one local position: a
    single region over their (layer[, expert]) grid stands for all of them, so the planner and
    the verifier work per grid instead of per weight (the 235B MoE switch: ~24k expert weights
    per side). ``members`` expands a region of it into the members' own slots, as storage
    sees them.
    """

    member: ParamSlot | FlatSlot  # the first member's slot; the others differ in name only
    axes: int  # leading dims of the anchor that index members (layer, expert)
    names: tuple[str, ...]  # member names, row-major over the anchor's leading dims
    # Hashed once: plans key dicts on (key, slot, anchor) per transfer, and hashing hundreds
    # of names each time cost more than the rest of the verifier's loop.
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.member, self.axes, self.names)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt, so the hash is this process's (string hashes are salted)
        return StackSlot, (self.member, self.axes, self.names)

    @property
    def chunk(self) -> int:
        return self.member.chunk


Slot = ParamSlot | FlatSlot | BufferSlot | StackSlot


def members(slot: Slot, anchor: Box, box: Box) -> list[tuple[Slot, Box, Box]]:
    """(slot, anchor, box) per storage tensor that ``box`` (inside ``anchor``) touches.

    A plain slot is its own only member. For a ``StackSlot`` the members are the indices of
    ``box``'s leading axes, row-major: both ends of a transfer expand one box alike.

    Raises:
        LayoutError: a family whose names do not match its anchor's leading axes, or ``box``
            outside ``anchor`` on them (a plan nobody verified).
    """
    if type(slot) is not StackSlot:
        return [(slot, anchor, box)]
    n, m = slot.axes, slot.member
    lead = anchor.shape[:n]
    if not (0 < n <= len(anchor.lo) == len(box.lo) and len(slot.names) == math.prod(lead)
            and all(a <= l < h <= z for l, h, a, z in zip(box.lo[:n], box.hi[:n], anchor.lo,
                                                          anchor.hi))):
        raise LayoutError(f"box {box} is not a part of the {len(slot.names)}-member family "
                          f"over {anchor} ({n} leading axes)")
    tail_alo, tail_ahi = anchor.lo[n:], anchor.hi[n:]
    out = []
    for idx in itertools.product(*(range(l, h) for l, h in zip(box.lo[:n], box.hi[:n]))):
        name = slot.names[flat_index(lead, tuple(i - a for i, a in zip(idx, anchor.lo)))]
        one = tuple(i + 1 for i in idx)
        out.append((renamed(m, name), Box(idx + tail_alo, one + tail_ahi),
                    Box(idx + box.lo[n:], one + box.hi[n:])))
    return out


def renamed(slot: ParamSlot | FlatSlot, name: str) -> ParamSlot | FlatSlot:
    if type(slot) is ParamSlot:
        return ParamSlot(slot.chunk, name, slot.local_offset)
    return FlatSlot(slot.chunk, slot.buffer, name, slot.offset)


def grid_boxes(points: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cover sorted, distinct integer points exactly with few boxes: runs along the last axis,
    merged over consecutive indices of the axes before that cover the same runs."""
    if not points[0]:
        return [((), ())]
    if len(points[0]) == 1:  # runs
        runs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        start = prev_x = points[0][0]
        for (x,) in points[1:]:
            if x != prev_x + 1:
                runs.append(((start,), (prev_x + 1,)))
                start = x
            prev_x = x
        runs.append(((start,), (prev_x + 1,)))
        return runs
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    prev: list | None = None  # [head lo, head hi, the rest's boxes]

    def flush() -> None:
        if prev is not None:
            out.extend(((prev[0],) + lo, (prev[1],) + hi) for lo, hi in prev[2])

    i = 0
    while i < len(points):
        head = points[i][0]
        j = i
        while j < len(points) and points[j][0] == head:
            j += 1
        rest = grid_boxes([p[1:] for p in points[i:j]])
        if prev is not None and prev[1] == head and prev[2] == rest:
            prev[1] = head + 1
        else:
            flush()
            prev = [head, head + 1, rest]
        i = j
    flush()
    return out


def slot_key(kind: str, slot: Slot) -> tuple:
    """The key of ``slot``'s tensor in a rank's local storage, for state ``kind``.

    Raises:
        LayoutError: ``slot`` is a ``StackSlot``, which spans several tensors (``members``).
    """
    if type(slot) is StackSlot:
        raise LayoutError(f"a family of {len(slot.names)} slots has no single storage tensor; "
                          "expand it with members()")
    return (kind, type(slot).__name__, slot.chunk, slot.name)


def flat_index(shape: tuple[int, ...], idx: tuple[int, ...]) -> int:
    flat = 0
    for s, i in zip(shape, idx):
        flat = flat * s + i
    return flat
