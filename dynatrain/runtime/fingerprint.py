"""End-to-end check of a switch: every destination box holds the bytes its source sent.

The planner's plan is proven before it runs; this checks the run itself (packing, wire, unpacking,
local copies, a corrupting link) inside the real job, where no reference state exists. Each
transfer gets a fingerprint of its bytes (all its state kinds, in the plan's segment order) on
the source, from the source storage, and on the destination, from the destination storage after
the last round. One all-reduce gathers the source fingerprints (each transfer has one source,
every other process adds zeros); each destination compares its own. A mismatch is voted, so the
switch aborts everywhere with the source untouched.

A transfer's bytes come as segments (one per state kind and stacked member, the same segments,
in the same order and of the same sizes, on both ends: the wire pieces rely on it). A segment's
bytes, padded to even length with a zero byte, are read as signed 16-bit words in the machine's
byte order, ``w[0..m)``; its sums are ``a = sum w[i]`` and ``b = sum (i + 1) * w[i]``. The
fingerprint of segments ``0..K`` is ``(sum a_k, sum (b_k + (k + 1) * a_k))`` modulo the prime
``2**31 - 1``: a changed byte moves the first, displaced bytes or segments the second. It is
computed per chunk of a segment as float64 sums and dot products (exact: every partial sum
stays below 2**53), on the tensors' device, and reduced modulo the prime in int64. It detects
accidents, not adversaries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..planner.plan import Plan, Transfer
from .storage import ByteViews, row_blocks

PRIME = (1 << 31) - 1
CHUNK = 1 << 20  # bytes per dot product (even): 2**19 + 1 words of |w| <= 2**15 keep every
# partial sum below 2**53
_POSITIONS: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ... as float64, per device


def _positions(n: int, on: torch.device) -> torch.Tensor:
    have = _POSITIONS.get(on)
    if have is None or have.numel() < n:
        have = _POSITIONS[on] = torch.arange(max(n, CHUNK // 2 + 1), dtype=torch.float64,
                                             device=on)
    return have[:n]


def fingerprint(views: list[torch.Tensor], on: torch.device) -> torch.Tensor:
    """The fingerprint of segments ``views`` (uint8 views, in order), as int64 [2]."""
    s1 = torch.zeros((), dtype=torch.int64, device=on)
    s2 = torch.zeros((), dtype=torch.int64, device=on)
    for k, v in enumerate(views):
        a, b = _segment(v, on)
        s1 = (s1 + a) % PRIME
        s2 = (s2 + b + ((k + 1) % PRIME) * a) % PRIME
    return torch.stack([s1, s2])


def _segment(v: torch.Tensor, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) of one segment's bytes, each reduced modulo ``PRIME``."""
    a = torch.zeros((), dtype=torch.int64, device=on)
    b = torch.zeros((), dtype=torch.int64, device=on)
    pos = 0  # index of the next word in the segment
    carry = None  # a block's odd last byte, the first of the next word
    # Block by block: a strided view is copied one block at a time, never whole (a local
    # segment can be a large share of a parameter, more than the staging budget).
    for x in (b.reshape(-1) for b in row_blocks(v, CHUNK)):
        if carry is not None:
            x = torch.cat([carry, x])
        carry = x[-1:].clone() if x.numel() % 2 else None
        if carry is not None:
            x = x[:-1]
        if x.data_ptr() % 2:  # words need an even address
            x = x.clone()
        a, b, pos = _fold(x, a, b, pos, on)
    if carry is not None:  # the segment's odd last byte, padded with a zero byte
        a, b, pos = _fold(torch.cat([carry, carry.new_zeros(1)]), a, b, pos, on)
    return a, b


def _fold(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pos: int, on: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Add the words of ``x`` (even length), which start at word ``pos``, to (a, b)."""
    if not x.numel():
        return a, b, pos
    w = x.view(torch.int16).to(torch.float64)
    c = w.sum().to(torch.int64) % PRIME
    # sum over the block of (pos + j + 1) * w[j] = (pos + 1) * c + sum j * w[j]
    cw = torch.dot(w, _positions(w.numel(), on)).to(torch.int64) % PRIME
    return (a + c) % PRIME, (b + ((pos + 1) % PRIME) * c + cw) % PRIME, pos + w.numel()


def _transfers(plan: Plan) -> Iterator[tuple[int, str, str, Transfer]]:
    """(index, source device, destination device, transfer) in plan order: the same on every
    process."""
    k = 0
    for rnd in plan.rounds:
        for m in rnd.messages:
            for t in m.transfers:
                yield k, m.src_device, m.dst_device, t
                k += 1


def compare_transfers(plan: Plan, device: str, src: ByteViews | None, dst: ByteViews | None,
                    pg: dist.ProcessGroup, on: torch.device, timeout: float,
                    wait: Callable) -> list[str]:
    """Compare every transfer this device received with what its source sent.

    Every process of the switch calls it after the last round (it runs one all-reduce).
    Returns one line per transfer that differs (empty: all arrived intact)."""
    n = sum(len(m.transfers) for rnd in plan.rounds for m in rnd.messages)
    table = torch.zeros((max(n, 1), 2), dtype=torch.int64, device=on)
    mine: list[tuple[int, Transfer, torch.Tensor]] = []
    for k, src_device, dst_device, t in _transfers(plan):
        if src_device == device:
            table[k] = fingerprint(src(t.kinds, t.src_slot, t.src_anchor, t.box), on)
        if dst_device == device:
            mine.append((k, t, fingerprint(dst(t.kinds, t.dst_slot, t.dst_anchor, t.box), on)))
    wait(dist.all_reduce(table, group=pg, async_op=True), timeout)
    if not mine:
        return []
    got = torch.stack([f for _, _, f in mine])
    differs = (got != table[[k for k, _, _ in mine]]).any(1).tolist()
    return [f"transfer {k} ({'+'.join(t.kinds)} of {_name(t.dst_slot)} {list(t.box.lo)}.."
            f"{list(t.box.hi)} from source rank {t.src_rank}) differs at destination rank "
            f"{t.dst_rank}" for (k, t, _), bad in zip(mine, differs) if bad]


def _name(slot) -> str:
    names = getattr(slot, "names", None)  # a stacked family: its first and last member
    return f"{names[0]}..{names[-1]}" if names else slot.name
