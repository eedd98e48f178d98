"""LiveSwitcher on a real megatron-core job: prepare while training, switch, keep training.

In forked gloo workers (``megatron_support.live``) a job with megatron's LR scheduler trains in
layout A. On every process a ``LiveSwitcher``:

* refuses a destination that is another model: ``prepare`` fails in the background and
  ``switch`` raises ``SwitchFailed`` (caused by the planner's error) on every process, whose
  ``job`` is the very job passed, untouched;
* plans and verifies A -> B in the background while iteration 2 trains;
* survives a destination build that fails on one process: the switch raises ``SwitchFailed``
  with the same job on every process (none commits alone), megatron's parallel state is A's
  again and the job (bit for bit unchanged) trains on in A;
* then switches: the destination job must equal, bit for bit (megatron's own view of model,
  DDP buffers and optimizer, plus every param group's lr and weight decay), a fresh B job loaded
  from megatron's dist-checkpoint of A with A's scheduler state, and a further iteration must
  give both the same losses and state. The iteration count is carried over.
"""

from __future__ import annotations

import tempfile

from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dynatrain.ir.layout import Layout
from dynatrain.planner.intersect import PlanError
from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob, SwitchFailed
from dynatrain.verify.check import check
from matrix import case, to_harness_cfg, to_spec
from megatron_support import live

CFG_A = case("a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_B = case("b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_OTHER_MODEL = case("other", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=256,
                       hidden_size=128)


def _scheduler(optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=live.LR, min_lr=live.LR / 10, lr_warmup_steps=2,
        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.01, end_wd=0.05,
        wd_incr_steps=10, wd_incr_style="linear")


def test_live_switcher_prepares_switches_and_rolls_back() -> None:
    spec_a, spec_b, spec_other = to_spec(CFG_A), to_spec(CFG_B), to_spec(CFG_OTHER_MODEL)
    configs = {id(spec_a): live.resolve(to_harness_cfg(CFG_A)),
               id(spec_b): live.resolve(to_harness_cfg(CFG_B))}
    devices = Layout(spec_a).devices

    with tempfile.TemporaryDirectory(prefix="live_switcher_ckpt_") as ckpt:

        def work(rank: int) -> dict:
            cfg_of: dict[int, dict] = {}
            builds = {"n": 0, "fail_next_b": False}

            def build(spec) -> MegatronJob:
                builds["n"] += 1
                c = configs[id(spec)]
                j = live.build(c, seed=c["seed"] + 7 * builds["n"])
                if spec is spec_b and builds["fail_next_b"]:
                    # After megatron's collective setup, so that the other processes finish
                    # building (as after an out-of-memory error in the last allocation).
                    builds["fail_next_b"] = False
                    raise RuntimeError("injected build failure")
                cfg_of[id(j.optimizer)] = c
                return MegatronJob(j.ddps, j.optimizer, _scheduler(j.optimizer))

            def as_live(job: MegatronJob) -> live.Job:
                return live.Job(cfg_of[id(job.optimizer)], [d.module.module for d in
                                                            job.model_chunks],
                                job.model_chunks, job.optimizer)

            def train(job: MegatronJob) -> list[float]:
                losses = live.train_step(as_live(job), job.iteration)
                job.scheduler.step(increment=1)
                job.iteration += 1
                return losses

            def state(job: MegatronJob) -> dict:
                out = live.native_state(as_live(job))
                opts = getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]
                for i, opt in enumerate(opts):
                    for g, group in enumerate(opt.param_groups):
                        out[f"opt{i}.group{g}.lr_wd"] = (group["lr"], group["weight_decay"])
                return out

            out: dict = {}
            live.init_parallel(configs[id(spec_a)])
            job = build(spec_a)
            for _ in range(2):
                train(job)
            sw = LiveSwitcher(spec_a, devices[rank], build, check, timeout=60,
                              check_transfers=True)

            sw.prepare(spec_other)  # another model: the planner refuses it
            before = state(job)
            try:
                sw.switch(job)
                out["other_model"] = None
            except SwitchFailed as e:
                assert isinstance(e.__cause__, PlanError) and e.job is job
                out["other_model"] = str(e.__cause__)
            out["other_model_untouched"] = live.native_diffs(before, state(job))

            future = sw.prepare(spec_b)
            out["losses_during_prepare"] = train(job)  # iteration 2 trains while planning
            future.result()
            out["ready"] = sw.ready()

            builds["fail_next_b"] = rank == 1  # one process fails, every process must stay
            before = state(job)
            try:
                sw.switch(job)
                out["build_failure"] = None
            except SwitchFailed as e:
                assert e.job is job
                out["build_failure"] = str(e)
            out["rolled_back_tp"] = ps.get_tensor_model_parallel_world_size()
            out["rolled_back_diffs"] = live.native_diffs(before, state(job))
            train(job)  # iteration 3, still in A

            live.save_dist_checkpoint(as_live(job), ckpt)
            sched = job.scheduler.state_dict()
            result = sw.switch(job)
            new = result.job
            out["iteration"] = (job.iteration, new.iteration)
            out["pp_after"] = ps.get_pipeline_model_parallel_world_size()
            out["seconds"] = result.seconds

            ref = build(spec_b)
            live.load_dist_checkpoint(as_live(ref), ckpt)
            ref.scheduler.load_state_dict(sched)
            ref.iteration = job.iteration
            out["pre"] = live.native_diffs(state(ref), state(new))
            out["lr"] = [g["lr"] for g in new.optimizer.param_groups]
            out["losses"] = (train(new), train(ref))
            out["post"] = live.native_diffs(state(ref), state(new))
            return out

        results = live.run_workers(work, len(devices))

    for rank, res in enumerate(results):
        assert res["other_model"] and "same model" in res["other_model"], res["other_model"]
        assert res["other_model_untouched"] == []
        failed = res["build_failure"]
        assert failed and "back in the source layout, nothing moved" in failed, failed
        assert ("this process: RuntimeError: injected build failure" in failed) == (rank == 1)
        assert res["rolled_back_tp"] == 2 and res["rolled_back_diffs"] == []
        assert res["iteration"] == (4, 4)
        assert res["pp_after"] == 2
        assert res["pre"] == [], f"rank {rank}: {res['pre'][:5]}"
        assert res["losses"][0] == res["losses"][1]
        assert res["post"] == [], f"rank {rank}: {res['post'][:5]}"
        # The scheduler moved on (warmup then cosine): not the optimizer's initial lr.
        assert all(lr != live.LR and lr > 0 for lr in res["lr"]), res["lr"]
        assert set(res["seconds"]) >= {"exchange", "install", "plan", "verify"}
    assert any(res["losses"][0] for res in results), "no rank saw a loss"
    # A (pp 1) kept training while the switch was prepared: every rank saw its loss.
    assert all(r["losses_during_prepare"] and r["ready"] for r in results)
