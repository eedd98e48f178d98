"""A staging budget tiny against the state is refused before any piece is cut, with the smallest
budget the plan allows; that budget really plans, within the limits; the default one always does.

Guarantee tested: ``BudgetTooSmall.smallest`` is exact (one byte less is refused), and the budget
the message suggests is ``smallest`` rounded up to one decimal of a unit, so the size one decimal
below it is refused too. Refusals must not reach ``spread`` (which is what a tiny budget blows
up): the tests make its passes fail if they are called, instead of timing anything.
"""

from __future__ import annotations

from functools import cache

import pytest

from dynatrain.cli import main
from dynatrain.ir.errors import EXIT_BAD_INPUT
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.state import transition_views
from dynatrain.ir.units import format_bytes, parse_bytes
from dynatrain.planner import pipeline
from dynatrain.planner.intersect import PlanError, intersect
from dynatrain.planner.pipeline import check_compatible, plan_transition
from dynatrain.planner.schedule import (MAX_ROUNDS, MAX_SCHEDULE_STEPS, STEPS_PER_PAIR,
                                        BudgetTooSmall, Demand, _round_up, check_budget)
from dynatrain.planner.sources import pick_sources
from dynatrain.planner.spread import PairPhase, global_spread, pairs_by_device, rounds_of
from dynatrain.verify.check import verify

TINY = ("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml")
LLAMA_70B = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp8-dp2.yaml")
LLAMA_70B_DP3 = ("specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml")
QWEN_235B = ("specs/qwen3-235b-a22b/tp4-pp8-ep16-256gpu.yaml",
             "specs/qwen3-235b-a22b/tp4-pp8-ep8-192gpu.yaml")
DEFAULT_BUDGET = 2 << 30


@cache
def layouts(pair: tuple[str, str]) -> tuple[Layout, Layout]:
    return Layout(load_spec(pair[0])), Layout(load_spec(pair[1]))


@cache
def transfers(pair: tuple[str, str]):
    src, dst = layouts(pair)
    sv, dv = transition_views(src, dst)
    picked, _ = pick_sources(intersect(sv, dv, ()), src.devices, dst.devices,
                             check_compatible(sv, dv), pipeline.replica_of(dst))
    return picked, src.devices, dst.devices


@cache
def refusal(pair: tuple[str, str], budget: int) -> BudgetTooSmall:
    with pytest.raises(BudgetTooSmall) as err:
        plan_transition(*layouts(pair), budget)
    return err.value


@pytest.fixture
def no_coalesce(monkeypatch):
    """Refusals must come before spread cuts the transfers into chunks (grouping them into
    pairs of devices cuts nothing and does not depend on the budget)."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("spread ran: the budget was not checked first")
    monkeypatch.setattr(pipeline, "global_spread", refuse)
    monkeypatch.setattr(pipeline, "class_rounds", refuse)


def refused(pair: tuple[str, str], budget: int) -> BudgetTooSmall:
    with pytest.raises(BudgetTooSmall) as err:
        check_budget(*transfers(pair), budget)
    return err.value


# ---- tiny budgets are refused at once, with the smallest budget -------------------------------

@pytest.mark.parametrize("size", ["100B", "256B", "4KiB"])
def test_tiny_gpt_tiny_budgets_are_refused_before_coalesce(size, no_coalesce) -> None:
    budget = parse_bytes(size)
    with pytest.raises(BudgetTooSmall) as caught:
        plan_transition(*layouts(TINY), budget)
    err = caught.value
    text = str(err)
    assert isinstance(err, PlanError) and err.exit_code == EXIT_BAD_INPUT
    assert "\n" not in text
    assert text.startswith(f"--budget {format_bytes(budget)} is too small for this switch")
    if err.rounds:  # it would plan, in too many rounds
        assert f"up to {err.rounds:,} rounds" in text and f"limit of {MAX_ROUNDS:,} rounds" in text
        assert err.rounds > MAX_ROUNDS
    else:  # no number of rounds fits a piece of every pair of the busiest device
        assert "half the budget cannot stage a round's piece of each" in text
    suggested = format_bytes(err.suggested)
    assert text.endswith(f"the smallest budget this plan allows is {suggested} "
                         f"(--budget {suggested.replace(' ', '')})")
    assert err.budget == budget and err.suggested >= err.smallest > budget


def test_seventy_b_with_one_mib_is_refused_before_coalesce(no_coalesce) -> None:
    err = refusal(LLAMA_70B, 1 << 20)
    assert (err.rounds == 0 or err.rounds > MAX_ROUNDS) and "--budget 1.0 MiB is too small" in str(err)


def test_a_budget_that_cannot_stage_one_element_names_it_and_the_smallest(no_coalesce) -> None:
    with pytest.raises(BudgetTooSmall) as caught:
        plan_transition(*layouts(TINY), 20)
    text = str(caught.value)
    assert text.startswith("--budget 20 B is too small to move one element (12 bytes) of ")
    assert text.endswith(f"(--budget {format_bytes(caught.value.suggested).replace(' ', '')})")


@pytest.mark.parametrize("size", ["100B", "256B", "4KiB"])
def test_cli_refuses_in_one_line_exit_2(size, capsys, no_coalesce) -> None:
    assert main(["plan", *TINY, "--budget", size]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the smallest budget this plan allows is" in err[0], err


# ---- the suggested budget is tight and really plans -------------------------------------------

# The 235B plan at its smallest budget (hundreds of rounds, ~2 min here) runs in the deep
# profile only; tiny-gpt checks the same property in the default run.
@pytest.mark.parametrize("pair", [TINY, pytest.param(QWEN_235B, marks=pytest.mark.slow)],
                         ids=["tiny-gpt", "qwen3-235b-ep16-ep8"])
def test_the_suggested_budget_plans_within_the_limits(pair) -> None:
    err = refusal(pair, 1 << 20 if pair == QWEN_235B else 256)
    src, dst = layouts(pair)
    plan = plan_transition(src, dst, parse_bytes(format_bytes(err.suggested).replace(" ", "")))
    assert plan.budget_bytes == err.suggested
    assert 1 < plan.stats["rounds"] <= MAX_ROUNDS
    assert plan.stats["peak_staging_bytes"] <= err.suggested
    if pair == TINY:  # the 235B plan takes a few seconds more to verify
        assert verify(plan, src, dst).ok


@pytest.mark.parametrize("pair", [TINY, LLAMA_70B, QWEN_235B],
                         ids=["tiny-gpt", "llama-70b", "qwen3-235b-ep16-ep8"])
def test_the_smallest_budget_is_exact_and_the_suggestion_one_decimal_above(pair) -> None:
    err = refusal(pair, 1 << 20 if pair != TINY else 256)
    assert check_budget(*transfers(pair), err.smallest).fits(err.smallest)
    assert refused(pair, err.smallest - 1).smallest == err.smallest
    check_budget(*transfers(pair), err.suggested)
    # One decimal below the suggestion, in the unit it is written in, is refused.
    number, unit = format_bytes(err.suggested).split()
    below = parse_bytes(f"{float(number) - 0.1:.1f}{unit}")
    assert refused(pair, below).suggested == err.suggested


# ---- the bounds are sound: the real plan needs at least what the check says ------------------

@pytest.mark.parametrize("budget", [20_000, 64 << 10, 1 << 20])
def test_rounds_and_messages_bounds_never_exceed_the_real_plan(budget) -> None:
    picked, src_devices, dst_devices = transfers(TINY)
    need = check_budget(picked, src_devices, dst_devices, budget)
    pairs, local = pairs_by_device(picked, src_devices, dst_devices, PairPhase(*layouts(TINY)))
    unit, n = global_spread(pairs, budget)
    rounds = rounds_of(pairs.values(), local, unit, n)
    messages = [m for r in rounds for m in r.messages if not m.local]
    assert need.messages(budget) <= len(messages)
    # The planner's rounds lie between the least any schedule needs and the check's bound.
    assert need.least_rounds(budget) <= len(rounds) <= need.rounds(budget)


@pytest.mark.parametrize("pair", [TINY, LLAMA_70B_DP3, QWEN_235B],
                         ids=["tiny-gpt", "llama-70b-dp3", "qwen3-235b"])
def test_the_pipelines_demand_from_pairs_is_the_demand_of_the_transfers(pair) -> None:
    """The pipeline checks the budget from its pairs of devices: the very same ``Demand``
    (every field, the element's tensor too) as one pass over the transfers."""
    picked, src_devices, dst_devices = transfers(pair)
    pairs, _ = pairs_by_device(picked, src_devices, dst_devices, PairPhase(*layouts(pair)))
    want = Demand.of(picked, src_devices, dst_devices)
    assert want.pairs == len(pairs) > 0
    assert Demand.of_pairs(pairs.values()) == want


# ---- the default budget passes on the shipped switches ----------------------------------------

@pytest.mark.parametrize("pair", [TINY, LLAMA_70B], ids=["tiny-gpt", "llama-70b"])
def test_the_default_budget_plans_the_shipped_switches(pair) -> None:
    plan = plan_transition(*layouts(pair), DEFAULT_BUDGET)
    assert plan.stats["rounds"] <= MAX_ROUNDS


@pytest.mark.parametrize("pair", [LLAMA_70B_DP3, QWEN_235B], ids=["llama-70b-dp3", "qwen3-235b"])
def test_the_default_budget_passes_the_check_on_the_shipped_switches(pair) -> None:
    need = check_budget(*transfers(pair), DEFAULT_BUDGET)
    assert need.rounds(DEFAULT_BUDGET) * need.messages(DEFAULT_BUDGET) <= MAX_SCHEDULE_STEPS // 4


# ---- the limits themselves --------------------------------------------------------------------

def test_a_switch_with_more_pairs_than_steps_is_bounded_by_its_pairs() -> None:
    pairs = MAX_SCHEDULE_STEPS  # each pair alone is one step at any budget
    need = Demand(busiest_bytes=1 << 20, sides=((1 << 20, (12,) * 4, pairs // 2),), peers=4,
                  pairs=pairs, elem_bytes=12, elem_key="w")
    assert need.step_limit() == STEPS_PER_PAIR * pairs
    assert need.fits(need.smallest_budget())
    assert not need.fits(need.smallest_budget() - 1)


def test_a_switch_with_nothing_to_send_fits_any_budget() -> None:
    need = Demand(busiest_bytes=0, sides=(), peers=0, pairs=0, elem_bytes=0, elem_key="")
    assert need.fits(1) and need.smallest_budget() == 1


@pytest.mark.parametrize("n", [1, 999, 1023, 1024, 1025, 14_624, 153_426_400, 611_472_468,
                               (1 << 30) + 1, 3 << 40])
def test_suggested_sizes_are_written_exactly_and_the_next_smaller_is_below(n) -> None:
    v = _round_up(n)
    text = format_bytes(v)
    assert v >= n and parse_bytes(text.replace(" ", "")) == v
    if v >= 1024:
        number, unit = text.split()
        assert parse_bytes(f"{float(number) - 0.1:.1f}{unit}") < n
