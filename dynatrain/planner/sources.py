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
    out = []
    for n in needs:
        nbytes = n.box.numel * sum(DTYPE_BYTES.get(dtypes[(n.key, k)], 8) for k in n.kinds)
        dst_dev = dst_devices[n.dst.rank]
        best = min(n.holders, key=lambda h: (
            src_devices[h.rank] != dst_dev,
            node_of(src_devices[h.rank]) != node_of(dst_dev),
            load[src_devices[h.rank]],
            h.rank,
        ))
        src_dev = src_devices[best.rank]
        if src_dev != dst_dev:
            load[src_dev] += nbytes
        out.append(Transfer(n.key, n.kinds, n.box, best.rank, n.dst.rank, best.slot, best.anchor,
                            n.dst.slot, n.dst.anchor, nbytes))
    return out
