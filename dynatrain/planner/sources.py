"""Pick one source per needed part: same device, then same node, then a rotation over holders.

Every choice is a function of the part, its holders and the receiving rank alone, never of
what else the plan sends: a process can compute its own receives, and a sender which of its
parts each receiver takes from it, without planning anyone else's part (``planner.slices``).
Balance comes from the rotation: the receiver's replica index (its rank in the destination's
data-parallel-with-context group) plus a fixed offset per part picks the holder, and a large
replicated part is picked slab by slab, each slab one holder further. Replicas of one position
thus spread evenly over the holders, and so do the slabs of one big part.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from ..ir.box import Box
from ..ir.layout import DTYPE_BYTES
from .intersect import Holders, Intersection
from .plan import Transfer


def node_of(device: str) -> str:
    return device.split(":", 1)[0]


SLAB_BYTES = 64 << 20  # replicated parts larger than this are picked in slabs of about it


def slabs(box: Box, nbytes: int) -> list[Box]:
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


_KEY_SALT: dict[str, int] = {}


def part_offset(key: str, box: Box) -> int:
    """A fixed offset per part (stable across processes, unlike ``hash`` of a string), so
    that small parts of one position do not all start the rotation at the same holder."""
    salt = _KEY_SALT.get(key)
    if salt is None:
        salt = _KEY_SALT[key] = zlib.crc32(key.encode())
    h = salt
    for x in box.lo:
        h = (h * 1_000_003 + x) & 0xFFFFFFFF
    return h


class Candidates:
    """The holders of one part as sorted (rank, Holders) pairs, with per-node lists.

    Built once per holders tuple (shared by every part the same ranks hold in the same slots).
    A rank listed in two groups (two slots holding the same box) keeps its first group.
    """

    __slots__ = ("holders", "ranks", "group", "members", "by_node")

    def __init__(self, holders: tuple[Holders, ...], src_nodes: Sequence[str],
                 shared: dict | None = None) -> None:
        self.holders = holders  # keeps the tuple alive: callers cache by its id
        if len(holders) == 1:  # the usual case: one slot, its ranks listed once
            group = dict.fromkeys(holders[0].ranks, holders[0])
        else:
            group = {}
            for h in holders:
                for r in h.ranks:
                    group.setdefault(r, h)
        self.group = group
        # Many parts (every norm of a stage) have the same holder ranks in other slots: their
        # sorted ranks, set and per-node lists are built once (``shared``, by rank tuple).
        ranks = tuple(group)
        hit = shared.get(ranks) if shared is not None else None
        if hit is None:
            srt = sorted(group)
            by_node: dict[str, list[int]] = {}
            for r in srt:
                by_node.setdefault(src_nodes[r], []).append(r)
            hit = (srt, frozenset(srt), by_node)
            if shared is not None:
                shared[ranks] = hit
        self.ranks, self.members, self.by_node = hit

    def choose(self, here: int, dst_node: str, replica: int, offset: int, slab: int) -> int:
        """The rank a receiver takes slab ``slab`` of this part from."""
        if here in self.members:
            return here
        near = self.by_node.get(dst_node)
        pool = near if near else self.ranks
        return pool[(replica + offset + slab) % len(pool)]


class CandidateCache:
    """``Candidates`` per holders tuple, keyed by the tuple's id (it is kept alive)."""

    def __init__(self, src_nodes: Sequence[str]) -> None:
        self.src_nodes = src_nodes
        self.cache: dict[int, Candidates] = {}
        self.shared: dict[tuple[int, ...], tuple] = {}

    def __call__(self, holders: tuple[Holders, ...]) -> Candidates:
        c = self.cache.get(id(holders))
        if c is None:
            c = self.cache[id(holders)] = Candidates(holders, self.src_nodes, self.shared)
        return c


def remote_pieces(box: Box, nbytes: int, cands: Candidates) -> list[tuple[Box, int]]:
    """(box, bytes) of each piece a receiver not holding the part takes from one holder: the
    whole part, or each slab of a large replicated one (piece i picks with ``slab`` = i)."""
    if nbytes > SLAB_BYTES and len(cands.ranks) > 1:
        # A replicated part spanning many layers: one holder per slab, or its one sender
        # would carry all of them.
        eb = nbytes // box.numel
        return [(sub, sub.numel * eb) for sub in slabs(box, nbytes)]
    return [(box, nbytes)]


def part_transfers(key: str, kinds: tuple[str, ...], box: Box, nbytes: int,
                   cands: Candidates, dst_rank: int, here: int, dst_node: str, replica: int,
                   dst_slot, dst_anchor: Box) -> list[Transfer]:
    """The transfers that bring one part to ``dst_rank``: one, or one per slab of a large
    replicated part not held on the receiver's device (each slab from the next holder)."""
    offset = part_offset(key, box)
    if here in cands.members:
        h = cands.group[here]
        return [Transfer(key, kinds, box, here, dst_rank, h.slot, h.anchor, dst_slot,
                         dst_anchor, nbytes)]
    out = []
    for s, (sub, n) in enumerate(remote_pieces(box, nbytes, cands)):
        r = cands.choose(here, dst_node, replica, offset, s)
        h = cands.group[r]
        out.append(Transfer(key, kinds, sub, r, dst_rank, h.slot, h.anchor, dst_slot,
                            dst_anchor, n))
    return out


def elem_bytes_of(dtypes: dict[tuple[str, str], str], key: str, kinds: tuple[str, ...]) -> int:
    return sum(DTYPE_BYTES.get(dtypes[(key, k)], 8) for k in kinds)


class ElemBytes:
    """``elem_bytes_of`` memoized per (key, kinds): asked once per part on hot paths."""

    def __init__(self, dtypes: dict[tuple[str, str], str]) -> None:
        self.dtypes = dtypes
        self.memo: dict[tuple[str, tuple[str, ...]], int] = {}

    def __call__(self, key: str, kinds: tuple[str, ...]) -> int:
        eb = self.memo.get((key, kinds))
        if eb is None:
            eb = self.memo[(key, kinds)] = elem_bytes_of(self.dtypes, key, kinds)
        return eb


def pick_sources(inter: Intersection, src_devices: tuple[str, ...], dst_devices: tuple[str, ...],
                 dtypes: dict[tuple[str, str], str],
                 replica_of: Callable[[int], int] = lambda r: 0) -> tuple[list[Transfer], int]:
    """One ``Transfer`` per needed part (per slab of a large replicated one), from the holder
    the rules above give. ``replica_of(dst_rank)``: the receiver's replica index.

    Also returns the lower bound on bytes that must cross devices: parts that no source rank
    on the destination device holds.
    """
    rank_on_device = {d: r for r, d in enumerate(src_devices)}
    cands = CandidateCache([node_of(d) for d in src_devices])
    elem_bytes = ElemBytes(dtypes)
    out: list[Transfer] = []
    remote = 0
    for dst_rank, dst_dev in enumerate(dst_devices):
        here = rank_on_device.get(dst_dev, -1)
        dst_node = node_of(dst_dev)
        replica = replica_of(dst_rank)
        for ans in inter.answers(dst_rank):
            e = ans.entry
            eb = elem_bytes(e.key, ans.kinds)
            for box, holders in ans.parts:
                c = cands(holders)
                nbytes = box.numel * eb
                ts = part_transfers(e.key, ans.kinds, box, nbytes, c, dst_rank, here,
                                    dst_node, replica, e.slot, e.box)
                if ts[0].src_rank != here:
                    remote += nbytes
                out.extend(ts)
    return out, remote
