"""Rebuild the destination's params from its main params after the rounds (``derive_param``).

Without the distributed optimizer each rank's main params sit in its params' own slots: a
local cast. With it, every optimizer rank casts its main-param shard and sends it to the other
ranks of its DistributedOptimizer group point to point, as Megatron's param all-gather does
after each optimizer step; each rank receives the ranges it does not own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir.buffers import owned_ranges
from ..ir.layout import Layout
from ..ir.state import StateView
from ..planner.plan import Plan
from .storage import Storage, torch_dtype

DERIVE_TAG = (1 << 31) - 1  # above every round's piece tags


@dataclass(frozen=True, slots=True)
class _Need:
    """Destination rank ``receiver`` needs ``[lo, hi)`` of param ``name``'s flat local view,
    which optimizer rank ``provider`` holds as its whole main-param shard of that param."""

    receiver: int
    provider: int
    chunk: int
    name: str
    lo: int
    hi: int


def _needs(L: Layout, rank: int) -> tuple[_Need, ...]:
    """Megatron's param all-gather for ``rank``: per buffer, every optimizer rank's ranges,
    from the member of ``rank``'s (intra-instance) DistributedOptimizer group that owns them."""
    out = []
    for bi, buf in enumerate(L.rank_buffers(rank)):
        members = L.mesh.groups(rank)["edp" if buf.is_expert else "dp_cp"]
        D = buf.dp_size
        pos = members.index(rank)
        base = pos // D * D  # optimizer instances are consecutive blocks of D members
        mine = {sh.param.name: sh for cs in L.rank_shards(rank) if cs.chunk.vp == buf.chunk
                for sh in cs.shards}
        for k in range(D):
            q = members[base + k]
            if L.optimizer_rank(q, buf.is_expert) != k or L.rank_buffers(q)[bi] != buf:
                raise ValueError(f"derive params: rank {q} is not optimizer rank {k} of rank "
                                 f"{rank}'s buffer {bi} (layout groups disagree)")
            theirs = {sh.param.name: sh for cs in L.rank_shards(q) if cs.chunk.vp == buf.chunk
                      for sh in cs.shards}
            for o in owned_ranges(buf, k):
                if theirs[o.name] != mine[o.name]:
                    raise ValueError(f"derive params: ranks {rank} and {q} hold different "
                                     f"shards of {o.name} in one optimizer group")
                out.append(_Need(rank, q, buf.chunk, o.name, o.param[0], o.param[1]))
    return tuple(out)


def derive_params(plan: Plan, view: StateView, dst_rank: int | None, dst: Storage | None,
                  pg: dist.ProcessGroup, devices: tuple[str, ...], timeout: float, where,
                  wait: Callable, on: torch.device | None = None) -> tuple[int, int, int]:
    """Rebuild the params from the main params; returns (bytes sent, received, staged).

    ``on``: the device of the staging buffers (the destination storage's).
    """
    L = view.layout
    if "main_param" not in view.kinds:
        raise ValueError("derived params need main params in the destination")
    pdtype = torch_dtype(view.kinds["param"])
    if not L.parallel.use_distributed_optimizer:
        if dst is not None:  # main params sit in the params' own slots: a local cast
            for k, t in dst.items():
                if k[0] == "param":
                    t.copy_(dst[("main_param",) + k[1:]])
        return 0, 0, 0
    r = dst_rank

    def main_flat(chunk: int, name: str, n: int) -> torch.Tensor:
        # A shard holding only vocab padding has no storage: its elements are zeros.
        t = dst.get(("main_param", "FlatSlot", chunk, name)) if dst is not None else None
        if t is None:
            return torch.zeros(n, dtype=pdtype, device=on)
        if t.numel() != n:
            raise ValueError(f"main-param shard of {name} has {t.numel()} elements, the "
                             f"buffer says {n}")
        return t.to(pdtype)

    def param_flat(chunk: int, name: str) -> torch.Tensor | None:
        t = dst.get(("param", "ParamSlot", chunk, name)) if dst is not None else None
        return None if t is None else t.view(-1)  # fresh zeros(local_shape): contiguous

    ops, bufs, recvs, peers = [], [], [], []
    sent = received = 0
    if r is not None:
        needs = _needs(L, r)
        incoming: dict[int, list[_Need]] = {}
        for n in needs:
            if n.provider == r:
                p = param_flat(n.chunk, n.name)
                if p is not None:
                    p[n.lo:n.hi].copy_(main_flat(n.chunk, n.name, n.hi - n.lo))
            else:
                incoming.setdefault(n.provider, []).append(n)
        # What this rank provides to the other members of its optimizer groups.
        outgoing: dict[int, list[_Need]] = {}
        others = sorted({q for bi, buf in enumerate(L.rank_buffers(r))
                         for q in L.mesh.groups(r)["edp" if buf.is_expert else "dp_cp"]} - {r})
        for q in others:
            for n in _needs(L, q):
                if n.provider == r:
                    outgoing.setdefault(q, []).append(n)
        esize = torch.empty((), dtype=pdtype).element_size()
        for q, ns in sorted(outgoing.items()):
            buf = torch.cat([main_flat(n.chunk, n.name, n.hi - n.lo) for n in ns]
                            ).view(torch.uint8) if ns else torch.empty(0, dtype=torch.uint8,
                                                                        device=on)
            peer = plan.dst_devices[q]
            ops.append(dist.P2POp(dist.isend, buf, group=pg, tag=DERIVE_TAG,
                                  group_peer=devices.index(peer)))
            bufs.append(buf)
            peers.append(peer)
            sent += buf.numel()
        for q, ns in sorted(incoming.items()):
            buf = torch.empty(sum(n.hi - n.lo for n in ns) * esize, dtype=torch.uint8,
                              device=on)
            peer = plan.dst_devices[q]
            ops.append(dist.P2POp(dist.irecv, buf, group=pg, tag=DERIVE_TAG,
                                  group_peer=devices.index(peer)))
            bufs.append(buf)
            peers.append(peer)
            recvs.append((ns, buf))
            received += buf.numel()
    staging = sum(b.untyped_storage().nbytes() for b in bufs)
    works = dist.batch_isend_irecv(ops) if ops else []
    deadline = time.monotonic() + timeout
    for k, w in enumerate(works):
        where.peer = peers[k] if len(works) == len(ops) else None
        wait(w, timeout, deadline)
    where.peer = None
    for ns, buf in recvs:
        vals = buf.view(pdtype)
        off = 0
        for n in ns:
            p = param_flat(n.chunk, n.name)
            if p is not None:
                p[n.lo:n.hi].copy_(vals[off:off + n.hi - n.lo])
            off += n.hi - n.lo
    return sent, received, staging
