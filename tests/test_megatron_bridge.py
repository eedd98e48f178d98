"""The Megatron bridge against real megatron-core training jobs: bit for bit, both directions.

Each case builds a real megatron-core 0.16.1 job on CPU in forked gloo workers
(``megatron_support.live``: GPTModel local spec -> Float16Module -> DDP -> get_megatron_optimizer)
and trains it two real steps (forward/backward, finalize_model_grads, Adam), so moments, step and
expert_bias are all non-trivial. Then, on every rank:

* **extract vs an independent oracle.** ``extract_state`` must equal, region by region and bit
  for bit, the storage the IR builds (``storage.fill_from_global``) from global tensors that
  megatron itself reports: each rank's ``sharded_state_dict()`` of the model and of the optimizer
  (``fully_reshardable``, where megatron gathers its DistributedOptimizer shards over DP and maps
  them to per-parameter tensors with the checkpoint metadata), assembled in the parent with every
  element covered and every replica agreeing. The oracle never touches the IR or the bridge.
* **zero copy.** Params, main params and moments in the extracted storage alias the job's own
  tensors.
* **install round trip.** ``install_state`` into a freshly built job of the same layout (other
  weights) must make megatron's own view of the state (module state dicts, DDP param buffers,
  the optimizer's bucket-space or per-parameter state, Adam's step) equal the source job's bit
  for bit, and one more training step on both jobs must give the same losses and states.
"""

from __future__ import annotations

import pytest
import torch

from dynatrain.ir.errors import LayoutError
from dynatrain.ir.layout import Layout
from dynatrain.ir.state import StateView, view_of
from dynatrain.runtime.megatron import STEP_KEY, extract_state, install_state, storage_spec
from dynatrain.runtime.storage import fill_from_global, region
from matrix import MOE, case, to_harness_cfg, to_spec
from megatron_support import live

# vocab 256 splits without padding at tp <= 2 (multiple of 16 * tp); the MoE case keeps the
# matrix's vocab 200 (padded to 208) so vocab padding rows are exercised too.
CASES = {
    "tp2-dp2-gqa-swiglu": case("tp2-dp2", 4, tp=2, num_query_groups=2, swiglu=True,
                               vocab_size=256),
    "pp2-vpp2-dp2-tied": case("pp2-vpp2-dp2", 4, pp=2, vpp=2, num_layers=4, vocab_size=256),
    # megatron refuses to train MoE with TP > 1 without sequence parallelism (CUDA-only here).
    "moe-ep2-edp2-expert-bias": case("moe", 4, ep=2, swiglu=True,
                                     moe_shared_expert_intermediate_size=48, **live.EXPERT_BIAS,
                                     **MOE),
    "tp2-dp2-no-distopt-untied": case("no-distopt", 4, tp=2, use_distributed_optimizer=False,
                                      untie_embeddings_and_output_weights=True, vocab_size=256),
    # Two DistributedOptimizer instances over dp4: each shards over its half of the DP group.
    "dp4-distopt-instances2": case("instances2", 4, num_distributed_optimizer_instances=2,
                                   vocab_size=256),
}


def _clone(store: dict) -> dict:
    return {k: v.detach().clone() for k, v in store.items()}


def _aliases(store: dict, job: live.Job) -> tuple[int, int]:
    """(storage tensors of params, main params and moments, how many alias the job's memory)."""
    ptrs = set()
    for ddp in job.ddps:
        for p in ddp.module.parameters():
            ptrs.add(p.untyped_storage().data_ptr())
    for opt in getattr(job.optimizer, "chained_optimizers", None) or [job.optimizer]:
        for g in opt.optimizer.param_groups:
            for p in g["params"]:
                ptrs.add(p.untyped_storage().data_ptr())
                for t in opt.optimizer.state[p].values():
                    if t.dim() > 0:
                        ptrs.add(t.untyped_storage().data_ptr())
    keys = [k for k in store if k[0] in ("param", "main_param", "exp_avg", "exp_avg_sq")]
    return len(keys), sum(store[k].untyped_storage().data_ptr() in ptrs for k in keys)


def _run_case(cfg: dict, view: StateView, wrong: StateView | None) -> list[dict]:
    c = live.resolve(to_harness_cfg(cfg))

    def work(rank: int) -> dict:
        live.init_parallel(c)
        job = live.build(c)
        losses = [live.train_step(job, it) for it in range(2)]
        store = extract_state(view, rank, job.ddps, job.optimizer)
        out = {"losses": losses, "store": _clone(store), "aliases": _aliases(store, job),
               "leaves": live.sharded_leaves(job)}
        if wrong is not None:
            try:
                extract_state(wrong, rank, job.ddps, job.optimizer)
                out["wrong"] = None
            except LayoutError as e:
                out["wrong"] = str(e)
        before = live.native_state(job)
        fresh = live.build(c, seed=c["seed"] + 17)
        out["fresh_differs"] = len(live.native_diffs(before, live.native_state(fresh)))
        install_state(view, rank, fresh.ddps, fresh.optimizer, store)
        out["installed_diffs"] = live.native_diffs(before, live.native_state(fresh))
        out["next_losses"] = (live.train_step(job, 2), live.train_step(fresh, 2))
        out["after_diffs"] = live.native_diffs(live.native_state(job), live.native_state(fresh))
        return out

    return live.run_workers(work, cfg["world"])


def _oracle_tensors(view: StateView, per_rank: list[dict]) -> dict:
    """Logical tensors (IR keys and kinds) from megatron's sharded state dicts."""
    glob, steps = live.assemble([r["leaves"] for r in per_rank])
    prefixes = {"optimizer.state.param.": "main_param", "optimizer.state.fp32_param.": "main_param",
                "optimizer.state.exp_avg.": "exp_avg", "optimizer.state.exp_avg_sq.": "exp_avg_sq"}
    out = {}
    for ckey, t in glob.items():
        key, kind = ckey, "param"
        for pre, k in prefixes.items():
            if ckey.startswith(pre):
                key, kind = ckey[len(pre):], k
        if (key, kind) not in view.tensors() and (key, "buffer") in view.tensors():
            kind = "buffer"
        want = view.tensors()[(key, kind)]
        out[(key, kind)] = t[tuple(slice(0, s) for s in want.shape)]  # vocab padding off
    assert len(steps) == 1, steps
    out[("optimizer.step", "step")] = torch.tensor(int(steps.pop()), dtype=torch.int64)
    missing = set(view.tensors()) - set(out)
    assert not missing, f"the oracle has no {sorted(missing)[:4]}"
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_extract_matches_megatron_and_install_round_trips(name: str) -> None:
    cfg = CASES[name]
    view = view_of(Layout(to_spec(cfg)))
    wrong = view_of(Layout(to_spec(dict(cfg, tp=1)))) if name.startswith("tp2-dp2-gqa") else None
    results = _run_case(cfg, view, wrong)
    oracle = _oracle_tensors(view, results)

    for rank, res in enumerate(results):
        store = res["store"]
        specs = storage_spec(view, rank)
        assert set(store) == set(specs), rank
        for k, s in specs.items():
            assert (tuple(store[k].shape), store[k].dtype) == (s.shape, s.dtype), (rank, k)
        expected = fill_from_global(view, rank, oracle)
        bad = [(r.key, r.kind, r.box) for r in view.regions(rank)
               if not live.bits_equal(region(store, r.kind, r.slot, r.box),
                                      region(expected, r.kind, r.slot, r.box))]
        assert not bad, f"rank {rank}: {len(bad)} regions differ from megatron's, e.g. {bad[:3]}"
        n, aliased = res["aliases"]
        assert n > 0 and aliased == n, f"rank {rank}: only {aliased} of {n} tensors are views"
        assert int(store[STEP_KEY]) == 2
        # Not vacuous: the job trained, the fresh build differed, install made them equal.
        assert res["fresh_differs"] > 0
        assert res["installed_diffs"] == [], res["installed_diffs"][:5]
        assert res["next_losses"][0] == res["next_losses"][1]
        assert res["after_diffs"] == [], res["after_diffs"][:5]
        if res.get("wrong", "") is None:
            raise AssertionError("extract_state accepted a layout the job does not run")
    for key, kind in oracle:  # two Adam steps: every moment and expert_bias moved
        if kind in ("exp_avg", "exp_avg_sq", "buffer"):
            assert oracle[(key, kind)].abs().sum() > 0, (key, kind)
    assert ("expert-bias" in name) == any(k == "buffer" for _, k in view.tensors())
    losses = [l for r in results for step in r["losses"] for l in step]
    assert losses, "no rank saw a loss"
    if wrong is not None:
        assert all("local shape" in r["wrong"] for r in results), [r["wrong"] for r in results]


def _fresh_job(name: str):
    """The case, its state view and harness config, and ``build()``: this rank's fresh job."""
    cfg = CASES[name]
    view = view_of(Layout(to_spec(cfg)))
    c = live.resolve(to_harness_cfg(cfg))

    def build() -> live.Job:
        live.init_parallel(c)
        return live.build(c)

    return cfg, view, c, build


def test_before_the_first_step_adam_starts_from_zero() -> None:
    """A job that has not stepped yet has no Adam state: extract gives zero moments and step 0,
    and a fresh job installed from it trains its first step exactly like the original."""
    cfg, view, c, build = _fresh_job("tp2-dp2-gqa-swiglu")

    def work(rank: int) -> dict:
        job = build()
        store = extract_state(view, rank, job.ddps, job.optimizer)
        zero = all(not store[k].any() for k in store if k[0] in ("exp_avg", "exp_avg_sq"))
        fresh = live.build(c, seed=c["seed"] + 17)
        install_state(view, rank, fresh.ddps, fresh.optimizer, store)
        losses = (live.train_step(job, 0), live.train_step(fresh, 0))
        return {"zero": zero, "step": int(store[STEP_KEY]), "losses": losses,
                "diffs": live.native_diffs(live.native_state(job), live.native_state(fresh))}

    for res in live.run_workers(work, cfg["world"]):
        assert res["zero"] and res["step"] == 0
        assert res["losses"][0] == res["losses"][1] and res["losses"][0]
        assert res["diffs"] == [], res["diffs"][:5]


def test_precision_aware_remainders_refused_not_read_as_masters() -> None:
    """With the precision-aware optimizer TE FusedAdam may keep each master only as an int16
    remainder of the bf16 param (``store_param_remainders``): the bridge refuses it in one line
    rather than carry half a master. (Carrying precision-aware fp32 masters and bf16 moments is
    checked against megatron's reload in tests/test_te_live.py.)"""
    cfg, view, _, build = _fresh_job("tp2-dp2-gqa-swiglu")

    def work(rank: int) -> str:
        job = build()
        for opt in getattr(job.optimizer, "chained_optimizers", [job.optimizer]):
            opt.config.use_precision_aware_optimizer = True
            opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
            opt.optimizer.store_param_remainders = True
        try:
            extract_state(view, rank, job.ddps, job.optimizer)
        except LayoutError as err:
            return str(err)
        return ""

    for msg in live.run_workers(work, cfg["world"]):
        assert "int16 remainders" in msg and "\n" not in msg


def test_install_refuses_a_storage_of_another_layout_before_touching_the_job() -> None:
    """The storage is checked against the layout before the job is even looked at."""
    view = view_of(Layout(to_spec(CASES["tp2-dp2-gqa-swiglu"])))
    other = view_of(Layout(to_spec(dict(CASES["tp2-dp2-gqa-swiglu"], tp=1))))
    store = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in storage_spec(other, 0).items()}
    with pytest.raises(LayoutError, match="storage"):
        install_state(view, 0, [], None, store)
    store = {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in storage_spec(view, 0).items()}
    store[STEP_KEY] = torch.zeros((), dtype=torch.float32)
    with pytest.raises(LayoutError, match="optimizer.step|step"):
        install_state(view, 0, [], None, store)
