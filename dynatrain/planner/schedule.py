"""Coalesce transfers into messages and pack messages into rounds under a staging budget.

Staging model: a remote message is packed into a contiguous buffer on the sender and received
into one on the receiver, so it costs its size on both devices for its round; local copies go
slot to slot and stage nothing. Messages larger than the budget are split at transfer boundaries,
and single transfers larger than the budget are cut into slabs of their box.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..ir.box import Box
from .intersect import PlanError
from .plan import Message, Round, Transfer


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
                out.extend(_split_transfer(replace(t, box=sub, nbytes=sub.numel * per_elem),
                                           budget))
            return out
        if size > 1:  # one slab along d is too big: split each index of d separately
            out = []
            for i in range(box.lo[d], box.hi[d]):
                sub = Box(box.lo[:d] + (i,) + box.lo[d + 1:], box.hi[:d] + (i + 1,) + box.hi[d + 1:])
                out.extend(_split_transfer(replace(t, box=sub, nbytes=sub.numel * per_elem),
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
    """Group transfers per (source device, destination device), splitting to fit the budget."""
    by_pair: dict[tuple[str, str], list[Transfer]] = defaultdict(list)
    for t in transfers:
        by_pair[(src_devices[t.src_rank], dst_devices[t.dst_rank])].append(t)
    messages = []
    for (s, d), ts in sorted(by_pair.items()):
        ts.sort()
        if s == d:  # local copies need no staging: one message
            messages.append(Message(s, d, tuple(ts)))
            continue
        chunk: list[Transfer] = []
        size = 0
        for t in ts:
            for part in _split_transfer(t, budget):
                if chunk and size + part.nbytes > budget:
                    messages.append(Message(s, d, tuple(chunk)))
                    chunk, size = [], 0
                chunk.append(part)
                size += part.nbytes
        if chunk:
            messages.append(Message(s, d, tuple(chunk)))
    return messages


def schedule_rounds(messages: list[Message], budget: int) -> list[Round]:
    """First-fit decreasing: each message goes to the first round where both ends have room."""
    local = [m for m in messages if m.local]
    remote = sorted((m for m in messages if not m.local),
                    key=lambda m: (-m.nbytes, m.src_device, m.dst_device))
    rounds: list[list[Message]] = []
    used: list[dict[str, int]] = []
    for m in remote:
        size = m.nbytes
        for i, u in enumerate(used):
            if u.get(m.src_device, 0) + size <= budget and u.get(m.dst_device, 0) + size <= budget:
                break
        else:
            rounds.append([])
            used.append({})
            i = len(rounds) - 1
        rounds[i].append(m)
        used[i][m.src_device] = used[i].get(m.src_device, 0) + size
        used[i][m.dst_device] = used[i].get(m.dst_device, 0) + size
    if not rounds:
        rounds.append([])
    rounds[0][:0] = local  # local copies run in the first round, beside the exchanges
    return [Round(tuple(sorted(r, key=lambda m: (m.src_device, m.dst_device)))) for r in rounds]


def peak_staging(rnd: Round) -> dict[str, int]:
    """Staging bytes per device in one round (remote messages only)."""
    used: dict[str, int] = defaultdict(int)
    for m in rnd.messages:
        if not m.local:
            used[m.src_device] += m.nbytes
            used[m.dst_device] += m.nbytes
    return dict(used)
