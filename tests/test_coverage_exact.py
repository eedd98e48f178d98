"""Coverage is proven by exact tiling everywhere a region is "covered", never by counting.

Each place is fed a region set with a duplicate and a hole of the same size, which an element
count cannot tell from a tiling (``test_checkpoint_hostile`` does the same for checkpoints):

* the planner's intersection (``intersect``, the global plan, the intersection with failed
  ranks, and a device's ``plan_slice``): a source layout whose view claims that TP rank 1
  holds rows 256..767 of the embedding (rows 256..511 twice, rows 768..1023 nowhere);
* a lost-state report read back (``LostState.from_json``, what the verifier and a recovery
  read from a plan): boxes that overlap where the true report's boxes were disjoint;
* the verifier's coverage rule: one transfer's box moved onto its neighbour's.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from dynatrain.ir.box import Box
from dynatrain.ir.errors import EXIT_BAD_INPUT, DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.state import transition_views
from dynatrain.planner.intersect import PlanError, intersect
from dynatrain.planner.lost import LostEntry, LostState, first_overlap
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Round
from dynatrain.planner.slices import plan_slice
from dynatrain.verify.check import verify

TINY = ("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml")
EMB = "embedding.word_embeddings.weight"
BUDGET = 1 << 20


def _lying_source() -> tuple[Layout, Layout]:
    """TP2 -> PP2 of the tiny GPT, the source's view claiming TP rank 1 holds embedding rows
    [256, 768) instead of [512, 1024): as many rows as the truth, 256 of them twice."""
    src, dst = (Layout(load_spec(p)) for p in TINY)
    sv, _ = transition_views(src, dst)  # the view the planner will use (one per layout)
    real = sv._dense_stored
    assert [s.box for s in real(0, 1) if s.key == EMB] == [Box((512, 0), (1024, 128))]
    lie = {}

    def lying(pp: int, tp: int):
        part = real(pp, tp)
        if tp != 1:
            return part
        if pp not in lie:  # one tuple per part, as the view's own cache keeps them
            lie[pp] = tuple(dataclasses.replace(s, box=Box((256, 0), (768, 128)))
                            if s.key == EMB else s for s in part)
        return lie[pp]

    sv._dense_stored = lying  # the instance's lookup, ahead of the (cached) method
    return src, dst


def _refused(call) -> str:
    with pytest.raises(PlanError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == EXIT_BAD_INPUT, msg
    assert msg.startswith(f"{EMB} [0:1024, 0:128] [param] on rank "), msg
    assert "the source layout does not tile it: element [256, 0] is in two different " \
           "source boxes ([0:512, 0:128] and [256:768, 0:128])" in msg, msg
    return msg


def test_the_global_plan_refuses_a_duplicate_and_a_hole() -> None:
    src, dst = _lying_source()
    _refused(lambda: plan_transition(src, dst, BUDGET))
    sv, dv = transition_views(src, dst)
    _refused(lambda: intersect(sv, dv))


def test_the_intersection_with_failed_ranks_refuses_it() -> None:
    src, dst = _lying_source()
    sv, dv = transition_views(src, dst)
    _refused(lambda: intersect(sv, dv, failed=frozenset({3})))


@pytest.mark.parametrize("device", ["node0:gpu0", "node0:gpu1"])
def test_a_device_slice_refuses_it(device: str) -> None:
    """gpu0 receives the whole embedding (destination stage 0); gpu1 sends its lying part."""
    src, dst = _lying_source()
    _refused(lambda: plan_slice(src, dst, BUDGET, device, spread=(1 << 16, 1)))


def test_hole_alone_and_truth_are_told_apart() -> None:
    """The same places, with a hole but no duplicate, and with the truth."""
    src, dst = (Layout(load_spec(p)) for p in TINY)
    assert intersect(*transition_views(src, dst)).per_rank  # the truth plans
    src, dst = (Layout(load_spec(p)) for p in TINY)  # fresh views, nothing cached yet
    sv, dv = transition_views(src, dst)
    real = sv._dense_stored
    sv._dense_stored = functools.cache(lambda pp, tp: tuple(
        s for s in real(pp, tp) if not (tp == 1 and s.key == EMB)))
    with pytest.raises(PlanError, match=r"element \[512, 0\] is held by no source rank"):
        intersect(sv, dv)


# ---- lost-state reports ----------------------------------------------------------------------


def _report() -> dict:
    lost = LostState((LostEntry("decoder.layers.mlp.linear_fc1.weight", "exp_avg",
                                (Box((0, 0, 0), (1, 2, 8)), Box((0, 4, 0), (1, 6, 8))), 128),),
                     ("node1:gpu0",))
    doc = json.loads(json.dumps(lost.to_json()))
    assert LostState.from_json(doc) == lost
    return doc


def test_a_lost_report_with_a_duplicate_and_a_hole_is_refused() -> None:
    doc = _report()
    doc["tensors"][0]["boxes"][1] = "[0:1, 1:3, 0:8]"  # rows 4..5 -> 1..2: row 1 twice
    with pytest.raises(DynatrainError) as info:
        LostState.from_json(doc)
    msg = str(info.value)
    assert msg == ("summary.lost: decoder.layers.mlp.linear_fc1.weight [exp_avg]: boxes "
                   "[0:1, 0:2, 0:8] and [0:1, 1:3, 0:8] overlap (a lost report's boxes are "
                   "disjoint)"), msg
    assert info.value.exit_code == EXIT_BAD_INPUT
    doc = _report()
    doc["tensors"][0]["boxes"][1] = doc["tensors"][0]["boxes"][0]  # one box listed twice
    with pytest.raises(DynatrainError, match="overlap"):
        LostState.from_json(doc)
    doc = _report()
    doc["tensors"][0]["boxes"][1] = "[0:2, 0:8]"
    with pytest.raises(DynatrainError, match="differ in their number of dimensions"):
        LostState.from_json(doc)


def test_first_overlap_against_every_pair() -> None:
    """``first_overlap`` finds a pair exactly when some two boxes meet (all pairs, by hand)."""
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(400):
        boxes = []
        for _ in range(rng.randrange(0, 6)):
            lo = tuple(rng.randrange(0, 5) for _ in range(2))
            boxes.append(Box(lo, tuple(x + rng.randrange(1, 3) for x in lo)))
        meets = any(a.meets(b) for a, b in itertools.combinations(boxes, 2))
        pair = first_overlap(boxes)
        assert (pair is not None) == meets, boxes
        if pair is not None:
            assert pair[0].meets(pair[1])
    assert first_overlap([Box((), ()), Box((), ())]) is not None  # a scalar twice
    assert first_overlap([Box((), ())]) is None


# ---- the verifier's coverage rule ------------------------------------------------------------


def test_the_verifier_refuses_a_transfer_moved_onto_its_neighbour() -> None:
    """Two transfers into one region, the second's box set to the first's (same shape, same
    bytes, same element count): written twice there (and never where it was)."""
    src, dst = (Layout(load_spec(p)) for p in TINY)
    plan = plan_transition(src, dst, BUDGET)
    assert verify(plan, src, dst).ok
    seen = {}
    for r, rnd in enumerate(plan.rounds):
        for i, m in enumerate(rnd.messages):
            for j, t in enumerate(m.transfers):
                at = (t.dst_rank, t.key, t.kinds, t.dst_slot, t.dst_anchor)
                first = seen.setdefault(at, t)
                if first is not t and first.box.shape == t.box.shape and first.box != t.box:
                    ts = m.transfers[:j] + (t._replace(box=first.box),) + m.transfers[j + 1:]
                    msgs = (rnd.messages[:i] + (Message(m.src_device, m.dst_device, ts),)
                            + rnd.messages[i + 1:])
                    rounds = plan.rounds[:r] + (Round(msgs, rnd.order),) + plan.rounds[r + 1:]
                    bad = dataclasses.replace(plan, rounds=rounds, stats=dict(plan.stats))
                    report = verify(bad, src, dst)
                    found = [v for v in report.violations if v.rule == "coverage"]
                    # One witness per region: its least point not written exactly once.
                    assert [v.key for v in found] == [t.key], found
                    assert "is written twice" in found[0].detail, found
                    assert found[0].witness == first.box.lo, found
                    return
    raise AssertionError("no region of the plan has two transfers of one shape")
