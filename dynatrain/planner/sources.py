"""Pick one source per needed part: same device, then same node, then the least-loaded sender.

Ties break on rank, so every process computes the same plan from the same inputs.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.layout import DTYPE_BYTES
from .intersect import Need
from .plan import Transfer


def node_of(device: str) -> str:
    return device.split(":", 1)[0]


def pick_sources(needs: list[Need], src_devices: tuple[str, ...], dst_devices: tuple[str, ...],
                 dtypes: dict[tuple[str, str], str]) -> list[Transfer]:
    """One ``Transfer`` per need, from the cheapest holder."""
    load: dict[str, int] = defaultdict(int)
    src_nodes = [node_of(d) for d in src_devices]
    dst_nodes = [node_of(d) for d in dst_devices]
    elem_bytes: dict[tuple[str, tuple[str, ...]], int] = {}
    out = []
    for n in needs:
        eb = elem_bytes.get((n.key, n.kinds))
        if eb is None:
            eb = elem_bytes[(n.key, n.kinds)] = sum(DTYPE_BYTES.get(dtypes[(n.key, k)], 8)
                                                     for k in n.kinds)
        nbytes = n.box.numel * eb
        dst_dev, dst_node = dst_devices[n.dst.rank], dst_nodes[n.dst.rank]
        if len(n.holders) == 1:
            best = n.holders[0]
        else:
            best = min(n.holders, key=lambda h: (
                src_devices[h.rank] != dst_dev,
                src_nodes[h.rank] != dst_node,
                load[src_devices[h.rank]],
                h.rank,
            ))
        src_dev = src_devices[best.rank]
        if src_dev != dst_dev:
            load[src_dev] += nbytes
        out.append(Transfer(n.key, n.kinds, n.box, best.rank, n.dst.rank, best.slot, best.anchor,
                            n.dst.slot, n.dst.anchor, nbytes))
    return out
