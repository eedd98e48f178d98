"""``dynatrain plan A B --device D``: one device's slice, printed, written and checked.

The numbers the command prints (rounds, messages and bytes sent and received, local copies,
peak staging of the device) must be those of the device's part of the global plan
(``plan_transition``), counted here from the global plan's own messages; ``--text -`` must
list exactly those messages, round by round; ``--json`` holds the same slice. Options a slice
cannot honour, and a device in neither layout, exit 2 with one line naming the option.
"""

from __future__ import annotations

import json
import re
from functools import cache

import pytest

from dynatrain.cli import main
from dynatrain.ir.errors import EXIT_BAD_INPUT
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.planner.plan import Plan, Round, message_order
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.serialize import plan_from_json
from dynatrain.planner.text import plan_to_text

A, B = "specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"
BUDGET = 1 << 20  # 8 rounds on the tiny pair: several rounds, still fast


@cache
def global_plan(src: str, dst: str) -> Plan:
    return plan_transition(Layout(load_spec(src)), Layout(load_spec(dst)), BUDGET)


def part_of(glob: Plan, device: str) -> Plan:
    """The global plan's rounds with only ``device``'s messages, in the global order."""
    rounds = []
    for r in glob.rounds:
        msgs = tuple(m for m in r.messages if device in (m.src_device, m.dst_device))
        rounds.append(Round(msgs, message_order(msgs)))
    return Plan(glob.src_name, glob.dst_name, glob.src_devices, glob.dst_devices,
                tuple(rounds), glob.budget_bytes, glob.derived)


def expected_numbers(glob: Plan, device: str) -> dict[str, int]:
    msgs = [m for r in glob.rounds for m in r.messages if device in (m.src_device, m.dst_device)]
    sent = [m for m in msgs if not m.local and m.src_device == device]
    recv = [m for m in msgs if not m.local and m.dst_device == device]
    local = [m for m in msgs if m.local]
    peak = 0
    for r in glob.rounds:
        peak = max(peak, sum(m.nbytes for m in r.messages if not m.local and device in (
            m.src_device, m.dst_device)))
    return dict(rounds=len(glob.rounds), sent=len(sent), received=len(recv),
                local=len(local), bytes_sent=sum(m.nbytes for m in sent),
                bytes_received=sum(m.nbytes for m in recv),
                bytes_local=sum(m.nbytes for m in local), peak=peak,
                transfers=sum(len(m.transfers) for m in msgs))


def printed_numbers(out: str) -> dict[str, int]:
    def grab(pattern: str) -> tuple[int, ...]:
        m = re.search(pattern, out)
        assert m, f"{pattern!r} not in:\n{out}"
        return tuple(int(g) for g in m.groups())

    rounds, = grab(r"rounds +(\d+) ")
    sent, received, local, transfers = grab(
        r"messages +(\d+) sent, (\d+) received, (\d+) local cop(?:y|ies); (\d+) transfers?")
    bs, br, bl = grab(r"bytes +sent (\d+) .*received (\d+) .*local (\d+) ")
    peak, = grab(r"staging +peak (\d+) ")
    return dict(rounds=rounds, sent=sent, received=received, local=local, bytes_sent=bs,
                bytes_received=br, bytes_local=bl, peak=peak, transfers=transfers)


@pytest.mark.parametrize("src,dst,device", [
    (A, B, "node0:gpu0"), (A, B, "node0:gpu3"), (B, A, "node0:gpu2")])
def test_printed_slice_is_the_global_plans_part(capsys, src, dst, device) -> None:
    assert main(["plan", src, dst, "--device", device, "--budget", str(BUDGET)]) == 0
    out = capsys.readouterr().out
    glob = global_plan(src, dst)
    want = expected_numbers(glob, device)
    assert want["rounds"] > 1 and want["sent"] and want["received"]  # a case that can differ
    assert printed_numbers(out) == want
    assert f"device    {device} " in out
    assert "verify_slice: ok" in out


def test_text_lists_the_devices_messages(capsys) -> None:
    dev = "node0:gpu1"
    assert main(["plan", A, B, "--device", dev, "--budget", str(BUDGET), "--text", "-"]) == 0
    out = capsys.readouterr().out
    glob = global_plan(A, B)
    assert out == plan_to_text(part_of(glob, dev))
    assert out != plan_to_text(glob)  # the other devices' messages are left out


def test_json_holds_the_slice(tmp_path, capsys) -> None:
    dev, path = "node0:gpu2", tmp_path / "slice.json"
    assert main(["plan", B, A, "--device", dev, "--budget", str(BUDGET),
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["format"] == "dynatrain.slice/1" and doc["summary"]["verified"]
    glob = global_plan(B, A)
    want = part_of(glob, dev)
    got = plan_from_json(doc["plan"])
    assert got.rounds == want.rounds
    s = doc["summary"]
    n = printed_numbers(out)
    assert (s["bytes_sent"], s["bytes_received"], s["peak_staging_bytes"]) == (
        n["bytes_sent"], n["bytes_received"], n["peak"])
    assert [s["unit_bytes"], s["rounds"]] == list(glob.stats["spread"])


@pytest.mark.parametrize("extra,option", [
    (["--device", "node7:gpu0"], "--device"),
    (["--device", "node0:gpu1", "--place", "auto"], "--place auto"),
    (["--device", "node0:gpu1", "--failed", "node0:gpu2"], "--failed"),
    (["--device", "node0:gpu1", "--per-device"], "--per-device"),
    (["--device", "node0:gpu1", "--reserve", "1GiB"], "--reserve"),
])
def test_options_a_slice_cannot_honour_exit_2(capsys, extra, option) -> None:
    assert main(["plan", A, B, *extra]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dynatrain: error: {option}:"), err
    if option == "--device":
        assert "neither layout" in err[0]
