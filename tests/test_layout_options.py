"""Megatron's other layout options, against megatron-core 0.16.1 itself and its own rules.

* ``pipeline_model_parallel_layout``: parsing as megatron-core's ``parse_str_to_list`` does
  (checked against it on many strings), VPP derived as stages / pp, layer placement per
  (pp, vp) chunk and the embedding/output placement (``pre_process``/``post_process`` follow
  (pp0, vp0) / (pp_last, vp_last), not the ``E``/``L`` markers), and every refusal as one line.
* ``pad_buckets_for_high_nccl_busbw``: bucket ends padded to lcm(D, 128, 2**16) under the
  distributed optimizer, ignored without it; the DistributedOptimizer ranges follow.
* ``kv_channels`` derived as ``hidden_size // num_attention_heads`` when not given.

Each parity case builds the real model on CPU under gloo and compares every rank (about 1 s a
case); the whole file takes about 15 s on 2 cores.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from matrix import OPTION_CASES, case, drawn_case, to_harness_cfg, to_spec
from strategies import layouts, models

from dynatrain.ir.errors import SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import parse_spec, spec_from_dict, spec_to_yaml_text
from dynatrain.ir.pipeline import LayoutParseError, parse_layout, stage_layers

harness = pytest.importorskip("megatron_support.harness")
from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import (
    PipelineParallelLayerLayout,
)
from test_megatron_parity import compare_rank

_CHAR = {LayerType.embedding: "E", LayerType.loss: "L", LayerType.decoder: "t",
         LayerType.mtp: "m"}


@pytest.mark.parametrize("cfg", OPTION_CASES, ids=[c["name"] for c in OPTION_CASES])
def test_options_match_megatron(cfg: dict) -> None:
    layout = Layout(to_spec(cfg))
    real = harness.megatron_facts(to_harness_cfg(cfg), cfg["world"])
    assert len(real) == layout.world
    diffs = [f"rank {r}: {d}" for r in range(layout.world) for d in compare_rank(layout, r,
                                                                                  real[r])]
    assert not diffs, "\n".join(diffs[:12])
    # Layer numbers and where the embedding / output layer live, chunk by chunk.
    for r in range(layout.world):
        ours = [(ch.vp, ch.pre_process, ch.post_process, [i + 1 for i in ch.layers])
                for ch in layout.chunks(layout.coords(r).pp)]
        theirs = [(c["chunk"], c["pre_process"], c["post_process"], c["layer_numbers"])
                  for c in real[r]["chunks"]]
        assert ours == theirs, f"rank {r}"


def test_markers_do_not_move_the_embedding() -> None:
    """'|Ett|tL': the E marker sits on pp rank 1, but megatron builds the embedding on pp 0
    (pre_process is (pp0, vp0)), which then holds no decoder layer."""
    layout = Layout(to_spec(next(c for c in OPTION_CASES
                                 if c["name"] == "layout-empty-first-stage")))
    first = layout.chunks(0)[0]
    assert (first.layers, first.pre_process) == ((), True)
    assert [sh.param.name for sh in layout.rank_shards(0)[0].shards] == [
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]


def test_pad_buckets_changes_the_buffers() -> None:
    """The padding case is not vacuous: without the flag the IR differs from megatron in
    bucket bounds and optimizer ranges on every rank."""
    cfg = next(c for c in OPTION_CASES if c["name"] == "pad-busbw-dp4-buckets")
    real = harness.megatron_facts(to_harness_cfg(cfg), cfg["world"])
    plain = Layout(to_spec({**cfg, "pad_buckets_for_high_nccl_busbw": False}))
    for r in range(plain.world):
        diffs = compare_rank(plain, r, real[r])
        assert any(d.startswith("buffers") for d in diffs)
        assert any(d.startswith("optimizer ranges") for d in diffs)
    padded = Layout(to_spec(cfg))
    for b in padded.rank_buffers(0):
        assert all((end - start) % (1 << 16) == 0 for start, end in b.buckets)
        assert all(p.start % 64 == 0 for p in b.params)


# ---- parsing ----------------------------------------------------------------------------------

PARSE_CASES = [
    "Et|tt|tL", "Ettt|(tt|)*2tL", "E(tt|)*3ttL", "Et*3|t*0|tL", "E,t,t|t,L", "(|ab)*2",
    "E(t|)*2,(tt)*2L", "((t)*2)*3", "Et*12|t*1|L", "|Ett|tL", "", "|", "E|m|L", "Ex|L",
    "E(t|t", "Et)*2|L", "E*3", "(E)*0tL", "Et|(t|t|)*3L", "E(tt)*2*2L",
]


def _megatron_parse(text: str) -> tuple[str, ...] | None:
    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    except AssertionError:
        return None
    return tuple("".join(_CHAR[t] for t in s) for s in stages)


@pytest.mark.parametrize("text", PARSE_CASES)
def test_parse_matches_megatron(text: str) -> None:
    want = _megatron_parse(text)
    if want is None:
        with pytest.raises(LayoutParseError):
            parse_layout(text)
    else:
        assert parse_layout(text) == want


def test_parse_refuses_huge_expansions_fast() -> None:
    for text in ("t*99999999999", "(tt|)*9999999", "E" + "(t*9999999)*9999999" + "L"):
        with pytest.raises(LayoutParseError):
            parse_layout(text)


@pytest.mark.parametrize("text, pp", [("Et|tt|tL", 3), ("Ett|tt|tt|ttL", 2),
                                      ("Et*2|t|tt|t||tL", 2), ("|Ett|tL", 3), ("Ettt|tL", 2),
                                      ("Ett|tt||L", 2)])
def test_placement_matches_megatron_formula(text: str, pp: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets and counts per (pp, vp) from megatron's own layout object."""
    mc = PipelineParallelLayerLayout(text, pp)
    # Its lookups read the VPP size from parallel_state (None there would mean "chunk 0").
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: mc.virtual_pipeline_model_parallel_size)
    n = sum(s.count("t") for s in parse_layout(text))
    layout = Layout(to_spec(case("x", pp, pp=pp, num_layers=n,
                                 pipeline_model_parallel_layout=text)))
    vpp = mc.virtual_pipeline_model_parallel_size
    assert layout.spec.parallel.vpp == (vpp if vpp > 1 else None)
    got = stage_layers(layout.split)
    for r in range(pp):
        for v in range(vpp):
            assert list(got[r][v]) == mc.get_layer_id_list(vp_stage=v, pp_rank=r)


# ---- rules: one line naming the field and the rule --------------------------------------------

BASE = {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                  "vocab_size": 100},
        "parallel": {"pp": 2}, "world": {"nodes": 1, "gpus_per_node": 2}}


def _spec(model: dict | None = None, **par: object) -> dict:
    doc = copy.deepcopy(BASE)
    doc["model"].update(model or {})
    doc["parallel"].update(par)
    return doc


REFUSED = [
    ("unknown-char", {"pipeline_model_parallel_layout": "Etx|ttL"},
     "parallel.pipeline_model_parallel_layout", "invalid layer character 'x'"),
    ("stages-not-multiple", {"pipeline_model_parallel_layout": "Et|tt|tL"},
     "parallel.pipeline_model_parallel_layout", "3 stages, which must be a multiple of pp=2"),
    ("vpp-conflict", {"pipeline_model_parallel_layout": "Et|t|t|tL", "vpp": 3},
     "parallel.vpp", "conflicts with pipeline_model_parallel_layout"),
    ("first-not-E", {"pipeline_model_parallel_layout": "tE|tttL"},
     "parallel.pipeline_model_parallel_layout", "must start with the embedding"),
    ("last-not-L", {"pipeline_model_parallel_layout": "Ett|tLt"},
     "parallel.pipeline_model_parallel_layout", "must end with the loss"),
    ("two-E", {"pipeline_model_parallel_layout": "Ett|EttL"},
     "parallel.pipeline_model_parallel_layout", "embedding 'E' exactly once"),
    ("two-L", {"pipeline_model_parallel_layout": "EttL|ttL"},
     "parallel.pipeline_model_parallel_layout", "loss 'L' exactly once"),
    ("layer-count", {"pipeline_model_parallel_layout": "Ett|tL"},
     "parallel.pipeline_model_parallel_layout", "3 decoder layers 't' but num_layers=4"),
    ("mtp", {"pipeline_model_parallel_layout": "Ett|ttmL"},
     "parallel.pipeline_model_parallel_layout", "multi-token prediction"),
    ("with-first-stage", {"pipeline_model_parallel_layout": "Ett|ttL",
                          "decoder_first_pipeline_num_layers": 2},
     "parallel.pipeline_model_parallel_layout", "cannot be combined with decoder_first"),
    ("with-account", {"pipeline_model_parallel_layout": "Ett|ttL",
                      "account_for_loss_in_pipeline_split": True},
     "parallel.pipeline_model_parallel_layout", "account_for_loss_in_pipeline_split"),
    ("pp1-two-stages", {"pp": 1, "pipeline_model_parallel_layout": "Ett|ttL"},
     "parallel.pipeline_model_parallel_layout", "with pp=1 must be one stage"),
    ("huge", {"pipeline_model_parallel_layout": "E(t*9999999|)*9999999L"},
     "parallel.pipeline_model_parallel_layout", "expands to more than"),
    ("huge-count", {"pipeline_model_parallel_layout": "Et*123456789012|L"},
     "parallel.pipeline_model_parallel_layout", "too many times"),
    ("not-a-string", {"pipeline_model_parallel_layout": ["E", "tttt", "L"]},
     "parallel.pipeline_model_parallel_layout", "string"),
    ("pad-not-bool", {"pad_buckets_for_high_nccl_busbw": "yes"},
     "parallel.pad_buckets_for_high_nccl_busbw", "boolean"),
]


@pytest.mark.parametrize("par, field, rule", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_in_one_line(par: dict, field: str, rule: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_from_dict(_spec(**par))
    text = str(err.value)
    assert "\n" not in text and err.value.field == field and rule in text, text


def test_megatron_refuses_what_we_refuse() -> None:
    """The layout refusals are megatron's own: its layout object asserts on each."""
    for par, *_ in (r[1:] for r in REFUSED[:9]):
        text, pp = par["pipeline_model_parallel_layout"], par.get("pp", 2)
        if "vpp" in par:  # checked by TransformerConfig, against its own VPP argument
            assert PipelineParallelLayerLayout(text, pp).virtual_pipeline_model_parallel_size \
                != par["vpp"]
            continue
        with pytest.raises((AssertionError, IndexError)):
            PipelineParallelLayerLayout(text, pp).validate_layer_layout(4, None)


def test_yaml_layout_and_derived_vpp() -> None:
    spec = parse_spec("model: {num_layers: 8, hidden_size: 64, num_attention_heads: 4, "
                      "vocab_size: 100}\nparallel: {pp: 2, pipeline_model_parallel_layout: "
                      "'E(tt|)*3ttL', pad_buckets_for_high_nccl_busbw: true}\n"
                      "world: {nodes: 1, gpus_per_node: 4}")
    assert spec.parallel.vpp == 2 and spec.parallel.pad_buckets_for_high_nccl_busbw
    assert [c.layers for c in Layout(spec).chunks(1)] == [(2, 3), (6, 7)]


def test_kv_channels_derived_as_megatron() -> None:
    spec = spec_from_dict(_spec({"hidden_size": 30, "num_attention_heads": 4}))
    assert spec.model.head_dim == 7  # 30 // 4, as TransformerConfig.__post_init__
    with pytest.raises(SpecError) as err:
        spec_from_dict(_spec({"hidden_size": 3, "num_attention_heads": 4}))
    assert err.value.field == "model.hidden_size" and "kv_channels" in str(err.value)


# ---- random layouts against megatron -------------------------------------------------------


@st.composite
def _option_layouts(draw: st.DrawFn) -> dict:
    """Small random layouts that use a layout string or bus-bandwidth padding."""
    model = draw(models(te=False))  # built by megatron here, where TE cannot be imported
    doc = draw(layouts(model, max_world=8))
    p = doc["parallel"]
    assume(p.get("pipeline_model_parallel_layout") or p.get("pad_buckets_for_high_nccl_busbw"))
    # With cp > 1 the harness swaps core attention for a parameter-less stand-in (megatron's
    # local one refuses CP), which would drop a learnable softmax offset.
    assume(p.get("cp", 1) == 1 or model.get("softmax_type") != "learnable")
    return doc


def _check_random(doc: dict) -> None:
    cfg, world = drawn_case(doc)
    layout = Layout(spec_from_dict(doc))
    real = harness.megatron_facts(to_harness_cfg(cfg), world)
    diffs = [f"rank {r}: {d}" for r in range(world) for d in compare_rank(layout, r, real[r])]
    assert not diffs, "\n".join(diffs[:8])


@settings(max_examples=5, database=None, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(doc=_option_layouts())
def test_random_option_layouts_match_megatron(doc: dict) -> None:
    """What the gate's strategy draws with these options, built by megatron-core: equal."""
    note(f"doc = {doc!r}")
    _check_random(doc)


@pytest.mark.slow
@settings(max_examples=80, database=None, derandomize=False, deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(doc=_option_layouts())
def test_random_option_layouts_match_megatron_deep(doc: dict) -> None:
    note(f"doc = {doc!r}")
    _check_random(doc)


def test_dense_order_with_cp_refused_as_megatron_does() -> None:
    """Found by the random comparison: a dense model with cp > 1, pp > 1 and an order not
    ending in pp is refused by megatron-core (its expert grid has no cp), so by the rules too."""
    cfg = case("dense-cp2-pp2-pp-not-last", 4, pp=2, cp=2, order="tp-cp-ep-pp-dp")
    assert "pp-last rank ordering" in harness.mcore_rejects(to_harness_cfg(cfg), 4)
    with pytest.raises(SpecError) as err:
        to_spec(cfg)
    assert err.value.field == "parallel.order" and "needs cp=1 when pp > 1" in str(err.value)


MTP = dict(mtp_num_layers=1, position_embedding_type="rope",
           untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize("text, rule", [
    ("Ett|mttL", "must place every decoder layer 't' before the MTP layers 'm'"),
    ("Ettt|tm||L", "must put all MTP layers 'm' in the last stage"),  # not its last chunk
    ("Ett|ttL", "has 0 multi-token prediction layers 'm' but mtp_num_layers=1"),
])
def test_mtp_layouts_refused_as_megatron_does(text: str, rule: str) -> None:
    """MTP layers in a layout string: megatron's layout object asserts on each refusal."""
    cfg = case("mtp-layout", 2, pp=2, num_layers=4, pipeline_model_parallel_layout=text, **MTP)
    with pytest.raises(SpecError) as err:
        to_spec(cfg)
    assert rule in str(err.value)
    with pytest.raises(AssertionError):
        PipelineParallelLayerLayout(text, 2).validate_layer_layout(4, 1)


def test_mtp_layer_kind_follows_its_stage_in_megatron_lm() -> None:
    """Megatron-LM builds an MoE model's MTP layer from the last decoder layer's spec, but from
    an MoE spec when the MTP stage holds no decoder layer: with a dense last layer the model
    changes with the layout, which the rules refuse."""
    moe = dict(MTP, num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[1, 1, 1, 0])
    empty = case("mtp-empty-last", 2, pp=2, num_layers=4, pipeline_model_parallel_layout=
                 "Ett|tt||mL", **moe)
    # (the harness input by hand: to_harness_cfg would validate the refused spec)
    cfg = dict(to_harness_cfg(case("mtp-vpp2", 2, pp=2, vpp=2, num_layers=4, **moe)),
               transformer_config_overrides={"pipeline_model_parallel_layout": "Ett|tt||mL"})
    real = harness.megatron_facts(cfg, 2)
    assert any(p["name"].startswith("mtp.layers.0.") and ".mlp.experts." in p["name"]
               for p in real[1]["named_parameters"])
    with pytest.raises(SpecError) as err:
        to_spec(empty)
    assert err.value.field == "model.mtp_num_layers" and "dense" in str(err.value)
    held = to_spec(case("mtp-last-held", 2, pp=2, num_layers=4, **moe))  # the last layer: dense
    assert not any("mtp" in d.name and "experts" in d.name
                   for d in Layout(held).chunk_defs(1, 0)[0][0])


def test_standalone_mtp_refused_by_name() -> None:
    """MTP on a rank before the last is megatron's ``mtp_standalone``; DynaTrain refuses it
    (its embedding copy is outside the default embedding group)."""
    assert PipelineParallelLayerLayout("Ettttm|L", 2).validate_layer_layout(4, 1) is True
    with pytest.raises(SpecError) as err:
        to_spec(case("mtp-standalone", 2, pp=2, num_layers=4,
                     pipeline_model_parallel_layout="Ettttm|L", **MTP))
    assert "DynaTrain does not model them on an earlier rank" in str(err.value)


def test_mtp_refusals_are_megatron_facts() -> None:
    """With pp > 1, a tied embedding fails megatron's own sharded_state_dict on the MTP stage,
    and learned positions are two different tensors saved as one (both replica 0)."""
    tied = case("mtp-tied-pp2", 2, pp=2, **dict(MTP, untie_embeddings_and_output_weights=False))
    assert "AssertionError" in harness.mcore_rejects(to_harness_cfg(tied), 2)
    learned = case("mtp-learned-pp2", 2, pp=2, **dict(MTP, position_embedding_type=
                                                      "learned_absolute"))
    real = harness.megatron_facts(to_harness_cfg(learned), 2)
    mains = [r for r in range(2) for p in real[r]["params"]
             if p["key"] == "embedding.position_embeddings.weight" and not any(p["replica_id"])]
    assert mains == [0, 1]
    for cfg, rule in ((tied, "needs untie_embeddings_and_output_weights"),
                      (learned, "needs a position embedding other than learned_absolute")):
        with pytest.raises(SpecError) as err:
            to_spec(cfg)
        assert err.value.field == "model.mtp_num_layers" and rule in str(err.value)


def test_layout_spec_round_trips_through_yaml() -> None:
    spec = to_spec(next(c for c in OPTION_CASES if c["name"] == "layout-vpp3-x-n"))
    again = parse_spec(spec_to_yaml_text(spec))
    assert again == spec and again.parallel.vpp == 3
