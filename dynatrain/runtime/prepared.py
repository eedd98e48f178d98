"""One process's part of a switch made ahead: bound, checked and cut into rounds before the
switch, so that the switch itself runs only the exchange and the commit vote.

A switch binds its process to the plan, checks the destination storage and prepares each
round: the byte views of every transfer, the wire pieces and the copy tables (``exchange``).
That is Python work per transfer, on the critical path before round 0 and beside the wire in
every later round (10-15 ms per process for ``bench/runtime_bench.py``'s 40M switch on this
2-core host; at scale, thousands of transfers per device). ``prepare_exchange`` does it while
the job still trains (``LiveSwitcher.build_ahead`` does, into the destination it built), and
``switch(..., prepared=...)`` reuses it.

The rounds hold views of the storage they were made from. At the switch the source must be
the same tensors (a job's parameter buffers and optimizer state do not move between
iterations once Adam's moments exist); the few small ones a job's state hands out as fresh
tensors each time (Adam's step count, a cast bias) are copied here when prepared and their
current values copied in at every switch, so that a run never writes into the job's memory
and never reads a stale value. A large source tensor that moved, or another destination, makes
the prepared part unfit: the switch prepares as without it and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir.state import StateView
from ..planner.plan import Plan
from .copytable import warm_up
from .exchange import RoundWork
from .storage import Storage

COPIED_BYTES = 64 << 10  # a source tensor at most this large is copied, and refreshed by value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory seen the same way (two views made alike of one tensor are)."""
    return a is b or (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


@dataclass(eq=False)
class PreparedExchange:
    """What ``prepare_exchange`` made for one process; give it to ``switch(prepared=...)``.

    It holds views of its source and destination storage: drop it once the switch ran, or
    the source job's memory stays referenced."""

    plan: Plan
    device: str
    devices: tuple[str, ...]
    me: object  # executor._Me
    on: torch.device
    src: dict | None  # the storage its views read: the given tensors, small ones copied
    dst: Storage | None
    works: tuple[RoundWork, ...]
    seconds: float  # how long preparing took

    def bind(self, plan: Plan, device: str, devices: tuple[str, ...],
             src_store: Mapping | None, dst_store: Mapping | None) -> str:
        """Bind to the switch called with these arguments: "" where this runs it (the copied
        small source tensors take ``src_store``'s values now), else why it cannot."""
        if plan is not self.plan:
            return "prepared for another plan"
        if device != self.device or devices != self.devices:
            return "prepared for another process or process order"
        if (dst_store is None) != (self.dst is None) or (
                dst_store is not None and not _all_same(dst_store, self.dst)):
            return "prepared for another destination storage"
        if (src_store is None) != (self.src is None):
            return "prepared for another source storage"
        if src_store is None:
            return ""
        if src_store.keys() != self.src.keys():
            return "prepared for another source storage"
        copies = []
        for key, t in src_store.items():
            mine = self.src[key]
            if _same(t, mine):
                continue
            if t.nbytes > COPIED_BYTES or (t.dtype, t.shape, t.device) != (
                    mine.dtype, mine.shape, mine.device):
                return f"source tensor {key} moved since the exchange was prepared"
            copies.append((mine, t))
        for mine, t in copies:
            mine.copy_(t)
        return ""

    def fresh_works(self) -> Callable[[int], RoundWork]:
        """The rounds, cleared of what an earlier run left."""
        for w in self.works:
            w.reset()
        return self.works.__getitem__


def _all_same(a: Mapping, b: Mapping) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def prepare_exchange(plan: Plan, src_view: StateView, dst_view: StateView, device: str,
                     src_store: Mapping[tuple, torch.Tensor] | None,
                     dst_store: Storage | None, *,
                     devices: Sequence[str] | None = None) -> PreparedExchange:
    """Make this process's part of ``switch(plan, ...)`` ahead of the switch.

    Args:
        plan, src_view, dst_view, device, src_store, devices: as ``switch`` will get them.
        dst_store: the destination storage the switch will write (``switch``'s
            ``dst_store``; required where the device runs a destination rank).

    Raises:
        ValueError: the process, its storage or ``devices`` do not match the plan (what
            ``switch`` would abort on).

    Example:
        >>> ex = prepare_exchange(plan, sv, dv, dev, src, dst)            # doctest: +SKIP
        >>> dst, report = switch(plan, sv, dv, dev, src, dst_store=dst, prepared=ex)  # doctest: +SKIP
    """
    from . import executor  # the switch's own binding and checks (it imports this module)

    t0 = time.perf_counter()
    order = executor._process_order(plan, devices)
    me = executor._bind(plan, src_view, dst_view, device, src_store, order)
    if me.dst_rank is not None and dst_store is None:
        raise ValueError(f"{device} runs destination rank {me.dst_rank}: prepare_exchange needs "
                         "its dst_store (the storage the switch will write)")
    on = executor.tensor_device(src_store, dst_store, dist.group.WORLD
                                if dist.is_initialized() else None)
    executor.on_one_device(on, ("source", src_store), ("destination", dst_store))
    dst = executor._destination(dst_view, me, dst_store, on)
    src = None
    if src_store is not None:
        src = {k: (t.clone() if t.nbytes <= COPIED_BYTES else t) for k, t in src_store.items()}
    works = executor._works(plan, me, src, dst, order)
    warm_up(on)  # CUDA: Triton's compile, off the switch
    return PreparedExchange(plan, device, order, me, on, src, dst,
                            tuple(works(i) for i in range(len(plan.rounds))),
                            time.perf_counter() - t0)
