"""Pick one source per needed part: same device, then same node, then a scaled choice.

Every choice is a function of the part, its holders and the receiving rank alone, never of
what else the plan sends: a process can compute its own receives, and a sender which of its
parts each receiver takes from it, without planning anyone else's part (``planner.slices``).

A receiver whose node holds none of a part picks among all of its n holders by scaling: the
m replicas of its position (its rank in the data-parallel-with-context group; for expert
weights, in the expert-data-parallel group) are laid over the n holders, replica j covering
the stretch [j n/m, (j+1) n/m), and a fixed fraction per part in [0, 1) picks the point of
that stretch (``spread_index``). So every holder serves the m replicas of a part alike (each
at most once when n >= m), while one receiver takes its parts from the one to three holders
its stretch crosses, not from a different holder per part: a 98304-GPU data-parallel shrink
then has a few device pairs per receiver instead of dozens, each carrying many parts. A large
replicated part is picked slab by slab, the slabs sweeping every fraction of ``LANES`` turns
of the pool, so it is spread evenly over the holders for every receiver; the slabs one
receiver takes from the same holder in a row are one transfer. On the receiver's own node the
holders are few (a node's GPUs): there the receiver's replica index plus a fixed offset per
part rotates over them, slab by slab.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from ..ir.box import Box, new_box
from ..ir.layout import DTYPE_BYTES, Layout
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
    that the parts of one position fall on every point of a stretch (and, on a node, do not
    all start the rotation at the same holder)."""
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


_MASK = 0xFFFFFFFF


# A large part's slabs are spread over this many lanes, each a shift of the pool by 1/LANES:
# a receiver takes such a part from as many holders, so the holders' loads stay even however
# the receivers that take it locally or on their node fall (measured on the Qwen3-235B
# switch: with one lane the busiest sender moves 28.0 GiB against a mean of 23.5; with two,
# 24.5, as with a holder per slab).
LANES = 2


def slab_point(offset: int, slab: int, slabs: int) -> tuple[int, int]:
    """Slab ``slab`` of ``slabs``' (lane, fraction in 2**-32 units): a part's own offset plus
    the slab's share of LANES turns, so the slabs of one part sweep every lane once, each
    lane's fraction from 0 to 1. A part of one slab takes lane 0 at its offset."""
    lanes = LANES if slabs > 1 else 1
    x = (offset * lanes + ((slab * lanes) << 32) // slabs) % (lanes << 32)
    return x >> 32, x & _MASK


def lane_shift(lane: int, n: int) -> int:
    """How many holders of ``n`` lane ``lane`` turns the pool on."""
    return lane * n // LANES


def spread_index(replica: int, replicas: int, fraction: int, n: int, shift: int) -> int:
    """The pool index (of ``n`` holders) that replica ``replica`` of ``replicas`` takes a
    piece at ``fraction`` (2**-32 units) of its stretch [j n/m, (j+1) n/m) from, the pool
    turned ``shift`` holders on (``lane_shift``)."""
    w = (((replica % replicas) << 32) + fraction) * n // (replicas << 32)
    return (w + shift) % n


def spread_takers(index: int, replicas: int, fraction: int, n: int, shift: int) -> range:
    """The replicas that ``spread_index`` sends to pool index ``index`` for ``fraction``: one
    run of them, as its stretch is monotone in the replica."""
    v = (index - shift) % n
    one, scaled = n << 32, fraction * n

    def first_at_least(w: int) -> int:  # the least replica whose stretch point reaches w
        return -((scaled - w * (replicas << 32)) // one)
    return range(max(0, first_at_least(v)), min(replicas, first_at_least(v + 1)))


class PartChoice:
    """What the choice reads of one part, alike for every receiver: its offset and its
    pieces (``remote_pieces``), each with the pool shift of its lane and its fraction
    (``slab_point``). Built once per part and reused by all the replicas that need it."""

    __slots__ = ("offset", "pieces")

    def __init__(self, key: str, box: Box, nbytes: int, cands: Candidates) -> None:
        self.offset = offset = part_offset(key, box)
        pieces = remote_pieces(box, nbytes, cands)
        n = len(cands.ranks)
        self.pieces = []
        for s, (sub, size) in enumerate(pieces):
            lane, fraction = slab_point(offset, s, len(pieces))
            self.pieces.append((sub, size, lane_shift(lane, n), fraction))


def part_transfers(key: str, kinds: tuple[str, ...], box: Box, nbytes: int,
                   cands: Candidates, dst_rank: int, here: int, dst_node: str, replica: int,
                   dst_slot, dst_anchor: Box, replicas: int = 1,
                   choice: PartChoice | None = None) -> list[Transfer]:
    """The transfers that bring one part to ``dst_rank`` (replica ``replica`` of
    ``replicas``): one, or one per run of slabs of a large replicated part not held on the
    receiver's device that it takes from the same holder. ``choice``: the part's
    ``PartChoice``, if the caller keeps one."""
    if here in cands.members:
        h = cands.group[here]
        return [Transfer(key, kinds, box, here, dst_rank, h.slot, h.anchor, dst_slot,
                         dst_anchor, nbytes)]
    if choice is None:
        choice = PartChoice(key, box, nbytes, cands)
    near = cands.by_node.get(dst_node)
    out: list[Transfer] = []
    if near:  # few holders on the node: rotate, slab by slab
        offset = choice.offset
        for s, (sub, n, _, _) in enumerate(choice.pieces):
            r = near[(replica + offset + s) % len(near)]
            h = cands.group[r]
            out.append(Transfer(key, kinds, sub, r, dst_rank, h.slot, h.anchor, dst_slot,
                                dst_anchor, n))
        return out
    pool = cands.ranks
    size = len(pool)
    # ``spread_index`` inlined (millions of slabs on the largest switches); runs of slabs
    # from one holder are collected first and each built as one transfer.
    base, den = (replica % replicas) << 32, replicas << 32
    runs: list[list] = []
    last = -1
    for sub, n, shift, fraction in choice.pieces:
        r = pool[((base + fraction) * size // den + shift) % size]
        if r == last:  # the next slab from the same holder: one transfer
            run = runs[-1]
            run[2] = sub
            run[3] += n
            continue
        runs.append([r, sub, sub, n])
        last = r
    for r, first, end, n in runs:
        h = cands.group[r]
        out.append(Transfer(key, kinds, first if first is end else new_box(first.lo, end.hi), r,
                            dst_rank, h.slot, h.anchor, dst_slot, dst_anchor, n))
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


class ReplicaIndex:
    """A destination rank's replica index among the ranks that hold the same parameters, and
    how many there are: for dense state its rank in the data-parallel-with-context group (of
    ``count``), for expert weights its expert-data-parallel rank (of ``expert_count``). The
    choice above lays the replicas of one position over the holders."""

    def __init__(self, dst: Layout) -> None:
        self.layout = dst
        self.count = dst.dp * dst.parallel.cp
        self.expert_count = dst.edp
        self._memo: dict[int, tuple[int, int]] = {}  # asked per part and receiver: millions
        self._keys: frozenset[str] | None = None

    def both(self, rank: int) -> tuple[int, int]:
        """(dense replica index, expert replica index) of ``rank``."""
        r = self._memo.get(rank)
        if r is None:
            c = self.layout.coords(rank)
            r = self._memo[rank] = (c.dp_cp, c.edp)
        return r

    @property
    def expert_keys(self) -> frozenset[str]:
        """Checkpoint keys of the expert weights (their replicas are expert-data-parallel)."""
        if self._keys is None:
            L = self.layout
            # Keys name the expert family, not the EP rank: EP rank 0's stages list them all.
            # A dense model has none, found without compiling every stage (a slice compiles
            # only the stages it meets).
            self._keys = frozenset(d.key for pp in range(L.parallel.pp)
                                   for defs, _ in L.chunk_defs(pp, 0) for d in defs
                                   if d.expert) if L.model.num_moe_experts else frozenset()
        return self._keys

    def of(self, rank: int, key: str) -> tuple[int, int]:
        """(replica index, replica count) of ``rank`` for tensor ``key``."""
        dense, expert = self.both(rank)
        if key in self.expert_keys:
            return expert, self.expert_count
        return dense, self.count


def pick_sources(inter: Intersection, src_devices: tuple[str, ...], dst_devices: tuple[str, ...],
                 dtypes: dict[tuple[str, str], str], replica_of: ReplicaIndex | None = None
                 ) -> tuple[list[Transfer], int]:
    """One ``Transfer`` per needed part (per run of slabs of a large replicated one), from the
    holder the rules above give. ``replica_of.of(dst_rank, key)``: the receiver's replica
    index and count (None: every receiver is replica 0 of 1).

    Also returns the lower bound on bytes that must cross devices: parts that no source rank
    on the destination device holds.
    """
    rank_on_device = {d: r for r, d in enumerate(src_devices)}
    cands = CandidateCache([node_of(d) for d in src_devices])
    elem_bytes = ElemBytes(dtypes)
    out: list[Transfer] = []
    remote = 0
    # Per part (keyed by identity: the intersection keeps it alive), what every receiver of
    # it reads alike: answers are shared by the ranks of a class, so the replicas of a
    # position reuse the candidates, size and choice of each part.
    known: dict[int, tuple[Candidates, int, PartChoice | None]] = {}
    for dst_rank, dst_dev in enumerate(dst_devices):
        here = rank_on_device.get(dst_dev, -1)
        dst_node = node_of(dst_dev)
        for ans in inter.answers(dst_rank):
            e = ans.entry
            eb = elem_bytes(e.key, ans.kinds)
            replica, replicas = replica_of.of(dst_rank, e.key) if replica_of is not None \
                else (0, 1)
            for part in ans.parts:
                got = known.get(id(part))
                if got is None:
                    box, holders = part
                    c = cands(holders)
                    got = known[id(part)] = (c, box.numel * eb, None)
                c, nbytes, choice = got
                box = part[0]
                if choice is None and here not in c.members:
                    choice = PartChoice(e.key, box, nbytes, c)
                    known[id(part)] = (c, nbytes, choice)
                ts = part_transfers(e.key, ans.kinds, box, nbytes, c, dst_rank, here,
                                    dst_node, replica, e.slot, e.box, replicas, choice)
                if ts[0].src_rank != here:
                    remote += nbytes
                out.extend(ts)
    return out, remote
