"""Run a plan's switch on this machine: one CPU process per device, gloo, random state.

``run_local`` forks one process per device of the switch (``process_devices(plan)``; fork is
~0.2 s where spawn re-imports torch for seconds). Every process draws the same global tensors
from ``seed`` (with Megatron's invariant param == cast(main_param) when the plan derives the
params), builds the storage of its source rank from them, runs ``switch``, and compares the
destination storage byte for byte with the storage built directly from the same tensors for
its destination rank. Processes meet through a file store in a temporary directory (no
network port) and report through JSON files (no pickles). Process 0 shows each round when
``progress`` is set: a ``rich`` progress bar when stderr is a terminal, else one line per
round from the ``dynatrain.runtime`` logger (what CI logs and tests see).

The parent never waits forever and never loses a reason: a process that raises reports the
exception's type and first line; one that dies (a signal, ``os._exit``) or never reports is
named; once one process has failed the others get ``2 * timeout + GRACE_SECONDS`` to abort
before they are killed. A switch that did not commit on every process raises
``LocalRunAborted`` (exit status 4) naming who died or failed first.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..ir.errors import DynatrainError
from ..ir.state import StateView
from ..planner.plan import Plan
from .executor import SwitchAborted, process_devices, switch
from .storage import allocate, fill_from_global, random_global, storage_bytes, torch_dtype

MAX_TIMEOUT = 1e6  # seconds; beyond it a "timeout" is no timeout (and overflows timedelta math)
MIN_TIMEOUT = 1e-3  # gloo counts its timeouts in whole milliseconds
GRACE_SECONDS = 5.0  # after a failure, beyond two waits, for the others to report their abort


class LocalRunAborted(SwitchAborted):
    """A local switch did not commit on every process; every source stayed intact.

    Attributes:
        results: every process's result, in device order (see ``run_local``).
        failed: the devices whose processes died, crashed or never reported (the cause),
            else those that aborted.
    """

    def __init__(self, message: str, results: list[dict], failed: tuple[str, ...]) -> None:
        super().__init__(message, device=failed[0])
        self.results, self.failed = results, failed


def check_run_options(timeout: float, seed: int) -> None:
    """Refuse a ``timeout`` or ``seed`` a local run cannot use, before anything is forked.

    Raises:
        DynatrainError: naming ``--timeout`` (not finite seconds in [0.001, 1e6]) or
            ``--seed`` (not an integer that ``torch.manual_seed`` takes: 0 <= seed < 2**64).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        raise DynatrainError(f"--timeout: must be a finite number of seconds from {MIN_TIMEOUT} "
                             f"to {MAX_TIMEOUT:.0f} (got {timeout!r})")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise DynatrainError(f"--seed: must be an integer with 0 <= seed < 2**64, the seeds "
                             f"torch.manual_seed takes (got {seed!r})")


@dataclass(frozen=True)
class _Job:
    """What a forked process needs; inherited through fork, never pickled."""

    plan: Plan
    src: StateView
    dst: StateView
    devices: tuple[str, ...]
    out: Path
    seed: int
    timeout: float
    progress: bool
    check_transfers: bool
    preallocated: bool = False
    warmup: bool = False


def global_state(view: StateView, seed: int, derived: bool) -> dict:
    """The random global tensors a local run starts from (the same in every process)."""
    tensors = random_global(view, seed)
    if derived:  # at a step boundary Megatron's params are the cast of its main params
        pdtype = torch_dtype(view.kinds["param"])
        for key, kind in list(tensors):
            if kind == "param":
                tensors[(key, kind)] = tensors[(key, "main_param")].to(pdtype)
    return tensors


def reason(err: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when the message is empty)."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _worker(idx: int, job: _Job) -> None:
    # Forked without exec: what the parent built stays out of this process's cycle
    # collections (gc docs), neither rescanned nor copied page by page as they write to it.
    gc.freeze()
    torch.set_num_threads(1)  # one process per device on a few cores
    device = job.devices[idx]
    res: dict = {"device": device, "errors": [], "checked": 0}
    bar = None
    try:
        if job.progress and idx == 0:
            bar = _Progress(job.plan)
        dist.init_process_group("gloo", init_method=f"file://{job.out}/store", rank=idx,
                                world_size=len(job.devices),
                                timeout=datetime.timedelta(seconds=job.timeout))
        plan = job.plan
        tensors = global_state(job.src, job.seed, bool(plan.derived))
        src = None
        if device in plan.src_devices:
            src = fill_from_global(job.src, plan.src_devices.index(device), tensors)
        if job.warmup:  # untimed, its destination dropped: as a process that switched before
            switch(plan, job.src, job.dst, device, src, timeout=job.timeout)
        kw = {"on_round": bar.on_round} if bar is not None and bar.on_round else {}
        if job.preallocated and device in plan.dst_devices:  # as a destination built ahead
            kw["dst_store"] = allocate(job.dst, plan.dst_devices.index(device))
        dist.barrier()
        t0 = time.perf_counter()
        dst, report = switch(plan, job.src, job.dst, device, src, timeout=job.timeout,
                             check_transfers=job.check_transfers, **kw)
        if bar is not None:
            bar.done()
        dist.barrier()
        res["seconds"] = time.perf_counter() - t0
        res["report"] = {k: v for k, v in report.items() if k != "per_round"}
        if device in plan.dst_devices:
            rank = plan.dst_devices.index(device)
            want = fill_from_global(job.dst, rank, tensors)
            if dst is None or dst.keys() != want.keys():
                res["errors"].append(f"{device}: destination rank {rank} has other tensors "
                                     "than its layout")
            else:
                for k, w in want.items():
                    g = dst[k]
                    if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(
                            _bits(g), _bits(w)):
                        res["errors"].append(f"{device}: destination rank {rank}: {k} differs")
                res["checked"] = len(want)
                res["dst_bytes"] = storage_bytes(dst)
        dist.destroy_process_group()
    except SwitchAborted as err:
        res["aborted"] = str(err)
        res["errors"].append(str(err))
    except BaseException as err:  # noqa: BLE001 — reported to the parent
        # The reason goes on the first line: that is the line a report shows.
        res["crashed"] = f"{device} crashed: {reason(err)}"
        res["errors"].append(res["crashed"])
        res["traceback"] = traceback.format_exc()
    finally:
        if bar is not None:
            bar.close()
    tmp = job.out / f"result{idx}.json.tmp"  # renamed: the parent never reads half a file
    tmp.write_text(json.dumps(res), encoding="utf-8")
    tmp.replace(job.out / f"result{idx}.json")


class _Progress:
    """Process 0's view of the rounds: a rich bar on a terminal, else the runtime's log lines."""

    def __init__(self, plan: Plan) -> None:
        self.on_round = None
        self._bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(TextColumn("  switching"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("rounds"), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("switch", total=len(plan.rounds))
            self._bar.start()
            self.on_round = self._at_round  # called at each round's start: the ones before
        else:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("  %(message)s"))
            log = logging.getLogger("dynatrain.runtime")
            log.addHandler(handler)
            log.setLevel(logging.INFO)

    def _at_round(self, i: int) -> None:
        self._bar.update(self._task, completed=i)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self._bar.tasks[0].total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def run_local(plan: Plan, src: StateView, dst: StateView, *, seed: int = 0,
              timeout: float = 60.0, progress: bool = False,
              check_transfers: bool = False, preallocated: bool = False,
              warmup: bool = False) -> list[dict]:
    """Run ``plan`` in one local process per device; each process's result, in device order.

    A result holds ``device``, ``errors`` (empty when its destination is bit-exact; one line
    each), ``checked`` (destination tensors compared), ``seconds`` (the switch, barrier to
    barrier) and ``report`` (``SwitchReport.as_dict`` without its per-round list).
    ``preallocated``: each process allocates its destination storage (zeros, its pages
    mapped) before the switch, which writes into it (a live switch's destination exists),
    instead of the switch allocating it. ``warmup``: each process first runs the same switch
    once, untimed (connections, allocator and code paths warm, as in a process that switched
    before). Call
    ``check_run_options(timeout, seed)`` before to refuse bad options early.

    Returns:
        The results of a switch that committed on every process (its destination may still
        differ from the reference: see ``errors``).

    Raises:
        DynatrainError: ``timeout`` or ``seed`` out of range (``check_run_options``).
        LocalRunAborted: the switch did not commit everywhere (exit status 4). Its
            ``results`` say per process why: ``aborted`` (the ``SwitchAborted`` message),
            ``crashed`` ("node0:gpu1 crashed: ValueError: ..."), or, for a process that left
            no result, ``died`` ("node0:gpu2 died (signal 9)") or ``missing`` (killed after
            the time it may need).
    """
    check_run_options(timeout, seed)
    devices = process_devices(plan)
    with tempfile.TemporaryDirectory(prefix="dynatrain-run-") as tmpdir:
        job = _Job(plan, src, dst, devices, Path(tmpdir), seed, timeout, progress,
                   check_transfers, preallocated, warmup)
        fork = multiprocessing.get_context("fork")
        procs = [fork.Process(target=_worker, args=(i, job), daemon=True)
                 for i in range(len(devices))]
        for p in procs:
            p.start()
        # Every wait of the switch may take ``timeout``: rounds, derive, vote, plus setup.
        limit = timeout * (len(plan.rounds) + 4) * (2 if warmup else 1) + 120
        killed = _join(procs, job, limit, 2 * timeout + GRACE_SECONDS)
        results = [_result(i, d, procs[i], job, killed) for i, d in enumerate(devices)]
    if any("report" not in r for r in results):
        raise _aborted(results)
    return results


def _read(job: _Job, i: int) -> dict | None:
    path = job.out / f"result{i}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _join(procs: list, job: _Job, limit: float, grace: float) -> dict[int, str]:
    """Wait for every process: at most ``limit`` seconds, and ``grace`` seconds after the
    first that failed; kill the rest. Returns, per killed process, why it was killed."""
    start = time.monotonic()
    cutoff, why = start + limit, f"did not finish within {limit:.0f} s"
    alive = set(range(len(procs)))
    while alive:
        left = cutoff - time.monotonic()
        if left <= 0:
            break
        multiprocessing.connection.wait([procs[i].sentinel for i in alive], timeout=left)
        for i in [i for i in alive if not procs[i].is_alive()]:
            alive.discard(i)
            procs[i].join()
            res = _read(job, i)
            failed = res is None or "report" not in res
            later = time.monotonic() + grace
            if failed and later < cutoff:  # the others must notice and abort, then report
                cutoff = later
                why = (f"did not report within {grace:.0f} s after {job.devices[i]} failed "
                       f"(--timeout {job.timeout:g} s)")
    killed = {}
    for i in alive:
        procs[i].kill()
        procs[i].join()
        killed[i] = why
    return killed


def _result(i: int, device: str, proc, job: _Job, killed: dict[int, str]) -> dict:
    res = _read(job, i)
    if res is not None:
        return res
    if i in killed:
        res = {"missing": f"{device} {killed[i]}; killed"}
    elif proc.exitcode is not None and proc.exitcode < 0:
        res = {"died": f"{device} died (signal {-proc.exitcode})"}
    else:
        res = {"died": f"{device} exited with status {proc.exitcode} without reporting"}
    res.update(device=device, errors=[next(iter(res.values()))], checked=0)
    return res


def _aborted(results: list[dict]) -> LocalRunAborted:
    """One line: who died, crashed or went missing (the cause), then how the others ended."""
    causes = [r for r in results if {"died", "crashed", "missing"} & r.keys()]
    aborts = [r for r in results if "aborted" in r]
    committed = sum("report" in r for r in results)
    parts = [r.get("died") or r.get("crashed") or r.get("missing") for r in causes[:3]]
    if len(causes) > 3:
        parts.append(f"and {len(causes) - 3} more")
    if aborts:
        parts.append(f"{len(aborts)} process(es) aborted, their sources intact (first: "
                     f"{aborts[0]['aborted']})")
    if committed:
        parts.append(f"{committed} of {len(results)} committed")
    failed = tuple(r["device"] for r in (causes or aborts))
    return LocalRunAborted("switch aborted: " + "; ".join(parts), results, failed)
