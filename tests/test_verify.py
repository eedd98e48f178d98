"""The verifier's rules, one by one, on hand-made faults; its tiling check against brute force.

Broad coverage of faults comes from the mutation tests (test_mutation.py); here each rule is
pinned with a fault whose witness is known exactly.
"""

from __future__ import annotations

import dataclasses
import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given

from dynatrain.ir.box import Box
from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import DTYPE_BYTES, Layout
from dynatrain.ir.state import OPTIMIZER_KINDS, StateView
from dynatrain.ir.summary import rank_elements
from dynatrain.ir.units import format_bytes
from dynatrain.planner.cost import Topology
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Round
from dynatrain.verify.check import check, verify
from dynatrain.verify.report import VerificationError
from dynatrain.ir.tiling import tiling_fault
from test_plan_simulate import DENSE, MOE, spec


# ---- tiling: exact integer check vs. counting every point -----------------------------------

@st.composite
def boxes_in(draw, anchor: Box):
    out = []
    for _ in range(draw(st.integers(0, 5))):
        lo, hi = [], []
        for a, z in zip(anchor.lo, anchor.hi):
            x = draw(st.integers(a - 1, z))
            y = draw(st.integers(x, z + 1))
            lo.append(x)
            hi.append(y)
        out.append(Box(tuple(lo), tuple(hi)))
    return out


ANCHOR = Box((1, 0), (4, 3))


@given(boxes_in(ANCHOR))
def test_tiling_fault_agrees_with_counting_points(boxes) -> None:
    count = {p: 0 for p in itertools.product(range(1, 4), range(0, 3))}
    stray = False
    for b in boxes:
        if any(l >= h for l, h in zip(b.lo, b.hi)):
            stray = True
        for p in itertools.product(*(range(l, h) for l, h in zip(b.lo, b.hi))):
            if p in count:
                count[p] += 1
            else:
                stray = True
    exact = not stray and all(c == 1 for c in count.values())
    fault = tiling_fault(ANCHOR, boxes)
    assert (fault is None) == exact
    if fault is None:
        return
    p = fault.point
    if fault.what == "missing":
        assert count[p] == 0
    elif fault.what == "twice":
        assert count[p] >= 2 and sum(1 for b in boxes if b & Box(p, tuple(x + 1 for x in p))) >= 2
    elif fault.what == "outside":
        assert p not in count and any(all(l <= x < h for l, h, x in zip(b.lo, b.hi, p))
                                      for b in boxes)


def test_tiling_of_stacked_boxes_groups_by_layer() -> None:
    """Boxes of different layers never overlap, even when the sweep dim would say so."""
    anchor = Box((0, 0, 0), (3, 4, 8))
    boxes = [Box((l, r, 0), (l + 1, r + 1, 8)) for l in range(3) for r in range(4)]
    assert tiling_fault(anchor, boxes) is None
    fault = tiling_fault(anchor, boxes + [Box((2, 3, 5), (3, 4, 6))])
    assert fault.what == "twice" and fault.point == (2, 3, 5)


# ---- the rules on real plans -----------------------------------------------------------------

def _plan(src, dst, budget=1 << 30):
    s, d = Layout(src), Layout(dst)
    return plan_transition(s, d, budget), s, d


def _replace_round(plan, i, rnd):
    rounds = list(plan.rounds)
    rounds[i] = rnd
    return dataclasses.replace(plan, rounds=tuple(rounds))


def test_good_plans_verify_and_check_returns_the_report() -> None:
    plan, s, d = _plan(spec(MOE, 4, tp=2, ep=2), spec(MOE, 8, tp=2, ep=2, pp=2))
    report = check(plan, s, d, Topology())
    assert report.ok and report.checked["transfers"] == plan.stats["transfers"]
    assert report.checked["expert_replicas"] > 0 and "verified" in str(report)


def test_dropped_transfer_names_the_unwritten_element() -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    rnd = plan.rounds[0]
    i = next(i for i, m in enumerate(rnd.messages) if not m.local)
    m = rnd.messages[i]
    gone = m.transfers[0]
    msgs = list(rnd.messages)
    msgs[i] = Message(m.src_device, m.dst_device, m.transfers[1:])
    bad = _replace_round(plan, 0, dataclasses.replace(rnd, messages=tuple(msgs)))
    report = verify(bad, s, d)
    assert [v.rule for v in report.violations] == ["coverage"]
    v = report.violations[0]
    assert v.witness == gone.box.lo and v.ranks == (gone.dst_rank,) and v.key == gone.key
    assert "never written" in str(v)
    with pytest.raises(VerificationError, match="never written"):
        check(bad, s, d)


def test_source_that_does_not_hold_the_data_is_named() -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    view = StateView(s)
    rnd = plan.rounds[0]

    def held(rank, t):
        return any(x.key == t.key and x.slot == t.src_slot and x.box == t.src_anchor
                   for x in view.stored(rank))

    # A transfer of a TP-split tensor: the other TP rank holds the other half, not this one.
    i, m, t = next((i, m, t) for i, m in enumerate(rnd.messages) if not m.local
                   for t in m.transfers[:1] if not held(1 - t.src_rank, t))
    other = 1 - t.src_rank
    moved = Message(s.devices[other], m.dst_device, (t._replace(src_rank=other),))
    msgs = list(rnd.messages)
    msgs[i] = Message(m.src_device, m.dst_device, m.transfers[1:])
    msgs.append(moved)
    bad = _replace_round(plan, 0, Round(tuple(msgs)))
    report = verify(bad, s, d)
    src_v = [v for v in report.violations if v.rule == "source"]
    assert src_v and src_v[0].ranks == (other,) and src_v[0].witness == t.box.lo


def test_cycle_of_waits_is_a_deadlock_with_the_cycle_as_witness() -> None:
    a, b = "node0:gpu0", "node0:gpu1"
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    ab = next(m for m in plan.messages() if (m.src_device, m.dst_device) == (a, b))
    ba = next(m for m in plan.messages() if (m.src_device, m.dst_device) == (b, a))
    local = [m for m in plan.messages() if m.local]
    msgs = (ab, ba, *local)
    ok = Round(msgs, ((a, (0, 1) + tuple(2 + i for i, m in enumerate(local) if m.src_device == a)),
                      (b, (0, 1) + tuple(2 + i for i, m in enumerate(local) if m.src_device == b))))
    one = dataclasses.replace(plan, rounds=(ok,))
    assert verify(one, s, d).ok
    flipped = dict(ok.order)
    flipped[b] = (1, 0) + flipped[b][2:]  # a sends first, b also wants to send first
    bad = dataclasses.replace(plan, rounds=(dataclasses.replace(
        ok, order=tuple(sorted(flipped.items()))),))
    report = verify(bad, s, d)
    assert report.rules() == {"deadlock"}
    assert set(report.violations[0].witness) == {(0, 0), (0, 1)}
    assert "cycle" in str(report)


def test_message_missing_from_a_device_order_leaves_its_peer_waiting() -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    rnd = plan.rounds[0]
    order = dict(rnd.device_order())
    dev = rnd.messages[0].src_device
    order[dev] = order[dev][1:]
    report = verify(_replace_round(plan, 0, dataclasses.replace(
        rnd, order=tuple(sorted(order.items())))), s, d)
    assert report.rules() == {"deadlock"} and "waits forever" in str(report)


def test_memory_over_budget_and_over_capacity() -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2), budget=1 << 20)
    peak = verify(plan, s, d).checked["peak_staging_bytes"]
    tight = dataclasses.replace(plan, budget_bytes=peak - 1)
    report = verify(tight, s, d)
    assert report.rules() == {"memory"} and len(report.violations) == 1
    assert report.violations[0].witness[1:] == (peak, peak - 1)
    assert (f"round 0: {report.violations[0].devices[0]} stages {format_bytes(peak)}, over the "
            f"{format_bytes(peak - 1)} budget (1 more (round, device) pair over)") in str(report)
    small = Topology(memory_GB=1e-6)  # 1000 bytes: less than any device's state
    report = verify(plan, s, d, small)
    assert report.rules() == {"memory"} and len(report.violations) == 1
    v = report.violations[0]
    assert v.witness[2] == 1000 and set(v.devices) == set(plan.src_devices)
    assert "1 more device is over too" in v.detail


# ---- memory: state + staging + reserve against device memory, counted independently ---------

# pp2 -> pp4 keeps TP (and so the padded vocab): every device's state is its ranks' elements.
PP_SRC, PP_DST = spec(DENSE, 4, pp=2), spec(DENSE, 4, pp=4)
CAPACITY = 2_000_000  # bytes: Topology(memory_GB=0.002)


def _state_bytes(layout: Layout, devices: tuple[str, ...], dev: str) -> int:
    """Bytes of state ``dev`` holds, from the per-rank element counts (not the verifier)."""
    if dev not in devices:
        return 0
    params, opt = rank_elements(layout, devices.index(dev))
    st = layout.spec.state
    opt_dtypes = [getattr(st, k) for k in OPTIMIZER_KINDS if getattr(st, k) is not None]
    step = 8 if opt_dtypes else 0  # Adam's step: one int64 on every rank
    return (params * DTYPE_BYTES[st.param] + sum(opt * DTYPE_BYTES[t] for t in opt_dtypes)
            + step)


def _staging(plan, dev: str) -> tuple[int, int]:
    """(bytes, round) of the round in which ``dev`` stages the most, from the plan's messages."""
    per_round = [sum(m.nbytes for m in r.messages
                     if not m.local and dev in (m.src_device, m.dst_device)) for r in plan.rounds]
    best = max(per_round, default=0)
    return best, per_round.index(best) if per_round else 0


def _live(plan, s: Layout, d: Layout) -> dict[str, tuple[int, int, int, int]]:
    """Per device: (source state, destination state, peak staging, its round)."""
    return {dev: (_state_bytes(s, plan.src_devices, dev), _state_bytes(d, plan.dst_devices, dev),
                  *_staging(plan, dev))
            for dev in sorted(set(plan.src_devices) | set(plan.dst_devices))}


def test_reserve_that_fits_passes_and_says_what_was_counted() -> None:
    plan, s, d = _plan(PP_SRC, PP_DST, budget=1 << 20)
    live = _live(plan, s, d)
    total = {dev: a + b + c for dev, (a, b, c, _) in live.items()}
    fullest = max(sorted(total), key=total.get)
    reserve = CAPACITY - total[fullest]  # fills the fullest device to the byte
    report = check(plan, s, d, Topology(memory_GB=CAPACITY / 1e9), reserve_bytes=reserve)
    assert report.ok
    c = report.checked
    assert (c["peak_live_bytes"], c["reserve_bytes"], c["capacity_bytes"], c["headroom_bytes"],
            c["fullest_device"]) == (total[fullest], reserve, CAPACITY, 0, fullest)
    assert c["peak_staging_bytes"] == max(x[2] for x in live.values())
    # No device memory to check against: nothing about live state is claimed.
    assert "peak_live_bytes" not in verify(plan, s, d).checked


def test_reserve_that_pushes_one_device_over_names_it_and_the_four_parts() -> None:
    plan, s, d = _plan(PP_SRC, PP_DST, budget=1 << 20)
    live = _live(plan, s, d)
    total = {dev: a + b + c for dev, (a, b, c, _) in live.items()}
    ranked = sorted(total, key=lambda dev: (-total[dev], dev))
    worst, second = ranked[:2]
    assert total[worst] > total[second]  # the case has one fullest device
    reserve = CAPACITY - total[worst] + 1
    report = verify(plan, s, d, Topology(memory_GB=CAPACITY / 1e9), reserve_bytes=reserve)
    assert report.rules() == {"memory"} and len(report.violations) == 1
    v = report.violations[0]
    src_n, dst_n, staged, r = live[worst]
    assert v.devices == (worst,) and v.witness == (r, CAPACITY + 1, CAPACITY)
    assert v.detail == (
        f"{worst} needs {CAPACITY + 1} bytes while switching (source state "
        f"{format_bytes(src_n)} + destination state {format_bytes(dst_n)} + staging "
        f"{format_bytes(staged)} in round {r} + reserve {format_bytes(reserve)}) but has "
        f"{CAPACITY} bytes — free memory, lower --reserve, or use a smaller --budget / more "
        f"devices")
    assert report.checked["headroom_bytes"] == -1
    with pytest.raises(VerificationError, match=f"memory: {worst} needs"):
        check(plan, s, d, Topology(memory_GB=CAPACITY / 1e9), reserve_bytes=reserve)


def test_overflow_on_53_devices_is_one_sentence_per_kind() -> None:
    plan, s, d = _plan(spec(DENSE, 64, tp=2), spec(DENSE, 64, tp=2, pp=2), budget=1 << 20)
    live = _live(plan, s, d)
    total = sorted((a + b + c for a, b, c, _ in live.values()), reverse=True)
    capacity = 10**6
    reserve = capacity - total[52] + 1  # the 53 fullest devices (and any tied with them) over
    n_over = sum(1 for t in total if t + reserve > capacity)
    assert n_over >= 53
    budget = 1 << 14
    pairs_over = sum(1 for dev in live for r in plan.rounds
                     if sum(m.nbytes for m in r.messages if not m.local
                            and dev in (m.src_device, m.dst_device)) > budget)
    tight = dataclasses.replace(plan, budget_bytes=budget)
    report = verify(tight, s, d, Topology(memory_GB=capacity / 1e9), reserve_bytes=reserve)
    lines = str(report).splitlines()
    assert lines[0] == "verification failed: 2 violation(s)" and len(lines) == 3, lines
    staging, state = report.violations
    assert f"over the {format_bytes(budget)} budget ({pairs_over - 1} more (round, device) " \
           "pairs over)" in staging.detail
    assert staging.witness[1] == max(x[2] for x in live.values())
    assert f"; {n_over - 1} more devices are over too — " in state.detail
    assert len(state.devices) == 8 and state.devices[0] == max(
        sorted(live), key=lambda dev: sum(live[dev][:3]))


@pytest.mark.parametrize("reserve", [-1, 1.5, True, "1GiB", 1 << 60])
def test_a_reserve_that_is_not_a_byte_count_is_refused(reserve) -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    with pytest.raises(DynatrainError, match=r"^reserve: must be a whole number of bytes"):
        verify(plan, s, d, Topology(), reserve_bytes=reserve)


def test_a_reserve_without_device_memory_is_refused_not_ignored() -> None:
    plan, s, d = _plan(spec(DENSE, 2, tp=2), spec(DENSE, 2, pp=2))
    with pytest.raises(DynatrainError, match=r"^reserve: 1\.0 GiB needs a device memory"):
        verify(plan, s, d, Topology(memory_GB=None), reserve_bytes=1 << 30)
    with pytest.raises(DynatrainError, match=r"^reserve: "):
        check(plan, s, d, None, reserve_bytes=1 << 30)


def test_expert_state_sent_to_a_device_that_does_not_own_it() -> None:
    src, dst = spec(MOE, 4, ep=4), spec(MOE, 4, ep=2, tp=2)
    plan, s, d = _plan(src, dst)
    view = StateView(d)
    rnd = plan.rounds[0]
    i, t = next((i, t) for i, m in enumerate(rnd.messages) for t in m.transfers
                if ".experts." in t.key)
    owner_ep = d.coords(t.dst_rank).ep
    other = next(r for r in range(d.world) if d.coords(r).edp == d.coords(t.dst_rank).edp
                 and d.coords(r).ep != owner_ep)
    assert not any(x.key == t.key and x.box.lo[:2] == t.box.lo[:2] for x in view.stored(other))
    m = rnd.messages[i]
    msgs = list(rnd.messages)
    msgs[i] = Message(m.src_device, m.dst_device, tuple(x for x in m.transfers if x != t))
    msgs.append(Message(m.src_device, d.devices[other], (t._replace(dst_rank=other),)))
    report = verify(_replace_round(plan, 0, Round(tuple(msgs))), s, d)
    ex = [v for v in report.violations if v.rule == "expert"]
    assert ex and ex[0].ranks == (other,) and ex[0].witness == t.box.lo


def test_layout_with_two_owners_of_an_expert_is_caught(monkeypatch) -> None:
    """The ownership rule checks the destination layout itself: give one rank a second copy."""
    dst = Layout(spec(MOE, 4, ep=4))
    view = StateView(dst)
    theirs = view.param_part(1)
    stolen = next(x for x in theirs if ".experts." in x.key)
    mine = view.param_part(0)
    real = StateView.param_part
    monkeypatch.setattr(StateView, "param_part", lambda self, rank: (
        real(self, rank) + (stolen,) if rank == 0 and self.layout is dst else real(self, rank)))
    from dynatrain.verify.ownership import check_expert_ownership
    found = []
    check_expert_ownership(StateView(dst), dst.devices, found.append)
    assert any(v.rule == "expert" and set(v.ranks) == {0, 1} and v.key == stolen.key
               and v.witness == stolen.box.lo for v in found), found
    assert mine  # rank 0 held experts of its own before
