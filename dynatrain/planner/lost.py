"""State with no surviving copy: which devices failed, and exactly what went with them.

A device that dies without notice sends nothing. Parameters usually survive on a DP replica, but
the DistributedOptimizer keeps each optimizer shard (main_param, exp_avg, exp_avg_sq) once per
DP group, and with DP=1 whole stages exist once (a tied embedding's copy on the last stage
counts as a copy). The planner (``intersect``) finds the pieces of destination state whose every
source holder failed; this module turns them into a ``LostState``
report in logical tensor coordinates (boxes of the global tensor, disjoint, merged where they
abut) and raises ``StateLost`` (exit status 3) rather than plan around them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.box import Box
from ..ir.errors import EXIT_LOST, DynatrainError
from ..ir.layout import DTYPE_BYTES
from ..ir.units import format_bytes

KIND_ORDER = ("param", "main_param", "exp_avg", "exp_avg_sq", "buffer", "step")


@dataclass(frozen=True, slots=True)
class LostEntry:
    """The elements of logical tensor (``key``, ``kind``) no survivor holds: disjoint boxes."""

    key: str
    kind: str
    boxes: tuple[Box, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)


@dataclass(frozen=True, slots=True)
class LostState:
    """Everything the destination needs that no surviving device holds.

    ``entries`` are sorted by key, then kind; ``failed`` are the failed devices, sorted.
    """

    entries: tuple[LostEntry, ...]
    failed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def keys(self) -> tuple[str, ...]:
        """Checkpoint keys with something lost, in order."""
        return tuple(dict.fromkeys(e.key for e in self.entries))

    @property
    def kinds(self) -> tuple[str, ...]:
        """State kinds with something lost, in ``KIND_ORDER`` (others after, sorted)."""
        have = {e.kind for e in self.entries}
        return tuple(k for k in dict.fromkeys((*KIND_ORDER, *sorted(have))) if k in have)

    def summary(self) -> str:
        """One line: how many tensors, how many bytes of which kinds, the first lost box."""
        if not self.entries:
            return "state lost: nothing"
        n = len(self.keys)
        first = self.entries[0]
        return (f"state lost: {n} tensor{'s' if n != 1 else ''}, {format_bytes(self.nbytes)} of "
                f"{'/'.join(self.kinds)} have no surviving copy (first: {first.key}"
                f"{first.boxes[0]})")

    def to_text(self) -> str:
        """The summary, the failed devices, then a few lines per tensor (kinds that lost the
        same boxes share a line)."""
        lines = [self.summary()]
        if self.failed:
            lines.append(f"  failed devices: {', '.join(self.failed)}")
        groups: dict[tuple[str, tuple[Box, ...]], list[LostEntry]] = {}
        for e in self.entries:
            groups.setdefault((e.key, e.boxes), []).append(e)
        for (key, boxes), es in groups.items():
            kinds = ", ".join(e.kind for e in es)
            elems = sum(b.numel for b in boxes)
            lines.append(f"  {key} [{kinds}]: {elems} elements, "
                         f"{format_bytes(sum(e.nbytes for e in es))}, {len(boxes)} box"
                         f"{'es' if len(boxes) != 1 else ''}")
            shown = ", ".join(str(b) for b in boxes[:4])
            more = f", ... and {len(boxes) - 4} more" if len(boxes) > 4 else ""
            lines.append(f"      {shown}{more}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """Plain data (``from_json`` reads it back). Boxes are written as their text,
        ``"[0:2, 176:352, 0:128]"`` (half-open, per dimension): readable, and shallow enough
        for a plan's summary."""
        return {"failed": list(self.failed), "bytes": self.nbytes, "elements": self.numel,
                "tensors": [{"key": e.key, "kind": e.kind, "elements": e.numel,
                             "bytes": e.nbytes, "boxes": [str(b) for b in e.boxes]}
                            for e in self.entries]}

    @classmethod
    def from_json(cls, doc: dict) -> "LostState":
        """The report ``to_json`` wrote.

        Raises:
            DynatrainError: ``doc`` is not such a report, or an entry's boxes overlap (its
                elements, bytes and any refill from it would count the overlap twice): one
                line naming the field.
        """
        try:
            entries = tuple(LostEntry(str(t["key"]), str(t["kind"]),
                                      tuple(parse_box(b) for b in t["boxes"]), int(t["bytes"]))
                            for t in doc["tensors"])
            lost = cls(entries, tuple(str(d) for d in doc.get("failed", ())))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise DynatrainError(f"summary.lost: not a lost-state report ({e!r})") from None
        for e in lost.entries:
            if len({len(b.lo) for b in e.boxes}) > 1:
                raise DynatrainError(f"summary.lost: {e.key} [{e.kind}]: its boxes differ in "
                                     "their number of dimensions")
            pair = first_overlap(e.boxes)
            if pair is not None:
                raise DynatrainError(f"summary.lost: {e.key} [{e.kind}]: boxes {pair[0]} and "
                                     f"{pair[1]} overlap (a lost report's boxes are disjoint)")
        return lost


def parse_box(text: str) -> Box:
    """The box ``str(Box)`` wrote: ``"[0:2, 176:352]"``; ``"[]"`` for a scalar.

    Raises:
        ValueError: not such a text, or an empty or inverted interval.
    """
    if not (isinstance(text, str) and text.startswith("[") and text.endswith("]")):
        raise ValueError(f"a box is written [lo:hi, ...], got {text!r}")
    body = text[1:-1].strip()
    dims = [d.split(":") for d in body.split(",")] if body else []
    if any(len(d) != 2 for d in dims):
        raise ValueError(f"a box is written [lo:hi, ...], got {text!r}")
    lo, hi = tuple(int(a) for a, _ in dims), tuple(int(b) for _, b in dims)
    if any(not 0 <= a < b for a, b in zip(lo, hi)):
        raise ValueError(f"a box needs 0 <= lo < hi in every dimension, got {text!r}")
    return Box(lo, hi)


class StateLost(DynatrainError):
    """Some state the destination needs has no surviving copy (exit status 3).

    ``lost``: the ``LostState`` report; ``str(err)`` is its one-line summary.
    """

    exit_code = EXIT_LOST

    def __init__(self, lost: LostState) -> None:
        self.lost = lost
        super().__init__(lost.summary())


def lost_state(pieces: Iterable[tuple[str, tuple[str, ...], Box]],
               dtypes: dict[tuple[str, str], str], failed: Iterable[str] = ()) -> LostState:
    """The report of lost ``pieces`` (key, kinds, box), which may repeat and overlap.

    ``dtypes``: each (key, kind)'s dtype, for the bytes.
    """
    by_tensor: dict[tuple[str, str], set[Box]] = defaultdict(set)
    for key, kinds, box in pieces:
        for k in kinds:
            by_tensor[(key, k)].add(box)
    rank = {k: i for i, k in enumerate(KIND_ORDER)}
    entries = []
    for key, kind in sorted(by_tensor, key=lambda tk: (tk[0], rank.get(tk[1], 99), tk[1])):
        boxes = tuple(merge_boxes(disjoint_union(by_tensor[(key, kind)])))
        size = DTYPE_BYTES.get(dtypes.get((key, kind), ""), 8)
        entries.append(LostEntry(key, kind, boxes, size * sum(b.numel for b in boxes)))
    return LostState(tuple(entries), tuple(sorted(set(failed))))


# ---- boxes --------------------------------------------------------------------------------------


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most two per dimension)."""
    cut = a & b
    if cut is None:
        return [a]
    out = []
    lo, hi = list(a.lo), list(a.hi)
    for d in range(len(lo)):
        if lo[d] < cut.lo[d]:
            out.append(Box(tuple(lo), tuple(hi[:d] + [cut.lo[d]] + hi[d + 1:])))
            lo[d] = cut.lo[d]
        if cut.hi[d] < hi[d]:
            out.append(Box(tuple(lo[:d] + [cut.hi[d]] + lo[d + 1:]), tuple(hi)))
            hi[d] = cut.hi[d]
    return out


def first_overlap(boxes: Iterable[Box]) -> tuple[Box, Box] | None:
    """Two of ``boxes`` (of one rank) that share an element, or None if they are pairwise
    disjoint. A sweep along dim 0: only boxes reaching past one's start there can meet it."""
    ordered = sorted(boxes)
    if len(ordered) > 1 and not ordered[0].lo:  # scalars: any two are the same element
        return ordered[0], ordered[1]
    active: list[Box] = []
    for b in ordered:  # lo[0] never decreases
        active = [a for a in active if a.hi[0] > b.lo[0]]
        for a in active:
            if a.meets(b):
                return a, b
        active.append(b)
    return None


def disjoint_union(boxes: Iterable[Box]) -> list[Box]:
    """The union of ``boxes`` as disjoint boxes, sorted.

    Boxes of one layout are mostly equal or disjoint (DP replicas, TP slices), so after
    dropping repeats the pairwise subtraction rarely cuts anything; boxes of different
    layers/experts (leading dims where every box has extent 1) are never compared.
    """
    distinct = sorted(set(boxes))
    if not distinct:
        return []
    ndim = len(distinct[0].lo)
    if ndim == 0:  # a scalar (optimizer.step)
        return distinct
    k = 0
    while k < ndim - 1 and all(b.hi[k] - b.lo[k] == 1 for b in distinct):
        k += 1
    groups: dict[tuple[int, ...], list[Box]] = defaultdict(list)
    for b in distinct:
        groups[b.lo[:k]].append(b)
    out: list[Box] = []
    for members in groups.values():
        # Sweep along dim k (members are sorted by lo): only boxes reaching past this one's
        # start can overlap it.
        active: list[Box] = []
        for b in members:
            active = [a for a in active if a.hi[k] > b.lo[k]]
            pieces = [b]
            for other in active:
                if other & b is not None:
                    pieces = [p for q in pieces for p in subtract(q, other)]
            active.extend(pieces)
            out.extend(pieces)
    return sorted(out)


def merge_boxes(boxes: list[Box]) -> list[Box]:
    """Disjoint boxes with abutting neighbours merged (equal in every dim but one), sorted."""
    cur = sorted(boxes)
    for d in reversed(range(len(cur[0].lo) if cur else 0)):
        lines: dict[tuple, list[Box]] = defaultdict(list)
        for b in cur:
            lines[(b.lo[:d] + b.lo[d + 1:], b.hi[:d] + b.hi[d + 1:])].append(b)
        cur = []
        for line in lines.values():
            line.sort(key=lambda b: b.lo[d])
            run = line[0]
            for b in line[1:]:
                if b.lo[d] == run.hi[d]:
                    run = Box(run.lo, run.hi[:d] + (b.hi[d],) + run.hi[d + 1:])
                else:
                    cur.append(run)
                    run = b
            cur.append(run)
    return sorted(cur)


# ---- failed devices -----------------------------------------------------------------------------


def expand_failed(failed: str | Iterable[str], devices: Iterable[str]) -> frozenset[str]:
    """The failed devices a ``--failed`` list names: ``node3`` means every device of node3,
    ``node5:gpu2`` that one device.

    Args:
        failed: comma-separated text (``"node3,node5:gpu2"``) or a list of such names.
        devices: the devices the names may refer to (the source layout's).

    Raises:
        DynatrainError: a name is empty or matches no device or node (one line naming
            ``--failed``).

    Example:
        >>> sorted(expand_failed("node1", ["node0:gpu0", "node1:gpu0", "node1:gpu1"]))
        ['node1:gpu0', 'node1:gpu1']
    """
    devices = tuple(devices)
    names = failed.split(",") if isinstance(failed, str) else list(failed)
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in devices:
        by_node[d.split(":", 1)[0]].append(d)
    known = set(devices)
    out: set[str] = set()
    for raw in names:
        name = str(raw).strip()
        if name in known:
            out.add(name)
        elif name in by_node:
            out.update(by_node[name])
        else:
            what = "an empty name" if not name else repr(name)
            raise DynatrainError(f"--failed: {what} is no device or node of the source layout "
                                 f"(devices look like {devices[0] if devices else 'node0:gpu0'}"
                                 ", nodes like " + (devices[0].split(':', 1)[0] if devices
                                                    else "node0") + ")")
    return frozenset(out)


def check_failed(failed: frozenset[str], src_devices: tuple[str, ...],
                 dst_devices: tuple[str, ...]) -> frozenset[int]:
    """The source ranks on ``failed`` devices.

    Raises:
        DynatrainError: a failed device is not a source device, or the destination places a
            rank on one (the destination must be chosen on survivors).
    """
    unknown = sorted(failed - set(src_devices))
    if unknown:
        raise DynatrainError(f"failed: {unknown[0]} is not a device of the source layout")
    on_failed = [(r, d) for r, d in enumerate(dst_devices) if d in failed]
    if on_failed:
        r, d = on_failed[0]
        more = f" (and {len(on_failed) - 1} more ranks)" if len(on_failed) > 1 else ""
        raise DynatrainError(f"failed: the destination layout places rank {r} on failed device "
                             f"{d}{more}; choose a destination on surviving devices")
    return frozenset(r for r, d in enumerate(src_devices) if d in failed)
