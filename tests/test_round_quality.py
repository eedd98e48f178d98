"""Round quality across model families and sizes: the plan moves exactly the bytes no plan can
avoid, and its predicted wire time stays within 1.10x the topology's lower bound.

``spread`` cuts every pair's traffic evenly over the rounds, so the sum over rounds of the
busiest link should be the busiest link over the whole switch, up to the cut unit and one
latency per round. These tests check that claim on members of the three families the
benchmark follows (Llama-3.1-70B, Llama-3.1-405B, Qwen3-235B-A22B); the larger members
(hundreds of thousands of transfers) are marked slow, and ``bench/plan_bench.py`` reports the
same ratio up to 12288 GPUs.
"""

from __future__ import annotations

import pytest

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_from_dict
from dynatrain.planner.cost import H100
from dynatrain.planner.pipeline import plan_transition

BUDGET = 2 << 30
QUALITY = 1.10  # predicted / lower-bound seconds, the bound


def llama70b(world: int, pp: int) -> Layout:
    """Llama-3.1-70B at TP8 and ``pp`` on ``world`` GPUs (8 per node)."""
    return Layout(spec_from_dict(dict(model="llama3.1-70b", parallel=dict(tp=8, pp=pp),
                                      world=dict(nodes=world // 8, gpus_per_node=8)),
                                 origin=f"70b W={world} pp={pp}"))


def llama405b(world: int) -> Layout:
    """Llama-3.1-405B TP8 PP16 on ``world`` GPUs, as the shipped 405B specs."""
    return Layout(spec_from_dict(dict(
        model="llama3.1-405b", parallel=dict(tp=8, pp=16,
                                             account_for_embedding_in_pipeline_split=True,
                                             account_for_loss_in_pipeline_split=True),
        world=dict(nodes=world // 8, gpus_per_node=8)), origin=f"405b W={world}"))


def shipped(name: str) -> Layout:
    return Layout(load_spec(f"specs/{name}.yaml"))


CASES = {
    "70b-pp4-pp8-64": lambda: (llama70b(64, 4), llama70b(64, 8)),
    "70b-pp4-pp8-256": lambda: (llama70b(256, 4), llama70b(256, 8)),
    "70b-dp4-dp3-shipped": lambda: (shipped("llama3.1-70b/tp8-pp4-dp4"),
                                    shipped("llama3.1-70b/tp8-pp4-dp3-96gpu")),
    "405b-512-384": lambda: (llama405b(512), llama405b(384)),
    "235b-ep16-ep8-192": lambda: (shipped("qwen3-235b-a22b/tp4-pp8-ep16-256gpu"),
                                  shipped("qwen3-235b-a22b/tp4-pp8-ep8-192gpu")),
}
SLOW_CASES = {
    "70b-pp4-pp8-1024": lambda: (llama70b(1024, 4), llama70b(1024, 8)),
    "405b-2048-1536": lambda: (llama405b(2048), llama405b(1536)),
    "235b-tp4pp8ep16-tp8pp4ep8": lambda: (shipped("qwen3-235b-a22b/tp4-pp8-ep16-256gpu"),
                                          shipped("qwen3-235b-a22b/tp8-pp4-ep8-256gpu")),
}


def check_quality(src: Layout, dst: Layout) -> None:
    plan = plan_transition(src, dst, BUDGET, H100)
    st = plan.stats
    assert st["bytes_moved"] == st["bytes_lower_bound"], "moves bytes a better pick avoids"
    assert st["peak_staging_bytes"] <= BUDGET
    ratio = st["predicted_seconds"] / st["lower_bound_seconds"]
    assert ratio <= QUALITY, f"predicted {ratio:.3f}x the lower bound ({st['rounds']} rounds)"


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_quality(case: str) -> None:
    check_quality(*CASES[case]())


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_round_quality_of_larger_members(case: str) -> None:
    check_quality(*SLOW_CASES[case]())
