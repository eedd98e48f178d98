"""Pick one source per needed part: same device, then same node, then the least-loaded sender.

Ties break on rank, so every process computes the same plan from the same inputs.
"""

from __future__ import annotations

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
    load = [0] * len(src_devices)  # bytes each source rank sends to other devices
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
                rank, h = _choose(holders, here, dst_node, src_nodes, load)
                if rank != here:
                    load[rank] += nbytes
                    remote += nbytes
                out.append(Transfer(e.key, ans.kinds, box, rank, dst_rank, h.slot, h.anchor,
                                    e.slot, e.box, nbytes))
    return out, remote


def _choose(holders: tuple[Holders, ...], here: int, dst_node: str, src_nodes: list[str],
            load: list[int]) -> tuple[int, Holders]:
    if len(holders) == 1 and len(holders[0].ranks) == 1:
        return holders[0].ranks[0], holders[0]
    best: tuple | None = None
    for h in holders:
        if here in h.ranks:
            return here, h
        for r in h.ranks:
            score = (src_nodes[r] != dst_node, load[r], r)
            if best is None or score < best[0]:
                best = (score, r, h)
    assert best is not None
    return best[1], best[2]
