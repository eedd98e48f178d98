"""One round of a switch on one process: wire pieces, staging, posting, waiting, unpacking.

A remote message goes on the wire as *pieces*, cut the same way on both ends from the plan and
the dtypes alone: its (transfer, state kind) segments in plan order, each cut along its outer
dims into chunks of about ``CHUNK_BYTES``; a chunk of at least ``DIRECT_MIN_BYTES`` is a piece
of its own, and the chunks between two such are packed together up to ``CHUNK_BYTES``. A piece
whose view is contiguous travels straight from the source storage or into the destination
storage (no copy, no staging; each end decides for itself); the others are packed into, or
received into, one byte arena the process keeps for the whole switch and grows only when a
round needs more. So a round's staging never exceeds what the plan says (its message bytes), is
usually far below it, and its pages are touched once per switch rather than once per round.
Sends packed ahead live in two more buffers (by round parity), used only while everything the
process holds stays within what the plan says it stages in its busiest round.

A round's staged sends, staged receives and local copies are each described once, when the
round is prepared, as a ``CopyTable`` (a part per piece): on CUDA with Triton a whole-table run
is a few kernel launches whatever the piece count; elsewhere a part runs as one ``copy_`` per
merged pair of views. On CUDA the sends packed ahead are packed on a stream of the arena's own,
and the round's posting waits for that stream's event (no host synchronisation).

Local copies (device to itself) run in whichever round ``spread_local`` gives them. In a round
a process posts every receive, posts its straight sends and the sends packed ahead, then packs
and posts the rest piece by piece (the network moves a piece while the next is packed), copies
its local messages, prepares the next round and, where there is room, packs that round's
staged sends while this round's transfers run, and finally waits for its receives in order,
unpacking each staged piece as soon as it lands. Packing ahead only reads the source storage,
which nothing writes during a switch, so it is safe at any time.

On gloo every operation of a round is independent and non-blocking, so posting order cannot
deadlock. NCCL runs the operations between two ranks in the order they were posted, so there
a round packs all of its staged sends, is posted as one group (``batch_isend_irecv``: pieces
between two processes in tag order on both ends, as NCCL matches them by order) and unpacks
once it completed. A piece's tag is ``k * MAX_PIECES + piece index`` for the k-th message
between its two devices in the round: unique among the round's operations between two
processes.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planner.plan import Message, Round, Transfer
from .copytable import CopyTable
from .storage import ByteViews, row_blocks

DIRECT_MIN_BYTES = 256 << 10  # a segment this large is a piece of its own (straight from or
# into storage where contiguous); below it, packing costs less than another wire operation
CHUNK_BYTES = 4 << 20  # segments and packed runs are cut to about this, so packing, the wire
# and unpacking overlap (gloo moves 4 MiB pieces as fast as 64 MiB ones, measured)
MAX_PIECES = 1 << 20  # pieces per message: tag = pair ordinal * MAX_PIECES + piece index


@dataclass(slots=True)
class Piece:
    """One wire operation: its peer, tag, byte size and tensor views.

    ``views`` are the segments' views in the storage (source views on the sender, destination
    views on the receiver). ``wire`` is what goes on the wire: the single contiguous view's
    bytes when ``direct``, else a slice of the staging arena (assigned when the round runs).
    """

    peer: int
    tag: int
    nbytes: int
    views: list[torch.Tensor]
    direct: bool
    wire: torch.Tensor | None = None
    ahead: bool = False  # a staged send packed during the previous round
    table: CopyTable | None = None  # the round's pack or unpack table (staged pieces)
    part: int = -1  # this piece's part of ``table``


@dataclass(slots=True)
class RoundWork:
    """What one process does in one round, prepared before the round runs."""

    index: int
    recvs: list[Piece]
    sends: list[Piece]
    local: list[Transfer]  # copied slot to slot on this device
    src: ByteViews | None
    dst: ByteViews | None
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    planned_staging: int  # the plan's staging for this process: its remote message bytes
    staging: int  # bytes of this round's pieces that go through the arena
    packed_ahead: int = 0  # of those, send bytes packed during the previous round
    pack: CopyTable | None = None  # staged sends into the arena, a part per piece
    unpack: CopyTable | None = None  # staged receives out of the arena, a part per piece
    copies: CopyTable | None = None  # the local copies
    send_region: torch.Tensor | None = None  # the arena bytes of the staged sends (bound by
    recv_region: torch.Tensor | None = None  # Arena.carve/pack_ahead), and of the receives
    packed: object = None  # CUDA: event recorded when the sends packed ahead are packed

    def reset(self) -> None:
        """Forget what a run left (arena slices, sends packed ahead): ready to run again."""
        for p in self.recvs + self.sends:
            p.wire, p.ahead = None, False
        self.packed_ahead, self.send_region, self.recv_region, self.packed = 0, None, None, None

    def local_views(self):
        """(source, destination) byte views of the local copies."""
        for t in self.local:
            yield from zip(_segment_views(self.src, t, "src"), _segment_views(self.dst, t, "dst"))


def _segment_views(views: ByteViews, t: Transfer, side: str) -> list[torch.Tensor]:
    """Per kind of ``t``, the bytes of its box in the source or destination slot."""
    if side == "src":
        return views(t.kinds, t.src_slot, t.src_anchor, t.box)
    return views(t.kinds, t.dst_slot, t.dst_anchor, t.box)


def _pieces(m: Message, ordinal: int, views: ByteViews, side: str, rank: int, peer: int
            ) -> list[Piece]:
    """Cut message ``m`` into wire pieces; both ends cut it the same way (see the module doc)."""
    out: list[Piece] = []
    run: list[torch.Tensor] = []
    run_bytes = total = 0
    base = ordinal * MAX_PIECES

    def flush() -> None:
        nonlocal run, run_bytes
        if run:
            out.append(Piece(peer, base + len(out), run_bytes, run, False))
            run, run_bytes = [], 0

    for t in m.transfers:
        if (t.src_rank if side == "src" else t.dst_rank) != rank:
            end, dev, role = (("sent", m.src_device, "source") if side == "src"
                              else ("received", m.dst_device, "destination"))
            raise ValueError(f"transfer {t} is {end} by {dev}, which runs {role} rank {rank}")
        for seg in _segment_views(views, t, side):
            total += seg.numel()
            for v in row_blocks(seg, CHUNK_BYTES):
                n = v.numel()
                room = len(out) + 3 <= MAX_PIECES  # a flushed run, this piece, a last run
                if n >= DIRECT_MIN_BYTES and room:
                    flush()
                    out.append(Piece(peer, base + len(out), n, [v], v.is_contiguous()))
                    continue
                if run_bytes + n > CHUNK_BYTES and room:
                    flush()
                run.append(v)
                run_bytes += n
    flush()
    if total != m.nbytes:
        raise ValueError(f"message {m.src_device}->{m.dst_device} holds {total} bytes, the plan "
                         f"says {m.nbytes} (plan and dtypes disagree)")
    return out


def spread_local(rounds: tuple[Round, ...], device: str, src_rank: int | None,
                 dst_rank: int | None) -> list[list[Transfer]]:
    """This device's local copies, spread over the rounds it runs.

    The plan puts every local copy in the first round, beside that round's exchange; a device
    with many local bytes would then finish the round late and post its next sends late, while
    it idles in rounds with little traffic. Local copies touch nothing another process waits
    for, so each device may run them in any round: largest first, each goes to the round where
    this device has the fewest bytes so far (its remote message bytes plus copies placed).
    """
    load = [0] * len(rounds)
    local: list[Transfer] = []
    for i, rnd in enumerate(rounds):
        for mi in rnd.device_order().get(device, ()):
            m = rnd.messages[mi]
            if not m.local:
                load[i] += m.nbytes
                continue
            for t in m.transfers:
                if t.src_rank != src_rank or t.dst_rank != dst_rank:
                    raise ValueError(f"local transfer {t} does not stay on {device}")
            local.extend(m.transfers)
    out: list[list[Transfer]] = [[] for _ in rounds]
    heap = [(b, i) for i, b in enumerate(load)]
    heapq.heapify(heap)
    for t in sorted(local, key=lambda t: -t.nbytes):
        b, i = heapq.heappop(heap)
        out[i].append(t)
        heapq.heappush(heap, (b + t.nbytes, i))
    return out


def prepare_round(i: int, rnd: Round, device: str, src_rank: int | None, dst_rank: int | None,
                  src: ByteViews | None, dst: ByteViews | None, devices: tuple[str, ...],
                  local: list[Transfer]) -> RoundWork:
    """Views and pieces of this process's part of round ``i`` (no data moves yet); ``local``:
    the local copies this device runs in the round (``spread_local``)."""
    recvs: list[Piece] = []
    sends: list[Piece] = []
    if local and (src is None or dst is None):
        raise ValueError(f"local copies on {device}, which is not both a source and a "
                         "destination device")
    sent = received = 0
    n_local = sum(t.nbytes for t in local)
    mine = rnd.device_order().get(device, ())
    # Tags: the k-th message of a device pair in this round (both ends count alike).
    seen: dict[tuple[str, str], int] = {}
    ordinal = {}
    for mi in sorted(mine):
        pair = (rnd.messages[mi].src_device, rnd.messages[mi].dst_device)
        ordinal[mi] = seen[pair] = seen.get(pair, -1) + 1
    if seen and max(seen.values()) >= (1 << 31) // MAX_PIECES:
        raise ValueError(f"round {i} has more messages between two devices than tags allow")
    for mi in mine:
        m = rnd.messages[mi]
        nbytes = m.nbytes
        if m.local:
            continue  # run in the round spread_local chose
        if m.src_device == device:
            if src is None:
                raise ValueError(f"{device} sends a message but holds no source rank")
            sends += _pieces(m, ordinal[mi], src, "src", src_rank, devices.index(m.dst_device))
            sent += nbytes
        elif m.dst_device == device:
            if dst is None:
                raise ValueError(f"{device} receives a message but runs no destination rank")
            recvs += _pieces(m, ordinal[mi], dst, "dst", dst_rank, devices.index(m.src_device))
            received += nbytes
        else:
            raise ValueError(f"round {i} orders message {mi} ({m.src_device}->{m.dst_device}) "
                             f"on {device}, which is neither end")
    staging = sum(p.nbytes for p in recvs + sends if not p.direct)
    work = RoundWork(i, recvs, sends, local, src, dst, sent, received, n_local, sent + received,
                     staging)
    work.pack = _staging_table(sends, "send")
    work.unpack = _staging_table(recvs, "recv")
    work.copies = CopyTable([list(work.local_views())])
    return work


def _staging_table(pieces: list[Piece], side: str) -> CopyTable:
    """The copies of the staged ``pieces`` to (sends) or from (receives) their arena bytes: a
    part per piece, the pieces laid out one after the other as ``Arena`` places them."""
    parts = []
    for p in pieces:
        if p.direct:
            continue
        p.part, off, part = len(parts), 0, []
        for v in p.views:
            part.append((v, off) if side == "send" else (off, v))
            off += v.numel()
        parts.append(part)
    table = CopyTable(parts)
    for p in pieces:
        if not p.direct:
            p.table = table
    return table


class Arena:
    """The staging bytes of one process for a whole switch; its buffers grow, never shrink.

    ``buf`` holds the staged pieces of the running round that were not packed ahead;
    ``ahead[k]`` the sends packed ahead for the rounds of parity ``k`` (round ``i + 1`` is
    packed while round ``i``'s sends, in the other one, may still be on the wire). ``peak`` is
    the most bytes the three held at once (on CUDA the caching allocator may keep freed
    buffers reserved beyond that).
    """

    def __init__(self, device: torch.device | None = None, budget: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.budget = budget  # None: pack ahead whenever there is something to pack
        self.buf = self._empty(0)
        self.ahead = [self._empty(0), self._empty(0)]
        self.peak = 0
        # CUDA: sends are packed ahead on a stream of their own, so that packing round i + 1
        # runs beside round i's transfers and unpacking (on the current stream).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        """Free every buffer (the peak is kept)."""
        self.buf = self.ahead[0] = self.ahead[1] = self._empty(0)

    def held(self) -> int:
        """Bytes the arena holds now."""
        return self.buf.numel() + self.ahead[0].numel() + self.ahead[1].numel()

    def carve(self, work: RoundWork) -> None:
        """Give every staged piece of ``work`` that was not packed ahead its slice of ``buf``."""
        need = work.staging - work.packed_ahead
        if need > self.buf.numel():
            self.buf = self._empty(0)  # free it first
            k = work.index % 2
            if self.budget is not None and need + self.held() > self.budget:
                # Only this round's sends packed ahead are still in use: the sends of earlier
                # rounds completed, so their buffers may go to make room.
                self.ahead[1 - k] = self._empty(0)
                if not work.packed_ahead:
                    self.ahead[k] = self._empty(0)
            self.buf = self._empty(need)
        self.peak = max(self.peak, self.held())
        off = 0
        for p in work.recvs + work.sends:
            if p.direct:
                p.wire = p.views[0]
            elif not p.ahead:
                p.wire = self.buf[off:off + p.nbytes]
                off += p.nbytes
        # The staged receives come first in buf, then the staged sends not packed ahead.
        recv_bytes = sum(p.nbytes for p in work.recvs if not p.direct)
        work.recv_region = self.buf[:recv_bytes]
        if not work.packed_ahead:
            work.send_region = self.buf[recv_bytes:need]
        if work.packed is not None:  # posting this round's sends waits for their packing
            torch.cuda.current_stream(self.device).wait_event(work.packed)

    def pack_ahead(self, work: RoundWork) -> int:
        """Pack the staged sends of ``work`` (the next round) now, if the budget allows.

        Allowed when the buffers, grown for it and for ``work``'s own staging, stay within the
        budget. Returns the bytes packed (0: none; the round packs them itself)."""
        staged = [p for p in work.sends if not p.direct]
        need = sum(p.nbytes for p in staged)
        if not need:
            return 0
        k = work.index % 2
        after = (max(self.buf.numel(), work.staging - need) + self.ahead[1 - k].numel()
                 + max(self.ahead[k].numel(), need))
        if self.budget is not None and after > self.budget:
            return 0
        if need > self.ahead[k].numel():
            self.ahead[k] = self._empty(0)  # its sends (two rounds back) have completed
            self.ahead[k] = self._empty(need)
        self.peak = max(self.peak, self.held())
        off = 0
        for p in staged:
            p.wire, p.ahead = self.ahead[k][off:off + p.nbytes], True
            off += p.nbytes
        work.send_region = self.ahead[k][:need]
        if self.stream is None:
            _pack_all(work)
        else:
            # The side stream first waits for the current one: the buffer's earlier users (the
            # sends of two rounds back, waited for there) are done. The current stream waits
            # for the event before it posts the round (carve), and the buffer is only freed
            # after that, so the allocator never hands it out while the packing still runs.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                _pack_all(work)
            work.packed = self.stream.record_event()
        work.packed_ahead = need
        return need


def _pack(p: Piece) -> None:
    """Copy the views of staged send ``p`` into its wire (its part of the round's table)."""
    if p.table is not None:
        p.table.run(p.wire, part=p.part)
        return
    off = 0  # a piece made without a table (by hand, in tests)
    for v in p.views:
        n = v.numel()
        p.wire.narrow(0, off, n).view(v.shape).copy_(v)
        off += n


def _unpack(p: Piece) -> None:
    """Copy staged receive ``p`` from its wire into its views."""
    if p.table is not None:
        p.table.run(p.wire, part=p.part)
        return
    off = 0
    for v in p.views:
        n = v.numel()
        v.copy_(p.wire.narrow(0, off, n).view(v.shape))
        off += n


def _pack_all(work: RoundWork) -> None:
    """Pack every staged send of ``work`` (one table run: a few kernel launches on CUDA)."""
    if work.pack is not None:
        work.pack.run(work.send_region)
    else:
        for p in work.sends:
            if not p.direct:
                _pack(p)


def posts_grouped(pg: dist.ProcessGroup) -> bool:
    """Whether a round's operations must be posted as one group (``batch_isend_irecv``).

    NCCL runs the operations between two ranks in the order they were posted: a receive
    posted before a send, on both ends, waits forever unless the round is one NCCL group.
    gloo's operations are independent, so each piece is posted as soon as it is packed.
    """
    return dist.get_backend(pg) != "gloo"


def _post_grouped(work: RoundWork, pg: dist.ProcessGroup, where
                  ) -> list[tuple[dist.Work | None, Piece | None, bool]]:
    """Pack every staged send, then post the round as one group.

    NCCL has no tags: operations between two processes in one direction match in posting
    order, so both ends post them in tag order, which both compute alike. They all carry tag
    0, so that gloo (in the tests) matches them by order too, as NCCL does."""
    where.phase = "pack"
    if not work.packed_ahead:
        _pack_all(work)
    where.phase = "exchange"
    ops = [dist.P2POp(dist.irecv, p.wire, group=pg, tag=0, group_peer=p.peer)
           for p in sorted(work.recvs, key=lambda p: (p.peer, p.tag))]
    ops += [dist.P2POp(dist.isend, p.wire, group=pg, tag=0, group_peer=p.peer)
            for p in sorted(work.sends, key=lambda p: (p.peer, p.tag))]
    return [(w, None, False) for w in (dist.batch_isend_irecv(ops) if ops else [])]


def _post_each(work: RoundWork, pg: dist.ProcessGroup, where
               ) -> list[tuple[dist.Work | None, Piece | None, bool]]:
    """Post every receive, then every send as soon as it is packed (gloo)."""
    works: list[tuple[dist.Work | None, Piece | None, bool]] = []
    for p in work.recvs:
        # The process group's own calls: dist.irecv/isend only add checks done here already.
        works.append((pg.recv([p.wire], p.peer, p.tag), p, True))
    # Sends that need no packing now first: the network starts while the rest is packed.
    for p in sorted(work.sends, key=lambda p: not (p.direct or p.ahead)):
        if not (p.direct or p.ahead):
            where.phase = "pack"
            _pack(p)
            where.phase = "exchange"
        works.append((pg.send([p.wire], p.peer, p.tag), p, False))
    return works


def run_round(work: RoundWork, arena: Arena, pg: dist.ProcessGroup, devices: tuple[str, ...],
              timeout: float, where, wait: Callable,
              prepare_next: Callable[[], RoundWork] | None, grouped: bool = False
              ) -> tuple[float, RoundWork | None]:
    """Run one prepared round; returns its seconds and the next round's work, which
    ``prepare_next`` prepares (and the arena packs ahead) while this round's transfers run.
    ``grouped``: post the round as one group (``posts_grouped``)."""
    t0 = time.perf_counter()
    where.phase = "exchange"
    arena.carve(work)
    works = _post_grouped(work, pg, where) if grouped else _post_each(work, pg, where)
    where.phase = "local copy"  # overlaps the exchange: no staging, no network
    if work.copies is not None:
        work.copies.run()
    else:
        for s, d in work.local_views():
            d.copy_(s)
    nxt = None
    if prepare_next is not None:
        where.phase = "prepare next round"
        nxt = prepare_next()
        where.phase = "pack next round"
        arena.pack_ahead(nxt)
    deadline = time.monotonic() + timeout
    for w, p, is_recv in works:  # receives first (posted first): unpack each as it lands
        where.phase, where.peer = "exchange", devices[p.peer] if p is not None else None
        wait(w, timeout, deadline)
        if is_recv and not p.direct:
            where.phase, where.peer = "unpack", None
            _unpack(p)
    where.peer = None
    if grouped:  # one group: its receives are all complete now (on CUDA: the current
        # stream waited for the group's NCCL stream in Work.wait, so the unpack runs after it)
        where.phase = "unpack"
        if work.unpack is not None and work.unpack.kernel:
            work.unpack.run(work.recv_region)  # one table run
        else:
            for p in work.recvs:
                if not p.direct:
                    _unpack(p)
    for p in work.recvs + work.sends:
        p.wire = None  # drop views of the arena before it may be replaced
    work.send_region = work.recv_region = None
    return time.perf_counter() - t0, nxt
