"""Live recovery from an unannounced process death, checked against megatron's own reload.

Four forked processes train TP2·DP2 (``megatron_support.recovery``), with a megatron dist
checkpoint after each of two iterations. Right after the second, node0:gpu1 kills itself
(SIGKILL: no warning, no cleanup). It held a TP rank whose params survive on its DP replica
(node0:gpu3), but its DistributedOptimizer shard (fp32 main params and Adam moments) existed
nowhere else. The survivors:

1. notice through the heartbeats that node0:gpu1 stopped (bounded: ``stale_after``);
2. try to recover from a missing checkpoint, a truncated one and the one of the previous step:
   each is refused on every survivor with one line and exit status 2, the job untouched;
3. recover from the checkpoint of this step, without being told who died or where to go: they
   agree on node0:gpu1, take the top ``suggest`` layout for the three survivors (TP1·DP3 on
   gpu0, gpu2, gpu3), move what survives between themselves and refill exactly the lost ranges
   from the checkpoint.

Every survivor's state (params, DDP buffers, DistributedOptimizer state, step, lr/wd,
iteration, consumed samples) then equals, bit for bit, what a fresh TP1·DP3 job loads from that
checkpoint through megatron's own loader, and one more iteration gives both the same losses.
That iteration is checkpointed, then node0:gpu0 kills itself too, and the two survivors recover
told who died and where to go: TP1 on node0:gpu3 (node0:gpu2 leaves), which then holds all the
optimizer state and refills all of the lost third from the checkpoint, again bit for bit equal
to megatron's reload.
"""

from __future__ import annotations

import os
import tempfile

import torch

from matrix import case
from megatron_support import elastic
from megatron_support import recovery as rec

MODEL = dict(num_layers=4, num_query_groups=2, swiglu=True, vocab_size=200)
DEV = [f"node0:gpu{i}" for i in range(4)]
VICTIMS = ("node0:gpu1", "node0:gpu0")
SURVIVORS = ["node0:gpu0", "node0:gpu2", "node0:gpu3"]
LAST = ["node0:gpu3"]
TIMEOUT = 20.0


def test_survivors_recover_from_killed_processes_bit_exact() -> None:
    base = case("a", 4, tp=2, **MODEL)
    with tempfile.TemporaryDirectory(prefix="live_recovery_") as ckpt:
        fns = {d: rec.worker(base, d, DEV, VICTIMS, LAST, ckpt, 6, TIMEOUT) for d in DEV}
        got = elastic.run_processes(fns, may_die=VICTIMS, timeout=180.0)
        assert sorted(got) == ["node0:gpu2", "node0:gpu3"]  # the victims left no result
        # ... but the second one saved what it saw before it died.
        got[VICTIMS[1]] = torch.load(os.path.join(ckpt, f"{VICTIMS[1]}.pt"),
                                     weights_only=False)

    assert sorted(got) == SURVIVORS
    for d, r in got.items():
        # 1. the heartbeats named the dead process within stale_after (1.5 s) plus polling.
        assert r["noticed"] == (VICTIMS[0],), (d, r["noticed"])
        assert r["notice_seconds"] < 5.0, (d, r["notice_seconds"])
        # 2. bad checkpoints: one line, exit status 2, the job kept bit for bit.
        why = {"missing": "no such directory", "truncated": "is truncated",
               "step1": "holds Adam step 1, the job is at step 2"}
        assert [f["what"] for f in r["refused"]] == list(why)
        for f in r["refused"]:
            assert f["error"] is not None, (d, f)
            assert why[f["what"]] in f["error"] and "\n" not in f["error"], (d, f["error"])
            assert f["code"] == 2 and f["same_job"] and f["diffs"] == [], (d, f)
        # 3. detected and recovered into the suggested layout on the three survivors.
        first = r["first"]
        assert first["role"] == "stayed" and first["spec"] == "a tp1 pp1 dp3", (d, first)
        assert first["recovery"]["failed"] == [VICTIMS[0]]
        assert first["recovery"]["devices"] == SURVIVORS
        assert first["micro_batches"] == 2  # global batch 6 over DP3
        _assert_equal_to_reload(d, first)
    lost = got[SURVIVORS[0]]["first"]["recovery"]["lost_bytes"]
    assert lost > 0
    # DP3 shards the optimizer state: every lost element is refilled on exactly one rank.
    assert sum(r["first"]["recovery"]["refilled_bytes"] for r in got.values()) == lost

    # 4. told who died and where to go: TP1 on gpu3; gpu2 leaves.
    assert "second" not in got[VICTIMS[1]]
    left, last = got["node0:gpu2"]["second"], got["node0:gpu3"]["second"]
    assert left["role"] == "left" and left["spec"] is None and "pre" not in left
    assert last["role"] == "stayed" and last["spec"] == "last"
    assert last["recovery"]["failed"] == [VICTIMS[1]]
    assert last["recovery"]["devices"] == LAST
    assert last["micro_batches"] == 6
    _assert_equal_to_reload("node0:gpu3", last)
    # One destination rank holds all the optimizer state: it refilled everything lost.
    assert last["recovery"]["refilled_bytes"] == last["recovery"]["lost_bytes"] > 0


def _assert_equal_to_reload(d: str, e: dict) -> None:
    assert e["pre"] == [] and e["post"] == [], (d, e["pre"][:5], e["post"][:5])
    assert e["n_state"] > 10
    assert e["losses"][0]["losses"] == e["losses"][1]["losses"], (d, e["losses"])
    # The refill wrote exactly this rank's share of the lost ranges, nothing else.
    assert e["written"] == [e["recovery"]["refilled_bytes"]], (d, e["written"], e["recovery"])

def test_roll_call_agreement_and_heartbeats(tmp_path, caplog, monkeypatch) -> None:
    """The store primitives recovery stands on, in one process (no group): a roll call that
    names who did not come and logs who it still waits for, stops early once every missing
    device is known dead, first-writer-wins agreement, and heartbeat staleness."""
    import logging
    import threading
    import time

    import torch.distributed as dist

    from dynatrain.runtime.megatron import Rendezvous, rendezvous
    from dynatrain.runtime.megatron.recovery import Heartbeat, Liveness

    monkeypatch.setattr(rendezvous, "LOG_EVERY", 0.1)
    rdzv = Rendezvous(dist.FileStore(str(tmp_path / "store"), -1), "gloo", prefix="t")
    devs = ["node0:gpu0", "node0:gpu1", "node0:gpu2"]
    late = threading.Timer(0.2, lambda: rdzv.store.set("call/node0:gpu2", "1"))
    late.start()
    with caplog.at_level(logging.INFO, logger="dynatrain.runtime"):
        t = time.monotonic()
        missing = rdzv.present("call", devs, "node0:gpu0", timeout=0.6)
        waited = time.monotonic() - t
    assert missing == ("node0:gpu1",) and 0.6 <= waited < 2.0
    assert "still waiting for node0:gpu1" in caplog.text
    # Known dead: no wait for them.
    t = time.monotonic()
    assert rdzv.present("call2", devs[:2], "node0:gpu0", 30.0,
                        dead=lambda: {"node0:gpu1"}) == ("node0:gpu1",)
    assert time.monotonic() - t < 1.0
    # The first proposal wins; a later, different one gets it back.
    assert rdzv.propose("failed", {"failed": ["node0:gpu1"]}) == {"failed": ["node0:gpu1"]}
    assert rdzv.propose("failed", {"failed": []}) == {"failed": ["node0:gpu1"]}
    # A beating device stays alive; one that stops beating goes stale after stale_after.
    beat = Heartbeat(rdzv, "node0:gpu0", 0.02)
    stopped = Heartbeat(rdzv, "node0:gpu1", 0.02)
    live = Liveness(rdzv, stale_after=0.5)
    time.sleep(0.1)
    stopped.stop()
    assert live.stale(devs[:2]) == set()  # the first look starts the clock
    time.sleep(0.1)
    assert live.stale(devs[:2]) == set()  # not yet stale_after
    time.sleep(0.6)
    assert live.stale(devs[:2]) == {"node0:gpu1"}
    beat.stop()


def test_a_late_survivor_adopts_the_proposal_though_a_replacement_beats(tmp_path) -> None:
    """A survivor released late from a collective finds the failed devices already proposed
    and confirmed by the others, while a replacement process beats under the dead device's
    name (a node back after its failure): it adopts the proposal at once instead of waiting
    ``timeout + collective_timeout`` for that device's roll call."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from dynatrain.runtime.megatron import Rendezvous
    from dynatrain.runtime.megatron.recovery import Heartbeat, Liveness, Recovery

    rdzv = Rendezvous(dist.FileStore(str(tmp_path / "store"), -1), "gloo", prefix="t",
                      timeout=60.0)
    devs = ("node0:gpu0", "node0:gpu1", "node1:gpu0")
    sw = SimpleNamespace(spec=object(), layout=SimpleNamespace(devices=devs), rendezvous=rdzv,
                         device="node0:gpu1", timeout=60.0, collective_timeout=6.0,
                         liveness=Liveness(rdzv, stale_after=0.5))
    rdzv.count("g1/recover/claim", 1)  # the first survivor claimed and announced
    rdzv.store.set("g1/recover/here/node0:gpu0", "1")
    rdzv.propose("g1/recover/failed", {"failed": ["node1:gpu0"]})
    rdzv.post("g1/recover/confirm/node0:gpu0", {"outcome": "ok"})
    replacement = Heartbeat(rdzv, "node1:gpu0", 0.02)  # beats on: never stale
    try:
        t = time.monotonic()
        agreed = Recovery(sw, None, 1).agree_failed(frozenset())
        waited = time.monotonic() - t
    finally:
        replacement.stop()
    assert agreed == ("node1:gpu0",) and waited < 5.0
    # Without a proposal the roll call waits for the beating device (until its timeout).
    rdzv.store.set("g2/recover/here/node0:gpu0", "1")
    rdzv.count("g2/recover/claim", 1)
    beat = Heartbeat(rdzv, "node1:gpu0", 0.02)
    done = threading.Event()
    try:
        worker = threading.Thread(target=lambda: (Recovery(
            SimpleNamespace(**{**vars(sw), "timeout": 1.0, "collective_timeout": 0.5}), None,
            2).agree_failed(frozenset()), done.set()), daemon=True)
        t = time.monotonic()
        worker.start()
        time.sleep(1.0)
        assert not done.is_set()  # still waiting on the beating device
        rdzv.post("g2/recover/confirm/node0:gpu0", {"outcome": "ok"})
        worker.join(10)
        assert done.is_set() and time.monotonic() - t >= 1.5
    finally:
        beat.stop()


def test_the_watchdog_aborts_once_when_a_peer_stops_beating(tmp_path) -> None:
    """``Watchdog`` (what ``LiveSwitcher(abort_after=...)`` starts): nothing while every device
    of the job beats; one abort, naming the device, once one stopped for ``abort_after``."""
    import time

    import torch.distributed as dist

    from dynatrain.runtime.megatron import Rendezvous
    from dynatrain.runtime.megatron.recovery import Heartbeat, Liveness
    from dynatrain.runtime.megatron.watchdog import Watchdog

    rdzv = Rendezvous(dist.FileStore(str(tmp_path / "store"), -1), "gloo", prefix="w")
    devs = ["node0:gpu0", "node0:gpu1"]
    beats = [Heartbeat(rdzv, d, 0.02) for d in devs]
    aborted: list[float] = []
    dog = Watchdog(lambda: devs, Liveness(rdzv, 0.4).stale,
                   abort=lambda: aborted.append(time.monotonic()), poll=0.05)
    time.sleep(1.0)
    assert aborted == [] and dog.fired is None  # all beat: nothing
    stopped = time.monotonic()
    beats[1].stop()
    while not aborted and time.monotonic() - stopped < 5:
        time.sleep(0.02)
    assert len(aborted) == 1 and dog.fired is not None and dog.fired[0] == ("node0:gpu1",)
    # Stale means no change seen for 0.4 s of the dog's clock; the last change it saw can be up
    # to one poll (0.05 s) plus one beat (0.02 s) before ``stopped``.
    assert 0.4 - 0.05 - 0.02 <= aborted[0] - stopped < 2.0
    time.sleep(0.3)
    assert len(aborted) == 1  # at most once
    beats[0].stop()
    dog.stop()


def test_the_watchdog_waits_for_a_peer_that_is_still_starting(tmp_path) -> None:
    """A peer that has not beaten yet (its node still builds the job) is not taken for dead
    within the grace (the job's watchdog: the group timeout or ten times ``abort_after``); once
    it beats it is watched like the others; one that never beats is stale after the grace. A CI
    run aborted on a peer that started 4.5 s late."""
    import time

    import torch.distributed as dist

    from dynatrain.runtime.megatron import Rendezvous
    from dynatrain.runtime.megatron.recovery import Heartbeat, Liveness
    from dynatrain.runtime.megatron.watchdog import Watchdog

    rdzv = Rendezvous(dist.FileStore(str(tmp_path / "store"), -1), "gloo", prefix="s")
    devs = ["node0:gpu0", "node0:gpu1"]
    first = Heartbeat(rdzv, devs[0], 0.02)
    aborted: list[float] = []
    dog = Watchdog(lambda: devs, Liveness(rdzv, 0.3, grace=30.0).stale,
                   abort=lambda: aborted.append(time.monotonic()), poll=0.05)
    time.sleep(1.0)  # gpu1 never beat in three times abort_after
    assert aborted == [] and dog.fired is None
    late = Heartbeat(rdzv, devs[1], 0.02)
    time.sleep(0.5)
    assert aborted == []
    late.stop()
    stopped = time.monotonic()
    while not aborted and time.monotonic() - stopped < 5:
        time.sleep(0.02)
    assert dog.fired is not None and dog.fired[0] == ("node0:gpu1",), dog.fired
    first.stop()
    dog.stop()
    # A counter that does not move from where it was first seen (never beaten, or a name a dead
    # process beat under before) is stale after the grace, not after stale_after.
    rdzv.beat("node0:gpu3")  # a dead process's last beat
    plain, graced = Liveness(rdzv, 0.1), Liveness(rdzv, 0.1, grace=0.6)
    for live in (plain, graced):
        assert live.stale(["node0:gpu2", "node0:gpu3"]) == set()  # the first look
    time.sleep(0.2)
    assert plain.stale(["node0:gpu2", "node0:gpu3"]) == {"node0:gpu2", "node0:gpu3"}
    assert graced.stale(["node0:gpu2", "node0:gpu3"]) == set()
    time.sleep(0.5)
    assert graced.stale(["node0:gpu2", "node0:gpu3"]) == {"node0:gpu2", "node0:gpu3"}
