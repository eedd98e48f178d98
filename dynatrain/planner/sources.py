"""Pick one source per needed part: same device, then same node, then the least-loaded sender.

Ties break on rank, so every process computes the same plan from the same inputs.
"""

from __future__ import annotations

import heapq

from ..ir.box import Box
from ..ir.layout import DTYPE_BYTES
from .intersect import Holders, Intersection
from .plan import Transfer


def node_of(device: str) -> str:
    return device.split(":", 1)[0]


def pick_sources(inter: Intersection, src_devices: tuple[str, ...], dst_devices: tuple[str, ...],
                 dtypes: dict[tuple[str, str], str]) -> tuple[list[Transfer], int]:
    """One ``Transfer`` per needed part, from the cheapest holder.

    Also returns the lower bound on bytes that must cross devices: parts that no source rank
    on the destination device holds.
    """
    src_nodes = [node_of(d) for d in src_devices]
    rank_on_device = {d: r for r, d in enumerate(src_devices)}
    picker = _Picker(src_nodes)
    elem_bytes: dict[tuple[str, tuple[str, ...]], int] = {}
    out: list[Transfer] = []
    remote = 0
    for dst_rank, dst_dev in enumerate(dst_devices):
        here = rank_on_device.get(dst_dev, -1)
        dst_node = node_of(dst_dev)
        for ans in inter.answers(dst_rank):
            e = ans.entry
            eb = elem_bytes.get((e.key, ans.kinds))
            if eb is None:
                eb = elem_bytes[(e.key, ans.kinds)] = sum(
                    DTYPE_BYTES.get(dtypes[(e.key, k)], 8) for k in ans.kinds)
            for box, holders in ans.parts:
                nbytes = box.numel * eb
                rank, h = picker.choose(holders, here, dst_node)
                if rank != here and nbytes > SLAB_BYTES and (
                        len(holders) > 1 or len(holders[0].ranks) > 1):
                    # A replicated part spanning many layers: pick per slab, or its one
                    # sender would carry all of them (the 405B switch: busiest sender 13%
                    # over its share, predicted time 1.13x the bound instead of 1.06x).
                    for sub in _slabs(box, nbytes):
                        n = sub.numel * eb
                        rank, h = picker.choose(holders, here, dst_node)
                        picker.add_load(rank, n)
                        remote += n
                        out.append(Transfer(e.key, ans.kinds, sub, rank, dst_rank, h.slot,
                                            h.anchor, e.slot, e.box, n))
                    continue
                if rank != here:
                    picker.add_load(rank, nbytes)
                    remote += nbytes
                out.append(Transfer(e.key, ans.kinds, box, rank, dst_rank, h.slot, h.anchor,
                                    e.slot, e.box, nbytes))
    return out, remote


SLAB_BYTES = 64 << 20  # replicated parts larger than this are picked in slabs of about it


def _slabs(box: Box, nbytes: int) -> list[Box]:
    """``box`` cut along its first dim longer than 1 into slabs of about ``SLAB_BYTES``
    (whole indices: a layer or expert each at the finest)."""
    d = next((i for i, (l, h) in enumerate(zip(box.lo, box.hi)) if h - l > 1), None)
    if d is None:
        return [box]
    size = box.hi[d] - box.lo[d]
    step = max(1, SLAB_BYTES // (nbytes // size))
    return [Box(box.lo[:d] + (a,) + box.lo[d + 1:],
                box.hi[:d] + (min(a + step, box.hi[d]),) + box.hi[d + 1:])
            for a in range(box.lo[d], box.hi[d], step)]


class _Picker:
    """Chooses among holders in time independent of how many replicas hold a part.

    Per holder group (shared by many parts) it keeps a set for the same-device test, its ranks
    per node, and a heap of (load, rank) whose stale entries are refreshed when popped: the
    least-loaded remote sender costs O(log n), not a scan of every DP replica.
    """

    def __init__(self, src_nodes: list[str]) -> None:
        self.src_nodes = src_nodes
        self.load = [0] * len(src_nodes)  # bytes each source rank sends to other devices
        self.groups: dict[int, tuple[Holders, frozenset[int], dict[str, list[int]], list]] = {}
        self.lists: dict[int, tuple[tuple[Holders, ...], list]] = {}

    def add_load(self, rank: int, nbytes: int) -> None:
        self.load[rank] += nbytes

    def _group(self, h: Holders):
        g = self.groups.get(id(h))
        if g is None:
            by_node: dict[str, list[int]] = {}
            for r in h.ranks:
                by_node.setdefault(self.src_nodes[r], []).append(r)
            heap = [(self.load[r], r) for r in h.ranks]
            heapq.heapify(heap)
            g = self.groups[id(h)] = (h, frozenset(h.ranks), by_node, heap)  # h: keeps id alive
        return g

    def _least_loaded(self, heap: list) -> tuple[int, int]:
        while True:
            load, r = heap[0]
            if load == self.load[r]:
                return load, r
            heapq.heapreplace(heap, (self.load[r], r))

    def choose(self, holders: tuple[Holders, ...], here: int, dst_node: str
               ) -> tuple[int, Holders]:
        if len(holders) == 1 and len(holders[0].ranks) == 1:
            return holders[0].ranks[0], holders[0]
        hit = self.lists.get(id(holders))
        if hit is None:  # the tuple rides along to keep its id from being reused
            hit = self.lists[id(holders)] = (holders, [self._group(h) for h in holders])
        groups = hit[1]
        for h, members, _, _ in groups:
            if here in members:
                return here, h
        best: tuple | None = None
        for h, _, by_node, _ in groups:  # same node: a handful of ranks at most
            for r in by_node.get(dst_node, ()):
                score = (self.load[r], r)
                if best is None or score < best[0]:
                    best = (score, r, h)
        if best is None:
            for h, _, _, heap in groups:
                score = self._least_loaded(heap)
                if best is None or score < best[0]:
                    best = (score, score[1], h)
        assert best is not None
        return best[1], best[2]
