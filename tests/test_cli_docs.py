"""What users read: reference pages written from the code stay in step with it, and the
help and generated specs say what they do."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from dynatrain.cli import build_parser, main
from dynatrain.planner.cost import PRESETS, Topology

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "fixtures" / "hf"


def _help(cmd: str, option: str | None = None) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if option is None:
        return next(a.help for a in sub._choices_actions if a.dest == cmd)
    return next(a.help for a in sub.choices[cmd]._actions if option in a.option_strings)


def test_topology_page_documents_every_field_and_preset():
    text = (ROOT / "docs" / "topology.md").read_text(encoding="utf-8")
    for field in Topology.model_fields:
        assert f"`{field}`" in text, field
    for name in PRESETS:
        assert f"`{name}`" in text, name


def test_plan_text_page_documents_the_notation():
    text = (ROOT / "docs" / "plan-text.md").read_text(encoding="utf-8")
    for part in ("`cN:", "@[", "optim[B]", "(xN)", "c-1", "`[BOX]`", "rS"):
        assert part in text, part


def test_topology_help_lists_every_preset():
    for cmd in ("plan", "verify", "suggest"):
        for name in PRESETS:
            assert name in _help(cmd, "--topology"), (cmd, name)


def test_load_says_it_checks_and_discards():
    assert "discarded" in _help("load") and "nothing is written" in _help("load")


def test_spec_from_hf_has_a_name_and_no_moe_fields_on_a_dense_model(capsys):
    assert main(["spec", "--from-hf", str(HF / "llama3.1-8b.json"), "--parallel", "tp=2",
                 "--world", "nodes=1,gpus_per_node=8"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["name"] == "llama (HuggingFace config) on 8 GPUs, TP2 PP1 DP4"
    assert not [k for k in doc["model"] if k.startswith("moe_")], doc["model"]
    assert main(["spec", "--from-hf", str(HF / "qwen3-30b-a3b.json"), "--parallel",
                 "tp=2,ep=4", "--world", "nodes=1,gpus_per_node=8", "--name", "q"]) == 0
    moe = yaml.safe_load(capsys.readouterr().out)
    assert moe["name"] == "q" and moe["model"]["moe_router_topk"] == 8


def test_assignments_take_ascii_digits_only(capsys):
    assert main(["spec", "--from-hf", str(HF / "llama3.1-8b.json"), "--parallel", "tp=\u00b2",
                 "--world", "nodes=1,gpus_per_node=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynatrain: error: parallel.tp: ") and "Traceback" not in err
