"""Transformer Engine layouts in the IR, without megatron: parameter order and names, keys,
the spec rules, sequence parallelism, ``_extra_state``, and plans between TE layouts.

Parity with megatron-core's own TE build is tests/test_te_parity.py; these pin the model's
shape of it, so a regression names the rule it broke.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import assert_plan_exact

from dynatrain.ir.errors import SpecError
from dynatrain.ir.facts import extra_state_facts, rank_facts
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import transition_views, view_of
from dynatrain.planner.pipeline import plan_transition

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
            vocab_size=200, make_vocab_size_divisible_by=16, max_position_embeddings=64)
MOE = dict(BASE, num_moe_experts=4, moe_ffn_hidden_size=32)
TE = dict(transformer_impl="transformer_engine")


def spec(model: dict, world: int, **par: object):
    return spec_from_dict({"model": model, "parallel": par,
                           "world": {"devices": [f"node0:gpu{i}" for i in range(world)]}})


def names(layout: Layout, rank: int = 0) -> list[str]:
    return [sh.param.name for cs in layout.rank_shards(rank) for sh in cs.shards]


def test_dense_layer_order_fuses_norms_into_linears() -> None:
    got = [n for n in names(Layout(spec({**BASE, **TE, "add_bias_linear": True}, 1)))
           if n.startswith("decoder.layers.0.")]
    p = "decoder.layers.0."
    assert got == [p + n for n in (
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")]


def test_rmsnorm_has_no_layer_norm_bias_and_qk_norms_follow_qkv() -> None:
    got = [n for n in names(Layout(spec({**BASE, **TE, "normalization": "RMSNorm",
                                         "qk_layernorm": True}, 1)))
           if n.startswith("decoder.layers.1.")]
    p = "decoder.layers.1."
    assert got == [p + n for n in (
        "self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight", "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]


def test_grouped_experts_interleave_weights_and_biases_under_sequential_keys() -> None:
    layout = Layout(spec({**MOE, **TE, "moe_grouped_gemm": True, "add_bias_linear": True}, 2,
                         ep=2))
    shards = [sh for cs in layout.rank_shards(1) for sh in cs.shards
              if sh.param.name.startswith("decoder.layers.0.mlp.experts.")]
    p = "decoder.layers.0.mlp.experts."
    assert [sh.param.name for sh in shards] == [p + n for n in (
        "linear_fc1.weight0", "linear_fc1.bias0", "linear_fc1.weight1", "linear_fc1.bias1",
        "linear_fc2.weight0", "linear_fc2.bias0", "linear_fc2.weight1", "linear_fc2.bias1")]
    assert {sh.param.key for sh in shards} == {
        f"decoder.layers.mlp.experts.experts.linear_fc{i}.{k}" for i in (1, 2)
        for k in ("weight", "bias")}
    # EP rank 1 holds global experts 2 and 3 of 4, on the axis after the layer axis
    assert [sh.param.prepend for sh in shards[:4:2]] == [((0, 2), (2, 4)), ((0, 2), (3, 4))]


def test_moe_keeps_its_pre_mlp_norm_key_dense_layers_fuse_it() -> None:
    model = {**MOE, **TE, "num_layers": 2, "moe_layer_freq": [0, 1]}
    keys = {sh.param.name: sh.param.key for cs in Layout(spec(model, 1)).rank_shards(0)
            for sh in cs.shards}
    assert keys["decoder.layers.1.pre_mlp_layernorm.weight"] == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    assert keys["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    local = {sh.param.name: sh.param.key for cs in Layout(spec({**model, "transformer_impl":
                                                                "local"}, 1)).rank_shards(0)
             for sh in cs.shards}
    assert local["decoder.layers.1.pre_mlp_layernorm.weight"] == \
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"


@pytest.mark.parametrize("model,field", [
    ({**MOE, "moe_grouped_gemm": True}, "model.moe_grouped_gemm"),
    ({**BASE, **TE, "moe_grouped_gemm": True}, "model.moe_grouped_gemm"),
])
def test_grouped_gemm_rules(model: dict, field: str) -> None:
    with pytest.raises(SpecError) as e:
        Layout(spec(model, 1))
    assert e.value.field == field and "\n" not in str(e.value)


def test_transformer_impl_is_validated() -> None:
    with pytest.raises(SpecError, match="transformer_impl"):
        spec({**BASE, "transformer_impl": "te"}, 1)


def test_sequence_parallel_changes_no_layout_fact() -> None:
    for model, par in (({**BASE, **TE}, dict(tp=2)),
                       ({**MOE, **TE, "moe_grouped_gemm": True}, dict(tp=2, ep=2, etp=1))):
        a, b = Layout(spec(model, 4, **par)), Layout(spec(model, 4, sequence_parallel=True, **par))
        for r in range(4):
            assert rank_facts(a, r) == rank_facts(b, r)


def test_extra_state_is_not_state_and_objects_follow_the_modules() -> None:
    layout = Layout(spec({**MOE, **TE, "moe_grouped_gemm": True}, 2, ep=2))
    assert not any("_extra_state" in k for k, _ in view_of(layout).tensors())
    objs = extra_state_facts(layout, 1)
    experts = [o for o in objs if ".experts." in o["key"]]
    assert {(o["key"], tuple(o["global_offset"])) for o in experts} == {
        (f"decoder.layers.mlp.experts.experts.linear_fc{i}._extra_state", (l, e))
        for i in (1, 2) for l in (0, 1) for e in (2, 3)}
    assert all(o["global_shape"] == [2, 4] for o in experts)
    assert objs[-1] == {"chunk": 0, "key": "decoder.final_layernorm._extra_state",
                        "global_shape": [1], "global_offset": [0], "replica_id": [0, 0, 1]}
    assert extra_state_facts(Layout(spec(MOE, 2, ep=2)), 1) == []


TRANSITIONS = [
    ("te-tp2->pp2", spec({**BASE, **TE, "swiglu": True}, 4, tp=2),
     spec({**BASE, **TE, "swiglu": True}, 4, pp=2)),
    ("te-grouped-ep2->ep4", spec({**MOE, **TE, "moe_grouped_gemm": True}, 4, tp=2, ep=2),
     spec({**MOE, **TE, "moe_grouped_gemm": True}, 4, ep=4)),
    ("te-sequential->grouped", spec({**MOE, **TE}, 2, ep=2),
     spec({**MOE, **TE, "moe_grouped_gemm": True}, 4, ep=2, tp=2, etp=1)),
    ("local->te-dense", spec({**BASE, "swiglu": True}, 2, tp=2),
     spec({**BASE, **TE, "swiglu": True}, 4, tp=2, sequence_parallel=True)),
]


@pytest.mark.parametrize("name,src,dst", TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_plan_between_te_layouts_is_bit_exact(name, src, dst) -> None:
    s, d = transition_views(Layout(src), Layout(dst))
    rng = np.random.default_rng(5)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) for tk, t in
               s.tensors().items()}
    plan = plan_transition(s.layout, d.layout, 1 << 14)
    assert_plan_exact(plan, s, d, tensors, 1 << 14)
