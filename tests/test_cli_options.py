"""Options are honoured or refused up front, ``-`` is stdout for every output, and sizes,
device lists and rank lists read one syntax everywhere (ASCII digits, ranges low-high)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from dynatrain.api import failed_devices, load_layout
from dynatrain.cli import build_parser, main
from dynatrain.ir.devices import parse_device_list
from dynatrain.ir.errors import DynatrainError, SpecError
from dynatrain.ir.loader import spec_from_dict
from dynatrain.ir.units import parse_bytes
from dynatrain.planner.suggest import MAX_SUGGEST_DEVICES, parse_devices
from test_cli_errors import assert_one_error_line, run_main

ROOT = Path(__file__).resolve().parent.parent
TINY_SRC = str(ROOT / "specs" / "tiny-gpt" / "pp2-dp2.yaml")
TINY_DST = str(ROOT / "specs" / "tiny-gpt" / "tp2-dp2.yaml")
SMALL = str(ROOT / "specs" / "llama3.1-8b" / "tp2-dp4.yaml")  # 8 GPUs per node
BIG = str(ROOT / "specs" / "llama3.1-70b" / "tp8-pp4-dp4.yaml")  # 16 nodes of 8


# ---- '-' is stdout, for every output option ------------------------------------------------

def _output_options() -> list[tuple[str, str, str]]:
    """(command, option, help) of every option that names an output file."""
    out = []
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd, parser in sub.choices.items():
        for action in parser._actions:
            if action.metavar and str(action.metavar).startswith("FILE"):
                out.append((cmd, action.option_strings[-1], action.help or ""))
    return out


def test_every_output_option_documents_dash_as_stdout():
    options = _output_options()
    assert {(c, o) for c, o, _ in options} >= {
        ("layout", "--json"), ("plan", "--json"), ("plan", "--text"), ("plan", "--heatmap"),
        ("plan", "--dot"), ("run-plan", "--json"), ("suggest", "--json"), ("spec", "--output")}
    for cmd, option, text in options:
        assert "'-': stdout" in text, (cmd, option)


@pytest.mark.parametrize("argv", [
    ["plan", TINY_SRC, TINY_DST, "--json", "-"],
    ["suggest", TINY_SRC, "--devices", "node0:gpu0-3", "--top", "1", "--json", "-"],
    ["layout", TINY_SRC, "--json", "-"],
])
def test_json_dash_goes_to_stdout_alone(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    json.loads(out)  # stdout holds the document alone, no summary around it
    assert not (tmp_path / "-").exists()


def test_text_and_dot_dash_write_to_stdout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["plan", TINY_SRC, TINY_DST, "--dot", "-"], capsys)
    assert code == 0 and out.startswith("digraph") and not (tmp_path / "-").exists(), err
    code, out, _ = run_main(["plan", TINY_SRC, TINY_DST, "--text", "-"], capsys)
    assert code == 0 and out.startswith("plan ") and "  moved " not in out


def test_spec_output_dash_is_stdout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "padded_vocab_size": 1024, "vocab_size": 1000,
                                "world_size": 8, "max_position_embeddings": 128}))
    code, out, err = run_main(["spec", "--from-args", str(args), "-o", "-"], capsys)
    assert code == 0 and out.startswith("name: ") and "\nmodel: " in out, err
    assert not (tmp_path / "-").exists()


def test_two_outputs_on_stdout_refused_before_planning(capsys):
    t0 = time.perf_counter()
    code, out, err = run_main(["plan", BIG, BIG, "--json", "-", "--text", "-"], capsys)
    assert_one_error_line(code, out, err, "--text: only one output can go to stdout")
    assert out == "" and time.perf_counter() - t0 < 5


def test_two_outputs_on_one_file_refused_before_planning(tmp_path, capsys):
    # The second would replace the first: the plan would be lost without a word.
    (tmp_path / "d").mkdir()
    same = str(tmp_path / "out")
    code, out, err = run_main(["plan", BIG, BIG, "--json", same, "--text",
                               str(tmp_path / "d" / ".." / "out")], capsys)
    assert_one_error_line(code, out, err, "--text: ")
    assert "is the file --json writes already" in err and not (tmp_path / "out").exists()


def test_output_in_a_missing_directory_refused_before_planning(tmp_path, capsys):
    bad = str(tmp_path / "missing" / "plan.json")
    code, out, err = run_main(["plan", BIG, BIG, "--json", bad], capsys)
    assert_one_error_line(code, out, err, "--json: cannot write")
    assert "no such directory" in err and out == ""


# ---- options a source cannot honour are refused, not ignored -------------------------------

@pytest.mark.parametrize("extra, option", [
    (["--heatmap", "f.png", "--text", "-"], "--text"),
    (["--heatmap", "f.png"], "--heatmap"),
    (["--dot", "f.dot"], "--dot"),
    (["--budget", "1GiB"], "--budget"),
    (["--topology", "h800"], "--topology"),
    (["--place", "auto"], "--place"),
    (["--failed", "node0"], "--failed"),
    (["--reserve", "1GiB"], "--reserve"),
])
def test_checkpoint_source_refuses_what_it_would_ignore(extra, option, tmp_path, monkeypatch,
                                                        capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["plan", str(ckpt), TINY_DST, *extra], capsys)
    line = assert_one_error_line(code, out, err, f"{option}: not with a checkpoint directory")
    assert "--json and --per-device" in line and out == ""
    assert not (tmp_path / "f.png").exists() and not (tmp_path / "f.dot").exists()


def test_dot_of_a_world_too_large_to_draw_is_refused_before_planning(tmp_path, capsys):
    # 3072 devices: at least 3072 messages; the refusal costs no planning.
    big = str(ROOT / "specs" / "llama3.1-405b" / "tp8-pp16-dp24-3072gpu.yaml")
    js = tmp_path / "p.json"
    t0 = time.perf_counter()
    code, out, err = run_main(["plan", big, big, "--dot", str(tmp_path / "p.dot"),
                               "--json", str(js)], capsys)
    assert_one_error_line(code, out, err, "--dot: a switch over 3072 devices")
    assert time.perf_counter() - t0 < 10 and not js.exists()


# ---- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["0", "0GiB", "0 MiB", "0B", "0.0KB"])
def test_zero_reserve_in_any_unit(text, capsys):
    assert parse_bytes(text, "--reserve", allow_zero=True) == 0
    code, out, err = run_main(["plan", TINY_SRC, TINY_DST, "--reserve", text], capsys)
    assert code == 0, err


@pytest.mark.parametrize("text", ["\u0661\u0662GiB", "\uff12GiB", "2\u00b2GiB", "\u0662e9"])
def test_sizes_take_ascii_digits_only(text):
    # float() reads Arabic-Indic and fullwidth digits; a size must not.
    with pytest.raises(DynatrainError, match="digits 0-9"):
        parse_bytes(text, "--budget")


def test_zero_budget_still_refused():
    with pytest.raises(DynatrainError, match="positive"):
        parse_bytes("0GiB", "--budget")


# ---- device lists: one parser for --devices and --failed ------------------------------------

@pytest.mark.parametrize("text", ["node12-15", "node0:gpu0-7", "node3,node5:gpu2",
                                  "node1:gpu2-5,node9"])
def test_failed_takes_what_devices_takes(text):
    layout = load_layout(BIG)
    assert failed_devices(text, layout) == frozenset(parse_devices(text, layout.spec))


def test_failed_ranges_on_the_command_line(tmp_path, capsys):
    code, out, err = run_main(["plan", SMALL, SMALL, "--failed", "node0:gpu0-1"], capsys)
    # Ranges parse (the refusal is about the plan, not the syntax): the destination is on them.
    assert code == 2 and "failed device node0:gpu0" in err and "not like" not in err


@pytest.mark.parametrize("option", ["--devices", "--failed"])
@pytest.mark.parametrize("text, says", [
    ("node0:gpu0-99", "gpu99 is out of range; the spec has world.gpus_per_node = 8"),
    ("node0:gpu8", "gpu8 is out of range; the spec has world.gpus_per_node = 8"),
    ("node0-99999999999", "out of range: node numbers must be at most 999999"),
    ("node" + "9" * 5000, "out of range: node numbers must be at most 999999"),
    ("node3-0", "the node range 3-0 is reversed; ranges run low-high (node0-3)"),
    ("node0:gpu5-2", "the gpu range 5-2 is reversed"),
    ("node\u0663", "digits 0-9"),
    ("node0:gpu\uff11", "digits 0-9"),
])
def test_device_lists_say_what_is_wrong(option, text, says):
    layout = load_layout(SMALL)
    with pytest.raises(DynatrainError) as err:
        if option == "--devices":
            parse_devices(text, layout.spec)
        else:
            failed_devices(text, layout)
    msg = str(err.value)
    assert msg.startswith(f"{option}: ") and says in msg and "\n" not in msg, msg


def test_spec_device_ids_take_ascii_digits_only():
    doc = {"model": "llama3.1-8b", "parallel": {"tp": 1},
           "world": {"devices": ["node\u0660:gpu0"]}}
    with pytest.raises(SpecError):
        spec_from_dict(doc)


def test_suggest_bounds_the_devices_and_says_so(capsys):
    t0 = time.perf_counter()
    code, out, err = run_main(["suggest", SMALL, "--devices", "node0-9999"], capsys)
    assert_one_error_line(code, out, err, f"names more than {MAX_SUGGEST_DEVICES} devices")
    assert time.perf_counter() - t0 < 5
    help_text = next(h for c, o, h in _help_of("suggest") if o == "--devices")
    assert f"at most {MAX_SUGGEST_DEVICES}" in help_text


def test_device_list_is_bounded_before_it_is_built():
    t0 = time.perf_counter()
    with pytest.raises(DynatrainError, match="names more than 100 devices"):
        parse_device_list("node0-999999:gpu0-9999", "--devices", max_devices=100)
    assert time.perf_counter() - t0 < 1


def _help_of(cmd: str) -> list[tuple[str, str, str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(cmd, a.option_strings[-1] if a.option_strings else a.dest, a.help or "")
            for a in sub.choices[cmd]._actions]


@pytest.mark.parametrize("option, says", [("--budget=", "--budget: expected a size"),
                                          ("--topology=", "--topology: must be h100")])
def test_an_empty_option_value_is_refused_not_taken_for_the_default(option, says, capsys):
    tiny = "specs/tiny-gpt/tp2-dp2.yaml"
    code, out, err = run_main(["plan", tiny, "specs/tiny-gpt/pp2-dp2.yaml", option], capsys)
    assert_one_error_line(code, out, err, says)


def test_allow_lost_without_failed_is_refused(capsys):
    code, out, err = run_main(["plan", "specs/tiny-gpt/tp2-dp2.yaml",
                               "specs/tiny-gpt/pp2-dp2.yaml", "--allow-lost"], capsys)
    assert_one_error_line(code, out, err, "--allow-lost: goes with --failed")


@pytest.mark.parametrize("text", ["1EiB", "2PB", "12x"])
def test_an_unknown_unit_is_named_with_the_units_there_are(text):
    with pytest.raises(DynatrainError) as err:
        parse_bytes(text, "--budget")
    msg = str(err.value)
    assert msg.startswith("--budget: unknown unit ") and "G/GiB" in msg and "\n" not in msg


def test_spec_reads_a_bounded_file_and_refuses_parallel_with_args(tmp_path, capsys):
    code, out, err = run_main(["spec", "--from-args", "/dev/zero", "--world",
                               "nodes=1,gpus_per_node=4"], capsys)
    assert_one_error_line(code, out, err, "/dev/zero: must be at most 16 MiB")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "padded_vocab_size": 1024, "vocab_size": 1000,
                                "world_size": 8, "max_position_embeddings": 128}))
    code, out, err = run_main(["spec", "--from-args", str(args), "--parallel", "tp=4"], capsys)
    assert_one_error_line(code, out, err, "--parallel: not with --from-args")
