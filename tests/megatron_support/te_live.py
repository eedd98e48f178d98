"""A live switch (``LiveSwitcher``) of a Transformer Engine job, checked against megatron's reload.

``te_live_batch`` takes switches, each two ``te_cases`` entries (same model, same devices), and
runs, in one child interpreter that puts the TE stand-in (``tests/te_standin``) on ``sys.path``
before megatron is imported (as ``megatron_support.te`` does, so the test process keeps seeing
"TE not installed"), ``world`` forked gloo workers (``megatron_support.live``) that each:

* build the TE job in layout A (megatron-core's TE spec; GPU-style initialisation, see
  ``te._main``) with megatron's LR scheduler and train two real iterations;
* ``prepare`` A -> B with a ``LiveSwitcher`` (plan + verify in the background) while iteration
  2 trains, save megatron's dist-checkpoint of A (model incl. TE's ``_extra_state`` objects,
  ``fully_reshardable`` optimizer state) and ``switch``;
* build a fresh B job and load that checkpoint into it the way Megatron-LM does
  (``live.load_dist_checkpoint``; ``_extra_state`` goes through megatron's own load and
  ``load_state_dict``, as in a real reload), with A's scheduler state;
* compare both B jobs through megatron's own accessors (``live.native_state``: module state
  dicts, ``_extra_state`` included, DDP param buffers, DistributedOptimizer state, step; plus
  every param group's lr / weight decay), then train one more iteration on each and compare
  losses and state again.

Each rank's result is a JSON-able dict (see ``_work``); the child writes the list as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback

from .te import STANDIN, run_child

__all__ = ["te_live_batch"]


def te_live_batch(jobs: dict[str, dict], timeout: float = 300.0) -> dict[str, list[dict] | str]:
    """Switches ``{"a": cfg_a, "b": cfg_b}`` (``"rollback": True``: ``_rollback``'s switch
    instead) run in one child interpreter, one after another: each one's per-rank results, or
    the traceback that ended it (a string). One child for all: on Python 3.12 an interpreter
    importing torch's CUDA build and megatron costs about 14 CPU-seconds before it does
    anything."""
    return run_child("megatron_support.te_live", jobs, timeout * max(1, len(jobs)),
                     "TE live switches")


def _one(req: dict) -> list[dict]:
    return (_rollback if req.get("rollback") else _run)(req["a"], req["b"])


def _rollback(cfg_a: dict, cfg_b: dict) -> list[dict]:
    """Train A two iterations, ask for B with a destination build that raises on rank 0 (every
    process then goes back to A, with new process groups), then train A on: with fp8 delayed
    scaling TE's global amax reductions must run over the new groups."""
    from te_cases import to_te_spec

    from dynatrain.ir.layout import Layout
    from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob, SwitchFailed
    from dynatrain.verify.check import check
    from megatron_support import live

    spec_a, spec_b = to_te_spec(cfg_a), to_te_spec(cfg_b)
    c_a = live.resolve(_harness_cfg(cfg_a))
    devices = Layout(spec_a).devices

    def work(rank: int) -> dict:
        jobs: dict[int, live.Job] = {}

        def build(spec) -> MegatronJob:
            if spec.name != spec_a.name:  # the destination: fails on rank 0, not built here
                if rank == 0:
                    raise RuntimeError("injected: the destination build fails on rank 0")
                return MegatronJob([], None, None)
            j = live.build(c_a, seed=c_a["seed"])
            jobs[id(j.optimizer)] = j
            return MegatronJob(j.ddps, j.optimizer, None)

        live.init_parallel(c_a)
        job = build(spec_a)
        lj = jobs[id(job.optimizer)]
        for it in range(2):
            live.train_step(lj, it)
        job.iteration = 2
        sw = LiveSwitcher(spec_a, devices[rank], build, check, timeout=60)
        sw.prepare(spec_b).result()
        try:
            sw.switch(job)
            failed = ""
        except SwitchFailed as err:
            failed = str(err)
        scales = _fp8_scales(lj)
        losses = live.train_step(lj, 2)
        return {"failed": failed, "losses": losses,
                "scales_moved": _fp8_scales(lj) != scales, "fp8_modules": _fp8_ran(lj),
                **_fp8_registrations([lj])}

    return live.run_workers(work, len(devices), timeout=240)


def _fp8_registrations(jobs: list) -> dict:
    """TE's global delayed-scaling registrations against the jobs that train now: keys naming
    another amax-reduction group than megatron's current one (stale), and registered modules
    against the jobs' delayed-scaling modules."""
    from megatron.core import parallel_state as ps
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    from dynatrain.runtime.megatron.te_fp8 import has_delayed_state

    group = ps.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=False)
    buffers = FP8GlobalStateManager.quantization_state.global_amax_buffer
    return {"stale_keys": [k for k in buffers if f"group={id(group)}" not in k],
            "registered": sum(len(v) for k, v in buffers.items() if k.startswith("forward_")),
            "delayed_modules": sum(has_delayed_state(m) for j in jobs for g in j.gpts
                                   for m in g.modules())}


def _fp8_scales(job) -> list:
    from dynatrain.runtime.megatron.te_fp8 import has_delayed_state

    return [m.fp8_meta["scaling_fwd"].scale.tolist() for g in job.gpts for m in g.modules()
            if has_delayed_state(m)]


def _harness_cfg(cfg: dict) -> dict:
    from matrix import to_harness_cfg

    c = to_harness_cfg(cfg)
    # GPU-style initialisation, as te._main builds TE jobs (the shim maps cuda to cpu).
    c["transformer_config_overrides"] = {"use_cpu_initialization": False,
                                         **(c.get("transformer_config_overrides") or {})}
    return dict(c, transformer_impl="transformer_engine")


def _run(cfg_a: dict, cfg_b: dict) -> list[dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from te_cases import to_te_spec

    from dynatrain.ir.layout import Layout
    from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob
    from dynatrain.verify.check import check
    from megatron_support import live

    spec_a, spec_b = to_te_spec(cfg_a), to_te_spec(cfg_b)
    configs = {id(spec_a): live.resolve(_harness_cfg(cfg_a)),
               id(spec_b): live.resolve(_harness_cfg(cfg_b))}
    devices = Layout(spec_a).devices

    def scheduler(optimizer) -> OptimizerParamScheduler:
        return OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=live.LR, min_lr=live.LR / 10, lr_warmup_steps=2,
            lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.01, end_wd=0.05,
            wd_incr_steps=10, wd_incr_style="linear")

    with tempfile.TemporaryDirectory(prefix="te_live_ckpt_") as ckpt:

        def work(rank: int) -> dict:
            cfg_of: dict[int, dict] = {}
            builds = {"n": 0}

            def build(spec) -> MegatronJob:
                builds["n"] += 1  # every build starts from other weights than the last
                c = configs[id(spec)]
                j = live.build(c, seed=c["seed"] + 7 * builds["n"])
                cfg_of[id(j.optimizer)] = c
                return MegatronJob(j.ddps, j.optimizer, scheduler(j.optimizer))

            def as_live(job: MegatronJob) -> live.Job:
                return live.Job(cfg_of[id(job.optimizer)],
                                [d.module.module for d in job.model_chunks],
                                job.model_chunks, job.optimizer)

            def train(job: MegatronJob) -> list[float]:
                losses = live.train_step(as_live(job), job.iteration)
                job.scheduler.step(increment=1)
                job.iteration += 1
                return losses

            def state(job: MegatronJob) -> dict:
                out = live.native_state(as_live(job))
                for i, opt in enumerate(getattr(job.optimizer, "chained_optimizers", None)
                                        or [job.optimizer]):
                    for g, group in enumerate(opt.param_groups):
                        out[f"opt{i}.group{g}.lr_wd"] = (group["lr"], group["weight_decay"])
                return out

            out: dict = {}
            live.init_parallel(configs[id(spec_a)])
            job = build(spec_a)
            out["te_modules_a"] = _te_module_count(as_live(job))
            out["adam"] = _adam_classes(job.optimizer)
            out["master_weights"] = any(
                getattr(o.optimizer, "master_weights", False)
                for o in getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer])
            for _ in range(2):
                train(job)
            sw = LiveSwitcher(spec_a, devices[rank], build, check, timeout=60)
            future = sw.prepare(spec_b)
            out["losses_during_prepare"] = train(job)  # iteration 2 trains while planning
            future.result()

            live.save_dist_checkpoint(as_live(job), ckpt)
            sched = job.scheduler.state_dict()
            result = sw.switch(job)
            new = result.job
            out["iteration"] = [job.iteration, new.iteration]
            out["pp_after"] = ps.get_pipeline_model_parallel_world_size()
            out["tp_after"] = ps.get_tensor_model_parallel_world_size()
            out["ep_after"] = ps.get_expert_model_parallel_world_size()
            out["te_modules_b"] = _te_module_count(as_live(new))
            out["fp8_scaled_modules"] = _fp8_scaled(as_live(new))
            out["fp8_ran_modules"] = _fp8_ran(as_live(job))
            out["seconds"] = {k: float(v) for k, v in result.seconds.items()}

            ref = build(spec_b)
            out["reload_missing"] = live.load_dist_checkpoint(as_live(ref), ckpt,
                                                              missing_extra_state=True)
            ref.scheduler.load_state_dict(sched)
            ref.iteration = job.iteration
            s_ref, s_new = state(ref), state(new)
            out["n_state"] = len(s_ref)
            out["n_extra_state"] = sum(k.endswith("_extra_state") for k in s_ref)
            out["pre"] = live.native_diffs(s_ref, s_new)
            out["losses"] = [train(new), train(ref)]
            out["post"] = live.native_diffs(state(ref), state(new))
            if "fp8" in cfg_a:
                out.update(_fp8_registrations([as_live(new), as_live(ref)]))
            return out

        return live.run_workers(work, len(devices), timeout=240)


def _adam_classes(optimizer) -> list[str]:
    """The inner optimizers' classes: megatron-core takes TE's FusedAdam whenever TE imports
    (M16 optimizer/__init__.py:12-34), here the stand-in's."""
    leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return sorted({f"{type(o.optimizer).__module__}.{type(o.optimizer).__name__}"
                   for o in leaves})


def _fp8_ran(job) -> int:
    """TE modules of this rank (the source job) that ran an fp8 forward (a recipe recorded)."""
    return sum("recipe" in getattr(m, "fp8_meta", {}) for g in job.gpts for m in g.modules())


def _fp8_scaled(job) -> int:
    """TE modules of this rank whose delayed-scaling scales left their initial 1.0."""
    from dynatrain.runtime.megatron.te_fp8 import has_delayed_state

    return sum(has_delayed_state(m) and bool((m.fp8_meta["scaling_fwd"].scale != 1).any())
               for g in job.gpts for m in g.modules())


def _te_module_count(job) -> int:
    """TE modules (the stand-in's) in this rank's chunks: the job is really a TE build."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    return sum(isinstance(m, TransformerEngineBaseModule) for g in job.gpts for m in g.modules())


def _main(src: str, dst: str) -> None:
    if sys.path[0] != STANDIN:
        sys.path.insert(0, STANDIN)
    import transformer_engine  # noqa: F401  (the stand-in, before megatron)

    with open(src) as f:
        req = json.load(f)
    results: dict[str, list | str] = {}
    for key, job in req.items():
        try:
            results[key] = _one(job)
        except Exception:  # noqa: BLE001 — that test reports it; the others still run
            results[key] = traceback.format_exc()
    with open(dst, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
