"""Plans executed by the numpy simulator give every destination shard bit for bit.

Each transition builds source storage from random global tensors, runs the plan, and compares
with the destination storage built directly from the same tensors. Covers changes of TP (incl.
non-power-of-two), PP (even/uneven), VPP, DP, CP, EP, ETP, dist-opt on/off, vocab padding and
world grow/shrink. The global tensors cover the vocab rows the switch carries (padding rows
both layouts hold are trained state in Megatron), so those rows are checked too.
"""

from __future__ import annotations

import numpy as np
import pytest

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.verify.simulate import execute, materialize

from oracle import assert_plan_exact

DENSE = dict(num_layers=4, hidden_size=48, num_attention_heads=12, num_query_groups=6,
             ffn_hidden_size=96, vocab_size=150, make_vocab_size_divisible_by=8, swiglu=True,
             max_position_embeddings=32)
MOE = dict(DENSE, num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_enable_expert_bias=True,
           moe_router_score_function="sigmoid",
           moe_shared_expert_intermediate_size=48)


def spec(model: dict, world: int, **par: object):
    return spec_from_dict({"model": model, "parallel": par,
                           "world": {"nodes": max(1, world // 4), "gpus_per_node": min(4, world)}
                           if world % 4 == 0 or world < 4 else
                           {"devices": [f"node0:gpu{i}" for i in range(world)]}})


TRANSITIONS = [
    ("tp2->tp3", spec(DENSE, 4, tp=2), spec(DENSE, 3, tp=3)),
    ("tp1->tp2-dp2", spec(DENSE, 2), spec(DENSE, 4, tp=2)),
    ("pp2->pp4-uneven", spec(DENSE, 2, pp=2), spec(DENSE, 3, pp=3, decoder_first_pipeline_num_layers=2)),
    ("pp2-vpp2->tp2-pp2", spec(DENSE, 4, pp=2, vpp=2), spec(DENSE, 4, tp=2, pp=2)),
    ("dp4->dp2-cp2", spec(DENSE, 4), spec(DENSE, 4, cp=2)),
    ("distopt->replicated", spec(DENSE, 4, tp=2), spec(DENSE, 4, tp=2, use_distributed_optimizer=False)),
    ("replicated->distopt-buckets", spec(DENSE, 4, use_distributed_optimizer=False),
     spec(DENSE, 4, pp=2, overlap_grad_reduce=True, bucket_size=3000)),
    ("untied-grow-8", spec({**DENSE, "untie_embeddings_and_output_weights": True}, 4, tp=2),
     spec({**DENSE, "untie_embeddings_and_output_weights": True}, 8, tp=2, pp=2)),
    ("moe-ep2->ep4-etp1", spec(MOE, 4, tp=2, ep=2), spec(MOE, 4, ep=4)),
    ("moe-ep4-etp1->tp2-etp2-ep2", spec(MOE, 4, ep=4, etp=1), spec(MOE, 8, tp=2, ep=2, pp=2)),
]


@pytest.mark.parametrize("name,src,dst", TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
@pytest.mark.parametrize("budget", [1 << 30, 4096])
def test_plan_reproduces_destination_bit_exact(name, src, dst, budget) -> None:
    s, d = transition_views(Layout(src), Layout(dst))
    rng = np.random.default_rng(7)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) for tk, t in
               s.tensors().items()}
    plan = plan_transition(s.layout, d.layout, budget)
    assert_plan_exact(plan, s, d, tensors, budget)


DERIVE = [
    ("derive-distopt-tp2->pp2", spec(DENSE, 4, tp=2), spec(DENSE, 4, pp=2)),
    ("derive-replicated-moe", spec(MOE, 4, ep=2), spec(MOE, 4, ep=4, use_distributed_optimizer=False)),
]


@pytest.mark.parametrize("name,src,dst", DERIVE, ids=[t[0] for t in DERIVE])
def test_derived_params_are_not_sent_and_come_out_exact(name, src, dst) -> None:
    dst = dst.model_copy(update={"state": dst.state.model_copy(update={"derive_param": True})})
    s, d = transition_views(Layout(src), Layout(dst))
    rng = np.random.default_rng(11)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) for tk, t in
               s.tensors().items()}
    for key, kind in list(tensors):  # Megatron's invariant: param == cast(main_param)
        if kind == "param":
            tensors[(key, kind)] = tensors[(key, "main_param")]
    plan = plan_transition(s.layout, d.layout, 1 << 20)
    full = plan_transition(s.layout, Layout(dst.model_copy(update={
        "state": dst.state.model_copy(update={"derive_param": False})})), 1 << 20)
    assert plan.derived == ("param",)
    assert all("param" not in t.kinds for m in plan.messages() for t in m.transfers)
    assert plan.stats["bytes_moved"] + plan.stats["bytes_local"] < (
        full.stats["bytes_moved"] + full.stats["bytes_local"])
    assert_plan_exact(plan, s, d, tensors)


@pytest.mark.parametrize("src_tp,dst_tp,rows", [(2, 6, 160), (2, 3, 160), (3, 1, 152)])
def test_vocab_padding_rows_both_hold_are_carried_and_new_ones_zero(src_tp, dst_tp, rows) -> None:
    # vocab 150, padded to a multiple of 8 * tp: tp1 152, tp2 160, tp3 168, tp6 192. A reload
    # through megatron's checkpoint copies the rows both sizes hold and zero-fills the rest.
    src, dst = Layout(spec(DENSE, src_tp, tp=src_tp)), Layout(spec(DENSE, dst_tp, tp=dst_tp))
    s, d = transition_views(src, dst)
    assert s.vocab_rows == d.vocab_rows == rows
    key = "embedding.word_embeddings.weight"
    assert s.tensors()[(key, "param")].shape[0] == rows
    rng = np.random.default_rng(5)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) + 1 for tk, t in
               s.tensors().items()}
    got = execute(plan_transition(src, dst, 1 << 20), materialize(s, tensors), d)
    Vp = dst.padded_vocab
    # TP row shards; a rank whose rows are all past the carried ones stores nothing (zeros).
    H = DENSE["hidden_size"]
    table = np.concatenate([g.get(("param", "ParamSlot", 0, key), np.zeros((Vp // dst_tp, H)))
                            for g in got])
    assert table.shape[0] == Vp
    np.testing.assert_array_equal(table[:rows], tensors[(key, "param")])  # padding included
    assert not table[rows:].any() and (table[150:rows] != 0).all()
