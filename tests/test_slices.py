"""Per-device plan slices equal the global plan's parts, and each slice verifies alone.

``plan_slice(src, dst, budget, device)`` computes one device's sends, receives and local
copies per round without planning the other devices' parts. The union of all devices' slices
must be the global plan (``plan_transition``), message for message and in the same per-round
order, on the correctness gate's random layouts and on a shipped pair; the devices agree on
the plan's two global numbers (cut unit and rounds) through ``agree`` alone; a slice passes
``verify_slice``, and a slice with one transfer dropped, duplicated or sent from a device
that does not hold it fails it.
"""

from __future__ import annotations

import threading
from functools import cache

import pytest
from hypothesis import given, settings

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.planner.plan import Message, Plan, Round, message_order
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.slices import _stage_leads, plan_slice, stage_leads_exact
from dynatrain.verify.slice import verify_slice

from strategies import Transition, transitions

LLAMA_70B = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp8-dp2.yaml")
TINY = ("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml")


def devices_of(src: Layout, dst: Layout) -> list[str]:
    return sorted(set(src.devices) | set(dst.devices))


def assert_slice_is_part(glob: Plan, part: Plan, device: str) -> None:
    """``part`` holds exactly ``device``'s messages of ``glob``, round by round, run in the
    same order by the device and by each of its peers."""
    assert len(part.rounds) == len(glob.rounds), device
    for r, (rs, rg) in enumerate(zip(part.rounds, glob.rounds)):
        mine = tuple(m for m in rg.messages if device in (m.src_device, m.dst_device))
        assert rs.messages == mine, f"{device}: round {r} differs from the global plan"
        go, so = rg.device_order(), rs.device_order()
        for dev in so:
            assert [rs.messages[i] for i in so[dev]] == [
                rg.messages[i] for i in go[dev] if device in (
                    rg.messages[i].src_device, rg.messages[i].dst_device)], (device, dev, r)


def check_union(src: Layout, dst: Layout, budget: int, devices=None) -> Plan:
    glob = plan_transition(src, dst, budget)
    spread = tuple(glob.stats["spread"])
    for dev in devices or devices_of(src, dst):
        part = plan_slice(src, dst, budget, dev, spread=spread)
        assert_slice_is_part(glob, part, dev)
        report = verify_slice(part, src, dst, dev)
        assert report.ok, str(report)
    return glob


@settings(max_examples=40)
@given(t=transitions())
def test_slices_of_random_transitions_are_the_global_plan(t: Transition) -> None:
    # Slices take the destination as placed; --place auto would place it first.
    check_union(Layout(t.src), Layout(t.dst), t.budget)


@cache
def seventy_b() -> tuple[Layout, Layout]:
    return Layout(load_spec(LLAMA_70B[0])), Layout(load_spec(LLAMA_70B[1]))


def test_slices_of_the_shipped_70b_switch() -> None:
    src, dst = seventy_b()
    devs = src.devices
    check_union(src, dst, 2 << 30, [devs[0], devs[37], devs[64], devs[-1]])


def test_devices_agree_on_unit_and_rounds_through_agree_alone() -> None:
    """Every device runs ``plan_slice`` in its own thread; ``agree`` is a max over threads
    (what an all-reduce MAX does in a job). The agreed numbers are the global plan's."""
    src, dst = Layout(load_spec(TINY[0])), Layout(load_spec(TINY[1]))
    budget = 8 << 10  # small enough for several rounds
    devs = devices_of(src, dst)
    barrier = threading.Barrier(len(devs))
    box: dict[str, int] = {}
    lock = threading.Lock()
    results: dict[str, Plan] = {}
    errors: list[BaseException] = []

    def agree(value: int) -> int:
        with lock:
            box["max"] = max(box.get("max", value), value)
        barrier.wait()
        out = box["max"]
        if barrier.wait() == 0:
            box.clear()
        barrier.wait()
        return out

    def run(dev: str) -> None:
        try:
            results[dev] = plan_slice(src, dst, budget, dev, agree=agree)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(d,)) for d in devs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    glob = plan_transition(src, dst, budget)
    assert glob.stats["rounds"] > 1
    for dev in devs:
        assert results[dev].stats["spread"] == glob.stats["spread"]
        assert_slice_is_part(glob, results[dev], dev)


def _edited(part: Plan, edit) -> Plan:
    rounds = []
    for r in part.rounds:
        msgs = tuple(edit(m) for m in r.messages)
        rounds.append(Round(msgs, message_order(msgs)))
    return Plan(part.src_name, part.dst_name, part.src_devices, part.dst_devices,
                tuple(rounds), part.budget_bytes, part.derived)


@pytest.mark.parametrize("fault", ["drop", "twice", "wrong-sender", "stranger"])
def test_a_broken_slice_fails_its_own_check(fault: str) -> None:
    src, dst = Layout(load_spec(TINY[0])), Layout(load_spec(TINY[1]))
    glob = plan_transition(src, dst, 1 << 20)
    dev = "node0:gpu1"
    part = plan_slice(src, dst, 1 << 20, dev, spread=tuple(glob.stats["spread"]))
    assert verify_slice(part, src, dst, dev).ok
    target = next(m for r in part.rounds for m in r.messages if m.dst_device == dev
                  and len(m.transfers) > 1)
    other = next(d for d in src.devices if d != dev)

    def edit(m: Message) -> Message:
        if m is not target:
            return m
        ts = m.transfers
        if fault == "drop":
            return Message(m.src_device, m.dst_device, ts[1:])
        if fault == "twice":
            return Message(m.src_device, m.dst_device, ts + ts[:1])
        if fault == "wrong-sender":  # same records, claimed by a device that is not their rank's
            return Message(other if m.src_device != other else src.devices[0], m.dst_device, ts)
        return Message(other, other, ts)  # a message the device takes no part in

    report = verify_slice(_edited(part, edit), src, dst, dev)
    assert not report.ok
    rule = {"drop": "coverage", "twice": "coverage", "wrong-sender": "source",
            "stranger": "source"}[fault]
    assert any(v.rule == rule for v in report.violations), str(report)


def test_slice_arguments_are_checked() -> None:
    src, dst = Layout(load_spec(TINY[0])), Layout(load_spec(TINY[1]))
    with pytest.raises(DynatrainError, match="exactly one of agree= or spread="):
        plan_slice(src, dst, 1 << 20, "node0:gpu0")
    with pytest.raises(DynatrainError, match="in neither layout"):
        plan_slice(src, dst, 1 << 20, "node9:gpu0", spread=(1, 1))


def _same_leads(layout: Layout) -> None:
    for pp in range(layout.parallel.pp):
        for ep in range(layout.parallel.ep):
            fast, exact = _stage_leads(layout, pp, ep), stage_leads_exact(layout, pp, ep)
            assert fast.keys() == exact.keys(), (pp, ep)
            for k, v in exact.items():
                assert (fast[k] is None) == (v is None), (pp, ep, k)
                if v is not None:
                    assert fast[k].tolist() == v.tolist(), (pp, ep, k)


@settings(max_examples=40)
@given(t=transitions())
def test_stage_leads_from_one_layer_per_kind_are_exact(t: Transition) -> None:
    # The slice's stage filter reads one layer of each kind; it must list exactly the keys and
    # leading indices that every parameter definition of the stage gives.
    _same_leads(Layout(t.src))
    _same_leads(Layout(t.dst))


@pytest.mark.parametrize("spec", ["specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
                                  "specs/mixtral-8x22b/tp4-pp4-ep8.yaml",
                                  "specs/llama3.1-70b/tp4-pp4-vpp5-dp8.yaml", TINY[1]])
def test_stage_leads_of_shipped_specs_are_exact(spec: str) -> None:
    _same_leads(Layout(load_spec(spec)))
