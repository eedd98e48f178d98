"""Test support for live recovery: a megatron job in forked processes loses one to SIGKILL
right after its dist checkpoint, and the survivors ``recover``.

``refill`` wires ``LiveSwitcher(refill=...)`` to DynaTrain's checkpoint reader (the runtime
does not import it): it plans reading just the lost ranges (``plan_load(..., only=lost)``:
metadata only, so a bad checkpoint is refused before anything moves) and reports the
checkpoint's Adam step; the returned function writes them into the rank's storage and records
the bytes it wrote in ``WRITTEN``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import torch
import torch.distributed as dist

from dynatrain.checkpoint import LoadStats, load_planned, open_checkpoint, plan_load
from dynatrain.checkpoint.load import read_step
from dynatrain.ir.layout import Layout
from dynatrain.runtime.megatron import LiveSwitcher, RecoveryFailed, Rendezvous
from dynatrain.verify.check import check
from dynatrain.ir.loader import spec_from_dict
from matrix import to_harness_cfg, to_spec, to_spec_dict

from . import elastic, live

WRITTEN: list[int] = []  # bytes each refill of this process wrote


def refill(ckpt: str, layout, rank: int, lost):
    """``LiveSwitcher``'s ``refill``: (the checkpoint's Adam step, write the lost ranges)."""
    c = open_checkpoint(ckpt)
    load = plan_load(c, layout, [rank], only=lost)

    def write(store: dict) -> None:
        stats = LoadStats()
        load_planned(load, stores={rank: store}, stats=stats)
        WRITTEN.append(stats.bytes_written)

    return read_step(c), write


def config_of(base: dict, spec) -> dict:
    """The harness config of ``spec``'s layout of ``base``'s model (e.g. a suggested one)."""
    p = spec.parallel
    cfg = dict(base, name=spec.name, world=len(Layout(spec).devices), tp=p.tp, pp=p.pp,
               vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp,
               num_distributed_optimizer_instances=p.num_distributed_optimizer_instances)
    return elastic.megatron_lm_config(to_harness_cfg(cfg))


def truncated_copy(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` whose largest chunk file lost its second half."""
    shutil.copytree(src, dst)
    files = [os.path.join(dst, f) for f in os.listdir(dst) if f.endswith(".distcp")]
    big = max(files, key=os.path.getsize)
    os.truncate(big, os.path.getsize(big) // 2)
    return dst


def spec_on(base: dict, name: str, devices: list[str], **parallel):
    """``base``'s model in layout ``parallel`` on exactly ``devices``."""
    doc = to_spec_dict(dict(base, name=name, world=len(devices), **parallel))
    doc["world"] = {"devices": list(devices)}
    return spec_from_dict(doc)


def worker(base: dict, device: str, devices: list[str], victims: tuple[str, str],
           last: list[str], ckpt_dir: str, global_batch: int, timeout: float):
    """A process of the job. It trains 2 steps (a checkpoint after each), then ``victims[0]``
    kills itself; the survivors notice it through heartbeats, try three bad checkpoints (each
    refused, job untouched), then recover from the right one, detecting who died and taking
    the suggested layout; they compare with megatron's reload of it and train a step (saved).
    Then ``victims[1]`` kills itself and the survivors recover, told who died and where to go
    (TP1 on ``last``: the others leave). ``victims[1]`` saves what it saw before it dies,
    as ``<ckpt_dir>/<device>.pt``."""
    spec_a = to_spec(base)
    spec_last = spec_on(base, "last", last, tp=1)

    def fn(store) -> dict:
        rdzv = Rendezvous(store, "gloo", prefix="job", timeout=timeout)
        tr = elastic.Trainer({spec_a.name: elastic.megatron_lm_config(to_harness_cfg(base))},
                             global_batch)

        def build(spec):
            tr.configs.setdefault(spec.name, config_of(base, spec))
            return tr.build(spec)

        rdzv.form("start", devices, device)
        live.init_parallel(tr.configs[spec_a.name])
        job = tr.build(spec_a)
        sw = LiveSwitcher(spec_a, device, build, check, rendezvous=rdzv, timeout=timeout,
                          heartbeat=0.1, stale_after=1.5, refill=refill, check_transfers=True,
                          init_kwargs=dict(create_gloo_process_groups=False))
        old, ck = os.path.join(ckpt_dir, "step1"), os.path.join(ckpt_dir, "step2")
        tr.step(job)
        tr.save(job, old)
        tr.step(job)
        tr.save(job, ck)
        if dist.get_rank() == 0:
            truncated_copy(ck, os.path.join(ckpt_dir, "truncated"))
        dist.barrier()
        if device == victims[0]:
            os.kill(os.getpid(), signal.SIGKILL)  # no warning, no cleanup
        before = tr.state(job)
        t0 = time.monotonic()
        while not (gone := sw.unresponsive()):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("the heartbeat never named the dead process")
            time.sleep(0.05)
        out: dict = {"noticed": gone, "notice_seconds": time.monotonic() - t0, "refused": []}
        for bad in ("missing", "truncated", "step1"):
            try:
                sw.recover(job, checkpoint=os.path.join(ckpt_dir, bad))
                out["refused"].append({"what": bad, "error": None})
            except RecoveryFailed as e:
                out["refused"].append({"what": bad, "error": str(e), "code": e.exit_code,
                                       "same_job": e.job is job,
                                       "diffs": live.native_diffs(before, tr.state(job))})
        res = sw.recover(job, checkpoint=ck)
        out["first"] = _checked(tr, sw, res, ck)
        job = res.job
        ck3 = os.path.join(ckpt_dir, "step3")
        tr.save(job, ck3)  # after the step _checked trained
        if device == victims[1]:
            torch.save(out, os.path.join(ckpt_dir, f"{device}.pt"))  # what it saw so far
            os.kill(os.getpid(), signal.SIGKILL)
        res = sw.recover(job, failed=[victims[1]], dst_spec=spec_last, checkpoint=ck3)
        out["second"] = _checked(tr, sw, res, ck3)
        sw.close()
        return out

    return fn


def _checked(tr, sw: LiveSwitcher, res, ck: str) -> dict:
    """A recovered job against a fresh job of its layout loaded by megatron from ``ck``; then
    one more iteration on both."""
    out = dict(role=res.role, recovery=res.recovery, seconds=res.seconds,
               written=list(WRITTEN), spec=sw.spec.name if sw.spec else None)
    WRITTEN.clear()
    if res.job is None:
        return out
    ref = tr.reference(sw.spec, ck)
    out["n_state"] = len(tr.state(ref))
    out["pre"] = live.native_diffs(tr.state(ref), tr.state(res.job))
    out["micro_batches"] = tr.micro_batches()
    out["losses"] = (tr.step(res.job), tr.step(ref))
    out["post"] = live.native_diffs(tr.state(ref), tr.state(res.job))
    return out
