"""``dynatrain run-plan`` runs a real switch on this machine and says whether it is bit-exact.

The tiny shipped pair runs in-process through ``dynatrain.cli.main`` (the command forks one
gloo process per device); a pair too large to run as local processes is refused with one
line and status 2 before anything starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dynatrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny-gpt"
BIG = ROOT / "specs" / "llama3.1-70b"


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_tiny_pair_switches_bit_exact_in_several_rounds(capfd) -> None:
    # capfd: the progress lines come from the forked process 0, through file descriptor 2.
    code, out, err = run_main(["run-plan", str(TINY / "tp2-dp2.yaml"), str(TINY / "pp2-dp2.yaml"),
                               "--budget", "1MiB", "--seed", "3", "--timeout", "30"], capfd)
    assert code == 0, (out, err)
    assert "  bit-exact: yes (" in out
    rounds = int(re.search(r"moved .* in (\d+) rounds?, ", out).group(1))
    assert rounds > 1  # the 1 MiB budget splits the switch into rounds, each logged once
    assert err.count("  round ") == rounds and f"round {rounds}/{rounds}: " in err, err
    assert "budget 1.0 MiB" in out
    # Each of the three throughputs says what it divides by what.
    assert "GB/s over all devices (bytes moved between devices over the slowest process's " \
        "time)" in out, out
    assert "GB/s so far (all devices' bytes over the time since round 0)" in err, err
    assert "GB/s through its own links (its sent + received bytes over its exchange time)" \
        in err, err


def test_check_transfers_and_json_report(tmp_path, capfd) -> None:
    report = tmp_path / "run.json"
    code, out, err = run_main(["run-plan", str(TINY / "pp2-dp2.yaml"), str(TINY / "tp2-dp2.yaml"),
                               "--check-transfers", "--quiet", "--json", str(report)], capfd)
    assert code == 0, (out, err)
    assert "  bit-exact: yes (" in out
    assert "  transfers every fingerprint matched at both ends inside the switch (" in out
    doc = json.loads(report.read_text(encoding="utf-8"))
    assert doc["bit_exact"] and len(doc["processes"]) == 4
    reports = [p["report"] for p in doc["processes"]]
    assert sum(r["bytes_sent"] for r in reports) == doc["plan"]["bytes_moved"]
    assert all(len(r["round_seconds"]) == doc["plan"]["rounds"] for r in reports)
    assert all(r["check_seconds"] > 0 for r in reports)


def test_a_world_too_large_for_local_processes_is_refused(capsys) -> None:
    code, out, err = run_main(["run-plan", str(BIG / "tp8-pp4-dp4.yaml"),
                               str(BIG / "tp8-pp8-dp2.yaml")], capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynatrain: error: run-plan: ")
    assert "128 devices" in lines[0] and "at most 16" in lines[0]


def test_processes_caps_the_local_world(capsys) -> None:
    code, out, err = run_main(["run-plan", str(TINY / "tp2-dp2.yaml"), str(TINY / "pp2-dp2.yaml"),
                               "--processes", "3"], capsys)
    assert code == 2 and out == "" and "4 devices" in err and len(err.splitlines()) == 1


def test_a_wrong_destination_is_reported_not_bit_exact(capfd, monkeypatch) -> None:
    # Break the runtime (staged pieces are never unpacked): the check must see it and fail.
    from dynatrain.runtime import exchange

    monkeypatch.setattr(exchange, "_unpack", lambda piece: None)
    code, out, err = run_main(["run-plan", str(TINY / "tp2-dp2.yaml"), str(TINY / "pp2-dp2.yaml"),
                               "--quiet"], capfd)
    assert code == 1, (out, err)
    assert "  bit-exact: no (" in out and "differs" in err


def test_a_switch_that_times_out_is_one_line_and_exit_4() -> None:
    # In a fresh process (torch reads its C++ log level when it loads): gloo's own connection
    # errors stay off stderr, where the aborted switch's one line goes.
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "dynatrain.cli", "run-plan",
                           str(TINY / "tp2-dp2.yaml"), str(TINY / "pp2-dp2.yaml"), "--quiet",
                           "--timeout", "0.001"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 4, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("dynatrain: error: switch aborted: "), done.stderr
