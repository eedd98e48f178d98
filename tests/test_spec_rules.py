"""One test per spec rule: a tiny valid spec, changed to break exactly that rule.

Each case asserts the ``SpecError`` names the expected field and says the rule in words. A few
cases check the other side of a rule (a spec that sits right at its edge still loads), so a rule
cannot pass these tests by rejecting too much.
"""

from __future__ import annotations

import copy

import pytest

from dynatrain.ir.errors import SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import parse_spec, spec_from_dict
from dynatrain.ir.rules import MAX_WORLD

DELETE = object()

# 8 layers, 8 heads in 4 query groups, 8 GPUs: every parallel size up to 8 has room to be wrong.
DENSE = {
    "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 8,
              "num_query_groups": 4, "ffn_hidden_size": 128, "vocab_size": 1000},
    "parallel": {},
    "world": {"nodes": 1, "gpus_per_node": 8},
}
MOE = copy.deepcopy(DENSE)
MOE["model"].update(num_moe_experts=8, moe_ffn_hidden_size=64, moe_router_topk=2)


def changed(base: dict, changes: dict) -> dict:
    """``base`` with dotted paths set (or removed with ``DELETE``)."""
    out = copy.deepcopy(base)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


def test_bases_are_valid():
    for base in (DENSE, MOE):
        Layout(spec_from_dict(copy.deepcopy(base)))


# (id, base, changes, expected field, fragment of the rule)
BROKEN = [
    # ---- model ---------------------------------------------------------------------------
    ("groups-divide-heads", DENSE, {"model.num_query_groups": 3},
     "model.num_query_groups", "must divide num_attention_heads=8"),
    ("hidden-at-least-heads", DENSE, {"model.hidden_size": 4},
     "model.hidden_size", "must be at least num_attention_heads=8"),
    ("moe-layer-freq-list-length", MOE, {"model.moe_layer_freq": [1, 0, 1]},
     "model.moe_layer_freq", "one 0/1 entry per layer"),
    ("moe-ffn-needs-experts", DENSE, {"model.moe_ffn_hidden_size": 64},
     "model.moe_ffn_hidden_size", "needs num_moe_experts"),
    ("shared-expert-needs-experts", DENSE, {"model.moe_shared_expert_intermediate_size": 64},
     "model.moe_shared_expert_intermediate_size", "needs num_moe_experts"),
    ("expert-bias-needs-experts", DENSE, {"model.moe_router_enable_expert_bias": True},
     "model.moe_router_enable_expert_bias", "needs num_moe_experts"),
    ("first-dense-needs-experts", DENSE, {"model.moe_first_dense_layers": 1},
     "model.moe_first_dense_layers", "needs num_moe_experts"),
    ("topk-at-most-experts", MOE, {"model.moe_router_topk": 9},
     "model.moe_router_topk", "must be at most num_moe_experts=8"),
    ("first-dense-leaves-a-moe-layer", MOE, {"model.moe_first_dense_layers": 8},
     "model.moe_first_dense_layers", "must leave at least one MoE layer"),
    ("shared-experts-no-bias", MOE,
     {"model.moe_shared_expert_intermediate_size": 64, "model.add_bias_linear": True},
     "model.add_bias_linear", "shared experts cannot have biases"),
    ("shared-gate-needs-shared-expert", MOE, {"model.moe_shared_expert_gate": True},
     "model.moe_shared_expert_gate", "needs moe_shared_expert_intermediate_size"),
    # ---- world ---------------------------------------------------------------------------
    ("world-both-forms", DENSE, {"world.devices": ["node0:gpu0", "node0:gpu1"]},
     "world.devices", "not both"),
    ("world-needs-gpus-per-node", DENSE, {"world.gpus_per_node": DELETE},
     "world", "needs nodes and gpus_per_node"),
    ("world-needs-nodes", DENSE, {"world.nodes": DELETE},
     "world", "needs nodes and gpus_per_node"),
    ("world-too-big", DENSE, {"world.nodes": MAX_WORLD, "world.gpus_per_node": 2},
     "world", f"at most {MAX_WORLD} devices"),
    ("devices-duplicate", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE,
      "world.devices": ["node0:gpu0", "node0:gpu1", "node0:gpu0", "node0:gpu3"]},
     "world.devices", "'node0:gpu0' is listed twice"),
    ("devices-bad-id", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE,
      "world.devices": ["node0:gpu0", "gpu1"]},
     "world.devices", "device ids look like 'node3:gpu5'"),
    ("devices-bad-id-too-many-digits", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE, "world.devices": ["node1234567:gpu0"]},
     "world.devices", "device ids look like"),
    ("devices-not-strings", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE, "world.devices": ["node0:gpu0", 1]},
     "world.devices.1", "valid string"),
    ("devices-empty", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE, "world.devices": []},
     "world.devices", "at least one device"),
    # ---- dense parallel ------------------------------------------------------------------
    ("tp-divides-heads", DENSE, {"parallel.tp": 3},
     "parallel.tp", "must divide num_attention_heads=8"),
    ("tp-vs-groups-more-groups", DENSE,
     {"model.num_attention_heads": 12, "model.num_query_groups": 6, "model.hidden_size": 96,
      "parallel.tp": 4},
     "parallel.tp", "must divide num_query_groups=6, or be a multiple of it"),
    ("tp-vs-groups-fewer-groups", DENSE,
     {"model.num_attention_heads": 12, "model.num_query_groups": 4, "model.hidden_size": 96,
      "model.ffn_hidden_size": 192, "parallel.tp": 6},
     "parallel.tp", "must divide num_query_groups=4, or be a multiple of it"),
    ("tp-divides-ffn", DENSE, {"model.ffn_hidden_size": 101, "parallel.tp": 2},
     "parallel.tp", "must divide ffn_hidden_size=101"),
    ("world-divisible-by-model-parallel", DENSE, {"parallel.tp": 4, "world.gpus_per_node": 6},
     "world", "divisible by tp*pp*cp=4"),
    ("world-divisible-by-cp", DENSE, {"parallel.cp": 3},
     "world", "divisible by tp*pp*cp=3"),
    ("optimizer-instances-divide-dp-cp", DENSE,
     {"parallel.num_distributed_optimizer_instances": 3},
     "parallel.num_distributed_optimizer_instances", "must divide dp*cp=8"),
    ("optimizer-instances-need-distributed-optimizer", DENSE,
     {"parallel.num_distributed_optimizer_instances": 2,
      "parallel.use_distributed_optimizer": False},
     "parallel.num_distributed_optimizer_instances", "needs use_distributed_optimizer"),
    ("ep-needs-moe", DENSE, {"parallel.ep": 2}, "parallel.ep", "needs a MoE model"),
    ("etp-needs-moe", DENSE, {"parallel.etp": 2}, "parallel.etp", "needs a MoE model"),
    # ---- MoE parallel --------------------------------------------------------------------
    ("ep-divides-experts", MOE, {"parallel.ep": 3},
     "parallel.ep", "must divide num_moe_experts=8"),
    ("etp-divides-moe-ffn", MOE, {"model.moe_ffn_hidden_size": 66, "parallel.ep": 2,
                                  "parallel.etp": 4},
     "parallel.etp", "must divide moe_ffn_hidden_size=66"),
    ("tp-divides-shared-expert", MOE,
     {"model.moe_shared_expert_intermediate_size": 100, "parallel.tp": 8},
     "parallel.tp", "must divide moe_shared_expert_intermediate_size=100"),
    ("world-divisible-by-expert-model-parallel", MOE,
     {"parallel.ep": 4, "world.gpus_per_node": 6},
     "world", "divisible by etp*ep*pp=4"),
    ("optimizer-instances-divide-edp", MOE,
     {"parallel.ep": 8, "parallel.num_distributed_optimizer_instances": 2},
     "parallel.num_distributed_optimizer_instances", "expert data-parallel size 1"),
    ("order-not-pp-last-needs-equal-dp", MOE,
     {"parallel.tp": 2, "parallel.pp": 2, "parallel.ep": 4, "parallel.etp": 1,
      "parallel.order": "tp-cp-ep-pp-dp", "world.nodes": 2},
     "parallel.order", "expert DP == DP (here 2 vs 4)"),
    ("moe-bias-needs-etp1", MOE,
     {"model.add_bias_linear": True, "parallel.tp": 2, "parallel.ep": 2},
     "parallel.etp", "add_bias_linear needs etp=1"),
    # A 0.16 rule: 0.16 keeps these experts in the dense buffer and loses their optimizer
    # state; 0.19 gives them an expert buffer (ALLOWED below).
    ("ep1-etp-ne-tp-distributed-optimizer", MOE,
     {"parallel.tp": 2, "parallel.etp": 1, "megatron_core": "0.16.1"},
     "parallel.etp", "etp != tp with ep=1"),
    ("ep1-cp-before-tp-distributed-optimizer", MOE,
     {"parallel.tp": 2, "parallel.cp": 2, "parallel.order": "cp-tp-ep-dp-pp"},
     "parallel.order", "different expert-TP slices"),
    # ---- pipeline ------------------------------------------------------------------------
    ("vpp-needs-pp", DENSE, {"parallel.vpp": 2}, "parallel.vpp", "needs pp > 1"),
    ("uneven-needs-pp", DENSE, {"parallel.decoder_first_pipeline_num_layers": 4},
     "parallel.decoder_first_pipeline_num_layers", "needs pp > 1"),
    ("uneven-last-needs-pp", DENSE, {"parallel.decoder_last_pipeline_num_layers": 4},
     "parallel.decoder_first_pipeline_num_layers", "needs pp > 1"),
    ("uneven-not-with-accounting", DENSE,
     {"parallel.pp": 2, "parallel.decoder_first_pipeline_num_layers": 4,
      "parallel.account_for_loss_in_pipeline_split": True},
     "parallel.account_for_embedding_in_pipeline_split", "cannot be combined"),
    ("uneven-ends-exceed-layers", DENSE,
     {"parallel.pp": 2, "parallel.decoder_first_pipeline_num_layers": 5,
      "parallel.decoder_last_pipeline_num_layers": 5},
     "parallel.decoder_first_pipeline_num_layers", "exceed num_layers=8"),
    ("uneven-layers-without-middle-stage", DENSE,
     {"parallel.pp": 2, "parallel.decoder_first_pipeline_num_layers": 3,
      "parallel.decoder_last_pipeline_num_layers": 4},
     "parallel.pp", "1 layers are left for no middle stage"),
    ("uneven-middle-split-evenly", DENSE,
     {"parallel.pp": 4, "parallel.decoder_first_pipeline_num_layers": 2,
      "parallel.decoder_last_pipeline_num_layers": 1},
     "parallel.pp", "5 layers outside the first/last stage must split evenly over 2 middle"),
    ("uneven-vpp-needs-middle-stage", DENSE,
     {"parallel.pp": 2, "parallel.vpp": 2, "parallel.decoder_first_pipeline_num_layers": 4,
      "parallel.decoder_last_pipeline_num_layers": 4},
     "parallel.vpp", "needs a middle stage"),
    ("uneven-first-divisible-by-vpp", DENSE,
     {"model.num_layers": 11, "parallel.pp": 3, "parallel.vpp": 2,
      "parallel.decoder_first_pipeline_num_layers": 3, "world.gpus_per_node": 3},
     "parallel.decoder_first_pipeline_num_layers", "must be divisible by vpp=2"),
    ("uneven-last-divisible-by-vpp", DENSE,
     {"model.num_layers": 11, "parallel.pp": 3, "parallel.vpp": 2,
      "parallel.decoder_last_pipeline_num_layers": 3, "world.gpus_per_node": 3},
     "parallel.decoder_last_pipeline_num_layers", "must be divisible by vpp=2"),
    ("uneven-middle-divisible-by-vpp", DENSE,
     {"model.num_layers": 10, "parallel.pp": 4, "parallel.vpp": 2,
      "parallel.decoder_first_pipeline_num_layers": 2,
      "parallel.decoder_last_pipeline_num_layers": 2, "world.gpus_per_node": 4},
     "parallel.vpp", "must divide the 3 layers of each middle stage"),
    ("pp-divides-layers", DENSE, {"parallel.pp": 3, "world.gpus_per_node": 3},
     "parallel.pp", "must divide num_layers=8"),
    ("pp-divides-layers-with-accounting", DENSE,
     {"parallel.pp": 2, "parallel.account_for_embedding_in_pipeline_split": True},
     "parallel.pp", "must divide num_layers=9 (incl. accounted embedding/loss)"),
    ("vpp-divides-stage-layers", DENSE, {"parallel.pp": 2, "parallel.vpp": 3},
     "parallel.vpp", "must divide the 4 layers per pipeline stage"),
    # ---- fp8 -----------------------------------------------------------------------------
    ("fp8-needs-te", DENSE, {"model.fp8": "hybrid"}, "model.fp8",
     "needs transformer_impl=transformer_engine"),
    ("fp8-delayed-experts", MOE, {"model.fp8": "e4m3", "model.transformer_impl":
                                  "transformer_engine"}, "model.fp8_recipe",
     "delayed scaling with experts is refused"),
    ("fp8-delayed-mtp", DENSE, {"model.fp8": "hybrid", "model.transformer_impl":
                                "transformer_engine", "model.mtp_num_layers": 1,
                                "model.position_embedding_type": "rope",
                                "model.untie_embeddings_and_output_weights": True},
     "model.fp8_recipe", "delayed scaling with MTP layers is not modelled"),
    ("fp8-delayed-sinks", DENSE, {"model.fp8": "hybrid", "model.transformer_impl":
                                  "transformer_engine", "model.softmax_type": "learnable"},
     "model.fp8_recipe", "delayed scaling with learnable softmax is not modelled"),
    ("fp8-custom-recipe", DENSE, {"model.fp8": "hybrid", "model.transformer_impl":
                                  "transformer_engine", "model.fp8_recipe": "custom"},
     "model.fp8_recipe", "'delayed', 'tensorwise', 'blockwise' or 'mxfp8'"),
    # ---- schema (pydantic) -----------------------------------------------------------------
    ("order-is-permutation", DENSE, {"parallel.order": "tp-cp-dp-pp"},
     "parallel.order", "permutation of tp, cp, ep, dp, pp"),
    ("order-no-repeats", DENSE, {"parallel.order": "tp-tp-ep-dp-pp"},
     "parallel.order", "permutation"),
    ("unknown-field", DENSE, {"parallel.tpp": 2}, "parallel.tpp", "unknown field"),
    ("unknown-top-level-field", DENSE, {"optimizer": {}}, "optimizer", "unknown field"),
    ("wrong-type", DENSE, {"parallel.tp": "2"}, "parallel.tp", "valid integer"),
    ("bool-is-not-int", DENSE, {"parallel.tp": True}, "parallel.tp", "valid integer"),
    ("float-is-not-int", DENSE, {"model.num_layers": 8.0}, "model.num_layers", "valid integer"),
    ("positive", DENSE, {"parallel.pp": 0}, "parallel.pp", "greater than or equal to 1"),
    ("bounded", DENSE, {"model.hidden_size": 2 ** 200}, "model.hidden_size", "less than or equal"),
    ("required", DENSE, {"world": DELETE}, "world", "is required"),
    ("required-model-field", DENSE, {"model.vocab_size": DELETE}, "model.vocab_size",
     "is required"),
    ("literal", DENSE, {"state.param": "int8"}, "state.param", "'bf16', 'fp16' or 'fp32'"),
    ("moe-layer-freq-entry", MOE, {"model.moe_layer_freq": [1, 0, 2, 1, 1, 1, 1, 1]},
     "model.moe_layer_freq.2", "less than or equal to 1"),
    ("unknown-preset", DENSE, {"model": "llama-9000"}, "model", "unknown preset"),
    ("derive-param-needs-main", DENSE, {"state.derive_param": True, "state.main_param": None},
     "state.derive_param", "needs main_param"),
    ("derive-param-needs-cast", DENSE, {"state.derive_param": True, "state.param": "fp32"},
     "state.derive_param", "bf16/fp16 param cast from fp32"),
    ("unknown-preset-key", DENSE, {"model": {"preset": "llama-9000"}}, "model.preset",
     "unknown preset"),
]


@pytest.mark.parametrize("base,changes,field,fragment",
                         [pytest.param(*c[1:], id=c[0]) for c in BROKEN])
def test_broken_rule_is_named(base, changes, field, fragment):
    with pytest.raises(SpecError) as info:
        spec_from_dict(changed(base, changes))
    err = info.value
    assert err.field == field, str(err)
    assert fragment in str(err), str(err)
    assert str(err).startswith(f"{field}: ") and "\n" not in str(err)


# Specs right at the edge of a rule: each must load and compile.
ALLOWED = [
    # The edges of the rule above: tp before cp, ep > 1, or no distributed optimizer.
    ("ep1-tp-before-cp", MOE, {"parallel.tp": 2, "parallel.cp": 2}),
    ("ep2-cp-before-tp", MOE,
     {"parallel.tp": 2, "parallel.cp": 2, "parallel.ep": 2, "parallel.order": "cp-tp-ep-dp-pp"}),
    ("ep1-cp-before-tp-no-distributed-optimizer", MOE,
     {"parallel.tp": 2, "parallel.cp": 2, "parallel.order": "cp-tp-ep-dp-pp",
      "parallel.use_distributed_optimizer": False}),
    ("gqa-fewer-groups-than-tp", DENSE,
     {"model.num_query_groups": 2, "parallel.tp": 4}),
    ("gqa-one-group", DENSE, {"model.num_query_groups": 1, "parallel.tp": 8}),
    ("gqa-groups-equal-tp", DENSE, {"parallel.tp": 4}),
    ("kv-channels-lifts-hidden-rule", DENSE, {"model.hidden_size": 60, "model.kv_channels": 8}),
    ("uneven-pp", DENSE,
     {"parallel.pp": 4, "parallel.decoder_first_pipeline_num_layers": 1,
      "parallel.decoder_last_pipeline_num_layers": 1}),
    ("uneven-first-only", DENSE,
     {"model.num_layers": 7, "parallel.pp": 4, "parallel.decoder_first_pipeline_num_layers": 1}),
    ("uneven-two-stages-no-middle", DENSE,
     {"parallel.pp": 2, "parallel.decoder_first_pipeline_num_layers": 3,
      "parallel.decoder_last_pipeline_num_layers": 5}),
    ("uneven-pp-vpp", DENSE,
     {"model.num_layers": 12, "parallel.pp": 4, "parallel.vpp": 2,
      "parallel.decoder_first_pipeline_num_layers": 2,
      "parallel.decoder_last_pipeline_num_layers": 2}),
    ("vpp", DENSE, {"parallel.pp": 2, "parallel.vpp": 4}),
    ("accounted-split", DENSE,
     {"model.num_layers": 6, "parallel.pp": 4,
      "parallel.account_for_embedding_in_pipeline_split": True,
      "parallel.account_for_loss_in_pipeline_split": True}),
    ("ep1-etp-ne-tp-without-distributed-optimizer", MOE,
     {"parallel.tp": 2, "parallel.etp": 1, "parallel.use_distributed_optimizer": False}),
    ("ep-gt-1-etp-ne-tp", MOE, {"parallel.tp": 2, "parallel.ep": 2, "parallel.etp": 1}),
    ("ep1-etp-ne-tp-distributed-optimizer-0.19", MOE,
     {"parallel.tp": 2, "parallel.etp": 1, "megatron_core": "0.19.2"}),
    ("order-not-pp-last-equal-dp", MOE,
     {"parallel.tp": 2, "parallel.pp": 2, "parallel.ep": 2, "parallel.etp": 1,
      "parallel.order": "tp-cp-ep-pp-dp", "world.nodes": 2}),
    ("moe-bias-etp1", MOE, {"model.add_bias_linear": True, "parallel.tp": 2, "parallel.ep": 2,
                            "parallel.etp": 1}),
    ("derive-param", DENSE, {"state.derive_param": True}),
    ("fp8-delayed-dense", DENSE, {"model.fp8": "hybrid", "model.transformer_impl":
                                  "transformer_engine", "model.fp8_amax_history_len": 1024}),
    ("fp8-stateless-experts", MOE, {"model.fp8": "e4m3", "model.fp8_recipe": "mxfp8",
                                    "model.transformer_impl": "transformer_engine"}),
    ("devices", DENSE,
     {"world.nodes": DELETE, "world.gpus_per_node": DELETE,
      "world.devices": [f"node{n}:gpu{g}" for n in (7, 3) for g in range(4)]}),
    ("aliases", DENSE, {"parallel": {"tensor_model_parallel_size": 2,
                                     "pipeline_model_parallel_size": 2}}),
    ("preset-with-override", DENSE,
     {"model": {"preset": "llama3.1-8b", "num_layers": 8}, "parallel.tp": 8}),
]


@pytest.mark.parametrize("base,changes", [pytest.param(*c[1:], id=c[0]) for c in ALLOWED])
def test_edge_of_rule_is_allowed(base, changes):
    Layout(spec_from_dict(changed(base, changes)))


# Where rules.py once disagreed with megatron-core 0.16.1: megatron-core rejects the first and
# third and accepts the second.
def test_uneven_pp_middle_stage_without_layers_is_rejected():
    with pytest.raises(SpecError):
        spec_from_dict(changed(DENSE, {"parallel.pp": 4,
                                       "parallel.decoder_first_pipeline_num_layers": 4,
                                       "parallel.decoder_last_pipeline_num_layers": 4}))


def test_order_rule_exempts_pp1():
    spec_from_dict(changed(MOE, {"parallel.tp": 2, "parallel.ep": 4, "parallel.etp": 1,
                                 "parallel.order": "pp-tp-cp-ep-dp", "world.nodes": 2}))


def test_order_with_different_pp_groups_is_rejected():
    with pytest.raises(SpecError):
        spec_from_dict(changed(MOE, {"parallel.tp": 2, "parallel.cp": 2, "parallel.pp": 2,
                                     "parallel.ep": 4, "parallel.etp": 1,
                                     "parallel.order": "tp-pp-cp-ep-dp", "world.nodes": 2}))


def test_yaml_and_dict_agree():
    text = ("model: {num_layers: 8, hidden_size: 64, num_attention_heads: 8,"
            " num_query_groups: 4, vocab_size: 1000}\n"
            "parallel: {tp: 3}\nworld: {nodes: 1, gpus_per_node: 8}\n")
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert str(info.value) == "parallel.tp: must divide num_attention_heads=8 (got 3)"
