"""The budget's limits on a plan, checked from the transfers before any is cut.

Staging model: a remote message is packed into a contiguous buffer on the sender and received
into one on the receiver, so it costs its size on both devices for its round; local copies go
slot to slot and stage nothing. A device's budget is split evenly between sending and receiving
(``spread`` cuts every pair's traffic into rounds within those halves).

A budget tiny against the state would make the rounds and the messages explode, so
``check_budget`` bounds both from the transfers alone (the pipeline: from its pairs of devices,
``Demand.of_pairs``), before any transfer is cut, and refuses such a budget with the smallest
one the plan allows.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.box import Box, new_box
from ..ir.units import format_bytes, parse_bytes
from .intersect import PlanError
from .plan import Round, Transfer


def _sub(t: Transfer, box: Box, d: int, lo: int, hi: int) -> Transfer:
    """``t`` restricted to [lo, hi) along dim ``d`` of its box."""
    # Hundreds of thousands of calls per large plan: list copies and a Transfer built as a
    # tuple are 1.4x faster than slicing the bounds and calling the constructor.
    a, z = [*box.lo], [*box.hi]
    a[d], z[d] = lo, hi
    key, kinds, _, sr, dr, s_slot, s_anchor, d_slot, d_anchor, n = t  # _replace is 3x slower
    return _new(Transfer, (key, kinds, new_box((*a,), (*z,)), sr, dr, s_slot, s_anchor, d_slot,
                           d_anchor, n // (box.hi[d] - box.lo[d]) * (hi - lo)))


_new = tuple.__new__


def peak_staging(rnd: Round) -> dict[str, int]:
    """Staging bytes per device in one round (remote messages only)."""
    used: dict[str, int] = defaultdict(int)
    for m in rnd.messages:
        if not m.local:
            used[m.src_device] += m.nbytes
            used[m.dst_device] += m.nbytes
    return dict(used)


# ---- budget limits: checked from the transfers, before spread cuts them ------------------------

# The most rounds a plan may need. Every round ends in a barrier of all devices at run time;
# the shipped switches need at most 27 at the default 2 GiB (Qwen3-235B TP4 PP8 EP16 -> TP8 PP4
# EP8) and the test suite's small budgets a few hundred.
MAX_ROUNDS = 1024
# The most pairs x rounds the planner may face: ``spread`` computes each pair's share of each
# round (a few us each here), and a plan has up to that many messages. At the default 2 GiB the
# shipped switches need at most ~0.25M (Llama-3.1-405B 4096 -> 3072 GPUs).
MAX_SCHEDULE_STEPS = 1 << 22
# A switch whose device pairs alone exceed MAX_SCHEDULE_STEPS is bounded by its own size
# instead: this many steps per pair of devices that exchange anything (so some budget fits).
STEPS_PER_PAIR = 16
# ``spread``'s cut unit: half the budget / (this x the most pairs one device has in one
# direction). A chunk exceeds its even share by at most about two units, so a device's pairs
# together waste at most ~1/16 of its half budget a round.
UNITS_PER_HALF = 32


def unit_bytes(budget: int, peers: int) -> int:
    """The cut unit for ``budget`` when no device has more than ``peers`` pairs in one
    direction (a number every device agrees on before it cuts)."""
    return max(1, budget // 2 // (UNITS_PER_HALF * max(1, peers)))


class BudgetTooSmall(PlanError):
    """The budget cannot stage one element, or its plan would need more rounds or steps than
    ``MAX_ROUNDS`` and ``MAX_SCHEDULE_STEPS`` allow.

    Attributes:
        budget: the budget given, in bytes.
        rounds: the most rounds the planner may need within ``budget`` (0: it cannot fit).
        messages: the fewest messages any plan has (one per pair of devices).
        smallest: the smallest budget (bytes) whose bounds fit every limit.
        suggested: ``smallest`` rounded up to a size ``format_bytes`` writes exactly.
    """

    def __init__(self, message: str, budget: int, rounds: int, messages: int, smallest: int,
                 suggested: int) -> None:
        super().__init__(message)
        self.budget, self.rounds, self.messages = budget, rounds, messages
        self.smallest, self.suggested = smallest, suggested


@dataclass(frozen=True, slots=True)
class Demand:
    """What a plan's transfers between devices ask of a staging budget, before any cutting.

    Attributes:
        busiest_bytes: the most bytes one device sends, or receives, over the whole switch.
        sides: (bytes, largest element of each of its pairs, how many) per distinct kind of
            device side (one device's sends, or its receives), equal sides counted once.
        peers: the most pairs one device has in one direction.
        pairs: pairs of devices that exchange anything.
        elem_bytes: the largest element (all its kinds) sent between devices.
        elem_key: the tensor that element belongs to.
    """

    busiest_bytes: int
    sides: tuple[tuple[int, tuple[int, ...], int], ...]
    peers: int
    pairs: int
    elem_bytes: int
    elem_key: str

    @classmethod
    def of(cls, transfers: list[Transfer], src_devices: tuple[str, ...],
           dst_devices: tuple[str, ...]) -> Demand:
        """One pass over ``transfers``; local copies stage nothing and are left out."""
        pair_bytes: dict[tuple[str, str], int] = defaultdict(int)
        pair_elem: dict[tuple[str, str], int] = defaultdict(int)
        elem, key = 0, ""
        # Bytes per element depend on (key, kinds) alone (their dtypes): one numel each.
        sizes: dict[tuple[str, tuple[str, ...]], int] = {}
        for t in transfers:
            pair = (src_devices[t.src_rank], dst_devices[t.dst_rank])
            if pair[0] == pair[1]:
                continue
            pair_bytes[pair] += t.nbytes
            per_elem = sizes.get((t.key, t.kinds))
            if per_elem is None:
                per_elem = sizes[(t.key, t.kinds)] = t.nbytes // max(1, t.box.numel)
            if per_elem > pair_elem[pair]:
                pair_elem[pair] = per_elem
            if (per_elem, key) > (elem, t.key):  # the largest, the least key among equals
                elem, key = per_elem, t.key
        return cls._of_sides(((s, d, n, pair_elem[(s, d)]) for (s, d), n in pair_bytes.items()),
                             len(pair_bytes), elem, key)

    @classmethod
    def of_pairs(cls, pairs: Iterable) -> Demand:
        """The same from the remote pairs (``spread.Pair``: ``src``, ``dst``, ``nbytes``,
        ``elem`` and ``elem_key`` of its transfers), without a pass over the transfers."""
        elem, key, n = 0, "", 0
        sides = []
        for p in pairs:
            n += 1
            sides.append((p.src, p.dst, p.nbytes, p.elem))
            if (p.elem, key) > (elem, p.elem_key):
                elem, key = p.elem, p.elem_key
        return cls._of_sides(sides, n, elem, key)

    @classmethod
    def _of_sides(cls, pairs: Iterable[tuple[str, str, int, int]], count: int, elem: int,
                  key: str) -> Demand:
        """From (source device, destination device, bytes, largest element) per pair."""
        sides: dict[tuple[str, str], list] = {}  # ("out"/"in", device) -> [bytes, elems]
        for s, d, n, e in pairs:
            for side in (("out", s), ("in", d)):
                acc = sides.get(side)
                if acc is None:
                    acc = sides[side] = [0, []]
                acc[0] += n
                acc[1].append(e)
        kinds = Counter((n, tuple(sorted(es))) for n, es in sides.values())
        return cls(max((n for n, _ in sides.values()), default=0),
                   tuple(sorted((n, es, c) for (n, es), c in kinds.items())),
                   max((len(es) for _, es in sides.values()), default=0), count, elem, key)

    def unit(self, budget: int) -> int:
        return unit_bytes(budget, self.peers)

    def least_rounds(self, budget: int) -> int:
        """The fewest rounds any schedule needs: a device sends, and receives, at most half
        the budget a round."""
        return -(-self.busiest_bytes // max(1, budget // 2))

    def rounds(self, budget: int) -> int:
        """The most rounds ``spread`` may need (0: a device cannot fit its chunks at all).

        A pair's chunk holds at most its even share plus one unit (edges on the unit grid)
        plus twice its cut tolerance (``spread.split``); at R rounds a side holds at most
        bytes / R + that slack, so R = bytes / (half - slack) fits every side.
        """
        half, u = budget // 2, self.unit(budget)
        most = 1
        for n, elems, _ in self.sides:
            slack = sum(u + 2 * max(u // 2, e) for e in elems)
            if slack >= half:
                return 0
            most = max(most, -(-n // (half - slack)))
        return most

    def messages(self, budget: int) -> int:
        """The fewest messages any plan has: one per pair of devices that exchange."""
        return self.pairs

    def step_limit(self) -> int:
        """``MAX_SCHEDULE_STEPS``, or ``STEPS_PER_PAIR`` per exchanging pair where more."""
        return max(MAX_SCHEDULE_STEPS, STEPS_PER_PAIR * self.pairs)

    def fits(self, budget: int) -> bool:
        """Whether ``budget`` stages every element and its bounds stay within the limits."""
        if not self.pairs:
            return True
        if self.elem_bytes > budget // 2:
            return False
        rounds = self.rounds(budget)
        return 0 < rounds <= MAX_ROUNDS and rounds * self.pairs <= self.step_limit()

    def smallest_budget(self) -> int:
        """The smallest budget that ``fits`` (every bound shrinks as the budget grows)."""
        hi = 2 * (self.busiest_bytes + self.elem_bytes) + 16
        while not self.fits(hi):  # many pairs per device: their slack needs more
            hi *= 2
        lo = 0  # fits(hi), not fits(lo)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.fits(mid) else (mid, hi)
        return hi


def check_budget(transfers: list[Transfer], src_devices: tuple[str, ...],
                 dst_devices: tuple[str, ...], budget: int) -> Demand:
    """Refuse ``budget`` if it cannot stage one element, or if the plan would need more than
    ``MAX_ROUNDS`` rounds or ``MAX_SCHEDULE_STEPS`` pairs x rounds, before ``spread`` cuts
    anything (a tiny budget explodes the chunks, and the planner's time with them).

    Raises:
        BudgetTooSmall: one line with the budget, the rounds and messages it needs at least,
            the limits, and the smallest budget this plan allows (rounded up to a size
            ``format_bytes`` writes exactly; it passes this check).

    Example:
        >>> check_budget(transfers, src.devices, dst.devices, 256)  # doctest: +SKIP
        BudgetTooSmall: --budget 256 B is too small for this switch: it needs at least ...
    """
    return check_demand(Demand.of(transfers, src_devices, dst_devices), budget)


def check_demand(need: Demand, budget: int) -> Demand:
    """``check_budget`` of a demand already computed (the pipeline's, from its pairs)."""
    if need.fits(budget):
        return need
    smallest = need.smallest_budget()
    suggested = _round_up(smallest)
    typed = format_bytes(suggested).replace(" ", "")
    tail = (f"; the smallest budget this plan allows is {format_bytes(suggested)} "
            f"(--budget {typed})")
    given = format_bytes(budget)
    if _round_up(budget) != budget:  # not written exactly: say the bytes too
        given = f"{budget} B ({given})"
    rounds, messages = need.rounds(budget), need.messages(budget)
    if need.elem_bytes > budget // 2:
        text = (f"--budget {given} is too small to move one element ({need.elem_bytes} bytes) "
                f"of {need.elem_key}: a device stages what it sends in half the budget and "
                f"what it receives in the other half{tail}")
    elif rounds == 0:
        text = (f"--budget {given} is too small for this switch: a device exchanges with "
                f"{need.peers:,} others, and half the budget cannot stage a round's piece of "
                f"each{tail}")
    else:
        text = (f"--budget {given} is too small for this switch: spreading its {messages:,} "
                f"pairs of devices over rounds may take up to {rounds:,} rounds "
                f"({rounds * messages:,} pairs x rounds), over the planner's limit of "
                f"{MAX_ROUNDS:,} rounds and {need.step_limit():,} pairs x rounds{tail}")
    raise BudgetTooSmall(text, budget, rounds, messages, smallest, suggested)


def _round_up(n: int) -> int:
    """The smallest size >= ``n`` that ``format_bytes`` writes exactly (one decimal of its
    unit, read back by ``parse_bytes``): a budget the user can type as shown."""
    unit, name = 1, "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if n < 1024 * unit:
            break
        unit, name = unit * 1024, bigger
    if unit == 1:
        return n
    tenths = -(-n * 10 // unit)
    while (v := parse_bytes(f"{tenths / 10:.1f}{name}")) < n:  # float parsing rounds down
        tenths += 1
    return v
