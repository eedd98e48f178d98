"""Buddy pairs: which device keeps a copy of which device's optimizer state between steps.

A job with one DistributedOptimizer instance holds each optimizer shard once, so a failed device
takes its shard with it. DynaTrain's buddy copies (``runtime.megatron.buddy``) send every
device's non-parameter state after each step to its *buddy*, a device on another node; this
module picks the pairs and says what a set of failed devices still loses with them. Pure
Python: ``suggest`` and ``plan`` report it without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..ir.errors import DynatrainError


def node_of(device: str) -> str:
    """The node of ``node3:gpu5``: ``node3`` (a device without ``:`` is its own node)."""
    return device.split(":", 1)[0]


def buddy_pairs(devices: Sequence[str]) -> dict[str, str]:
    """Each device's buddy: ``devices[(i + shift) % n]`` for the smallest shift that puts every
    buddy on another node (with ``k`` devices per node in rank order, ``shift = k``: the device
    with the same index on the next node). A ring, so every device holds exactly one copy.

    Raises:
        DynatrainError: the devices are all on one node (a copy on the same node dies with it).
    """
    n = len(devices)
    for shift in range(1, n):
        if all(node_of(devices[i]) != node_of(devices[(i + shift) % n]) for i in range(n)):
            return {devices[i]: devices[(i + shift) % n] for i in range(n)}
    raise DynatrainError(f"buddy copies: the job's {n} devices must span two nodes or more, "
                         f"and no ring puts every device's copy on another node "
                         f"({', '.join(devices[:3])}{', ...' if n > 3 else ''})")


def uncovered(failed: Iterable[str], pairs: dict[str, str]) -> frozenset[str]:
    """The failed devices whose buddy failed too: state only they held is lost even with buddy
    copies (state held by any failed device whose buddy survives comes back from the buddy)."""
    gone = frozenset(failed)
    return frozenset(d for d in gone if pairs.get(d) in gone)
