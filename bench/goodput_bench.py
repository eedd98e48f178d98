"""Goodput under a trace of capacity events: DynaTrain live, checkpoint-restart, and
data-parallel-only elasticity, each running the same job through the same trace.

    python bench/goodput_bench.py                   # the full trace (about 4 minutes per way)
    python bench/goodput_bench.py --trace short --global-batch 6   # what the tests run
    python bench/goodput_bench.py --ways live,checkpoint --out FILE

The job is ``examples/live_switch_gpt.py``'s dense GPT, trained with megatron-core on 8 forked
gloo processes, "4 nodes x 2 GPUs", starting in TP2 PP2 DP2 (global batch 12 x 16 tokens, or
``--global-batch``). The trace is a list of events at wall-clock offsets: a preemption notice
(a node leaves, its deadline some seconds later), a failure without notice (the node's
processes are SIGKILLed wherever they are) and capacity coming back (the node returns; after a
failure, as new processes). Each way meets them as the systems it stands for do:

* **live** (DynaTrain): the bench, as a scheduler, posts the notice to the job's store
  (``requests.post_notice``, what ``dynatrain notice`` does); the job's ``LiveControl`` picks
  ``suggest``'s top layout on the devices that stay and switches at the first boundary where
  every plan is ready. The node that left waits as a spare; when capacity is back the bench
  posts the first layout (``requests.post_request``, what ``dynatrain switch`` does) and the
  spares join through the same live switch. The job keeps buddy copies
  (``LiveSwitcher(buddy=True)``, a copy after every step); on a failure the survivors' next
  collective fails, they call ``LiveSwitcher.recover``, which restores the newest step from
  the copies and goes on on ``suggest``'s layout of the survivors; the node's new processes
  (started once the job recovered) wait as spares and join when the bench posts the first
  layout. A survivor blocked in a collective on the dead is released by its group's timeout
  (gloo cannot abort one): ``COLLECTIVE_S`` for megatron's groups, ``GROUP_S`` for the
  default group the loop's own boundary collectives use, so detection takes up to that long
  here (``detect``); on NCCL the watchdog (``abort_after``) releases them once a heartbeat is
  stale.
* **checkpoint** (checkpoint-restart, the best case of it: Megatron-LM's
  ``--exit-signal-handler``, which saves when the scheduler signals): at the event every
  process saves a megatron dist checkpoint (model and fully reshardable optimizer) and exits;
  new processes start on the new devices, form the group and megatron's parallel state, build
  the job in the layout ``suggest`` picks (the same layout the live way goes to) and load the
  checkpoint. No iteration is lost; the restart is the downtime. A failure gets no save:
  the job also saves every ``--save-every`` iterations (Megatron-LM's ``--save-interval``);
  the bench, as the scheduler, tears the job down at once (no detection time: the best case)
  and restarts it on the devices left from the newest complete save; the iterations since
  are lost and done again.
* **dp-only** (data-parallel elasticity, as torchft and SageMaker HyperPod do it): the layout
  inside a data-parallel replica never changes; a notice takes out every replica holding a
  leaving device, and returning capacity brings whole replicas back. The replica changes are
  made here by DynaTrain's own live switch (the bench posts the layout), so the way differs
  from the live one in the devices it can use, not in how bytes move. A failure takes out
  the replica that held the node: the survivors recover onto the other replicas (the bench
  names the node, as torchft's lighthouse would; the job detects who is gone itself) from the
  buddy copies, which stand in for the optimizer state a replica keeps whole there.

A CPU machine runs all 8 "devices" on the same cores, so fewer devices would not train slower.
Each process therefore stands in for an accelerator: an iteration on ``n`` devices takes
``--work`` / ``n`` seconds (perfect scaling, an assumption), the real training step running
inside that time (the default leaves room for it here; ``failure_free_iteration_s`` shows when it
does not). Forked processes start warm: the checkpoint way's restarts do not include starting an
interpreter and importing torch and megatron (``cold_start_s`` in the JSON measures that once,
for one process on this machine: a real restart pays it on every node).

Reported per way: iterations done, the failure-free iteration time (the median period, start to
start, of two iterations in a row in the first layout with no event between them, the first
period left out), the effective training time ratio (iterations done x failure-free iteration
time / wall time, the wall time being the trace's: every way's first iteration starts when its
clock does), the same ratio without any downtime (``bound``: the devices the way trains on after
each event, from the event on, over the first layout's 8) and per event the downtime (the gap
between the last iteration before it and the first one after it, plus any stall at the
boundaries between the event and it), by phase, iterations lost, and the devices and layout
after it, and after a failure how the job came back (``recovered_by``). Iterations lost to a
failure count as not done: the ratio's iterations are the job's progress. A plot of the
timeline is written next to the JSON (``recovery_bench.py`` measures recoveries in detail).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the processes are forked: no CUDA in this one
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import live_switch_gpt as example  # noqa: E402  (imports megatron once: workers start warm)
import mcore_job  # noqa: E402

from dynatrain.ir.layout import Layout  # noqa: E402
from dynatrain.ir.loader import spec_from_dict, spec_to_dict  # noqa: E402
from dynatrain.planner.suggest import suggest  # noqa: E402
from dynatrain.runtime.megatron import (LiveSwitcher, Rendezvous, SwitchFailed, cpu,  # noqa: E402
                                        parallel_kwargs)
from dynatrain.runtime.megatron.control import LiveControl  # noqa: E402
from dynatrain.runtime.megatron.requests import post_notice, post_request  # noqa: E402
from dynatrain.verify.check import check  # noqa: E402
from forked import run_forked  # noqa: E402  (bench/)
from goodput_model import scale_model, scale_table  # noqa: E402  (bench/: the model at scale)

NODES, GPUS = 4, 2
DEVICES = [f"node{n}:gpu{g}" for n in range(NODES) for g in range(GPUS)]
FIRST = {"tp": 2, "pp": 2}
GLOBAL_BATCH, SEQ = 12, 16
TIMEOUT = 300.0
WAYS = ("live", "checkpoint", "dp-only")
COLLECTIVE_S = 6.0  # megatron's groups give up on a dead peer after this (a hang's bound)
GROUP_S = 10.0  # the default group's (the loop's own collectives), with room for a slow boundary
# (seconds after the start, what, node, the notice's deadline in seconds); "fail": the node's
# processes are SIGKILLed with no notice; "back": the node returns (after a failure, as new
# processes)
TRACES = {
    "full": {"duration": 240.0, "events": [(40.0, "notice", "node3", 30.0),
                                           (100.0, "back", "node3", None),
                                           (150.0, "fail", "node1", None),
                                           (200.0, "back", "node1", None)]},
    # Each event's window (about 20 s) leaves the checkpoint way (about 11 s and 9 s per
    # notice and return on a quiet 2-core machine) room for a machine the test suite loads too.
    "short": {"duration": 92.0, "events": [(10.0, "notice", "node3", 15.0),
                                           (32.0, "back", "node3", None),
                                           (52.0, "fail", "node1", None),
                                           (72.0, "back", "node1", None)]},
}


def first_spec():
    return spec_from_dict({"name": "tp2-pp2-dp2", "model": example.BASE, "parallel": FIRST,
                           "world": {"nodes": NODES, "gpus_per_node": GPUS}})


def node_devices(node: str) -> list[str]:
    return [d for d in DEVICES if d.startswith(node + ":")]


# ---- in every process ----------------------------------------------------------------------


class Log:
    """What a job's rank 0 appends to a JSON-lines file the bench reads at the end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, **rec) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _pace(t0: float, work: float, devices: int) -> None:
    """Stand in for an accelerator: the iteration that began at ``t0`` ends ``work / devices``
    seconds later (the real training step ran inside that time, when it fits)."""
    time.sleep(max(0.0, t0 + work / devices - time.time()))


def _wait_for_start(start_unix: float, leader: bool, log: Log) -> None:
    """Every way's first iteration starts when the trace's clock does."""
    if leader:
        log.write(kind="ready", t=time.time())
    time.sleep(max(0.0, start_unix - time.time()))


def _decide(flags: list[int], group) -> list[int]:
    """The job's rank 0's flags, on every process of ``group`` (None: the default group)."""
    t = torch.tensor(flags, dtype=torch.int64)
    dist.broadcast(t, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return [int(v) for v in t.tolist()]


def live_worker(device: str, store_path: str, start_unix: float, end_unix: float, log: Log,
                args, way: str, fresh: bool = False) -> None:
    """``live`` and ``dp-only``: a job under ``LiveControl`` taking up what the bench posts,
    with buddy copies, recovering from a failure without notice (``fresh``: a process of a
    node back after a failure, joining as a spare)."""
    from megatron.core import parallel_state as ps

    cpu.set_device(DEVICES.index(device))
    store = dist.FileStore(store_path, -1)
    rdzv = Rendezvous(store, "gloo", prefix="job", timeout=TIMEOUT, group_timeout=GROUP_S)
    trainer = mcore_job.GlobalBatch(args.global_batch, SEQ, example.BASE["vocab_size"])
    spec = None if fresh else first_spec()
    with cpu.cpu_shim():
        job = None
        if spec is not None:
            rdzv.form("start", DEVICES, device)
            ps.initialize_model_parallel(**parallel_kwargs(spec), **mcore_job.init_kwargs(),
                                         distributed_timeout_minutes=COLLECTIVE_S / 60)
            job = mcore_job.build_job(spec)
        sw = LiveSwitcher(spec, device, mcore_job.build_job, check, rendezvous=rdzv,
                          timeout=TIMEOUT, init_kwargs=mcore_job.init_kwargs(), buddy=True,
                          heartbeat=0.1, stale_after=1.5, collective_timeout=COLLECTIVE_S)
        ctl = LiveControl(sw)
        seen = None
        if not fresh:
            _wait_for_start(start_unix, sw.leader, log)
        joined = False
        while True:
            if job is None:  # left: a spare until capacity is back (or the job ends)
                try:
                    result = sw.join(timeout=TIMEOUT * 4)
                except SwitchFailed:  # the job rolled back and trains on; the event is
                    continue  # reported not done, and this spare waits for the next switch
                if result is None:
                    return
                job, joined = result.job, True  # at the boundary the others switched at
                continue
            try:
                t0 = time.time()
                if not joined:
                    job = ctl.boundary(job)
                joined = False
                if ctl.last is not seen:
                    seen = ctl.last
                    if sw.leader:
                        ok = not isinstance(seen, Exception)
                        log.write(kind="switch", ok=ok, t0=t0, t1=time.time(),
                                  downtime=seen.seconds.get("downtime") if ok else None,
                                  phases=seen.phases() if ok else None,
                                  error=None if ok else str(seen))
                if job is None:
                    continue
                [stop] = _decide([int(sw.leader and time.time() >= end_unix)], sw.group)
                if stop:
                    break
                n = len(sw.layout.devices)
                t0 = time.time()
                trainer.step(job)
                # The copy follows the optimizer step at once, as in a job whose accelerator
                # time is its step's (the boundary's own snapshot is then the same copy).
                sw.snapshot(job)
                _pace(t0, args.work, n)
                if sw.leader:
                    log.write(kind="iteration", iteration=job.iteration, t0=t0, t1=time.time(),
                              devices=n, layout=sw.spec.name)
            except Exception:  # noqa: BLE001 — a peer died: what a survivor sees of it
                job = _recover(sw, ctl, job, way, log)
        ctl.close()
        sw.close()


def _recover(sw, ctl, job, way: str, log: Log):
    """Go on without the dead (``LiveSwitcher.recover``: detected by their heartbeat, state
    from the buddy copies): live on ``suggest``'s layout of the survivors, dp-only on the
    replicas the dead were not in (the bench, as torchft's lighthouse would, says which node
    failed; the job detects who is gone itself)."""
    t0 = time.time()
    dst = None
    if way == "dp-only":
        gone = node_devices(sw.rendezvous.store.get("bench/failed").decode())
        dst = spec_from_dict(_dp_only(first_spec(), gone))
    res = sw.recover(job, dst_spec=dst)
    ctl.recovered(res)
    if sw.leader:
        log.write(kind="recovery", t0=t0, t1=time.time(), mode=res.recovery["mode"],
                  failed=list(res.recovery["failed"]), phases=res.phases(),
                  iteration=res.recovery["iteration"])
    return res.job


def checkpoint_worker(device: str, devices: list[str], spec_doc: dict, segment: int,
                      load_from: str | None, save_to: str, store_path: str, start_unix: float,
                      end_unix: float, log: Log, args) -> None:
    """``checkpoint``: one run of the job, from a checkpoint (or from scratch) until the bench
    asks it to stop (save, exit) or the trace ends."""
    from megatron.core import parallel_state as ps

    started = time.time()
    cpu.set_device(DEVICES.index(device))
    store = dist.FileStore(store_path, -1)
    rdzv = Rendezvous(store, "gloo", prefix=f"segment{segment}", timeout=TIMEOUT)
    trainer = mcore_job.GlobalBatch(args.global_batch, SEQ, example.BASE["vocab_size"])
    spec = spec_from_dict(spec_doc)
    leader = devices[0] == device
    with cpu.cpu_shim():
        rdzv.form("start", devices, device)
        ps.initialize_model_parallel(**parallel_kwargs(spec), **mcore_job.init_kwargs())
        t1 = time.time()
        job = mcore_job.build_job(spec)
        t2 = time.time()
        if load_from is not None:
            mcore_job.load_checkpoint(job, load_from)
        if leader:
            log.write(kind="restart", segment=segment, started=started, group=t1 - started,
                      build=t2 - t1, load=time.time() - t2, loaded=load_from is not None)
        if segment == 0:
            _wait_for_start(start_unix, leader, log)
        while True:
            stop_key = f"stop/{segment}"
            flags = [int(time.time() >= end_unix), int(store.check([stop_key]))] if leader \
                else [0, 0]
            end, stop = _decide(flags, None)
            if end:
                return
            if stop:
                t0 = time.time()
                mcore_job.save_checkpoint(job, save_to)
                if leader:
                    log.write(kind="save", segment=segment, t0=t0, t1=time.time(),
                              iteration=job.iteration, path=save_to, periodic=False)
                return
            t0 = time.time()
            trainer.step(job)
            _pace(t0, args.work, len(devices))
            if leader:
                log.write(kind="iteration", iteration=job.iteration, t0=t0, t1=time.time(),
                          devices=len(devices), layout=spec.name)
            if job.iteration % args.save_every == 0:  # Megatron-LM's --save-interval
                t0 = time.time()
                path = os.path.join(os.path.dirname(save_to),
                                    f"periodic-s{segment}-it{job.iteration}")
                mcore_job.save_checkpoint(job, path)  # every rank returns once all saved
                if leader:
                    log.write(kind="save", segment=segment, t0=t0, t1=time.time(),
                              iteration=job.iteration, path=path, periodic=True)


# ---- the bench: processes, the trace, the numbers ------------------------------------------


def _run(target, args_, err_dir: str, name: str) -> None:
    def quietly(*a):
        example.quiet_library_warnings()
        target(*a)

    run_forked(quietly, args_, os.path.join(err_dir, f"error-{name}.txt"))


class Processes:
    """Forked workers; any that fails (or the time limit) stops the way with its traceback,
    except those the bench killed itself (a failure in the trace, or a job torn down)."""

    def __init__(self, tmpdir: str, limit: float) -> None:
        self.ctx, self.tmpdir = multiprocessing.get_context("fork"), tmpdir
        self.procs: list = []
        self.of: dict[str, object] = {}  # device -> its newest process
        self.killed: set[int] = set()  # pids
        self.deadline = time.monotonic() + limit

    def start(self, target, per_device: dict[str, tuple]) -> list:
        started = []
        for d, a in per_device.items():
            p = self.ctx.Process(target=_run, args=(target, a, self.tmpdir, d))
            p.start()
            started.append(p)
            self.of[d] = p
        self.procs += started
        return started

    def kill(self, devices: list[str]) -> None:
        """SIGKILL the processes of ``devices`` (and whatever they started), at once."""
        procs = [self.of[d] for d in devices if self.of[d].exitcode is None]
        self.killed |= {p.pid for p in procs}
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
        for p in procs:
            p.join(timeout=10)
        for d in devices:  # a victim may have seen its peers go first and written why
            path = os.path.join(self.tmpdir, f"error-{d}.txt")
            if os.path.exists(path):
                os.remove(path)

    def check(self) -> None:
        bad = [p for p in self.procs if p.exitcode not in (None, 0) and p.pid not in self.killed]
        if bad or time.monotonic() > self.deadline:
            time.sleep(0.5)  # let a failing worker finish writing its traceback
            errors = sorted(f for f in os.listdir(self.tmpdir) if f.startswith("error-"))
            text = ("\n".join(f"{f[6:-4]}: " + open(os.path.join(self.tmpdir, f)).read()
                               for f in errors) if errors else
                    "a worker died" if bad else "the bench's time limit passed")
            raise RuntimeError(f"a worker failed:\n{text}")

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.join(timeout=5)


def _dp_only(spec, leaving: list[str] | None) -> dict:
    """The layout data-parallel elasticity goes to: ``spec``'s model-parallel layout on the
    data-parallel replicas (of the first layout) that hold no leaving device."""
    first = Layout(first_spec())
    replicas: dict[int, list[str]] = {}
    for r, d in enumerate(first.devices):
        replicas.setdefault(first.coords(r).dp, []).append(d)
    keep = [devs for devs in replicas.values() if not set(devs) & set(leaving or [])]
    if leaving is None or len(keep) == len(replicas):
        return spec_to_dict(first_spec())
    # Rank order inside the kept replicas as the first layout had it (TP fastest, then DP).
    devices = [d for d in first.devices if any(d in devs for devs in keep)]
    doc = spec_to_dict(first_spec(), tuple(devices))
    doc["name"] = f"tp2-pp2-dp{len(keep)}"
    return doc


def run_live(way: str, trace: dict, tmpdir: str, args) -> dict:
    store_path = os.path.join(tmpdir, "store")
    log = Log(os.path.join(tmpdir, "log.jsonl"))
    start = time.time() + args.startup
    end = start + trace["duration"]
    procs = Processes(tmpdir, args.startup + trace["duration"] + 600)
    procs.start(live_worker, {d: (d, store_path, start, end, log, args, way) for d in DEVICES})
    store = dist.PrefixStore("job/", dist.FileStore(store_path, -1))
    events, answers, failed, failed_at = [], [], set(), {}
    try:
        pending = list(trace["events"])
        while any(p.exitcode is None for p in procs.procs if p.pid not in procs.killed):
            procs.check()
            if pending and time.time() >= start + pending[0][0]:
                at, what, node, deadline = pending.pop(0)
                t, n = time.time(), None
                if what == "fail":  # no notice: the node's processes die where they are
                    store.set("bench/failed", node)
                    procs.kill(node_devices(node))
                    failed.add(node)
                    failed_at[node] = t
                elif what == "notice" and way == "live":
                    n = post_notice(store, node_devices(node), deadline, source="goodput bench")
                elif what == "notice":
                    n = post_request(store, _dp_only(first_spec(), node_devices(node)),
                                     source="goodput bench (dp-only)")
                else:
                    if node in failed:  # the node's new processes, spares until they join
                        failed.discard(node)
                        # A replacement node comes up once the job went on without the dead
                        # one: beating under a dead device's name before every survivor
                        # reached the roll call, it would keep the recovery waiting on it
                        # (docs/runtime.md).
                        while not any(r["kind"] == "recovery" and r["t0"] >= failed_at[node]
                                      for r in _read(log.path)):
                            procs.check()
                            time.sleep(0.1)
                        procs.start(live_worker, {d: (d, store_path, start, end, log, args,
                                                      way, True) for d in node_devices(node)})
                        while not store.check([f"spare/{d}" for d in node_devices(node)]):
                            procs.check()
                            time.sleep(0.05)
                    n = post_request(store, spec_to_dict(first_spec()),
                                     source="goodput bench")
                events.append({"at": at, "what": what, "node": node, "deadline_s": deadline,
                               "posted": t, "request": n})
            for e in events:
                key = f"answer/{e['request']}"
                if e["request"] is not None and "answer" not in e and store.check([key]):
                    e["answer"] = json.loads(store.get(key))["line"]
            time.sleep(0.05)
        procs.check()
    finally:
        procs.close()
    for e in events:
        key = f"answer/{e['request']}"
        if e["request"] is not None and "answer" not in e and store.check([key]):
            e["answer"] = json.loads(store.get(key))["line"]
        answers.append(e.get("answer"))
    return {"start": start, "end": end, "events": events, "log": _read(log.path)}


def run_checkpoint(trace: dict, tmpdir: str, args) -> dict:
    store_path = os.path.join(tmpdir, "store")
    log = Log(os.path.join(tmpdir, "log.jsonl"))
    start = time.time() + args.startup
    end = start + trace["duration"]
    store = dist.FileStore(store_path, -1)
    procs = Processes(tmpdir, args.startup + trace["duration"] + 600)
    devices, spec_doc = list(DEVICES), spec_to_dict(first_spec())
    segment, load_from, events = 0, None, []

    def launch() -> list:
        save_to = os.path.join(tmpdir, f"ckpt{segment}")
        return procs.start(checkpoint_worker, {
            d: (d, devices, spec_doc, segment, load_from, save_to, store_path, start, end, log,
                args) for d in devices})

    try:
        current = launch()
        pending = list(trace["events"])
        while True:
            procs.check()
            if all(p.exitcode is not None for p in current):
                break
            if pending and time.time() >= start + pending[0][0]:
                at, what, node, deadline = pending.pop(0)
                events.append({"at": at, "what": what, "node": node, "deadline_s": deadline,
                               "posted": time.time()})
                gone = node_devices(node)
                if what in ("notice", "fail"):
                    stay = [d for d in devices if d not in gone]
                    top = suggest(Layout(spec_from_dict(spec_doc)), stay).ranked[0].spec
                    nxt_devices, nxt_doc = stay, spec_to_dict(top, tuple(stay))
                else:
                    nxt_devices, nxt_doc = list(DEVICES), spec_to_dict(first_spec())
                if what == "fail":
                    # The node dies; the scheduler (told at once here: the best case) tears
                    # the job down and restarts it from the newest complete checkpoint.
                    procs.kill(gone)
                    procs.kill([d for d in devices if d not in gone])
                    saves = [r for r in _read(log.path) if r["kind"] == "save"]
                    load_from = max(saves, key=lambda r: r["t1"])["path"] if saves else None
                else:
                    store.set(f"stop/{segment}", "1")
                    for p in current:  # every process saved and exited: restart anew
                        while p.exitcode is None:
                            procs.check()
                            time.sleep(0.02)
                    load_from = os.path.join(tmpdir, f"ckpt{segment}")
                segment += 1
                devices, spec_doc = nxt_devices, nxt_doc
                events[-1]["restarted"] = time.time()
                current = launch()
            time.sleep(0.05)
        procs.check()
    finally:
        procs.close()
    return {"start": start, "end": end, "events": events, "log": _read(log.path)}


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(way: str, run: dict) -> dict:
    """The way's numbers from its rank 0s' logs."""
    its = sorted((r for r in run["log"] if r["kind"] == "iteration"), key=lambda r: r["t0"])
    fails = [run["start"] + e["at"] for e in run["events"] if e["what"] == "fail"]
    # Each iteration follows the one before, except right after a failure, where the job may
    # go on from an earlier one (the newest checkpoint): the iterations between are lost.
    lost, top, undone = 0, 0, set()  # undone: indices of the iterations lost
    for j, (a, r) in enumerate(zip([None] + its, its)):
        rolled_back = a is not None and any(a["t0"] < t <= r["t0"] for t in fails)
        if r["iteration"] != top + 1 and not (rolled_back and r["iteration"] <= top + 1):
            raise RuntimeError(f"{way}: iteration {r['iteration']} after {top} with no failure "
                               f"between: {[x['iteration'] for x in its][:60]}")
        if r["iteration"] <= top:  # gone back: the iterations since were done in vain
            lost += top + 1 - r["iteration"]
            undone |= {i for i in range(j) if its[i]["iteration"] >= r["iteration"]}
        top = r["iteration"]
    done = top  # iterations of progress: the lost ones were done again
    # An iteration's period: its step and the boundary after it (where requests are looked
    # at), between two iterations of the first layout with no event between them (the first
    # layout comes back with the capacity; the very first period is left out).
    first = (its[0]["layout"], its[0]["devices"]) if its else None
    at = [run["start"] + e["at"] for e in run["events"]]
    steady = [b["t0"] - a["t0"] for a, b in zip(its[1:], its[2:])
              if (a["layout"], a["devices"]) == (b["layout"], b["devices"]) == first
              and not any(a["t0"] < t <= b["t0"] for t in at)]
    if not steady:
        raise RuntimeError(f"{way}: no two iterations of the first layout in a row to time")
    t_ff = statistics.median(steady)
    t_begin = run["start"]
    wall = run["end"] - t_begin
    ready = [r["t"] for r in run["log"] if r["kind"] == "ready"]
    events = []
    for k, e in enumerate(run["events"]):
        t_e = run["start"] + e["at"]
        before = [r for r in its if r["t0"] < t_e]
        nxt = run["start"] + run["events"][k + 1]["at"] if k + 1 < len(run["events"]) \
            else run["end"]
        # The first iteration in a layout other than the one the event found.
        was = before[-1]["layout"], before[-1]["devices"]
        after = [r for r in its if r["t0"] >= t_e and r["t0"] < nxt
                 and (r["layout"], r["devices"]) != was]
        row = {"at_s": e["at"], "what": e["what"], "node": e["node"],
               "deadline_s": e["deadline_s"], "answer": e.get("answer")}
        if not after:
            row.update(done=False)
            events.append(row)
            continue
        last = max((r for r in its if r["t1"] <= after[0]["t0"]), key=lambda r: r["t1"])
        # Every stall from the event to the new layout's first iteration: the switch, and the
        # boundaries where the job took the event up (a notice's layout is chosen there); from
        # the last iteration that began before the event (after a failure: the last one that
        # finished, as the one it cut short left no record).
        span = [r for r in its if (r["t1"] > t_e or r is before[-1])
                and r["t0"] <= after[0]["t0"]]
        gaps = sum(b["t0"] - a["t1"] for a, b in zip(span, span[1:]))
        row.update(done=True, downtime_s=gaps,
                   ended_after_event_s=after[0]["t0"] - t_e, layout=after[0]["layout"],
                   devices=after[0]["devices"],
                   iterations_lost=last["iteration"] - (after[0]["iteration"] - 1))
        if e["deadline_s"] is not None:
            row["met_deadline"] = after[0]["t0"] <= t_e + e["deadline_s"]
        if e["what"] == "fail":  # how the job came back: its recovery's way, or a restart
            rec = [r for r in run["log"] if r["kind"] == "recovery"
                   and t_e <= r["t0"] <= after[0]["t0"]]
            row["recovered_by"] = (rec[0]["mode"] if rec else
                                   f"restart at iteration {after[0]['iteration'] - 1}")
        phases = _phases(way, run["log"], last["t1"], after[0]["t0"])
        phases["other"] = max(0.0, gaps - sum(phases.values()))
        row["phases_s"] = phases
        events.append(row)
    # Without downtime, iterations come at the rate of the devices in use: the way's devices
    # from each event on (taking effect at the event), over the first layout's.
    held, area, t_prev = len(DEVICES), 0.0, run["start"]
    for e, row in zip(run["events"], events):
        t_e = run["start"] + e["at"]
        area += held * (t_e - t_prev)
        held, t_prev = row.get("devices", held), t_e
    area += held * (run["end"] - t_prev)
    return {"way": way, "iterations": done, "iterations_lost": lost,
            "failure_free_iteration_s": t_ff,
            "wall_s": wall, "effective_training_time_ratio": done * t_ff / wall,
            "without_downtime_ratio": area / (len(DEVICES) * wall),
            "ready_late_s": max(0.0, max(ready) - run["start"]) if ready else None,
            "events": events,
            "timeline": [(r["t0"] - t_begin, r["t1"] - t_begin, r["devices"], i in undone)
                         for i, r in enumerate(its)]}


def _phases(way: str, log: list[dict], t0: float, t1: float) -> dict:
    """What the gap between two iterations was spent on (rank 0's view); after a failure,
    ``cut_short``: from the last iteration's end until the job began to recover (the
    iteration the failure cut short, and the error reaching the survivors; for the
    checkpoint way, until the scheduler's restart)."""
    if way == "checkpoint":
        save = [r for r in log if r["kind"] == "save" and not r.get("periodic")
                and t0 - 1 <= r["t0"] <= t1]
        rest = [r for r in log if r["kind"] == "restart" and t0 <= r["started"] <= t1]
        out = {}
        if save:
            out["save"] = save[0]["t1"] - save[0]["t0"]
        if save and rest:
            out["exit_and_start"] = rest[0]["started"] - save[0]["t1"]
        elif rest:
            out["cut_short"] = rest[0]["started"] - t0
        if rest:
            out.update(group_and_parallel_state=rest[0]["group"], build=rest[0]["build"],
                       load=rest[0]["load"])
        return out
    rec = [r for r in log if r["kind"] == "recovery" and t0 <= r["t0"] <= t1]
    if rec:
        return {"cut_short": rec[0]["t0"] - t0, **rec[0]["phases"]}
    sw = [r for r in log if r["kind"] == "switch" and r["ok"] and t0 - 1 <= r["t0"] <= t1]
    return dict(sw[0]["phases"]) if sw else {}


def cold_start_seconds() -> float:
    """One fresh interpreter importing torch, megatron-core and DynaTrain's runtime: what each
    process of a real restart pays before it can form its group."""
    code = ("import torch, megatron.core.models.gpt, dynatrain.runtime.megatron")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    return time.perf_counter() - t


def table(rows: list[dict]) -> str:
    head = (f"{'way':11s} {'iterations':>10s} {'t_ff':>7s} {'wall':>7s} {'ratio':>6s} "
            f"{'bound':>6s} | "
            "events: downtime (devices after, layout)")
    lines = [head, "-" * len(head)]
    for r in rows:
        ev = "; ".join(
            (f"{e['what']} {e['node']}: {e['downtime_s']:.2f} s ({e['devices']}, {e['layout']})"
             + (f" {e['iterations_lost']} it. lost" if e["iterations_lost"] else "")
             + ("" if e.get("met_deadline", True) else " DEADLINE MISSED"))
            if e["done"] else f"{e['what']} {e['node']}: not done" for e in r["events"])
        lines.append(f"{r['way']:11s} {r['iterations']:10d} {r['failure_free_iteration_s']:6.3f}s"
                     f" {r['wall_s']:6.1f}s {r['effective_training_time_ratio']:6.3f} "
                     f"{r['without_downtime_ratio']:6.3f} | {ev}")
    lines.append("downtime by phase (s):")
    for r in rows:
        for e in r["events"]:
            if e["done"]:
                lines.append(f"  {r['way']:11s} {e['what']} {e['node']}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in e["phases_s"].items()))
    return "\n".join(lines)


EVENT_COLORS = {"notice": "tab:red", "fail": "black", "back": "tab:green"}


def plot(rows: list[dict], trace: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.8 * len(rows) + 0.6), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        for t0, t1, n, undone in r["timeline"]:
            ax.broken_barh([(t0, t1 - t0)], (0, n), color="tab:grey" if undone else "tab:blue")
        for e in trace["events"]:
            ax.axvline(e[0], color=EVENT_COLORS[e[1]], lw=1)
        ax.set_ylim(0, len(DEVICES) + 0.5)
        ax.set_ylabel("devices")
        ax.set_title(f"{r['way']}: {r['iterations']} iterations, effective training time "
                     f"ratio {r['effective_training_time_ratio']:.2f}", fontsize=9)
    axes[-1, 0].set_xlabel("seconds (red: notice, black: failure, green: capacity back; grey: "
                           "iterations lost to a failure)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=sorted(TRACES), default="full")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"comma-separated, of {', '.join(WAYS)} (default: all)")
    ap.add_argument("--work", type=float, default=16.0, metavar="S",
                    help="an iteration's accelerator time on one device: it takes S / devices "
                         "seconds (default 16: 2 s on 8 devices, longer than its real step "
                         "here)")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, metavar="N",
                    help=f"samples per iteration (default {GLOBAL_BATCH}; a multiple of 6: "
                         "every data-parallel size on 8, 6 or 4 devices of the trace divides "
                         "it; fewer micro-batches, less CPU per iteration)")
    ap.add_argument("--save-every", type=int, default=5, metavar="N",
                    help="the checkpoint way saves every N iterations, as Megatron-LM's "
                         "--save-interval does (default 5: about 10 s here); a failure loses "
                         "the iterations since")
    ap.add_argument("--startup", type=float, default=15.0, metavar="S",
                    help="seconds the processes get to start before the trace's clock starts")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "goodput_bench.json"))
    ap.add_argument("--no-model", action="store_true", help="measure only (no model at scale)")
    model = ap.add_argument_group("the model at scale (assumptions)")
    model.add_argument("--node-hours", type=float, default=2000.0,
                       help="node-hours per preemption notice (default 2000)")
    model.add_argument("--back-min", type=float, default=30.0,
                       help="minutes until a preempted node is back (default 30)")
    model.add_argument("--nccl-init-s-1k", type=float, default=5.0,
                       help="seconds to form a world's communicators at 1,024 GPUs (default 5)")
    model.add_argument("--nccl-init-s-100k", type=float, default=60.0,
                       help="the same at 102,400 GPUs (default 60)")
    model.add_argument("--build-s", type=float, default=5.0,
                       help="seconds to build the job on a device (default 5)")
    model.add_argument("--ckpt-GBps", type=float, default=2.0,
                       help="checkpoint write and read speed per device, GB/s (default 2)")
    model.add_argument("--fail-node-hours", type=float, default=5000.0,
                       help="node-hours per failure without notice (default 5000)")
    model.add_argument("--detect-s", type=float, default=10.0,
                       help="seconds until a failure is seen (default 10)")
    model.add_argument("--save-interval-min", type=float, default=10.0,
                       help="minutes between the checkpoint way's saves (default 10)")
    args = ap.parse_args()
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in WAYS]
    if bad or not ways:
        ap.error(f"--ways: expected names from {', '.join(WAYS)} (got {args.ways!r})")
    positive = ("node_hours", "ckpt_GBps", "fail_node_hours")
    for name in ("work", "node_hours", "back_min", "nccl_init_s_1k", "nccl_init_s_100k",
                 "build_s", "ckpt_GBps", "fail_node_hours", "detect_s", "save_interval_min"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0) or (name in positive and v == 0):
            ap.error(f"--{name.replace('_', '-')}: a finite number "
                     f"{'> 0' if name in positive else '>= 0'} (got {v})")
    if args.global_batch < 6 or args.global_batch % 6:
        ap.error(f"--global-batch: a positive multiple of 6 (got {args.global_batch})")
    if args.save_every < 1:
        ap.error(f"--save-every: an integer >= 1 (got {args.save_every})")
    trace = TRACES[args.trace]
    out: dict = {"environment": {"python": platform.python_version(), "torch": torch.__version__,
                                 "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                 "trace": args.trace, "events": trace["events"],
                 "duration_s": trace["duration"], "work_s": args.work, "devices": DEVICES,
                 "save_every": args.save_every, "collective_timeout_s": COLLECTIVE_S,
                 "first_layout": "tp2-pp2-dp2", "global_batch": args.global_batch, "seq": SEQ}
    rows = []
    for way in ways:
        with tempfile.TemporaryDirectory(prefix=f"goodput_{way}_") as tmpdir:
            run = run_checkpoint(trace, tmpdir, args) if way == "checkpoint" else \
                run_live(way, trace, tmpdir, args)
        rows.append(summarize(way, run))
    out["ways"] = rows
    out["cold_start_s"] = cold_start_seconds()
    print(table(rows), flush=True)
    print(f"a real restart also starts interpreters and imports torch and megatron on every "
          f"node: {out['cold_start_s']:.1f} s for one process here (not in the checkpoint "
          f"way's downtime above)")
    if not args.no_model:
        out["model"] = scale_model(args, out["cold_start_s"])
        print(scale_table(out["model"], args, out["cold_start_s"]), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(rows, trace, png)
    out["plot"] = png
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
