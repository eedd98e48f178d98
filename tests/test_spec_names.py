"""A spec's name is printed on terminals and in reports: control, bidirectional and other
invisible characters are refused at load, in one line naming the code point."""

from __future__ import annotations

import pytest

from dynatrain.ir.errors import SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import parse_spec, spec_from_dict
from test_cli_errors import assert_one_error_line, run_main

BASE = {"model": "llama3.1-8b", "parallel": {"tp": 2}, "world": {"nodes": 1, "gpus_per_node": 8}}


@pytest.mark.parametrize("ch", ["\u202e", "\u202d", "\u2066", "\u200f", "\u200b", "\x1b",
                                "\x07", "\x85", "\u2028", "\t", "\ue000"])
def test_names_with_invisible_characters_are_refused(ch):
    with pytest.raises(SpecError) as err:
        spec_from_dict({**BASE, "name": f"tp2{ch}exe.yaml"})
    msg = str(err.value)
    assert msg.startswith("name: must be printable text: character 3 is "
                          f"U+{ord(ch):04X}"), msg
    assert msg.isprintable()


def test_cli_refuses_a_right_to_left_override_in_one_line(tmp_path, capsys):
    spec = tmp_path / "rlo.yaml"
    spec.write_text('name: "safe\\u202Elmy.exe"\nmodel: llama3.1-8b\nparallel: {tp: 2}\n'
                    "world: {nodes: 1, gpus_per_node: 8}\n", encoding="utf-8")
    line = assert_one_error_line(*run_main(["layout", str(spec)], capsys),
                                 "U+202E (RIGHT-TO-LEFT OVERRIDE)")
    assert "\u202e" not in line


@pytest.mark.parametrize("name", ["Llama-3.1-70B on 128 GPUs, TP4 PP4", "模型 测试", "café ✓"])
def test_ordinary_names_still_load(name):
    assert spec_from_dict({**BASE, "name": name}).name == name


def test_layout_repr_quotes_the_name_or_gives_the_layer_count():
    named = Layout(parse_spec("name: TP2 DP2\n" + "model: llama3.1-8b\nparallel: {tp: 2}\n"
                              "world: {nodes: 1, gpus_per_node: 8}\n"))
    assert repr(named).startswith("Layout('TP2 DP2', W=8, tp=2,"), repr(named)
    unnamed = Layout(spec_from_dict(BASE))
    assert repr(unnamed).startswith("Layout(32L, W=8, tp=2,"), repr(unnamed)
