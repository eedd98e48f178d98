"""What ``state.derive_param`` costs after the rounds: the param all-gather over DP.

With ``derive_param`` the plan sends no bf16 params; each destination rank casts the fp32 main
params it owns, and (under the distributed optimizer) receives the rest of its params from the
other ranks of its optimizer group, as Megatron's param all-gather does after every step. A rank
receives exactly the param elements it holds but does not own. Without the distributed
optimizer every rank owns all it holds: a local cast, nothing received.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.layout import DTYPE_BYTES, Layout
from ..ir.summary import rank_elements
from .cost import Topology
from .sources import node_of


@dataclass(frozen=True, slots=True)
class DerivedGather:
    """Bytes the param all-gather moves and its wire time (bandwidth model, like the rounds)."""

    total_bytes: int  # received, summed over destination ranks
    max_device_bytes: int  # received by the busiest device
    seconds: float  # the busiest device's bytes at its link's bandwidth, plus one latency
    crosses_nodes: bool  # some optimizer group spans nodes (the network bounds the time)


def derived_param_gather(dst: Layout, topology: Topology) -> DerivedGather:
    """The all-gather ``derive_param`` implies for destination layout ``dst``."""
    if not dst.spec.state.derive_param:
        return DerivedGather(0, 0, 0.0, False)
    itemsize = DTYPE_BYTES[dst.spec.state.param]
    received = []
    for rank in range(dst.world):
        params, owned = rank_elements(dst, rank)
        received.append((params - owned) * itemsize)
    # Ranks with the same TP and PP coordinates form a dense DP x CP optimizer group (expert
    # groups are subsets of these).
    groups: dict[tuple[int, int], set[str]] = {}
    for rank, dev in enumerate(dst.devices):
        c = dst.coords(rank)
        groups.setdefault((c.tp, c.pp), set()).add(node_of(dev))
    crosses = any(len(nodes) > 1 for nodes in groups.values())
    peak = max(received, default=0)
    bandwidth = topology.inter_node_GBps if crosses else topology.intra_node_GBps
    seconds = peak / (bandwidth * 1e9) + (topology.latency_us * 1e-6 if peak else 0.0)
    return DerivedGather(sum(received), peak, seconds, crosses)
