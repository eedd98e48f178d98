"""The part of a live switch that changes the world: the processes of both layouts meet in one
default group, run the plan, and the destination's processes form the destination's group;
a failure anywhere forms the source's group again and rebuilds the source job from its intact
state. ``LiveSwitcher`` (``live.py``) drives it; the protocol is described there."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NoReturn

from ...ir.errors import DynatrainError
from ...ir.layout import Layout
from ...ir.spec import LayoutSpec
from ...ir.state import transition_views, view_of
from ..executor import process_devices, switch
from .bridge import extract_state, install_state, install_step
from .build_ahead import Built, set_parallel_state, set_rng_state
from .groups_ahead import GroupsAhead, Joinworld, Subworld, switch_order
from .job import MegatronJob, Prepared, SwitchFailed, SwitchResult, carry_into, parallel_kwargs
from .rendezvous import Rendezvous, RendezvousTimeout
from . import te_fp8

if TYPE_CHECKING:
    from .live import LiveSwitcher


AHEAD = " ahead"  # a plan vote's mark: this process made the destination's world ahead


def _no_votes(votes: dict[str, str | None], what: str, timeout: float) -> None:
    """Raise naming every device whose vote did not come (its process died or hangs)."""
    missing = [d for d, v in votes.items() if v is None]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise RendezvousTimeout(f"no {what} vote within {timeout:.1f} s from "
                                f"{', '.join(missing[:8])}{more}", missing)


def _why(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}"


class WorldSwitch:
    """One world-changing switch, seen from one process (a source, a joiner or both)."""

    def __init__(self, sw: LiveSwitcher, prep: Prepared | None, device: str, rdzv: Rendezvous,
                 *, src: Layout | None = None, generation: int | None = None) -> None:
        self.sw, self.prep, self.device, self.rdzv = sw, prep, device, rdzv
        self.src = prep.src if prep is not None else src
        self.g = prep.generation if prep is not None else generation
        assert self.src is not None and self.g is not None
        self.src_spec: LayoutSpec | None = prep.src_spec if prep is not None else None
        self.src_rank = (self.src.devices.index(device) if device in self.src.devices
                         else None)

    def _ps(self):
        from megatron.core import parallel_state as ps

        return ps

    def run(self, job: MegatronJob | None, src_store: dict | None, carry: dict,
            t: list[float], failure: BaseException | None = None) -> SwitchResult:
        """Take part in the switch: ``job``/``src_store`` on a source process (None on a
        joiner), ``carry`` what the job carries, ``failure`` a planning error of a joiner."""
        ps, prep, g, rdzv = self._ps(), self.prep, self.g, self.rdzv
        saved = self.sw._save_global()
        seconds: dict[str, float] = {"agree": t[-1] - t[0]} if len(t) > 1 else {}
        mark = [time.perf_counter()]

        def lap(name: str) -> None:
            mark.append(time.perf_counter())
            seconds[name] = mark[-1] - mark[-2]

        ahead: GroupsAhead | None = None
        built = self.sw._built_for(prep) if prep is not None else None
        self.sw._built = None
        try:
            if prep is None:
                # A joiner that could not plan still meets the others, so they learn it now.
                dst_devices = ()
                union = self._union_without_plan()
            else:
                dst_devices = prep.dst.devices
                union = process_devices(prep.plan)
            waited = time.perf_counter()
            ahead = self._world_ahead(union, built)
            if ahead is None:
                built = None
            seconds["groups_wait"] = time.perf_counter() - waited
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            if ahead is not None and isinstance(ahead.world, Joinworld) and built is not None:
                # Devices join, the destination built ahead: every process of the world agreed
                # on the plan then (``build_ahead.all_in_world``); the go said the job built.
                ahead.promote()
                lap("switch_group")
            elif ahead is not None and isinstance(ahead.world, Joinworld):
                # Devices join: the vote says whether every process made the world ahead.
                if self._plan_vote(union, failure, ahead.ready(0)):
                    lap("plan_vote")
                    ahead.promote()  # the switch runs in the destination's world
                else:
                    lap("plan_vote")
                    ahead.discard()
                    ahead = built = None
                    rdzv.form(f"g{g}/switch", union, self.device)
                lap("switch_group")
            else:
                if ahead is None:
                    rdzv.form(f"g{g}/switch", union, self.device)
                lap("switch_group")
                if ahead is None:  # else the switch's processes are the job's: they agreed
                    self._plan_vote(union, failure)
                    lap("plan_vote")
            assert prep is not None
            src_view, dst_view = transition_views(prep.src, prep.dst)
            # A join's world made ahead, now the default group, numbers its processes in the
            # destination's order (then those that leave, where some do).
            joined = ahead is not None and isinstance(ahead.world, Joinworld)
            order = switch_order(self.src.devices, dst_devices) if joined else None
            dst_store, report = switch(prep.plan, src_view, dst_view, self.device, src_store,
                                       None, timeout=self.sw.timeout,
                                       check_transfers=self.sw.check_transfers,
                                       dst_store=built.storage if built is not None else None,
                                       devices=order,
                                       prepared=built.exchange if built is not None else None)
            if built is not None and built.exchange is None:  # the build ahead's reason
                report["prepared_why"] = built.exchange_why
            src_store = None
            lap("exchange")
            # The switch's group is the destination's when both hold the same processes in the
            # same order, or when it is a join's world made ahead: kept, not formed again.
            keep = joined or tuple(union) == tuple(dst_devices)
            if ahead is not None and isinstance(ahead.world, Subworld) \
                    and self.device in dst_devices:
                ahead.promote()  # the destination's world, made ahead, is the default now
            elif joined and ahead.switch_group is not None and self.device in dst_devices:
                ahead.settle()  # devices left too: the destination's world, from the switch's
            elif not keep and self.device in dst_devices:
                rdzv.leave()  # a leaving process leaves after the vote, off the others' path
            new, outcome, error = None, "ok", None
            if self.device in dst_devices:
                try:
                    new = (self._install_built(built, dst_store, carry, lap) if built is not None
                           else self._build(prep, dst_view, dst_store, carry, lap, keep, ahead))
                except Exception as err:  # noqa: BLE001 — voted, then raised everywhere
                    outcome, error = _why(err), err
            del dst_store
            votes = rdzv.vote(f"g{g}/commit", union, self.device, outcome)
            lap("commit_vote")
            if outcome == "ok":
                _no_votes(votes, "commit", rdzv.timeout)
            bad = {d: (v or "no vote") for d, v in votes.items() if v != "ok"}
            if bad:
                d, why = ((self.device, outcome) if outcome != "ok"
                          else next(iter(bad.items())))
                raise DynatrainError(f"the switch was voted down by {len(bad)} process(es), "
                                     f"e.g. {d}: {why}") from error
        except Exception as err:  # noqa: BLE001 — every failure rolls back
            self.roll_back(job, carry, err, saved)
        if built is not None and new is not None:  # what the build ahead left, now committed
            if self.sw.global_state is not None:
                self.sw.global_state.restore(built.global_state)
            set_rng_state(built.rng)
        if new is None:  # left: its groups go (gloo joins their threads: ~5 ms a group)
            rdzv.leave()
        te_fp8.forget_groups()  # TE fp8 registrations of the old job name its old groups
        if union.index(self.device) == 0:
            rdzv.post(f"done/{g}", {"outcome": "committed"})
        report["world_ahead"] = ahead is not None
        report["built_ahead"] = built is not None
        if built is not None:
            seconds["build_ahead"] = built.seconds
            # A joiner was not in the job when it stopped: it reports no arrival.
            arrived = self.sw._arrived if self.src_rank is not None else 0.0
            report["arrived_at"], report["left_at"] = arrived, time.time()
        report["groups_ahead"] = self.sw.groups_taken if new is not None else 0
        role = ("left" if new is None else "stayed" if self.src_rank is not None else "joined")
        seconds.update(plan=prep.plan_seconds, verify=prep.verify_seconds,
                       downtime=time.perf_counter() - t[0])
        return SwitchResult(new, report, seconds, role, g)

    def _union_without_plan(self) -> tuple[str, ...]:
        doc = self.rdzv.read(f"switch/{self.g}")
        if doc is None:
            raise DynatrainError(f"switch {self.g} is not announced")
        from ...ir.loader import spec_from_dict

        dst = Layout(spec_from_dict(doc["dst"]))
        return tuple(sorted(set(self.src.devices) | set(dst.devices)))

    def _plan_vote(self, union: tuple[str, ...], failure: BaseException | None,
                   ahead: bool = False) -> bool:
        """Every process of the switch (joiners too, which the job's agreement did not
        reach) planned the very same switch: a vote through the store. Each also says
        whether it made the destination's world ahead (``ahead``); returns whether all did."""
        prep = self.prep
        digest = prep.digest.hex() if prep is not None else f"failed: {_why(failure)}"
        votes = self.rdzv.vote(f"g{self.g}/plan", union, self.device,
                               digest + (AHEAD if ahead else ""))
        if failure is not None:
            raise failure
        _no_votes(votes, "plan", self.rdzv.timeout)
        plans = {d: (v or "").removesuffix(AHEAD) for d, v in votes.items()}
        if any(v != digest for v in plans.values()):
            odd = {d: v for d, v in plans.items() if v != digest}
            raise DynatrainError(f"{self.device}: the processes planned different switches "
                                 f"({len(odd)} differ, e.g. {next(iter(odd.items()))})")
        return all((v or "").endswith(AHEAD) for v in votes.values())

    def _world_ahead(self, union: tuple[str, ...], built: Built | None) -> GroupsAhead | None:
        """The destination's world and groups made ahead (those of the destination job
        ``built`` ahead, if any), where the switch can take them: devices only leave
        (``Subworld``) and every process of the switch has all of its own (one all-reduce in
        the job's world, which is the switch's), or devices join (``Joinworld``: the plan
        vote, which reaches the joiners too, agrees on it, or, where the destination was
        built ahead, the build's own agreement in that world did). None: the switch forms its
        groups, and those made ahead are destroyed."""
        sw = self.sw
        ahead, sw._ahead = sw._ahead, None
        if built is not None:
            ahead = built.ahead
        if ahead is None:
            return None
        if isinstance(ahead.world, Joinworld) and self.prep is not None \
                and set(union) == set(self.prep.dst.devices) | set(self.src.devices):
            if built is None:
                self._ready_unless_voted_down(ahead, union)
            return ahead  # agreed in the plan vote, or when built, joiners included
        ok = ahead.ready(sw.timeout)  # its thread creates groups: done before any other is
        if isinstance(ahead.world, Subworld) and self.prep is not None \
                and union == self.src.devices and sw._all_built(ok):
            return ahead
        ahead.discard()
        return None

    def _ready_unless_voted_down(self, ahead: GroupsAhead, union: tuple[str, ...]) -> None:
        """Wait for a join's world made ahead (at most the switch's timeout) until some
        process of the switch has voted without it: then it cannot be taken, and waiting on
        would only make this process's vote late. (A joiner that came after the job's
        processes gave up waiting for it would otherwise wait its whole timeout for groups
        whose other members are gone.)"""
        deadline = time.monotonic() + self.sw.timeout
        keys = [f"g{self.g}/plan/{d}" for d in union if d != self.device]
        while not ahead.ready(0.05) and time.monotonic() < deadline:
            votes = [self.rdzv.read(k) for k in keys]
            if any(v is not None and not str(v["outcome"]).endswith(AHEAD) for v in votes):
                return

    def _install_built(self, built: Built, dst_store: dict, carry: dict, lap) -> MegatronJob:
        """The destination job built ahead, its state switched into it: megatron's parallel
        state it was built in (the groups made ahead, its world promoted), the step and what
        the job carries."""
        assert built.job is not None
        lap("dst_group")
        set_parallel_state(built.parallel)
        self.sw.groups_taken = built.groups
        install_step(built.job.optimizer, dst_store)
        carry_into(built.job, carry)
        lap("install")
        return built.job

    def _build(self, prep: Prepared, dst_view: Any, dst_store: dict, carry: dict,
               lap, keep: bool = False, ahead: GroupsAhead | None = None) -> MegatronJob:
        ps, sw = self._ps(), self.sw
        if not keep and ahead is None:  # else already the destination's default group
            self.rdzv.form(f"g{self.g}/dst", prep.dst.devices, self.device)
        lap("dst_group")
        if ahead is not None:
            sw.groups_taken = ahead.initialize()
        else:
            sw.groups_taken = 0
            ps.initialize_model_parallel(**parallel_kwargs(prep.dst_spec), **sw.init_kwargs)
        lap("parallel_state")
        new = sw.build(prep.dst_spec)
        lap("build")
        install_state(dst_view, prep.dst.devices.index(self.device), new.model_chunks,
                      new.optimizer, dst_store)
        carry_into(new, carry)
        lap("install")
        return new

    def roll_back(self, job: MegatronJob | None, carry: dict, cause: BaseException,
                  saved: object = None) -> NoReturn:
        """Back to the source layout, then raise ``SwitchFailed``: on a source process, form
        the source's group again and rebuild the job from the old job's intact state; then
        what the switcher's ``global_state`` saved before the switch is restored."""
        ps, sw, g = self._ps(), self.sw, self.g
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.rdzv.leave()
        what = f"{self.device}: the switch failed ({_why(cause)})"
        if job is None or self.src_rank is None or self.src_spec is None:
            if sw.global_state is not None:
                sw.global_state.restore(saved)
            raise SwitchFailed(f"{what}; this process runs no source rank", None) from cause
        try:
            live = sw.liveness  # a source device that died cannot come: fail at once
            self.rdzv.form(f"g{g}/rollback", self.src.devices, self.device,
                           dead=(lambda: live.stale(self.src.devices)) if live else None)
            ps.initialize_model_parallel(**parallel_kwargs(self.src_spec), **sw.init_kwargs)
            te_fp8.forget_groups()
            restored = sw.build(self.src_spec)
            full = view_of(self.src, self.src.padded_vocab)  # every row, padding included
            state = extract_state(full, self.src_rank, job.model_chunks, job.optimizer)
            install_state(full, self.src_rank, restored.model_chunks, restored.optimizer, state)
            carry_into(restored, carry)
            if sw.global_state is not None:  # after the rebuild, which set it for the source
                sw.global_state.restore(saved)
        except Exception as err:  # noqa: BLE001
            raise SwitchFailed(f"{what}, and the source layout could not be formed again "
                               f"({_why(err)}): recover on the survivors (their source state "
                               "is intact) or restart from a checkpoint", None) from cause
        if self.src_rank == 0:
            self.rdzv.post(f"done/{g}", {"outcome": "rolled back"})
        raise SwitchFailed(f"{what}; rolled back: the job trains on in the source layout, "
                           "rebuilt in new process groups", restored) from cause
