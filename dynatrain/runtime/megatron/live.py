"""Switch a running Megatron-core job to another parallel layout between two iterations,
on the same processes or on a world that shrinks or grows.

Every process of the job owns a ``LiveSwitcher`` for its device. ``prepare(dst_spec)`` plans
the switch in a background thread while training goes on. For a same-devices switch each
process plans only its own part (``planner.slices``: its sends, receives and local copies, in
time that does not grow with the job's data-parallel size): at ``switch`` the job agrees on a
digest of what determines the plan (both specs, budget, topology, planner), then on the plan's
two global numbers (its cut unit and rounds, by all-reduces of one integer), and every process
checks its own slice (``verify`` checks a slice as one; the union of those checks is the
global verification) before anything moves. A switch to other devices plans the whole plan on
every process (spares and joiners plan it too) and agrees on the plan's digest. ``switch(job)``
then, at an iteration
boundary, checks the job's own metadata against the IR's source layout (``check_job``:
checkpoint ShardedTensors, DDP buffers, optimizer ranges, the megatron-core series; a
difference refuses the switch on every process, naming the first differing parameter), binds
the job's state as IR storage (``extract_state``: views, no copies), sets up
megatron's parallel state for the destination, builds the destination job with the caller's
``build`` (the code that built the job in the first place; it also seeds megatron's RNG streams
for the new coordinates, as at startup: megatron itself does not carry them across a TP or PP
change), and runs the plan across the processes (``executor.switch``: all or nothing), then
carries the LR scheduler, the iteration and the consumed samples over.

**Same devices** (both layouts name the same devices, in sorted order): the switch runs in the
job's own process group; no rendezvous is needed. The destination job is built before the
exchange, every process agrees that it built, and the plan runs straight into the new job's own
tensors (``bridge.bind_state``): the state is held twice during the switch (source and
destination job), not three times, and nothing is copied after the exchange. A build that fails
on any process keeps every process in the source layout.

**Another world** (devices leave or join, or ranks move to other devices). Megatron keeps its
parallel state in the default process group, so that group must hold exactly the layout's
processes; a ``Rendezvous`` (a store every process reaches, e.g. torchrun's TCPStore) lets
processes move between groups:

1. ``prepare`` announces the switch in the store (``switch/<g>``: both specs), so spare
   processes can plan it too while the job trains;
2. ``switch`` agrees on the plan in the job's group and posts ``go/<g>`` with the carried
   scheduler state, iteration and samples; every process of the union of both layouts
   (``process_devices(plan)``, rank = index there) then forms the default group of the switch,
   checks that all planned the same switch and runs it (where the destination's world was
   made ahead, ``groups_ahead``, the switch runs in it instead, and where the destination
   was built ahead with the joiners, the build's agreement already checked the plan);
3. the destination's processes form the destination's default group (rank = layout rank),
   initialize megatron's parallel state, build and install; every process of the union votes
   through the store. Committed: staying and joining processes get the new job; leaving
   processes get ``role == "left"``, no group and no parallel state, and may idle as spares
   (``join``) or exit.

Processes that join are ``LiveSwitcher(None, device, ...)`` spares that call ``join()``: spare
processes that were in the job all along, or processes started later that reach the same store
(a new rendezvous: e.g. a replacement node). ``join`` waits for an announced switch that names
the device, plans and verifies it, takes part with no source state and returns the new job;
it returns None once the job calls ``close()``.

All or nothing: when a switch fails anywhere (planning, a missing or failing process, an
aborted exchange, a failing destination build), ``switch`` raises ``SwitchFailed`` on every
process still alive, whose ``job`` is the job to train on in the source layout: the same
object when its groups survived, else (after another world's groups were formed) a job rebuilt
in re-formed source groups holding the same state bit for bit. The source state is only ever
read. A process that dies during the final vote may leave others committed (the limit of any
commit protocol); a dead source process leaves nothing to roll back to.

**Recovery** (``recover``, ``recovery.py``): when a member dies without notice, the survivors
agree through the store on who is gone (a roll call bounded by ``timeout``, cut short by the
heartbeats that ``heartbeat=`` starts; ``unresponsive()`` lets a training loop notice between
iterations), switch to a layout on the survivors (given, or the top of ``suggest``), refill
exactly the state only the dead held from the dist checkpoint of the current step (``refill``),
and train on; a refused checkpoint changes nothing.

Under torchrun: give each process a device name (``node<N>:gpu<local_rank>``), a ``Rendezvous``
on the agent's store (``TCPStore(MASTER_ADDR, MASTER_PORT, is_master=False)``) and a fresh
prefix per job; processes outside the first layout start as spares. The verifier is passed in
by the caller (``dynatrain.verify.check.check``): the runtime layer does not import it.
"""

from __future__ import annotations

import hashlib
import logging
import json
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import replace
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NoReturn

import torch
import torch.distributed as dist

from ...ir.errors import DynatrainError, LayoutError
from ...ir.layout import Layout
from ...ir.loader import spec_from_dict, spec_to_dict
from ...ir.spec import LayoutSpec
from ...ir.state import transition_views
from ...planner.cost import H100, Topology
from ...planner.gcpause import cycle_collector_paused
from ...planner.pipeline import plan_transition
from ...planner.slices import finish_slice, slice_pairs
from ...planner.suggest import suggest
from ...planner.serialize import plan_to_json
from .. import copytable
from ..executor import SwitchAborted, switch
from ..headroom import check_switch_headroom, job_cuda_device
from .bridge import bind_state, extract_state, install_step
from .check_job import check_job
from .job import (Builder, GlobalState, MegatronJob, Notice, Prepared, Refill, SwitchFailed,
                  SwitchResult, TrainState, Verifier, carried, carry_into, parallel_kwargs)
from .job import where_failed as _where
from . import build_ahead as ahead_build
from .build_ahead import Built
from .buddy import BuddyCopy
from .groups_ahead import GroupsAhead
from .groups_ahead import Joinworld, Subworld, joinworld, subworld
from .groups_ahead import resync as resync_groups, supported as groups_ahead_supported
from .recovery import Heartbeat, Liveness, Recovery
from .rendezvous import Rendezvous
from . import te_fp8
from .watchdog import Watchdog
from .world import WorldSwitch

log = logging.getLogger(__name__)

SLICE_PLANNER = "spread-1"  # in the digest: processes must run the same planner


def slice_digest(src_spec: LayoutSpec, src: Layout, dst_spec: LayoutSpec, dst: Layout,
                 budget_bytes: int, topology: Topology) -> bytes:
    """What determines a same-devices switch's slices, hashed: the processes of the job must
    agree on it before each cuts its own slice.

    Each spec is hashed with its world as the explicit device list: a process that joined
    read its spec back from the rendezvous in that form, while the others may hold the
    ``nodes``/``gpus_per_node`` form of the same layout.
    """
    doc = {"src": spec_to_dict(src_spec, src.devices), "dst": spec_to_dict(dst_spec, dst.devices),
           "budget": budget_bytes, "topology": topology.model_dump(), "planner": SLICE_PLANNER}
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=16).digest()


def _group_s(rdzv: Rendezvous) -> float:
    """The collective timeout of a default group ``rdzv`` forms."""
    return rdzv.group_timeout if rdzv.group_timeout is not None else rdzv.timeout


BUILT_POLL = 0.01  # seconds between a joiner's looks for the go once it built ahead (two
# store requests each: 200 a second per joiner, for an iteration or two)


class LiveSwitcher:
    """Plans, verifies and runs layout switches of the Megatron job on this process.

    Args:
        spec: the layout the job runs now; None for a spare process (it joins with ``join``).
        device: this process's device (its rank is ``Layout(spec).devices.index(device)``).
        build: builds a fresh job for a spec; called after megatron's parallel state for that
            spec is initialized, on every process of the layout.
        verify: checks a plan against its layouts and raises if it breaks a rule
            (``dynatrain.verify.check.check``).
        rendezvous: where processes meet to change the world; None: switches keep the devices.
        budget_bytes: staging budget per device of a switch.
        timeout: seconds any one wait for peers may take before a switch aborts.
        group: the process group of a same-devices job (None: the default group).
        init_kwargs: extra ``initialize_model_parallel`` arguments (e.g.
            ``create_gloo_process_groups``), used for every layout.
        check_transfers: compare every transfer's fingerprint at both ends before a switch
            commits (``executor.switch``).
        slices: plan a same-devices switch as this device's slice only (default); False
            plans and verifies the whole plan on every process, as switches to other devices
            and switches with ``check_transfers`` do.
        heartbeat: seconds between two beats of this process's heartbeat in the rendezvous
            (a daemon thread; None: no heartbeat). With heartbeats, ``unresponsive`` names
            processes that stopped, and ``recover`` stops waiting for them early.
        stale_after: seconds without a beat after which a device counts as dead (default:
            ten heartbeats, at least one second).
        refill: plans filling lost state from a checkpoint for ``recover`` (``job.Refill``;
            e.g. built on ``dynatrain.checkpoint.plan_load(..., only=lost)``); called with
            ``lost`` None it plans the rank's whole state (a rollback).
        collective_timeout: seconds after which a collective of the job's process groups gives
            up on a peer that died or stopped (gloo cannot abort a collective: this bound is
            what releases a survivor blocked in one). Given, megatron's groups are made with it
            (``distributed_timeout_minutes``, unless ``init_kwargs`` names one), and
            ``recover``'s roll call waits this long beyond ``timeout`` for processes whose
            heartbeat still beats (blocked, not dead: they are never declared failed). None:
            taken from ``init_kwargs["distributed_timeout_minutes"]`` where given.
        abort_after: with ``heartbeat``: once a device of the job has not beaten for this many
            seconds, a watchdog thread aborts this process's process groups (NCCL), so that a
            collective blocked on it raises at once and the loop can ``recover``
            (``watchdog.Watchdog``; gloo cannot abort: there ``collective_timeout`` releases).
            Re-armed after each recovery. None: no watchdog.
        train_state: reads the training state a checkpoint was saved with (``job.TrainState``:
            iteration, consumed samples, scheduler, as ``job.carried`` gives them). With it and
            ``refill``, ``recover`` rolls every survivor back in place to a checkpoint of an
            older step when the state of the current step is lost.
        global_state: what ``build`` changes outside the job (Megatron-LM's ``args``, its
            micro-batch calculator, RNG streams): saved before each switch and restored when
            the switch fails, so the job trains on exactly as before (``job.GlobalState``).
        groups_ahead: for a same-devices switch on gloo, ``prepare`` records the process
            groups megatron makes for the destination and creates them in a background thread
            while the job trains; the switch then takes them instead of creating them
            (``groups_ahead.GroupsAhead``). The same where the world changes: the destination's
            default group too, made inside the job's world where devices only leave (a
            notice's switch; ``groups_ahead.Subworld``), beside it where devices join (with
            the joiners, while they wait in ``join``; ``groups_ahead.Joinworld``; where
            others leave meanwhile, the switch's world too). False: create them at the
            switch.
        buddy: keep buddy copies (``buddy.BuddyCopy``): ``snapshot(job)``, called after every
            optimizer step, copies this rank's optimizer state to host memory and to its
            buddy on another node, so that ``recover`` restores the state of a step every
            survivor shares without a checkpoint when a device (or a node) dies at any moment.
            Needs the distributed optimizer, bf16/fp16 params with fp32 main params, and devices
            on two nodes or more.
        reserve_bytes: what the job needs on its device above what it holds at a boundary to
            train an iteration, kept free when ``build_ahead`` holds a destination job beside
            it (default: the CUDA allocator's peak above what is allocated at that boundary;
            unchecked on the CPU).

    Example:
        >>> sw = LiveSwitcher(spec_a, "node0:gpu3", build, check, rendezvous=rdzv)  # doctest: +SKIP
        >>> sw.prepare(spec_b)                      # plans in the background
        >>> result = sw.switch(job)                 # at an iteration boundary
        >>> job = result.job                        # None if this device left
    """

    def __init__(self, spec: LayoutSpec | None, device: str, build: Builder, verify: Verifier,
                 *, rendezvous: Rendezvous | None = None, budget_bytes: int = 2 << 30,
                 timeout: float = 60.0, group: dist.ProcessGroup | None = None,
                 topology: Topology = H100, init_kwargs: dict | None = None,
                 check_transfers: bool = False, heartbeat: float | None = None,
                 stale_after: float | None = None, refill: Refill | None = None,
                 slices: bool = True, global_state: GlobalState | None = None,
                 train_state: TrainState | None = None,
                 collective_timeout: float | None = None,
                 abort_after: float | None = None, groups_ahead: bool = True,
                 reserve_bytes: int | None = None, buddy: bool = False) -> None:
        self.spec, self.layout = spec, (Layout(spec) if spec is not None else None)
        if self.layout is not None and device not in self.layout.devices:
            raise LayoutError(f"device {device} is not in the layout ({self.layout.devices[0]},"
                              " ...)")
        if spec is None and rendezvous is None:
            raise LayoutError("a spare process (spec None) needs a rendezvous to join through")
        self.device, self.build, self.verify = device, build, verify
        self.rendezvous = rendezvous
        self.budget_bytes, self.timeout, self.group = budget_bytes, timeout, group
        self.topology, self.init_kwargs = topology, dict(init_kwargs or {})
        if collective_timeout is not None:
            if not collective_timeout > 0:
                raise LayoutError(f"collective_timeout: seconds > 0 (got {collective_timeout!r})")
            self.init_kwargs.setdefault("distributed_timeout_minutes", collective_timeout / 60)
        minutes = self.init_kwargs.get("distributed_timeout_minutes")
        self.collective_timeout = None if minutes is None else 60.0 * float(minutes)
        self.check_transfers = check_transfers
        self.slices, self.global_state = slices, global_state
        self.groups_ahead = groups_ahead
        self._ahead: GroupsAhead | None = None  # the prepared switch's groups, being created
        self._built: Built | None = None  # the prepared switch's destination job, built ahead
        self._arrived = 0.0  # wall clock when this process entered the last switch
        self.reserve_bytes = reserve_bytes
        self.ahead_why: str | None = None  # why the last build ahead did not happen
        self._cuda_device = job_cuda_device()  # here: the planning thread has its own device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynatrain-plan")
        self._pending: Future[Prepared] | None = None
        self._generation = 0  # the last switch announced in the rendezvous that this job saw
        self._open: int | None = None  # announced, neither gone nor cancelled yet
        self._watch: int | None = None  # a spare's next announcement to look at
        self.refill, self.train_state = refill, train_state
        self.check_seconds: float | None = None  # the last switch's check_job, for reports
        # The job the last switch checked (``check_job``), while it lives: a recovery after
        # that switch failed need not check it again.
        self.checked: weakref.ref | None = None
        self.groups_taken = 0  # megatron groups the last in-place switch took ready-made
        self._heartbeat = self.liveness = None
        if heartbeat is not None:
            if rendezvous is None or not heartbeat > 0:
                raise LayoutError(f"heartbeat: needs a rendezvous and seconds > 0 (got "
                                  f"{heartbeat!r})")
            self._heartbeat = Heartbeat(rendezvous, device, float(heartbeat))
            self.liveness = Liveness(rendezvous, stale_after if stale_after is not None
                                     else max(10 * float(heartbeat), 1.0))
        self.buddy = buddy
        self._buddy: BuddyCopy | None = None  # the copies of the current layout
        self.buddy_why: str | None = None  # why the current layout keeps no copies
        if buddy and self.layout is not None:
            self._buddy = self._new_copies()
        self.abort_after, self.watchdog = abort_after, None
        if abort_after is not None:
            if self._heartbeat is None or not abort_after > 0:
                raise LayoutError(f"abort_after: needs a heartbeat and seconds > 0 (got "
                                  f"{abort_after!r})")
            self._arm_watchdog()

    @property
    def active(self) -> bool:
        """True while this process runs a rank of the job's layout."""
        return self.layout is not None

    @property
    def rank(self) -> int | None:
        return self.layout.devices.index(self.device) if self.layout is not None else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ---- prepare -----------------------------------------------------------------------------

    def prepare(self, dst_spec: LayoutSpec) -> Future[Prepared]:
        """Plan and verify the switch to ``dst_spec`` in the background (and announce it to
        spares); errors surface in ``switch`` (or from the returned future)."""
        if self.spec is None or self.layout is None:
            raise DynatrainError(f"{self.device} runs no rank: a spare joins with join()")
        if self._pending is not None and not self._pending.done():
            raise DynatrainError("a switch is already being prepared")
        generation = None
        if self.rendezvous is not None:
            self._cancel_open()
            generation = self._generation = self._generation + 1
            if self.leader:
                self.rendezvous.post(f"switch/{generation}", {
                    "src": spec_to_dict(self.spec, self.layout.devices),
                    "dst": spec_to_dict(dst_spec, Layout(dst_spec).devices)})
                if self.rendezvous.count("latest", 1) != generation:
                    raise DynatrainError("another job uses this rendezvous prefix")
            self._open = generation
        self._drop_built()  # a superseded switch's destination
        self._pending = self._pool.submit(self._prepare, self.spec, self.layout, dst_spec,
                                          generation)
        self._start_groups_ahead(dst_spec)
        return self._pending

    def _drop_built(self) -> None:
        """Forget the destination built ahead for a switch that will not run; the groups it
        was built in are destroyed."""
        built, self._built = self._built, None
        if built is not None and built.ahead is not None:
            built.ahead.discard()

    def _start_groups_ahead(self, dst_spec: LayoutSpec) -> None:
        """Start creating the destination's megatron groups (same devices, gloo)."""
        if self._ahead is not None:  # a superseded switch's: it must be done first (its
            ok = self._ahead.ready(self.timeout)  # thread creates groups too)
            self._ahead = None
            if not self._all_built(ok):
                resync_groups(self.group)
        dst_devices = Layout(dst_spec).devices
        if not (self.groups_ahead and groups_ahead_supported(self.init_kwargs)):
            return
        world: Subworld | Joinworld | None = None
        if dst_devices != self.layout.devices:  # the world changes: made ahead, if it can be
            rdzv = self.rendezvous
            if rdzv is None or self.group is not None:
                return
            world = (subworld(self.layout.devices, dst_devices, self.device, _group_s(rdzv))
                     or joinworld(self.layout.devices, dst_devices, self.device,
                                  f"ahead/g{self._generation}", rdzv.store, _group_s(rdzv)))
            if world is None:
                return
        elif dst_devices != tuple(sorted(dst_devices)):
            return
        try:
            self._ahead = GroupsAhead({**parallel_kwargs(dst_spec), **self.init_kwargs}, world)
        except Exception:  # noqa: BLE001 — megatron refuses the layout: the switch says so
            self._ahead = None

    def notice(self, leaving: Iterable[str], deadline_s: float,
               dst_spec: LayoutSpec | None = None) -> Notice:
        """A preemption notice: the ``leaving`` devices go away within ``deadline_s`` seconds.

        Every process of the job calls it with the same arguments (``LiveControl`` does so for
        a notice posted to the store: its rank 0 checks it and picks the layout, every process
        prepares that one). Takes ``dst_spec``, or the top ``suggest`` layout on the devices
        that stay, and prepares the switch in the background; the training loop's next
        ``switch`` runs it (the leaving processes come out with role "left").
        ``Notice.fits()`` then says whether it was done in time; a switch that did not fit
        still runs, and a device that is gone before it does is a failure for ``recover``.

        Raises:
            DynatrainError (exit status 2), before anything is prepared: see ``check_notice``.
        """
        met = self.check_notice(leaving, deadline_s, dst_spec)
        self.prepare(met.dst_spec)
        return met

    def check_notice(self, leaving: Iterable[str], deadline_s: float,
                     dst_spec: LayoutSpec | None = None) -> Notice:
        """What ``notice`` would prepare, prepared nowhere: the devices that leave, the layout
        (``dst_spec`` or the top of ``suggest`` on the rest) and the deadline.

        Raises:
            DynatrainError (exit status 2): a deadline already passed (not above 0), a device
                that is not in the job, no device named, no device staying, a switch already
                being prepared, a ``dst_spec`` on a leaving device, or no layout of the model
                on the rest.
        """
        if self.spec is None or self.layout is None:
            raise DynatrainError(f"{self.device} runs no rank: a notice goes to the job's "
                                 "processes")
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)):
            raise DynatrainError(f"notice: deadline_s: expected the seconds left, a number "
                                 f"(got {type(deadline_s).__name__})")
        if not deadline_s > 0:  # NaN too
            raise DynatrainError(f"notice: deadline_s: the deadline has already passed "
                                 f"(got {deadline_s!r} s; give the seconds left, > 0)")
        if isinstance(leaving, (str, bytes)):  # not its characters
            raise DynatrainError(f"notice: leaving: expected device names, a list (got the "
                                 f"string {leaving!r})")
        deadline = time.monotonic() + float(deadline_s)
        names = list(leaving)
        odd = next((d for d in names if not isinstance(d, str)), None)
        if odd is not None:
            raise DynatrainError(f"notice: leaving: device names are strings like "
                                 f"'node3:gpu5' (got {odd!r})")
        gone = tuple(dict.fromkeys(names))
        here = set(self.layout.devices)  # sets: a notice may name thousands of a job's devices
        unknown = [d for d in gone if d not in here]
        if unknown:
            raise DynatrainError(f"notice: leaving: {unknown[0]} is not a device of the job "
                                 f"({len(self.layout.devices)} devices: "
                                 f"{self.layout.devices[0]} ...)")
        if not gone:
            raise DynatrainError("notice: leaving: no device named")
        leave = set(gone)
        stay = [d for d in self.layout.devices if d not in leave]
        if not stay:
            raise DynatrainError("notice: leaving: every device of the job leaves; nothing "
                                 "can train on (checkpoint before the deadline instead)")
        if self._pending is not None and not self._pending.done():
            raise DynatrainError("notice: a switch is already being prepared; notice again "
                                 "once it ran")
        predicted = None
        if dst_spec is None:
            found = suggest(self.layout, stay, topology=self.topology,
                            budget_bytes=self.budget_bytes)
            if not found.ranked:
                raise DynatrainError(f"notice: no layout of the model fits the {len(stay)} "
                                     f"devices that stay: {found.why_empty()}")
            dst_spec, predicted = found.ranked[0].spec, found.ranked[0].predicted_seconds
        elif set(Layout(dst_spec).devices) & set(gone):
            raise DynatrainError("notice: dst_spec uses a leaving device")
        return Notice(gone, dst_spec, deadline, predicted)

    def ready(self) -> bool:
        """True once ``prepare``'s plan is done (or failed)."""
        return self._pending is not None and self._pending.done()

    # ---- the destination built ahead (build_ahead.py) ------------------------------------------

    def ahead_settled(self) -> bool:
        """Whether the destination's world and groups made ahead, if any, are made (or
        failed) now, without waiting: where devices join they need the joiners, and a
        training loop may train on until they are (``LiveControl`` does)."""
        return self._ahead is None or self._ahead.settled()

    def build_ahead(self, job: MegatronJob | None = None) -> str | None:
        """Build the prepared switch's destination job now, so that ``switch`` runs only the
        job check, the exchange and the commit vote (``build_ahead.py``): a same-devices
        switch's, or, where the world changes, in the destination's world made ahead
        (``groups_ahead``; a leaving process builds nothing; joiners waiting in ``join`` are
        told through the store and build with the job's processes).

        Every process of the job calls it at the same iteration boundary, after ``prepare``
        and once ``ready()`` on every process; the job then trains on in its own layout,
        exactly as before (megatron's parallel state, ``global_state`` and RNG streams are put
        back), until ``switch``. The destination's groups are those made ahead, or are made
        now; where devices join, this waits for the joiners to have made them (at most
        ``timeout``). Returns None when built, else why not (the switch then builds at its
        own time): the world changes and its world was not made ahead, the planning failed,
        no room beside the job, or a build that failed on some process (a joiner's too);
        every process returns None or every process a reason. The build's
        time is ``seconds["build_ahead"]`` of the switch's result (not downtime: the job
        trains between it and the switch).

        Given ``job`` (the job training now), it also makes this process's part of the
        exchange into the destination (``runtime.prepared``), so that the switch skips
        preparing its rounds; without it, or where the job's state has moved by the switch,
        the switch prepares them itself (its report: ``prepared_ahead``, ``prepared_why``).
        """
        return ahead_build.build_ahead(self, job)

    def _prepare(self, src_spec: LayoutSpec, src: Layout, dst_spec: LayoutSpec,
                 generation: int | None) -> Prepared:
        if self._cuda_device is not None:  # Triton's compile off the switch's critical path
            copytable.warm_up(torch.device("cuda", self._cuda_device))
        dst = Layout(dst_spec)
        in_place = src.devices == dst.devices and tuple(sorted(src.devices)) == src.devices
        if not in_place and self.rendezvous is None:
            raise LayoutError("a switch between different devices (or device orders) needs a "
                              f"rendezvous: {len(src.devices)} devices ({src.devices[0]}, ...) "
                              f"-> {len(dst.devices)} ({dst.devices[0]}, ...)")
        t0 = time.perf_counter()
        # check_transfers compares fingerprints in one table of the whole plan's transfers
        # (``fingerprint.compare_transfers``): with it, every process plans the whole plan.
        if in_place and self.slices and not self.check_transfers:
            # Only this device's part; its rounds are cut at switch time, once the job has
            # agreed on their number. The digest covers what determines the plan.
            pairs = slice_pairs(src, dst, self.device)
            return Prepared(src_spec, src, dst_spec, dst, None,
                            slice_digest(src_spec, src, dst_spec, dst, self.budget_bytes,
                                         self.topology),
                            time.perf_counter() - t0, 0.0, generation, in_place, pairs)
        plan = plan_transition(src, dst, self.budget_bytes, self.topology)
        t1 = time.perf_counter()
        self.verify(plan, src, dst)
        # Against what is free on the device now, not a topology figure (None: CPU, unchecked).
        check_switch_headroom(plan, transition_views(src, dst)[1], self.device, self._cuda_device)
        t2 = time.perf_counter()
        doc = plan_to_json(plan)
        del doc["summary"]  # timings: the only part that differs between processes
        text = json.dumps(doc, sort_keys=True).encode()
        return Prepared(src_spec, src, dst_spec, dst, plan,
                        hashlib.blake2b(text, digest_size=16).digest(), t1 - t0, t2 - t1,
                        generation, in_place)

    def _cut_slice(self, prep: Prepared, job: MegatronJob | None) -> Prepared:
        """This device's slice cut into the plan's rounds, verified: the job agrees on the
        unit and the number of rounds (all-reduces of one integer), then on every process
        having a slice that passes its checks (an all-reduce MIN); else nothing moved."""
        assert self.layout is not None
        t0 = time.perf_counter()
        plan = failure = None
        try:
            plan = finish_slice(self.layout, prep.dst, self.budget_bytes, prep.pairs,
                                agree=self._max)
        except DynatrainError as err:  # the same on every process: all saw the same numbers
            raise SwitchFailed(f"{self.device}: the switch did not start ({err}); the job is "
                               "untouched", job) from err
        t1 = time.perf_counter()
        try:
            self.verify(plan, self.layout, prep.dst)  # verify.check checks a slice as one
            check_switch_headroom(plan, transition_views(self.layout, prep.dst)[1],
                                  self.device, self._cuda_device)
        except Exception as err:  # noqa: BLE001 — agreed below, then raised everywhere
            failure = err
        if not self._all_built(failure is None):
            where = _where(failure)
            raise SwitchFailed(f"{self.device}: a plan slice failed its checks on {where};"
                               " the job is untouched", job) from failure
        return replace(prep, plan=plan, plan_seconds=prep.plan_seconds + t1 - t0,
                       verify_seconds=time.perf_counter() - t1)

    def _max(self, value: int) -> int:
        """``value``'s maximum over the job's processes (an all-reduce MAX)."""
        x = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":  # NCCL moves device memory only
            x = x.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return int(x.item())

    def _cancel_open(self) -> None:
        if self._open is not None and self.leader and self.rendezvous is not None:
            self.rendezvous.post(f"go/{self._open}", {"go": False})
        self._open = None

    # ---- switch ------------------------------------------------------------------------------

    def _agree(self, digest: bytes) -> None:
        """Every process of the job must have planned the very same switch (failed: zeros)."""
        mine = torch.frombuffer(bytearray(digest), dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":  # NCCL moves device memory only
            mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
        world = dist.get_world_size(self.group)
        got = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(got, mine, group=self.group)
        if any(not torch.equal(g, mine) for g in got):
            raise DynatrainError(f"{self.device}: the processes planned different switches")

    def switch(self, job: MegatronJob) -> SwitchResult:
        """Run the prepared switch on ``job`` (every process of the job, at an iteration
        boundary; processes that join call ``join``).

        Returns the destination job (fresh model chunks and optimizer holding the switched
        state, the scheduler state, iteration and consumed samples carried over), or, on a
        process whose device left, a result with ``job`` None. This switcher then runs the
        destination layout (or is a spare).

        Raises:
            SwitchFailed: on every process; ``.job`` is the job to keep training in the source
                layout (see the module docstring); its cause is the first error.
        """
        if self.spec is None or self.layout is None:
            raise DynatrainError(f"{self.device} runs no rank: a spare joins with join()")
        if self._pending is None:
            raise DynatrainError("switch() needs a prepare(dst_spec) first")
        with cycle_collector_paused(promote_after=False):  # a full collection: after it
            return self._switch_now(job)

    def _switch_now(self, job: MegatronJob) -> SwitchResult:
        t = [time.perf_counter()]
        # Wall clock, comparable between the processes of one machine: the job's downtime is
        # from the last process's arrival to the last one's departure (report["arrived_at"],
        # report["left_at"]); a process's own ``downtime`` also holds its wait for the others.
        self._arrived = time.time()
        try:
            prep, failure = self._pending.result(), None
            if dist.get_world_size(self.group) != self.layout.world or \
                    dist.get_rank(self.group) != self.rank:
                raise LayoutError(f"{self.device} is rank {dist.get_rank(self.group)} of "
                                  f"{dist.get_world_size(self.group)} processes; the layout "
                                  f"wants rank {self.rank} of {self.layout.world}")
            # The job's own metadata against the IR's source layout: a job the spec does not
            # describe is refused here, on every process (agreed below), before bytes move.
            t0 = time.perf_counter()
            check_job(self.layout, self.rank, job.model_chunks, job.optimizer)
            self.checked = weakref.ref(job)
            self.check_seconds = time.perf_counter() - t0
            src_view, _ = transition_views(self.layout, prep.dst)
            src = extract_state(src_view, self.rank, job.model_chunks, job.optimizer)
        except Exception as err:  # noqa: BLE001 — raised below, once every process knows
            prep, failure = None, err
        try:
            self._agree(bytes(16) if prep is None else prep.digest)
        except Exception as err:  # noqa: BLE001
            failure = failure or err
        if failure is not None:
            self._cancel_open()
            if prep is None or not prep.in_place:
                self._pending = None
            raise SwitchFailed(f"{self.device}: the switch did not start ({type(failure).__name__}:"
                               f" {failure}); the job is untouched", job) from failure
        assert prep is not None
        t.append(time.perf_counter())
        if not prep.in_place:
            assert self.rendezvous is not None and prep.generation is not None
            carry = carried(job)
            if self.leader:  # joiners follow the job on whether the destination was built
                self.rendezvous.post(f"go/{prep.generation}", {
                    "go": True, "carry": carry, "built": self._built_for(prep) is not None})
            self._open = None
            world = WorldSwitch(self, prep, self.device, self.rendezvous)
            try:
                result = world.run(job, src, carry, t)
            except SwitchFailed:
                self._pending = None  # its generation is spent: prepare again to retry
                raise
            self._after(prep, result.role)
            return result
        self._open = None
        if prep.plan is None:  # cut at the boundary where the destination was built, or now
            built = self._built_for(prep)
            prep = built.prep if built is not None else self._cut_slice(prep, job)
        t.append(time.perf_counter())
        return self._switch_in_place(job, prep, src, t)

    def _built_for(self, prep: Prepared) -> Built | None:
        """The destination built ahead for ``prep``'s switch, if any."""
        built = self._built
        return built if built is not None and built.prep.digest == prep.digest else None

    def _switch_in_place(self, job: MegatronJob, prep: Prepared, src: dict,
                         t: list[float]) -> SwitchResult:
        """Build the destination job first, then switch straight into its tensors.

        The state is never held three times (source job, a separate destination storage, the
        new job) and nothing is copied after the exchange. Every process must have built its
        destination before anything moves: a build that fails on any process keeps every
        process in the source layout (agreed by an all-reduce), so no process commits alone.
        """
        from megatron.core import parallel_state as ps

        src_view, dst_view = transition_views(self.layout, prep.dst)
        scheduler = carried(job)
        saved = self._save_global()
        t.append(time.perf_counter())
        new = dst = failure = None
        built, self._built = self._built_for(prep), None
        if built is not None:
            return ahead_build.switch_built(self, job, prep, src, t, built, saved, scheduler)
        ahead, self._ahead = self._ahead, None
        waited = time.perf_counter()
        if self.groups_ahead and groups_ahead_supported(self.init_kwargs):
            # Groups made ahead only if every process has all of its own (one all-reduce).
            if not self._all_built(ahead is not None and ahead.ready(self.timeout)):
                ahead = None
                resync_groups(self.group)
        else:
            ahead = None
        waited = time.perf_counter() - waited
        try:
            ps.destroy_model_parallel()
            if ahead is not None:
                self.groups_taken = ahead.initialize()
            else:
                self.groups_taken = 0
                ps.initialize_model_parallel(**parallel_kwargs(prep.dst_spec), **self.init_kwargs)
            t.append(time.perf_counter())
            new = self.build(prep.dst_spec)
            dst = bind_state(dst_view, self.rank, new.model_chunks, new.optimizer)
        except Exception as err:  # noqa: BLE001 — agreed below, then raised everywhere
            failure = err
        t.append(time.perf_counter())
        if not self._all_built(failure is None):
            new = dst = None
            self._back_to_source(saved, job)
            where = _where(failure)
            raise SwitchFailed(f"{self.device}: building the destination failed on {where}"
                               "; back in the source layout, nothing moved",
                               job) from failure
        try:
            dst, report = switch(prep.plan, src_view, dst_view, self.device, src, self.group,
                                 timeout=self.timeout, check_transfers=self.check_transfers,
                                 dst_store=dst)
        except SwitchAborted as err:
            new = dst = None  # free the destination job before going back
            self._aborted(err, prep, job, scheduler, saved, back_to_source=True)
        del src
        t.append(time.perf_counter())
        # Everything that can still fail happens before the commit vote: the source job was
        # only read, so a failure on any process leaves every process in the source layout.
        failure = None
        try:
            install_step(new.optimizer, dst)
            carry_into(new, scheduler)
        except Exception as err:  # noqa: BLE001 — voted below, then raised everywhere
            failure = err
        if not self._all_built(failure is None):
            new = dst = None
            self._back_to_source(saved, job)
            where = _where(failure)
            raise SwitchFailed(f"{self.device}: installing the switched state failed on {where}"
                               "; back in the source layout, the job trains on",
                               job) from failure
        t.append(time.perf_counter())
        te_fp8.forget_groups()  # the source job's TE fp8 registrations name its old groups
        self._after(prep, "stayed")
        names = ("check_agree", "cut_slice", "save_state", "parallel_state", "build", "exchange",
                 "install")
        seconds = {n: b - a for n, a, b in zip(names, t, t[1:])}
        seconds.update(plan=prep.plan_seconds, verify=prep.verify_seconds,
                       check=self.check_seconds or 0.0, downtime=t[-1] - t[0],
                       groups_wait=waited)
        report["groups_ahead"] = self.groups_taken
        report["arrived_at"], report["left_at"] = self._arrived, time.time()
        return SwitchResult(new, report, seconds, "stayed", prep.generation)

    def _all_built(self, ok: bool) -> bool:
        """Whether every process of the job built its destination (an all-reduce MIN)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        if dist.get_backend(self.group) == "nccl":  # NCCL moves device memory only
            flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(flag.item()))

    def _aborted(self, err: SwitchAborted, prep: Prepared, job: MegatronJob, scheduler: dict,
                 saved: object, back_to_source: bool) -> NoReturn:
        """An in-place switch's exchange aborted: raise ``SwitchFailed`` with the job to train
        on. Its group intact, the source job as it is (``back_to_source``: megatron's parallel
        state of the source first); its group destroyed, the job rebuilt in new groups
        (``WorldSwitch.roll_back``), or, without a rendezvous to form them, none."""
        if not err.group_destroyed:
            if back_to_source:
                self._back_to_source(saved, job)
            raise SwitchFailed(f"{err}; the job trains on", job) from err
        if self.rendezvous is None or prep.generation is None:
            raise SwitchFailed(f"{err}; without a rendezvous the job's groups cannot be "
                               "formed again: restart from a checkpoint", None) from err
        world = WorldSwitch(self, prep, self.device, self.rendezvous)
        world.roll_back(job, scheduler, err, saved)  # raises SwitchFailed, rebuilt job

    def _back_to_source(self, saved: object = None, job: MegatronJob | None = None) -> None:
        """Megatron's parallel state of the source layout again (every process together), and
        what ``global_state`` saved before the switch; ``job``'s TE fp8 modules register again
        with the new groups."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**parallel_kwargs(self.spec), **self.init_kwargs)
        te_fp8.forget_groups(job.model_chunks if job is not None else ())
        if self.global_state is not None:
            self.global_state.restore(saved)

    def _save_global(self) -> object:
        return self.global_state.save() if self.global_state is not None else None

    def _after(self, prep: Prepared, role: str) -> None:
        self._pending = self._built = None
        if role == "left":
            self.spec = self.layout = None
            self._watch = (prep.generation or 0) + 1
        else:
            self.spec, self.layout = prep.dst_spec, prep.dst
        if prep.generation is not None:
            self._generation = prep.generation

    # ---- buddy copies ------------------------------------------------------------------------

    def _new_copies(self) -> BuddyCopy:
        assert self.layout is not None
        return BuddyCopy(self.layout, self.device, self.collective_timeout or self.timeout)

    def snapshot(self, job: MegatronJob) -> dict[str, float]:
        """Take this step's buddy copy (``buddy=True``): every process of the job calls it at
        the same boundary, after the optimizer step. The first call after a switch or a
        recovery pairs the devices of the new layout. The exchange with the buddy runs in the
        background; the job's next optimizer step waits for it before it begins. Returns the
        seconds of the copy to host and of posting the exchange (``buddy.BuddyCopy.seconds``
        gets what the next step waited once it finished); ``{}`` when the layout allows no
        copies (its devices on one node: ``buddy_why`` says why, a warning is logged once, and
        a failure falls back to a checkpoint until a layout allows them again).

        Raises:
            DynatrainError: the switcher keeps no copies, or runs no rank.
            RuntimeError: the last exchange failed: the buddy or the ward died or hangs (after
                ``collective_timeout``): ``recover``.
        """
        if not self.buddy or self.layout is None:
            raise DynatrainError(f"{self.device}: snapshot() needs LiveSwitcher(buddy=True) "
                                 "and a running rank")
        if self._buddy is None or self._buddy.layout is not self.layout:
            self._buddy = None
            try:
                self._buddy = self._new_copies()
            except DynatrainError as err:  # e.g. the survivors of a recovery on one node
                if self.buddy_why is None:
                    log.warning("%s: no buddy copies in layout %s: %s", self.device,
                                self.layout.spec.name, err)
                self.buddy_why = str(err)
                return {}
        self.buddy_why = None
        if self._ahead is not None and not self._buddy.has_group:
            # The first copy makes a group: not while groups are made ahead, or torch would
            # number them in another order on some processes.
            self._ahead.ready(self.timeout)
        self._buddy.take(job)
        return dict(self._buddy.seconds)

    # ---- recovery ----------------------------------------------------------------------------

    def unresponsive(self) -> tuple[str, ...]:
        """Devices of the job whose heartbeat stopped for ``stale_after`` seconds, in rank
        order (a training loop polls it between iterations; the first calls only start the
        clock). Needs ``heartbeat``."""
        if self.liveness is None or self.layout is None:
            raise DynatrainError("unresponsive() needs a heartbeat and a running rank")
        gone = self.liveness.stale(self.layout.devices)
        return tuple(d for d in self.layout.devices if d in gone)

    def _arm_watchdog(self) -> None:
        """A fresh watchdog on this process's groups (the last one fired, or none yet)."""
        assert self.rendezvous is not None and self.abort_after is not None
        if self.watchdog is not None:
            self.watchdog.stop()
        # A peer that has not beaten since this watchdog started gets the group timeout (or
        # ten times abort_after) before it counts as stopped: it may still be starting.
        grace = max(self.collective_timeout or 0.0, 10.0 * self.abort_after)
        look = Liveness(self.rendezvous, self.abort_after, grace=grace)

        def peers() -> tuple[str, ...]:
            # Never this process's own device: it runs, whatever its heartbeat thread did.
            return tuple(d for d in (self.layout.devices if self.layout else ())
                         if d != self.device)

        self.watchdog = Watchdog(peers, look.stale)

    def recover(self, job: MegatronJob, failed: Iterable[str] | None = None,
                dst_spec: LayoutSpec | None = None,
                checkpoint: str | os.PathLike[str] | None = None,
                rollback: bool | None = None) -> SwitchResult:
        """Go on without the processes that stopped answering (every surviving process of the
        job calls it; see ``recovery.py``).

        Args:
            job: this process's job; its process groups may be broken (a member died).
            failed: devices known dead; others that do not answer within ``timeout`` (or
                whose heartbeat stopped) are added. None: detect them all.
            dst_spec: the layout to go on in, on surviving devices only; None: the top
                ``suggest`` result for the surviving devices.
            checkpoint: a dist checkpoint of the job. Of the survivors' current step: read
                (through ``refill``) for exactly the state only the dead held. Of an older
                step: every survivor reloads all of it and the job goes on from that step
                (a rollback in place; needs ``train_state``).
            rollback: None: roll back only when the current step cannot be restored (state
                lost and no checkpoint of this step, or survivors at different steps); True:
                always roll back to ``checkpoint``; False: never (refuse instead).

        Returns:
            The destination job (``role`` "stayed", or "left" with ``job`` None on a survivor
            the destination does not use); ``recovery`` says what failed, was lost and refilled.

        Raises:
            RecoveryFailed: on every survivor, with one line; ``.job`` is ``job``, its state
                untouched (exit status 2: a refused checkpoint or destination, nothing torn
                down; 3: state lost that nothing given restores; 4: a process died or voted no
                while recovering). Retry with ``recover``.
        """
        if self.spec is None or self.layout is None or self.rendezvous is None:
            raise DynatrainError(f"{self.device}: recover() needs a running rank and a "
                                 "rendezvous")
        if self._open is not None:  # a prepared world switch cannot run any more
            self.rendezvous.post(f"go/{self._open}", {"go": False})
            self._open = None
        # A destination built ahead, and a world made ahead, name dead peers.
        self._pending = self._built = self._ahead = None
        self._generation += 1  # spent even when the recovery fails, on every survivor alike
        rec = Recovery(self, job, self._generation)
        given = frozenset(failed) if failed is not None else frozenset()
        with cycle_collector_paused(promote_after=False):  # a full collection: after it
            result, dst_spec = rec.run(given, dst_spec,
                                       None if checkpoint is None else os.fspath(checkpoint),
                                       rollback)
        if result.role == "left":
            self.spec = self.layout = None
            self._watch = self._generation + 1
        else:
            self.spec, self.layout = dst_spec, Layout(dst_spec)
        if self.watchdog is not None and self.watchdog.fired is not None:
            self._arm_watchdog()
        return result

    # ---- spares ------------------------------------------------------------------------------

    def join(self, timeout: float | None = None) -> SwitchResult | None:
        """Wait (a spare process) for a switch that takes this device in, and take part.

        Returns the destination job (``role == "joined"``), or None once the job ``close``d.
        Announced switches that do not name this device, or are cancelled, are skipped. With
        ``buddy``, the new layout's first copy is taken before it returns, at the boundary
        where the job's processes take theirs (``LiveControl`` and the Megatron-LM driver do,
        right after the switch).

        Raises:
            SwitchFailed: the switch this process took part in failed (``job`` None); call
                ``join`` again to wait for the next one.
            RendezvousTimeout: nothing came within ``timeout`` seconds.
        """
        rdzv = self.rendezvous
        if self.active or rdzv is None:
            raise DynatrainError(f"{self.device} runs a rank: only spares join")
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        g = self._watch if self._watch is not None else self._first_watch(rdzv)
        rdzv.post(f"spare/{self.device}", {})  # a switch asked for from outside may take it
        while True:
            doc = rdzv.wait(f"switch/{g}", left(), unless="closed")
            if doc is None:
                return None
            src_spec, dst_spec = spec_from_dict(doc["src"]), spec_from_dict(doc["dst"])
            src, dst = Layout(src_spec), Layout(dst_spec)
            if self.device not in dst.devices or self.device in src.devices:
                g += 1
                continue
            try:
                prep, failure = self._prepare(src_spec, src, dst_spec, g), None
            except Exception as err:  # noqa: BLE001 — the switch still needs this process
                prep, failure = None, err
            if prep is not None:  # the destination's world, with the job's processes
                self._join_ahead(src, dst, dst_spec, g)
            # The source's leader (its first device) posts the go once its job agreed; before
            # that, it may post that the job builds the destination ahead, with the joiners.
            build = f"build/{g}"
            go = rdzv.wait(f"go/{g}", left(), unless=("closed", build), who=src.devices[:1])
            if go is None and not rdzv.has("closed"):  # the job builds ahead: so does this one
                if prep is not None:
                    ahead_build.build_joined(self, prep)
                # Built: the switch comes at the job's next boundary or so; polled more often
                # than a spare's idle wait, as the job waits for the joiners from its go.
                poll = BUILT_POLL if self._built is not None else 0.05
                go = rdzv.wait(f"go/{g}", left(), unless="closed", who=src.devices[:1],
                               poll=poll)
            if go is None:
                self._drop_built()
                return None
            self._watch = g + 1
            if not go["go"]:
                self._drop_built()
                if self._ahead is not None:
                    self._ahead.discard()
                    self._ahead = None
                g += 1
                continue
            if self._built is not None and not go.get("built"):
                # The job's build ahead failed (whatever befell this process's agreement): its
                # processes dropped the world made ahead, so does this one; the switch forms
                # its groups and builds.
                self._drop_built()
            world = WorldSwitch(self, prep, self.device, rdzv, src=src, generation=g)
            with cycle_collector_paused(promote_after=False):
                result = world.run(None, None, go["carry"], [time.perf_counter()], failure)
            assert prep is not None
            self._after(prep, result.role)
            if result.role == "joined":
                rdzv.store.delete_key(f"spare/{self.device}")
                if self.buddy:  # the job's processes take the new layout's first copy right
                    self.snapshot(result.job)  # after the switch (a collective): so must this
            return result

    def _join_ahead(self, src: Layout, dst: Layout, dst_spec: LayoutSpec, g: int) -> None:
        """A joiner makes the destination's world and megatron's groups with the job's
        processes, which make them while they train (``_start_groups_ahead``)."""
        rdzv = self.rendezvous
        assert rdzv is not None
        self._drop_built()  # an earlier try's (its join timed out)
        if self._ahead is not None:
            self._ahead.discard()
            self._ahead = None
        if not (self.groups_ahead and not dist.is_initialized()
                and groups_ahead_supported(self.init_kwargs, rdzv.backend)):
            return
        world = joinworld(src.devices, dst.devices, self.device, f"ahead/g{g}", rdzv.store,
                          _group_s(rdzv))
        if world is None:
            return
        try:
            self._ahead = GroupsAhead({**parallel_kwargs(dst_spec), **self.init_kwargs}, world)
        except Exception:  # noqa: BLE001 — megatron refuses the layout: the switch says so
            self._ahead = None

    def _first_watch(self, rdzv: Rendezvous) -> int:
        """A process new to the job looks at the latest announcement unless it is over."""
        g = rdzv.count("latest")
        if g == 0:
            return 1
        go = rdzv.read(f"go/{g}")
        over = rdzv.has(f"done/{g}") or (go is not None and not go["go"])
        return g + 1 if over else g

    def close(self) -> None:
        """End the job for its spares: their ``join`` returns None (call on every process)."""
        if self.leader and self.rendezvous is not None:
            self._cancel_open()
            self.rendezvous.post("closed", {})
        self._built = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        self._pool.shutdown(wait=False)
