"""Expert-weight families (``StackSlot``): the stacked IR holds exactly what the unstacked one does.

The IR groups congruent expert weights of a stage into one region over their (layer, expert)
grid, ``grid_boxes`` cuts the grid into boxes, ``members`` expands a family back into one
(slot, anchor, box) per storage tensor. Checked here: the box cover on its own, the expansion on
hand-made families, the per-rank regions and storage of several MoE layouts against the same
layouts with stacking switched off, and a plan that moves families (simulated bit for bit,
verified, and through JSON).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynatrain.ir.state as state_mod
from dynatrain.ir.box import Box
from dynatrain.ir.errors import DynatrainError, LayoutError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import (BufferSlot, FlatSlot, ParamSlot, StackSlot, StateView, grid_boxes,
                                members, slot_key, storage_tensors, transition_views)
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Round
from dynatrain.planner.serialize import plan_from_json, plan_to_json
from dynatrain.verify.check import verify
from dynatrain.verify.simulate import execute, materialize

from oracle import assert_plan_exact

# ---- grid_boxes ----------------------------------------------------------------------------


def _points(boxes) -> list[tuple[int, ...]]:
    """Every point of every box, with repeats (so overlaps show)."""
    return [p for lo, hi in boxes
            for p in itertools.product(*(range(a, b) for a, b in zip(lo, hi)))]


def _grid(*ranges) -> list[tuple[int, ...]]:
    return sorted(itertools.product(*ranges))


def test_grid_boxes_1d_runs_with_gaps() -> None:
    pts = [(0,), (1,), (2,), (5,), (7,), (8,)]
    assert grid_boxes(pts) == [((0,), (3,)), ((5,), (6,)), ((7,), (9,))]
    assert grid_boxes([(4,)]) == [((4,), (5,))]


def test_grid_boxes_2d_full_grid_is_one_box() -> None:
    assert grid_boxes(_grid(range(2, 5), range(1, 4))) == [((2, 1), (5, 4))]


def test_grid_boxes_2d_ragged_first_and_last_rows() -> None:
    # Row 0 starts late, row 3 ends early, rows 1-2 are full: three boxes, the middle merged.
    pts = sorted([(0, 2), (0, 3)] + _grid(range(1, 3), range(4)) + [(3, 0), (3, 1)])
    assert grid_boxes(pts) == [((0, 2), (1, 4)), ((1, 0), (3, 4)), ((3, 0), (4, 2))]


def test_grid_boxes_3d() -> None:
    assert grid_boxes(_grid(range(2), range(3), range(4))) == [((0, 0, 0), (2, 3, 4))]
    # Layers 0-1 full, layer 2 misses expert column 1 in its rows: a different cover there.
    pts = sorted(set(_grid(range(3), range(2), range(3))) - {(2, 0, 1), (2, 1, 1)})
    assert grid_boxes(pts) == [((0, 0, 0), (2, 2, 3)), ((2, 0, 0), (3, 2, 1)),
                               ((2, 0, 2), (3, 2, 3))]
    # Zero-dimensional points: one empty box.
    assert grid_boxes([()]) == [((), ())]


@st.composite
def _point_sets(draw: st.DrawFn) -> list[tuple[int, ...]]:
    dims = draw(st.sampled_from([(4, 5), (3, 3, 4), (2, 6), (5,)]))
    pts = draw(st.sets(st.tuples(*(st.integers(0, n - 1) for n in dims)), min_size=1))
    return sorted(pts)


@settings(max_examples=300)
@given(_point_sets())
def test_grid_boxes_cover_exactly(pts: list[tuple[int, ...]]) -> None:
    boxes = grid_boxes(pts)
    for lo, hi in boxes:
        assert len(lo) == len(hi) == len(pts[0]) and all(a < b for a, b in zip(lo, hi))
    covered = _points(boxes)
    assert len(covered) == len(set(covered)), "boxes overlap"
    assert sorted(covered) == pts
    assert len(boxes) <= len(pts)


# ---- members -------------------------------------------------------------------------------


def test_members_of_a_param_family_row_major() -> None:
    names = tuple(f"w{i}" for i in range(6))  # anchor leading dims (layer 2:4, expert 4:7)
    fam = StackSlot(ParamSlot(1, "w0", (4, 0)), 2, names)
    anchor = Box((2, 4, 0, 0), (4, 7, 8, 16))
    assert fam.chunk == 1
    # Whole anchor: six members in row-major order, each a (1, 1) slice of the grid.
    whole = members(fam, anchor, anchor)
    assert [s.name for s, _, _ in whole] == list(names)
    assert [a.lo[:2] for _, a, _ in whole] == [(2, 4), (2, 5), (2, 6), (3, 4), (3, 5), (3, 6)]
    assert all(s == ParamSlot(1, n, (4, 0)) for (s, _, _), n in zip(whole, names))
    assert all(a == b for _, a, b in whole)
    # A sub-box: layer 3, experts 5:7, rows 2:6 of the trailing (8, 16).
    sub = members(fam, anchor, Box((3, 5, 2, 0), (4, 7, 6, 16)))
    assert sub == [
        (ParamSlot(1, "w4", (4, 0)), Box((3, 5, 0, 0), (4, 6, 8, 16)),
         Box((3, 5, 2, 0), (4, 6, 6, 16))),
        (ParamSlot(1, "w5", (4, 0)), Box((3, 6, 0, 0), (4, 7, 8, 16)),
         Box((3, 6, 2, 0), (4, 7, 6, 16))),
    ]
    # Sub-box over both leading axes: layer 2:4, expert 4:6 -> w0, w1, w3, w4.
    two = members(fam, anchor, Box((2, 4, 0, 3), (4, 6, 8, 5)))
    assert [s.name for s, _, _ in two] == ["w0", "w1", "w3", "w4"]
    assert [b for _, _, b in two] == [Box((l, e, 0, 3), (l + 1, e + 1, 8, 5))
                                      for l in (2, 3) for e in (4, 5)]
    assert all(a.shape[:2] == (1, 1) and a.lo[2:] == (0, 0) and a.hi[2:] == (8, 16)
               for _, a, _ in two)


def test_members_of_a_flat_family() -> None:
    fam = StackSlot(FlatSlot(1, 2, "f0", 64), 1, ("f0", "f1", "f2"))
    anchor = Box((5, 0, 0), (8, 4, 4))
    assert members(fam, anchor, Box((6, 1, 0), (8, 3, 4))) == [
        (FlatSlot(1, 2, "f1", 64), Box((6, 0, 0), (7, 4, 4)), Box((6, 1, 0), (7, 3, 4))),
        (FlatSlot(1, 2, "f2", 64), Box((7, 0, 0), (8, 4, 4)), Box((7, 1, 0), (8, 3, 4))),
    ]
    assert [s.name for s, _, _ in members(fam, anchor, Box((5, 0, 0), (6, 1, 1)))] == ["f0"]


@pytest.mark.parametrize("slot", [ParamSlot(0, "p", (2, 0)), FlatSlot(0, 1, "f", 8),
                                  BufferSlot(0, "b")])
def test_plain_slot_is_its_own_only_member(slot) -> None:
    anchor, box = Box((0, 0), (4, 4)), Box((1, 2), (3, 4))
    assert members(slot, anchor, box) == [(slot, anchor, box)]


def test_slot_key_refuses_a_family() -> None:
    fam = StackSlot(ParamSlot(0, "a", (0, 0)), 1, ("a", "b"))
    with pytest.raises(LayoutError):
        slot_key("param", fam)
    with pytest.raises(LayoutError):
        slot_key("exp_avg", StackSlot(FlatSlot(0, 1, "a", 0), 2, ("a", "b", "c", "d")))
    assert slot_key("param", fam.member) == ("param", "ParamSlot", 0, "a")


# ---- the stacked IR against the unstacked one ----------------------------------------------

MOE = dict(num_layers=4, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
           vocab_size=50, make_vocab_size_divisible_by=8, swiglu=False, max_position_embeddings=8,
           num_moe_experts=8, moe_ffn_hidden_size=8, moe_router_topk=2,
           moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
GLU = dict(MOE, swiglu=True)


def _spec(model: dict, world: int, **par: object):
    devices = [f"node{i // 4}:gpu{i % 4}" for i in range(world)]
    return spec_from_dict({"model": model, "parallel": par, "world": {"devices": devices}})


LAYOUTS = [
    # 4 experts per rank, 4 layers, expert DP 2 and 3 (some expert weights cut between shards).
    ("ep2-dp2-distopt", _spec(MOE, 4, ep=2)),
    ("ep2-dp3-distopt", _spec(GLU, 6, ep=2)),
    ("ep4-tp2-distopt", _spec(GLU, 8, tp=2, ep=4)),
    ("ep2-etp2-swiglu", _spec(GLU, 8, tp=2, ep=2, etp=2)),
    ("ep2-no-distopt", _spec(GLU, 4, ep=2, use_distributed_optimizer=False)),
    ("pp2-vpp2-ep2", _spec(dict(GLU, num_layers=8), 8, pp=2, vpp=2, ep=2)),
    ("ep2-buckets", _spec(GLU, 4, ep=2, overlap_grad_reduce=True, bucket_size=700)),
    ("ep2-layer-pattern", _spec(dict(GLU, moe_layer_freq=[1, 0, 1, 1]), 4, ep=2)),
    ("ep2-first-dense", _spec(dict(GLU, moe_first_dense_layers=1), 4, ep=2, pp=2)),
]


def _no_stacking(mp: pytest.MonkeyPatch) -> None:
    """Switch stacking off: every expert weight takes the per-weight path (no templates)."""
    mp.setattr(state_mod, "STACK_FAMILIES", False)


def _views(spec, monkeypatch) -> tuple[StateView, StateView]:
    """A stacked and an unstacked view of ``spec``, each on its own fresh Layout.

    The state caches are per view (``lru_cache`` on methods keys on the view) and the
    module-level caches below the state (shards, buffers, model) never read the switch; the
    stacked view is filled before the patch so nothing it caches can see it, and the
    unstacked one is filled entirely under the patch.
    """
    stacked = StateView(Layout(spec))
    world = stacked.layout.world
    for r in range(world):
        stacked.stored(r)
    with monkeypatch.context() as mp:
        _no_stacking(mp)
        flat = StateView(Layout(spec))
        for r in range(world):
            flat.stored(r)
            flat.regions(r)
    return stacked, flat


def _families(view: StateView, rank: int) -> list:
    return [s for s in view.stored(rank) if type(s.slot) is StackSlot]


def _expanded(stored) -> Counter:
    """Stored entries with families expanded into members, kinds still grouped."""
    return Counter((s.key, s.kinds, box, slot, s.primary) for s in stored
                   for slot, _, box in members(s.slot, s.box, s.box))


@pytest.mark.parametrize("name,spec", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_regions_equal_the_unstacked_ones(name, spec, monkeypatch) -> None:
    stacked, flat = _views(spec, monkeypatch)
    n_stacked = n_flat = 0
    for rank in range(stacked.layout.world):
        # The patch took: no families without stacking; both sides stand for the same state.
        assert not _families(flat, rank)
        got = Counter((r.key, r.kind, r.box, r.slot, r.primary) for r in stacked.regions(rank))
        want = Counter((r.key, r.kind, r.box, r.slot, r.primary) for r in flat.regions(rank))
        assert got == want, f"rank {rank}: {got - want} extra, {want - got} missing"
        assert all(type(r.slot) is not StackSlot for r in stacked.regions(rank))
        assert _expanded(stacked.stored(rank)) == _expanded(flat.stored(rank))
        assert sum(stacked.parts(rank), ()) == stacked.stored(rank)
        for fam in _families(stacked, rank):
            s = fam.slot
            assert len(s.names) == fam.box.numel // Box(fam.box.lo[s.axes:],
                                                         fam.box.hi[s.axes:]).numel >= 2
            assert len(set(s.names)) == len(s.names) and s.member.name == s.names[0]
        n_stacked += len(stacked.stored(rank))
        n_flat += len(flat.stored(rank))
    # Nothing computed under the patch leaked into caches that a later view reads.
    again = StateView(Layout(spec))
    assert all(again.stored(r) == stacked.stored(r) for r in range(stacked.layout.world))
    # Stacking happened, for module params and (with the distributed optimizer) for shards.
    fams = [f for r in range(stacked.layout.world) for f in _families(stacked, r)]
    assert fams and n_stacked < n_flat
    assert any(type(f.slot.member) is ParamSlot for f in fams)
    if spec.parallel.use_distributed_optimizer:
        assert any(type(f.slot.member) is FlatSlot for f in fams)


def test_distopt_splits_expert_weights_between_shards() -> None:
    # Expert DP 3 with SwiGLU cuts some expert weights between optimizer shards, so the
    # equivalence above covers partial flat members next to whole ones.
    view = StateView(Layout(dict(LAYOUTS)["ep2-dp3-distopt"]))
    partial = whole = 0
    for rank in range(view.layout.world):
        sizes = storage_tensors(view, rank)
        for r in view.regions(rank):
            if r.kind == "exp_avg" and "experts" in r.key:
                full = np.prod(sizes[("param", "ParamSlot", r.slot.chunk, r.slot.name)][0])
                assert r.box.numel <= full
                partial += r.box.numel < full
                whole += r.box.numel == full
    assert partial and whole


@pytest.mark.parametrize("name,spec", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_storage_tensors_equal_the_unstacked_ones(name, spec, monkeypatch) -> None:
    stacked, flat = _views(spec, monkeypatch)
    for rank in range(stacked.layout.world):
        with monkeypatch.context() as mp:
            _no_stacking(mp)
            want = storage_tensors(flat, rank)
        assert storage_tensors(stacked, rank) == want
        assert any(k[0] == "param" and "experts" in k[3] for k in want)


# ---- a plan that moves families ------------------------------------------------------------

TRANSITIONS = [
    ("ep2-dp2->ep4-etp2", _spec(GLU, 4, ep=2), _spec(GLU, 8, tp=2, ep=4, etp=2), 1 << 30),
    ("ep4-tp2->ep2-pp2-vpp", _spec(dict(GLU, num_layers=8), 8, tp=2, ep=4),
     _spec(dict(GLU, num_layers=8), 8, pp=2, vpp=2, ep=2, use_distributed_optimizer=False), 4096),
]


def _plan(src_spec, dst_spec, budget):
    src, dst = Layout(src_spec), Layout(dst_spec)
    return src, dst, plan_transition(src, dst, budget)


def _transfers(plan):
    return [t for m in plan.messages() for t in m.transfers]


@pytest.mark.parametrize("name,src,dst,budget", TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_plan_with_families_simulates_bit_exact_and_verifies(name, src, dst, budget) -> None:
    src, dst, plan = _plan(src, dst, budget)
    ts = _transfers(plan)
    fam = [t for t in ts if type(t.src_slot) is StackSlot or type(t.dst_slot) is StackSlot]
    assert fam, "no transfer moves an expert family"
    assert any(type(t.src_slot) is StackSlot and type(t.dst_slot) is StackSlot for t in ts)
    for t in fam:  # both ends expand the box alike (the simulator also checks this)
        got = members(t.src_slot, t.src_anchor, t.box)
        assert [b for _, _, b in got] == [b for _, _, b in members(t.dst_slot, t.dst_anchor, t.box)]
        assert sum(b.numel for _, _, b in got) == t.box.numel

    s, d = transition_views(src, dst)
    rng = np.random.default_rng(3)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) for tk, t in
               s.tensors().items()}
    assert_plan_exact(plan, s, d, tensors, budget)

    report = verify(plan, src, dst)
    assert report.ok, str(report)


def test_rotated_family_names_are_caught() -> None:
    # A family whose member names are rotated writes each expert into its neighbour's tensor:
    # the simulator's destination differs and the verifier reports the writes.
    name, src, dst, budget = TRANSITIONS[0]
    src, dst, plan = _plan(src, dst, budget)
    rounds, done = [], False
    for rnd in plan.rounds:
        msgs = []
        for m in rnd.messages:
            ts = []
            for t in m.transfers:
                sl = t.dst_slot
                if not done and type(sl) is StackSlot and t.dst_anchor == t.box:
                    names = sl.names[1:] + sl.names[:1]
                    t = t._replace(dst_slot=StackSlot(replace(sl.member, name=names[0]),
                                                      sl.axes, names))
                    done = True
                ts.append(t)
            msgs.append(Message(m.src_device, m.dst_device, tuple(ts)))
        rounds.append(Round(tuple(msgs), rnd.order))
    assert done
    bad = replace(plan, rounds=tuple(rounds))
    s, d = transition_views(src, dst)
    rng = np.random.default_rng(4)
    tensors = {tk: rng.standard_normal(t.shape).astype(np.float32) for tk, t in
               s.tensors().items()}
    got = execute(bad, materialize(s, tensors), d)
    want = materialize(d, tensors)
    assert any(not np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    report = verify(bad, src, dst)
    assert not report.ok and "coverage" in report.rules()


# ---- JSON ----------------------------------------------------------------------------------


def test_plan_with_families_round_trips_through_json() -> None:
    name, src, dst, budget = TRANSITIONS[0]
    _, _, plan = _plan(src, dst, budget)
    doc = json.loads(json.dumps(plan_to_json(plan)))
    assert doc["format"] == "dynatrain.plan/3"
    slots = doc["slots"]  # listed once, named by index from the transfers
    stacks = [t for r in doc["rounds"] for m in r for t in m["transfers"]
              if slots[t[5]][0] == "stack" or slots[t[7]][0] == "stack"]
    assert stacks
    assert len({json.dumps(v) for v in slots}) == len(slots)  # each slot once
    back = plan_from_json(doc)
    assert back.rounds == plan.rounds
    assert back == plan
    fam = next(t for t in _transfers(back) if type(t.src_slot) is StackSlot)
    assert type(fam.src_slot.names) is tuple and type(fam.src_slot.member) in (ParamSlot, FlatSlot)


@pytest.mark.parametrize("bad", [
    ["stack", 2, ["buffer", 0, "decoder.layers.0.mlp.router.expert_bias"], ["a", "b"]],
    ["stack", 1, ["stack", 1, ["param", 0, "a", [0, 0]], ["a", "b"]], ["a", "b"]],
    ["stack", 1, ["param", 0, "a", [0, 0]], "ab"],
    ["stack", 1, ["bogus", 0, "a"], ["a", "b"]],
    ["stack", 1],
])
def test_malformed_stack_slot_is_refused(bad) -> None:
    name, src, dst, budget = TRANSITIONS[0]
    _, _, plan = _plan(src, dst, budget)
    doc = json.loads(json.dumps(plan_to_json(plan)))
    slots = doc["slots"]
    t = next(t for r in doc["rounds"] for m in r for t in m["transfers"]
             if slots[t[5]][0] == "stack")
    slots[t[5]] = bad
    with pytest.raises(DynatrainError):
        plan_from_json(doc)


@pytest.mark.parametrize("end", [5, 7], ids=["src-slot", "dst-slot"])
@pytest.mark.parametrize("corrupt", ["names", "axes"])
def test_a_parseable_but_wrong_family_is_reported_not_crashed_on(end, corrupt) -> None:
    # A document that reads back but whose family disagrees with the layouts (a name list cut
    # short, other leading axes) breaks the source or coverage rule; verify does not crash.
    name, src_spec, dst_spec, budget = TRANSITIONS[0]
    src, dst, plan = _plan(src_spec, dst_spec, budget)
    doc = json.loads(json.dumps(plan_to_json(plan)))
    slots = doc["slots"]
    t = next(t for r in doc["rounds"] for m in r for t in m["transfers"]
             if slots[t[end]][0] == "stack")
    slot = json.loads(json.dumps(slots[t[end]]))  # a copy for this transfer alone
    t[end] = len(slots)
    slots.append(slot)
    if corrupt == "names":
        slot[3] = slot[3][:1]
    else:
        slot[1] = 3
    report = verify(plan_from_json(doc), src, dst)
    assert not report.ok
    assert report.rules() == ({"source"} if end == 5 else {"coverage"})


@pytest.mark.parametrize("ref", [-1, 10 ** 6, "0", None, True])
def test_slot_reference_outside_the_table_is_refused(ref) -> None:
    name, src, dst, budget = TRANSITIONS[0]
    _, _, plan = _plan(src, dst, budget)
    doc = json.loads(json.dumps(plan_to_json(plan)))
    doc["rounds"][0][0]["transfers"][0][7] = ref
    with pytest.raises(DynatrainError, match="malformed"):
        plan_from_json(doc)


def test_members_refuses_boxes_outside_the_family() -> None:
    fam = StackSlot(ParamSlot(0, "w2", (0,)), 1, ("w2", "w3"))
    anchor = Box((2, 0), (4, 8))
    assert [m[0].name for m in members(fam, anchor, Box((3, 0), (4, 8)))] == ["w3"]
    for box in (Box((1, 0), (2, 8)), Box((3, 0), (5, 8)), Box((2,), (3,))):
        with pytest.raises(LayoutError, match="not a part of"):
            members(fam, anchor, box)
    short = StackSlot(ParamSlot(0, "w2", (0,)), 1, ("w2",))
    with pytest.raises(LayoutError, match="1-member family"):
        members(short, anchor, Box((2, 0), (3, 8)))


def test_stack_slot_pickles_by_value() -> None:
    import pickle

    fam = StackSlot(FlatSlot(0, 1, "a", 0), 2, ("a", "b", "c", "d"))
    back = pickle.loads(pickle.dumps(fam))
    assert back == fam and hash(back) == hash(fam) and back._hash == hash(
        (fam.member, fam.axes, fam.names))


def test_deeply_nested_stack_slot_is_refused_cleanly() -> None:
    name, src, dst, budget = TRANSITIONS[0]
    _, _, plan = _plan(src, dst, budget)
    doc = plan_to_json(plan)
    nested: list = ["param", 0, "a", [0, 0]]
    for _ in range(3000):
        nested = ["stack", 1, nested, ["a", "b"]]
    doc["slots"][0] = nested
    with pytest.raises(DynatrainError, match="member must be a param or flat slot"):
        plan_from_json(doc)
