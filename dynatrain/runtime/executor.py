"""Execute a verified plan across real processes with ``torch.distributed``: all or nothing.

Every process of the switch calls ``switch`` with the same plan. The processes are the devices
``process_devices(plan)`` (the sorted union of the plan's source and destination devices); the
process of device ``devices[i]`` must be rank ``i`` of ``group``. A process holds the source
rank its device runs in the plan's source layout (if any) and builds the destination rank its
device runs in the destination layout (if any); ``Transfer.src_rank``/``dst_rank`` are those
layout ranks and ``plan.src_devices``/``plan.dst_devices`` map them to devices.

Rounds run in order. In a round a device copies its local messages slot to slot (no staging),
packs every remote message it sends into one contiguous uint8 buffer (all transfers, all kinds,
in plan order), receives every remote message into one uint8 buffer, exchanges them all at once
with ``batch_isend_irecv`` (tag = the message's index in the round, so matching does not depend
on posting order) and unpacks. The staging bytes are measured from those buffers. With
``plan.derived == ("param",)`` each destination rank then rebuilds its params from the main
params: a local cast without the distributed optimizer, otherwise Megatron's param all-gather
(each optimizer rank casts its main-param shard and sends it to the ranks of its
DistributedOptimizer group, point to point).

The destination storage is freshly allocated and the source storage is only ever read. After
the last round every process votes (an all-gather of one flag; success is its MIN): only a
unanimous vote returns the destination storage. Anything else raises ``SwitchAborted`` on
every process that is still alive, within about ``timeout`` seconds per pending operation:

- a failure or timeout while messages may be in flight destroys ``group`` (when
  ``destroy_group_on_abort``, the default): pending operations cannot be cancelled and stale
  messages must never meet a retry. Destroying a gloo group with nothing pending also closes
  its connections, so peers blocked on this process fail at once (measured: ~50 ms) instead
  of at their timeout; with operations pending gloo keeps them open and peers time out.
  Retry in a fresh group (``init_process_group``/``new_group`` again).
- a failed vote (a process found a problem after all its messages completed, e.g. its source
  checksum changed under ``verify_source``) leaves ``group`` consistent and usable: retry in it.

In both cases the source storage is untouched and a retry of the same ``switch`` may succeed.
The vote has the limit of any commit protocol: a process that dies inside the vote itself may
leave others committed; their sources are still intact, so the caller can roll back.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..ir.buffers import owned_ranges
from ..ir.errors import DynatrainError
from ..ir.layout import Layout
from ..ir.state import StateView
from ..planner.plan import Message, Plan, Round
from .storage import Storage, allocate, byte_view, checksums, region, torch_dtype, within

# Tags of the param all-gather after the rounds: above any message index of a round.
_DERIVE_TAG = 1 << 24


class SwitchAborted(DynatrainError):
    """A layout switch did not commit; the source state is untouched and a retry is possible.

    Attributes:
        device: the device of the process that raised.
        round_index: the round it was in (None before the first or after the last).
        peer: the device it was waiting for or that failed, if known.
        group_destroyed: True when the process group was destroyed (retry in a fresh one).
    """

    def __init__(self, message: str, *, device: str, round_index: int | None = None,
                 peer: str | None = None, group_destroyed: bool = False) -> None:
        self.device, self.round_index, self.peer = device, round_index, peer
        self.group_destroyed = group_destroyed
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one device did in one round (bytes are payload, staging is measured)."""

    index: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    staging_bytes: int  # bytes of the staging buffers this device allocated in the round
    planned_staging_bytes: int  # what the plan says this device stages in the round


@dataclass(frozen=True, slots=True)
class SwitchReport:
    """One device's account of a committed switch."""

    device: str
    process_index: int
    src_rank: int | None
    dst_rank: int | None
    rounds: tuple[RoundReport, ...]
    budget_bytes: int
    derive_bytes_sent: int
    derive_bytes_received: int
    derive_staging_bytes: int
    derive_seconds: float
    vote_seconds: float
    total_seconds: float

    def as_dict(self) -> dict:
        """Plain-data summary: totals, per-round lists and achieved bandwidth (GB/s = 1e9 B/s)."""
        sent = sum(r.bytes_sent for r in self.rounds)
        received = sum(r.bytes_received for r in self.rounds)
        seconds = sum(r.seconds for r in self.rounds)
        return {
            "device": self.device, "process_index": self.process_index,
            "src_rank": self.src_rank, "dst_rank": self.dst_rank,
            "rounds": len(self.rounds),
            "round_seconds": [r.seconds for r in self.rounds],
            "round_staging_bytes": [r.staging_bytes for r in self.rounds],
            "bytes_sent": sent, "bytes_received": received,
            "bytes_local": sum(r.bytes_local for r in self.rounds),
            "exchange_seconds": seconds,
            "achieved_GBps": (sent + received) / seconds / 1e9 if seconds > 0 else 0.0,
            "send_GBps": sent / seconds / 1e9 if seconds > 0 else 0.0,
            "recv_GBps": received / seconds / 1e9 if seconds > 0 else 0.0,
            "peak_staging_bytes": max((r.staging_bytes for r in self.rounds), default=0),
            "planned_peak_staging_bytes": max((r.planned_staging_bytes for r in self.rounds),
                                              default=0),
            "budget_bytes": self.budget_bytes,
            "derive_bytes_sent": self.derive_bytes_sent,
            "derive_bytes_received": self.derive_bytes_received,
            "derive_staging_bytes": self.derive_staging_bytes,
            "derive_seconds": self.derive_seconds,
            "vote_seconds": self.vote_seconds,
            "total_seconds": self.total_seconds,
            "per_round": [asdict(r) for r in self.rounds],
        }


def process_devices(plan: Plan) -> tuple[str, ...]:
    """The devices of a switch, in process order: process ``i`` runs ``devices[i]``."""
    return tuple(sorted(set(plan.src_devices) | set(plan.dst_devices)))


class _Where:
    """Where a process is, so that an abort can name the round and the peer."""

    def __init__(self) -> None:
        self.round: int | None = None
        self.phase = "setup"
        self.peer: str | None = None


def switch(plan: Plan, src_view: StateView, dst_view: StateView, device: str,
           src_store: Mapping[tuple, torch.Tensor] | None,
           group: dist.ProcessGroup | None = None, *, timeout: float = 60.0,
           destroy_group_on_abort: bool = True, verify_source: bool = False,
           on_round: Callable[[int], None] | None = None) -> tuple[Storage | None, dict]:
    """Run ``plan`` on this process; every process of the switch calls it.

    Args:
        plan: a verified plan; ``src_view``/``dst_view`` are the state views of its layouts.
        device: this process's device; it must be rank ``process_devices(plan).index(device)``
            of ``group``.
        src_store: this device's source storage (None iff the device is not a source device).
            Only read, never written.
        group: the process group of exactly the switch's processes (None: the default group).
            Its timeout is set to ``timeout``.
        timeout: seconds any one wait for peers (a round's exchange, the all-gather, the vote)
            may take before the switch aborts.
        destroy_group_on_abort: destroy ``group`` when aborting with messages possibly in
            flight (see the module docstring); False leaves that to the caller.
        verify_source: hash the source storage before and after and vote failure if it changed.
        on_round: test hook, called with the round index after this device packed the round's
            sends and before it exchanges them (inject faults with it).

    Returns:
        (destination storage, or None if the device is not a destination device; the report
        of ``SwitchReport.as_dict``).

    Raises:
        SwitchAborted: on any failure or timeout, on every process still alive.

    Example:
        >>> dst, report = switch(plan, sv, dv, "node0:gpu1", src, timeout=30)  # doctest: +SKIP
    """
    t_start = time.perf_counter()
    td = datetime.timedelta(seconds=timeout)
    where = _Where()
    devices = process_devices(plan)
    pg = group if group is not None else dist.group.WORLD
    try:
        me = _bind(plan, src_view, dst_view, device, src_store, pg, devices)
        pg.set_timeout(td)  # gloo collectives block their worker thread up to this long
        before = checksums(src_store) if verify_source and src_store is not None else None
        dst = allocate(dst_view, me.dst_rank) if me.dst_rank is not None else None
        reports = []
        for i, rnd in enumerate(plan.rounds):
            where.round, where.peer = i, None
            reports.append(_run_round(i, rnd, me, src_store, dst, pg, devices, timeout, where,
                                      on_round))
        where.round = None
        t = time.perf_counter()
        derive = (0, 0, 0)
        if plan.derived:
            where.phase = "derive params"
            derive = _derive_params(plan, dst_view, me, dst, pg, devices, timeout, where)
        derive_seconds = time.perf_counter() - t
    except Exception as err:  # noqa: BLE001 — every failure becomes one SwitchAborted
        raise _abort(err, device, where, pg, destroy_group_on_abort) from err

    # All messages of this process completed: a problem found now is voted, not shouted.
    problem = ""
    try:
        where.phase = "check"
        if before is not None and checksums(src_store) != before:
            problem = "its source storage changed during the switch"
    except Exception as err:  # noqa: BLE001
        problem = f"{type(err).__name__}: {err}"
    t = time.perf_counter()
    where.phase, where.peer = "vote", None
    try:
        flags = torch.zeros(len(devices), dtype=torch.int32)
        mine = torch.tensor([0 if problem else 1], dtype=torch.int32)
        _wait(dist.all_gather_single(flags, mine, group=pg, async_op=True), timeout)
    except Exception as err:  # noqa: BLE001
        raise _abort(err, device, where, pg, destroy_group_on_abort) from err
    if int(flags.min()) != 1:  # the vote is the MIN of the flags
        failed = [d for d, f in zip(devices, flags.tolist()) if f != 1]
        why = f" ({problem})" if problem else ""
        raise SwitchAborted(f"switch aborted at the commit vote: {', '.join(failed)} voted "
                            f"failure{why}; this is {device}; group still usable",
                            device=device, peer=failed[0])
    report = SwitchReport(device, me.index, me.src_rank, me.dst_rank, tuple(reports),
                          plan.budget_bytes, derive[0], derive[1], derive[2], derive_seconds,
                          time.perf_counter() - t, time.perf_counter() - t_start)
    return dst, report.as_dict()


@dataclass(frozen=True, slots=True)
class _Me:
    index: int
    device: str
    src_rank: int | None
    dst_rank: int | None


def _bind(plan: Plan, src_view: StateView, dst_view: StateView, device: str,
          src_store: Mapping | None, pg: dist.ProcessGroup, devices: tuple[str, ...]) -> _Me:
    """Check that this process, its group and its storage match the plan."""
    if device not in devices:
        raise ValueError(f"device {device} is in neither layout of the plan ({devices[0]}, ...)")
    if len(plan.src_devices) != src_view.layout.world:
        raise ValueError(f"the plan has {len(plan.src_devices)} source ranks, src_view "
                         f"{src_view.layout.world}")
    if len(plan.dst_devices) != dst_view.layout.world:
        raise ValueError(f"the plan has {len(plan.dst_devices)} destination ranks, dst_view "
                         f"{dst_view.layout.world}")
    index = devices.index(device)
    if pg.size() != len(devices) or pg.rank() != index:
        raise ValueError(f"process of {device} must be rank {index} of a group of "
                         f"{len(devices)} (the sorted device union); got rank {pg.rank()} "
                         f"of {pg.size()}")
    src_rank = plan.src_devices.index(device) if device in plan.src_devices else None
    dst_rank = plan.dst_devices.index(device) if device in plan.dst_devices else None
    if (src_store is None) != (src_rank is None):
        raise ValueError(f"{device} {'is' if src_rank is not None else 'is not'} a source "
                         f"device, so src_store must {'' if src_rank is not None else 'not '}"
                         "be given")
    if plan.derived not in ((), ("param",)):
        raise ValueError(f"derived kinds {plan.derived} are not supported (only ('param',))")
    return _Me(index, device, src_rank, dst_rank)


def _wait(work: dist.Work | None, timeout: float, deadline: float | None = None) -> None:
    left = timeout if deadline is None else max(deadline - time.monotonic(), 1e-3)
    if work is not None and work.wait(datetime.timedelta(seconds=left)) is False:
        raise TimeoutError(f"no completion within {left:.1f} s")


def _abort(err: Exception, device: str, where: _Where, pg: dist.ProcessGroup,
           destroy: bool) -> SwitchAborted:
    destroyed = False
    if destroy:
        try:
            dist.destroy_process_group(pg)
            destroyed = True
        except Exception:  # noqa: BLE001 — already destroyed or never initialized
            pass
    at = (f"round {where.round} ({where.phase})" if where.round is not None
          else f"the {where.phase} step")
    peer = f" waiting for {where.peer}" if where.peer else ""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    then = "group destroyed, retry in a fresh one" if destroyed else "group left as is"
    return SwitchAborted(f"switch aborted in {at} on {device}{peer}: "
                         f"{type(err).__name__}: {first}; source untouched, {then}",
                         device=device, round_index=where.round, peer=where.peer,
                         group_destroyed=destroyed)


def _views(store: Mapping[tuple, torch.Tensor], t, side: str):
    """Per kind of ``t``, the view of its box in the source or destination slot."""
    slot, anchor = (t.src_slot, t.src_anchor) if side == "src" else (t.dst_slot, t.dst_anchor)
    sl = within(t.box, anchor)
    return [region(store, kind, slot, anchor)[sl] for kind in t.kinds]


def _pack(m: Message, src: Mapping[tuple, torch.Tensor], src_rank: int) -> torch.Tensor:
    buf = torch.empty(m.nbytes, dtype=torch.uint8)
    off = 0
    for t in m.transfers:
        if t.src_rank != src_rank:
            raise ValueError(f"transfer {t} is sent by {m.src_device}, which runs source "
                             f"rank {src_rank}")
        for v in _views(src, t, "src"):
            b = byte_view(v)
            n = b.numel()
            if off + n > m.nbytes:
                raise ValueError(f"message {m.src_device}->{m.dst_device} holds more than its "
                                 f"{m.nbytes} bytes (plan and dtypes disagree)")
            buf[off:off + n].view(b.shape).copy_(b)
            off += n
    if off != m.nbytes:
        raise ValueError(f"message {m.src_device}->{m.dst_device} packs {off} bytes, the plan "
                         f"says {m.nbytes}")
    return buf


def _unpack(m: Message, buf: torch.Tensor, dst: Storage, dst_rank: int) -> None:
    off = 0
    for t in m.transfers:
        if t.dst_rank != dst_rank:
            raise ValueError(f"transfer {t} is received by {m.dst_device}, which runs "
                             f"destination rank {dst_rank}")
        for v in _views(dst, t, "dst"):
            b = byte_view(v)
            n = b.numel()
            b.copy_(buf[off:off + n].view(b.shape))
            off += n
    if off != buf.numel():
        raise ValueError(f"message {m.src_device}->{m.dst_device} unpacks {off} of "
                         f"{buf.numel()} bytes")


def _run_round(i: int, rnd: Round, me: _Me, src: Mapping | None, dst: Storage | None,
               pg: dist.ProcessGroup, devices: tuple[str, ...], timeout: float, where: _Where,
               on_round: Callable[[int], None] | None) -> RoundReport:
    t0 = time.perf_counter()
    where.phase = "pack"
    local: list[Message] = []
    ops, peers, recvs, bufs = [], [], [], []
    sent = received = planned = 0
    for mi in rnd.device_order().get(me.device, ()):
        m = rnd.messages[mi]
        if m.local:
            local.append(m)
        elif m.src_device == me.device:
            assert src is not None and me.src_rank is not None
            buf = _pack(m, src, me.src_rank)
            ops.append(dist.P2POp(dist.isend, buf, group=pg, tag=mi,
                                  group_peer=devices.index(m.dst_device)))
            peers.append(m.dst_device)
            bufs.append(buf)
            sent += m.nbytes
            planned += m.nbytes
        elif m.dst_device == me.device:
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, buf, group=pg, tag=mi,
                                  group_peer=devices.index(m.src_device)))
            peers.append(m.src_device)
            recvs.append((m, buf))
            bufs.append(buf)
            received += m.nbytes
            planned += m.nbytes
        else:
            raise ValueError(f"round {i} orders message {mi} ({m.src_device}->{m.dst_device}) "
                             f"on {me.device}, which is neither end")
    staging = sum(b.untyped_storage().nbytes() for b in bufs)
    if on_round is not None:
        on_round(i)
    where.phase = "exchange"
    works = dist.batch_isend_irecv(ops) if ops else []
    # Local copies overlap the exchange: they touch neither staging buffers nor the network.
    where.phase = "local copy"
    n_local = 0
    for m in local:
        assert src is not None and dst is not None
        for t in m.transfers:
            if t.src_rank != me.src_rank or t.dst_rank != me.dst_rank:
                raise ValueError(f"local transfer {t} does not stay on {me.device}")
            for s, d in zip(_views(src, t, "src"), _views(dst, t, "dst")):
                d.copy_(s)
        n_local += m.nbytes
    where.phase = "exchange"
    deadline = time.monotonic() + timeout
    attributed = len(works) == len(ops)  # one work per op: a timeout can name its peer
    for k, w in enumerate(works):
        where.peer = peers[k] if attributed else None
        _wait(w, timeout, deadline)
    where.phase, where.peer = "unpack", None
    for m, buf in recvs:
        assert dst is not None and me.dst_rank is not None
        _unpack(m, buf, dst, me.dst_rank)
    return RoundReport(i, time.perf_counter() - t0, sent, received, n_local, staging, planned)


# ---- derived params ------------------------------------------------------------------------

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


def _derive_params(plan: Plan, view: StateView, me: _Me, dst: Storage | None,
                   pg: dist.ProcessGroup, devices: tuple[str, ...], timeout: float,
                   where: _Where) -> tuple[int, int, int]:
    """Rebuild the params from the main params; returns (bytes sent, received, staged)."""
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
    r = me.dst_rank

    def main_flat(chunk: int, name: str, n: int) -> torch.Tensor:
        # A shard holding only vocab padding has no storage: its elements are zeros.
        t = dst.get(("main_param", "FlatSlot", chunk, name)) if dst is not None else None
        if t is None:
            return torch.zeros(n, dtype=pdtype)
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
                            ).view(torch.uint8) if ns else torch.empty(0, dtype=torch.uint8)
            peer = plan.dst_devices[q]
            ops.append(dist.P2POp(dist.isend, buf, group=pg, tag=_DERIVE_TAG,
                                  group_peer=devices.index(peer)))
            bufs.append(buf)
            peers.append(peer)
            sent += buf.numel()
        for q, ns in sorted(incoming.items()):
            buf = torch.empty(sum(n.hi - n.lo for n in ns) * esize, dtype=torch.uint8)
            peer = plan.dst_devices[q]
            ops.append(dist.P2POp(dist.irecv, buf, group=pg, tag=_DERIVE_TAG,
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
        _wait(w, timeout, deadline)
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
