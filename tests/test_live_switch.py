"""A layout switch of a real megatron-core job, checked against megatron's own dist-checkpoint.

Each case runs in one set of forked gloo processes (``megatron_support.live``), the way a live
switch will: build layout A, train two real steps, ``extract_state``; save A with megatron's
``dist_checkpointing`` (fully_reshardable optimizer state) as the reference; run the verified
plan A -> B with ``executor.switch`` across the processes; tear megatron's parallel state down
and set up B in the same processes; build a fresh B job and ``install_state`` the switched
storage; build a second fresh B job and load the checkpoint into it through megatron. The two B
jobs must hold the same state bit for bit (megatron's own view: module state dicts, DDP param
buffers, optimizer state, step), and one more training step must give both the same losses
and the same state again.

Both cases pad the vocabulary (250 -> 256, 200 -> 208) to the same size in A and B: Megatron
trains the padding rows (their logits enter the softmax), and the switch must carry them as the
checkpoint reload does.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from dynatrain.ir.layout import Layout
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime.executor import process_devices, switch
from dynatrain.runtime.megatron import extract_state, install_state
from dynatrain.runtime.megatron.bridge import bind_state, install_step
from dynatrain.verify.check import check
from matrix import MOE, case, to_harness_cfg, to_spec
from megatron_support import live

SWITCHES = {
    "tp2-dp2->pp2-dp2-tied": (
        case("a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=250),
        case("b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=250)),
    "moe-ep2-edp2->ep4-pp1": (
        case("a", 4, ep=2, swiglu=True, vocab_size=200, **live.EXPERT_BIAS, **MOE),
        case("b", 4, ep=4, swiglu=True, vocab_size=200, **live.EXPERT_BIAS, **MOE)),
}


# The install path is the same code for dense and MoE state (the MoE bind case covers the
# expert state), and install_state itself is checked bit-exact against megatron on every bridge
# case (test_megatron_bridge's round trips): switches into the executor's own storage then
# install run in the deep profile only, to keep the default suite short; the default profile
# switches straight into the B job (bind), as LiveSwitcher does. The dense bind case is deep
# too: test_te_live runs the very same switch (padded vocabulary, tied embedding split across
# stages, DP2) by default with TE layers, and test_live_switcher a dense local-layer job.
def _marks(name: str, into: str) -> list:
    return [pytest.mark.slow] if into == "install" or not name.startswith("moe") else []


CASES = [pytest.param(name, into, id=f"{name}-{into}", marks=_marks(name, into))
         for name in SWITCHES for into in ("install", "bind")]


@pytest.mark.parametrize("name,into", CASES)
def test_switched_job_equals_megatron_checkpoint_reload(name: str, into: str) -> None:
    # into="install": switch into the executor's own storage, then install_state into a fresh
    # B job. into="bind": build the B job first and switch straight into its tensors
    # (bind_state, then install_step), as LiveSwitcher does.
    cfg_a, cfg_b = SWITCHES[name]
    la, lb = Layout(to_spec(cfg_a)), Layout(to_spec(cfg_b))
    va, vb = transition_views(la, lb)
    assert va.vocab_rows > la.model.vocab_size  # padding rows are carried
    plan = plan_transition(la, lb, 1 << 30)
    check(plan, la, lb)
    devices = process_devices(plan)
    assert devices == la.devices == lb.devices
    ca, cb = live.resolve(to_harness_cfg(cfg_a)), live.resolve(to_harness_cfg(cfg_b))

    with tempfile.TemporaryDirectory(prefix="live_switch_ckpt_") as ckpt:

        def work(rank: int) -> dict:
            live.init_parallel(ca)
            job = live.build(ca)
            for it in range(2):
                live.train_step(job, it)
            live.save_dist_checkpoint(job, ckpt)
            t0 = time.perf_counter()
            src = extract_state(va, rank, job.ddps, job.optimizer)
            t1 = time.perf_counter()
            if into == "install":
                dst, report = switch(plan, va, vb, devices[rank], src, timeout=60)
                t2 = time.perf_counter()
                ps.destroy_model_parallel()
                live.init_parallel(cb)
                t3 = time.perf_counter()
                switched = live.build(cb, seed=cb["seed"] + 17)
                t4 = time.perf_counter()
                install_state(vb, rank, switched.ddps, switched.optimizer, dst)
            else:
                ps.destroy_model_parallel()
                live.init_parallel(cb)
                t2 = t3 = time.perf_counter()
                switched = live.build(cb, seed=cb["seed"] + 17)
                bound = bind_state(vb, rank, switched.ddps, switched.optimizer)
                t4 = time.perf_counter()
                dst, report = switch(plan, va, vb, devices[rank], src, timeout=60,
                                     dst_store=bound)
                assert dst is bound
                install_step(switched.optimizer, dst)
            t5 = time.perf_counter()
            ref = live.build(cb, seed=cb["seed"] + 29)
            live.load_dist_checkpoint(ref, ckpt)
            dist.barrier()
            out = {"pre": live.native_diffs(live.native_state(ref), live.native_state(switched)),
                   "n_state": len(live.native_state(ref))}
            out["losses"] = (live.train_step(switched, 2), live.train_step(ref, 2))
            out["post"] = live.native_diffs(live.native_state(ref), live.native_state(switched))
            out["seconds"] = {"extract": t1 - t0, "switch": t2 - t1, "parallel_state": t3 - t2,
                              "build": t4 - t3, "install": t5 - t4}
            out["bytes_received"] = report["bytes_received"]
            return out

        results = live.run_workers(work, la.world)

    for rank, res in enumerate(results):
        assert res["n_state"] > 0
        assert res["pre"] == [], f"rank {rank}: {res['pre'][:5]}"
        assert res["losses"][0] == res["losses"][1], (rank, res["losses"])
        assert res["post"] == [], f"rank {rank}: {res['post'][:5]}"
    assert any(res["losses"][0] for res in results), "no rank saw a loss"
    assert sum(res["bytes_received"] for res in results) > 0
