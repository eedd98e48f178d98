"""``--place auto``: choose which device runs each destination rank so that less data moves.

By default destination rank r runs on the r-th device of its spec. Any assignment of the same
devices to ranks is an equally valid layout, and a good one keeps data where it already is.
Megatron's structure is kept: each tensor-parallel group stays together on consecutive devices
of one node (its NVLink domain). So whole TP groups ("blocks") are assigned to node-local device
slots, maximizing the bytes each destination rank finds already on its device: a maximum-weight
bipartite matching (networkx) between blocks and slots.
"""

from __future__ import annotations

from collections import defaultdict


from ..ir.layout import DTYPE_BYTES, Layout
from ..ir.spec import WorldConfig
from .intersect import Answer, Intersection, PlanError
from .sources import node_of

# Blossom matching is cubic; beyond this many blocks a greedy heaviest-edge-first pass is used.
MATCHING_LIMIT = 160


def tp_blocks(layout: Layout) -> list[tuple[int, ...]]:
    """The destination's tensor-parallel groups, each in TP-rank order."""
    seen: set[int] = set()
    out = []
    for r in range(layout.world):
        if r not in seen:
            g = layout.mesh.groups(r)["tp"]
            seen.update(g)
            out.append(g)
    return out


def device_slots(devices: tuple[str, ...], size: int) -> list[tuple[str, ...]]:
    """Runs of ``size`` devices inside one node, in the order the spec lists them."""
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in devices:
        by_node[node_of(d)].append(d)
    out = []
    for devs in by_node.values():
        out.extend(tuple(devs[i:i + size]) for i in range(0, len(devs) - size + 1, size))
    return out


def _held_here(inter: Intersection, src: Layout, dtypes: dict[tuple[str, str], str]
               ) -> list[dict[str, int]]:
    """Per destination rank: bytes of what it needs that each source device already holds."""
    per_group: dict[int, dict[str, int]] = {}
    out = []
    for rank, groups in enumerate(inter.per_rank):
        acc: dict[str, int] = defaultdict(int)
        for g in groups:
            got = per_group.get(id(g))
            if got is None:
                got = per_group[id(g)] = _held_by_device(g, src, dtypes)
            for dev, n in got.items():
                acc[dev] += n
        out.append(acc)
    return out


def _held_by_device(answers: tuple[Answer, ...], src: Layout,
                    dtypes: dict[tuple[str, str], str]) -> dict[str, int]:
    acc: dict[str, int] = defaultdict(int)
    for a in answers:
        eb = sum(DTYPE_BYTES.get(dtypes[(a.entry.key, k)], 8) for k in a.kinds)
        for box, holders in a.parts:
            n = box.numel * eb
            for h in holders:
                for r in h.ranks:
                    acc[src.devices[r]] += n
    return acc


def auto_place(src: Layout, dst: Layout, inter: Intersection,
               dtypes: dict[tuple[str, str], str]) -> Layout:
    """``dst`` with its devices reassigned to ranks so that the most bytes stay in place.

    Raises:
        PlanError: the destination's TP groups cannot each sit inside one node.
    """
    tp = dst.parallel.tp
    blocks = tp_blocks(dst)
    slots = device_slots(dst.devices, tp)
    if len(slots) < len(blocks):
        raise PlanError(f"--place auto: the destination's {len(blocks)} TP groups of {tp} ranks "
                        f"do not fit inside its nodes ({len(slots)} node-local runs of {tp} devices)")
    held = _held_here(inter, src, dtypes)
    where = {d: (s, i) for s, slot in enumerate(slots) for i, d in enumerate(slot)}
    weight: dict[tuple[int, int], int] = defaultdict(int)
    for b, block in enumerate(blocks):
        for i, r in enumerate(block):
            for dev, n in held[r].items():
                s_i = where.get(dev)
                if s_i is not None and s_i[1] == i:  # the block's i-th rank lands on slot[i]
                    weight[(b, s_i[0])] += n
    chosen = _match(weight, len(blocks))
    free = [s for s in range(len(slots)) if s not in set(chosen.values())]
    devices = list(dst.devices)
    for b, block in enumerate(blocks):
        s = chosen.get(b)
        if s is None:
            s = free.pop(0)
        for r, d in zip(block, slots[s]):
            devices[r] = d
    world = WorldConfig(devices=tuple(devices))
    return Layout(dst.spec.model_copy(update={"world": world}))


def _match(weight: dict[tuple[int, int], int], nblocks: int) -> dict[int, int]:
    """Block -> slot with the largest total weight (exact up to MATCHING_LIMIT blocks)."""
    if nblocks <= MATCHING_LIMIT:
        import networkx as nx  # here: its import is a fifth of `dynatrain plan`'s start-up

        g = nx.Graph()
        for (b, s), w in sorted(weight.items()):
            g.add_edge(("b", b), ("s", s), weight=w)
        pairs = nx.max_weight_matching(g)
        out = {}
        for u, v in pairs:
            (_, b), (_, s) = (u, v) if u[0] == "b" else (v, u)
            out[b] = s
        return out
    out, taken = {}, set()
    for (b, s), _ in sorted(weight.items(), key=lambda kv: (-kv[1], kv[0])):
        if b not in out and s not in taken:
            out[b] = s
            taken.add(s)
    return out
