"""Coalesce transfers into messages and pack messages into rounds under a staging budget.

Staging model: a remote message is packed into a contiguous buffer on the sender and received
into one on the receiver, so it costs its size on both devices for its round; local copies go
slot to slot and stage nothing. A device's budget is split evenly between sending and receiving;
messages larger than half the budget are split at transfer boundaries, and single transfers
larger than that are cut into slabs of their box.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.box import Box
from .intersect import PlanError
from .cost import Topology
from .plan import Message, Round, Transfer, message_order
from .sources import node_of


def _split_transfer(t: Transfer, budget: int) -> list[Transfer]:
    """Cut ``t`` into slabs of at most ``budget`` bytes (outermost splittable dim first)."""
    if t.nbytes <= budget:
        return [t]
    per_elem = t.nbytes // t.box.numel
    if per_elem > budget:
        raise PlanError(f"budget of {budget} bytes is too small to move one element "
                        f"({per_elem} bytes) of {t.key}")
    box = t.box
    for d, size in enumerate(box.shape):
        inner = per_elem * (box.numel // (size * _prod(box.shape[:d])))
        if size > 1 and inner <= budget:
            step = max(1, budget // inner)
            out = []
            for lo in range(box.lo[d], box.hi[d], step):
                hi = min(lo + step, box.hi[d])
                sub = Box(box.lo[:d] + (lo,) + box.lo[d + 1:], box.hi[:d] + (hi,) + box.hi[d + 1:])
                out.extend(_split_transfer(t._replace(box=sub, nbytes=sub.numel * per_elem),
                                           budget))
            return out
        if size > 1:  # one slab along d is too big: split each index of d separately
            out = []
            for i in range(box.lo[d], box.hi[d]):
                sub = Box(box.lo[:d] + (i,) + box.lo[d + 1:], box.hi[:d] + (i + 1,) + box.hi[d + 1:])
                out.extend(_split_transfer(t._replace(box=sub, nbytes=sub.numel * per_elem),
                                           budget))
            return out
    raise PlanError(f"cannot split {t} under a budget of {budget} bytes")


def _prod(xs: tuple[int, ...]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def coalesce(transfers: list[Transfer], src_devices: tuple[str, ...],
             dst_devices: tuple[str, ...], budget: int) -> list[Message]:
    """Group transfers per (source device, destination device), splitting each message to half
    the budget (a device's budget is shared by what it sends and what it receives)."""
    by_pair: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(src_devices[t.src_rank], dst_devices[t.dst_rank])].append(t)
    messages = []
    for (s, d), ts in sorted(by_pair.items()):  # transfers keep the planner's order
        if s == d:  # local copies need no staging: one message
            messages.append(Message(s, d, tuple(ts)))
            continue
        chunk: list[Transfer] = []
        size = 0
        for t in ts:
            for part in _split_transfer(t, budget // 2):
                if chunk and size + part.nbytes > budget // 2:
                    messages.append(Message(s, d, tuple(chunk)))
                    chunk, size = [], 0
                chunk.append(part)
                size += part.nbytes
        if chunk:
            messages.append(Message(s, d, tuple(chunk)))
    return messages


def schedule_rounds(messages: list[Message], budget: int, topo: Topology | None = None
                    ) -> list[Round]:
    """Pack remote messages into as few, as evenly loaded rounds as the budget allows.

    Each device's budget is split evenly between what it sends and what it receives in a
    round: links run both directions at once, so a round that fills only one direction wastes
    half of it. The busiest direction of the busiest device sets the minimum number of rounds.
    Messages go largest first to the round where the slower of their two endpoints would finish
    earliest (link bytes over link speed), among rounds with room. If some message fits in no
    round, packing starts over with one more round open from the start: spreading every
    device's traffic evenly over all rounds keeps the sum of round times near the plan's lower
    bound, where rounds opened late for leftovers would each cost a full round.
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
        s, d = dev_id[m.src_device], dev_id[m.dst_device]
        same = node_of(m.src_device) == node_of(m.dst_device)
        link = 0 if same else 2
        jobs.append((s, d, m.nbytes, 4 * s + link, 4 * d + link + 1,
                     m.nbytes * (intra if same else inter)))
        total_out[s] += m.nbytes
        total_in[d] += m.nbytes
    n = max((-(-v // half) for v in total_out + total_in), default=0)
    while True:
        placed = _pack(jobs, n, half, len(devices))
        if placed is not None:
            break
        n += 1
    rounds: list[list[Message]] = [[] for _ in range(n)]
    for m, i in zip(remote, placed):
        rounds[i].append(m)
    rounds = [r for r in rounds if r] or [[]]
    rounds[0][:0] = local  # local copies run in the first round, beside the exchanges
    out = []
    for r in rounds:
        msgs = tuple(sorted(r, key=lambda m: (m.src_device, m.dst_device)))
        out.append(Round(msgs, message_order(msgs)))
    return out


def _pack(jobs: list[tuple[int, int, int, int, int, float]], n: int, half: int,
          ndev: int) -> list[int] | None:
    """Round of each job with ``n`` rounds, or None if some job fits in none."""
    out_used = [[0] * ndev for _ in range(n)]
    in_used = [[0] * ndev for _ in range(n)]
    busy = [[0.0] * (4 * ndev) for _ in range(n)]
    placed = []
    for s, d, size, ko, ki, t in jobs:
        best, best_score = -1, (0.0, 0)
        for i in range(n):
            if out_used[i][s] + size > half or in_used[i][d] + size > half:
                continue
            b = busy[i]
            finish = (b[ko] if b[ko] > b[ki] else b[ki]) + t
            score = (finish, i)
            if best < 0 or score < best_score:
                best, best_score = i, score
        if best < 0:
            return None
        out_used[best][s] += size
        in_used[best][d] += size
        busy[best][ko] += t
        busy[best][ki] += t
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
