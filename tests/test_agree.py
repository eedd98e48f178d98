"""The global plan's (unit, R) is what every device agrees on alone.

``global_spread`` sums chunk loads per device with numpy; each live process instead runs
``agree_spread`` on its own pairs and an all-reduce MAX (``agree``). Here the reference is that
fixpoint, run over every device's pairs with ``agree`` the max over all devices, on the gate's
random layouts and on shipped switches, at budgets that take one round up to many.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.planner.intersect import PlanError
from dynatrain.planner.schedule import MAX_ROUNDS, unit_bytes
from dynatrain.planner.spread import Pair, fit_from, global_spread, least_rounds

from strategies import Transition, transitions
from test_symmetry import fresh_pairs, llama70b

# DP8 -> DP6 (the shipped DP4 -> DP3 has no twins: its receivers' period is the whole group)
LLAMA_70B_DP8_DP6 = (256, 192)
QWEN_235B = ("specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
             "specs/qwen3-235b-a22b/tp4-pp8-ep8-192gpu.yaml")


def agreed(pairs: dict[tuple[str, str], Pair], budget: int) -> tuple[int, int] | None:
    """``agree_spread``'s fixpoint with every device's value maxed over all devices (None:
    more than ``MAX_ROUNDS`` rounds, which ``global_spread`` refuses)."""
    sides: dict[str, tuple[list[Pair], list[Pair]]] = {}
    for (s, d), p in pairs.items():
        sides.setdefault(s, ([], []))[0].append(p)
        sides.setdefault(d, ([], []))[1].append(p)

    def agree(values) -> int:
        return max(values, default=1)

    unit = unit_bytes(budget, agree(max(len(o), len(i)) for o, i in sides.values()))
    r = agree(least_rounds(o, i, budget // 2) for o, i in sides.values())
    while True:
        nxt = agree(fit_from(o, i, r, budget, unit) for o, i in sides.values())
        if nxt > MAX_ROUNDS:
            return None
        if nxt == r:
            return unit, r
        r = nxt


def check(pairs: dict[tuple[str, str], Pair], budget: int) -> None:
    want = agreed(pairs, budget)
    if want is None:
        with pytest.raises(PlanError):
            global_spread(pairs, budget)
    else:
        assert global_spread(pairs, budget) == want


@settings(max_examples=max(30, settings.default.max_examples // 10))  # deep: 200
@given(t=transitions(), shrink=st.sampled_from([1, 3]))
def test_global_spread_is_what_devices_agree_on(t: Transition, shrink: int) -> None:
    src, dst = Layout(t.src), Layout(t.dst)
    check(fresh_pairs(src, dst), max(2, t.budget // shrink))


@cache
def shipped(pair: tuple[str, str] | tuple[int, int]) -> dict[tuple[str, str], Pair]:
    if isinstance(pair[0], int):  # Llama-3.1-70B TP8 PP4 on that many GPUs each
        return fresh_pairs(llama70b(pair[0]), llama70b(pair[1]))
    return fresh_pairs(Layout(load_spec(pair[0])), Layout(load_spec(pair[1])))


@pytest.mark.parametrize("pair,budget", [(LLAMA_70B_DP8_DP6, 4 << 30),
                                         (LLAMA_70B_DP8_DP6, 256 << 20),
                                         (QWEN_235B, 4 << 30), (QWEN_235B, 1 << 30)],
                         ids=["70b-dp8-dp6-4g", "70b-dp8-dp6-256m", "235b-4g", "235b-1g"])
def test_global_spread_of_shipped_switches(pair, budget: int) -> None:
    pairs = shipped(pair)
    assert len({id(p.twin or p) for p in pairs.values()}) < len(pairs)  # twins share loads
    check(pairs, budget)
