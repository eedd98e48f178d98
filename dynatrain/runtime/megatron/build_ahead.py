"""A switch's destination job, built at an iteration boundary before the switch
(``LiveSwitcher.build_ahead`` runs ``build_ahead`` here; a same-devices switch then runs
``switch_built``, a switch that changes the world ``world.WorldSwitch`` with the job built).

Building the destination (megatron's modules, DDP buffers, the distributed optimizer and its
state, bound as the plan's destination storage) depends on the destination layout only, not on
the state the switch moves. ``LiveSwitcher.build_ahead`` therefore builds it at a boundary
after ``prepare``, once the destination's process groups exist (``groups_ahead``), and the
switch that follows runs only what must be synchronous: the job check, the exchange and the
commit vote. Given the training job, the build ahead also makes this process's part of the
exchange into the built destination (``runtime.prepared``: every round's views, wire pieces
and copy tables; a joiner's from its destination alone), so that the exchange at the switch
moves bytes and nothing else; the switch's report says whether it used it
(``prepared_ahead``) and why not.

Megatron keeps its parallel state in module globals, and a job's ``build`` changes more
outside the job (RNG streams, Megatron-LM's ``args`` and micro-batch calculator: the
switcher's ``global_state``). The build ahead runs with the destination's parallel state and
records what the build left (``Built``); then the source's parallel state, global state and RNG
streams are put back exactly, and the job trains on. The switch puts the recorded ones in
place. One difference with a build at the switch: RNG streams the build does not seed itself
are those of the boundary where it ran.

Where devices only leave, the destination's world is not the job's: it was made inside the
job's world (``groups_ahead.Subworld``), and the build runs with it as torch's default group
(``GroupsAhead.entered``), which is put back afterwards; a process that leaves builds nothing.
Where devices join, the destination's world was made beside the job's, with the joiners
(``groups_ahead.Joinworld``), and the build runs collectives of that world, so the joiners
build too: the job's rank 0 posts ``build/<g>`` on the store, each joiner waiting in
``LiveSwitcher.join`` builds (``build_joined``), and one all-gather in the destination's
world agrees that every process built the same plan's destination (``all_in_world``); the
switch then needs no plan vote through the store. Where devices leave as others join, that
agreement runs in the switch's world made ahead, which holds the leavers too (they build
nothing).

The destination is held beside the training job until the switch. On a GPU it is built ahead
only if its state plus a reserve fits in what is free (``headroom.free_bytes``): the reserve is
what the job needs above what it holds at a boundary to train an iteration (by default the
allocator's peak since start-up above what is allocated now). On the CPU nothing is checked
(see ``headroom``). Where it does not fit, the switch builds it at its own time, and its report
says why.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ...ir.state import StateView, storage_tensors, transition_views
from ...ir.units import format_bytes
from ..executor import SwitchAborted, switch
from ..headroom import free_bytes
from ..prepared import PreparedExchange, prepare_exchange
from ..storage import torch_dtype
from . import te_fp8
from .bridge import bind_state, extract_state, install_step
from .groups_ahead import (GroupsAhead, Joinworld, _new_group_is, _restore, _snapshot,
                           switch_order)
from .groups_ahead import resync as resync_groups
from .job import (MegatronJob, Prepared, SwitchFailed, SwitchResult, carry_into, first_line,
                  parallel_kwargs, where_failed)

if TYPE_CHECKING:
    from .live import LiveSwitcher


@dataclass(slots=True)
class Built:
    """A destination job built ahead, with what its build left outside it."""

    prep: Prepared  # the prepared switch it belongs to, its slice cut into rounds
    job: MegatronJob | None
    storage: dict | None  # the job's state bound as the plan's destination storage
    parallel: dict  # megatron's parallel state of the destination (module globals)
    global_state: object  # the switcher's ``global_state.save()`` right after the build
    rng: dict  # the RNG streams the build left
    groups: int  # megatron groups it took ready-made
    seconds: float  # the build ahead, at its boundary
    # Where the world changes: the destination's world and groups, made ahead (the switch
    # promotes the world); ``job`` and ``storage`` are None on a process that leaves.
    ahead: GroupsAhead | None = None
    # This process's part of the exchange, made into ``storage`` (``prepare_exchanges``);
    # else why not.
    exchange: PreparedExchange | None = None
    exchange_why: str | None = "no job given to build_ahead"


def _tracker_module() -> Any:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom


def rng_state() -> dict:
    """Every RNG stream a build may seed: Python, numpy, torch (CPU, CUDA) and megatron's
    tracker (the object, which a build may replace, and its states and seeds)."""
    mod = _tracker_module()
    tracker = mod._CUDA_RNG_STATE_TRACKER
    fields = None
    if tracker is not None:  # containers copied: fork and add replace and add entries
        fields = {k: (dict(v) if isinstance(v, dict) else set(v) if isinstance(v, set) else v)
                  for k, v in vars(tracker).items()}
    out = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(),
           "tracker": (tracker, mod._CUDA_RNG_STATE_TRACKER_INITIALIZED, fields)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(saved: dict) -> None:
    """The streams ``rng_state`` saved, exactly."""
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"])
    mod = _tracker_module()
    tracker, initialized, fields = saved["tracker"]
    mod._CUDA_RNG_STATE_TRACKER, mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, initialized
    if tracker is not None:
        vars(tracker).clear()
        vars(tracker).update({k: (dict(v) if isinstance(v, dict) else set(v)
                                  if isinstance(v, set) else v) for k, v in fields.items()})


def parallel_state() -> dict:
    """Megatron's parallel state now (its module's globals)."""
    from megatron.core import parallel_state as ps

    return _snapshot(ps)


def set_parallel_state(saved: dict) -> None:
    """Megatron's parallel state ``saved`` in place, without destroying the groups it
    replaces (they stay in use by the job that owns them)."""
    from megatron.core import parallel_state as ps

    _restore(ps, saved)


def clear_parallel_state() -> None:
    """Megatron's parallel state emptied, as ``initialize_model_parallel`` wants it, with
    every group left alive (0.19's destroy destroys groups)."""
    from megatron.core import parallel_state as ps

    with _new_group_is(lambda **kw: None, no_destroy=True):
        ps.destroy_model_parallel()


def job_reserve(cuda_device: int | None) -> int | None:
    """What the job needs above what it holds at a boundary to train an iteration: the
    allocator's peak above what is allocated now (None on the CPU)."""
    if cuda_device is None:
        return None
    return max(torch.cuda.max_memory_allocated(cuda_device)
               - torch.cuda.memory_allocated(cuda_device), 0)


def state_bytes(dst: StateView, rank: int) -> int:
    """The destination state one rank allocates (what ``bind_state`` binds)."""
    return sum(int(np.prod(shape)) * torch_dtype(dtype).itemsize
               for shape, dtype in storage_tensors(dst, rank).values())


def no_room(dst: StateView, rank: int, device: str, cuda_device: int | None,
            reserve_bytes: int | None) -> str | None:
    """Why the destination cannot be held beside the training job on this device, or None
    (it fits, or the CPU, which is not checked)."""
    free = free_bytes(cuda_device)
    if free is None:
        return None
    reserve = reserve_bytes if reserve_bytes is not None else job_reserve(cuda_device) or 0
    need = state_bytes(dst, rank)
    if need + reserve <= free:
        return None
    return (f"{device}: the destination state ({format_bytes(need)}) and the job's reserve "
            f"for training ({format_bytes(reserve)}) do not fit in the "
            f"{format_bytes(free)} free; built at the switch")


def build(build_fn: Any, spec: Any, initialize: Any) -> tuple[MegatronJob, Any]:
    """``build_fn(spec)`` with megatron's parallel state of the destination set up by
    ``initialize()`` (which returns how many groups it took ready-made); the caller puts the
    source's state back."""
    clear_parallel_state()
    groups = initialize()
    return build_fn(spec), groups


# ---- LiveSwitcher's build ahead and its switch ---------------------------------------------


def build_ahead(sw: LiveSwitcher, job: MegatronJob | None = None) -> str | None:
    """``LiveSwitcher.build_ahead`` (its docstring), for ``sw``."""
    t0 = time.perf_counter()
    why = cannot_build_ahead(sw)
    if why == "":
        return None  # built already
    if not sw._all_built(why is None):
        sw.ahead_why = why or "another process of the job could not build ahead"
        return sw.ahead_why
    assert sw._pending is not None and sw.layout is not None
    prep = sw._pending.result()
    if prep.plan is None:  # this device's slice, cut into rounds now (agreed by all)
        try:
            prep = sw._cut_slice(prep, None)
        except SwitchFailed as err:
            sw.ahead_why = first_line(err.__cause__ or err)
            return sw.ahead_why
    groups_ahead = sw._ahead
    joined = groups_ahead is not None and isinstance(groups_ahead.world, Joinworld)
    if joined and sw.leader:  # the joiners, waiting in ``join``, build with the job now
        assert sw.rendezvous is not None
        sw.rendezvous.post(f"build/{prep.generation}", {"build": True})
    built, failure = build_in(sw, prep, groups_ahead)
    if joined:
        assert groups_ahead is not None
        ok, failure = agreed_in_world(sw, groups_ahead, failure is None, prep.digest, failure)
        ok = sw._all_built(ok)  # the job's own processes: one answer, whatever befell the world
        if not ok and sw._ahead is not None:
            # A build that failed may have left the world's groups out of step: every process
            # drops them (the joiners too, told by the go), and the switch forms its own.
            sw._ahead.discard()
            sw._ahead = None
    else:
        ok = sw._all_built(failure is None)
    if not ok:
        built = None
        if groups_ahead is None:  # groups made here, maybe not as many everywhere
            resync_groups(sw.group)
        sw.ahead_why = f"building ahead failed on {where_failed(failure)}"
        return sw.ahead_why
    assert built is not None
    if job is not None:
        prepare_exchanges(sw, built, job)
    built.seconds = time.perf_counter() - t0
    sw._built, sw._ahead, sw.ahead_why = built, None, None
    return None


def prepare_exchanges(sw: LiveSwitcher, built: Built, job: MegatronJob | None) -> None:
    """This process's part of the switch's exchange, made into the built destination (views of
    ``job``'s state, which the switch checks are still where they were). Each process for
    itself, with no agreement: the wire is the same either way, and where it fails the switch
    prepares its part at its own time (``built.exchange_why`` says why)."""
    prep = built.prep
    joined = built.ahead is not None and isinstance(built.ahead.world, Joinworld)
    try:
        src_view, dst_view = transition_views(prep.src, prep.dst)
        src = (extract_state(src_view, sw.rank, job.model_chunks, job.optimizer)
               if job is not None else None)
        built.exchange = prepare_exchange(
            prep.plan, src_view, dst_view, sw.device, src, built.storage,
            devices=switch_order(prep.src.devices, prep.dst.devices) if joined else None)
        built.exchange_why = None
    except Exception as err:  # noqa: BLE001 — the switch prepares it instead
        built.exchange, built.exchange_why = None, first_line(err)


def build_joined(sw: LiveSwitcher, prep: Prepared) -> None:
    """A joiner's part of a build ahead (``join`` runs it when the job's leader posts that
    the job builds): its destination job, built with the job's processes in the
    destination's world made ahead; agreed with them (``all_in_world``). Kept for the
    switch where all built (the go says whether the job did); else the world made ahead is
    dropped, as every process drops it, and the switch forms its groups and builds."""
    t0 = time.perf_counter()
    ahead = sw._ahead
    if ahead is None:
        return  # no world to agree in (the job's groups could not have been made either)
    ready = ahead.ready(sw.timeout)
    if ahead.world_group is None:  # the job's agreement fails by its timeout, and drops it
        ahead.discard()
        sw._ahead = None
        return
    built, failure = build_in(sw, prep, ahead) if ready else (None, None)
    ok, failure = agreed_in_world(sw, ahead, built is not None, prep.digest, failure)
    if ok:
        assert built is not None
        prepare_exchanges(sw, built, None)  # a joiner holds no source: its receives only
        built.seconds = time.perf_counter() - t0
        sw._built, sw._ahead = built, None
        return
    sw.ahead_why = f"building ahead failed on {where_failed(failure)}"
    if sw._ahead is not None:
        sw._ahead.discard()
        sw._ahead = None


def agreed_in_world(sw: LiveSwitcher, ahead: GroupsAhead, ok: bool, digest: bytes,
                    failure: BaseException | None) -> tuple[bool, BaseException | None]:
    """``all_in_world``, and the failure to report; where the agreement itself failed (a
    process of the world died: gloo fails every member's collective), that world is
    unusable: its groups are destroyed and the switch forms its own."""
    try:
        return all_in_world(ahead, ok, digest), failure
    except Exception as err:  # noqa: BLE001 — reported as the build ahead's failure
        ahead.discard()
        sw._ahead = None
        return False, failure or err


def all_in_world(ahead: GroupsAhead, ok: bool, digest: bytes) -> bool:
    """Whether every process of the switch's world made ahead (the job's processes and the
    joiners: the destination's world, or where devices leave too the switch's) says ``ok``
    for the same plan (``digest``): one all-gather on the world's own group. Where all did,
    the switch needs no plan vote."""
    mine = torch.cat([torch.tensor([1 if ok else 0], dtype=torch.int64),
                      torch.frombuffer(bytearray(digest), dtype=torch.int64)])
    world = ahead.world
    assert isinstance(world, Joinworld)
    group = ahead.switch_group if world.leaves else ahead.world_group
    got = [torch.zeros_like(mine) for _ in range(world.union)]
    dist.all_gather(got, mine, group=group)
    return all(bool(g[0]) and torch.equal(g[1:], mine[1:]) for g in got)


def build_in(sw: LiveSwitcher, prep: Prepared, groups_ahead: GroupsAhead | None
             ) -> tuple[Built | None, BaseException | None]:
    """``prep``'s destination job, built in megatron's parallel state of the destination
    (the groups made ahead, in their world; else made now); then the parallel state, the
    global state and the RNG streams of before, exactly. A process that leaves builds
    nothing. Returns the build, or the error it raised."""
    _, dst_view = transition_views(prep.src, prep.dst)
    world = groups_ahead.world if groups_ahead is not None else None
    rank = sw.rank if world is None else world.rank
    if groups_ahead is not None:
        initialize = groups_ahead.initialize
    else:
        def initialize() -> int:
            from megatron.core import parallel_state as ps

            ps.initialize_model_parallel(**parallel_kwargs(prep.dst_spec), **sw.init_kwargs)
            return 0
    saved_ps, saved_global = parallel_state(), sw._save_global()
    saved_rng = rng_state()
    built = failure = None
    try:
        if rank is None:  # this process leaves the job at the switch: nothing to build
            built = Built(prep, None, None, {}, None, {}, 0, 0.0, groups_ahead)
        else:
            # Where the world changes, megatron builds in the destination's world made ahead.
            with groups_ahead.entered() if world is not None else nullcontext():
                new, groups = build(sw.build, prep.dst_spec, initialize)
                storage = bind_state(dst_view, rank, new.model_chunks, new.optimizer)
                built = Built(prep, new, storage, parallel_state(),
                              sw._save_global(), rng_state(), groups, 0.0, groups_ahead)
    except Exception as err:  # noqa: BLE001 — agreed by the caller; the switch builds instead
        built, failure = None, err
    finally:  # the parallel state, global state and RNG streams of before, exactly
        set_parallel_state(saved_ps)
        if sw.global_state is not None:
            sw.global_state.restore(saved_global)
        set_rng_state(saved_rng)
    return built, failure


def cannot_build_ahead(sw: LiveSwitcher) -> str | None:
    """Why this process cannot build the prepared switch's destination ahead (None: it
    can; empty: it has)."""
    if sw.layout is None:
        return f"{sw.device} runs no rank"
    if sw._pending is None or not sw._pending.done():
        return "no switch is prepared and planned (prepare, then wait for ready())"
    if sw._pending.exception() is not None:
        return "the switch's planning failed (the switch says why)"
    prep = sw._pending.result()
    world = sw._ahead.world if sw._ahead is not None else None
    if not prep.in_place and world is None:
        return ("the world changes and its destination's world is not made ahead (see "
                "groups_ahead): the destination's job is built in its own group, at the "
                "switch")
    if sw._built_for(prep) is not None:
        return ""
    if sw._ahead is not None and not sw._ahead.ready(sw.timeout):
        return (f"{sw.device}: the destination's groups made ahead were not ready "
                f"within {sw.timeout:.0f} s")
    rank = sw.rank if world is None else world.rank
    if rank is None:
        return None  # leaves: builds nothing
    _, dst_view = transition_views(sw.layout, prep.dst)
    return no_room(dst_view, rank, sw.device, sw._cuda_device, sw.reserve_bytes)


def switch_built(sw: LiveSwitcher, job: MegatronJob, prep: Prepared, src: dict,
                 t: list[float], built: Built, saved: object, scheduler: dict) -> SwitchResult:
    """The in-place switch into a destination built ahead: the exchange straight into its
    storage, the step and scheduler installed, the build's global state and RNG streams
    put in place, the commit vote; then megatron's parallel state of the destination
    replaces the source's. Until the vote the source's parallel state never changes, so a
    failure only puts back what was saved."""
    from megatron.core import parallel_state as ps

    src_view, dst_view = transition_views(sw.layout, prep.dst)
    saved_rng = rng_state()
    sw.groups_taken = built.groups
    try:
        dst, report = switch(prep.plan, src_view, dst_view, sw.device, src, sw.group,
                             timeout=sw.timeout, check_transfers=sw.check_transfers,
                             dst_store=built.storage, prepared=built.exchange)
        if built.exchange is None:  # the build ahead's reason, not the executor's
            report["prepared_why"] = built.exchange_why
    except SwitchAborted as err:
        built = None  # free the destination job before going back
        # The source's parallel state was never replaced: nothing to put back first.
        sw._aborted(err, prep, job, scheduler, saved, back_to_source=False)
    del src
    t.append(time.perf_counter())
    new, failure = built.job, None
    try:
        install_step(new.optimizer, dst)
        carry_into(new, scheduler)
        if sw.global_state is not None:
            sw.global_state.restore(built.global_state)
        set_rng_state(built.rng)
    except Exception as err:  # noqa: BLE001 — voted below, then raised everywhere
        failure = err
    if not sw._all_built(failure is None):
        new = dst = built = None
        if sw.global_state is not None:
            sw.global_state.restore(saved)
        set_rng_state(saved_rng)
        where = where_failed(failure)
        raise SwitchFailed(f"{sw.device}: installing the switched state failed on {where}"
                           "; back in the source layout, the job trains on",
                           job) from failure
    ps.destroy_model_parallel()  # the source's groups
    set_parallel_state(built.parallel)
    t.append(time.perf_counter())
    te_fp8.forget_groups()  # the source job's TE fp8 registrations name its old groups
    sw._after(prep, "stayed")
    names = ("check_agree", "cut_slice", "save_state", "exchange", "install")  # rest: ahead
    seconds = {n: b - a for n, a, b in zip(names, t, t[1:])}
    seconds.update(plan=prep.plan_seconds, verify=prep.verify_seconds,
                   check=sw.check_seconds or 0.0, downtime=t[-1] - t[0],
                   build_ahead=built.seconds)
    report["groups_ahead"] = sw.groups_taken
    report["arrived_at"], report["left_at"] = sw._arrived, time.time()
    report["built_ahead"] = True
    return SwitchResult(new, report, seconds, "stayed", prep.generation)
