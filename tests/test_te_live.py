"""A live switch of a Transformer Engine job equals megatron's own dist-checkpoint reload.

Jobs built with megatron-core's TE spec over the CPU stand-in (``tests/te_standin``, on the
path of a child interpreter and its forked gloo workers only: ``megatron_support.te_live``)
train in layout A; a ``LiveSwitcher`` prepares the switch to B while iteration 2 trains, then
switches. The switched job must hold, bit for bit, what a fresh B job loaded from megatron's
dist-checkpoint of A holds (megatron's own view: module state dicts including TE's
``_extra_state``, DDP param buffers, DistributedOptimizer state and step, every param group's
lr and weight decay), and one more iteration must give both the same losses and the same state
again.

* default (~17 s): a dense GPT with SwiGLU, GQA and a padded vocabulary (250 -> 256), TP2·DP2
  -> PP2·DP2 (tied embedding split across stages);
* default (~50 s): DeepSeek-V3's shape — multi-latent attention, a dense first layer, grouped
  experts with a router expert bias, an MTP layer (so an embedding copy on the last stage) —
  PP2·EP2 -> TP2·EP2 with sequence parallelism;
* ``slow`` (~29 s): a grouped-GEMM MoE (TEGroupedMLP, SwiGLU, router expert bias) EP2 -> EP4.

Every switch the run selects from this file runs in one child interpreter (``switched``), one
after another; each test checks its own.
"""

from __future__ import annotations

import pytest
from matrix import MOE, case
from te_cases import to_te_spec

from dynatrain.ir.layout import Layout

pytest.importorskip("megatron.core")
te_live = pytest.importorskip("megatron_support.te_live")

FUSED_ADAM = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
PA = dict(state={"exp_avg": "bf16", "exp_avg_sq": "bf16"}, optimizer_config_overrides={
    "use_precision_aware_optimizer": True, "main_params_dtype": "fp32", "exp_avg_dtype": "bf16",
    "exp_avg_sq_dtype": "bf16", "store_param_remainders": False})
FP8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=3,
           fp8_amax_compute_algo="max")
BIAS = {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}
G = {"moe_grouped_gemm": True}
DSV3 = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16,
            qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True, normalization="RMSNorm",
            position_embedding_type="rope", untie_embeddings_and_output_weights=True,
            mtp_num_layers=1, moe_layer_freq=[0, 1, 1, 1], swiglu=True, **BIAS, **MOE, **G)

# name: (A, B, (tp, pp, ep) of B)
SWITCHES = {
    "dense-tp2-dp2->pp2-dp2": (
        case("te-live-a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=250),
        case("te-live-b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=250),
        (1, 2, 1)),
    "moe-grouped-ep2->ep4": (
        case("te-live-moe-a", 4, ep=2, swiglu=True, vocab_size=200, **BIAS, **MOE, **G),
        case("te-live-moe-b", 4, ep=4, swiglu=True, vocab_size=200, **BIAS, **MOE, **G),
        (1, 1, 4)),
    # fp8 with delayed scaling: every TE GEMM's scales and amax histories move with it.
    "fp8-delayed-tp2-dp2->pp2-dp2": (
        case("te-live-fp8-a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=250,
             sequence_parallel=True, **FP8),
        case("te-live-fp8-b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=250, **FP8),
        (1, 2, 1)),
    # The precision-aware optimizer: TE FusedAdam's own fp32 masters and bf16 moments.
    "precision-aware-tp2-dp2->pp2-dp2": (
        case("te-live-pa-a", 4, tp=2, num_query_groups=2, swiglu=True, vocab_size=250, **PA),
        case("te-live-pa-b", 4, pp=2, num_query_groups=2, swiglu=True, vocab_size=250, **PA),
        (1, 2, 1)),
    # fp8 with current scaling: no state, so sequential experts move as without fp8.
    "fp8-tensorwise-moe-ep2->tp2-ep2": (
        case("te-live-fp8cs-a", 4, ep=2, swiglu=True, vocab_size=200, fp8="hybrid",
             fp8_recipe="tensorwise", **MOE),
        case("te-live-fp8cs-b", 4, tp=2, ep=2, etp=1, swiglu=True, vocab_size=200,
             sequence_parallel=True, fp8="hybrid", fp8_recipe="tensorwise", **MOE),
        (2, 1, 2)),
    # DeepSeek-V3's shape: MLA, a dense first layer, grouped experts, an MTP layer.
    "mla-mtp-moe-pp2-ep2->tp2-ep2": (
        case("te-live-mla-a", 4, pp=2, ep=2, num_layers=4, vocab_size=200, **DSV3),
        case("te-live-mla-b", 4, tp=2, ep=2, etp=1, num_layers=4, vocab_size=200,
             sequence_parallel=True, **DSV3),
        (2, 1, 2)),
}
CASES = [pytest.param(n, id=n, marks=[pytest.mark.slow] if n.startswith("moe") else [])
         for n in SWITCHES]
ROLLED_BACK = "fp8-delayed-tp2-dp2->pp2-dp2"  # the switch the rollback test fails


@pytest.fixture(scope="module")
def switched(request) -> dict:
    """The results of every switch this run selected from this module (each test's, or the
    traceback that ended it), from one child interpreter."""
    jobs = {}
    for item in request.session.items:
        if item.path != request.path:
            continue
        if item.originalname == "test_fp8_job_trains_on_after_a_rolled_back_switch":
            cfg_a, cfg_b, _ = SWITCHES[ROLLED_BACK]
            jobs["rollback"] = {"a": cfg_a, "b": cfg_b, "rollback": True}
        else:
            name = item.callspec.params["name"]
            jobs[name] = {"a": SWITCHES[name][0], "b": SWITCHES[name][1]}
    return te_live.te_live_batch(jobs)


def _results(switched: dict, key: str) -> list[dict]:
    got = switched[key]
    if isinstance(got, str):
        pytest.fail(f"{key} failed in the child:\n{got[-4000:]}")
    return got


@pytest.mark.parametrize("name", CASES)
def test_te_live_switch_equals_megatron_checkpoint_reload(name: str, switched: dict) -> None:
    cfg_a, cfg_b, dst_sizes = SWITCHES[name]
    results = _results(switched, name)
    assert len(results) == cfg_a["world"]
    for rank, res in enumerate(results):
        # Really TE builds on both sides (stand-in modules), and really the destination layout.
        assert res["te_modules_a"] > 0 and res["te_modules_b"] > 0, rank
        assert (res["tp_after"], res["pp_after"], res["ep_after"]) == dst_sizes, rank
        # megatron runs TE's FusedAdam (step per param group), as it does with TE installed.
        assert res["adam"] == [FUSED_ADAM], (rank, res["adam"])
        # precision-aware: FusedAdam itself holds the masters (megatron keeps none)
        assert res["master_weights"] == ("optimizer_config_overrides" in cfg_a), rank
        assert res["iteration"] == [3, 3], rank
        assert res["n_state"] > 0 and res["n_extra_state"] > 0, rank
        # Megatron's reload leaves exactly TE core attention's extra state (not in its
        # sharded state dict) as built; the comparison below covers its value too.
        assert res["reload_missing"] and all(k.endswith("core_attention._extra_state")
                                             for k in res["reload_missing"]), rank
        assert res["pre"] == [], f"rank {rank}: {res['pre'][:5]}"
        assert res["losses"][0] == res["losses"][1], (rank, res["losses"])
        assert res["post"] == [], f"rank {rank}: {res['post'][:5]}"
        assert set(res["seconds"]) >= {"exchange", "install", "plan", "verify"}
        if "fp8" in cfg_a:  # fp8 really ran; delayed scales moved off their initial 1.0
            assert res["fp8_ran_modules"] > 0, rank
            assert (res["fp8_scaled_modules"] > 0) == (cfg_a["fp8_recipe"] == "delayed"), rank
            # TE's global amax registrations: only the two jobs training now, under
            # megatron's current group (the commit dropped the source job's)
            assert res["stale_keys"] == [] and res["registered"] == res["delayed_modules"], (
                rank, res["stale_keys"][:2], res["registered"], res["delayed_modules"])
    # Every rank of A's last pipeline stage saw a loss while the switch was planned.
    a = Layout(to_te_spec(cfg_a))
    last = [r for r in range(a.world) if a.coords(r).pp == a.parallel.pp - 1]
    assert [r for r, res in enumerate(results) if res["losses_during_prepare"]] == last
    assert any(r["losses"][0] for r in results), "no rank saw a loss"


def test_fp8_job_trains_on_after_a_rolled_back_switch(switched: dict) -> None:
    """A switch whose destination build fails on one process sends every process back to the
    source layout with new process groups. TE registered each delayed-scaling module under the
    old amax-reduction group and reduces every registration at each autocast exit, so the
    rollback must make the modules register again (``te_fp8.forget_groups``): the next fp8
    iteration then runs and updates the scales with every registration under the new group.
    (Stale registrations would keep reducing over the old groups, which megatron's
    ``destroy_model_parallel`` only forgets; a world change destroys them for real.)"""
    cfg_a = SWITCHES[ROLLED_BACK][0]
    results = _results(switched, "rollback")
    assert len(results) == cfg_a["world"]
    for rank, res in enumerate(results):
        assert "building the destination failed" in res["failed"], (rank, res["failed"])
        assert res["fp8_modules"] > 0 and res["scales_moved"], rank
        # registered again under the new group, each module once
        assert res["stale_keys"] == [] and res["registered"] == res["delayed_modules"] > 0, (
            rank, res["stale_keys"][:2], res["registered"], res["delayed_modules"])
    assert any(r["losses"] for r in results)
