"""All or nothing after the exchange: whatever fails once the bytes moved (installing the step,
the carried LR scheduler state) fails the switch on every process, and every process trains on
in the source layout — megatron's parallel state and what ``build`` changed outside the job
(``global_state``: here a dict standing for Megatron-LM's args and micro-batch calculator)
included.

In forked gloo workers (``megatron_support.live``), a TP2 job on 2 processes prepares a switch
to PP2. Three failures are injected on rank 1 only, each after the exchange:

* the destination scheduler refuses the carried state (as megatron's
  ``OptimizerParamScheduler`` does for a state it does not accept);
* the Adam step cannot be installed;
* both processes switch for real at the end: the switch must then commit, with the global state
  of the destination.

After each failure: ``SwitchFailed`` on both processes with the very job passed, TP back to 2,
the job's state bit for bit unchanged, the global state restored to what it was before the
switch, and an iteration still trains.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dynatrain.ir.layout import Layout
from dynatrain.runtime.megatron import LiveSwitcher, MegatronJob, SwitchFailed
from dynatrain.runtime.megatron import live as live_module
from dynatrain.verify.check import check
from matrix import case, to_harness_cfg, to_spec
from megatron_support import live

CFG_A = case("a", 2, tp=2, num_query_groups=2, swiglu=True, vocab_size=256)
CFG_B = case("b", 2, pp=2, num_query_groups=2, swiglu=True, vocab_size=256)


class _Refusing(OptimizerParamScheduler):
    def load_state_dict(self, state_dict):  # noqa: D401 — megatron's signature
        raise ValueError("injected: the scheduler refuses the carried state")


class _Globals:
    """Stands for Megatron-LM's global state: ``build`` writes the layout it built into it."""

    def __init__(self) -> None:
        self.values = {"tp": 2, "pp": 1, "micro_batches": 4}

    def save(self) -> dict:
        return dict(self.values)

    def restore(self, saved: dict) -> None:
        self.values.clear()
        self.values.update(saved)


def test_failures_after_the_exchange_leave_every_process_in_the_source_layout() -> None:
    spec_a, spec_b = to_spec(CFG_A), to_spec(CFG_B)
    configs = {id(spec_a): live.resolve(to_harness_cfg(CFG_A)),
               id(spec_b): live.resolve(to_harness_cfg(CFG_B))}
    devices = Layout(spec_a).devices

    def work(rank: int) -> dict:
        inject = {"what": None}
        cfg_of: dict[int, dict] = {}
        glob = _Globals()

        def build(spec) -> MegatronJob:
            c = configs[id(spec)]
            j = live.build(c, seed=c["seed"])
            cfg_of[id(j.optimizer)] = c
            glob.values.update(tp=spec.parallel.tp, pp=spec.parallel.pp,
                               micro_batches=8 if spec is spec_b else 4)
            cls = _Refusing if inject["what"] == "scheduler" and rank == 1 else \
                OptimizerParamScheduler
            sched = cls(j.optimizer, init_lr=0.0, max_lr=live.LR, min_lr=live.LR / 10,
                        lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine",
                        start_wd=0.01, end_wd=0.05, wd_incr_steps=10, wd_incr_style="linear")
            return MegatronJob(j.ddps, j.optimizer, sched)

        def as_live(job):
            return live.Job(cfg_of[id(job.optimizer)], [d.module.module for d in
                                                        job.model_chunks],
                            job.model_chunks, job.optimizer)

        def train(job):
            losses = live.train_step(as_live(job), job.iteration)
            job.scheduler.step(increment=1)
            job.iteration += 1
            return losses

        real_install = live_module.install_step

        def failing_install(optimizer, dst):
            if inject["what"] == "install" and rank == 1:
                raise RuntimeError("injected: the Adam step cannot be installed")
            return real_install(optimizer, dst)

        live_module.install_step = failing_install
        out: dict = {"failures": []}
        live.init_parallel(configs[id(spec_a)])
        job = build(spec_a)
        train(job)
        sw = LiveSwitcher(spec_a, devices[rank], build, check, timeout=60, global_state=glob)
        for what in ("scheduler", "install"):
            inject["what"] = what
            sw.prepare(spec_b).result()
            before = live.native_state(as_live(job))
            glob_before = dict(glob.values)
            try:
                sw.switch(job)
                out["failures"].append((what, None))
            except SwitchFailed as e:
                assert e.job is job
                out["failures"].append((
                    what, str(e), ps.get_tensor_model_parallel_world_size(),
                    ps.get_pipeline_model_parallel_world_size(),
                    live.native_diffs(before, live.native_state(as_live(job))),
                    glob.values == glob_before, sw.spec is spec_a))
            train(job)  # the job trains on in the source layout
        inject["what"] = None
        sw.prepare(spec_b).result()
        result = sw.switch(job)
        out["committed"] = (result.role, ps.get_pipeline_model_parallel_world_size(),
                            dict(glob.values), result.job.iteration)
        train(result.job)
        return out

    results = live.run_workers(work, len(devices))
    for rank, res in enumerate(results):
        for what, *failure in res["failures"]:
            assert failure and failure[0] is not None, f"rank {rank}: {what} did not fail"
            line, tp, pp, diffs, glob_restored, same_spec = failure
            assert "back in the source layout, the job trains on" in line, line
            assert ("this process" in line) == (rank == 1), line
            assert "injected" in line if rank == 1 else "another process" in line
            assert (tp, pp) == (2, 1) and diffs == [] and glob_restored and same_spec
        assert res["committed"] == ("stayed", 2, {"tp": 1, "pp": 2, "micro_batches": 8}, 3)
