"""Buddy copies: a job with one DistributedOptimizer instance loses devices inside an iteration
and recovers with no checkpoint at all (``megatron_support.failures.buddy_worker``).

Every device copies its optimizer state after each step to its own host memory and to its
buddy on another node (``LiveSwitcher(buddy=True)``, ``snapshot``). Each recovery must restore,
bit for bit, the state of the newest step that every survivor and the dead device's buddy hold,
as megatron's own reload of a checkpoint of that step (saved for the test only) gives it in the
survivors' layout; the next iteration's losses must be equal. A copy planted one step behind
must make that comparison fail.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.planner.buddy import buddy_pairs, check_buddy_spec, cover, uncovered
from dynatrain.runtime.megatron.buddy import fill_pieces, newest_common
from dynatrain.ir.state import transition_views
from dynatrain.planner.lost import LostState
from dynatrain.planner.pipeline import plan_transition
from matrix import case
from megatron_support import elastic
from megatron_support import failures as fl
from megatron_support import recovery as rec

MODEL = dict(num_layers=4, num_query_groups=2, swiglu=True, vocab_size=200)
TIMEOUT, COLLECTIVE = 30.0, 6.0
NODES4 = [f"node{i}:gpu0" for i in range(4)]  # four one-device nodes
TWO_BY_TWO = ["node0:gpu0", "node0:gpu1", "node1:gpu0", "node1:gpu1"]


def test_buddy_copies_restore_a_death_in_each_phase_without_a_checkpoint() -> None:
    """DP4 on four nodes loses a process in the gradient reduce-scatter (no survivor stepped),
    then one in its optimizer step (the survivors stepped, the dead device's step is lost with
    it) and one in the parameter all-gather (every process stepped; the dead one never sent
    that step's copy). Each time the survivors go back to the step before the failing
    iteration, from their own copies and the dead device's buddy."""
    base = case("buddy-phases", 4, **MODEL)
    victims = [((NODES4[3],), "reduce_scatter"), ((NODES4[2],), "optimizer_step"),
               ((NODES4[1],), "param_all_gather")]
    with tempfile.TemporaryDirectory(prefix="live_buddy_") as ckpt:
        fns = {d: fl.buddy_worker(base, d, NODES4, victims, ckpt, 12, TIMEOUT, COLLECTIVE)
               for d in NODES4}
        got = elastic.run_processes(fns, may_die=tuple(NODES4[1:]), timeout=400.0)
        assert sorted(got) == [NODES4[0]]
        results = {(phase, d): _read(ckpt, phase, d) for phase in ("reduce_scatter",
                   "optimizer_step", "param_all_gather") for d in NODES4}
    # (the Adam steps the survivors held, the step restored): two finished iterations first.
    want = {"reduce_scatter": ({(2, 2)}, 2), "optimizer_step": ({(3, 4)}, 3),
            "param_all_gather": ({(4, 5)}, 4)}
    for n, (dead, phase) in enumerate(victims):
        survivors = NODES4[:3 - n]
        assert {d for (p, d), e in results.items() if p == phase and e} == set(survivors)
        held, restored = want[phase]
        filled = 0
        for d in survivors:
            e = results[(phase, d)]
            assert e["released"] is not None, (phase, d, e)
            rc = e["recovery"]
            assert rc["failed"] == list(dead) and rc["mode"] == "buddy", (phase, rc)
            assert set(map(tuple, rc["steps"].values())) == held, (phase, rc["steps"])
            assert rc["iteration"] == restored and rc["lost_bytes"] > 0, (phase, rc)
            filled += rc["refilled_bytes"]
            _assert_equal_to_reload((phase, d), e)
        # Each survivor wrote its share of the lost state from the copies; together, all of
        # it (every destination rank holds its own, disjoint, DP shard of it).
        assert filled == results[(phase, survivors[0])]["recovery"]["lost_bytes"], (phase,
                                                                                    filled)


def test_a_whole_node_comes_back_from_its_buddies() -> None:
    """TP2·DP2 on two nodes of two loses node1 (both processes SIGKILLed in a forward pass):
    node0 holds node1's copies of the last finished step and goes on, with no checkpoint."""
    base = case("buddy-node", 4, tp=2, **MODEL)
    node1 = tuple(TWO_BY_TWO[2:])
    with tempfile.TemporaryDirectory(prefix="live_buddy_node_") as ckpt:
        fns = {d: fl.buddy_worker(base, d, TWO_BY_TWO, [(node1, "forward")], ckpt, 12, TIMEOUT,
                                  COLLECTIVE) for d in TWO_BY_TWO}
        got = elastic.run_processes(fns, may_die=node1, timeout=300.0)
    assert sorted(got) == list(TWO_BY_TWO[:2])
    for d, r in got.items():
        e = r["forward"]
        rc = e["recovery"]
        assert rc["failed"] == list(node1) and rc["mode"] == "buddy", (d, rc)
        assert set(map(tuple, rc["steps"].values())) == {(2, 2)}, rc["steps"]
        if e["role"] == "stayed":
            _assert_equal_to_reload(d, e)
    assert any(r["forward"]["role"] == "stayed" for r in got.values())


def test_a_hung_device_comes_back_from_its_buddy() -> None:
    """DP2 on two nodes: node1 stops (SIGSTOP: its sockets stay open) inside its optimizer
    step, after node0 stepped. node0's parameter all-gather is released by the 6 s group
    timeout, the stopped heartbeat names node1, and node0 goes back to the step before from
    its own copy and on alone with node1's, bit for bit megatron's reload."""
    base = case("buddy-hang", 2, **MODEL)
    devices = NODES4[:2]
    with tempfile.TemporaryDirectory(prefix="live_buddy_hang_") as ckpt:
        fns = {d: fl.buddy_worker(base, d, devices, [((devices[1],), "optimizer_step_stop")],
                                  ckpt, 12, TIMEOUT, COLLECTIVE) for d in devices}
        got = elastic.run_processes(fns, may_die=(devices[1],), timeout=300.0)
    e = got[devices[0]]["optimizer_step_stop"]
    assert e["released"] is not None, e
    rc = e["recovery"]
    assert rc["failed"] == [devices[1]] and rc["mode"] == "buddy" and rc["iteration"] == 2, rc
    assert set(map(tuple, rc["steps"].values())) == {(2, 3)}, rc["steps"]  # node0 stepped
    _assert_equal_to_reload(devices[0], e)


def test_a_copy_one_step_behind_is_caught_by_the_comparison() -> None:
    """The same recovery with node0's copy of node1 planted one step behind (the bytes of the
    step before under the newest tag) must not equal megatron's reload: the check can fail."""
    base = case("buddy-plant", 2, **MODEL)
    devices = NODES4[:2]
    with tempfile.TemporaryDirectory(prefix="live_buddy_plant_") as ckpt:
        fns = {d: fl.buddy_worker(base, d, devices, [((devices[1],), "reduce_scatter")], ckpt,
                                  12, TIMEOUT, COLLECTIVE, plant=devices[0]) for d in devices}
        got = elastic.run_processes(fns, may_die=(devices[1],), timeout=300.0)
    e = got[devices[0]]["reduce_scatter"]
    assert e["recovery"]["mode"] == "buddy", e["recovery"]
    assert e["pre"], "a stale buddy copy went unnoticed"


def _read(ckpt: str, phase: str, device: str) -> dict | None:
    path = os.path.join(ckpt, f"{phase}-{device}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _assert_equal_to_reload(d, e: dict) -> None:
    assert e["pre"] == [] and e["post"] == [], (d, e["pre"][:5], e["post"][:5])
    assert e["n_state"] > 10
    assert e["losses"][0]["losses"] == e["losses"][1]["losses"], (d, e["losses"])
    assert e["written"] == [], (d, e["written"])  # no checkpoint was read


# ---- without processes ----------------------------------------------------------------------


def test_buddy_pairs_put_every_copy_on_another_node() -> None:
    assert buddy_pairs(TWO_BY_TWO) == {"node0:gpu0": "node1:gpu0", "node0:gpu1": "node1:gpu1",
                                       "node1:gpu0": "node0:gpu0", "node1:gpu1": "node0:gpu1"}
    assert buddy_pairs(NODES4[:3]) == {NODES4[0]: NODES4[1], NODES4[1]: NODES4[2],
                                       NODES4[2]: NODES4[0]}
    with pytest.raises(DynatrainError, match="two nodes"):
        buddy_pairs(["node0:gpu0", "node0:gpu1"])
    with pytest.raises(DynatrainError, match="no ring"):
        buddy_pairs(["node0:gpu0", "node0:gpu1", "node1:gpu0"])
    pairs = buddy_pairs(TWO_BY_TWO)
    assert uncovered(TWO_BY_TWO[2:], pairs) == frozenset()
    assert uncovered(["node0:gpu0", "node1:gpu0"], pairs) == {"node0:gpu0", "node1:gpu0"}


def test_newest_common_is_the_newest_step_every_copy_shares() -> None:
    pairs = buddy_pairs(NODES4[:3])  # 0 -> 1 -> 2 -> 0
    a, b = NODES4[0], NODES4[1]
    # node2 died; node0 keeps node2's copies. node1 stepped to 4 and copied it; node0 did not.
    holds = {a: {"own": [[2, 2], [3, 3]], "held": [[2, 2], [3, 3]], "ward": NODES4[2]},
             b: {"own": [[3, 3], [4, 4]], "held": [[3, 3], [4, 4]], "ward": a}}
    assert newest_common(holds, (NODES4[2],), pairs) == (3, 3)
    holds[b]["own"] = [[2, 2], [3, 3]]
    holds[a]["held"] = [[1, 1], [2, 2]]  # the dead device's copy of 3 never arrived
    assert newest_common(holds, (NODES4[2],), pairs) == (2, 2)
    holds[a]["held"] = [[0, 0], [1, 1]]  # nothing in common: a checkpoint must do
    assert newest_common(holds, (NODES4[2],), pairs) is None
    assert newest_common({a: holds[a]}, (NODES4[1], NODES4[2]), pairs) is None  # buddy gone


def test_fill_pieces_tile_the_lost_state_exactly() -> None:
    spec = rec.spec_on(case("fill", 4, tp=2, **MODEL), "tp2-dp2", TWO_BY_TWO, tp=2)
    src = Layout(spec)
    dst_spec = rec.spec_on(case("fill", 2, tp=2, **MODEL), "tp2", TWO_BY_TWO[:2], tp=2)
    state = dst_spec.state.model_copy(update={"derive_param": True})
    dst = Layout(dst_spec.model_copy(update={"state": state}))
    gone = frozenset(TWO_BY_TWO[2:])
    plan = plan_transition(src, dst, 1 << 30, failed=gone, allow_lost=True)
    lost = LostState.from_json(plan.stats["lost"])
    assert lost and "param" not in lost.kinds
    sv, dv = transition_views(src, dst)
    pieces = fill_pieces(sv, dv, lost, {d: buddy_pairs(TWO_BY_TWO)[d] for d in gone})
    # Every lost element a destination rank holds, exactly once, from a holder that survives.
    for t in range(dst.world):
        need = sum((reg.box & b).numel for reg in dv.regions(t) for e in lost.entries
                   if (e.key, e.kind) == (reg.key, reg.kind) for b in e.boxes
                   if reg.box & b is not None)
        mine = [p for p in pieces if p.dst_rank == t]
        assert sum(p.box.numel for p in mine) == need > 0
        assert {p.holder for p in mine} <= set(TWO_BY_TWO[:2])
    with pytest.raises(DynatrainError, match="held by no failed device"):
        fill_pieces(sv, dv, lost, {TWO_BY_TWO[2]: TWO_BY_TWO[0]})  # node1:gpu1's copy missing


def test_plan_and_suggest_say_what_buddy_copies_would_restore() -> None:
    spec = rec.spec_on(case("cover", 4, tp=2, **MODEL), "tp2-dp2", TWO_BY_TWO, tp=2)
    whole_node = cover(spec, TWO_BY_TWO, TWO_BY_TWO[2:])
    assert not whole_node.uncovered and whole_node.holders == {
        "node1:gpu0": "node0:gpu0", "node1:gpu1": "node0:gpu1"}
    assert "nothing is lost" in whole_node.line() and "node0" in whole_node.line()
    pair = cover(spec, TWO_BY_TWO, ["node0:gpu0", "node1:gpu0"])  # each the other's buddy
    assert pair.uncovered == ("node0:gpu0", "node1:gpu0") and "lost their buddy" in pair.line()
    one_node = cover(spec, ["node0:gpu0", "node0:gpu1", "node0:gpu2", "node0:gpu3"],
                     ["node0:gpu3"])
    assert one_node.why_none is not None and "two nodes" in one_node.line()
    no_do = rec.spec_on(case("cover", 4, tp=2, use_distributed_optimizer=False, **MODEL),
                        "tp2-dp2", TWO_BY_TWO, tp=2)
    assert "use_distributed_optimizer" in cover(no_do, TWO_BY_TWO, TWO_BY_TWO[2:]).line()
    with pytest.raises(DynatrainError, match="use_distributed_optimizer"):
        check_buddy_spec(no_do)


def test_a_device_and_its_buddy_both_lost_fall_back_to_the_checkpoint() -> None:
    """DP4 on four nodes (buddies 0 -> 1 -> 2 -> 3 -> 0) loses node3 in a forward pass, then,
    while the survivors recover from the copies, node0, which held node3's copies, dies
    building the destination: that recovery fails with exit status 4, the job kept. Called
    again, the copies cannot restore node3's shard (exit status 3, one line saying why); with
    the checkpoint of the last finished iteration the lost shard is refilled from it, bit for
    bit megatron's reload."""
    base = case("buddy-fallback", 4, **MODEL)
    with tempfile.TemporaryDirectory(prefix="live_buddy_fallback_") as ckpt:
        fns = {d: fl.buddy_fallback_worker(base, d, NODES4, NODES4[3], NODES4[0], ckpt, 12,
                                           TIMEOUT, COLLECTIVE) for d in NODES4}
        got = elastic.run_processes(fns, may_die=(NODES4[3], NODES4[0]), timeout=300.0)
    assert sorted(got) == NODES4[1:3]
    for d, r in got.items():
        assert r["released"] is not None, (d, r)
        died, lost = r["tries"][:2]
        assert len(r["tries"]) == 2, r["tries"]
        assert died["code"] == 4 and died["same_job"], died
        assert lost["code"] == 3 and lost["same_job"] and lost["error"].count("\n") == 0, lost
        assert "node3:gpu0's buddy copy was on node0:gpu0, which failed too" in lost["error"]
        rc = r["recovery"]
        assert rc["failed"] == [NODES4[0], NODES4[3]] and rc["mode"] == "refill", (d, rc)
        assert r["pre"] == [] and r["post"] == [], (d, r["pre"][:5])
        assert r["losses"][0]["losses"] == r["losses"][1]["losses"], (d, r["losses"])


DRAWN_PHASES = ("forward", "reduce_scatter", "optimizer_step", "param_all_gather")


@pytest.mark.slow  # the fixed list above covers each phase; this draws combinations (deep run)
@settings(max_examples=8, deadline=None)
@given(phase=st.sampled_from(DRAWN_PHASES), stop=st.booleans(), victim=st.integers(1, 3),
       whole_node=st.booleans())
def test_buddy_copies_restore_a_drawn_failure(phase: str, stop: bool, victim: int,
                                              whole_node: bool) -> None:
    """A drawn phase, death or hang (SIGKILL or SIGSTOP) and victim (a device of DP4 on four
    one-device nodes, or a whole node of TP2·DP2 on two nodes of two): the recovery uses the
    copies, restores the last finished step or the one before, and equals megatron's reload
    of the checkpoint of that step."""
    phase = phase + "_stop" if stop else phase
    if whole_node:
        base, devices = case("buddy-drawn-node", 4, tp=2, **MODEL), TWO_BY_TWO
        dying = tuple(TWO_BY_TWO[2:])
    else:
        base, devices = case("buddy-drawn", 4, **MODEL), NODES4
        dying = (NODES4[victim],)
    with tempfile.TemporaryDirectory(prefix="live_buddy_drawn_") as ckpt:
        fns = {d: fl.buddy_worker(base, d, devices, [(dying, phase)], ckpt, 12, TIMEOUT,
                                  COLLECTIVE) for d in devices}
        got = elastic.run_processes(fns, may_die=dying, timeout=300.0)
    assert sorted(got) == sorted(d for d in devices if d not in dying)
    for d, r in got.items():
        e = r[phase]
        rc = e["recovery"]
        assert rc["failed"] == sorted(dying) and rc["mode"] == "buddy", (d, rc)
        assert rc["iteration"] in (1, 2), rc  # the failure struck iteration 3
        if e["role"] == "stayed":
            _assert_equal_to_reload(d, e)
