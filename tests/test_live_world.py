"""World shrink and grow of a live megatron-core job, checked against megatron's own
dist-checkpoint reload.

Forked processes (``megatron_support.elastic``) meet through a ``Rendezvous`` on one store. The
job trains in A = TP2·DP2 on four devices, then (every switch planned while the job runs):

1. shrinks to B = TP2·DP1 on gpu0 and gpu2: gpu1 leaves and idles as a spare, gpu3 leaves and
   exits; a fresh process for gpu3 is started afterwards (it reaches the job only through the
   store);
2. tries to grow to TP1·DP4 on gpu0, gpu2, gpu4-5, whose processes never come: the switch
   group never forms, the sources roll back (groups formed again, job rebuilt);
3. tries to grow to C = PP2·VPP2·DP2 on gpu0-3 while the destination build fails on the fresh
   gpu3, first at the boundary where the job and the joiners build it ahead (every process
   learns it; the job trains on exactly as before), then at the switch: the commit vote fails
   after the exchange, everyone rolls back, the joiners' ``join`` fails and they wait again;
4. grows to C with the spare (gpu1, between the job's devices in C's order) and the fresh
   process (gpu3).

After each committed switch every destination process holds, bit for bit, what a fresh job of
the destination loads from megatron's dist-checkpoint of the source (model, DDP buffers,
DistributedOptimizer state, step, lr/wd, iteration, samples), and one more iteration gives
both the same losses and state. After each rollback the job equals its state before the switch
bit for bit and evaluates the next batch to the same loss. The global batch stays 8 samples:
micro-batches per rank go 4 (DP2) -> 8 (DP1) -> 4 (DP2); A -> B changes only DP, so the next
batch's loss before (A) and after (B) may differ only in summation order.

A second run switches a MoE job with the router's expert_bias across EP and ETP changes:
EP2·ETP2 on four devices -> EP2·ETP1 on two (gpu2-3 exit) -> EP4 on four, gpu2-3 being freshly
started processes. VPP jobs run with Megatron-LM's p2p defaults (``elastic.megatron_lm_config``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass

import pytest

from dynatrain.ir.loader import spec_from_dict
from dynatrain.runtime.megatron import (LiveSwitcher, Rendezvous, SwitchFailed, SwitchResult)
from dynatrain.verify.check import check
from matrix import MOE, case, to_harness_cfg, to_spec, to_spec_dict
from megatron_support import elastic, live

MODEL = dict(num_layers=4, num_query_groups=2, swiglu=True, vocab_size=200)
MOE_MODEL = dict(num_layers=2, swiglu=True, vocab_size=200, **MOE, **live.EXPERT_BIAS)
TIMEOUT = 20.0
MISSING_TIMEOUT = 2.0  # how long the switch group waits for processes that never come
DEV = [f"node0:gpu{i}" for i in range(4)]
STAY, LEAVE = (DEV[0], DEV[2]), (DEV[1], DEV[3])  # the dense job's shrink


@dataclass
class Scenario:
    """Layouts (the first one is where the job starts, on ``DEV``), the switches every process
    follows (destination, what happens), the devices whose processes exit when they leave
    (the others idle as spares) and the fresh processes started when the first switch runs."""

    cases: dict[str, dict]
    schedule: list[tuple[str, str]]
    exit_on_leave: tuple[str, ...]
    fresh: tuple[str, ...]
    fail_fresh_build: str | None = None  # a fresh process's first builds of this layout fail
    fail_fresh_builds: int = 1  # how many of them
    global_batch: int = 8
    build_ahead_at: tuple[int, ...] = ()  # switches whose destination job is built ahead
    fresh_first: bool = False  # start the fresh processes before the first prepare
    timeout: float = TIMEOUT  # the rendezvous's and the switches' (groups made ahead too)

    def specs(self) -> dict:
        out = {k: to_spec(c) for k, c in self.cases.items()}
        for k, c in self.cases.items():
            if "devices" in c:  # an explicit device list
                doc = to_spec_dict({n: v for n, v in c.items() if n != "devices"})
                doc["world"] = {"devices": c["devices"]}
                out[k] = spec_from_dict(doc)
        return out


DENSE = Scenario(
    cases={"a": case("a", 4, tp=2, **MODEL),
           "b": dict(case("b", 2, tp=2, **MODEL), devices=list(STAY)),
           "c": case("c", 4, pp=2, vpp=2, **MODEL),
           "dp4": dict(case("dp4", 4, **MODEL), devices=[*STAY, "node0:gpu4", "node0:gpu5"])},
    schedule=[("b", "commit"), ("dp4", "missing"), ("c", "build fails"), ("c", "commit")],
    exit_on_leave=("node0:gpu3",), fresh=("node0:gpu3",), fail_fresh_build="c",
    fail_fresh_builds=2, build_ahead_at=(0, 2, 3))
# gpu3 leaves (and exits) while a freshly started gpu4 joins, in one switch: a node replaced
REPLACE = Scenario(
    cases={"a": case("a", 4, tp=2, **MODEL),
           "r": dict(case("r", 4, tp=2, **MODEL), devices=[*DEV[:3], "node0:gpu4"])},
    schedule=[("r", "commit")], exit_on_leave=("node0:gpu3",), fresh=("node0:gpu4",),
    build_ahead_at=(0,), fresh_first=True)
# the same, gpu4 started only when the switch runs: after the job's processes gave up making
# the worlds ahead (they wait ``timeout`` for it)
REPLACE_LATE = dataclasses.replace(REPLACE, fresh_first=False, timeout=8.0)
MOE_ETP = Scenario(
    cases={"ma": case("ma", 4, ep=2, etp=2, **MOE_MODEL),
           "mb": case("mb", 2, ep=2, etp=1, **MOE_MODEL),
           "mc": case("mc", 4, ep=4, etp=1, **MOE_MODEL)},
    schedule=[("mb", "commit"), ("mc", "commit")],
    exit_on_leave=("node0:gpu2", "node0:gpu3"), fresh=("node0:gpu2", "node0:gpu3"))


def _worker(sc: Scenario, device: str, fresh: bool, ckpt: str):
    specs = sc.specs()
    first = next(iter(sc.cases))
    configs = {s.name: elastic.megatron_lm_config(
        to_harness_cfg({k: v for k, v in sc.cases[k].items() if k != "devices"}))
        for k, s in specs.items()}

    def fn(store) -> dict:
        rdzv = Rendezvous(store, "gloo", prefix="job", timeout=sc.timeout)
        tr = elastic.Trainer(configs, sc.global_batch)
        fail_build = {"left": sc.fail_fresh_builds if fresh and sc.fail_fresh_build else 0}

        def build(spec):
            job = tr.build(spec)
            if fail_build["left"] and spec.name == sc.fail_fresh_build:
                # At the end: a build that fails inside its collectives (the tied embedding's
                # all-reduce) fails its peers too, but only at their timeout.
                fail_build["left"] -= 1
                raise RuntimeError("injected build failure")
            return job

        out: dict = {"device": device, "events": []}
        kw = dict(rendezvous=rdzv, timeout=sc.timeout, check_transfers=True,
                  init_kwargs=dict(create_gloo_process_groups=False))
        if not fresh:
            rdzv.form("start", DEV, device)
            live.init_parallel(configs[first])
            job = tr.build(specs[first])
            for _ in range(2):
                tr.step(job)
            sw = LiveSwitcher(specs[first], device, build, check, **kw)
            step = 0
        else:
            sw, job, step = LiveSwitcher(None, device, build, check, **kw), None, None

        while True:
            if job is None:  # a spare
                try:
                    res = sw.join()
                except SwitchFailed as e:
                    out["events"].append(("join failed", str(e)))
                    continue
                if res is None:
                    out["events"].append(("closed",))
                    return out
                job, step = res.job, res.generation - 1
                out["events"].append(_checked(tr, res, specs[sc.schedule[step][0]], ckpt, step))
                step += 1
                continue
            if step == len(sc.schedule):
                out["final"] = tr.step(job)
                sw.close()
                return out
            name, what = sc.schedule[step]
            if sc.fresh_first and device == "node0:gpu1" and step == 0:
                for d in sc.fresh:  # waiting as spares before the switch is announced
                    elastic.trigger(store, f"fresh-{d}")
                for d in sc.fresh:
                    assert rdzv.wait(f"spare/{d}", 60.0) is not None, d
            sw.prepare(specs[name]).result()
            ahead: dict = {}
            if step in sc.build_ahead_at:  # the job must be exactly as before it afterwards
                pre = tr.state(job)
                ahead["why"] = sw.build_ahead(job)  # and the exchange made ahead
                ahead["diffs"] = live.native_diffs(pre, tr.state(job))
            path = os.path.join(ckpt, str(step))
            tr.save(job, path)
            before = tr.state(job)
            eval_before = tr.step(job, forward_only=True)
            rdzv.timeout = MISSING_TIMEOUT if what == "missing" else sc.timeout
            if device == "node0:gpu1" and step == 0 and not sc.fresh_first:
                for d in sc.fresh:
                    elastic.trigger(store, f"fresh-{d}")  # start it while the job switches
            try:
                res = sw.switch(job)
            except SwitchFailed as e:
                rdzv.timeout = sc.timeout
                restored = e.job
                out["events"].append({
                    "step": step, "rolled_back": str(e), "same_object": restored is job,
                    "ahead": ahead,
                    "diffs": live.native_diffs(before, tr.state(restored)),
                    "eval": (eval_before, tr.step(restored, forward_only=True))})
                job, step = restored, step + 1
                continue
            rdzv.timeout = sc.timeout
            if res.role == "left":
                out["events"].append({"step": step, "left": True, "seconds": res.seconds,
                                      "ahead": ahead, "report": res.report})
                if device in sc.exit_on_leave:
                    return out  # leaves and exits
                job, step = None, None  # idles as a spare
                continue
            event = _checked(tr, res, specs[name], ckpt, step)
            event["eval_before"] = eval_before
            event["ahead"], event["report"] = ahead, res.report
            out["events"].append(event)
            job, step = res.job, step + 1

    return fn


def _run(sc: Scenario) -> dict[str, list]:
    with tempfile.TemporaryDirectory(prefix="live_world_ckpt_") as ckpt:
        fns = {d: _worker(sc, d, False, ckpt) for d in DEV}
        late = {f"fresh-{d}": (f"fresh-{d}", _worker(sc, d, True, ckpt)) for d in sc.fresh}
        got = elastic.run_processes(fns, late=late)
    for name, r in got.items():
        r["events"].append({"final": r.get("final")})
    return {name: r["events"] for name, r in got.items()}


def _checked(tr, res: SwitchResult, spec, ckpt: str, step: int) -> dict:
    """The switched job against a fresh job loaded from the source's dist-checkpoint."""
    ref = tr.reference(spec, os.path.join(ckpt, str(step)))
    ev = {"step": step, "role": res.role, "seconds": res.seconds,
          "bytes_received": res.report["bytes_received"],
          "world_ahead": res.report["world_ahead"], "groups_ahead": res.report["groups_ahead"],
          "built_ahead": res.report["built_ahead"], "built_at_switch": "build" in res.seconds,
          "prepared": (res.report["prepared_ahead"], res.report["prepared_why"]),
          "pre": live.native_diffs(tr.state(ref), tr.state(res.job)),
          "n_state": len(tr.state(ref)),
          "eval_after": tr.step(res.job, forward_only=True)}
    ev["losses"] = (tr.step(res.job), tr.step(ref))
    ev["post"] = live.native_diffs(tr.state(ref), tr.state(res.job))
    return ev


def test_world_shrinks_and_grows_with_spare_and_fresh_processes() -> None:
    ev = _run(DENSE)

    # 1. shrink: gpu0 and gpu2 stay and equal the checkpoint reload; gpu1 (spare) and gpu3
    # leave.
    for d in STAY:
        e = ev[d][0]
        assert e["role"] == "stayed" and e["pre"] == [] and e["post"] == [], (d, e)
        assert e["n_state"] > 10
        # Devices only left: the destination's world and megatron's groups were made while
        # the job trained, and the switch formed no group; the destination job was built in
        # that world at the boundary before, which left the source job exactly as it was.
        assert e["world_ahead"] and e["groups_ahead"] > 10, (d, e["groups_ahead"])
        assert e["ahead"] == {"why": None, "diffs": []}, (d, e["ahead"])
        assert e["report"]["built_ahead"] and "build" not in e["seconds"], (d, e["seconds"])
        assert tuple(e["prepared"]) == (True, None), (d, e["prepared"])  # its exchange too
        assert e["losses"][0]["losses"] == e["losses"][1]["losses"]
        # Only DP changed: the same 8 samples give the same loss up to summation order.
        before, after = e["eval_before"]["global_loss"], e["eval_after"]["global_loss"]
        assert abs(before - after) <= 1e-12 * abs(before), (before, after)
        assert (e["eval_before"]["micro_batches"], e["eval_after"]["micro_batches"]) == (4, 8)
    assert ev["node0:gpu3"][0]["left"] and len(ev["node0:gpu3"]) == 2  # left, then exited
    assert ev["node0:gpu1"][0]["left"]
    for d in LEAVE:  # the leaving processes built nothing, and agreed
        assert ev[d][0]["ahead"] == {"why": None, "diffs": []}, ev[d][0]["ahead"]
        assert ev[d][0]["report"]["built_ahead"], ev[d][0]["report"]
        assert ev[d][0]["report"]["prepared_ahead"], ev[d][0]["report"]["prepared_why"]

    # 2. gpu4-5 never come: the sources roll back.
    # 3. the build fails on the fresh gpu3: everyone rolls back after the exchange.
    for d in STAY:
        for e in ev[d][1:3]:
            assert "rolled back" in e["rolled_back"] and not e["same_object"], (d, e)
            assert e["diffs"] == [], (d, e["diffs"][:5])
            assert e["eval"][0]["losses"] == e["eval"][1]["losses"]
    # The build ahead of step 3 failed on the fresh gpu3: every process of the job learnt it,
    # and the job was exactly as before; the switch built at its own time (and failed).
    for d in STAY:
        why = ev[d][2]["ahead"]["why"]
        assert why and why.startswith("building ahead failed"), (d, why)
        assert ev[d][2]["ahead"]["diffs"] == [], (d, ev[d][2]["ahead"]["diffs"][:5])
    assert ev["node0:gpu1"][1][0] == "join failed"
    assert ev["fresh-node0:gpu3"][0][0] == "join failed"
    assert "injected build failure" in ev["fresh-node0:gpu3"][0][1]

    # 4. grow: stayed (gpu0, gpu2), joined from a spare (gpu1) and freshly started (gpu3).
    final = {"node0:gpu0": ev["node0:gpu0"][3], "node0:gpu2": ev["node0:gpu2"][3],
             "node0:gpu1": ev["node0:gpu1"][2], "node0:gpu3": ev["fresh-node0:gpu3"][1]}
    roles = {d: e["role"] for d, e in final.items()}
    assert roles == {"node0:gpu0": "stayed", "node0:gpu2": "stayed", "node0:gpu1": "joined",
                     "node0:gpu3": "joined"}
    _assert_equal_to_reload(final)
    assert all(e["eval_after"]["micro_batches"] == 4 for e in final.values())
    # Devices joined (one between the job's devices in the destination's order): the
    # destination's world and groups were made while the job trained (with the joiners,
    # while they waited), and the destination job was built in that world at the boundary
    # before, by the job's processes and the joiners together; the job's source state stayed
    # exactly as it was.
    for d, e in final.items():
        assert e["world_ahead"] and e["groups_ahead"] > 10, (d, e["groups_ahead"])
        assert e["built_ahead"] and not e["built_at_switch"], (d, e["seconds"])
        # Each process's part of the exchange was made ahead too (a joiner's: its receives).
        assert tuple(e["prepared"]) == (True, None), (d, e["prepared"])
    for d in STAY:
        assert final[d]["ahead"] == {"why": None, "diffs": []}, (d, final[d]["ahead"])
    # Every process of the last layout trained one more iteration together.
    assert all(ev[n][-1]["final"] is not None
               for n in ("node0:gpu0", "node0:gpu1", "node0:gpu2", "fresh-node0:gpu3"))


def test_a_device_leaves_and_another_joins_in_one_switch() -> None:
    """TP2·DP2 on gpu0-3 -> TP2·DP2 on gpu0-2 and gpu4: gpu3 leaves and exits, a process
    started for gpu4 while the job trains joins. Neither world holds the other: the switch's
    world (all five processes) and the destination's with megatron's groups were made while
    the job trained, the destination job built at the boundary before (by the job's
    processes that stay and the joiner; the one that leaves builds nothing), leaving the job
    exactly as it was; every destination process equals megatron's reload."""
    ev = _run(REPLACE)
    final = {d: ev[d][0] for d in DEV[:3]} | {"node0:gpu4": ev["fresh-node0:gpu4"][0]}
    assert {d: e["role"] for d, e in final.items()} == {
        "node0:gpu0": "stayed", "node0:gpu1": "stayed", "node0:gpu2": "stayed",
        "node0:gpu4": "joined"}
    _assert_equal_to_reload(final)
    assert ev["node0:gpu3"][0]["left"] and len(ev["node0:gpu3"]) == 2  # left, then exited
    for d in (*DEV[:3], "node0:gpu3"):
        assert ev[d][0]["ahead"] == {"why": None, "diffs": []}, (d, ev[d][0]["ahead"])
        assert ev[d][0]["report"]["built_ahead"] and ev[d][0]["report"]["world_ahead"], d
    for d, e in final.items():
        assert e["world_ahead"] and e["groups_ahead"] > 10, (d, e["groups_ahead"])
        assert e["built_ahead"] and not e["built_at_switch"], (d, e["seconds"])
        assert tuple(e["prepared"]) == (True, None), (d, e["prepared"])
    assert ev["node0:gpu3"][0]["report"]["prepared_ahead"]  # a leaver's sends, made ahead
    assert all(ev[n][-1]["final"] is not None
               for n in ("node0:gpu0", "node0:gpu1", "node0:gpu2", "fresh-node0:gpu4"))


def test_a_joiner_that_comes_after_the_job_gave_up_waiting_is_taken_in_at_the_switch() -> None:
    """REPLACE with gpu4 started only when the switch runs: the job's processes waited for it
    to make the worlds ahead (the build ahead says so) and gave up. At the switch gpu4's own
    attempt still waits for them; it stops at the first vote without the world made ahead,
    instead of voting after everyone else's wait ran out, and the switch forms its groups and
    builds then: every destination process equals megatron's reload."""
    ev = _run(REPLACE_LATE)
    final = {d: ev[d][0] for d in DEV[:3]} | {"node0:gpu4": ev["fresh-node0:gpu4"][0]}
    assert {d: e.get("role") for d, e in final.items()} == {
        "node0:gpu0": "stayed", "node0:gpu1": "stayed", "node0:gpu2": "stayed",
        "node0:gpu4": "joined"}, {d: e.get("rolled_back") for d, e in final.items()}
    _assert_equal_to_reload(final)
    for d in DEV[:3]:
        assert "not ready within" in final[d]["ahead"]["why"], (d, final[d]["ahead"])
    for d, e in final.items():
        assert not e["world_ahead"] and e["built_at_switch"], (d, e["seconds"])


@pytest.mark.slow  # deep profile: worlds shrink and grow in the test above; MoE switches in
# tests/test_live_switch.py (bind) and tests/test_gate_runtime.py
def test_moe_world_change_with_ep_and_etp() -> None:
    """MoE with the router's expert_bias: EP2·ETP2 on 4 -> EP2·ETP1 on 2 (gpu2-3 exit) ->
    EP4 on 4 with two freshly started processes."""
    ev = _run(MOE_ETP)
    shrink = {d: ev[d][0] for d in DEV[:2]}
    assert all(e["role"] == "stayed" for e in shrink.values())
    _assert_equal_to_reload(shrink)
    assert all(ev[d][0]["left"] for d in DEV[2:])
    grow = {"node0:gpu0": ev["node0:gpu0"][1], "node0:gpu1": ev["node0:gpu1"][1],
            "node0:gpu2": ev["fresh-node0:gpu2"][0], "node0:gpu3": ev["fresh-node0:gpu3"][0]}
    assert [e["role"] for e in grow.values()] == ["stayed", "stayed", "joined", "joined"]
    _assert_equal_to_reload(grow)


def _assert_equal_to_reload(events: dict) -> None:
    for d, e in events.items():
        assert e["pre"] == [] and e["post"] == [], (d, e["pre"][:5], e["post"][:5])
        assert e["n_state"] > 10
        assert e["losses"][0]["losses"] == e["losses"][1]["losses"]
    assert any(e["losses"][0]["losses"] for e in events.values()), "no rank saw a loss"
    assert sum(e["bytes_received"] for e in events.values()) > 0
