"""Buddy copies: every device's optimizer state at the last two step boundaries, kept in its own
host memory and in its buddy's on another node, so that a failure at any moment of an iteration
loses nothing that a checkpoint must restore.

Why two generations, on both sides. ``take`` runs at a step boundary (after the optimizer step
and the parameter all-gather): it copies this rank's state except the bf16 parameters (the fp32
main params, Adam's moments and step, module buffers such as the router's expert bias) into
host memory, then sends that copy to the buddy and receives its ward's, point to point, in the
background during the next forward and backward passes; the next optimizer step waits for that
exchange before it begins (before its grad-norm all-reduce). A device ``d`` that dies leaves
the survivors in one of these states (``m`` the lowest Adam step a survivor holds):

* all survivors at ``m`` and ``d``'s copy of ``m`` reached its buddy: restore ``m``;
* all at ``m`` but ``d`` died before its copy of ``m`` arrived (the survivors are in the next
  forward or backward pass, or blocked in the all-gather): ``d``'s buddy holds ``m - 1`` only;
* some survivors at ``m + 1`` (the failure struck inside the optimizer step, after the
  grad-norm all-reduce every rank took part in, so every rank had finished its exchange of
  ``m``).

A survivor is never more than one step ahead of the newest copy the dead device's buddy holds,
so two generations on each side always hold one step that every survivor and every lost shard
share: ``Recovery`` restores the newest such generation on every survivor (its own copy,
never its live tensors, which may be mid-step) and fills what the dead held from the buddies
during the exchange (``fill_pieces`` / ``run_fill``); the bf16 parameters are then derived from
the main params (``state.derive_param``), exactly as megatron's own cast does. The generation
carries its iteration, consumed samples and scheduler, so the data resumes at that step.

Cost: four copies of a rank's non-parameter state in host memory (``host_bytes``), and per
step one device-to-host copy at the boundary plus one send and one receive that run during the
next forward and backward passes (``bench/recovery_bench.py``'s buddy way measures both).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...ir.box import Box
from ...ir.errors import DynatrainError, LayoutError
from ...ir.layout import Layout
from ...ir.slots import Slot
from ...ir.state import StateView, view_of
from ...planner.buddy import buddy_pairs, check_buddy_spec
from ...planner.lost import LostState, subtract
from ..storage import Storage, region, storage_layout, within
from .bridge import extract_state, read_step
from .job import MegatronJob, carried

KEEP = 2  # generations kept on each side (see the module docstring)
POLL_S = 1.0  # how long a recovery waits for a ward's copy already on its way
_ALIGN = 8  # every tensor of a generation starts at a multiple of 8 bytes of its buffer


@dataclass(frozen=True)
class Generation:
    """One rank's state (parameters left out) at one step boundary, in host memory."""

    iteration: int
    step: int
    carry: dict | None  # job.carried at that boundary (own copies only)
    flat: torch.Tensor  # uint8: every tensor below, back to back
    store: Storage  # views into ``flat``, keyed like ``storage.allocate``

    @property
    def tag(self) -> tuple[int, int]:
        return self.iteration, self.step


def _offsets(view: StateView, rank: int) -> tuple[dict[tuple, tuple[int, tuple, torch.dtype]],
                                                    int]:
    """Where each non-parameter tensor of ``rank``'s storage sits in a generation's buffer."""
    out, at = {}, 0
    for key, (shape, dtype) in sorted(storage_layout(view, rank).items(), key=repr):
        if key[0] == "param":
            continue
        out[key] = (at, shape, dtype)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        at += -(-n // _ALIGN) * _ALIGN
    return out, at


def _views(flat: torch.Tensor, offsets: Mapping) -> Storage:
    out = {}
    for key, (at, shape, dtype) in offsets.items():
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[key] = flat[at:at + n].view(dtype).view(shape)
    return out


class BuddyCopy:
    """The buddy copies of one process of a job in one layout (``LiveSwitcher(buddy=True)``
    makes one per layout and calls ``take`` from ``snapshot``).

    Raises:
        DynatrainError: the layout's devices are on one node, or its state has no fp32 main
            params to derive the parameters from (``state.derive_param``'s rule).
    """

    def __init__(self, layout: Layout, device: str, timeout: float) -> None:
        check_buddy_spec(layout.spec)
        self.layout, self.device, self.timeout = layout, device, timeout
        self.pairs = buddy_pairs(layout.devices)
        self.buddy = self.pairs[device]
        self.ward = next(d for d, b in self.pairs.items() if b == device)
        self.rank = layout.devices.index(device)
        # The padding rows of the vocabulary counted as state: the widest view of the job's
        # tensors, whose keys cover any view a recovery reads them through.
        self.view = view_of(layout, layout.padded_vocab)
        self._mine, mine_bytes = _offsets(self.view, self.rank)
        self._theirs, their_bytes = _offsets(self.view, layout.devices.index(self.ward))
        self.host_bytes = KEEP * (mine_bytes + their_bytes)
        self._sizes = (mine_bytes, their_bytes)
        self.own: list[Generation] = []  # oldest first
        self.held: list[Generation] = []  # the ward's, oldest first
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple | None = None  # the exchange take started
        self.seconds: dict[str, float] = {}  # of the last take (copy, post, wait, exchange)

    @property
    def has_group(self) -> bool:
        """Whether the copies' group is made (the first ``take`` makes it)."""
        return self._group is not None

    def _pg(self) -> dist.ProcessGroup:
        """A gloo group of the job's world, made at the first ``take`` (a collective: every
        process takes its first copy at the same boundary). Host tensors travel on it
        whatever the job's backend."""
        if self._group is None:
            if dist.get_world_size() != self.layout.world or dist.get_rank() != self.rank:
                raise LayoutError(f"buddy copies: the default group must be the job's layout "
                                  f"in rank order (rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}; {self.device} is rank {self.rank} "
                                  f"of {self.layout.world})")
            self._group = dist.new_group(backend="gloo",
                                         timeout=datetime.timedelta(seconds=self.timeout))
        return self._group

    def _fresh(self, gens: list[Generation], size: int) -> torch.Tensor:
        """A buffer for the next generation: the oldest one's once ``KEEP`` are kept."""
        if len(gens) == KEEP:
            return gens.pop(0).flat
        return torch.empty(size, dtype=torch.uint8)

    def take(self, job: MegatronJob) -> None:
        """Copy this rank's state at this boundary to host memory and start sending it to the
        buddy (and receiving the ward's) in the background: the exchange overlaps the next
        forward and backward passes and is waited for (``finish``) when the job's optimizer
        step begins, before its grad-norm all-reduce, which the module docstring's argument
        needs. Every process of the job calls it at the same boundary, after the optimizer
        step; a second call at the same boundary (same iteration and step) does nothing.

        Raises:
            RuntimeError: the previous exchange failed: the buddy or the ward died or hangs
                (after ``timeout``); the job's collectives are broken too: ``recover``.
        """
        tag = (job.iteration, read_step(job.optimizer))
        if self.own and self.own[-1].tag == tag:
            return  # this boundary's copy is taken (the same on every process)
        self.finish()
        t0 = time.perf_counter()
        live = extract_state(self.view, self.rank, job.model_chunks, job.optimizer)
        flat = self._fresh(self.own, self._sizes[0])
        store = _views(flat, self._mine)
        for key, t in store.items():
            t.copy_(live[key])  # device to host
        gen = Generation(*tag, carried(job), flat, store)
        self.own.append(gen)
        t1 = time.perf_counter()
        pg = self._pg()
        into = self._fresh(self.held, self._sizes[1])
        tag_in = torch.zeros(2, dtype=torch.int64)
        buddy, ward = (self.layout.devices.index(d) for d in (self.buddy, self.ward))
        sends = [dist.isend(torch.tensor(gen.tag, dtype=torch.int64), buddy, group=pg, tag=1),
                 dist.isend(flat, buddy, group=pg, tag=2)]
        recvs = [dist.irecv(tag_in, ward, group=pg, tag=1),
                 dist.irecv(into, ward, group=pg, tag=2)]
        self._pending = (sends, recvs, tag_in, into, t1)
        self._arm(job)
        self.seconds = {"copy": t1 - t0, "post": time.perf_counter() - t1}

    def _arm(self, job: MegatronJob) -> None:
        """Make the job's optimizer step wait for the exchange first (once per job)."""
        opt = job.optimizer
        if getattr(opt, "_dynatrain_copies", None) is self:
            return
        real = opt.step

        def step(*args, **kwargs):
            self.finish()
            return real(*args, **kwargs)

        opt.step, opt._dynatrain_copies = step, self

    def finish(self) -> None:
        """Wait for the exchange ``take`` started and keep the ward's copy (nothing pending:
        nothing to do). Its seconds go to ``seconds``: ``wait`` is what the job waited."""
        if self._pending is None:
            return
        sends, recvs, tag_in, into, posted = self._pending
        t0 = time.perf_counter()
        self._pending = None
        for w in recvs + sends:
            w.wait(datetime.timedelta(seconds=self.timeout))
        self._keep(tag_in, into)
        self.seconds.update(wait=time.perf_counter() - t0, exchange=time.perf_counter() - posted)

    def _keep(self, tag_in: torch.Tensor, into: torch.Tensor) -> None:
        it, step = (int(x) for x in tag_in)
        self.held.append(Generation(it, step, None, into, _views(into, self._theirs)))

    def poll(self, within: float = POLL_S) -> None:
        """Keep the ward's copy if it has arrived, waiting at most ``within`` seconds for it (a
        recovery: the exchange of a job whose peer died may never finish, and its group is
        about to go). A receive is only known complete once waited for (gloo)."""
        if self._pending is None:
            return
        sends, recvs, tag_in, into, _ = self._pending
        self._pending = None
        try:
            for w in recvs:
                w.wait(datetime.timedelta(seconds=min(within, self.timeout)))
        except RuntimeError:  # never arrived: the ward died before it sent, or hangs
            return
        self._keep(tag_in, into)

    def tags(self) -> dict:
        """What this process holds: its own generations and its ward's, as (iteration, step)
        (a ward's copy that has arrived counts, its exchange finished or not)."""
        self.poll()
        return {"own": [list(g.tag) for g in self.own], "held": [list(g.tag) for g in self.held],
                "ward": self.ward}

    def own_at(self, tag: tuple[int, int]) -> Generation | None:
        return next((g for g in self.own if g.tag == tuple(tag)), None)

    def held_at(self, tag: tuple[int, int]) -> Generation | None:
        return next((g for g in self.held if g.tag == tuple(tag)), None)


def newest_common(holds: Mapping[str, dict], failed: tuple[str, ...],
                  pairs: Mapping[str, str]) -> tuple[int, int] | None:
    """The newest (iteration, step) that every survivor holds a copy of and every failed
    device's buddy holds its copy of; None if there is none (a buddy failed too, or no copies
    were taken yet). ``holds``: each survivor's ``BuddyCopy.tags()``."""
    common = None
    for tags in holds.values():
        mine = {tuple(t) for t in tags["own"]}
        common = mine if common is None else common & mine
    for d in failed:
        keeper = pairs.get(d)
        if keeper not in holds or holds[keeper]["ward"] != d:
            return None
        common = (common or set()) & {tuple(t) for t in holds[keeper]["held"]}
    return max(common, key=lambda t: (t[1], t[0])) if common else None


def why_none(holds: Mapping[str, dict] | None, failed: tuple[str, ...],
             pairs: Mapping[str, str] | None) -> str:
    """Why ``newest_common`` found no step to restore (for the line a refusal prints)."""
    if holds is None or pairs is None:
        return "no buddy copy of this layout was taken yet"
    for d in failed:
        keeper = pairs.get(d)
        if keeper not in holds:
            return f"{d}'s buddy copy was on {keeper}, which failed too"
    return "the survivors' and the buddies' copies share no step"


class Piece(NamedTuple):
    """``box`` of (key, kind), from the dead device's copy on ``holder`` to destination rank
    ``dst_rank``: the source and destination slots with their anchors, as in a ``Transfer``."""

    holder: str
    dst_rank: int
    key: str
    kind: str
    box: Box
    src_slot: Slot
    src_anchor: Box
    dst_slot: Slot
    dst_anchor: Box


def fill_pieces(src_view: StateView, dst_view: StateView, lost: LostState,
                holders: Mapping[str, str]) -> tuple[Piece, ...]:
    """Every piece of ``lost`` each destination rank holds, from the copy of a failed device
    that held it (``holders``: failed device -> the survivor holding its copy; the first in
    the source's rank order wins where several held it). The pieces of one destination region
    tile its lost part exactly: checked (pairwise disjoint, inside it, as many elements).

    Raises:
        DynatrainError: part of the lost state was held by no failed device with a copy.
    """
    src = src_view.layout
    dead = [(src.devices.index(d), h) for d, h in holders.items()]
    dead.sort()
    by_tensor: dict[tuple[str, str], list[tuple[str, object]]] = {}
    for rank, holder in dead:
        for reg in src_view.regions(rank):
            by_tensor.setdefault((reg.key, reg.kind), []).append((holder, reg))
    wanted = {(e.key, e.kind): e.boxes for e in lost.entries}
    out: list[Piece] = []
    for t in range(dst_view.layout.world):
        for reg in dst_view.regions(t):
            for b in wanted.get((reg.key, reg.kind), ()):
                need = reg.box & b
                if need is None:
                    continue
                rest, got = [need], []
                for holder, sreg in by_tensor.get((reg.key, reg.kind), ()):
                    nxt = []
                    for r in rest:
                        cut = r & sreg.box
                        if cut is None:
                            nxt.append(r)
                            continue
                        got.append(Piece(holder, t, reg.key, reg.kind, cut, sreg.slot,
                                         sreg.box, reg.slot, reg.box))
                        nxt.extend(subtract(r, cut))
                    rest = nxt
                if rest:
                    raise DynatrainError(f"buddy copies: {reg.key} [{reg.kind}]{rest[0]} was "
                                         "held by no failed device whose copy survives")
                _check_tiles(need, [p.box for p in got], reg.key, reg.kind)
                out.extend(got)
    return tuple(out)


def _check_tiles(whole: Box, parts: list[Box], key: str, kind: str) -> None:
    """``parts`` tile ``whole`` exactly: each inside it, pairwise disjoint, as many elements
    (a duplicate and a hole cannot cancel out once disjointness holds)."""
    for i, p in enumerate(parts):
        if (p & whole) != p or any(p & q is not None for q in parts[i + 1:]):
            raise DynatrainError(f"buddy copies: the pieces of {key} [{kind}]{whole} do not "
                                 f"tile it ({p})")
    if sum(p.numel for p in parts) != whole.numel:
        raise DynatrainError(f"buddy copies: the pieces of {key} [{kind}]{whole} do not "
                             "cover it")


def run_fill(pieces: tuple[Piece, ...], me: str, dst_devices: tuple[str, ...],
             devices: tuple[str, ...], copy: Storage | None, dst: Storage | None,
             pg: dist.ProcessGroup, timeout: float, on: torch.device) -> int:
    """Move ``pieces`` on the switch's group: the holder of a failed device's ``copy`` sends
    each destination rank (on ``dst_devices[rank]``) its pieces as one buffer, in piece order;
    the destination writes them into ``dst``. Every process of the switch calls it
    (``devices``: the group's processes in rank order). Returns the bytes this process wrote
    into ``dst``."""
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    wrote = 0
    for p in pieces:
        to = dst_devices[p.dst_rank]
        if p.holder == me and to == me:
            src = region(copy, p.kind, p.src_slot, p.src_anchor)[within(p.box, p.src_anchor)]
            out = region(dst, p.kind, p.dst_slot, p.dst_anchor)[within(p.box, p.dst_anchor)]
            out.copy_(src)
            wrote += out.numel() * out.element_size()
        elif p.holder == me:
            sends.setdefault(devices.index(to), []).append(p)
        elif to == me:
            recvs.setdefault(devices.index(p.holder), []).append(p)
    works, inbound = [], []
    for peer, ps in sends.items():
        parts = [region(copy, p.kind, p.src_slot, p.src_anchor)[within(p.box, p.src_anchor)]
                 .contiguous().view(-1).view(torch.uint8) for p in ps]
        works.append(dist.isend(torch.cat(parts).to(on), peer, group=pg, tag=3))
    for peer, ps in recvs.items():
        outs = [region(dst, p.kind, p.dst_slot, p.dst_anchor)[within(p.box, p.dst_anchor)]
                for p in ps]
        buf = torch.empty(sum(o.numel() * o.element_size() for o in outs), dtype=torch.uint8,
                          device=on)
        works.append(dist.irecv(buf, peer, group=pg, tag=3))
        inbound.append((buf, outs))
    for w in works:
        w.wait(datetime.timedelta(seconds=timeout))
    for buf, outs in inbound:
        at = 0
        for o in outs:
            n = o.numel() * o.element_size()
            o.copy_(buf[at:at + n].view(o.dtype).view(o.shape))
            at += n
            wrote += n
    return wrote

