"""A same-devices switch's destination job built at a boundary before the switch
(``LiveSwitcher.build_ahead``, ``runtime.megatron.build_ahead``).

In four forked gloo workers a job with megatron's LR scheduler trains TP2 (layout A) and
prepares a switch to PP2 (B):

* a build ahead that fails on one process builds nothing anywhere: every process gets the
  reason, and megatron's parallel state (the very group objects), the RNG streams and the job
  are A's exactly as before;
* a build ahead that succeeds also leaves all of them as they were, and the job trains an
  iteration in A in between, with the losses of a fresh A job loaded from megatron's
  dist-checkpoint taken before the build;
* the switch then neither sets up parallel state nor builds (no such phases; the build's time
  is ``build_ahead``), and its job equals, bit for bit, a fresh B job loaded from megatron's
  dist-checkpoint of A taken at the switch, before and after one more iteration.

Without GPUs the memory check is exercised on its own (``no_room`` with a stated free figure).
"""

from __future__ import annotations

import os
import tempfile

import torch
from megatron.core import parallel_state as ps

from dynatrain.ir.layout import Layout
from dynatrain.ir.state import view_of
from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob
from dynatrain.runtime.megatron import build_ahead as ahead
from dynatrain.verify.check import check
from matrix import case, to_harness_cfg, to_spec
from megatron_support import live
from test_live_switcher import _scheduler

CFG_A = case("a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_B = case("b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=256)


def _rng() -> tuple:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return (torch.get_rng_state().clone(), id(tracker),
            {k: v.clone() for k, v in tracker.get_states().items()})


def _same_rng(a: tuple, b: tuple) -> bool:
    return (torch.equal(a[0], b[0]) and a[1] == b[1] and a[2].keys() == b[2].keys()
            and all(torch.equal(a[2][k], b[2][k]) for k in a[2]))


def test_destination_built_ahead_switches_bit_exact() -> None:
    spec_a, spec_b = to_spec(CFG_A), to_spec(CFG_B)
    configs = {id(spec_a): live.resolve(to_harness_cfg(CFG_A)),
               id(spec_b): live.resolve(to_harness_cfg(CFG_B))}
    devices = Layout(spec_a).devices

    with tempfile.TemporaryDirectory(prefix="build_ahead_ckpt_") as ckpt:
        for sub in ("before", "at_switch"):
            os.mkdir(f"{ckpt}/{sub}")

        def work(rank: int) -> dict:
            cfg_of: dict[int, dict] = {}
            builds = {"n": 0, "fail": False}

            def build(spec) -> MegatronJob:
                builds["n"] += 1
                c = configs[id(spec)]
                j = live.build(c, seed=c["seed"] + 7 * builds["n"])
                if builds["fail"]:
                    builds["fail"] = False
                    raise RuntimeError("injected build failure")
                cfg_of[id(j.optimizer)] = c
                return MegatronJob(j.ddps, j.optimizer, _scheduler(j.optimizer))

            def as_live(job: MegatronJob) -> live.Job:
                return live.Job(cfg_of[id(job.optimizer)],
                                [d.module.module for d in job.model_chunks],
                                job.model_chunks, job.optimizer)

            def train(job: MegatronJob) -> list[float]:
                losses = live.train_step(as_live(job), job.iteration)
                job.scheduler.step(increment=1)
                job.iteration += 1
                return losses

            def untouched(job, before_state, tp_group, rng) -> dict:
                return {"state": live.native_diffs(before_state, live.native_state(as_live(job))),
                        "tp_group": ps.get_tensor_model_parallel_group() is tp_group,
                        "pp": ps.get_pipeline_model_parallel_world_size(),
                        "rng": _same_rng(rng, _rng())}

            out: dict = {}
            live.init_parallel(configs[id(spec_a)])
            job = build(spec_a)
            train(job)
            sw = LiveSwitcher(spec_a, devices[rank], build, check, timeout=60)
            sw.prepare(spec_b).result()

            live.save_dist_checkpoint(as_live(job), f"{ckpt}/before")
            sched_before = job.scheduler.state_dict()
            tp_group, rng = ps.get_tensor_model_parallel_group(), _rng()
            before = live.native_state(as_live(job))
            builds["fail"] = rank == 1
            out["failed_why"] = sw.build_ahead()
            out["after_failure"] = untouched(job, before, tp_group, rng)

            out["why"] = sw.build_ahead(job)  # the exchange made ahead too, into the build
            out["after_build"] = untouched(job, before, tp_group, rng)
            out["again"] = sw.build_ahead()  # built already: nothing more

            # The job trains on in A beside the built destination: the same losses as a fresh
            # A job loaded from megatron's dist-checkpoint taken before the build ahead.
            twin = build(spec_a)
            live.load_dist_checkpoint(as_live(twin), f"{ckpt}/before")
            twin.scheduler.load_state_dict(sched_before)
            twin.iteration = job.iteration
            out["losses_beside"] = (train(job), train(twin))
            del twin

            live.save_dist_checkpoint(as_live(job), f"{ckpt}/at_switch")
            sched = job.scheduler.state_dict()
            result = sw.switch(job)
            new = result.job
            out["phases"] = sorted(result.phases())
            out["build_ahead_s"] = result.seconds.get("build_ahead")
            out["built_ahead"] = result.report.get("built_ahead")
            out["prepared"] = (result.report.get("prepared_ahead"),
                               result.report.get("prepared_why"))
            out["pp_after"] = ps.get_pipeline_model_parallel_world_size()

            ref = build(spec_b)
            live.load_dist_checkpoint(as_live(ref), f"{ckpt}/at_switch")
            ref.scheduler.load_state_dict(sched)
            ref.iteration = job.iteration
            out["pre"] = live.native_diffs(live.native_state(as_live(ref)),
                                           live.native_state(as_live(new)))
            out["losses"] = (train(new), train(ref))
            out["post"] = live.native_diffs(live.native_state(as_live(ref)),
                                            live.native_state(as_live(new)))
            return out

        results = live.run_workers(work, len(devices), timeout=300)

    for rank, r in enumerate(results):
        why = r["failed_why"]
        assert why and why.startswith("building ahead failed on "), why
        assert ("injected build failure" in why) == (rank == 1), why
        for when in ("after_failure", "after_build"):
            u = r[when]
            assert u["state"] == [] and u["tp_group"] and u["pp"] == 1 and u["rng"], (when, u)
        assert r["why"] is None and r["again"] is None
        assert r["losses_beside"][0] == r["losses_beside"][1]
        assert r["built_ahead"] is True and r["build_ahead_s"] > 0
        # Made before the job trained on beside the build: the switch read the state as it
        # was at the switch (equal to the reload below), through the views made ahead.
        assert tuple(r["prepared"]) == (True, None), r["prepared"]
        assert "build" not in r["phases"] and "parallel_state" not in r["phases"], r["phases"]
        assert "exchange" in r["phases"] and "install" in r["phases"]
        assert r["pp_after"] == 2
        assert r["pre"] == [], f"rank {rank}: {r['pre'][:5]}"
        assert r["losses"][0] == r["losses"][1]
        assert r["post"] == [], f"rank {rank}: {r['post'][:5]}"
    assert any(r["losses"][0] for r in results), "no rank saw a loss"


def test_no_room_beside_the_job(monkeypatch) -> None:
    """On a GPU the destination is built ahead only if its state and the job's reserve fit
    in what is free; the CPU is not checked."""
    layout = Layout(to_spec(CFG_B))
    view = view_of(layout)
    need = ahead.state_bytes(view, 0)
    assert need > 0
    assert ahead.no_room(view, 0, "node0:gpu0", None, 0) is None  # the CPU: unchecked
    monkeypatch.setattr(ahead, "free_bytes", lambda dev: need + 100)
    assert ahead.no_room(view, 0, "node0:gpu0", 0, 100) is None
    why = ahead.no_room(view, 0, "node0:gpu0", 0, 101)
    assert why and why.startswith("node0:gpu0: the destination state (") and \
        "built at the switch" in why, why


def test_reserve_defaults_to_the_allocators_peak(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 7 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 3 << 20)
    assert ahead.job_reserve(0) == 4 << 20
    assert ahead.job_reserve(None) is None
    monkeypatch.setattr(ahead, "free_bytes", lambda dev: 10 << 30)
    layout = Layout(to_spec(CFG_B))
    assert ahead.no_room(view_of(layout), 0, "node0:gpu0", 0, None) is None
