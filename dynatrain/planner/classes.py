"""Symmetric planning: pairs cut alike kept as one class, their rounds built on first use.

``spread`` cuts every pair of one shape (``link_twins``: the same transfers but for their two
ranks, and the same phase) into the same chunks. A ``PairClass`` keeps those chunks once, with
the first pair's ranks, and lists its members: (source device, destination device, source rank,
destination rank). ``ClassRounds`` is a switch's remote classes plus its local copies: the plan
as data, in size proportional to the distinct shapes plus one small record per pair instead of
one record per transfer per pair.

Its rounds are built one at a time on first use (``LazyRounds``; ``tests/test_symmetry.py``
compares them with cutting every pair alone); what needs only sizes and devices (the plan's
statistics, its link bytes, ``verify``'s data rules) reads the classes instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from heapq import merge
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from .plan import _NBYTES, Message, Round, Transfer, message_order, with_ranks


class Member(NamedTuple):
    """One pair of a class: its two devices and the two ranks its transfers carry."""

    src_device: str
    dst_device: str
    src_rank: int
    dst_rank: int


@dataclass(frozen=True, slots=True)
class PairClass:
    """Pairs cut into the same chunks: ``chunks[i]`` runs in round i, written with the first
    member's ranks; every member runs them with its own two."""

    chunks: tuple[tuple[Transfer, ...], ...]
    members: tuple[Member, ...]

    def chunk_bytes(self) -> tuple[int, ...]:
        """Bytes of each round's chunk (0: the class sends nothing that round)."""
        return tuple([sum(map(_NBYTES, c)) for c in self.chunks])

    def transfers_of(self, i: int, member: Member) -> tuple[Transfer, ...]:
        """Round ``i``'s chunk as ``member`` sends it."""
        c = self.chunks[i]
        head = self.members[0]
        if member.src_rank == head.src_rank and member.dst_rank == head.dst_rank:
            return c
        return with_ranks(c, member.src_rank, member.dst_rank)


_DEVICES = itemgetter(0, 1)


@dataclass(frozen=True)
class ClassRounds:
    """A plan's rounds as classes of pairs plus each device's local copies (round 0)."""

    rounds: int
    classes: tuple[PairClass, ...]
    local: tuple[tuple[str, tuple[Transfer, ...]], ...]  # (device, its copies), by device

    def message_ends(self, i: int) -> list[tuple[str, str, int, Any]]:
        """Round ``i``'s messages, none built, in the round's one order (by source, then
        destination device): (source device, destination device, class index, member) for
        every member of a class that sends in round i, and (device, device, -1, its copies)
        for the local copies in round 0."""
        sends = [bool(c.chunks[i]) for c in self.classes]
        ends = [e for e in self._by_devices if sends[e[2]]]  # a sorted list, filtered
        if i == 0 and self.local:
            ends = list(merge(ends, [(d, d, -1, ts) for d, ts in self.local], key=_DEVICES))
        return ends

    @cached_property
    def _by_devices(self) -> list[tuple[str, str, int, Member]]:
        """Every member of every class by its two devices: each round's messages in order,
        sorted once (no two members share both devices, nor a member a local copy's)."""
        ends = [(m.src_device, m.dst_device, k, m)
                for k, c in enumerate(self.classes) for m in c.members]
        ends.sort(key=_DEVICES)
        return ends

    def round(self, i: int) -> Round:
        """Round ``i``: every class member's chunk i, the local copies in round 0, messages
        by (source, destination) device, run in that one order."""
        ms = tuple(Message(s, d, self.classes[k].transfers_of(i, m) if k >= 0 else m)
                   for s, d, k, m in self.message_ends(i))
        return Round(ms, message_order(ms))

    def order(self, i: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``round(i).order`` from the devices alone (no transfer is built)."""
        return message_order([m if k >= 0 else Member(s, d, -1, -1)
                              for s, d, k, m in self.message_ends(i)])

    @cached_property
    def sized(self) -> "SizedMessages":
        """Every message's round, devices, bytes and transfer count, as arrays (none built)."""
        return SizedMessages.of(self)


@dataclass(frozen=True)
class SizedMessages:
    """A ``ClassRounds``'s messages as numbers, none built: ``devices[src[j]]`` sends to
    ``devices[dst[j]]`` chunk i of class ``klass[j]``, ``sizes[klass[j], i]`` bytes in
    ``counts[klass[j], i]`` transfers (no message where that is 0); ``devices[local[j]]``
    copies ``local_bytes[j]`` bytes in ``local_counts[j]`` transfers in round 0.

    Integer arrays, so that sums over millions of messages are exact and take numpy's time,
    not Python's."""

    devices: tuple[str, ...]
    src: np.ndarray
    dst: np.ndarray
    klass: np.ndarray
    sizes: np.ndarray
    counts: np.ndarray
    local: np.ndarray
    local_bytes: np.ndarray
    local_counts: np.ndarray
    src_rank: np.ndarray  # each member's two ranks, for readers that check them (``verify``)
    dst_rank: np.ndarray

    @classmethod
    def of(cls, body: ClassRounds) -> "SizedMessages":
        index: dict[str, int] = {}
        every = [m for c in body.classes for m in c.members]
        n = len(every)
        # One pass in C per column (millions of members on the largest switches); devices
        # are indexed in the order members name them, source before destination.
        ends = np.fromiter((index.setdefault(d, len(index)) for m in every
                            for d in (m.src_device, m.dst_device)), np.int64, 2 * n)
        klass = np.repeat(np.arange(len(body.classes), dtype=np.int64),
                          [len(c.members) for c in body.classes])
        r = body.rounds
        local = [index.setdefault(d, len(index)) for d, _ in body.local]

        def ints(x) -> np.ndarray:
            return np.array(x, dtype=np.int64)
        chunks = [ch for c in body.classes for ch in c.chunks]  # flat: one list per column
        return cls(tuple(index), ends[0::2].copy(), ends[1::2].copy(), klass,
                   ints([sum(map(_NBYTES, ch)) for ch in chunks]).reshape(-1, r),
                   ints(list(map(len, chunks))).reshape(-1, r),
                   ints(local), ints([sum(t.nbytes for t in ts) for _, ts in body.local]),
                   ints([len(ts) for _, ts in body.local]),
                   np.fromiter((m.src_rank for m in every), np.int64, n),
                   np.fromiter((m.dst_rank for m in every), np.int64, n))

    def totals(self) -> dict[str, int]:
        """Transfers, remote messages, bytes between devices, bytes copied locally."""
        per = np.bincount(self.klass, minlength=len(self.sizes))  # members per class
        remote = np.bincount(self.klass[self.src != self.dst], minlength=len(self.sizes))
        return dict(transfers=int(self.counts.sum(axis=1) @ per + self.local_counts.sum()),
                    messages=int((self.counts > 0).sum(axis=1) @ remote),
                    bytes_moved=int(self.sizes.sum(axis=1) @ remote),
                    bytes_local=int(self.sizes.sum(axis=1) @ (per - remote)
                                    + self.local_bytes.sum()))


class LazyRounds(Sequence):
    """A plan's rounds, each built from its ``ClassRounds`` when first asked for and kept.

    Behaves as the tuple of ``Round`` it stands for: length, indexing, iteration, equality
    with that tuple and its hash."""

    __slots__ = ("body", "_built")

    def __init__(self, body: ClassRounds) -> None:
        self.body = body
        self._built: list[Round | None] = [None] * body.rounds

    def __len__(self) -> int:
        return self.body.rounds

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        r = self._built[i]
        if r is None:
            r = self._built[i] = self.body.round(i)
        return r

    def __iter__(self) -> Iterator[Round]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LazyRounds, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"LazyRounds({len(self)} rounds, {len(self.body.classes)} classes)"

    def streamed(self) -> Iterator[Round]:
        """Each round in turn, built anew and not kept unless already built: for writers
        that visit a plan of millions of messages once, in a round's memory."""
        for i in range(len(self)):
            yield self._built[i] or self.body.round(i)


def each_round(rounds: Sequence[Round]) -> Iterator[Round]:
    """The rounds in turn, without keeping those a ``LazyRounds`` builds."""
    return rounds.streamed() if isinstance(rounds, LazyRounds) else iter(rounds)


def device_orders(rounds: Sequence[Round]) -> Iterator[dict[str, tuple[int, ...]]]:
    """Each round's ``device_order()``; a ``LazyRounds``'s from its devices alone."""
    if isinstance(rounds, LazyRounds):
        return (rounds._built[i].device_order() if rounds._built[i] is not None
                else dict(rounds.body.order(i)) for i in range(len(rounds)))
    return (r.device_order() for r in rounds)


def class_rounds(pairs: Iterable, local: dict[str, list[Transfer]], unit: int,
                 rounds: int) -> ClassRounds:
    """``spread``'s pairs (twins linked) as classes: the first pair of each shape is cut once,
    and its twins join it as members (in the order of ``pairs``)."""
    members: dict[int, list[Member]] = {}
    leaders = {}
    for p in pairs:
        head = p if p.twin is None else p.twin
        t = p.transfers[0]
        if id(head) not in members:
            members[id(head)] = []
            leaders[id(head)] = head
        members[id(head)].append(Member(p.src, p.dst, t.src_rank, t.dst_rank))
    classes = []
    for k, ms in members.items():
        head = leaders[k]
        chunks = head.chunks(rounds, unit)
        h, first = head.transfers[0], ms[0]
        if (first.src_rank, first.dst_rank) != (h.src_rank, h.dst_rank):
            # The chunks carry the first member's ranks (the cut pair may come later, or be
            # another device's: a slice lists only its own device's pairs).
            chunks = [with_ranks(c, first.src_rank, first.dst_rank) for c in chunks]
        classes.append(PairClass(tuple(map(tuple, chunks)), tuple(ms)))
    return ClassRounds(rounds, tuple(classes),
                       tuple((d, tuple(local[d])) for d in sorted(local)))
