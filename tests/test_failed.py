"""Plans from survivors: failed devices send nothing, and what only they held is named exactly.

Hand cases on the shipped specs (tiny-gpt, llama3.1-8b, qwen3-30b-a3b): a DP replica keeps the
params alive, the DistributedOptimizer's shard of a failed rank is lost, DP=1 loses a whole
stage, a tied embedding survives on the last stage. A hypothesis property holds the lost report
to a brute-force count over numpy masks, and holds plans from survivors to the simulator with
every failed rank's storage poisoned (NaN), so that one byte read from it shows.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dynatrain.ir.box import Box
from dynatrain.ir.errors import EXIT_BAD_INPUT, EXIT_LOST, DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.state import StateView, transition_views
from dynatrain.planner.lost import (LostState, StateLost, disjoint_union, expand_failed,
                                    merge_boxes, subtract)
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Round
from dynatrain.planner.serialize import plan_from_json, plan_to_json
from dynatrain.verify.check import verify
from dynatrain.verify.simulate import execute, materialize

from oracle import assert_same_storages
from strategies import POOL, _tp_groups_fit, transitions

SPECS = Path(__file__).resolve().parent.parent / "specs"
OPT = ("main_param", "exp_avg", "exp_avg_sq")
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8}


def doc_of(path: str, **over: object) -> dict:
    doc = yaml.safe_load((SPECS / path).read_text())
    doc = copy.deepcopy(doc)
    for k, v in over.items():
        doc[k] = v
    return doc


def layout(doc: dict) -> Layout:
    return Layout(spec_from_dict(doc))


def devices(*gpus: int, node: int = 0) -> dict:
    return {"devices": [f"node{node}:gpu{g}" for g in gpus]}


# ---- brute force -------------------------------------------------------------------------------


def brute_lost(src: StateView, dst: StateView, failed: frozenset[str],
               derived: tuple[str, ...]) -> dict[tuple[str, str], np.ndarray]:
    """Per (key, kind), the mask of elements the destination needs and no surviving source
    rank holds in any region (tied copies included), element by element."""
    shapes = {tk: t.shape for tk, t in dst.tensors().items()}
    need = {tk: np.zeros(s, bool) for tk, s in shapes.items()}
    have = {tk: np.zeros(s, bool) for tk, s in shapes.items()}
    for r in range(dst.layout.world):
        for reg in dst.regions(r):
            if reg.kind not in derived:
                need[(reg.key, reg.kind)][_sl(reg.box)] = True
    for r, d in enumerate(src.layout.devices):
        if d in failed:
            continue
        for reg in src.regions(r):
            if (reg.key, reg.kind) in have:
                have[(reg.key, reg.kind)][_sl(reg.box)] = True
    return {tk: m for tk in shapes if (m := need[tk] & ~have[tk]).any()}


def _sl(b: Box) -> tuple[slice, ...]:
    return tuple(slice(l, h) for l, h in zip(b.lo, b.hi))


def assert_report_exact(lost: LostState, want: dict[tuple[str, str], np.ndarray],
                        dst: StateView) -> None:
    """The report names exactly the elements of ``want``: disjoint boxes, right bytes."""
    got = {(e.key, e.kind): e for e in lost.entries}
    assert set(got) == set(want)
    total = 0
    for tk, mask in want.items():
        e = got[tk]
        painted = np.zeros(mask.shape, np.int64)
        for b in e.boxes:
            painted[_sl(b)] += 1
        assert painted.max() <= 1, f"{tk}: boxes overlap"
        np.testing.assert_array_equal(painted.astype(bool), mask, err_msg=str(tk))
        nbytes = int(mask.sum()) * ITEMSIZE[dst.tensors()[tk].dtype]
        assert e.nbytes == nbytes and e.numel == mask.sum()
        total += nbytes
    assert lost.nbytes == total


def poisoned_sources(src: StateView, tensors: dict, failed: frozenset[str]) -> list:
    """Source storages with every failed rank's tensors NaN: a byte read from them shows."""
    stores = materialize(src, tensors)
    for r, d in enumerate(src.layout.devices):
        if d in failed:
            for arr in stores[r].values():
                arr[...] = np.nan
    return stores


def random_tensors(view: StateView, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {tk: np.array(rng.standard_normal(t.shape) + 2, np.float32)  # 0-d for the step
            for tk, t in view.tensors().items()}


def assert_survivor_plan_exact(plan, src: StateView, dst: StateView, failed: frozenset[str],
                               lost: dict[tuple[str, str], np.ndarray], seed: int = 3) -> None:
    """No message from a failed device; the destination is bit-exact, lost elements zero."""
    assert not any(m.src_device in failed for m in plan.messages())
    tensors = random_tensors(src, seed)
    if "param" in plan.derived:  # Megatron's invariant the derivation relies on
        for key, kind in list(tensors):
            if kind == "param":
                tensors[(key, kind)] = tensors[(key, "main_param")]
    want = {tk: a.copy() for tk, a in tensors.items()}
    for tk, mask in lost.items():
        want[tk][mask] = 0  # never written: the caller refills them from a checkpoint
    if "param" in plan.derived:
        for key, kind in list(want):
            if kind == "param":
                want[(key, kind)] = want[(key, "main_param")]
    got = execute(plan, poisoned_sources(src, tensors, failed), dst)
    assert_same_storages(got, materialize(dst, want))


# ---- hand cases: tiny-gpt ------------------------------------------------------------------------


def test_tp2_dp2_one_failed_loses_its_optimizer_shard_exactly() -> None:
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml"))
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1), parallel={"tp": 2}))
    failed = frozenset({"node0:gpu3"})
    with pytest.raises(StateLost) as err:
        plan_transition(src, dst, 1 << 20, failed=failed)
    lost = err.value.lost
    assert err.value.exit_code == EXIT_LOST == 3
    s, d = transition_views(src, dst)
    assert_report_exact(lost, brute_lost(s, d, failed, ()), d)
    # The params survive on rank 1 (the DP replica of rank 3); its optimizer shard does not.
    assert lost.kinds == OPT and lost.failed == ("node0:gpu3",)
    # All of rank 3's shard but the norm weights, which TP rank 0's shard (rank 2) holds too.
    assert_lost_is_the_unreplicated_shard_of(lost, s, 3)
    assert not any("norm" in k for k in lost.keys)
    assert lost.numel == 3 * (sum(x.box.numel for x in s.shard_part(3)) - 576)
    text = str(err.value)
    assert "\n" not in text and text == (
        "state lost: 5 tensors, 2.9 MiB of main_param/exp_avg/exp_avg_sq have no surviving "
        "copy (first: decoder.layers.mlp.linear_fc1.weight[0:2, 176:352, 0:128])")
    body = lost.to_text().splitlines()
    assert body[0] == text and body[1] == "  failed devices: node0:gpu3"
    assert ("  decoder.layers.mlp.linear_fc1.weight [main_param, exp_avg, exp_avg_sq]: 90112 "
            "elements, 1.0 MiB, 2 boxes") in body
    assert LostState.from_json(json.loads(json.dumps(lost.to_json()))) == lost


def test_tp2_dp2_one_failed_without_distopt_loses_nothing_and_is_exact() -> None:
    par = {"tp": 2, "use_distributed_optimizer": False}
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml", parallel=par))
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1, 2, 4), parallel=par))
    failed = frozenset({"node0:gpu3"})
    plan = plan_transition(src, dst, 1 << 16, failed=failed)
    assert plan.stats["failed"] == ["node0:gpu3"]
    assert plan.stats["lost"]["tensors"] == [] and plan.stats["lost"]["bytes"] == 0
    assert verify(plan, src, dst).ok
    s, d = transition_views(src, dst)
    assert_survivor_plan_exact(plan, s, d, failed, {})
    # Without the failure the planner reads rank 3's copy for the new device's rank 3.
    full = plan_transition(src, dst, 1 << 16)
    assert any(m.src_device == "node0:gpu3" for m in full.messages())


def test_dp1_pp2_one_failed_loses_a_whole_stage() -> None:
    src = layout(doc_of("tiny-gpt/pp2-dp2.yaml", world=devices(0, 1)))
    dst = layout(doc_of("tiny-gpt/pp2-dp2.yaml", world=devices(0), parallel={}))
    failed = frozenset({"node0:gpu1"})
    with pytest.raises(StateLost) as err:
        plan_transition(src, dst, 1 << 20, failed=failed)
    lost = err.value.lost
    s, d = transition_views(src, dst)
    assert_report_exact(lost, brute_lost(s, d, failed, ()), d)
    # Stage 1: layers 2 and 3, the final norm and the (untied) output layer, every kind.
    assert lost.kinds == ("param", *OPT)
    by = {(e.key, e.kind): e.boxes for e in lost.entries}
    assert by[("decoder.layers.mlp.linear_fc1.weight", "param")] == (
        Box((2, 0, 0), (4, 704, 128)),)
    assert by[("output_layer.weight", "exp_avg")] == (Box((0, 0), (1024, 128)),)
    assert ("decoder.final_layernorm.weight", "main_param") in by
    assert not any(k.startswith("embedding") for k in lost.keys)
    assert all(b.lo[0] >= 2 for e in lost.entries if e.key.startswith("decoder.layers")
               for b in e.boxes)


def test_tied_embedding_survives_on_the_last_stage() -> None:
    model = dict(doc_of("tiny-gpt/pp2-dp2.yaml")["model"],
                 untie_embeddings_and_output_weights=False)
    src = layout(doc_of("tiny-gpt/pp2-dp2.yaml", model=model, world=devices(0, 1),
                        parallel={"pp": 2, "use_distributed_optimizer": False}))
    dst = layout(doc_of("tiny-gpt/pp2-dp2.yaml", model=model, world=devices(1),
                        parallel={"use_distributed_optimizer": False}))
    failed = frozenset({"node0:gpu0"})
    s, d = transition_views(src, dst)
    want = brute_lost(s, d, failed, ())
    with pytest.raises(StateLost) as err:
        plan_transition(src, dst, 1 << 20, failed=failed)
    assert_report_exact(err.value.lost, want, d)
    assert "embedding.word_embeddings.weight" not in err.value.lost.keys  # the tied copy
    plan = plan_transition(src, dst, 1 << 20, failed=failed, allow_lost=True)
    assert verify(plan, src, dst).ok
    assert_survivor_plan_exact(plan, s, d, failed, want)


def test_allow_lost_plans_the_survivors_and_declares_the_rest() -> None:
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml"))
    dst = layout(doc_of("tiny-gpt/pp2-dp2.yaml", world=devices(0, 1)))
    failed = frozenset({"node0:gpu2"})
    s, d = transition_views(src, dst)
    want = brute_lost(s, d, failed, ())
    plan = plan_transition(src, dst, 1 << 14, failed=failed, allow_lost=True)
    assert_report_exact(LostState.from_json(plan.stats["lost"]), want, d)
    assert verify(plan, src, dst).ok
    assert_survivor_plan_exact(plan, s, d, failed, want)
    # Undeclared, the same plan leaves elements unwritten: coverage objects.
    bare = replace(plan, stats={k: v for k, v in plan.stats.items() if k != "lost"})
    assert verify(bare, src, dst).rules() == {"coverage"}


def test_failures_and_lost_state_survive_the_plan_file() -> None:
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml"))
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1), parallel={"tp": 2}))
    plan = plan_transition(src, dst, 1 << 20, failed=frozenset({"node0:gpu3"}), allow_lost=True)
    again = plan_from_json(json.loads(json.dumps(plan_to_json(plan))))
    assert again.stats["failed"] == ["node0:gpu3"]
    assert LostState.from_json(again.stats["lost"]) == LostState.from_json(plan.stats["lost"])
    assert verify(again, src, dst).ok
    # Told that nothing failed, verify finds the declared lost state on rank 3: not lost.
    found = verify(again, src, dst, failed=frozenset())
    assert found.rules() == {"coverage"}
    assert all("declared lost, but surviving source rank 3 (node0:gpu3)" in v.detail
               for v in found.violations)
    forgot = replace(again, stats={k: v for k, v in again.stats.items() if k != "lost"})
    assert "coverage" in verify(forgot, src, dst).rules()


def test_declaring_surviving_state_lost_is_caught() -> None:
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml"))
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1), parallel={"tp": 2}))
    plan = plan_transition(src, dst, 1 << 20, failed=frozenset({"node0:gpu3"}), allow_lost=True)
    doc = copy.deepcopy(plan.stats["lost"])
    doc["tensors"].append({"key": "decoder.final_layernorm.weight", "kind": "param",
                           "elements": 1, "bytes": 2, "boxes": ["[0:1]"]})
    found = verify(replace(plan, stats={**plan.stats, "lost": doc}), src, dst)
    assert any("declared lost, but surviving source rank" in v.detail and
               v.key == "decoder.final_layernorm.weight" for v in found.violations)


def test_a_plan_that_reads_from_a_failed_device_is_caught() -> None:
    par = {"tp": 2, "use_distributed_optimizer": False}
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml", parallel=par))
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1, 2, 4), parallel=par))
    failed = frozenset({"node0:gpu3"})
    plan = plan_transition(src, dst, 1 << 16, failed=failed)
    assert verify(plan, src, dst).ok
    # Mutate: one remote transfer from rank 1 now reads rank 3 (its DP replica, same slots).
    r, i, t = next((r, i, t) for r, rnd in enumerate(plan.rounds)
                   for i, m in enumerate(rnd.messages) for t in m.transfers
                   if t.src_rank == 1 and not m.local)
    m = plan.rounds[r].messages[i]
    moved = t._replace(src_rank=3)
    rest = tuple(x for x in m.transfers if x is not t)
    msgs = list(plan.rounds[r].messages)
    msgs[i:i + 1] = ([Message(m.src_device, m.dst_device, rest)] if rest else []) + [
        Message("node0:gpu3", m.dst_device, (moved,))]
    rounds = list(plan.rounds)
    rounds[r] = Round(tuple(msgs))
    bad = replace(plan, rounds=tuple(rounds))
    found = verify(bad, src, dst)
    assert found.rules() == {"source"}
    assert any("reads from failed device node0:gpu3" in v.detail for v in found.violations)
    assert verify(bad, src, dst, failed=frozenset()).ok  # only the failure makes it wrong


def test_destination_on_a_failed_device_is_bad_input() -> None:
    src = layout(doc_of("tiny-gpt/tp2-dp2.yaml"))
    with pytest.raises(DynatrainError) as err:
        plan_transition(src, src, 1 << 20, failed=frozenset({"node0:gpu1"}))
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert str(err.value) == ("failed: the destination layout places rank 1 on failed device "
                              "node0:gpu1; choose a destination on surviving devices")
    dst = layout(doc_of("tiny-gpt/tp2-dp2.yaml", world=devices(0, 1), parallel={"tp": 2}))
    with pytest.raises(DynatrainError, match="node7:gpu0 is not a device of the source"):
        plan_transition(src, dst, 1 << 20, failed=frozenset({"node7:gpu0"}))
    # A plan whose destination uses a failed device fails verification too.
    plan = plan_transition(src, src, 1 << 20)
    assert "coverage" in verify(plan, src, src, failed=frozenset({"node0:gpu1"})).rules()


def test_expand_failed() -> None:
    devs = [f"node{n}:gpu{g}" for n in range(2) for g in range(2)]
    assert expand_failed("node1,node0:gpu1", devs) == {"node1:gpu0", "node1:gpu1",
                                                       "node0:gpu1"}
    assert expand_failed(["node0:gpu0"], devs) == {"node0:gpu0"}
    for bad in ("node2", "node0:gpu9", "node0,,node1"):
        with pytest.raises(DynatrainError, match="^--failed: ") as err:
            expand_failed(bad, devs)
        assert "\n" not in str(err.value) and err.value.exit_code == EXIT_BAD_INPUT


def test_box_union_and_merge() -> None:
    a, b = Box((0, 0), (4, 4)), Box((2, 2), (6, 6))
    parts = subtract(a, b)
    assert sum(p.numel for p in parts) == 12 and all(p & b is None for p in parts)
    union = disjoint_union([a, b, a])
    assert sum(p.numel for p in union) == 28
    assert merge_boxes([Box((0,), (2,)), Box((2,), (5,)), Box((6,), (7,))]) == [
        Box((0,), (5,)), Box((6,), (7,))]
    assert disjoint_union([Box((), ()), Box((), ())]) == [Box((), ())]


# ---- hand cases: the shipped llama3.1-8b and qwen3-30b-a3b -----------------------------------


def assert_lost_is_the_unreplicated_shard_of(lost: LostState, src: StateView, rank: int) -> None:
    """The report is exactly what of ``rank``'s optimizer shard no other rank holds, by box
    algebra (the tensors are too big for masks): the lost boxes are disjoint and inside the
    shard, no surviving rank holds any of their elements, and each box of the shard is either
    lost whole or held whole by a survivor (a TP-replicated norm's shard on the other TP rank).
    """
    shard: dict[tuple[str, str], list[Box]] = {}
    for x in src.shard_part(rank):
        for k in x.kinds:
            shard.setdefault((x.key, k), []).append(x.box)
    held: dict[tuple[str, str], set[Box]] = {}
    for r in range(src.layout.world):
        if r != rank:
            for x in src.stored(r):
                for k in x.kinds:
                    held.setdefault((x.key, k), set()).add(x.box)
    got = {(e.key, e.kind): e.boxes for e in lost.entries}
    assert set(got) <= set(shard)
    for tk, boxes in shard.items():
        mine = got.get(tk, ())
        assert all(x & y is None for i, x in enumerate(mine) for y in mine[i + 1:])
        assert not any(lb & h is not None for lb in mine for h in held.get(tk, ()))
        covered = 0
        for b in boxes:
            part = sum(c.numel for lb in mine if (c := lb & b) is not None)
            whole = any(h.lo <= b.lo and all(hl <= bl and bh <= hh for hl, bl, bh, hh in
                                                 zip(h.lo, b.lo, b.hi, h.hi))
                        for h in held.get(tk, ()))
            assert (part == b.numel) != whole, (tk, b)
            covered += part
        assert covered == sum(lb.numel for lb in mine)  # nothing lost outside the shard


def test_llama_8b_tp2_dp4_one_failed() -> None:
    src = layout(doc_of("llama3.1-8b/tp2-dp4.yaml"))
    dst = layout(doc_of("llama3.1-8b/tp2-dp4.yaml", world=devices(0, 1, 2, 3, 4, 6)))
    failed = frozenset({"node0:gpu5"})
    with pytest.raises(StateLost) as err:
        plan_transition(src, dst, 1 << 30, failed=failed)
    s, _ = transition_views(src, dst)
    assert_lost_is_the_unreplicated_shard_of(err.value.lost, s, 5)
    assert err.value.lost.kinds == OPT
    par = {"tp": 2, "use_distributed_optimizer": False}
    src = layout(doc_of("llama3.1-8b/tp2-dp4.yaml", parallel=par))
    dst = layout(doc_of("llama3.1-8b/tp2-dp4.yaml", world=devices(0, 1, 2, 3, 4, 6),
                        parallel=par))
    plan = plan_transition(src, dst, 1 << 30, failed=failed)
    assert plan.stats["lost"]["bytes"] == 0 and verify(plan, src, dst).ok
    assert not any(m.src_device == "node0:gpu5" for m in plan.messages())


def test_qwen3_30b_one_failed_loses_its_dense_and_expert_shards() -> None:
    src = layout(doc_of("qwen3-30b-a3b/tp2-pp2-ep4.yaml"))
    dst = layout(doc_of("qwen3-30b-a3b/tp2-pp2-ep4.yaml", world={"nodes": 1,
                                                                 "gpus_per_node": 8}))
    failed = expand_failed("node1:gpu7", src.devices)
    with pytest.raises(StateLost) as err:
        plan_transition(src, dst, 1 << 30, failed=failed)
    s, _ = transition_views(src, dst)
    assert_lost_is_the_unreplicated_shard_of(err.value.lost, s, 15)
    assert any(".experts." in k for k in err.value.lost.keys)
    assert any(".experts." not in k for k in err.value.lost.keys)


# ---- the property --------------------------------------------------------------------------------


@st.composite
def failures(draw: st.DrawFn):
    """A transition, a non-empty set of failed source devices, and the destination moved onto
    survivors (the source's first, then spare devices)."""
    t = draw(transitions(max_world=8))
    src = Layout(t.src)
    # Mostly one device or one node, as failures come; sometimes more, up to all of them.
    one_node = [d for d in src.devices if d.split(":")[0] == src.devices[-1].split(":")[0]]
    failed = frozenset(draw(st.one_of(
        st.sampled_from(src.devices).map(lambda d: {d}), st.just(set(one_node)),
        st.sets(st.sampled_from(src.devices), min_size=1, max_size=len(src.devices)))))
    alive = [d for d in src.devices if d not in failed]
    spare = [d for d in POOL if d not in src.devices]
    if draw(st.booleans()):
        pool = draw(st.permutations(alive)) + draw(st.permutations(spare))
    else:
        pool = draw(st.permutations(alive + spare))
    world = Layout(t.dst).world
    dst_doc = dict(t.dst_doc, world={"devices": list(pool[:world])})
    dst_spec = spec_from_dict(dst_doc)
    place = t.place if _tp_groups_fit(dst_spec) else "naive"
    return t, src, Layout(dst_spec), failed, place


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(failures())
def test_lost_report_is_exact_and_survivor_plans_are_bit_exact(case) -> None:
    t, src, dst, failed, place = case
    s, d = transition_views(src, dst)
    derived = ("param",) if t.derive else ()
    want = brute_lost(s, d, failed, derived)
    event("state lost" if want else "nothing lost")
    if want:
        with pytest.raises(StateLost) as err:
            plan_transition(src, dst, t.budget, place=place, failed=failed)
        assert_report_exact(err.value.lost, want, d)
        assert err.value.exit_code == EXIT_LOST
        plan = plan_transition(src, dst, t.budget, place=place, failed=failed, allow_lost=True)
    else:
        plan = plan_transition(src, dst, t.budget, place=place, failed=failed)
        assert plan.stats["lost"]["tensors"] == []
    report = verify(plan, src, dst)  # a plan placed by --place auto: a permutation of dst's
    assert report.ok, str(report)
    assert_survivor_plan_exact(plan, s, d, failed, want)
