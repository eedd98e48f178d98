"""Imports flow one way: ir <- planner <- {verify, runtime} <- cli; ir and planner stay torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dynatrain"
LAYER = {"ir": 0, "planner": 1, "verify": 2, "runtime": 2, "checkpoint": 2.5, "cli": 3}
FORBIDDEN = {"ir": {"torch", "z3", "megatron"}, "planner": {"torch", "z3", "megatron"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                pkg = path.relative_to(PKG).parts[:-1]
                base = pkg[: len(pkg) - (node.level - 1)]
                names.add(".".join(("dynatrain", *base, *(node.module or "").split("."))).rstrip("."))
            elif node.module:
                names.add(node.module)
    return names


def _layer_of(path: Path) -> str:
    part = path.relative_to(PKG).parts[0]
    return part.removesuffix(".py")


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_flow_one_way(path: Path) -> None:
    layer = _layer_of(path)
    if layer not in LAYER:
        return
    for name in _imports(path):
        top = name.split(".")[0]
        assert top not in FORBIDDEN.get(layer, set()), f"{path.name} imports {name}"
        if top == "dynatrain" and len(name.split(".")) > 1:
            other = name.split(".")[1]
            if other in LAYER and other != layer:
                assert LAYER[other] < LAYER[layer], f"{layer} must not import {other} ({path.name})"
