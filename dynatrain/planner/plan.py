"""Plans as data: frozen transfer records grouped into messages and rounds.

A ``Transfer`` moves one box of one logical tensor (for one or more state kinds that share the
box) from a slot on a source rank to a slot on a destination rank. The transfers from one
device to another in one round form a ``Message`` (``spread`` cuts each pair's traffic into
round chunks); ``Round``s run one after another, each within the per-device staging budget. Everything is hashable and
serializable (``dynatrain.planner.serialize``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple

from ..ir.box import Box
from ..ir.slots import Slot


class Transfer(NamedTuple):
    """Copy ``box`` of ``key`` for ``kinds`` from a source region to a destination region.

    A region is a slot plus the box (its anchor) stored there; ``box`` lies inside both anchors,
    so the runtime views each slot's storage with its anchor's shape and slices ``box`` out.
    (A named tuple rather than a dataclass: large plans hold hundreds of thousands of these,
    and a tuple is built four times faster.)
    """

    key: str
    kinds: tuple[str, ...]
    box: Box
    src_rank: int
    dst_rank: int
    src_slot: Slot
    src_anchor: Box
    dst_slot: Slot
    dst_anchor: Box
    nbytes: int

    def __str__(self) -> str:
        return f"{self.key}{self.box} [{','.join(self.kinds)}] r{self.src_rank}->r{self.dst_rank}"


_NBYTES = itemgetter(9)  # Transfer.nbytes, read without a generator frame per transfer


def with_ranks(transfers, src_rank: int, dst_rank: int) -> tuple[Transfer, ...]:
    """``transfers`` sent from ``src_rank`` to ``dst_rank`` instead (the pairs of one class,
    ``classes``, send the same transfers but for their two ranks)."""
    new = tuple.__new__  # a Transfer built field by field: 3x faster than _replace
    return tuple(new(Transfer, (t[0], t[1], t[2], src_rank, dst_rank, t[5], t[6], t[7], t[8],
                                t[9])) for t in transfers)


@dataclass(frozen=True, slots=True)
class Message:
    """All transfers from one source device to one destination device in a round."""

    src_device: str
    dst_device: str
    transfers: tuple[Transfer, ...]
    # Summed once: the scheduler, cost model and verifier ask for it hundreds of thousands
    # of times on large plans.
    nbytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(map(_NBYTES, self.transfers)))

    @property
    def local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True, slots=True)
class Round:
    """Messages that run together; a device's staging in a round stays within the budget.

    ``order`` gives, per device, the indices (into ``messages``) of the messages it sends or
    receives, in the order it runs them. A runtime that blocks on each message until its peer
    arrives needs every two devices to agree on the order of what they share; the verifier
    proves that they do (no cycle of waits). Empty means the order of ``messages``.
    """

    messages: tuple[Message, ...]
    order: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def device_order(self) -> dict[str, tuple[int, ...]]:
        """Per device, its message indices in run order (``order``, or the default)."""
        if self.order:
            return dict(self.order)
        return dict(message_order(self.messages))


def message_order(messages: tuple[Message, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every device runs its messages in ``messages`` order (a local copy counts once).

    One global sequence cannot deadlock: the first unfinished message in it is the first
    unfinished one of both its devices.
    """
    per: dict[str, list[int]] = {}
    for i, m in enumerate(messages):
        per.setdefault(m.src_device, []).append(i)
        if m.dst_device != m.src_device:
            per.setdefault(m.dst_device, []).append(i)
    return tuple((d, tuple(ix)) for d, ix in sorted(per.items()))


@dataclass(frozen=True)
class Plan:
    """A complete transition plan from ``src`` to ``dst`` (spec names/paths for reference)."""

    src_name: str
    dst_name: str
    src_devices: tuple[str, ...]
    dst_devices: tuple[str, ...]
    rounds: tuple[Round, ...]
    budget_bytes: int
    # State kinds the destination rebuilds instead of receiving: ("param",) means cast each
    # rank's main params to the param dtype, then all-gather over DP (Megatron's param sync).
    derived: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict, compare=False, hash=False)
    # The rounds as classes of pairs cut alike (``classes.ClassRounds``), when ``rounds`` is
    # built from them (``classes.LazyRounds``); None for rounds given any other way, so that a
    # plan whose rounds were replaced is never read through classes that no longer describe it.
    classes: object = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.classes is not None and getattr(self.rounds, "body", None) is not self.classes:
            object.__setattr__(self, "classes", None)

    def messages(self):
        for rnd in self.rounds:
            yield from rnd.messages

    @cached_property
    def round_links(self) -> tuple[dict, ...]:
        """Per round, the bytes each device moves over each of its links
        (``cost.link_bytes``), computed once: the cost model, the lower bound, the summary
        and ``--per-device`` all read it (a plan never changes)."""
        from .cost import link_bytes  # cost imports this module
        if self.classes is not None:
            return self.link_table.dicts()
        return tuple(link_bytes(r.messages) for r in self.rounds)

    @cached_property
    def link_table(self):
        """``round_links`` as numbers (``cost.LinkTable``), which the cost model reads; from
        the classes' sizes when the plan has them, no message nor ``LinkBytes`` built."""
        from .cost import LinkTable, class_link_table  # cost imports this module
        if self.classes is not None:
            return class_link_table(self.classes)
        return LinkTable.of(self.round_links)
