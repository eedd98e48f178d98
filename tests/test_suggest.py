"""`suggest`: valid layouts on given devices that fit device memory, ranked by switch time.

Memory is checked against an independent count: per rank, ``rank_elements`` (the IR's own
per-rank shards and DistributedOptimizer ranges) times the state kinds' dtypes.
"""

from __future__ import annotations

import json

import pytest

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import DTYPE_BYTES, Layout
from dynatrain.ir.loader import load_spec, spec_from_dict, spec_to_dict
from dynatrain.ir.summary import rank_elements
from dynatrain.planner import suggest as sg
from dynatrain.planner.cost import H100, Topology
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.sources import node_of
from dynatrain.planner.suggest import candidate_layouts, parse_devices, suggest

LLAMA8B = "specs/llama3.1-8b/tp2-dp4.yaml"
QWEN30B = "specs/qwen3-30b-a3b/tp2-pp2-ep4.yaml"
GiB = 1 << 30
CAPACITY = int(H100.memory_GB * 1e9)


@pytest.fixture(scope="module")
def llama():
    return load_spec(LLAMA8B)


@pytest.fixture(scope="module")
def qwen():
    return load_spec(QWEN30B)


@pytest.fixture(scope="module")
def llama_on_8(llama):
    return suggest(llama, Layout(llama).devices, reserve_bytes=20 * GiB, top=8)


@pytest.fixture(scope="module")
def llama_on_6(llama):
    return suggest(llama, Layout(llama).devices[:6], reserve_bytes=20 * GiB, top=50)


@pytest.fixture(scope="module")
def qwen_on_16(qwen):
    return suggest(qwen, Layout(qwen).devices, reserve_bytes=20 * GiB)


def exact_peak_bytes(spec) -> int:
    """State on the fullest rank, from the IR's per-rank shards and optimizer ranges."""
    lay = Layout(spec)
    st = spec.state
    opt = sum(DTYPE_BYTES[k] for k in (st.main_param, st.exp_avg, st.exp_avg_sq) if k)
    return max(p * DTYPE_BYTES[st.param] + o * opt
               for p, o in (rank_elements(lay, r) for r in range(lay.world)))


def tp_groups_on_one_node(spec) -> bool:
    lay = Layout(spec)
    return all(len({node_of(lay.devices[g]) for g in lay.mesh.groups(r)[name]}) == 1
               for r in range(lay.world) for name in ("tp", "etp"))


# ---- parse_devices ------------------------------------------------------------------------------


def test_parse_devices_ranges_whole_nodes_and_single_devices(llama, qwen):
    assert parse_devices("node0:gpu0-2,node1:gpu5") == [
        "node0:gpu0", "node0:gpu1", "node0:gpu2", "node1:gpu5"]
    assert parse_devices("node1", qwen) == [f"node1:gpu{g}" for g in range(8)]
    assert parse_devices(" node0-1 ", qwen) == list(Layout(qwen).devices)
    listed = spec_from_dict(spec_to_dict(llama, ("node3:gpu1", "node3:gpu4", "node4:gpu0",
                                                 "node4:gpu1", "node4:gpu2", "node4:gpu3",
                                                 "node4:gpu4", "node4:gpu5")))
    assert parse_devices("node3", listed) == ["node3:gpu1", "node3:gpu4"]


@pytest.mark.parametrize("text, says", [
    ("", "got nothing"), ("gpu0", "is not like"), ("node0:cpu1", "is not like"),
    ("node0:gpu5-2", "low-high"), ("node0:gpu0-1,node0:gpu1", "node0:gpu1 is listed twice"),
    ("node2", "does not say how many gpus"), ("node0:gpu99999", "out of range"),
])
def test_parse_devices_refuses_bad_text_in_one_line(text, says):
    with pytest.raises(DynatrainError) as err:
        parse_devices(text)
    msg = str(err.value)
    assert msg.startswith("--devices: ") and says in msg and "\n" not in msg


# ---- candidates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [6, 8])
def test_candidates_are_valid_specs_on_exactly_the_devices(llama, n):
    devices = Layout(llama).devices[:n]
    specs = candidate_layouts(llama, devices)
    assert specs
    grids = set()
    for spec in specs:
        assert Layout(spec).devices == devices
        assert spec_from_dict(spec_to_dict(spec)) == spec  # passes the spec rules as written
        assert spec.model == llama.model and spec.state == llama.state
        assert tp_groups_on_one_node(spec)
        grids.add(sg.grid_text(spec))
    assert len(grids) == len(specs)  # no layout twice
    if n == 8:
        assert specs[0].parallel == llama.parallel  # the source's own layout comes first


def test_candidates_keep_as_many_optimizer_instances_as_the_data_parallel_size_allows(llama):
    # Two DistributedOptimizer instances (every optimizer shard on two devices): what lets a
    # recovery lose nothing. Kept wherever the candidate's DP divides by 2, else one.
    doc = spec_to_dict(llama)
    doc["parallel"] = dict(doc["parallel"], tp=1, num_distributed_optimizer_instances=2)
    two = spec_from_dict(doc)
    devices = Layout(two).devices
    for n in (6, 3):
        specs = candidate_layouts(two, devices[:n])
        assert specs
        for spec in specs:
            dp = Layout(spec).dp * spec.parallel.cp
            want = 2 if dp % 2 == 0 else 1
            assert spec.parallel.num_distributed_optimizer_instances == want, sg.grid_text(spec)
        assert any(s.parallel.num_distributed_optimizer_instances == 1 for s in specs)
        if n == 6:
            assert any(s.parallel.num_distributed_optimizer_instances == 2 for s in specs)


def test_candidates_keep_tp_inside_a_node(llama):
    # 3 + 3 devices on two nodes: a tp2 group would pair node0:gpu2 with node1:gpu0 (tp3 and
    # tp6 do not divide the 32 heads).
    devices = ("node0:gpu0", "node0:gpu1", "node0:gpu2", "node1:gpu0", "node1:gpu1",
               "node1:gpu2")
    specs = candidate_layouts(llama, devices)
    assert specs and all(tp_groups_on_one_node(s) for s in specs)
    assert all(s.parallel.tp == 1 for s in specs)
    out = suggest(llama, devices, top=1)
    assert out.tp_across_nodes > 0


def test_the_enumeration_is_capped(llama, monkeypatch):
    monkeypatch.setattr(sg, "MAX_CANDIDATES", 3)
    out = suggest(llama, Layout(llama).devices, top=1)
    assert out.considered == 3 and out.truncated and "(capped)" in out.to_text()


# ---- memory -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama_on_8", "llama_on_6", "qwen_on_16"])
def test_every_suggestion_fits_and_its_peak_bounds_the_exact_state(case, request):
    out = request.getfixturevalue(case)
    assert out.ranked
    for s in out.ranked:
        exact = exact_peak_bytes(s.spec)
        # exact for params; optimizer padding counted at its most (a few MiB at most here)
        assert exact <= s.peak_state_bytes <= exact + 64 * (1 << 20), s.grid
        assert exact + out.reserve_bytes <= CAPACITY


def test_peak_is_exact_for_an_mtp_model_without_distributed_optimizer():
    """Without optimizer padding the estimate is exact, so nothing may be missing: with MTP
    the decoder's final norm sits with the last decoder layer, not with the output layer."""
    doc = {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                     "ffn_hidden_size": 128, "vocab_size": 1000, "mtp_num_layers": 1,
                     "position_embedding_type": "rope", "normalization": "LayerNorm",
                     "untie_embeddings_and_output_weights": True},
           "parallel": {"pp": 2, "use_distributed_optimizer": False},
           "world": {"nodes": 1, "gpus_per_node": 4}}
    spec = spec_from_dict(doc)
    out = suggest(spec, Layout(spec).devices, top=50)
    assert out.ranked
    for s in out.ranked:  # exact_peak_bytes leaves out Adam's 8-byte step
        assert s.peak_state_bytes == exact_peak_bytes(s.spec) + 8, s.grid


def test_memory_filter_matches_an_exact_count(llama):
    devices = Layout(llama).devices[:6]
    peaks = sorted({exact_peak_bytes(s) for s in candidate_layouts(llama, devices)})
    assert len(peaks) >= 2
    # A reserve that leaves room between the two smallest distinct peaks: only those fit.
    room = (peaks[0] + peaks[1]) // 2
    out = suggest(llama, devices, reserve_bytes=CAPACITY - room, top=50)
    every = candidate_layouts(llama, devices)
    fit = [s for s in every if exact_peak_bytes(s) <= room]
    assert out.fitting == len(fit) and out.too_big_for_memory == len(every) - len(fit) > 0
    assert sorted(s.grid for s in out.ranked) == sorted(sg.grid_text(s) for s in fit)


def test_a_reserve_too_big_for_anything_gives_an_empty_list_with_counts(llama):
    out = suggest(llama, Layout(llama).devices[:6], reserve_bytes=CAPACITY - GiB)
    assert out.ranked == () and out.fitting == 0
    assert out.too_big_for_memory == out.considered - out.invalid - out.tp_across_nodes > 0
    assert "nothing fits with a reserve of" in out.why_empty()
    assert "nothing to suggest" in out.to_text()
    assert out.to_json()["suggestions"] == [] and out.to_json()["why_empty"]


def test_a_model_too_big_for_the_devices_says_so():
    big = load_spec("specs/llama3.1-70b/tp8-pp4-dp4.yaml")
    out = suggest(big, Layout(big).devices[:8])
    assert out.ranked == () and out.smallest_state_bytes > CAPACITY
    assert out.why_empty().startswith("the model cannot fit on 8 devices")


def test_without_device_memory_nothing_is_dropped_and_a_reserve_is_refused(llama):
    unchecked = Topology(name="no-memory", memory_GB=None)
    out = suggest(llama, Layout(llama).devices[:6], topology=unchecked, top=1)
    assert out.too_big_for_memory == 0 and out.capacity_bytes is None and out.ranked
    with pytest.raises(DynatrainError, match="^--reserve: .* needs a device memory"):
        suggest(llama, Layout(llama).devices[:6], topology=unchecked, reserve_bytes=GiB)


# ---- ranking ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama_on_8", "llama_on_6", "qwen_on_16"])
def test_ranking_is_by_predicted_downtime(case, request):
    ranked = request.getfixturevalue(case).ranked
    times = [s.predicted_seconds for s in ranked]
    assert times == sorted(times) and len(ranked) >= 2
    assert all(s.wire_seconds < s.predicted_seconds for s in ranked)  # fixed costs on top


@pytest.mark.parametrize("case, spec", [("llama_on_8", LLAMA8B), ("qwen_on_16", QWEN30B)])
def test_the_current_layout_comes_first_and_moves_nothing(case, spec, request):
    src = load_spec(spec)
    first = request.getfixturevalue(case).ranked[0]
    assert first.spec.parallel == src.parallel
    assert Layout(first.spec).devices == Layout(src).devices
    assert first.bytes_moved == 0 and first.estimated_bytes_moved == 0 and first.rounds == 1
    # What the planner gives for the identity switch: local copies only.
    plan = plan_transition(Layout(src), Layout(first.spec), 2 * GiB)
    assert all(m.local for m in plan.messages()) and plan.stats["bytes_local"] > 0


def test_only_the_top_by_estimate_are_planned(llama):
    out = suggest(llama, Layout(llama).devices, top=2)
    assert len(out.ranked) == 2 and out.fitting > 2
    assert any("more layouts fit" in n for n in out.notes)
    assert max(s.estimated_bytes_moved for s in out.ranked) <= min(
        s.estimated_bytes_moved for s in suggest(llama, Layout(llama).devices, top=6).ranked
        if s.grid not in {r.grid for r in out.ranked})


def test_the_estimate_is_exact_when_only_dp_changes(llama_on_6):
    same_tp = next(s for s in llama_on_6.ranked if s.grid == "tp2 pp1 dp3")
    assert same_tp.estimated_bytes_moved == pytest.approx(same_tp.bytes_moved, rel=1e-3)


# ---- failed devices -----------------------------------------------------------------------------


def test_bytes_lost_with_a_failed_device(llama):
    devices = Layout(llama).devices
    out = suggest(llama, devices[1:], failed=[devices[0]], top=3)
    assert out.ranked
    # dp=4 with the distributed optimizer: rank 0's optimizer shard exists once; its params
    # survive on the other DP replicas.
    _, opt = rank_elements(Layout(llama), 0)
    shard_bytes = opt * (4 + 4 + 4)
    for s in out.ranked:
        assert not set(Layout(s.spec).devices) & {devices[0]}
        assert s.bytes_lost == pytest.approx(shard_bytes, rel=1e-3)
    assert "lost" in out.to_text()


def test_without_failures_nothing_is_lost(llama_on_6):
    assert all(s.bytes_lost is None for s in llama_on_6.ranked)


def test_failed_devices_must_be_sources_and_not_suggested(llama):
    devices = Layout(llama).devices
    with pytest.raises(DynatrainError, match="^--devices: node0:gpu0 failed"):
        suggest(llama, devices, failed=["node0:gpu0"])
    with pytest.raises(DynatrainError, match="^--failed: node9:gpu0 is not a device"):
        suggest(llama, devices, failed=["node9:gpu0"])


@pytest.mark.parametrize("kw, says", [
    ({"devices": []}, "^--devices: needs at least one"),
    ({"devices": ["node0:gpu0", "node0:gpu0"]}, "^--devices: node0:gpu0 is listed twice"),
    ({"devices": ["gpu0"]}, "^--devices: device ids look like"),
    ({"top": 0}, "^--top: must be"), ({"reserve_bytes": -1}, "^--reserve: must be"),
])
def test_bad_arguments_are_one_line_errors(llama, kw, says):
    args = {"devices": list(Layout(llama).devices), **kw}
    with pytest.raises(DynatrainError, match=says):
        suggest(llama, args.pop("devices"), **args)


# ---- output -------------------------------------------------------------------------------------


def test_json_embeds_specs_that_load_back(qwen_on_16):
    doc = json.loads(json.dumps(qwen_on_16.to_json()))
    assert doc["format"] == "dynatrain.suggest/1"
    assert doc["considered"] == (doc["invalid"] + doc["tp_across_nodes"]
                                 + doc["too_big_for_memory"] + doc["fitting"])
    for entry, s in zip(doc["suggestions"], qwen_on_16.ranked, strict=True):
        assert spec_from_dict(entry["spec"]) == s.spec
        assert entry["bytes_moved"] == s.bytes_moved and entry["grid"] == s.grid


def test_text_is_a_table_best_first(llama_on_6):
    lines = llama_on_6.to_text().splitlines()
    assert lines[0].startswith("Llama-3.1-8B on one node, TP2 DP4  ->  6 devices")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "layout"])
    rows = lines[header + 1:]
    assert len(rows) == len(llama_on_6.ranked)
    assert rows[0].split()[:4] == ["1", *llama_on_6.ranked[0].grid.split()]


def test_layouts_the_budget_cannot_plan_are_named_not_dropped_silently():
    tiny = load_spec("specs/tiny-gpt/tp2-dp2.yaml")
    out = suggest(tiny, Layout(tiny).devices, top=5, budget_bytes=1024)
    assert len(out.ranked) == 1 and out.unplannable == 4  # the current layout moves nothing
    note = next(n for n in out.notes if "could not be planned" in n)
    assert note.startswith("4 of those 5 could not be planned, e.g. ") and "--budget" in note
    assert note in out.to_text()
