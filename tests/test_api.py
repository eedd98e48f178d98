"""The public Python API: the README's example runs, and it checks what the CLI checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dynatrain as dt
from dynatrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY_SRC, TINY_DST = "specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"
SRC, DST = "specs/llama3.1-70b/tp8-pp4-dp4.yaml", "specs/llama3.1-70b/tp8-pp8-dp2.yaml"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(tmp_path, monkeypatch, capsys) -> None:
    code = readme_example()
    monkeypatch.chdir(tmp_path)
    for spec in (TINY_SRC, TINY_DST):  # the example names shipped specs relative to the repo
        (tmp_path / spec).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / spec).write_text((ROOT / spec).read_text())
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 — our own README
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
