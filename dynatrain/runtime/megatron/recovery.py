"""Live recovery: the processes of a job that lost a member agree on who is gone, switch to a
layout on the survivors, refill what only the dead held from the last dist checkpoint, and
train on. ``LiveSwitcher.recover`` drives it; the steps, each bounded by the switcher's
``timeout``, all through the ``Rendezvous`` store (the job's process groups are broken: a
gloo or NCCL collective with a dead member hangs or errors):

1. **Who is gone.** Every survivor posts itself in a roll call (``g<g>/recover/here``, ``g`` the
   next switch number, the same on every survivor) and waits for the job's other devices.
   It stops waiting once every device still missing is known dead: named by the caller
   (``failed=``) or with a heartbeat that stopped moving (``Heartbeat``: a thread per process
   bumps ``beat/<device>`` every ``heartbeat`` seconds; ``Liveness`` calls a device dead when
   its counter did not move for ``stale_after`` seconds, no clocks compared), else at the
   timeout: a process that hangs but still beats is declared failed then. The first survivor
   to finish proposes the failed set (first writer wins: ``compare_set``) and every survivor
   takes that one; a process named in it although alive raises and must leave the job. The
   survivors confirm it in a vote: a survivor that dies now fails the recovery (retry).
2. **Where to.** ``dst_spec``, or the top of ``suggest`` on the surviving devices (the same on
   every survivor: the ranking is deterministic). Each survivor plans
   ``plan_transition(..., failed=..., allow_lost=True)`` and verifies it; the plan names the lost
   ranges exactly (``plan.stats["lost"]``).
3. **Can the checkpoint fill them?** Each destination rank plans reading its share of the lost
   ranges (``refill``: e.g. ``dynatrain.checkpoint.plan_load(..., only=lost)``: metadata only)
   and checks that the checkpoint's Adam step is the job's (an older checkpoint would mix two
   iterations). The survivors vote on the plan's digest and this check; a checkpoint that is
   missing, truncated, of another model, of an unknown format version or of another step is
   refused everywhere with one line (``RecoveryFailed``, exit status 2) before anything is
   torn down: the job keeps its state and ``recover`` may be retried with another checkpoint.
4. **Move.** The survivors abandon the old groups (megatron's parallel state, the default group),
   form a default group of the survivors (rank = position in the plan's process order, dead
   devices left out) and run the plan (``executor.switch``, all or nothing, sources only read).
5. **Refill and build.** Each destination rank writes the lost ranges it holds from the
   checkpoint into its received storage, the destination's processes form its default group,
   set up megatron's parallel state, build (``build``), install, and carry the scheduler,
   iteration and consumed samples; every survivor votes through the store.

What cannot be rolled back: the dead processes' unique state (DistributedOptimizer shards
exist once per DP group; with DP=1 whole stages) is gone, so the source layout can never be
formed again; the checkpoint refill is what restores it. A recovery that fails after step 3
leaves every survivor's source state untouched in memory and its groups torn down
(``RecoveryFailed.job`` is the old job): ``recover`` can be called again (it re-forms groups).
A process that dies during the last vote may leave others committed, as in any commit protocol.
Survivors whose device the destination does not use come out with ``role == "left"`` and may
idle as spares. Spares and fresh processes take no part in a recovery: grow back afterwards with
``prepare``/``switch``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ...ir.errors import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_LOST, DynatrainError, LayoutError
from ...ir.layout import Layout
from ...ir.loader import spec_to_dict
from ...ir.spec import LayoutSpec
from ...ir.state import transition_views
from ...planner.lost import LostState
from ...planner.pipeline import plan_transition
from ...planner.plan import Plan
from ...planner.serialize import plan_to_json
from ...planner.suggest import suggest
from ..executor import process_devices, switch
from ..storage import allocate, region, storage_layout
from .bridge import extract_state, install_state, read_step
from .buddy import BuddyCopy, fill_pieces, newest_common, run_fill, why_none
from .check_job import check_job
from .job import MegatronJob, RecoveryFailed, SwitchResult, carried, carry_into, parallel_kwargs
from .rendezvous import Rendezvous
from . import te_fp8

if TYPE_CHECKING:
    from .live import LiveSwitcher


class Heartbeat:
    """A daemon thread that bumps ``device``'s heartbeat counter every ``interval`` seconds."""

    def __init__(self, rdzv: Rendezvous, device: str, interval: float) -> None:
        self.rdzv, self.device, self.interval = rdzv, device, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dynatrain-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.rdzv.beat(self.device)
            except Exception:  # noqa: BLE001 — a store hiccup; the next beat tries again
                pass
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()


class Liveness:
    """Which devices' heartbeats stopped: counters unchanged for ``stale_after`` seconds of
    this process's own clock (no clocks are compared across processes).

    With ``grace`` a device whose counter has not moved since this object first saw it (it has
    not beaten yet, e.g. a slow node still building the job, or a replacement reusing a dead
    device's name) is stale only after ``grace`` seconds: a watchdog must not take a peer that
    is still starting for a dead one, nor wait on one that never starts forever."""

    def __init__(self, rdzv: Rendezvous, stale_after: float, grace: float | None = None) -> None:
        self.rdzv, self.stale_after, self.grace = rdzv, stale_after, grace
        # device -> (counter, when it last moved, the counter first seen)
        self._seen: dict[str, tuple[int, float, int]] = {}

    def stale(self, devices: tuple[str, ...] | list[str]) -> set[str]:
        now = time.monotonic()
        out = set()
        for d, n in self.rdzv.beats(devices).items():
            last = self._seen.get(d)
            if last is None:
                self._seen[d] = (n, now, n)
            elif last[0] != n:
                self._seen[d] = (n, now, last[2])
            else:
                started = n != last[2]
                limit = self.stale_after if started or self.grace is None else self.grace
                if now - last[1] >= limit:
                    out.add(d)
        return out


class LostForGood(DynatrainError):
    """State that no survivor, copy or given checkpoint can restore (exit status 3)."""

    exit_code = EXIT_LOST


@dataclass(frozen=True)
class RecoveryPlan:
    """A recovery every survivor agreed on (``Recovery.prepare``)."""

    digest: str  # of the plan (timings left out) and how lost state comes back
    dst_spec: LayoutSpec
    dst: Layout
    plan: Plan
    lost: LostState
    mode: str  # "exchange", "buddy", "refill" or "rollback" (``Recovery._restore``)
    write: Callable[[dict], object] | None  # this rank's checkpoint writer (refill, rollback)
    carry: dict | None  # the training state of a rollback or a buddy recovery
    src_store: dict | None  # this process's source state (None for a rollback)
    fill: Callable | None = None  # a buddy recovery's fill, run by the exchange

    def without_source(self) -> RecoveryPlan:
        return replace(self, src_store=None)


def _gather_in_flight(job: MegatronJob) -> bool:
    """Whether the job's DistributedOptimizer gathers parameters during the next forward pass
    (``overlap_param_gather``) rather than at the end of the step."""
    cfg = getattr(job.model_chunks[0], "ddp_config", None) if job.model_chunks else None
    return bool(cfg is not None and cfg.use_distributed_optimizer
                and cfg.overlap_param_gather)


def _device(backend: str) -> torch.device:
    """Where a rollback's destination storage lives: the job's GPU under NCCL."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:400]


def _refusal(err: BaseException) -> str:
    """A vote outcome for an error: ``"<exit status> <one line>"``."""
    code = getattr(err, "exit_code", 4) if isinstance(err, DynatrainError) else 4
    return f"{code} {type(err).__name__}: {_line(err)}"


def _bad(votes: dict[str, str | None], ok: str) -> tuple[str, str, int] | None:
    """The first device whose vote is not ``ok`` (``"ok"`` or ``"ok <digest>"``): (device,
    why, the exit status its refusal carries); None if every vote is ``ok``."""
    for d, v in votes.items():
        if v is None:
            return d, "no vote (its process died or hangs)", EXIT_ABORTED
        if v.startswith("ok") and v != ok:
            return d, "the survivors planned different recoveries", EXIT_ABORTED
        if v != ok:
            code, _, why = v.partition(" ")
            return d, why, int(code) if code.isdigit() else EXIT_ABORTED
    return None


class Recovery:
    """One recovery, seen from one surviving process."""

    def __init__(self, sw: LiveSwitcher, job: MegatronJob, generation: int) -> None:
        assert sw.spec is not None and sw.layout is not None and sw.rendezvous is not None
        self.sw, self.job, self.g = sw, job, generation
        self.rdzv: Rendezvous = sw.rendezvous
        self.src_spec: LayoutSpec = sw.spec
        self.src: Layout = sw.layout
        self.me = sw.device
        self.name = f"g{generation}/recover"
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()
        self.filled = 0  # bytes a buddy recovery wrote into this rank's state from copies
        self.copies_why: str | None = None  # why buddy copies could not restore the state

    def _lap(self, what: str) -> None:
        now = time.perf_counter()
        self.seconds[what] = now - self._mark
        self._mark = now

    def _dead(self) -> set[str]:
        """Devices whose heartbeat stopped: a vote stops waiting for them (a second failure
        during the recovery fails it at once, and ``recover`` may be called again)."""
        live = self.sw.liveness
        return live.stale(self.src.devices) if live is not None else set()

    def _fail(self, what: str, code: int, keep_job: bool = True) -> RecoveryFailed:
        return RecoveryFailed(f"{self.me}: recovery failed: {what}",
                              self.job if keep_job else None, code)

    # ---- 1. who is gone ----------------------------------------------------------------------

    def agree_failed(self, given: frozenset[str]) -> tuple[str, ...]:
        """The failed devices every survivor uses (see the module docstring, step 1)."""
        sw, rdzv, devices = self.sw, self.rdzv, self.src.devices
        unknown = sorted(given - set(devices))
        if unknown:
            raise self._fail(f"failed: {unknown[0]} is not a device of the job's layout",
                             EXIT_BAD_INPUT)
        if rdzv.count(f"{self.name}/claim", 1) == 1:
            # Keep the switch numbering spares follow: announce this number, naming no joiner.
            if rdzv.count("latest", 1) != self.g:
                raise self._fail("another job uses this rendezvous prefix", EXIT_BAD_INPUT)
            doc = spec_to_dict(self.src_spec, devices)
            rdzv.post(f"switch/{self.g}", {"src": doc, "dst": doc, "recovery": True})
        liveness = sw.liveness

        def dead() -> set[str]:
            # Once a survivor proposed the failed devices, every survivor adopts that proposal
            # (``propose``: the first one wins): a late one (released from a collective by its
            # timeout) need not wait for them, nor take a replacement that beats under a dead
            # device's name for that device come back.
            won = rdzv.read(f"{self.name}/failed")
            return (set(given) | (set(won["failed"]) if won is not None else set())
                    | (liveness.stale(devices) if liveness is not None else set()))

        # A survivor blocked in a collective on the dead beats on and arrives once its
        # group's timeout releases it: wait for it that long beyond the timeout.
        wait = sw.timeout + (sw.collective_timeout or 0.0)
        missing = rdzv.present(f"{self.name}/here", devices, self.me, wait, dead=dead)
        proposal = sorted(set(missing) | given)
        agreed = tuple(rdzv.propose(f"{self.name}/failed", {"failed": proposal})["failed"])
        self._lap("detect")
        if not agreed:
            err = self._fail("every device of the job answered: nothing failed (a switch "
                             "without failures is switch())", EXIT_BAD_INPUT)
            err.nothing_failed = True
            raise err
        if self.me in agreed:
            raise self._fail("the other processes declared this device failed (it did not "
                             f"answer within {wait:.1f} s); it must leave the job",
                             EXIT_ABORTED, keep_job=False)
        survivors = [d for d in devices if d not in agreed]
        bad = _bad(rdzv.vote(f"{self.name}/confirm", survivors, self.me, "ok",
                             dead=self._dead), "ok")
        if bad is not None:
            raise self._fail(f"{bad[0]} did not confirm the failed devices ({bad[1]}); call "
                             "recover again", EXIT_ABORTED)
        self._lap("agree")
        return agreed

    def agree_step(self, survivors: tuple[str, ...]) -> dict[str, tuple[int, int | str]]:
        """Every survivor's (iteration, Adam step), as each posted it. They differ when the
        failure struck inside an optimizer step (some survivors stepped, others not), and the
        step is ahead of the iteration on a survivor stopped in the parameter all-gather."""
        try:
            step: int | str = read_step(self.job.optimizer)
        except LayoutError:  # its optimizers disagree: it stopped between two of them
            step = "mixed"
        votes = self.rdzv.vote(f"{self.name}/step", survivors, self.me,
                               f"{self.job.iteration}:{step}", dead=self._dead)
        out = {}
        for d, v in votes.items():
            if v is None:
                raise self._fail(f"{d} did not post its step (its process died or hangs); "
                                 "call recover again", EXIT_ABORTED)
            it, _, s = v.partition(":")
            out[d] = (int(it), int(s) if s.isdigit() else s)
        return out

    # ---- 2. + 3. where to, and what restores what was lost ----------------------------------

    def prepare(self, failed: tuple[str, ...], steps: dict, dst_spec: LayoutSpec | None,
                checkpoint: str | None, rollback: bool | None,
                holds: dict | None = None) -> RecoveryPlan:
        """Plan, verify, choose how lost state comes back, check the checkpoint and extract the
        source state; voted by every survivor, so all go on or all raise the same refusal,
        before anything is torn down."""
        survivors = tuple(d for d in self.src.devices if d not in failed)
        out = None
        try:
            out = self._prepare(failed, survivors, steps, dst_spec, checkpoint, rollback, holds)
            outcome = "ok " + out.digest
        except Exception as err:  # noqa: BLE001 — voted, then raised everywhere
            outcome = _refusal(err)
        votes = self.rdzv.vote(f"{self.name}/ready", survivors, self.me, outcome,
                               dead=self._dead)
        # This process's own refusal first: the line it names is the one it can explain.
        bad = _bad({self.me: outcome}, "ok " + out.digest if out else "ok") or _bad(votes, outcome)
        self._lap("prepare")
        if bad is not None:
            raise self._fail(f"{bad[1]} (on {bad[0]}); the job keeps its state", bad[2])
        assert out is not None
        return out

    def _prepare(self, failed, survivors, steps, dst_spec, checkpoint,
                 rollback, holds) -> RecoveryPlan:
        sw, src = self.sw, self.src
        gone = frozenset(failed)
        if dst_spec is None:
            found = suggest(src, survivors, topology=sw.topology, budget_bytes=sw.budget_bytes,
                            failed=gone)
            if not found.ranked:
                raise DynatrainError(f"no layout of the model fits the {len(survivors)} "
                                     f"surviving devices: {found.why_empty()}")
            dst_spec = found.ranked[0].spec
        dst = Layout(dst_spec)
        plan = plan_transition(src, dst, sw.budget_bytes, sw.topology, failed=gone,
                               allow_lost=True)
        sw.verify(plan, src, dst)
        if set(process_devices(plan)) & gone:
            raise LayoutError("executor.process_devices still counts the failed devices as "
                              "processes of the switch (it must leave out plan.stats['failed'])")
        lost = LostState.from_json(plan.stats["lost"])
        one_step = len(set(steps.values())) == 1 and not _gather_in_flight(self.job)
        if sw.buddy and rollback is not True and not (one_step and not lost):
            got = self._from_copies(dst_spec, gone, holds) if holds is not None else None
            if got is not None:
                return got
            if holds is None:
                self.copies_why = why_none(None, (), None)
        rank = dst.devices.index(self.me) if self.me in dst.devices else None
        mode, write, carry = self._restore(dst, rank, lost, steps, checkpoint, rollback)
        src_view, dst_view = transition_views(src, dst)
        src_store = None
        if mode != "rollback":  # a rollback moves nothing: it reloads everything
            self._check_job()
            src_store = extract_state(src_view, src.devices.index(self.me),
                                      self.job.model_chunks, self.job.optimizer)
        doc = plan_to_json(plan)
        del doc["summary"]  # timings: the only part that differs between processes
        doc["restore"] = [mode, checkpoint if mode != "exchange" else None]
        digest = hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(),
                                 digest_size=16).hexdigest()
        return RecoveryPlan(digest, dst_spec, dst, plan, lost, mode, write, carry, src_store)

    def _from_copies(self, dst_spec: LayoutSpec, gone: frozenset[str],
                     holds: dict) -> RecoveryPlan | None:
        """A recovery from the buddy copies (``buddy.py``): every survivor's own copy of the
        newest step all copies share as its source, what the dead held from their buddies'
        copies during the exchange, the parameters derived from the main params. None when
        the copies cannot restore that step (a buddy died too, or none was taken yet): the
        caller falls back to a checkpoint."""
        sw, src, copies = self.sw, self.src, self._copies()
        failed = tuple(d for d in src.devices if d in gone)
        tag = newest_common(holds, failed, copies.pairs) if copies is not None else None
        if tag is None:
            self.copies_why = why_none(holds, failed, copies.pairs if copies else None)
            return None
        state = dst_spec.state.model_copy(update={"derive_param": True})
        dst = Layout(dst_spec.model_copy(update={"state": state}))
        plan = plan_transition(src, dst, sw.budget_bytes, sw.topology, failed=gone,
                               allow_lost=True)
        sw.verify(plan, src, dst)
        lost = LostState.from_json(plan.stats["lost"])
        src_view, dst_view = transition_views(src, dst)
        holders = {d: copies.pairs[d] for d in failed}
        pieces = fill_pieces(src_view, dst_view, lost, holders)
        self._check_job(needed=False)
        own = copies.own_at(tag)
        ward = copies.ward if copies.ward in gone else None
        held = copies.held_at(tag).store if ward is not None else None
        if held is not None:
            _check_copy(src_view, src.devices.index(ward), held)
        on = _device(self.rdzv.backend)
        src_store = {k: t.to(on) for k, t in own.store.items()}
        _check_copy(src_view, src.devices.index(self.me), own.store)
        mine = tuple(p for p in pieces if self.me in (p.holder, dst.devices[p.dst_rank]))

        def fill(dst_store, pg, devices, device) -> None:
            self.filled = run_fill(mine, self.me, dst.devices, devices, held, dst_store, pg,
                                   sw.timeout, device)

        doc = plan_to_json(plan)
        del doc["summary"]
        doc["restore"] = ["buddy", list(tag)]
        digest = hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(),
                                 digest_size=16).hexdigest()
        return RecoveryPlan(digest, dst_spec, dst, plan, lost, "buddy", None, own.carry,
                            src_store, fill)

    def _check_job(self, needed: bool = True) -> None:
        """The job must run what its spec says (no collective: safe with broken groups),
        checked once per job. megatron's ``sharded_state_dict``, which ``check_job`` reads,
        needs megatron's parallel state: a switch or recovery that failed after tearing it down
        leaves none, and checked this very job as it began (``sw.checked``). ``needed=False``:
        a recovery from buddy copies, whose copies ``extract_state`` bound to the layout when
        they were taken, checks only while it can."""
        from megatron.core import parallel_state as ps

        sw = self.sw
        checked = sw.checked() if sw.checked is not None else None
        if checked is self.job:
            return
        if not ps.model_parallel_is_initialized():
            if needed:
                raise LayoutError("the job was never checked against its layout and megatron's "
                                  "parallel state is gone: recover by rolling back "
                                  "(rollback=True with a checkpoint)")
            return
        check_job(self.src, self.src.devices.index(self.me), self.job.model_chunks,
                  self.job.optimizer)
        sw.checked = weakref.ref(self.job)

    def _copies(self) -> BuddyCopy | None:
        """The buddy copies of the job's current layout, if any were kept."""
        b = self.sw._buddy
        return b if b is not None and b.layout is self.src else None

    def agree_copies(self, survivors: tuple[str, ...]) -> dict | None:
        """Every survivor's buddy copies (``BuddyCopy.tags``); None if one has none."""
        copies = self._copies()
        mine = json.dumps(copies.tags()) if copies is not None else "none"
        votes = self.rdzv.vote(f"{self.name}/copies", survivors, self.me, mine, dead=self._dead)
        out = {}
        for d, v in votes.items():
            if v is None:
                raise self._fail(f"{d} did not post its buddy copies (its process died or "
                                 "hangs); call recover again", EXIT_ABORTED)
            if v == "none":
                return None
            out[d] = json.loads(v)
        return out

    def _restore(self, dst: Layout, rank: int | None, lost: LostState, steps: dict,
                 checkpoint: str | None, rollback: bool | None):
        """How the survivors get every piece of state of one step back: ``"exchange"``
        (everything survives, at one step), ``"refill"`` (the lost ranges from a checkpoint of
        the survivors' very step) or ``"rollback"`` (every destination rank reloads the whole
        checkpoint, of any step, with the training state it was saved with: what a restart
        from it gives). The same on every survivor: it depends only on what they all see.
        Returns (mode, this rank's checkpoint writer or None, the carried training state of a
        rollback or None)."""
        sw = self.sw
        held = sorted(set(steps.values()), key=repr)
        one_step = len(held) == 1 and not _gather_in_flight(self.job)
        if rollback is not True and one_step and not lost:
            return "exchange", None, None
        if len(held) == 1 and not one_step:
            # With the parameter all-gather overlapped into the next forward pass, a failure
            # may leave the survivors' parameters partly of the last step, partly older.
            need = ("the job overlaps its parameter all-gather with the forward pass "
                    "(overlap_param_gather): the survivors' parameters may be partly gathered")
        elif one_step:
            need = lost.summary() if lost else "a rollback was asked for"
        else:
            # Some survivors finished an optimizer step the others did not begin (the failure
            # struck inside it): no exchange brings them to one step.
            ahead = ", ".join(f"{d} at iteration {i}, step {s}" for d, (i, s) in steps.items())
            need = (f"the survivors hold different steps ({ahead}): the failure struck inside "
                    "an optimizer step")
        if self.copies_why is not None:
            need += f" (buddy copies cannot restore it: {self.copies_why})"
        if checkpoint is None or sw.refill is None:
            raise LostForGood(f"{need}, and no checkpoint restores it (recover needs "
                              "checkpoint= and a LiveSwitcher refill: a checkpoint of this step "
                              "to refill what was lost, of any step to roll back to)")
        # Planned for rank 0 on a survivor the destination leaves out: its step is all it needs.
        ck_step, write = sw.refill(checkpoint, dst, rank or 0, lost if lost else None)
        job_step = held[0][1] if one_step else None
        if rollback is not True and one_step and lost and (ck_step is None or ck_step == job_step):
            return "refill", write if rank is not None else None, None
        if rollback is False or sw.train_state is None:
            if not one_step:
                raise LostForGood(f"{need}; rolling back to checkpoint {checkpoint} needs "
                                  "rollback allowed and a LiveSwitcher train_state")
            how = ("recover(rollback=False) forbids rolling back to it" if rollback is False
                   else "or a LiveSwitcher train_state to roll back to it")
            raise DynatrainError(f"checkpoint {checkpoint}: holds Adam step {ck_step}, the "
                                 f"job is at step {job_step}; refilling from it would mix "
                                 f"two iterations (give the checkpoint of this step; {how})")
        carry = sw.train_state(checkpoint)
        missing = sorted({"iteration", "consumed_samples", "scheduler"} - set(carry))
        if missing:
            raise DynatrainError(f"checkpoint {checkpoint}: its training state has no "
                                 f"{missing[0]} (train_state must return what job.carried does)")
        if rank is None:
            return "rollback", None, carry
        return "rollback", sw.refill(checkpoint, dst, rank, None)[1], carry

    # ---- 4. + 5. move, refill, build ---------------------------------------------------------

    def run(self, given: frozenset[str], dst_spec: LayoutSpec | None, checkpoint: str | None,
            rollback: bool | None = None) -> tuple[SwitchResult, LayoutSpec]:
        """Recover (steps 1-5); the result and the destination's spec."""
        failed = self.agree_failed(given)
        survivors = tuple(d for d in self.src.devices if d not in failed)
        steps = self.agree_step(survivors)
        holds = self.agree_copies(survivors) if self.sw.buddy else None
        p = self.prepare(failed, steps, dst_spec, checkpoint, rollback, holds)
        from megatron.core import parallel_state as ps

        sw, rdzv = self.sw, self.rdzv
        saved = sw._save_global()
        carry = p.carry if p.mode in ("rollback", "buddy") else carried(self.job)
        union = tuple(d for d in process_devices(p.plan) if d not in failed)
        new, outcome, report, refilled = None, "ok", {}, 0
        src_store, p = p.src_store, p.without_source()
        try:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            src_view, dst_view = transition_views(self.src, p.dst)
            rank = p.dst.devices.index(self.me) if self.me in p.dst.devices else None
            if p.mode == "rollback":
                rdzv.leave()  # the broken group; nothing moves between survivors
                dst_store = (allocate(dst_view, rank, _device(rdzv.backend))
                             if rank is not None else None)
            else:
                rdzv.form(f"{self.name}/switch", union, self.me)  # destroys the broken group
                self._lap("switch_group")
                dst_store, report = switch(p.plan, src_view, dst_view, self.me, src_store,
                                           None, timeout=sw.timeout,
                                           check_transfers=sw.check_transfers, fill=p.fill)
                src_store = None
                self._lap("exchange")
                rdzv.leave()
            if rank is not None:
                if p.write is not None:
                    p.write(dst_store)
                    refilled = (_refilled_bytes(p.lost, dst_view, rank) if p.mode == "refill"
                                else _state_bytes(dst_view, rank, dst_store))
                elif p.mode == "buddy":  # filled during the exchange
                    refilled = self.filled
                self._lap("reload" if p.mode == "rollback" else "refill")
                new = self._build(p.dst_spec, p.dst, dst_view, dst_store, carry)
            del dst_store
        except Exception as err:  # noqa: BLE001 — voted, then raised everywhere
            outcome = _refusal(err)
        votes = rdzv.vote(f"{self.name}/commit", survivors, self.me, outcome, dead=self._dead)
        self._lap("commit_vote")
        bad = _bad(votes, "ok")
        if bad is not None:
            new = None
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            rdzv.leave()
            if sw.global_state is not None:
                sw.global_state.restore(saved)
            raise self._fail(f"{bad[1]} (on {bad[0]}); every survivor keeps its source state "
                             "(its groups are gone): call recover again", bad[2])
        te_fp8.forget_groups()  # TE fp8 registrations of the old job name its old groups
        if (survivors if p.mode == "rollback" else union).index(self.me) == 0:
            rdzv.post(f"done/{self.g}", {"outcome": "recovered"})
        role = "stayed" if new is not None else "left"
        self.seconds["downtime"] = sum(self.seconds.values())
        info = {"failed": list(failed), "dst": p.dst_spec.name, "devices": list(p.dst.devices),
                "lost_bytes": p.lost.nbytes, "refilled_bytes": refilled, "mode": p.mode,
                "steps": {d: list(s) for d, s in steps.items()},
                "iteration": int(carry["iteration"]),
                "plan_bytes_moved": p.plan.stats["bytes_moved"] if p.mode != "rollback" else 0}
        return SwitchResult(new, report, dict(self.seconds), role, self.g, info), p.dst_spec

    def _build(self, dst_spec: LayoutSpec, dst: Layout, dst_view, dst_store: dict,
               carry: dict) -> MegatronJob:
        from megatron.core import parallel_state as ps

        sw = self.sw
        self.rdzv.form(f"{self.name}/dst", dst.devices, self.me)
        self._lap("dst_group")
        ps.initialize_model_parallel(**parallel_kwargs(dst_spec), **sw.init_kwargs)
        new = sw.build(dst_spec)
        self._lap("build")
        install_state(dst_view, dst.devices.index(self.me), new.model_chunks, new.optimizer,
                      dst_store)
        carry_into(new, carry)
        self._lap("install")
        return new


def _check_copy(view, rank: int, store: dict) -> None:
    """A buddy copy holds every non-parameter tensor ``rank`` has in ``view``, of its shape
    (the copies are taken with the padding rows of the vocabulary as state, the widest view).

    Raises:
        LayoutError: it does not: one line naming the tensor.
    """
    for key, (shape, dtype) in storage_layout(view, rank).items():
        if key[0] == "param":
            continue
        got = store.get(key)
        if got is None or tuple(got.shape) != tuple(shape) or got.dtype != dtype:
            raise LayoutError(f"buddy copy of rank {rank}: {key} is "
                              f"{'missing' if got is None else tuple(got.shape)}, the "
                              f"recovery reads {tuple(shape)} {dtype}")


def _state_bytes(dst_view, rank: int, store: dict) -> int:
    """Bytes of the state ``rank`` holds: what a rollback reloads (buffer padding and the step
    counters, which are set rather than read, left out)."""
    return sum(reg.box.numel * region(store, reg.kind, reg.slot, reg.box).element_size()
               for reg in dst_view.regions(rank) if reg.kind != "step")


def _refilled_bytes(lost: LostState, dst_view, rank: int) -> int:
    """Bytes of ``lost`` that destination ``rank`` holds (what its refill wrote)."""
    wanted = {(e.key, e.kind): (e.boxes, e.nbytes // max(e.numel, 1)) for e in lost.entries}
    total = 0
    for reg in dst_view.regions(rank):
        boxes, size = wanted.get((reg.key, reg.kind), ((), 0))
        for b in boxes:
            cut = reg.box & b
            if cut is not None:
                total += cut.numel * size
    return total
