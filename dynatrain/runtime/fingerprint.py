"""End-to-end check of a switch: every destination box holds the bytes its source sent.

The planner's plan is proven before it runs; this checks the run itself (packing, wire, unpacking,
local copies, a corrupting link) inside the real job, where no reference state exists. Each
transfer gets a fingerprint of its bytes (all its state kinds, in the plan's segment order) on
the source, from the source storage, and on the destination, from the destination storage after
the last round. One all-reduce gathers the source fingerprints (each transfer has one source,
every other process adds zeros); each destination compares its own. A mismatch is voted, so the
switch aborts everywhere with the source untouched.

The fingerprint of a byte string ``b[0..n)`` is ``(sum b[i], sum (i + 1) * b[i])`` modulo the
prime ``2**31 - 1``: any changed byte moves the first, bytes moved to other positions move the
second. It is a function of the concatenated bytes only, so both ends agree however their views
are cut, and it is computed with a few integer reductions per chunk on the tensors' device,
with one host sync per switch. It detects accidents, not adversaries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..planner.plan import Plan, Transfer
from .storage import ByteViews

PRIME = (1 << 31) - 1
ROW = 64  # bytes per row of the reductions: positions are row * ROW + column
CHUNK = 1 << 20  # bytes reduced at once (bounds the int64 temporaries and keeps sums exact)


def fingerprint(views: list[torch.Tensor], on: torch.device) -> torch.Tensor:
    """The fingerprint of the concatenated bytes of ``views`` (uint8 views), as int64 [2]."""
    s1 = torch.zeros((), dtype=torch.int64, device=on)
    s2 = torch.zeros((), dtype=torch.int64, device=on)
    off = 0
    for v in views:
        flat = v.reshape(-1)  # a copy only where the view is strided
        for lo in range(0, flat.numel(), CHUNK):
            x = flat[lo:lo + CHUNK]
            c1, cw = _sums(x)
            # sum over the chunk of (off + j + 1) * x[j] = (off + 1) * c1 + sum j * x[j]
            s2 = (s2 + ((off + 1) % PRIME) * (c1 % PRIME) + cw % PRIME) % PRIME
            s1 = (s1 + c1) % PRIME
            off += x.numel()
    return torch.stack([s1, s2])


def _sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum x[j], sum j * x[j]) of a flat uint8 chunk, exactly, in int64."""
    n = x.numel()
    full = n - n % ROW
    rows = x[:full].view(-1, ROW)
    row_sums = rows.sum(1, dtype=torch.int64)
    col_sums = rows.sum(0, dtype=torch.int64)
    tail = x[full:].to(torch.int64)
    r = torch.arange(row_sums.numel(), dtype=torch.int64, device=x.device)
    c = torch.arange(ROW, dtype=torch.int64, device=x.device)
    t = torch.arange(full, n, dtype=torch.int64, device=x.device)
    c1 = row_sums.sum() + tail.sum()
    cw = ROW * (row_sums * r).sum() + (col_sums * c).sum() + (tail * t).sum()
    return c1, cw


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
