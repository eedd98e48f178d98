"""Execute a verified plan across real processes with ``torch.distributed``: all or nothing.

Every process of the switch calls ``switch`` with the same plan. The processes are the devices
``process_devices(plan)`` (the source's devices in rank order, then the destination's new
ones); the process of device ``devices[i]`` must be rank ``i`` of ``group`` (or of ``switch``'s
``devices`` order, where the group numbers them otherwise). A process holds the source
rank its device runs in the plan's source layout (if any) and builds the destination rank its
device runs in the destination layout (if any); ``Transfer.src_rank``/``dst_rank`` are those
layout ranks and ``plan.src_devices``/``plan.dst_devices`` map them to devices.

Rounds run in order (``exchange.py``): in a round a device posts its receives, packs and posts
its sends piece by piece (a large contiguous segment goes on the wire straight from or into
storage; the rest is packed into one staging arena kept for the whole switch), copies its local
messages slot to slot, prepares the next round (and packs its staged sends where there is
room) while the transfers run, and unpacks each received piece as it lands. The staging bytes
are measured from the arena: never more than the plan says the device stages in its busiest
round (what the verifier's memory check counts), usually much less. With
``plan.derived == ("param",)`` each destination rank then rebuilds its params from the main
params (``derive.py``: a local cast without the distributed optimizer, otherwise Megatron's
param all-gather, point to point).

Binding the process to the plan, checking the destination and preparing the rounds is Python
work per transfer; ``prepared.prepare_exchange`` does it ahead of the switch (a live switch's
build ahead does), and ``switch(..., prepared=...)`` then runs only the rounds and the vote.

The destination storage is freshly allocated (or given as ``dst_store``, zero-filled) and the
source storage is only ever read. After the last round every process votes (an all-gather of
one flag; success is its MIN): only a unanimous vote returns the destination storage. Anything
else raises ``SwitchAborted`` on every process that is still alive, within about ``timeout``
seconds per pending operation:

- a failure or timeout while messages may be in flight destroys ``group`` (when
  ``destroy_group_on_abort``, the default): pending operations cannot be cancelled and stale
  messages must never meet a retry. Destroying a gloo group with nothing pending also closes
  its connections, so peers blocked on this process fail at once (measured: ~50 ms) instead
  of at their timeout; with operations pending gloo keeps them open and peers time out.
  Retry in a fresh group (``init_process_group``/``new_group`` again).
- a failed vote (a process found a problem after all its messages completed: its source
  checksum changed under ``verify_source``, or under ``check_transfers`` a transfer's bytes at
  its destination differ from those at its source) leaves ``group`` consistent and usable:
  retry in it.

In both cases the source storage is untouched and a retry of the same ``switch`` may succeed.
The vote has the limit of any commit protocol: a process that dies inside the vote itself may
leave others committed; their sources are still intact, so the caller can roll back.

On NCCL a round is posted as one group (``exchange.posts_grouped``) after a start barrier, and
``Work.wait`` blocks the CPU, raising at the timeout, only when the group was created with
``TORCH_NCCL_BLOCKING_WAIT=1`` in the environment; otherwise a hung peer is left to NCCL's
watchdog, which by default tears the process down (the other processes' sources are intact).

Process 0 logs one line per round to the ``dynatrain.runtime`` logger at INFO (silent unless
the application configures logging), so a long switch shows its progress.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..ir.errors import EXIT_ABORTED, DynatrainError
from ..ir.state import StateView
from ..planner.plan import Plan
from .derive import derive_params
from .exchange import Arena, RoundWork, posts_grouped, prepare_round, run_round, spread_local
from .fingerprint import compare_transfers
from .storage import ByteViews, Storage, allocate, checksums, storage_layout

if TYPE_CHECKING:
    from .prepared import PreparedExchange

log = logging.getLogger("dynatrain.runtime")


class SwitchAborted(DynatrainError):
    """A layout switch did not commit; the source state is untouched and a retry is possible.

    Attributes:
        device: the device of the process that raised.
        round_index: the round it was in (None before the first or after the last).
        peer: the device it was waiting for or that failed, if known.
        group_destroyed: True when the process group was destroyed (retry in a fresh one).
    """

    exit_code = EXIT_ABORTED

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
    staging_bytes: int  # bytes of this round's pieces that went through the staging arena
    planned_staging_bytes: int  # what the plan says this device stages in the round
    packed_ahead_bytes: int  # of staging_bytes, sends packed during the previous round
    # Of seconds, the time blocked on the round's operations after posting them, copying
    # locally and preparing the next round: the wire plus waiting for slower peers.
    wait_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class SwitchReport:
    """One device's account of a committed switch."""

    device: str
    process_index: int
    src_rank: int | None
    dst_rank: int | None
    rounds: tuple[RoundReport, ...]
    budget_bytes: int
    peak_staging_bytes: int  # the most bytes the arena's buffers held at once (<= budget)
    derive_bytes_sent: int
    derive_bytes_received: int
    derive_staging_bytes: int
    derive_seconds: float
    check_seconds: float  # comparing transfer fingerprints (check_transfers), else ~0
    vote_seconds: float
    total_seconds: float
    # Fixed costs, paid once per switch whatever it moves (see ``as_dict``):
    setup_seconds: float = 0.0  # from the call to the first round's exchange
    start_barrier_seconds: float = 0.0  # of setup_seconds, the NCCL start barrier (0 on gloo)

    def as_dict(self) -> dict:
        """Plain-data summary: totals, per-round lists and achieved bandwidth (GB/s = 1e9 B/s).

        Time splits into ``setup_seconds`` (binding, source checksums, the destination
        storage, the NCCL start barrier, preparing the first round), ``exchange_seconds`` (the
        rounds; ``round_wait_seconds`` of it blocked on peers and the wire), ``derive_seconds``,
        ``check_seconds`` and ``vote_seconds`` (the commit vote, including waiting for the
        slowest process); ``fixed_seconds`` is setup plus vote. These parts add up to at most
        ``total_seconds``: the rest is bookkeeping between them.
        """
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
            "packed_ahead_bytes": sum(r.packed_ahead_bytes for r in self.rounds),
            "peak_staging_bytes": self.peak_staging_bytes,
            "planned_peak_staging_bytes": max((r.planned_staging_bytes for r in self.rounds),
                                              default=0),
            "budget_bytes": self.budget_bytes,
            "derive_bytes_sent": self.derive_bytes_sent,
            "derive_bytes_received": self.derive_bytes_received,
            "derive_staging_bytes": self.derive_staging_bytes,
            "derive_seconds": self.derive_seconds,
            "check_seconds": self.check_seconds,
            "vote_seconds": self.vote_seconds,
            "setup_seconds": self.setup_seconds,
            "start_barrier_seconds": self.start_barrier_seconds,
            "round_wait_seconds": sum(r.wait_seconds for r in self.rounds),
            "fixed_seconds": self.setup_seconds + self.vote_seconds,
            "total_seconds": self.total_seconds,
            "per_round": [asdict(r) for r in self.rounds],
        }


def process_devices(plan: Plan) -> tuple[str, ...]:
    """The devices of a switch, in process order: process ``i`` runs ``devices[i]``.

    The source's devices in source rank order, then those only the destination has in
    destination rank order: on an unchanged world process ``i`` is the job's own rank ``i``,
    so a switch runs in the job's group as it is (a sorted order would put node10 before
    node2 and break that from 11 nodes on).
    """
    gone = set(plan.stats.get("failed", ()))  # devices that died run no process
    union = dict.fromkeys(d for d in plan.src_devices if d not in gone)
    for d in plan.dst_devices:
        union.setdefault(d)
    return tuple(union)


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
           on_round: Callable[[int], None] | None = None,
           dst_store: Storage | None = None,
           check_transfers: bool = False,
           fill: Callable[[Storage | None, dist.ProcessGroup, tuple[str, ...], torch.device],
                          object] | None = None,
           devices: Sequence[str] | None = None,
           prepared: "PreparedExchange | None" = None) -> tuple[Storage | None, dict]:
    """Run ``plan`` on this process; every process of the switch calls it.

    Args:
        plan: a verified plan; ``src_view``/``dst_view`` are the state views of its layouts.
        device: this process's device; it must be rank ``devices.index(device)`` of ``group``.
        src_store: this device's source storage (None iff the device is not a source device).
            Only read, never written.
        group: the process group of exactly the switch's processes (None: the default group).
            Its timeout is set to ``timeout``.
        timeout: seconds any one wait for peers (a round's exchange, the all-gather, the vote)
            may take before the switch aborts.
        destroy_group_on_abort: destroy ``group`` when aborting with messages possibly in
            flight (see the module docstring); False leaves that to the caller.
        verify_source: hash the source storage before and after and vote failure if it changed.
        on_round: test hook, called with the round index at the start of the round's
            exchange, before any of its messages is posted (inject faults with it).
        dst_store: destination storage to write into instead of allocating it: zero-filled,
            with ``allocate(dst_view, rank)``'s keys, shapes and dtypes (e.g. allocated ahead
            of time). Returned on commit; on abort its contents are undefined.
        check_transfers: after the last round, compare a fingerprint of every transfer's bytes
            at its destination with one taken at its source (``fingerprint.py``: every moved
            byte is read once more on each end, then one all-reduce) and vote failure on any
            difference. Every process of the switch must pass the same value.
        fill: called on every process after the last round, before the params are derived,
            with (this process's destination storage or None, the group, the processes in
            group rank order, the tensor device): writes state that comes from outside the
            plan's sources (a recovery's buddy copies, ``megatron.buddy.run_fill``). A failure
            in it aborts the switch like a failed round.
        devices: the switch's processes in ``group``'s rank order (default
            ``process_devices(plan)``); the same devices in any order (a group made ahead in
            the destination's order, ``megatron.groups_ahead.Joinworld``).
        prepared: this process's part made ahead (``prepare_exchange``) for this plan, device,
            process order and storage: the switch then skips binding, the destination check
            and preparing its rounds. One that does not fit the call (another plan, order or
            storage; a large source tensor that moved since) is not used: the switch prepares
            as without it, and says why in the report (``prepared_ahead``, ``prepared_why``).
            Each process decides for itself; the wire is the same either way.

    Returns:
        (destination storage, or None if the device is not a destination device; the report
        of ``SwitchReport.as_dict``).

    Raises:
        SwitchAborted: on any failure or timeout, on every process still alive.

    Example:
        >>> dst, report = switch(plan, sv, dv, "node0:gpu1", src, timeout=30)  # doctest: +SKIP
    """
    pg = group if group is not None else dist.group.WORLD
    previous = _timeout_of(pg)
    try:
        return _switch(plan, src_view, dst_view, device, src_store, pg, timeout,
                       destroy_group_on_abort, verify_source, on_round, dst_store,
                       check_transfers, fill, devices, prepared)
    finally:  # the group is the caller's (often its default group): its own timeout again
        if previous is not None and not _destroyed(pg):
            pg.set_timeout(previous)


def _timeout_of(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg``'s collectives have now (None where torch does not say)."""
    try:
        return pg._get_backend(torch.device("cpu") if dist.get_backend(pg) == "gloo"
                               else torch.device("cuda")).options._timeout
    except Exception:  # noqa: BLE001 — a backend without options: left as the switch set it
        return None


def _destroyed(pg: dist.ProcessGroup) -> bool:
    try:
        dist.get_backend(pg)
        return False
    except Exception:  # noqa: BLE001 — destroyed on abort
        return True


def _switch(plan: Plan, src_view: StateView, dst_view: StateView, device: str,
            src_store: Mapping[tuple, torch.Tensor] | None, pg: dist.ProcessGroup,
            timeout: float, destroy_group_on_abort: bool, verify_source: bool,
            on_round: Callable[[int], None] | None, dst_store: Storage | None,
            check_transfers: bool,
            fill: Callable[[Storage | None, dist.ProcessGroup, tuple[str, ...], torch.device],
                           object] | None,
            order: Sequence[str] | None = None, prepared: "PreparedExchange | None" = None
            ) -> tuple[Storage | None, dict]:
    """``switch`` on the group ``pg``, whose timeout it sets to ``timeout``."""
    t_start = time.perf_counter()
    td = datetime.timedelta(seconds=timeout)
    where = _Where()
    devices = _process_order(plan, order)
    why = "none given" if prepared is None else prepared.bind(plan, device, devices,
                                                              src_store, dst_store)
    if why:
        prepared = None
    on = tensor_device(src_store, dst_store, pg) if prepared is None else prepared.on
    # Sends are packed ahead only within what the verified plan says this device stages in
    # its busiest round, so the verifier's memory check (state plus that) holds at run time.
    arena = Arena(on, planned_peak_staging(plan, device))
    try:
        if prepared is None:
            me = _bind(plan, src_view, dst_view, device, src_store, devices)
            on_one_device(on, ("source", src_store), ("destination", dst_store))
            dst = _destination(dst_view, me, dst_store, on)
        else:
            me, dst = prepared.me, prepared.dst
        _check_group(pg, me, devices)
        pg.set_timeout(td)  # gloo collectives block their worker thread up to this long
        before = checksums(src_store) if verify_source and src_store is not None else None
        grouped = posts_grouped(pg)
        barrier_seconds = 0.0
        if grouped:  # NCCL: a group's first collective must involve all of its ranks, and a
            # round's batch may involve only some
            where.phase = "start barrier"
            ids = [on.index] if on.type == "cuda" and on.index is not None else None
            t = time.perf_counter()
            _wait(dist.barrier(group=pg, async_op=True, device_ids=ids), timeout)
            barrier_seconds = time.perf_counter() - t
        first_round = [time.perf_counter()]  # set again when round 0's exchange starts
        works = (_works(plan, me, src_store, dst, devices) if prepared is None
                 else prepared.fresh_works())
        reports = _run_rounds(plan, me, works, pg, devices, timeout, where, on_round, arena,
                              grouped, first_round)
        setup_seconds = first_round[0] - t_start
        where.round = None
        if fill is not None:
            where.phase = "fill"
            fill(dst, pg, devices, on)
        t = time.perf_counter()
        derive = (0, 0, 0)
        if plan.derived:
            where.phase = "derive params"
            derive = derive_params(plan, dst_view, me.dst_rank, dst, pg, devices, timeout,
                                   where, _wait, on)
        derive_seconds = time.perf_counter() - t
        t = time.perf_counter()
        corrupted: list[str] = []
        if check_transfers:
            where.phase = "check transfers"
            corrupted = compare_transfers(
                plan, device, ByteViews(src_store) if src_store is not None else None,
                ByteViews(dst) if dst is not None else None, pg, on, timeout, _wait)
        check_seconds = time.perf_counter() - t
    except Exception as err:  # noqa: BLE001 — every failure becomes one SwitchAborted
        raise _abort(err, device, where, pg, destroy_group_on_abort) from err
    finally:
        peak_staging = arena.peak
        arena.release()  # freed before the vote

    # All messages of this process completed: a problem found now is voted, not shouted.
    problem = ""
    try:
        where.phase = "check"
        if before is not None and checksums(src_store) != before:
            problem = "its source storage changed during the switch"
        elif corrupted:
            more = f" (and {len(corrupted) - 1} more)" if len(corrupted) > 1 else ""
            problem = f"{corrupted[0]}{more}"
    except Exception as err:  # noqa: BLE001
        problem = f"{type(err).__name__}: {err}"
    t = time.perf_counter()
    where.phase, where.peer = "vote", None
    try:
        flags = torch.zeros(len(devices), dtype=torch.int32, device=on)
        mine = torch.tensor([0 if problem else 1], dtype=torch.int32, device=on)
        _wait(_all_gather(flags, mine, pg), timeout)
    except Exception as err:  # noqa: BLE001
        raise _abort(err, device, where, pg, destroy_group_on_abort) from err
    if int(flags.min()) != 1:  # the vote is the MIN of the flags
        failed = [d for d, f in zip(devices, flags.tolist()) if f != 1]
        why = f" ({problem})" if problem else ""
        raise SwitchAborted(f"switch aborted at the commit vote: {', '.join(failed)} voted "
                            f"failure{why}; this is {device}; group still usable",
                            device=device, peer=failed[0])
    report = SwitchReport(device, me.index, me.src_rank, me.dst_rank, tuple(reports),
                          plan.budget_bytes, peak_staging, derive[0], derive[1], derive[2],
                          derive_seconds, check_seconds, time.perf_counter() - t,
                          time.perf_counter() - t_start, setup_seconds, barrier_seconds)
    out = report.as_dict()
    out["prepared_ahead"], out["prepared_why"] = prepared is not None, why or None
    if me.index == 0:
        log.info("switch committed: %d rounds in %.3f s (%s); process 0 sent %s and received "
                 "%s: %.2f GB/s through its own links (its sent + received bytes over its "
                 "exchange time), staged at most %s (plan: %s)", len(reports),
                 report.total_seconds, plan.dst_name, _mib(out["bytes_sent"]),
                 _mib(out["bytes_received"]), out["achieved_GBps"], _mib(peak_staging),
                 _mib(out["planned_peak_staging_bytes"]))
    return dst, out


def planned_peak_staging(plan: Plan, device: str) -> int:
    """The most bytes ``device`` sends and receives between devices in one round of ``plan``:
    what the plan (and its verification) says the device stages at most."""
    return max((sum(m.nbytes for m in rnd.messages
                    if not m.local and device in (m.src_device, m.dst_device))
                for rnd in plan.rounds), default=0)


def tensor_device(src_store: Mapping[tuple, torch.Tensor] | None,
                  dst_store: Mapping[tuple, torch.Tensor] | None,
                  pg: dist.ProcessGroup) -> torch.device:
    """Where this process's staging, destination and vote tensors live: beside its state.

    The device of the storage it was given, else the backend's: NCCL moves only CUDA tensors,
    gloo CPU ones. One code path serves both; only the allocations follow the device.
    """
    for store in (src_store, dst_store):
        for t in (store or {}).values():
            return t.device
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_one_device(on: torch.device, *stores: tuple[str, Mapping | None]) -> None:
    """Every storage tensor of this process on ``on``: a device's copies run as one kernel
    table, and its staging sits beside its state (a CUDA job's state with one CPU tensor
    would otherwise fail inside Triton, naming a pointer, not the tensor)."""
    for what, store in stores:
        for key, t in (store or {}).items():
            if t.device != on:
                raise ValueError(f"{what} storage {key} is on {t.device}, the rest of this "
                                 f"process's storage on {on}: a process's storage must sit on "
                                 "one device")


def _destination(view: StateView, me: "_Me", given: Storage | None,
                 on: torch.device) -> Storage | None:
    """The storage the destination rank is built in: ``given`` (checked) or fresh zeros."""
    if me.dst_rank is None:
        if given is not None:
            raise ValueError(f"{me.device} runs no destination rank, so dst_store must not be "
                             "given")
        return None
    if given is None:
        return allocate(view, me.dst_rank, on)
    want = storage_layout(view, me.dst_rank)
    have = {k: (tuple(t.shape), t.dtype) for k, t in given.items()}
    if have != want:
        bad = sorted(set(want.items()) ^ set(have.items()), key=repr)[0]
        raise ValueError(f"dst_store does not match destination rank {me.dst_rank}'s storage "
                         f"(first difference: {bad[0]} {bad[1][1]} {list(bad[1][0])})")
    return given


def _works(plan: Plan, me: "_Me", src: Mapping | None, dst: Storage | None,
           devices: tuple[str, ...]) -> Callable[[int], RoundWork]:
    """Round ``i``'s work, prepared when asked (round ``i + 1`` while round ``i`` runs)."""
    src_views = ByteViews(src) if src is not None else None
    dst_views = ByteViews(dst) if dst is not None else None
    local = spread_local(plan.rounds, me.device, me.src_rank, me.dst_rank)

    def prepare(i: int) -> RoundWork:
        return prepare_round(i, plan.rounds[i], me.device, me.src_rank, me.dst_rank, src_views,
                             dst_views, devices, local[i])
    return prepare


def _run_rounds(plan: Plan, me: "_Me", prepare: Callable[[int], RoundWork],
                pg: dist.ProcessGroup, devices: tuple[str, ...], timeout: float,
                where: "_Where", on_round: Callable[[int], None] | None,
                arena: Arena, grouped: bool, first_round: list[float]) -> list[RoundReport]:
    """Every round in order; round ``i + 1``'s work (``prepare``) is had while round ``i``'s
    transfers run.

    ``first_round[0]`` is set to when round 0's exchange starts (the end of the setup)."""
    n = len(plan.rounds)
    reports: list[RoundReport] = []
    where.round, where.phase = (0, "prepare") if n else (None, "setup")
    nxt = prepare(0) if n else None
    progress = me.index == 0 and log.isEnabledFor(logging.INFO)
    moved = sum(m.nbytes for m in plan.messages() if not m.local) if progress else 0
    done = 0
    blocked = [0.0]  # seconds in the current round's waits

    def timed_wait(w: dist.Work | None, timeout: float, deadline: float | None = None) -> None:
        t = time.perf_counter()
        try:
            _wait(w, timeout, deadline)
        finally:
            blocked[0] += time.perf_counter() - t

    t0 = first_round[0] = time.perf_counter()
    for i in range(n):
        work, nxt = nxt, None
        where.round, where.peer, where.phase = i, None, "exchange"
        if on_round is not None:
            on_round(i)
        blocked[0] = 0.0
        seconds, nxt = run_round(work, arena, pg, devices, timeout, where, timed_wait,
                                 (lambda: prepare(i + 1)) if i + 1 < n else None, grouped)
        reports.append(RoundReport(i, seconds, work.bytes_sent, work.bytes_received,
                                   work.bytes_local, work.staging, work.planned_staging,
                                   work.packed_ahead, blocked[0]))
        if progress:
            done += sum(m.nbytes for m in plan.rounds[i].messages if not m.local)
            elapsed = time.perf_counter() - t0
            log.info("round %d/%d: %s of %s moved (all devices), %.3f s, %.2f GB/s so far "
                     "(all devices' bytes over the time since round 0); process 0 staged %s", i + 1, n, _mib(done), _mib(moved), seconds,
                     done / elapsed / 1e9 if elapsed > 0 else 0.0, _mib(work.staging))
    return reports


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class _Me:
    index: int
    device: str
    src_rank: int | None
    dst_rank: int | None


def _process_order(plan: Plan, order: Sequence[str] | None) -> tuple[str, ...]:
    """The switch's processes in its group's rank order (``switch``'s ``devices``)."""
    devices = process_devices(plan)
    if order is None:
        return devices
    if sorted(order) != sorted(devices):
        raise ValueError(f"devices: {len(order)} given, not the switch's {len(devices)} "
                         f"processes ({devices[0]}, ...) in some order")
    return tuple(order)


def _check_group(pg: dist.ProcessGroup, me: "_Me", devices: tuple[str, ...]) -> None:
    if pg.size() != len(devices) or pg.rank() != me.index:
        raise ValueError(f"process of {me.device} must be rank {me.index} of a group of "
                         f"{len(devices)} (the switch's processes); got rank {pg.rank()} "
                         f"of {pg.size()}")


def _bind(plan: Plan, src_view: StateView, dst_view: StateView, device: str,
          src_store: Mapping | None, devices: tuple[str, ...]) -> _Me:
    """Check that this process and its storage match the plan."""
    if device not in devices:
        raise ValueError(f"device {device} is in neither layout of the plan ({devices[0]}, ...)")
    if len(plan.src_devices) != src_view.layout.world:
        raise ValueError(f"the plan has {len(plan.src_devices)} source ranks, src_view "
                         f"{src_view.layout.world}")
    if len(plan.dst_devices) != dst_view.layout.world:
        raise ValueError(f"the plan has {len(plan.dst_devices)} destination ranks, dst_view "
                         f"{dst_view.layout.world}")
    index = devices.index(device)
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


def _all_gather(out: torch.Tensor, mine: torch.Tensor, pg: dist.ProcessGroup):
    """An async all-gather of ``mine`` into ``out``: torch 2.13 names it ``all_gather_single``
    (deprecating ``all_gather_into_tensor``); torch 2.6-2.12, in GPU containers, has only
    ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=pg, async_op=True)
