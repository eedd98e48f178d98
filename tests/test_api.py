"""The public Python API: the example in docs/cli.md runs, and it checks what the CLI checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dynatrain as dt
from dynatrain.cli import main
from dynatrain.ir.units import format_bytes as _format_bytes

ROOT = Path(__file__).resolve().parent.parent
TINY_SRC, TINY_DST = "specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"
SRC, DST = "specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp8-dp2.yaml"


def readme_example() -> str:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(tmp_path, monkeypatch, capsys) -> None:
    code = readme_example()
    monkeypatch.chdir(tmp_path)
    for spec in (TINY_SRC, TINY_DST):  # the example names shipped specs relative to the repo
        (tmp_path / spec).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / spec).write_text((ROOT / spec).read_text())
    exec(compile(code, "docs/cli.md", "exec"), {})  # noqa: S102 — our own docs
    out = capsys.readouterr().out
    assert out.startswith("tiny-gpt") and "moved" in out
    assert json.loads((tmp_path / "tiny-plan.json").read_text())["format"] == "dynatrain.plan/3"


def test_summary_is_what_the_cli_prints(capsys) -> None:
    switch = dt.plan(SRC, DST)
    assert main(["plan", SRC, DST]) == 0
    cli_lines = capsys.readouterr().out.splitlines()
    api_lines = dt.summarize(switch).splitlines()
    timing = re.compile(r"planned in .*")  # the two runs take their own time
    assert [timing.sub("", x) for x in api_lines] == [timing.sub("", x) for x in cli_lines]


def test_budget_in_any_unit_and_stats_have_the_checks() -> None:
    a = dt.plan(TINY_SRC, TINY_DST, budget="1MiB")
    b = dt.plan(TINY_SRC, TINY_DST, budget=1 << 20)
    assert a.plan.rounds == b.plan.rounds and a.budget_bytes == 1 << 20
    for key in ("verify_seconds", "peak_live_bytes", "bytes_moved", "predicted_seconds"):
        assert key in a.stats, key
    with pytest.raises(dt.DynatrainError, match="budget"):
        dt.plan(TINY_SRC, TINY_DST, budget="2")  # two bytes, surely meant with a unit


def test_verify_switch_checks_device_memory_as_the_cli_does(tmp_path, capsys) -> None:
    switch = dt.plan(SRC, DST)
    dt.save_plan(switch, tmp_path / "p.json")
    live = switch.stats["peak_live_bytes"]
    # A reserve that leaves less than the state needs: the API and `dynatrain verify` agree.
    reserve = int(80e9) - live + 1
    report = dt.verify_switch(dt.load_plan(tmp_path / "p.json"), reserve=reserve)
    assert not report.ok and report.rules() == {"memory"}
    assert main(["verify", str(tmp_path / "p.json"), "--reserve", str(reserve)]) == 1
    assert "memory" in capsys.readouterr().out
    assert dt.verify_switch(dt.load_plan(tmp_path / "p.json"), reserve=reserve - 1).ok
    with pytest.raises(dt.VerificationError):
        dt.plan(SRC, DST, reserve=reserve)


def test_load_plan_round_trip_and_bad_files(tmp_path) -> None:
    switch = dt.plan(TINY_SRC, TINY_DST, budget="1MiB")
    dt.save_plan(switch, tmp_path / "p.json")
    again = dt.load_plan(tmp_path / "p.json")
    assert again.plan == switch.plan and again.budget_bytes == switch.budget_bytes
    assert again.src.spec == switch.src.spec
    with pytest.raises(dt.DynatrainError, match="cannot read"):
        dt.load_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(dt.DynatrainError, match="not JSON"):
        dt.load_plan(tmp_path / "bad.json")


def test_import_dynatrain_needs_no_torch() -> None:
    code = ("import sys, dynatrain; assert 'torch' not in sys.modules; "
            "assert callable(dynatrain.plan) and dynatrain.verify_switch; "
            "import dynatrain.verify.check")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_suggest_from_python_and_the_cli(tmp_path, capsys) -> None:
    spec = "specs/llama3.1-8b/tp2-dp4.yaml"
    six = [f"node0:gpu{i}" for i in range(6)]
    got = dt.suggest(spec, "node0:gpu0-5", top=2)
    assert got.ranked and all(tuple(dt.load_layout(s.spec).devices) == tuple(six)
                              for s in got.ranked)
    times = [s.predicted_seconds for s in got.ranked]
    assert times == sorted(times)
    assert main(["suggest", spec, "--devices", "node0:gpu0-5", "--top", "2", "--json",
                 str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert got.ranked[0].grid in out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert len(doc["suggestions"]) == len(got.ranked)
    assert main(["suggest", spec, "--devices", "gpu0-5"]) == 2  # no node named
    assert capsys.readouterr().err.startswith("dynatrain: error: --devices")


def test_plan_from_survivors_names_what_is_lost(tmp_path, capsys) -> None:
    dst96 = "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml"
    out = tmp_path / "lost.json"
    # node15 dies: its DistributedOptimizer shards have no other copy.
    assert main(["plan", SRC, dst96, "--failed", "node15", "--json", str(out)]) == 3
    text, err = capsys.readouterr()
    assert "failed devices: node15:gpu0" in text and "[main_param, exp_avg, exp_avg_sq]" in text
    assert err.count("\n") == 1 and err.startswith("dynatrain: error: state lost: 6 tensors")
    doc = json.loads(out.read_text())
    assert doc["format"] == "dynatrain.lost/1"
    with pytest.raises(dt.StateLost) as info:
        dt.plan(SRC, dst96, failed="node15")
    assert info.value.exit_code == 3
    assert info.value.lost.to_json() == doc["lost"]  # the CLI and the API name the same loss
    # --allow-lost: plan what survives, verified, nothing read from node15, the loss recorded.
    switch = dt.plan(SRC, dst96, failed=["node15:gpu%d" % i for i in range(8)], allow_lost=True)
    assert switch.report.ok and switch.stats["lost"] == doc["lost"]
    assert not any(m.src_device.startswith("node15:") for m in switch.plan.messages())
    assert "lost    state lost: 6 tensors" in dt.summarize(switch)
    assert main(["plan", SRC, dst96, "--failed", "node99"]) == 2  # not a device of the job
    assert capsys.readouterr().err.startswith("dynatrain: error: --failed")


def test_derive_param_summary_counts_the_dp_all_gather() -> None:
    from dynatrain.ir.loader import spec_to_dict
    from dynatrain.ir.summary import bytes_by_kind
    from dynatrain.planner.cost import H100
    from dynatrain.planner.derive_cost import derived_param_gather

    doc = spec_to_dict(dt.load_layout(TINY_DST).spec)
    doc["state"] = {**doc.get("state", {}), "derive_param": True}
    dst = dt.load_layout(doc)
    switch = dt.plan(TINY_SRC, dst, budget="1MiB")
    g = derived_param_gather(dst, H100)
    # Each DP group owns every param element once: a rank receives what it holds but does not
    # own, so the group receives (dp - 1) / dp of the params it holds.
    params = next(k for k in bytes_by_kind(dst) if k.kind == "param").total_bytes
    assert g.total_bytes * dst.dp == params * (dst.dp - 1) and g.total_bytes > 0
    text = dt.summarize(switch)
    assert "all-gathers the rest over DP" in text
    assert f"{_format_bytes(g.total_bytes)} in all" in text
