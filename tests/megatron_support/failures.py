"""Test support for failures inside an iteration.

``worker``: a megatron job in forked processes checkpoints after iteration 1 only and trains
iterations 2 and 3. In iteration 4 one process stops (SIGSTOP: a hang, its sockets stay open)
inside its second micro-batch's forward pass. The survivors are blocked in collectives with it
or with each other; the job's bounded group timeout (``collective_timeout``) releases each, and
they ``recover`` (the stopped one is found by its heartbeat). A second process dies (SIGKILL)
while building the destination job of that recovery, which fails on every survivor (exit
status 4, job kept) and is called again. Since the stopped process's DistributedOptimizer shard
of step 3 exists nowhere else and the checkpoint is of step 1, every survivor reloads the
checkpoint in the suggested layout: a rollback in place. Then a third process dies (SIGKILL)
inside a forward pass; with no checkpoint given the recovery is refused with exit status 3
(state lost), job untouched, and a retry with the checkpoint rolls back again.

``redundant_worker``: a job with a second optimizer instance loses a whole node inside an
iteration and recovers with no checkpoint at all. ``phases_worker``: one death per phase of the
step. ``save_worker``: a death during a checkpoint save. ``notice_worker``: a preemption notice.
"""

from __future__ import annotations

import json
import os
import signal
import time

from dynatrain.runtime.megatron import LiveSwitcher, RecoveryFailed, Rendezvous
from dynatrain.verify.check import check
from matrix import to_harness_cfg, to_spec

from . import elastic, live
from . import recovery as rec


def train_state(ckpt: str) -> dict:
    """``LiveSwitcher``'s ``train_state``: what ``elastic.Trainer.save`` kept with ``ckpt``."""
    with open(os.path.join(ckpt, "common_train_state.json")) as f:
        common = json.load(f)
    return {"iteration": common["iteration"], "consumed_samples": common["consumed_samples"],
            "scheduler": common["scheduler"], "extra": {}}


def _fail_in_forward(job, sig: int, at_call: int = 2) -> None:
    """Send ``sig`` to this process at the start of its ``at_call``-th forward pass."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == at_call:
            os.kill(os.getpid(), sig)

    job.model_chunks[0].register_forward_pre_hook(hook)


def _start(store, base: dict, device: str, devices: list[str], global_batch: int,
           timeout: float, collective: float, dying_build: bool = False, **options):
    """Form the job's group, build its first job and a ``LiveSwitcher`` (heartbeat 0.1 s,
    stale after 1.5 s, the bounded group timeout ``collective``, ``options`` more); with
    ``dying_build`` the switcher's ``build`` kills this process (a failure inside a
    recovery). Returns (trainer, job, switcher)."""
    spec_a = rec.spec_on(base, to_spec(base).name, devices)  # rank r on devices[r]
    rdzv = Rendezvous(store, "gloo", prefix="job", timeout=timeout)
    tr = elastic.Trainer({spec_a.name: elastic.megatron_lm_config(to_harness_cfg(base))},
                         global_batch)

    def build(spec):
        if dying_build:
            os.kill(os.getpid(), signal.SIGKILL)
        tr.configs.setdefault(spec.name, rec.config_of(base, spec))
        return tr.build(spec)

    rdzv.form("start", devices, device)
    live.init_parallel(tr.configs[spec_a.name], distributed_timeout_minutes=collective / 60)
    job = tr.build(spec_a)
    sw = LiveSwitcher(spec_a, device, build, check, rendezvous=rdzv, timeout=timeout,
                      heartbeat=0.1, stale_after=1.5, collective_timeout=collective,
                      init_kwargs=dict(create_gloo_process_groups=False), **options)
    return tr, job, sw


def worker(base: dict, device: str, devices: list[str], stopped: str, in_recovery: str,
           killed: str, ckpt_dir: str, global_batch: int, timeout: float, collective: float):
    def fn(store) -> dict:
        # abort_after: the watchdog (a no-op abort under gloo) runs and is re-armed throughout.
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             dying_build=device == in_recovery, refill=rec.refill,
                             train_state=train_state, abort_after=4.5)
        ck = os.path.join(ckpt_dir, "step1")
        tr.step(job)
        tr.save(job, ck)
        tr.step(job)
        tr.step(job)
        store.set(f"test/pid/{device}", str(os.getpid()))
        out: dict = {}
        if device == stopped:
            _fail_in_forward(job, signal.SIGSTOP)
        dog = sw.watchdog
        out["first"] = _fail_and_roll_back(tr, sw, job, ck)
        # The watchdog saw the stopped process (under gloo it cannot abort), and recover armed
        # a fresh one.
        out["watchdog"] = {"fired": dog.fired and list(dog.fired[0]),
                           "rearmed": sw.watchdog is not dog}
        job = sw_job = out["first"].pop("job")
        if sw.layout is not None and sw.layout.devices[0] == device:
            os.kill(int(store.get(f"test/pid/{stopped}")), signal.SIGKILL)  # clean up the hang
        if sw_job is None:
            return out
        if device == killed:
            _fail_in_forward(job, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            tr.step(job)
            out["second_released"] = None
        except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
            out["second_released"] = (type(err).__name__, time.monotonic() - t0)
        try:
            sw.recover(job)
            out["lost"] = None
        except RecoveryFailed as err:
            out["lost"] = {"code": err.exit_code, "error": str(err), "same_job": err.job is job}
        res = sw.recover(job, checkpoint=ck)
        out["second"] = rec._checked(tr, sw, res, ck)
        sw.close()
        return out

    return fn


def _fail_and_roll_back(tr, sw: LiveSwitcher, job, ck: str) -> dict:
    """Iteration 4, which a peer's failure interrupts; then the recovery (auto: a rollback)."""
    t0 = time.monotonic()
    try:
        tr.step(job)
        released = None
    except Exception as err:  # noqa: BLE001 — released by the bounded group timeout
        released = (type(err).__name__, time.monotonic() - t0)
    iteration = job.iteration
    tries = []  # recoveries that a further failure made fail
    while True:
        t0 = time.monotonic()
        try:
            res = sw.recover(job, checkpoint=ck)
            break
        except RecoveryFailed as err:
            tries.append({"code": err.exit_code, "error": str(err), "same_job": err.job is job,
                          "seconds": time.monotonic() - t0, "written": list(rec.WRITTEN)})
            rec.WRITTEN.clear()
            if len(tries) > 1:
                raise
    out = rec._checked(tr, sw, res, ck)
    out.update(released=released, iteration_before=iteration, job=res.job, tries=tries)
    return out


def redundant_worker(base: dict, device: str, devices: list[str], killed: tuple[str, ...],
                     ckpt_dir: str, global_batch: int, timeout: float, collective: float):
    """A job whose optimizer state has a second copy at every step (megatron's
    ``num_distributed_optimizer_instances=2``) loses ``killed`` (SIGKILL, each in its forward
    pass of iteration 3: a whole node) and recovers with no checkpoint at all. The checkpoint
    of iteration 2 is saved for the test's oracle only: ``recover`` is not given it."""
    def fn(store) -> dict:
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective)
        oracle = os.path.join(ckpt_dir, "oracle-step2")
        tr.step(job)
        tr.step(job)
        tr.save(job, oracle)
        if device in killed:
            _fail_in_forward(job, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            tr.step(job)
            released = None
        except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
            released = (type(err).__name__, time.monotonic() - t0)
        res = sw.recover(job)  # no checkpoint
        out = rec._checked(tr, sw, res, oracle)
        out["released"] = released
        sw.close()
        return out

    return fn


def _die_in(phase: str, job, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to this process when it enters ``phase`` of its next iteration (SIGKILL:
    it dies; SIGSTOP: it hangs): the gradient reduce-scatter, its optimizer's own step (after
    the grad-norm all-reduce every rank took part in) or the parameter all-gather that ends
    the step."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    from dynatrain.runtime.megatron.bridge import _leaf_optimizers

    def die(*args, **kwargs):
        os.kill(os.getpid(), sig)

    if phase == "reduce_scatter":
        buffers.dist_reduce_scatter_func = die
    elif phase == "param_all_gather":
        buffers.dist_all_gather_func = die
    elif phase == "optimizer_step":
        for leaf in _leaf_optimizers(job.optimizer):
            leaf.optimizer.step = die
    else:
        raise ValueError(phase)


def phases_worker(base: dict, device: str, devices: list[str], victims: list[tuple],
                  ckpt_dir: str, global_batch: int, timeout: float, collective: float):
    """A DistributedOptimizer job that loses one process per entry of ``victims`` (device,
    phase, the devices to go on with as DP only or None for ``suggest``'s choice), in that
    order, each inside an iteration, with a checkpoint after the last finished iteration each
    time; the survivors ``recover`` (auto: an exact refill when they all hold that iteration's
    step, a rollback to it when the failure struck after some stepped)."""
    def fn(store) -> dict:
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             refill=rec.refill, train_state=train_state)
        out: dict = {}
        tr.step(job)
        for n, (victim, phase, onto) in enumerate(victims):
            ck = os.path.join(ckpt_dir, f"before{n}")
            tr.save(job, ck)
            if device == victim:
                _die_in(phase, job)
            try:
                tr.step(job)
                released = None
            except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
                released = type(err).__name__
            dst = None if onto is None else rec.spec_on(base, f"dp{len(onto)}", onto, tp=1)
            res = sw.recover(job, checkpoint=ck, dst_spec=dst)
            out[phase] = rec._checked(tr, sw, res, ck)  # trains one more iteration
            out[phase]["released"] = released
            job = res.job
            if job is None:
                break
        sw.close()
        return out

    return fn


def switch_worker(base: dict, device: str, devices: list[str], victim: str, ckpt_dir: str,
                  global_batch: int, timeout: float, collective: float):
    """A DistributedOptimizer job checkpoints iteration 1, prepares an in-place switch to TP2
    on the same devices, and ``victim`` dies (SIGKILL) as the switch's exchange begins. The
    survivors' switch fails: the group is gone and the source layout cannot be formed again
    without the dead device (they find that from its heartbeat, not at the timeout). Their
    source state is intact: they ``recover`` from it, refilling the lost shard from the
    checkpoint of their very step."""
    def fn(store) -> dict:
        from dynatrain.runtime import executor
        from dynatrain.runtime.megatron import SwitchFailed

        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             refill=rec.refill, train_state=train_state)
        tr.step(job)
        ck = os.path.join(ckpt_dir, "it1")
        tr.save(job, ck)
        sw.prepare(rec.spec_on(base, "tp2", devices, tp=2)).result()
        if device == victim:
            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            executor._run_rounds = die
        out: dict = {}
        t0 = time.monotonic()
        try:
            sw.switch(job)
            out["switch"] = "committed"
        except SwitchFailed as err:
            out["switch"], out["kept"] = str(err).splitlines()[0], err.job is not None
        out["failed_after_s"] = time.monotonic() - t0
        res = sw.recover(job, checkpoint=ck)
        out.update(rec._checked(tr, sw, res, ck))
        sw.close()
        return out

    return fn


def save_worker(base: dict, device: str, devices: list[str], victim: str, ckpt_dir: str,
                global_batch: int, timeout: float, collective: float):
    """A DistributedOptimizer job checkpoints iteration 1, trains iteration 2, and ``victim``
    dies (SIGKILL) as the checkpoint of iteration 2 is being saved: the other processes are
    inside megatron's ``dist_checkpointing.save``. The half-written checkpoint is refused by
    ``recover`` (exit status 2, the job kept) and the survivors roll back to iteration 1."""
    def fn(store) -> dict:
        from megatron.core import dist_checkpointing

        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             refill=rec.refill, train_state=train_state)
        ck1, ck2 = os.path.join(ckpt_dir, "it1"), os.path.join(ckpt_dir, "it2")
        tr.step(job)
        tr.save(job, ck1)
        tr.step(job)
        if device == victim:
            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            dist_checkpointing.save = die
        out: dict = {"released": None}
        try:
            tr.save(job, ck2)
        except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
            out["released"] = type(err).__name__
        try:
            sw.recover(job, checkpoint=ck2)
            out["partial"] = None
        except RecoveryFailed as err:
            out["partial"] = {"code": err.exit_code, "error": str(err), "same_job": err.job is job}
        res = sw.recover(job, checkpoint=ck1)
        out.update(rec._checked(tr, sw, res, ck1))
        sw.close()
        return out

    return fn


def notice_worker(base: dict, device: str, devices: list[str], leaving: list[str],
                  ckpt_dir: str, global_batch: int, timeout: float, collective: float):
    """A job gets a preemption notice for ``leaving`` (60 s ahead) after iteration 2: it
    prepares the switch to the suggested layout on the rest while it trains iteration 3, and
    switches at the boundary. A checkpoint of iteration 3, saved before the switch, is the
    test's oracle."""
    def fn(store) -> dict:
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective)
        tr.step(job)
        tr.step(job)
        notice = sw.notice(leaving, 60.0)
        tr.step(job)  # the plan is made meanwhile
        oracle = os.path.join(ckpt_dir, "oracle-it3")
        tr.save(job, oracle)
        res = sw.switch(job)
        out = {"fits": notice.fits(), "left_s": notice.seconds_left(), "dst": notice.dst_spec.name,
               "predicted": notice.predicted_seconds}
        if res.job is not None:
            out.update(rec._checked(tr, sw, res, oracle))
        out["role"] = res.role
        sw.close()
        return out

    return fn


def store_notice_worker(base: dict, device: str, devices: list[str], port: int,
                        global_batch: int, timeout: float, collective: float):
    """A job under ``LiveControl`` on a TCPStore the test hosts at ``port``: it trains and
    takes up the notices and requests a client posts there, until the client sets
    ``test-stop``. Returns the layouts it trained in, its iterations and its role."""
    def fn(_file_store) -> dict:
        import datetime

        import torch
        import torch.distributed as dist

        from dynatrain.runtime.megatron.control import LiveControl

        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective)
        ctl = LiveControl(sw)
        layouts = []
        while True:
            job = ctl.boundary(job)
            if job is None:  # this device left the job
                sw.close()
                return {"role": "left", "layouts": layouts}
            layouts.append(sw.spec.name)
            stop = torch.tensor([int(sw.leader and sw.rendezvous.has("test-stop"))])
            dist.broadcast(stop, src=0)
            if stop.item() or job.iteration >= 500:
                break
            tr.step(job)
            time.sleep(0.05)  # leave the cores to the client (a CPU machine is shared)
        sw.close()
        return {"role": "stayed", "layouts": layouts, "iteration": job.iteration,
                "devices": list(sw.layout.devices)}

    return fn


def buddy_worker(base: dict, device: str, devices: list[str], victims: list[tuple],
                 ckpt_dir: str, global_batch: int, timeout: float, collective: float,
                 plant: str | None = None):
    """A DistributedOptimizer job with one optimizer instance and buddy copies
    (``LiveSwitcher(buddy=True)``, ``snapshot`` after every step) loses, per entry of
    ``victims`` (devices, phase), those devices inside an iteration (``_die_in``'s phases or
    ``forward``, SIGKILLed; the same phase with ``_stop`` appended: SIGSTOPped there, a hang
    the group timeout releases) and recovers with no checkpoint. At every
    boundary a checkpoint is saved for the test's oracle only: each recovery is compared with
    the one of the iteration it restored. With ``plant``, that device's copy of its ward is
    made one step behind (the bytes of the step before, the tag of the newest) before the
    first failure: the recovered state must then differ from the oracle. Each survivor's
    result of each recovery is also written to ``<ckpt_dir>/<phase>-<device>.json``."""
    def fn(store) -> dict:
        from dynatrain.runtime.megatron.buddy import Generation

        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             buddy=True)
        saved: dict[int, str] = {}  # iteration -> the newest checkpoint of it
        count = [0]  # saves so far: the same path on every process

        def save(job) -> None:
            count[0] += 1
            path = os.path.join(ckpt_dir, f"ck{count[0]}-it{job.iteration}")
            tr.save(job, path)
            saved[job.iteration] = path

        out: dict = {"snapshot": []}
        for _ in range(2):
            tr.step(job)
            out["snapshot"].append(sw.snapshot(job))
            save(job)
        for n, (dying, phase) in enumerate(victims):
            if device == plant:
                sw._buddy.finish()  # the newest copy in hand
                old, new = sw._buddy.held[-2:]
                sw._buddy.held[-1] = Generation(new.iteration, new.step, None, old.flat,
                                                old.store)
            store.set(f"test/pid/{device}", str(os.getpid()))
            sig = signal.SIGSTOP if phase.endswith("_stop") else signal.SIGKILL
            if device in dying:
                if phase.startswith("forward"):
                    _fail_in_forward(job, sig)
                else:
                    _die_in(phase.removesuffix("_stop"), job, sig)
            try:
                tr.step(job)
                sw.snapshot(job)
                released = None
            except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
                released = type(err).__name__
            res = sw.recover(job)  # no checkpoint
            if sig == signal.SIGSTOP and res.job is not None and sw.layout.devices[0] == device:
                for d in dying:  # clean up the hang
                    os.kill(int(store.get(f"test/pid/{d}")), signal.SIGKILL)
            oracle = saved[res.recovery["iteration"]]
            out[phase] = rec._checked(tr, sw, res, oracle)  # trains one more iteration
            out[phase]["released"] = released
            # Kept on disk too: a survivor that a later phase kills returns no result.
            with open(os.path.join(ckpt_dir, f"{phase}-{device}.json"), "w") as f:
                json.dump(out[phase], f, default=list)
            job = res.job
            if job is None:
                break
            sw.snapshot(job)
            save(job)
        sw.close()
        return out

    return fn


def buddy_fallback_worker(base: dict, device: str, devices: list[str], victim: str,
                          in_recovery: str, ckpt_dir: str, global_batch: int, timeout: float,
                          collective: float):
    """A job with buddy copies loses ``victim`` (SIGKILL in a forward pass) and then, while the
    survivors recover from the copies, ``in_recovery`` (SIGKILL building the destination):
    the victim's buddy. The recovery fails (exit status 4, job kept); called again without a
    checkpoint it is refused with exit status 3 (the copies died with the buddy); with the
    checkpoint of the last finished iteration it refills from it."""
    def fn(store) -> dict:
        tr, job, sw = _start(store, base, device, devices, global_batch, timeout, collective,
                             dying_build=device == in_recovery, buddy=True, refill=rec.refill,
                             train_state=train_state)
        for _ in range(2):
            tr.step(job)
            sw.snapshot(job)
        ck = os.path.join(ckpt_dir, "it2")
        tr.save(job, ck)
        if device == victim:
            _fail_in_forward(job, signal.SIGKILL)
        out: dict = {"released": None}
        try:
            tr.step(job)
        except Exception as err:  # noqa: BLE001 — what a survivor sees of a dead peer
            out["released"] = type(err).__name__
        tries, res = [], None
        for checkpoint in (None, None, ck):
            try:
                res = sw.recover(job, checkpoint=checkpoint)
                break
            except RecoveryFailed as err:
                tries.append({"code": err.exit_code, "error": str(err),
                              "same_job": err.job is job})
        out["tries"] = tries
        if res is not None:
            out.update(rec._checked(tr, sw, res, ck))
        sw.close()
        return out

    return fn
