"""Megatron's process groups of a switch's destination, formed while the job still trains.

A same-devices switch replaces megatron's parallel state: ``initialize_model_parallel`` creates
every group of the destination (tensor, pipeline, data, context, expert, embedding, ... and
their gloo twins), each one a rendezvous of its members through the store and, on gloo, a full
mesh of connections. That was a third of an in-place switch's downtime in the live example.
``GroupsAhead`` moves it off the critical path:

1. ``record`` (on the training thread, at the boundary where the switch is prepared): megatron's
   own ``initialize_model_parallel`` runs for the destination with ``torch.distributed.new_group``
   replaced by a recorder (and ``destroy_process_group`` by nothing), and the module's globals
   are put back as they were: the calls megatron makes, in order, and nothing created;
2. a background thread makes the same calls, with the same arguments, while the job trains on
   in its current groups: every process calls ``new_group`` for every group (as megatron does),
   so torch numbers and names them exactly as it would have at the switch. Nothing else may
   create groups meanwhile (``LiveSwitcher`` waits for the thread before it creates any);
   torch's ``use_local_synchronization`` is no way out: its names count the groups each process
   is a member of, which differ between processes;
3. at the switch, once every process of the job agreed that its groups are ready (one
   all-reduce), ``initialize`` runs ``initialize_model_parallel`` again with ``new_group``
   handing out the groups made ahead, call by call, checked against the recorded arguments. If
   any process's groups are not ready, every process creates them at the switch as before,
   after ``resync`` set torch's group counter to the highest any process reached (a thread that
   failed part way left it lower than its peers').

A switch whose destination keeps some of the source's devices and no others (devices leave,
none join: a preemption notice's switch) changes the world, and torch has one default group per
process. Its groups are made ahead all the same (``Subworld``): the destination's world and
every megatron group of it are made as groups of the source's world, their ranks translated
(megatron's ``initialize_model_parallel`` is recorded with the destination's world size and
rank). The switch's exchange runs in the source's world as it is, then each staying process
``promote``s the destination's world to its default group: torch's default is set to it, every
other group of the source's world is destroyed (as ``destroy_process_group`` destroys a group),
and the kept groups' rank maps are renumbered to the new world. This reaches into torch's
process-group registry (``distributed_c10d._world``, ``_update_default_pg``): checked on the
torch this runs with, refused (groups made at the switch) where those are missing. It needs the
destination's devices in the source's relative order: torch numbers a group's members by sorted
global rank, megatron by its own world's rank.

Devices that join need a world beside the job's (``Joinworld``): made on the rendezvous
store, each group by its members only, by the job's processes in the background thread and by
the joiners while they wait. Where devices leave at the same switch, the switch's own world is
made so too, over every process of the switch, the destination's processes first (its groups
are then numbered alike in both worlds): the exchange runs in it, then the destination's
world becomes the default (``settle``).

Gloo only: NCCL communicators are created lazily by torch (at a group's first collective)
unless the default group was bound to a device, and an eager ``ncclCommSplit`` is a collective
on the parent communicator that the training stream is using, so on NCCL groups are created at
the switch (``supported``). Not used with SHARP (``initialize_model_parallel`` then runs
barriers on the new groups).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .rendezvous import release_in_background


def supported(init_kwargs: dict, backend: str | None = None) -> bool:
    """Whether the groups of a switch can be formed ahead: gloo (``backend``, default the
    current default group's), no SHARP."""
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else None
    return (backend == "gloo" and not init_kwargs.get("use_sharp")
            and not init_kwargs.get("sharp_enabled_group"))


@dataclass(frozen=True)
class Subworld:
    """A destination's world inside the current default group.

    Attributes:
        ranks: the current group's rank of each destination rank (strictly increasing).
        rank: this process's destination rank (None: it leaves).
        timeout: the collective timeout of the destination's default group.
    """

    ranks: tuple[int, ...]
    rank: int | None
    timeout: datetime.timedelta


def subworld(src: Sequence[str], dst: Sequence[str], device: str,
             timeout: float) -> Subworld | None:
    """The destination ``dst`` (devices in rank order) as a ``Subworld`` of the current default
    group, whose rank ``i`` runs ``src[i]``; None where it is not one: a device joins, none
    leaves, the order differs, or torch's registry lacks what ``promote`` needs."""
    c10d = dist.distributed_c10d
    if not (hasattr(c10d, "_update_default_pg") and hasattr(c10d, "_world")):
        return None
    if not set(dst) < set(src) or dist.get_world_size() != len(src) \
            or dist.get_rank() != list(src).index(device):
        return None
    ranks = tuple(list(src).index(d) for d in dst)
    if list(ranks) != sorted(ranks):
        return None
    return Subworld(ranks, list(dst).index(device) if device in dst else None,
                    datetime.timedelta(seconds=timeout))


@dataclass(frozen=True)
class Joinworld:
    """A destination's world that takes in processes from outside the job (spares joining):
    made beside the job's world on the rendezvous store, by the job's processes in a
    background thread and by the joiners while they wait.

    Where devices also leave (a node replaced: neither world holds the other), the switch's
    own world is made too, beside the job's, over every process of the switch: the
    destination's processes in its order, then those that leave (``switch_order``). The
    destination's processes are its first ranks, so the destination's groups are numbered
    alike in both worlds. The exchange runs in the switch's world; then the destination's
    processes make theirs the default group, and those that leave go.

    Attributes:
        size: the destination's number of processes.
        rank: this process's destination rank (None: it leaves).
        name: unique to the switch: the store prefix and torch's names of its groups.
        store: the store every process reaches (``Rendezvous.store``).
        timeout: the collective timeout of the destination's default group.
        union: the switch's number of processes (``size`` where nobody leaves).
        union_rank: this process's rank in the switch's world.
    """

    size: int
    rank: int | None
    name: str
    store: Any
    timeout: datetime.timedelta
    union: int
    union_rank: int

    @property
    def leaves(self) -> bool:
        """Whether devices leave too (the switch's world is not the destination's)."""
        return self.union > self.size


def switch_order(src: Sequence[str], dst: Sequence[str]) -> tuple[str, ...]:
    """The processes of a switch whose destination ``dst`` takes in devices from outside the
    source ``src``, in the order of its world: the destination's, then those that leave."""
    return (*dst, *(d for d in src if d not in dst))


def joinworld(src: Sequence[str], dst: Sequence[str], device: str, name: str, store: Any,
              timeout: float) -> Joinworld | None:
    """The destination ``dst`` as a ``Joinworld`` where it is one: it takes in a device the
    source does not hold (its other devices in any order; devices may leave too), and torch
    has what making and promoting it needs; else None."""
    c10d = dist.distributed_c10d
    if not all(hasattr(c10d, f) for f in ("_update_default_pg", "_world",
                                          "_new_process_group_helper")):
        return None
    order = switch_order(src, dst)
    if set(dst) <= set(src) or device not in order:
        return None
    return Joinworld(len(dst), list(dst).index(device) if device in dst else None, name, store,
                     datetime.timedelta(seconds=timeout), len(order), order.index(device))


def _size_and_rank(world: Subworld | Joinworld) -> tuple[int, int]:
    return (len(world.ranks) if isinstance(world, Subworld) else world.size), world.rank or 0


@contextmanager
def _world_is(world: Subworld | Joinworld | None) -> Iterator[None]:
    """torch's default world reads as ``world``'s (size, this process's rank; 0 for a
    process that leaves: megatron's list of groups is the same on every rank), and as
    initialized (a joiner has no default group yet)."""
    if world is None:
        yield
        return
    size, rank = _size_and_rank(world)
    real_size, real_rank, real_init = dist.get_world_size, dist.get_rank, dist.is_initialized
    dist.get_world_size = lambda group=None: size if group is None else real_size(group)
    dist.get_rank = lambda group=None: rank if group is None else real_rank(group)
    dist.is_initialized = lambda: True
    try:
        yield
    finally:
        dist.get_world_size, dist.get_rank = real_size, real_rank
        dist.is_initialized = real_init


def _own_group(ranks: Sequence[int], rank: int, store: Any, name: str,
               timeout: datetime.timedelta) -> Any:
    """A gloo group of the destination's ``ranks`` (sorted; ``rank`` is this process's), met on
    ``store`` under ``name``, made as torch makes a default group (no current default group
    is involved) and registered with its rank map in the destination's numbering."""
    c10d = dist.distributed_c10d
    pg, _ = c10d._new_process_group_helper(len(ranks), list(ranks).index(rank), [],
                                           dist.Backend("gloo"), store, group_name=name,
                                           timeout=timeout, group_desc=name)
    c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg


class _Recorded:
    """What ``new_group`` gave megatron while recording (never used as a group)."""

    __slots__ = ()


@contextmanager
def _new_group_is(fn: Callable[..., Any], no_destroy: bool = False) -> Iterator[None]:
    real_new, real_destroy = dist.new_group, dist.destroy_process_group
    dist.new_group = fn  # megatron calls torch.distributed.new_group(**kwargs) (create_group)
    if no_destroy:
        dist.destroy_process_group = lambda *a, **k: None
    try:
        yield
    finally:
        dist.new_group, dist.destroy_process_group = real_new, real_destroy


def _snapshot(module: Any) -> dict[str, tuple[Any, Any]]:
    """Every global of ``module``: (object, a shallow copy of its contents for containers
    that megatron fills in place)."""
    out = {}
    for k, v in vars(module).items():
        if k.startswith("__"):
            continue
        out[k] = (v, list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict)
                  else None)
    return out


def _restore(module: Any, snap: dict[str, tuple[Any, Any]]) -> None:
    for k in [k for k in vars(module) if not k.startswith("__") and k not in snap]:
        delattr(module, k)
    for k, (v, contents) in snap.items():
        if isinstance(v, list):
            v[:] = contents
        elif isinstance(v, dict):
            v.clear()
            v.update(contents)
        setattr(module, k, v)


def record(init: dict[str, Any],
           world: Subworld | Joinworld | None = None) -> list[dict[str, Any]]:
    """The ``new_group`` calls megatron's ``initialize_model_parallel(**init)`` makes, in order
    (their keyword arguments; ranks of ``world``'s numbering when given); megatron's parallel
    state is left as it was."""
    from megatron.core import parallel_state as ps

    calls: list[dict[str, Any]] = []

    def recorder(**kwargs: Any) -> _Recorded:
        calls.append(dict(kwargs))
        return _Recorded()

    snap = _snapshot(ps)
    try:
        with _new_group_is(recorder, no_destroy=True), _world_is(world):
            # 0.19's destroy also releases NCCL EP and symmetric-memory buffers: nothing under
            # gloo, the only backend this runs on (``supported``).
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**init)
    finally:
        _restore(ps, snap)
    return calls


def resync(group: Any = None) -> None:
    """Every process of ``group`` continues torch's group numbering from the highest count any
    of them reached (after groups made ahead failed on some process)."""
    import torch

    world = dist.distributed_c10d._world
    count = torch.tensor([world.group_count], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    world.group_count = int(count.item())


class GroupsAhead:
    """The groups of one destination, recorded now and created in a background thread.

    Args:
        init: ``initialize_model_parallel``'s arguments for the destination.
        world: the destination's world inside the current one (``Subworld``: devices leave)
            or beside it (``Joinworld``: devices join); None: the same world. Its own group is
            made first, then megatron's.
    """

    def __init__(self, init: dict[str, Any], world: Subworld | Joinworld | None = None) -> None:
        self.init, self.world = dict(init), world
        self.calls = record(self.init, world)
        self.groups: list[Any] = []
        self.world_group: Any = None
        self.switch_group: Any = None  # a Joinworld's where devices leave too
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._create, name="dynatrain-groups-ahead",
                                        daemon=True)
        self._thread.start()

    def _create(self) -> None:
        try:
            world = self.world
            if world is None:
                for kw in self.calls:
                    self.groups.append(dist.new_group(**kw))
                return
            if isinstance(world, Joinworld):
                self._create_joined(world)
                return
            self.world_group = dist.new_group(ranks=list(world.ranks), timeout=world.timeout)
            for kw in self.calls:
                ranks = [world.ranks[r] for r in kw["ranks"]]
                self.groups.append(dist.new_group(**{**kw, "ranks": ranks}))
        except BaseException as err:  # noqa: BLE001 — reported by ready(); groups made at the switch
            self.error = err

    def _create_joined(self, world: Joinworld) -> None:
        """Every group on its own, members only (torch's ``new_group`` would need the
        destination's world as the default group): numbered as ``new_group`` numbers them,
        by sorted rank. Where devices leave too, the switch's world comes first, and a
        process that leaves makes only that."""
        if world.leaves:
            self.switch_group = _own_group(range(world.union), world.union_rank, world.store,
                                           f"{world.name}/switch", world.timeout)
        if world.rank is None:
            return
        self.world_group = _own_group(range(world.size), world.rank, world.store,
                                      f"{world.name}/world", world.timeout)
        for i, kw in enumerate(self.calls):
            if kw.get("backend") not in (None, "gloo"):
                raise RuntimeError(f"groups ahead: megatron's group {i} asks for backend "
                                   f"{kw['backend']!r}")
            ranks = sorted(kw["ranks"])
            if world.rank not in ranks:
                self.groups.append(dist.GroupMember.NON_GROUP_MEMBER)
                continue
            self.groups.append(_own_group(ranks, world.rank, world.store, f"{world.name}/{i}",
                                          kw.get("timeout") or world.timeout))

    def discard(self) -> None:
        """Destroy the groups made ahead (a switch that will not take them)."""
        self.ready(0)
        if self._thread.is_alive():
            return  # still being made: they go with the next ``destroy_process_group``
        reg = dist.distributed_c10d._world
        mine = [g for g in [self.switch_group, self.world_group, *self.groups]
                if isinstance(g, dist.ProcessGroup) and g in reg.pg_map]
        for pg in mine:
            dist.destroy_process_group(pg)
        self.switch_group, self.world_group, self.groups = None, None, []
        release_in_background(mine)

    def settled(self) -> bool:
        """Whether making the groups is over (all made, or failed), without waiting."""
        return not self._thread.is_alive()

    def ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the groups; whether all were created."""
        self._thread.join(timeout)
        return not self._thread.is_alive() and self.error is None

    def _kept(self) -> list[Any]:
        return [g for g in [self.switch_group, self.world_group, *self.groups]
                if isinstance(g, dist.ProcessGroup)]

    def _renumber(self) -> dict[Any, dict[int, int]]:
        """The destination's world as torch's default group, the kept groups' rank maps in
        its numbering; returns their maps before."""
        c10d = dist.distributed_c10d
        world, reg = self.world, c10d._world
        assert world is not None and world.rank is not None and self.world_group is not None
        to_new = {old: new for new, old in enumerate(world.ranks)}
        before = {}
        c10d._update_default_pg(self.world_group)
        for pg in self._kept():
            before[pg] = reg.pg_group_ranks[pg]
            reg.pg_group_ranks[pg] = {to_new[g]: r for g, r in before[pg].items()}
        return before

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Inside, the destination's world is torch's default group and megatron's groups
        made ahead are numbered in it, while the job's world and groups stay as they are (a
        build ahead of the destination runs here; a joiner has no world of its own yet);
        afterwards, all as it was."""
        c10d = dist.distributed_c10d
        reg = c10d._world
        default, groups = reg.default_pg, len(reg.pg_map)
        if isinstance(self.world, Joinworld):  # its groups are numbered in it since made
            before = {}
            self._number_joined()
        else:
            before = self._renumber()
        try:
            yield
        finally:
            c10d._update_default_pg(default)
            for pg, ranks in before.items():
                reg.pg_group_ranks[pg] = ranks
        if len(reg.pg_map) != groups:  # numbered in a world that is not the default yet
            raise RuntimeError("groups ahead: the build made process groups of its own "
                               f"({len(reg.pg_map) - groups}); it runs at the switch")

    def promote(self) -> None:
        """Make the destination's world this process's default group (a ``world`` that this
        process stays in, once ``ready`` said so on every process; devices leaving: after
        the switch's exchange, joining: before it): every other group of the old world is
        destroyed and the groups made ahead are numbered in the new world's ranks.
        ``initialize`` then hands them to megatron. Devices joining and leaving: the switch's
        world, on every process of the switch; after the exchange ``settle`` makes the
        destination's the default."""
        reg = dist.distributed_c10d._world
        if isinstance(self.world, Joinworld) and self.switch_group is not None:
            dist.distributed_c10d._update_default_pg(self.switch_group)
        elif isinstance(self.world, Joinworld):
            self._number_joined()
        else:
            self._renumber()
        kept = set(map(id, self._kept()))
        old = [pg for pg in reg.pg_map if id(pg) not in kept]
        for pg in old:
            dist.destroy_process_group(pg)  # the old world's: its default is no longer one
        pg = None  # noqa: F841 — ``old`` holds the last references, dropped in the background
        release_in_background(old)
        if isinstance(self.world, Joinworld):
            # The joiners' count of torch's groups is not the job's: later groups (named by
            # it) must be named alike everywhere.
            resync()

    def settle(self) -> None:
        """After the exchange of a switch whose devices join and leave, on a process that
        stays or joins: the destination's world becomes the default group and the switch's
        world goes (its first ranks are the destination's: no group is renumbered)."""
        assert self.switch_group is not None
        self._number_joined()
        old = [self.switch_group]  # its last reference: dropped in the background
        self.switch_group = None
        dist.destroy_process_group(old[0])
        release_in_background(old)

    def _number_joined(self) -> None:
        """The destination's world as torch's default group (its groups' rank maps are in
        its numbering since they were made)."""
        assert isinstance(self.world, Joinworld) and self.world_group is not None
        dist.distributed_c10d._update_default_pg(self.world_group)

    def initialize(self) -> int:
        """megatron's parallel state of the destination from the groups made ahead (call once
        ``ready`` said so on every process, and after ``promote`` for a world change); the
        number of groups it took.

        Raises:
            RuntimeError: megatron asked for other groups than it did when recorded.
        """
        from megatron.core import parallel_state as ps

        queue = list(zip(self.calls, self.groups))
        taken = [0]

        def hand_out(**kwargs: Any) -> Any:
            if taken[0] >= len(queue):
                raise RuntimeError("groups ahead: megatron asked for more groups than recorded")
            want, group = queue[taken[0]]
            if dict(kwargs) != want:
                raise RuntimeError(f"groups ahead: megatron's group {taken[0]} differs from the "
                                   f"recorded one ({kwargs} != {want})")
            taken[0] += 1
            return group

        with _new_group_is(hand_out):
            ps.initialize_model_parallel(**self.init)
        if taken[0] != len(queue):
            raise RuntimeError(f"groups ahead: megatron took {taken[0]} of {len(queue)} groups")
        return taken[0]
