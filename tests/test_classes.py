"""The global plan kept as classes of pairs cut alike (``planner.classes``).

Its rounds, built on first use, are the explicit planner's (``test_symmetry`` compares every
message with splitting each pair alone); here: its statistics equal those of its explicit
rounds, ``verify``'s class path proves exactly the plans the explicit path proves (same
counts and staging, on the gate's random layouts and on shipped switches), and a fault
hidden in a class's members or chunks is found by the class path, not waved through.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given, settings

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.state import transition_views
from dynatrain.planner.classes import ClassRounds, LazyRounds, Member, PairClass
from dynatrain.planner.cost import (PRESETS, LinkBytes, link_bytes, lower_bound_seconds,
                                     predicted_seconds)
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Plan
from dynatrain.verify.check import verify
from dynatrain.verify.data import Declared, Holdings, _check_classes, _Transfers, check_data

from test_symmetry import llama70b
from strategies import Transition, transitions

LLAMA_70B_DP3 = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml")
LLAMA_405B = ("specs/llama3.1-405b/tp8-pp16-dp32-4096gpu.yaml",
              "specs/llama3.1-405b/tp8-pp16-dp24-3072gpu.yaml")
QWEN_235B = ("specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
             "specs/qwen3-235b-a22b/tp4-pp8-ep8-192gpu.yaml")


@cache
def layouts(pair: tuple[str, str]) -> tuple[Layout, Layout]:
    return Layout(load_spec(pair[0])), Layout(load_spec(pair[1]))


def explicit(plan: Plan) -> Plan:
    """The same plan with its rounds built: no classes, so every check runs per message."""
    out = replace(plan, rounds=tuple(plan.rounds))
    assert out.classes is None
    return out


def class_faults(plan: Plan, src: Layout, dst: Layout) -> tuple[list, tuple]:
    """What the class path alone finds, and its (count, staging)."""
    sv, dv = transition_views(src, dst)
    found: list = []
    out = _check_classes(plan, plan.classes, sv, dv, _Transfers(plan, sv, dv, Holdings(sv),
                                                                found.append),
                         Holdings(dv), Declared(), found.append)
    return found, out


def check_cost_figures(plan: Plan) -> None:
    """Predicted and lower-bound seconds and the staging peak, read from ``plan.link_table``,
    are the very floats and ints that ``LinkBytes`` of each round (and of the rounds summed)
    give on every preset topology."""
    per_round = [link_bytes(r.messages) for r in plan.rounds]
    total: dict[str, list[int]] = defaultdict(lambda: [0] * 5)
    for per in per_round:
        for d, lb in per.items():
            for i, v in enumerate((lb.intra_out, lb.intra_in, lb.inter_out, lb.inter_in,
                                   lb.local)):
                total[d][i] += v
    for topo in PRESETS.values():
        busiest = [max((lb.seconds(topo) for lb in per.values()), default=0.0)
                   for per in per_round]
        assert predicted_seconds(plan, topo) == sum(topo.latency_us * 1e-6 + b for b in busiest)
        whole = max((LinkBytes(*v).seconds(topo) for v in total.values()), default=0.0)
        assert lower_bound_seconds(plan, topo) == (topo.latency_us * 1e-6 if whole else 0.0) \
            + whole
    assert plan.link_table.staging_peak() == max(
        (lb.intra_out + lb.intra_in + lb.inter_out + lb.inter_in
         for per in per_round for lb in per.values()), default=0)


def check_same_as_explicit(plan: Plan, src: Layout, dst: Layout) -> None:
    assert plan.classes is not None
    flat = explicit(plan)
    # Statistics read from the classes are those of the explicit rounds.
    assert plan.round_links == tuple(link_bytes(r.messages) for r in flat.rounds)
    for p in (plan, flat):  # the cost model's numbers (numpy) against LinkBytes, exactly
        check_cost_figures(p)
    messages = [m for m in flat.messages() if not m.local]
    assert plan.stats["messages"] == len(messages)
    assert plan.stats["bytes_moved"] == sum(m.nbytes for m in messages)
    assert plan.stats["transfers"] == sum(len(m.transfers) for m in flat.messages())
    # The class path proves the plan on its own, with the explicit path's numbers.
    found, (count, staging) = class_faults(plan, src, dst)
    assert found == []
    sv, dv = transition_views(src, dst)
    want = check_data(flat, sv, dv, lambda v: pytest.fail(str(v)))
    assert count == want[0]
    assert [dict(s) for s in staging] == [dict(s) for s in want[1]]
    a, b = verify(plan, src, dst), verify(flat, src, dst)
    assert a.ok and b.ok and a.checked == b.checked


@settings(max_examples=max(30, settings.default.max_examples // 10))  # deep: 200
@given(t=transitions())
def test_class_plans_verify_as_their_explicit_rounds(t: Transition) -> None:
    src, dst = Layout(t.src), Layout(t.dst)
    check_same_as_explicit(plan_transition(src, dst, t.budget), src, dst)


@pytest.mark.parametrize("pair", [LLAMA_70B_DP3, pytest.param(QWEN_235B, marks=pytest.mark.slow)],
                         ids=["70b-dp4-dp3", "235b-ep16-ep8"])  # MoE by default: the gate's
def test_shipped_class_plans_verify_as_their_explicit_rounds(pair: tuple[str, str]) -> None:
    src, dst = layouts(pair)
    plan = plan_transition(src, dst, 2 << 30)
    check_same_as_explicit(plan, src, dst)


@pytest.mark.slow
def test_405b_class_plan_verifies_as_its_explicit_rounds() -> None:
    src, dst = layouts(LLAMA_405B)
    plan = plan_transition(src, dst, 2 << 30)
    # DP32 -> DP24: pairs carrying parameters only repeat every 3 receivers (8 times per
    # position); those carrying a receiver's own ZeRO shard are unique (measured: 9353
    # classes of 18230 pairs)
    assert len(plan.classes.classes) < 0.6 * sum(len(c.members) for c in plan.classes.classes)
    check_same_as_explicit(plan, src, dst)


def test_lazy_rounds_are_the_tuple_they_stand_for() -> None:
    src, dst = layouts(LLAMA_70B_DP3)
    plan = plan_transition(src, dst, 1 << 30)
    lazy, flat = plan.rounds, tuple(explicit(plan).rounds)
    assert isinstance(lazy, LazyRounds) and len(lazy) == len(flat) > 1
    assert lazy == flat and flat == lazy and hash(lazy) == hash(flat)
    assert lazy[-1] == flat[-1] and lazy[1:] == flat[1:] and list(lazy) == list(flat)
    with pytest.raises(IndexError):
        lazy[len(flat)]
    assert plan == explicit(plan)
    # Replacing the rounds drops the classes: they would no longer describe the plan.
    assert replace(plan, rounds=flat[:1]).classes is None


# ---- faults hidden in the classes ---------------------------------------------------------------

def with_body(plan: Plan, body: ClassRounds) -> Plan:
    return replace(plan, rounds=LazyRounds(body), classes=body)


def with_classes(plan: Plan, classes: list[PairClass]) -> Plan:
    b = plan.classes
    return with_body(plan, ClassRounds(b.rounds, tuple(classes), b.local))


@pytest.fixture(scope="module")
def symmetric() -> tuple[Plan, Layout, Layout]:
    # DP8 -> DP6: receivers three replicas apart take alike from senders four apart (the
    # shipped DP4 -> DP3 has no such period inside its group, hence no class of two)
    src, dst = llama70b(256), llama70b(192)
    plan = plan_transition(src, dst, 2 << 30)
    assert any(len(c.members) > 1 for c in plan.classes.classes)
    return plan, src, dst


def big_class(plan: Plan) -> int:
    return max(range(len(plan.classes.classes)), key=lambda k: len(plan.classes.classes[k].members))


def mutated_members(plan: Plan, fn) -> Plan:
    cs = list(plan.classes.classes)
    k = big_class(plan)
    cs[k] = PairClass(cs[k].chunks, tuple(fn(list(cs[k].members))))
    return with_classes(plan, cs)


def rank_elsewhere(layout: Layout, rank: int) -> int:
    """A rank at another model-parallel position (it holds other parameters)."""
    c = layout.coords(rank)
    return next(r for r in range(layout.world) if (layout.coords(r).tp, layout.coords(r).pp)
                != (c.tp, c.pp))


def faults(name: str, plan: Plan, src: Layout, dst: Layout) -> Plan:
    if name == "member dropped":
        return mutated_members(plan, lambda ms: ms[:-1])
    if name == "member twice":
        return mutated_members(plan, lambda ms: ms + ms[-1:])
    if name == "member reads another position":
        def other(ms):
            m = ms[-1]
            sr = rank_elsewhere(src, m.src_rank)
            return ms[:-1] + [Member(src.devices[sr], m.dst_device, sr, m.dst_rank)]
        return mutated_members(plan, other)
    if name == "member writes another position":
        def other(ms):
            m = ms[-1]
            dr = rank_elsewhere(dst, m.dst_rank)
            return ms[:-1] + [Member(m.src_device, plan.dst_devices[dr], m.src_rank, dr)]
        return mutated_members(plan, other)
    if name == "member on the wrong device":
        def moved(ms):
            m = ms[-1]
            return ms[:-1] + [m._replace(dst_device=plan.dst_devices[(m.dst_rank + 1)
                                                                    % len(plan.dst_devices)])]
        return mutated_members(plan, moved)
    if name == "member rank outside the layout":
        def outside(ms):
            m = ms[-1]
            return ms[:-1] + [m._replace(src_rank=src.world)]
        return mutated_members(plan, outside)
    if name == "chunk box shifted":
        cs = list(plan.classes.classes)
        k = big_class(plan)
        chunks = [list(ch) for ch in cs[k].chunks]
        i = next(i for i, ch in enumerate(chunks) if ch)
        t = chunks[i][0]
        lo = (t.box.lo[0] + 1,) + t.box.lo[1:]
        hi = (t.box.hi[0] + 1,) + t.box.hi[1:]
        chunks[i][0] = t._replace(box=type(t.box)(lo, hi))
        cs[k] = PairClass(tuple(map(tuple, chunks)), cs[k].members)
        return with_classes(plan, cs)
    raise AssertionError(name)


FAULTS = ["member dropped", "member twice", "member reads another position",
          "member writes another position", "member on the wrong device",
          "member rank outside the layout", "chunk box shifted"]


@pytest.mark.parametrize("name", FAULTS)
def test_a_fault_in_a_class_is_found_by_the_class_path(name: str, symmetric) -> None:
    plan, src, dst = symmetric
    bad = faults(name, plan, src, dst)
    found, _ = class_faults(bad, src, dst)
    assert found, name
    # ``verify`` then reports it as the explicit path does.
    a, b = verify(bad, src, dst), verify(explicit(bad), src, dst)
    assert not a.ok and not b.ok
    assert [str(v) for v in a.violations] == [str(v) for v in b.violations]


def test_faults_change_what_the_classes_say(symmetric) -> None:
    """The mutants really differ from the plan (else the test above could pass vacuously)."""
    plan, src, dst = symmetric
    for name in FAULTS:
        assert tuple(faults(name, plan, src, dst).rounds) != tuple(plan.rounds), name


def test_members_of_a_class_really_share_their_chunks(symmetric) -> None:
    """A class's members send its chunks with their own ranks: the materialized messages of
    every member carry the class's boxes and regions and the member's ranks."""
    plan, _, _ = symmetric
    body = plan.classes
    sent = defaultdict(dict)
    for i, r in enumerate(plan.rounds):
        for m in r.messages:
            sent[(m.src_device, m.dst_device)][i] = m.transfers
    for c in body.classes:
        for m in c.members:
            for i, ch in enumerate(c.chunks):
                if not ch:
                    continue
                got = sent[(m.src_device, m.dst_device)][i]
                assert [(t.src_rank, t.dst_rank) for t in got] == [(m.src_rank, m.dst_rank)] * len(ch)
                assert [t[:3] + t[5:] for t in got] == [t[:3] + t[5:] for t in ch]


def test_writers_read_each_round_once_and_keep_none(symmetric) -> None:
    """The JSON and text writers visit a class plan's rounds without keeping them, and the
    order they write is the built rounds' order."""
    from dynatrain.planner.classes import device_orders, each_round

    plan, _, _ = symmetric
    fresh = with_body(plan, plan.classes)
    assert [dict(o) for o in device_orders(fresh.rounds)] == [
        r.device_order() for r in explicit(plan).rounds]
    assert list(each_round(fresh.rounds)) == list(explicit(plan).rounds)
    assert all(r is None for r in fresh.rounds._built)  # nothing kept
