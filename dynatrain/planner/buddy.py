"""Buddy pairs: which device keeps a copy of which device's optimizer state between steps.

A job with one DistributedOptimizer instance holds each optimizer shard once, so a failed device
takes its shard with it. DynaTrain's buddy copies (``runtime.megatron.buddy``) send every
device's non-parameter state after each step to its *buddy*, a device on another node; this
module picks the pairs and says what a set of failed devices still loses with them. Pure
Python: ``suggest`` and ``plan`` report it without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..ir.errors import DynatrainError
from .sources import node_of


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


def check_buddy_spec(spec) -> None:
    """The rules a layout must meet to keep buddy copies (``runtime.megatron.buddy``).

    Raises:
        DynatrainError: one line naming the field and the rule.
    """
    st = spec.state
    if not spec.parallel.use_distributed_optimizer:
        raise DynatrainError("buddy copies: parallel.use_distributed_optimizer must be true "
                             "(without it every optimizer state is a module-shaped tensor "
                             "replicated over data parallel: no shard to copy)")
    if st.main_param != "fp32" or st.param == "fp32":
        raise DynatrainError("buddy copies: state.param must be bf16 or fp16 with fp32 main "
                             "params (the parameters are derived from them after a recovery)")


@dataclass(frozen=True)
class BuddyCover:
    """What buddy copies would restore when ``failed`` devices of a layout die."""

    failed: frozenset[str]
    holders: dict[str, str]  # failed device -> its buddy where that survives, in rank order
    uncovered: tuple[str, ...]  # failed devices whose buddy failed too, in rank order
    why_none: str | None  # the layout keeps no copies, and why

    def line(self) -> str:
        """One line for ``plan`` and ``suggest``."""
        if self.why_none is not None:
            return f"with buddy copies: none on this layout ({self.why_none})"
        if not self.uncovered:
            nodes = list(dict.fromkeys(node_of(h) for h in self.holders.values()))
            return (f"with buddy copies (LiveSwitcher(buddy=True)): nothing is lost; the "
                    f"{len(self.failed)} failed devices' state comes back from their buddies "
                    f"on {', '.join(nodes[:4])}{', ...' if len(nodes) > 4 else ''}")
        gone = self.uncovered
        return (f"with buddy copies: {len(gone)} failed devices lost their buddy too "
                f"({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}): what only they "
                "held is lost as above")

    def to_json(self) -> dict:
        return {"why_none": self.why_none, "uncovered": list(self.uncovered),
                "holders": dict(self.holders)}


def cover(spec, devices: Sequence[str], failed: Iterable[str]) -> BuddyCover:
    """What buddy copies on ``spec``'s layout (running on ``devices``) restore of ``failed``."""
    gone = frozenset(failed)
    try:
        check_buddy_spec(spec)
        pairs = buddy_pairs(devices)
    except DynatrainError as err:
        in_order = tuple(d for d in devices if d in gone)
        return BuddyCover(gone, {}, in_order, str(err).removeprefix("buddy copies: "))
    lost = uncovered(gone, pairs)
    return BuddyCover(gone, {d: pairs[d] for d in devices if d in gone - lost},
                      tuple(d for d in devices if d in lost), None)
