"""Coalesce transfers into messages and pack messages into rounds under a staging budget.

Staging model: a remote message is packed into a contiguous buffer on the sender and received
into one on the receiver, so it costs its size on both devices for its round; local copies go
slot to slot and stage nothing. A device's budget is split evenly between sending and receiving;
messages are cut into pieces of at most a quarter of that half, transfers that overflow a piece
into slabs of their box, so that rounds can be balanced finely.

A budget tiny against the state would make those pieces and rounds explode (the packer's time
grows with messages x rounds), so ``check_budget`` bounds both from the transfers alone, before
any piece is cut, and refuses such a budget with the smallest one the plan allows.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from ..ir.box import Box
from ..ir.units import format_bytes, parse_bytes
from .intersect import PlanError
from .cost import Topology
from .plan import Message, Round, Transfer, message_order
from .sources import node_of


def _cut(t: Transfer, room: int) -> tuple[Transfer | None, list[Transfer]]:
    """The largest leading slab of ``t`` within ``room`` bytes, and the rest of ``t`` in order.

    The slab runs along ``t``'s outermost dim longer than 1; where one index of that dim
    holds more than ``room``, the slab is cut from inside the first index. None: not even
    one element fits.
    """
    if t.nbytes <= room:
        return t, []
    box = t.box
    lo, hi = box.lo, box.hi
    d = 0
    while d < len(lo) and hi[d] - lo[d] == 1:
        d += 1
    if d == len(lo) or t.nbytes // box.numel > room:
        return None, [t]
    size = hi[d] - lo[d]
    k = room // (t.nbytes // size)  # whole indices of d that fit
    if k:
        return _sub(t, box, d, box.lo[d], box.lo[d] + k), [_sub(t, box, d, box.lo[d] + k, box.hi[d])]
    head, rest = _cut(_sub(t, box, d, box.lo[d], box.lo[d] + 1), room)
    return head, rest + [_sub(t, box, d, box.lo[d] + 1, box.hi[d])]


def _sub(t: Transfer, box: Box, d: int, lo: int, hi: int) -> Transfer:
    """``t`` restricted to [lo, hi) along dim ``d`` of its box."""
    sub = Box(box.lo[:d] + (lo,) + box.lo[d + 1:], box.hi[:d] + (hi,) + box.hi[d + 1:])
    key, kinds, _, sr, dr, s_slot, s_anchor, d_slot, d_anchor, n = t  # _replace is 3x slower
    return Transfer(key, kinds, sub, sr, dr, s_slot, s_anchor, d_slot, d_anchor,
                    n // (box.hi[d] - box.lo[d]) * (hi - lo))


def _prod(xs: tuple[int, ...]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


# Messages are at most this fraction of a device's per-direction budget. Whole-half messages
# leave rounds lumpy (predicted time up to 1.26x its lower bound on the shipped MoE switch);
# quarters balance them to within 1.07x for 3-5x more messages; eighths gain ~3% more for
# twice as many messages again (more records to plan, verify and post).
PIECES_PER_HALF = 4


def coalesce(transfers: list[Transfer], src_devices: tuple[str, ...],
             dst_devices: tuple[str, ...], budget: int) -> list[Message]:
    """Group transfers per (source device, destination device), cut into pieces of at most
    ``budget // 2 // PIECES_PER_HALF`` bytes (a device's budget is shared by what it sends and
    what it receives). A transfer that overflows a piece is cut: a slab of it fills the piece
    and the rest starts the next, so pieces are full and messages few."""
    by_pair: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(src_devices[t.src_rank], dst_devices[t.dst_rank])].append(t)
    messages = []
    for (s, d), ts in sorted(by_pair.items()):  # transfers keep the planner's order
        if s == d:  # local copies need no staging: one message
            messages.append(Message(s, d, tuple(ts)))
            continue
        piece = max(1, budget // 2 // PIECES_PER_HALF)
        chunk: list[Transfer] = []
        size = 0
        for t in ts:
            if size + t.nbytes <= piece:  # the common case: it fits as it is
                chunk.append(t)
                size += t.nbytes
                continue
            # A tiny budget may not fit one element's kinds in a piece: up to half then.
            per_elem = t.nbytes // max(1, t.box.numel)
            cap = min(budget // 2, max(piece, per_elem))
            if per_elem > cap:
                raise PlanError(f"budget of {budget} bytes is too small to move one element "
                                f"({per_elem} bytes) of {t.key}")
            todo = deque([t])
            while todo:
                cur = todo.popleft()
                if size + cur.nbytes <= cap:
                    chunk.append(cur)
                    size += cur.nbytes
                    continue
                # Fill the piece with a slab of ``cur`` (full pieces: fewer messages to
                # schedule, verify and post), unless little room is left.
                head, rest = _cut(cur, cap - size) if 8 * (cap - size) >= cap else (None, [cur])
                if head is None:  # start a new piece (the chunk is not empty here)
                    messages.append(Message(s, d, tuple(chunk)))
                    chunk, size = [], 0
                    todo.extendleft(reversed(rest))
                    continue
                chunk.append(head)
                size += head.nbytes
                todo.extendleft(reversed(rest))
        if chunk:
            messages.append(Message(s, d, tuple(chunk)))
    return messages


def schedule_rounds(messages: list[Message], budget: int, topo: Topology | None = None
                    ) -> list[Round]:
    """Pack remote messages into rounds so that the sum of round times stays near its bound.

    Each device's budget is split evenly between what it sends and what it receives in a
    round: links run both directions at once, so a round that fills only one direction wastes
    half of it. The busiest direction of the busiest device sets the minimum number of rounds.
    A round lasts as long as its busiest link, so the plan's time is the sum of those maxima.
    Messages of the devices with the most link time go first (they are the hardest to spread
    evenly), largest first among equals, each to the round whose busiest link it lengthens
    least, then where its slower endpoint finishes earliest, among rounds with room. Packing
    starts with the fewest rounds the busiest direction allows; a message that fits in none
    opens one more. If that happened, packing runs once more with every round it ended with
    open from the start, so that traffic spreads evenly over all of them (rounds opened late
    for leftovers each cost a round's latency and their busiest link). Two passes at most:
    growing one round or n/8 at a time took three on the 235B switch.
    """
    topo = topo or Topology()
    local = [m for m in messages if m.local]
    remote = sorted((m for m in messages if not m.local),
                    key=lambda m: (-m.nbytes, m.src_device, m.dst_device))
    half = budget // 2
    devices = sorted({m.src_device for m in remote} | {m.dst_device for m in remote})
    dev_id = {d: i for i, d in enumerate(devices)}
    intra, inter = 1.0 / (topo.intra_node_GBps * 1e9), 1.0 / (topo.inter_node_GBps * 1e9)
    # Per message: sender, receiver, size, and the link counters it loads (4 per device:
    # intra out, intra in, inter out, inter in) with its seconds on them.
    jobs = []
    total_out = [0] * len(devices)
    total_in = [0] * len(devices)
    for m in remote:
        if m.nbytes > half:
            raise PlanError(f"message {m.src_device} -> {m.dst_device} of {m.nbytes} bytes "
                            f"exceeds half the budget ({half} bytes)")
        s, d = dev_id[m.src_device], dev_id[m.dst_device]
        same = node_of(m.src_device) == node_of(m.dst_device)
        link = 0 if same else 2
        jobs.append((s, d, m.nbytes, 4 * s + link, 4 * d + link + 1,
                     m.nbytes * (intra if same else inter)))
        total_out[s] += m.nbytes
        total_in[d] += m.nbytes
    link_seconds = [0.0] * (4 * len(devices))
    for _, _, _, ko, ki, t in jobs:
        link_seconds[ko] += t
        link_seconds[ki] += t
    order = sorted(range(len(jobs)), key=lambda j: (
        -max(link_seconds[jobs[j][3]], link_seconds[jobs[j][4]]), -jobs[j][2], j))
    n = max((-(-v // half) for v in total_out + total_in), default=0)
    ordered = [jobs[j] for j in order]
    placed = _pack(ordered, n, half, len(devices))
    used = max(placed, default=-1) + 1
    if used > n:  # rounds opened late hold leftovers: pack again, all of them open from the start
        placed = _pack(ordered, used, half, len(devices))
    rounds: list[list[Message]] = [[] for _ in range(max(placed, default=-1) + 1)]
    for j, i in zip(order, placed):
        rounds[i].append(remote[j])
    rounds = [r for r in rounds if r] or [[]]
    rounds[0][:0] = local  # local copies run in the first round, beside the exchanges
    out = []
    for r in rounds:
        msgs = tuple(sorted(r, key=lambda m: (m.src_device, m.dst_device)))
        out.append(Round(msgs, message_order(msgs)))
    return out


def _pack(jobs: list[tuple[int, int, int, int, int, float]], n: int, half: int,
          ndev: int) -> list[int]:
    """Round of each job, starting from ``n`` rounds and opening one where a job fits none."""
    # Per device (or link counter), its value in each round: a job scans the rounds of its
    # own two devices and two links, the loop that runs messages x rounds times.
    out_used = [[0] * n for _ in range(ndev)]
    in_used = [[0] * n for _ in range(ndev)]
    busy = [[0.0] * n for _ in range(4 * ndev)]
    longest = [0.0] * n  # each round's busiest link so far
    placed = []
    for s, d, size, ko, ki, t in jobs:
        ou, iu, bo_l, bi_l = out_used[s], in_used[d], busy[ko], busy[ki]
        room_o, room_i = half - size, half - size
        # Score (growth of the round's busiest link, finish time, round) compared inline.
        best, best_grow, best_finish = -1, 0.0, 0.0
        for i, (o, u, bo, bi, top) in enumerate(zip(ou, iu, bo_l, bi_l, longest)):
            if o > room_o or u > room_i:
                continue
            finish = (bo if bo > bi else bi) + t
            grow = finish - top
            if grow < 0.0:
                grow = 0.0
            if best < 0 or grow < best_grow or (grow == best_grow and finish < best_finish):
                best, best_grow, best_finish = i, grow, finish
        if best < 0:  # fits in no round: open one (a job never exceeds half, so it fits)
            for rows in (out_used, in_used, busy):
                for row in rows:
                    row.append(0)
            longest.append(0.0)
            best, best_finish = len(longest) - 1, t
        ou[best] += size
        iu[best] += size
        bo_l[best] += t
        bi_l[best] += t
        if best_finish > longest[best]:
            longest[best] = best_finish
        placed.append(best)
    return placed


def peak_staging(rnd: Round) -> dict[str, int]:
    """Staging bytes per device in one round (remote messages only)."""
    used: dict[str, int] = defaultdict(int)
    for m in rnd.messages:
        if not m.local:
            used[m.src_device] += m.nbytes
            used[m.dst_device] += m.nbytes
    return dict(used)


# ---- budget limits: checked from the transfers, before coalesce cuts them ----------------------

# The most rounds a plan may need. Every round ends in a barrier of all devices at run time;
# the shipped switches need at most 32 at the default 2 GiB (Qwen3-235B TP4 PP8 EP16 -> TP8 PP4
# EP8) and the test suite's small budgets about 340.
MAX_ROUNDS = 1024
# The most messages x rounds the packer may face: it tries each message in each round, about
# 0.6 us a try here, so this is ~2.5 s of packing. At the default 2 GiB the shipped switches
# need at most ~1.1M (Llama-3.1-405B 4096 -> 3072 GPUs: 120k messages in 9 rounds). A device
# sends about 4 pieces a round, so messages >= 4 x rounds: this caps rounds near 1024 too.
MAX_SCHEDULE_STEPS = 1 << 22
# A switch whose device pairs alone exceed MAX_SCHEDULE_STEPS is bounded by its own size
# instead: this many steps per pair of devices that exchange anything (so some budget fits).
STEPS_PER_PAIR = 16


class BudgetTooSmall(PlanError):
    """The budget cannot stage one element, or its plan would need more rounds or scheduling
    steps than ``MAX_ROUNDS`` and ``MAX_SCHEDULE_STEPS`` allow.

    Attributes:
        budget: the budget given, in bytes.
        rounds: the fewest rounds any schedule within ``budget`` needs.
        messages: the fewest messages coalesce would cut with ``budget``.
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
        pairs: (bytes, largest element's bytes, how many pairs) per distinct kind of device
            pair that exchanges anything (pairs of equal demand are counted, not repeated).
        elem_bytes: the largest element (all its kinds) sent between devices.
        elem_key: the tensor that element belongs to.
    """

    busiest_bytes: int
    pairs: tuple[tuple[int, int, int], ...]
    elem_bytes: int
    elem_key: str

    @classmethod
    def of(cls, transfers: list[Transfer], src_devices: tuple[str, ...],
           dst_devices: tuple[str, ...]) -> Demand:
        """One pass over ``transfers``; local copies stage nothing and are left out."""
        pair_bytes: dict[tuple[str, str], int] = defaultdict(int)
        pair_elem: dict[tuple[str, str], int] = defaultdict(int)
        elem, key = 0, ""
        for t in transfers:
            pair = (src_devices[t.src_rank], dst_devices[t.dst_rank])
            if pair[0] == pair[1]:
                continue
            pair_bytes[pair] += t.nbytes
            per_elem = t.nbytes // max(1, t.box.numel)
            if per_elem > pair_elem[pair]:
                pair_elem[pair] = per_elem
                if per_elem > elem:
                    elem, key = per_elem, t.key
        sent: dict[str, int] = defaultdict(int)
        received: dict[str, int] = defaultdict(int)
        for (s, d), n in pair_bytes.items():
            sent[s] += n
            received[d] += n
        kinds = Counter((n, pair_elem[p]) for p, n in pair_bytes.items())
        return cls(max([*sent.values(), *received.values()], default=0),
                   tuple(sorted((n, e, c) for (n, e), c in kinds.items())), elem, key)

    def rounds(self, budget: int) -> int:
        """The fewest rounds any schedule needs: a device sends, and receives, at most half
        the budget a round (``schedule_rounds``' starting count)."""
        return -(-self.busiest_bytes // max(1, budget // 2))

    def messages(self, budget: int) -> int:
        """The fewest messages ``coalesce`` cuts: none exceeds its pair's cap (a piece, or
        one element where that is larger, at most half the budget)."""
        half = max(1, budget // 2)
        piece = max(1, half // PIECES_PER_HALF)
        return sum(c * -(-n // min(half, max(piece, e))) for n, e, c in self.pairs)

    def step_limit(self) -> int:
        """``MAX_SCHEDULE_STEPS``, or ``STEPS_PER_PAIR`` per exchanging pair where more."""
        return max(MAX_SCHEDULE_STEPS, STEPS_PER_PAIR * sum(c for _, _, c in self.pairs))

    def fits(self, budget: int) -> bool:
        """Whether ``budget`` stages every element and its bounds stay within the limits."""
        if not self.pairs:
            return True
        if self.elem_bytes > budget // 2:
            return False
        rounds = self.rounds(budget)
        return rounds <= MAX_ROUNDS and rounds * self.messages(budget) <= self.step_limit()

    def smallest_budget(self) -> int:
        """The smallest budget that ``fits`` (every bound shrinks as the budget grows)."""
        # Here every pair is one piece (half >= 4 x busiest) in one round: steps = pairs.
        lo, hi = 0, 8 * (self.busiest_bytes + self.elem_bytes) + 16
        while hi - lo > 1:  # fits(hi), not fits(lo)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.fits(mid) else (mid, hi)
        return hi


def check_budget(transfers: list[Transfer], src_devices: tuple[str, ...],
                 dst_devices: tuple[str, ...], budget: int) -> Demand:
    """Refuse ``budget`` if it cannot stage one element, or if the plan would need more than
    ``MAX_ROUNDS`` rounds or ``MAX_SCHEDULE_STEPS`` messages x rounds, before ``coalesce``
    cuts anything (a tiny budget explodes the pieces, and the packer's time with them).

    Raises:
        BudgetTooSmall: one line with the budget, the rounds and messages it needs at least,
            the limits, and the smallest budget this plan allows (rounded up to a size
            ``format_bytes`` writes exactly; it passes this check).

    Example:
        >>> check_budget(transfers, src.devices, dst.devices, 256)  # doctest: +SKIP
        BudgetTooSmall: --budget 256 B is too small for this switch: it needs at least ...
    """
    need = Demand.of(transfers, src_devices, dst_devices)
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
    else:
        text = (f"--budget {given} is too small for this switch: it needs at least {rounds:,} "
                f"rounds and {messages:,} messages ({rounds * messages:,} messages x rounds to "
                f"schedule), over the planner's limit of {MAX_ROUNDS:,} rounds and "
                f"{need.step_limit():,} messages x rounds{tail}")
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
