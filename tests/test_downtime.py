"""Predicted downtime (wire model plus fixed costs), topology validation, and the fixed costs
the runtime reports for a real switch.

The arithmetic is checked on a hand-built plan whose every number is computed by hand; the
runtime's report on a real gloo switch of the tiny GPT (no timings asserted, only that the
parts exist, are non-negative and fit inside the measured total).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from dynatrain.ir.box import Box
from dynatrain.ir.errors import EXIT_BAD_INPUT, SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.state import transition_views
from dynatrain.planner.cost import (H100, PRESETS, Downtime, Topology, load_topology,
                                    lower_bound_seconds, predicted_downtime,
                                    predicted_seconds)
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.plan import Message, Plan, Round, Transfer

ROOT = Path(__file__).resolve().parents[1]
A, B, C = "node0:gpu0", "node0:gpu1", "node1:gpu0"

# Round numbers: 1 GB/s inside a node, 0.5 across, 2 locally; 10 us latency per round.
TOPO = Topology(name="t", intra_node_GBps=1.0, inter_node_GBps=0.5, local_copy_GBps=2.0,
                latency_us=10.0, switch_fixed_s=0.2, round_fixed_us=1000.0, memory_GB=None)


def _msg(src: str, dst: str, nbytes: int) -> Message:
    t = Transfer("w", ("param",), Box((0,), (1,)), 0, 0, None, Box((0,), (1,)), None,
                 Box((0,), (1,)), nbytes)
    return Message(src, dst, (t,))


def _plan(rounds: tuple[Round, ...], derived: tuple[str, ...] = ()) -> Plan:
    return Plan("src", "dst", (A, B, C), (A, B, C), rounds, 1 << 30, derived)


PLAN = _plan((
    # A sends 1 GB over NVLink (1 s) and 0.25 GB across nodes (0.5 s): busiest link 1 s.
    Round((_msg(A, B, 10**9), _msg(A, C, 25 * 10**7))),
    # C copies 1 GB locally: 0.5 s.
    Round((_msg(C, C, 10**9),)),
))


def test_downtime_is_wire_plus_fixed_from_the_topology_fields():
    d = predicted_downtime(PLAN, TOPO)
    assert d.wire_seconds == predicted_seconds(PLAN, TOPO)
    assert d.lower_bound_seconds == lower_bound_seconds(PLAN, TOPO)
    assert d.wire_seconds == pytest.approx((1.0 + 10e-6) + (0.5 + 10e-6))
    # all bytes at once: A's NVLink (1 s) is still the busiest link
    assert d.lower_bound_seconds == pytest.approx(1.0 + 10e-6)
    assert d.rounds == 2
    assert d.switch_fixed_seconds == 0.2
    assert d.round_fixed_seconds == pytest.approx(2 * 1000e-6)
    assert d.fixed_seconds == d.switch_fixed_seconds + d.round_fixed_seconds
    assert d.total_seconds == d.wire_seconds + d.fixed_seconds
    assert d.total_seconds == pytest.approx(1.70202)
    assert d.as_dict()["total_seconds"] == d.total_seconds


def test_describe_states_parts_total_and_exclusions():
    text = predicted_downtime(PLAN, TOPO).describe()
    assert "\n" not in text
    assert text == ("wire 1.500 s on t (bandwidth model; lower bound 1.000 s, 1.50x) + fixed "
                    "~202 ms (setup, start barrier and commit vote 200 ms; 2 round syncs "
                    "2 ms) = ~1.702 s downtime predicted; excludes building the destination "
                    "job, forming process groups")
    derived = predicted_downtime(_plan(PLAN.rounds, ("param",)), TOPO)
    assert derived.describe().endswith("forming process groups, deriving params")


def test_empty_plan_pays_only_the_switch_fixed_cost():
    d = predicted_downtime(_plan(()), TOPO)
    assert (d.wire_seconds, d.lower_bound_seconds, d.round_fixed_seconds) == (0.0, 0.0, 0.0)
    assert d.total_seconds == 0.2
    # Nothing moves: no ratio of two zeros.
    assert "wire 0 s on t (bandwidth model; lower bound 0 s) + fixed ~200 ms" in d.describe()


@pytest.mark.parametrize("seconds, shown", [
    (0.0, "0 s"), (2.5, "2.500 s"), (0.0123, "12.3 ms"), (5.98e-6, "5.98 us"),
    (3.2e-8, "32 ns"), (1e-300, "<1 ns"), (1e300, "1e+300 s"), (7.5e6, "7.5e+06 s")])
def test_times_are_shown_in_a_unit_that_means_something(seconds, shown):
    from dynatrain.ir.units import format_seconds

    assert format_seconds(seconds) == shown


def test_a_tiny_plan_shows_its_wire_time_in_microseconds(capsys):
    from dynatrain.cli import main

    assert main(["plan", "specs/tiny-gpt/pp2-dp2.yaml", "specs/tiny-gpt/tp2-dp2.yaml"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  time"))
    assert "wire 0.000 s" not in line and "lower bound 0.000 s" not in line
    assert re.search(r"wire [0-9.]+ us on .* lower bound [0-9.]+ us, [0-9.]+x\)", line), line


@pytest.mark.parametrize("field, value", [
    ("inter_node_GBps", 1e-300), ("intra_node_GBps", 1e300), ("local_copy_GBps", 0.0),
    ("latency_us", 1e300), ("switch_fixed_s", 1e9), ("round_fixed_us", -1),
    ("memory_GB", 1e-300)])
def test_topology_fields_out_of_range_are_refused(field, value, tmp_path, capsys):
    from dynatrain.cli import main

    topo = tmp_path / "t.yaml"
    topo.write_text(f"{field}: {value!r}\n")
    assert main(["plan", "specs/tiny-gpt/pp2-dp2.yaml", "specs/tiny-gpt/tp2-dp2.yaml",
                 "--topology", str(topo)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"dynatrain: error: topology.{field}: ") and "Input should be" in err


def test_downtime_is_frozen():
    d = predicted_downtime(PLAN, TOPO)
    assert isinstance(d, Downtime)
    with pytest.raises(AttributeError):
        d.wire_seconds = 0.0  # type: ignore[misc]


def _topo_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("field, value", [
    ("latency_us", ".inf"), ("intra_node_GBps", ".nan"), ("switch_fixed_s", ".inf"),
    ("round_fixed_us", "-.inf"), ("memory_GB", ".inf"), ("switch_fixed_s", "-1"),
    ("round_fixed_us", "-5"),
])
def test_topology_refuses_non_finite_or_negative_numbers_naming_the_field(tmp_path, field,
                                                                          value):
    path = _topo_file(tmp_path, "bad.yaml", f"{field}: {value}\n")
    with pytest.raises(SpecError) as info:
        load_topology(path)
    msg = str(info.value)
    assert msg.startswith(f"topology.{field}: ") and "\n" not in msg
    assert info.value.exit_code == EXIT_BAD_INPUT


def test_topology_without_name_is_named_after_its_file(tmp_path):
    topo = load_topology(_topo_file(tmp_path, "mytopo.yaml", "intra_node_GBps: 100\n"))
    assert topo.name == "mytopo"
    assert topo.intra_node_GBps == 100.0
    named = load_topology(_topo_file(tmp_path, "other.yaml", "name: lab-a100\n"))
    assert named.name == "lab-a100"


def test_topology_file_must_be_a_mapping(tmp_path):
    with pytest.raises(SpecError, match=r"^--topology: must be a YAML mapping"):
        load_topology(_topo_file(tmp_path, "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(SpecError, match=r"^--topology: must be h100, h800, gloo-local or a "):
        load_topology(str(tmp_path / "missing.yaml"))


def test_presets_carry_finite_fixed_costs():
    assert load_topology("h100") is H100 and H100.name == "h100-8xnvlink-8x400g"
    assert load_topology("gloo-local").name == "gloo-local"
    for topo in PRESETS.values():
        for v in (topo.switch_fixed_s, topo.round_fixed_us, topo.latency_us):
            assert math.isfinite(v) and v >= 0
        assert topo.switch_fixed_s > 0  # every real switch pays a vote


def test_runtime_reports_fixed_parts_within_its_total():
    from dynatrain.runtime.local import run_local

    src = Layout(load_spec(str(ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml")))
    dst = Layout(load_spec(str(ROOT / "specs" / "tiny-gpt" / "pp2-dp2.yaml")))
    sv, dv = transition_views(src, dst)
    plan = plan_transition(src, dst, 1 << 20)
    results = run_local(plan, sv, dv, timeout=60.0)
    assert [e for r in results for e in r["errors"]] == []
    for r in results:
        rep = r["report"]
        parts = ("setup_seconds", "start_barrier_seconds", "round_wait_seconds",
                 "exchange_seconds", "derive_seconds", "check_seconds", "vote_seconds",
                 "fixed_seconds")
        for k in parts:
            assert rep[k] >= 0, k
        assert rep["start_barrier_seconds"] == 0.0  # gloo needs no start barrier
        assert rep["fixed_seconds"] == rep["setup_seconds"] + rep["vote_seconds"]
        assert rep["round_wait_seconds"] <= rep["exchange_seconds"]
        assert rep["start_barrier_seconds"] <= rep["setup_seconds"]
        accounted = (rep["setup_seconds"] + rep["exchange_seconds"] + rep["derive_seconds"]
                     + rep["check_seconds"] + rep["vote_seconds"])
        assert 0 < accounted <= rep["total_seconds"]
        assert rep["rounds"] == len(plan.rounds)


@pytest.mark.parametrize("text, field, says", [
    ("memory_GB: true\n", "memory_GB", "valid number (got True)"),  # not 1 GB
    ("intra_node_GBps: '300'\n", "intra_node_GBps", "valid number (got '300')"),
    ('name: "lab\\nb"\n', "name", "must be one line of printable text"),  # splits the summary
    ('name: "lab\\tb"\n', "name", "must be one line of printable text"),
])
def test_topology_refuses_booleans_strings_for_numbers_and_control_characters(tmp_path, text,
                                                                              field, says):
    with pytest.raises(SpecError) as info:
        load_topology(_topo_file(tmp_path, "bad.yaml", text))
    msg = str(info.value)
    assert msg.startswith(f"topology.{field}: ") and says in msg and "\n" not in msg, msg
