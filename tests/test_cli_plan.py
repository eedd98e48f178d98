"""`dynatrain plan` on shipped specs: summary, JSON round trip, clean errors."""

from __future__ import annotations

import json
import math
import re

import pytest

from dynatrain.cli import main, parse_bytes
from dynatrain.ir.errors import DynatrainError
from dynatrain.planner.serialize import plan_from_json, plan_to_json

SRC = "specs/llama3.1-70b/tp8-pp4-dp4.yaml"
DST = "specs/llama3.1-70b/tp8-pp8-dp2.yaml"


def test_plan_prints_summary_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", SRC, DST, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the least any plan moves for this placement" in text and "rounds" in text
    assert "biggest movers" in text and "optimal" not in text
    doc = json.loads(out.read_text())
    for field in ("bytes_moved", "bytes_lower_bound", "bytes_local", "messages", "rounds",
                  "peak_staging_bytes", "budget_bytes", "predicted_seconds",
                  "lower_bound_seconds", "plan_seconds", "verify_seconds"):
        assert field in doc["summary"], field
    assert doc["summary"]["bytes_moved"] == doc["summary"]["bytes_lower_bound"]
    assert doc["summary"]["peak_staging_bytes"] <= doc["summary"]["budget_bytes"]
    again = plan_to_json(plan_from_json(doc), doc["src_spec"], doc["dst_spec"])
    assert again == doc


def test_plan_reports_the_peak_memory_a_device_needs_while_switching(tmp_path, capsys) -> None:
    # Oracle: per device, its source and destination storage as the runtime allocates it,
    # plus the most it sends and receives between devices in one round.
    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import load_spec
    from dynatrain.ir.state import transition_views
    from dynatrain.planner.serialize import plan_from_json
    from dynatrain.runtime.storage import storage_layout

    src, dst = "specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"
    out = tmp_path / "plan.json"
    assert main(["plan", src, dst, "--budget", "1MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    plan = plan_from_json(doc)
    sv, dv = transition_views(Layout(load_spec(src)), Layout(load_spec(dst)))

    def state(view, devices, device) -> int:
        if device not in devices:
            return 0
        return sum(math.prod(shape) * dtype.itemsize
                   for shape, dtype in storage_layout(view, devices.index(device)).values())

    want = max(state(sv, plan.src_devices, d) + state(dv, plan.dst_devices, d)
               + max(sum(m.nbytes for m in r.messages if not m.local
                         and d in (m.src_device, m.dst_device)) for r in plan.rounds)
               for d in set(plan.src_devices) | set(plan.dst_devices))
    assert doc["summary"]["peak_live_bytes"] == want
    assert "  memory  peak " in text and "per device while switching" in text


def test_plan_errors_are_one_line_exit_2(tmp_path, capsys) -> None:
    assert main(["plan", SRC, "specs/qwen3-30b-a3b/tp2-pp2-ep4.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "same model" in err[0]
    assert main(["plan", SRC, DST, "--budget", "lots"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["plan", SRC, DST, "--budget", "1B"]) == 2
    assert "too small" in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("4096") == parse_bytes(4096) == 4096  # a bare number means bytes
    assert parse_bytes(100) == 100  # an int is bytes on purpose
    for bad in ("2", "100", "nan", "inf", "1e999", "-1GiB", "0", "2 parsecs", True, 2.5, 0):
        with pytest.raises(DynatrainError, match="^--budget: "):
            parse_bytes(bad)
    with pytest.raises(DynatrainError, match="2GiB or 2MiB"):  # says what was probably meant
        parse_bytes("2")


def test_plan_with_no_command_prints_usage(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: dynatrain" in err and all(c in err for c in ("plan", "verify", "run-plan"))


def test_plan_summary_counts_and_labels(capsys) -> None:
    tiny = ("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml")
    assert main(["plan", *tiny, "--budget", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"sends   \d+ messages between devices in \d+ rounds", text)
    assert re.search(r"local   .* \(\d+ local cop(y|ies)\)", text)
    assert "wire " in text and "bandwidth model" in text
    assert "1 rounds" not in text and "1 devices" not in text


def test_plan_place_auto_and_per_device(capsys) -> None:
    dst96 = "specs/llama3.1-70b/tp8-pp4-dp3-96gpu.yaml"
    assert main(["plan", SRC, dst96, "--place", "auto", "--per-device"]) == 0
    text = capsys.readouterr().out
    assert "place   auto" in text and "less than rank r on device r" in text
    rows = [l for l in text.splitlines() if l.startswith("    node")]
    assert len(rows) == 128  # every device of either layout, leaving ones included
    assert rows[8].split()[0] == "node1:gpu0"  # numeric order: node1 before node10
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error, one line
        main(["plan", SRC, dst96, "--place", "somewhere"])
    assert exc.value.code == 2 and "--place" in capsys.readouterr().err


def test_plan_text_listing(tmp_path, capsys) -> None:
    out = tmp_path / "plan.txt"
    assert main(["plan", "specs/llama3.1-8b/tp2-dp4.yaml", "specs/llama3.1-8b/tp2-dp4.yaml",
                 "--text", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("plan ") and "local copy node0:gpu0 -> node0:gpu0" in text
    assert "  send " not in text  # an identity switch sends nothing
    assert main(["plan", SRC, DST, "--text", str(tmp_path / "missing" / "x.txt")]) == 2
    assert capsys.readouterr().err.startswith("dynatrain: error: --text: cannot write")


def test_plan_heatmap_and_dot(tmp_path, capsys) -> None:
    small = "specs/llama3.1-8b/tp2-dp4.yaml"
    png, dot = tmp_path / "t.png", tmp_path / "t.dot"
    assert main(["plan", SRC, DST, "--heatmap", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", small, small, "--dot", str(dot)]) == 0
    assert dot.read_text().startswith("digraph")
    capsys.readouterr()
    js, png2 = tmp_path / "big.json", tmp_path / "big.png"
    assert main(["plan", SRC, DST, "--json", str(js), "--heatmap", str(png2),
                 "--dot", str(dot)]) == 2  # 70B: too many messages to draw
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dot" in err[0] and "at most" in err[0]
    # Known too large only once planned: the other outputs asked for are written, and said so.
    assert err[0].endswith("--json and --heatmap written"), err
    assert json.loads(js.read_text())["format"] == "dynatrain.plan/3"
    assert png2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", small, small, "--heatmap", str(tmp_path / "t.jpg")]) == 2


def _weights_only_70b(world: int) -> dict:
    """Llama-3.1-70B TP8 PP4, weights only: every data-parallel replica alike, so pairs
    that feed them are twins and the plan's classes have several members."""
    return dict(model="llama3.1-70b", parallel=dict(tp=8, pp=4),
                state=dict(main_param=None, exp_avg=None, exp_avg_sq=None),
                world=dict(nodes=world // 8, gpus_per_node=8))


@pytest.mark.parametrize("pair,budget", [
    (("specs/tiny-gpt/tp2-dp2.yaml", "specs/tiny-gpt/pp2-dp2.yaml"), 1 << 14),  # many rounds
    ((SRC, DST), 2 << 30),
    (("specs/qwen3-30b-a3b/tp2-pp2-ep4.yaml", "specs/qwen3-30b-a3b/tp2-pp2-ep4.yaml"), 1 << 30),
    ((_weights_only_70b(128), _weights_only_70b(64)), 2 << 30),  # classes of twins
])
def test_streamed_json_and_text_are_the_documents_bytes(pair, budget, monkeypatch) -> None:
    # The writers stream a batch of messages at a time, a plan kept as classes straight
    # from them; what they write must be exactly the whole document's compact JSON and the
    # whole text, whatever the batch boundaries.
    import io

    from dynatrain.ir.layout import Layout
    from dynatrain.ir.loader import load_spec, spec_from_dict, spec_to_dict
    from dynatrain.planner import serialize
    from dynatrain.planner.pipeline import plan_transition
    from dynatrain.planner.text import plan_text_lines, plan_to_text

    src, dst = (Layout(load_spec(x) if isinstance(x, str) else spec_from_dict(x, origin="t"))
                for x in pair)
    plan = plan_transition(src, dst, budget)
    if isinstance(pair[0], dict):  # members that send with ranks other than the first's
        assert any(len(c.members) > 1 for c in plan.classes.classes)
    specs = (spec_to_dict(src.spec), spec_to_dict(dst.spec, plan.dst_devices))
    for batch in (1, 3, serialize.STREAM_BATCH):
        monkeypatch.setattr(serialize, "STREAM_BATCH", batch)
        for with_specs in (specs, (None, None)):
            out = io.StringIO()
            serialize.write_plan_json(plan, out, *with_specs)
            whole = json.dumps(plan_to_json(plan, *with_specs), separators=(",", ":"))
            assert out.getvalue() == whole, batch
    assert "".join(plan_text_lines(plan)) == plan_to_text(plan)
    assert plan_from_json(json.loads(whole)).rounds == plan.rounds


def _command(*args: str, **kw):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "dynatrain.cli", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_command_ends_without_teardown_but_with_everything_written(tmp_path) -> None:
    """`plan` ends with ``os._exit`` (``cli.QUICK_EXIT``): its summary and JSON are complete,
    and its status is main's, for a plan and for bad input alike."""
    out = tmp_path / "plan.json"
    done = _command("plan", SRC, DST, "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "planned in" in done.stdout and done.stdout.endswith("\n")
    assert json.loads(out.read_text())["summary"]["bytes_moved"] > 0
    bad = _command("plan", str(tmp_path / "missing.yaml"), DST)
    assert bad.returncode == 2 and bad.stderr.startswith("dynatrain: error: "), bad.stderr


def test_command_into_a_closed_pipe_exits_quietly() -> None:
    """Read one line of every transfer as text (far more than a pipe buffers) and close the
    pipe, as `| head -1` does: the quick exit keeps the quiet end ``main`` gives it, status
    0, no traceback and no 'Exception ignored' from the last flush."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "dynatrain.cli", "plan", SRC, DST,
                             "--text", "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_plan_json_that_cannot_be_written_names_the_option(capsys) -> None:
    # /proc exists, so the early output check passes; the write itself fails
    assert main(["plan", SRC, DST, "--json", "/proc/dynatrain-no-such-file"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynatrain: error: --json: ") and "cannot write" in err, err
    assert err.count("\n") == 1
