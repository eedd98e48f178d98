"""Symmetric ranks are planned once: pairs of the same shape are cut into rounds alike.

A pair's phase (``PairPhase``) depends on the two ranks' (TP, PP) positions and on how their
data-parallel indices relate under ``sources``' scaling of the receivers' replicas onto the
holders, so the pairs that feed the replicas of one position alike have equal shapes
(``shape_of``), and ``link_twins`` lets
the planner split each shape once. The plan must be exactly the one that splitting every
pair alone gives, on the correctness gate's random layouts and on shipped data-parallel
switches, and the sharing must happen where the symmetry is (else the comparison could
hold vacuously).
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_from_dict
from dynatrain.ir.state import transition_views
from dynatrain.planner.intersect import intersect
from dynatrain.planner.pipeline import check_compatible, plan_transition, replica_of
from dynatrain.planner.sources import pick_sources
from dynatrain.planner.spread import Pair, PairPhase, pairs_by_device, shape_of

from strategies import Transition, transitions

LLAMA_70B_DP3 = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml")
LLAMA_70B_PP8 = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp8-dp2.yaml")
QWEN_235B = ("specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
             "specs/qwen3-235b-a22b/tp4-pp8-ep8-192gpu.yaml")


def fresh_pairs(src: Layout, dst: Layout) -> dict[tuple[str, str], Pair]:
    """The plan's remote pairs, built anew (a ``Pair`` caches its chunks), twins linked."""
    sv, dv = transition_views(src, dst)
    derived = ("param",) if dst.spec.state.derive_param else ()
    picked, _ = pick_sources(intersect(sv, dv, derived), src.devices, dst.devices,
                             check_compatible(sv, dv), replica_of(dst))
    return pairs_by_device(picked, src.devices, dst.devices, PairPhase(src, dst))[0]


def check_each_pair_alone(src: Layout, dst: Layout, budget: int) -> tuple[dict, int]:
    """The plan's remote messages equal every pair split on its own; returns the pairs and
    how many of them the planner cut as another pair's twin."""
    plan = plan_transition(src, dst, budget)
    unit, n = plan.stats["spread"]
    got = {(i, m.src_device, m.dst_device): m.transfers
           for i, r in enumerate(plan.rounds) for m in r.messages if not m.local}
    pairs = fresh_pairs(src, dst)
    twins = sum(p.twin is not None for p in pairs.values())
    for p in pairs.values():
        p.twin = None  # every pair split on its own
    want = {}
    for (s, d), p in pairs.items():
        for i, chunk in enumerate(p.chunks(n, unit)):
            if chunk:
                want[(i, s, d)] = tuple(chunk)
    assert got.keys() == want.keys()
    for k, ts in want.items():
        assert got[k] == ts, k
    return pairs, twins


@settings(max_examples=40)
@given(t=transitions())
def test_twins_cut_alike_on_random_transitions(t: Transition) -> None:
    check_each_pair_alone(Layout(t.src), Layout(t.dst), t.budget)


@cache
def layouts(pair: tuple[str, str]) -> tuple[Layout, Layout]:
    return Layout(load_spec(pair[0])), Layout(load_spec(pair[1]))


def llama70b(world: int) -> Layout:
    """Llama-3.1-70B TP8 PP4 on ``world`` GPUs (8 per node)."""
    return Layout(spec_from_dict(dict(model="llama3.1-70b", parallel=dict(tp=8, pp=4),
                                      world=dict(nodes=world // 8, gpus_per_node=8)),
                                 origin=f"70b W={world}"))


def test_data_parallel_switches_share_shapes_and_match_the_explicit_cut() -> None:
    # DP16 -> DP12 lays the twelve replicas of each position over the sixteen source
    # replicas: receivers three replicas apart take the same parameters from senders four
    # apart, so their parameter-only pairs are twins (a pair that also carries a receiver's
    # own ZeRO shard is unique). On the shipped DP4 -> DP3 switch the period is the whole
    # group, so no pair has a twin; it must still match.
    for (src, dst), shared in (((llama70b(512), llama70b(384)), True),
                               (layouts(LLAMA_70B_DP3), False), (layouts(LLAMA_70B_PP8), False)):
        pairs, twins = check_each_pair_alone(src, dst, 2 << 30)
        shapes = {shape_of(p) for p in pairs.values()}
        assert len(shapes) == len(pairs) - twins
        if shared:
            assert twins > 0.1 * len(pairs), (src, twins, len(pairs))


def test_shifting_receiver_and_sender_replicas_together_keeps_the_phase() -> None:
    # DP16 -> DP12: the scaling's period is 3 receivers to 4 senders (gcd 4).
    src, dst = llama70b(512), llama70b(384)
    phase = PairPhase(src, dst)
    n, m = src.dp, dst.dp
    # Rank = tp + 8 * (dp + DP * pp) in both layouts (tp-cp-ep-dp-pp order, TP 8).
    for pp in range(4):
        for tp in (0, 5):
            for j in range(n):  # source replica index
                base = phase(tp + 8 * (j + n * pp), tp + 8 * (0 + m * pp))
                for k in range(1, m // 3):
                    moved = phase(tp + 8 * ((j + 4 * k) % n + n * pp), tp + 8 * (3 * k + m * pp))
                    assert moved == base, (pp, tp, j, k)
                # a shift off the period changes it
                assert phase(tp + 8 * ((j + 1) % n + n * pp), tp + 8 * (1 + m * pp)) != base
    # ... and the pairs of one receiver all differ, and so do those of one sender.
    assert len({phase(s, 0) for s in range(src.world)}) == src.world
    assert len({phase(0, d) for d in range(dst.world)}) == dst.world


@pytest.mark.slow  # 5 s; the gate's random transitions above include MoE layouts
def test_moe_switch_matches_the_explicit_cut() -> None:
    check_each_pair_alone(*layouts(QWEN_235B), 2 << 30)
