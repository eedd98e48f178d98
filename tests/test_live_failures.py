"""Failures inside an iteration: bounded release, no checkpoint needed where megatron keeps a
second copy of the optimizer state, rollback in place where the newest checkpoint is old, and
exit status 3 when nothing can restore the lost state (``megatron_support.failures``).

Four forked processes train TP2·DP2 with a checkpoint of iteration 1 only. In iteration 4
node0:gpu1 stops (SIGSTOP) in a forward pass: every survivor's collective is released within
the job's collective timeout (never declared dead). While the survivors recover, node0:gpu0
dies building the destination job: the recovery fails on every survivor (exit status 4, the
job kept) as soon as its heartbeat stops, and is called again. The two survivors agree that
node0:gpu0 and gpu1 are gone and that they hold iteration 3, and, since gpu1's
DistributedOptimizer shard of step 3 exists nowhere else, roll back in place to the
checkpoint in the layout ``suggest`` picks for them. Every survivor's state then equals, bit
for bit, what megatron's own loader gives a fresh job of that layout from that checkpoint
(params, DDP buffers, optimizer state, step, lr/wd, iteration, consumed samples), and the next
iteration's losses are equal. Then node0:gpu2 dies (SIGKILL) in a forward pass: without a
checkpoint the recovery is refused on the last survivor with exit status 3 and the job
untouched; with it it rolls back again, bit for bit.

With ``num_distributed_optimizer_instances=2`` (DP4 on two nodes: every optimizer shard exists
on both, at the same step), a whole node killed inside an iteration loses nothing: the
survivors recover with no checkpoint at all, and hold, bit for bit, the state of the last
finished iteration as megatron's reload of a checkpoint of it (saved for the test only) gives
it in the survivors' layout.
"""

from __future__ import annotations

import tempfile

from matrix import case
from megatron_support import elastic
from megatron_support import failures as fl

MODEL = dict(num_layers=4, num_query_groups=2, swiglu=True, vocab_size=200)
DEV = [f"node0:gpu{i}" for i in range(4)]
STOPPED, IN_RECOVERY, KILLED = "node0:gpu1", "node0:gpu0", "node0:gpu2"
TIMEOUT, COLLECTIVE = 30.0, 6.0


def test_failure_inside_an_iteration_rolls_back_in_place_bit_exact() -> None:
    base = case("a", 4, tp=2, **MODEL)
    with tempfile.TemporaryDirectory(prefix="live_rollback_") as ckpt:
        fns = {d: fl.worker(base, d, DEV, STOPPED, IN_RECOVERY, KILLED, ckpt, 6, TIMEOUT,
                            COLLECTIVE) for d in DEV}
        got = elastic.run_processes(fns, may_die=(STOPPED, IN_RECOVERY, KILLED), timeout=300.0)
    assert sorted(got) == ["node0:gpu3"]  # the victims left no result
    for d, r in got.items():
        first = r["first"]
        # Released by the group timeout (plus the time a peer's own release takes), not hung.
        assert first["released"] is not None, d
        assert first["released"][1] < 3 * COLLECTIVE + 10, (d, first["released"])
        # A death inside the recovery: every survivor's attempt failed (exit status 4, job
        # kept), soon after the dead heartbeat, not at the timeout; the retry went on.
        [tried] = first["tries"]
        assert tried["code"] == 4 and tried["same_job"], tried
        assert tried["seconds"] < TIMEOUT, tried
        rc = first["recovery"]
        assert rc["failed"] == [IN_RECOVERY, STOPPED], (d, rc)
        assert rc["mode"] == "rollback", (d, rc)
        assert set(map(tuple, rc["steps"].values())) == {(3, 3)}, rc["steps"]
        assert rc["iteration"] == 1 and rc["lost_bytes"] > 0, rc
        assert first["role"] == "stayed"
        _assert_equal_to_reload(d, first)
        # Without a checkpoint nothing restores what node0:gpu0 alone held: exit status 3.
        lost = r["lost"]
        assert lost is not None and lost["code"] == 3 and lost["same_job"], (d, lost)
        assert r["second_released"] is not None, r["second_released"]
        assert "state lost" in lost["error"] and "no checkpoint" in lost["error"], lost
        assert lost["error"].count("\n") == 0
        assert STOPPED in r["watchdog"]["fired"] and r["watchdog"]["rearmed"], r["watchdog"]
        second = r["second"]
        assert second["recovery"]["failed"] == [KILLED], second["recovery"]
        assert second["recovery"]["mode"] == "rollback"
        _assert_equal_to_reload(d, second)


TWO_NODES = ["node0:gpu0", "node0:gpu1", "node1:gpu0", "node1:gpu1"]


def test_a_second_optimizer_instance_survives_a_whole_node_without_a_checkpoint() -> None:
    # DP4 with two DistributedOptimizer instances: instance 0 shards over node0's two devices,
    # instance 1 over node1's, so either node holds a whole copy of the optimizer state.
    base = case("instances2", 4, num_distributed_optimizer_instances=2, **MODEL)
    node1 = tuple(TWO_NODES[2:])
    with tempfile.TemporaryDirectory(prefix="live_redundant_") as ckpt:
        fns = {d: fl.redundant_worker(base, d, TWO_NODES, node1, ckpt, 12, TIMEOUT, COLLECTIVE)
               for d in TWO_NODES}
        got = elastic.run_processes(fns, may_die=node1, timeout=300.0)
    assert sorted(got) == TWO_NODES[:2]
    for d, r in got.items():
        assert r["released"] is not None and r["released"][1] < 3 * COLLECTIVE + 10, r
        rc = r["recovery"]
        assert rc["failed"] == list(node1) and rc["mode"] == "exchange", (d, rc)
        assert rc["lost_bytes"] == 0 and rc["refilled_bytes"] == 0 and r["written"] == []
        assert set(map(tuple, rc["steps"].values())) == {(2, 2)}, rc["steps"]
        if r["role"] == "stayed":
            assert r["pre"] == [] and r["post"] == [], (d, r["pre"][:5], r["post"][:5])
            assert r["n_state"] > 10
            assert r["losses"][0]["losses"] == r["losses"][1]["losses"], (d, r["losses"])
    assert any(r["role"] == "stayed" for r in got.values())


# (victim, phase, DP devices to go on with: None takes suggest's choice). The survivors stay
# data-parallel, so that each step ends in a parameter all-gather.
PHASES = [("node0:gpu3", "reduce_scatter", None),
          ("node0:gpu2", "optimizer_step", ["node0:gpu0", "node0:gpu1"]),
          ("node0:gpu1", "param_all_gather", None)]


def test_a_death_in_each_phase_of_the_step_is_refilled_or_rolled_back_exactly() -> None:
    """DP4 with the DistributedOptimizer loses a process in the gradient reduce-scatter (no
    survivor stepped: the checkpoint of the last iteration refills the lost shard exactly), then
    one in its optimizer step and one in the parameter all-gather (the survivors stepped, so the
    step's state is lost with the dead shard: every survivor rolls back to the checkpoint of the
    last finished iteration). Each time, bit for bit megatron's reload of that checkpoint."""
    base = case("phases", 4, **MODEL)
    with tempfile.TemporaryDirectory(prefix="live_phases_") as ckpt:
        fns = {d: fl.phases_worker(base, d, DEV, PHASES, ckpt, 12, TIMEOUT, COLLECTIVE)
               for d in DEV}
        got = elastic.run_processes(fns, may_die=tuple(v[0] for v in PHASES), timeout=400.0)
    assert sorted(got) == ["node0:gpu0"]
    r = got["node0:gpu0"]
    want = {"reduce_scatter": ("refill", {(1, 1)}), "optimizer_step": ("rollback", {(2, 3)}),
            "param_all_gather": ("rollback", {(3, 4)})}
    for victim, phase, _ in PHASES:
        e = r[phase]
        mode, steps = want[phase]
        assert e["released"] is not None, (phase, e)
        assert e["recovery"]["failed"] == [victim], (phase, e["recovery"])
        assert e["recovery"]["mode"] == mode, (phase, e["recovery"])
        assert set(map(tuple, e["recovery"]["steps"].values())) == steps, (phase, e["recovery"])
        _assert_equal_to_reload(phase, e)


def test_a_death_in_a_switchs_exchange_is_recovered_from_the_intact_sources() -> None:
    """DP4 switching in place to TP2·DP2 loses node0:gpu3 as the exchange begins. Every
    survivor's switch fails: its vote gives up within the switch's timeout (a gloo collective
    whose dead member is not a ring neighbour waits that long), and the source layout cannot be
    formed again without node0:gpu3, known at once from its stopped heartbeat rather than after
    another timeout. Their source state intact, the survivors recover: the lost shard refilled
    from the checkpoint of their step, bit for bit megatron's reload of it."""
    base = case("switch-death", 4, **MODEL)
    devices = DEV
    with tempfile.TemporaryDirectory(prefix="live_switch_death_") as ckpt:
        fns = {d: fl.switch_worker(base, d, devices, devices[3], ckpt, 12, TIMEOUT, COLLECTIVE)
               for d in devices}
        got = elastic.run_processes(fns, may_die=(devices[3],), timeout=300.0)
    assert sorted(got) == devices[:3]
    for d, r in got.items():
        assert "could not be formed again" in r["switch"] and "gone" in r["switch"], (d, r)
        assert not r["kept"] and r["failed_after_s"] < TIMEOUT + 10, (d, r)
        assert r["recovery"]["failed"] == [devices[3]], (d, r["recovery"])
        assert r["recovery"]["mode"] == "refill" and r["recovery"]["iteration"] == 1, r
        _assert_equal_to_reload(d, r)


def test_a_death_during_a_checkpoint_save_leaves_a_checkpoint_that_is_refused() -> None:
    """DP3 loses node0:gpu2 while saving the checkpoint of iteration 2: the half-written
    checkpoint is refused on both survivors (exit status 2, job kept), and they roll back to
    the checkpoint of iteration 1, bit for bit megatron's reload of it."""
    base = case("save", 3, **MODEL)
    devices = DEV[:3]
    with tempfile.TemporaryDirectory(prefix="live_save_") as ckpt:
        fns = {d: fl.save_worker(base, d, devices, devices[2], ckpt, 6, TIMEOUT, COLLECTIVE)
               for d in devices}
        got = elastic.run_processes(fns, may_die=(devices[2],), timeout=300.0)
    assert sorted(got) == devices[:2]
    for d, r in got.items():
        assert r["released"] is not None, (d, r)
        partial = r["partial"]
        assert partial is not None and partial["code"] == 2 and partial["same_job"], partial
        assert "it2" in partial["error"] and partial["error"].count("\n") == 0, partial
        assert r["recovery"]["mode"] == "rollback" and r["recovery"]["iteration"] == 1
        _assert_equal_to_reload(d, r)


def test_a_preemption_notice_is_met_by_a_switch_before_the_deadline() -> None:
    """DP4 is told node0:gpu3 leaves in 60 s: it plans while it trains, switches to DP3 at the
    next boundary well within the deadline, and node0:gpu3 leaves; the three hold, bit for bit,
    megatron's reload of the job's checkpoint into DP3."""
    base = case("notice", 4, **MODEL)
    with tempfile.TemporaryDirectory(prefix="live_notice_") as ckpt:
        fns = {d: fl.notice_worker(base, d, DEV, [DEV[3]], ckpt, 12, TIMEOUT, COLLECTIVE)
               for d in DEV}
        got = elastic.run_processes(fns, timeout=300.0)
    assert got[DEV[3]]["role"] == "left"
    for d in DEV[:3]:
        r = got[d]
        assert r["role"] == "stayed" and r["fits"] and r["left_s"] > 0, r
        assert r["predicted"] is not None and r["predicted"] > 0
        assert "dp3" in r["dst"], r["dst"]
        assert r["pre"] == [] and r["post"] == [], (d, r["pre"][:5], r["post"][:5])
        assert r["losses"][0]["losses"] == r["losses"][1]["losses"], (d, r["losses"])


def _assert_equal_to_reload(d: str, e: dict) -> None:
    assert e["pre"] == [] and e["post"] == [], (d, e["pre"][:5], e["post"][:5])
    assert e["n_state"] > 10
    assert e["losses"][0]["losses"] == e["losses"][1]["losses"], (d, e["losses"])
    # A refill writes exactly this rank's share of the lost ranges, a rollback the rank's
    # whole state; nothing else.
    assert e["written"] == [e["recovery"]["refilled_bytes"]], (d, e["written"], e["recovery"])
