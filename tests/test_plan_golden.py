"""Golden text of small plans: any change in what moves where shows up as a readable diff.

Regenerate after an intended change with ``DYNATRAIN_UPDATE_GOLDEN=1 python -m pytest
tests/test_plan_golden.py`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from dynatrain.planner.pipeline import plan_transition
from dynatrain.planner.text import plan_to_text

GOLDEN = Path(__file__).parent / "golden"
TINY = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=32, vocab_size=30, make_vocab_size_divisible_by=4, swiglu=True,
            max_position_embeddings=8)
TINY_MOE = dict(TINY, num_moe_experts=4, moe_ffn_hidden_size=8)


def _spec(model: dict, devices: int, **par):
    return spec_from_dict({"name": f"{devices} gpus {par}", "model": model, "parallel": par,
                           "world": {"nodes": max(1, devices // 2), "gpus_per_node": min(2, devices)}})


CASES = {
    "tp2-to-pp2": (_spec(TINY, 2, tp=2), _spec(TINY, 2, pp=2)),
    "dp2-to-tp2-grow4": (_spec(TINY, 2), _spec(TINY, 4, tp=2)),
    "moe-ep2-to-ep4": (_spec(TINY_MOE, 2, ep=2), _spec(TINY_MOE, 4, ep=4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_text_matches_golden(name: str) -> None:
    src, dst = CASES[name]
    text = plan_to_text(plan_transition(Layout(src), Layout(dst), 1 << 14))
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("DYNATRAIN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"plan text changed; see {path}"
