"""Layouts that differ between megatron-core versions, against the installed megatron-core.

With ETP != TP at EP=1, 0.19 puts the expert params into the expert-DP buffer (M19
tensor_parallel/layers.py:961-964); 0.16 keeps them in the dense one, where the distributed
optimizer loses their state (tests/test_megatron_inferences.py), so the IR refuses that on 0.16
(rules.py) and follows megatron-core on 0.19. CI runs this file on both versions (Python 3.11:
0.16.1; 3.12: 0.19.2), each against the megatron-core installed there.
"""

from __future__ import annotations

import functools

import pytest

from dynatrain.ir import versions
from dynatrain.ir.errors import SpecError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import spec_from_dict
from matrix import CASES, MOE, case, to_harness_cfg, to_spec, to_spec_dict

harness = pytest.importorskip("megatron_support.harness")
from test_megatron_parity import compare_rank  # noqa: E402  (needs megatron, as above)

# The megatron-core every comparison here is against; a spec without ``megatron_core`` means it.
INSTALLED = versions.normalize(pytest.importorskip("megatron.core").__version__)
OWN = versions.series(INSTALLED).etp_own_expert_buffer

# fmt: off
VERSION_CASES: list[dict] = [
    case("v-moe-ep1-etp1-tp2", 4, tp=2, etp=1, swiglu=True, **MOE),
    case("v-moe-ep1-etp2-tp1", 4, etp=2, **MOE),
    case("v-moe-ep1-etp1-tp2-cp2-vpp2", 8, tp=2, cp=2, pp=2, vpp=2, num_layers=4, etp=1, **MOE),
    case("v-moe-ep1-etp1-tp2-buckets", 4, tp=2, etp=1, bucket_size=2000, **MOE),
    case("v-moe-ep1-etp1-tp2-no-distopt", 4, tp=2, etp=1, use_distributed_optimizer=False,
         **MOE),
]
# fmt: on


@functools.lru_cache(maxsize=None)
def _facts(name: str) -> list[dict]:
    """megatron-core's facts of a VERSION_CASES entry, built once per session."""
    cfg = next(c for c in VERSION_CASES if c["name"] == name)
    return harness.megatron_facts(to_harness_cfg(cfg), cfg["world"])


def _versioned(cfg: dict, version: str):
    return spec_from_dict({**to_spec_dict(cfg), "megatron_core": version})


def _diffs(layout: Layout, real: list[dict]) -> list[str]:
    return [f"rank {r}: {d}" for r in range(layout.world)
            for d in compare_rank(layout, r, real[r])]


@pytest.mark.parametrize("version", sorted(s.tested for s in versions.SERIES.values()))
def test_layout_places_experts_by_version(version: str) -> None:
    """The IR's buffers follow ``buffers.experts_in_own_buffer``: on 0.19, ETP != TP at EP=1
    gives every rank an expert buffer sharded over expert DP; on 0.16 there is none."""
    cfg = next(c for c in VERSION_CASES if c["name"] == "v-moe-ep1-etp1-tp2-no-distopt")
    layout = Layout(_versioned(cfg, version))
    own = versions.series(version).etp_own_expert_buffer
    for r in range(layout.world):
        experts = [b for b in layout.rank_buffers(r) if b.is_expert]
        assert bool(experts) == own, (
            f"{version}, rank {r}: Layout must place experts by buffers.experts_in_own_buffer "
            "(ir/layout.py: expert_in_own_buffer and _buffers)")
        assert all(b.dp_size == layout.edp == 4 for b in experts)
        dense = [b for b in layout.rank_buffers(r) if not b.is_expert]
        assert any("local_experts" in p.name for b in dense for p in b.params) != own


def test_default_version_is_the_installed_one() -> None:
    """A spec without ``megatron_core`` means the megatron-core the comparisons run against."""
    assert to_spec(CASES[0]).megatron_core == INSTALLED
    assert versions.series_key(INSTALLED) in versions.SERIES


@pytest.mark.parametrize("cfg", VERSION_CASES, ids=[c["name"] for c in VERSION_CASES])
def test_version_dependent_layout_matches_megatron(cfg: dict) -> None:
    """The IR follows the installed version where layouts differ; where that version loses
    optimizer state (0.16 with the distributed optimizer) the spec is refused, naming it."""
    if not OWN and cfg.get("use_distributed_optimizer", True):
        with pytest.raises(SpecError, match=r"^parallel\.etp: etp != tp with ep=1 .* "
                           + INSTALLED.replace(".", r"\.") + " silently loses"):
            to_spec(cfg)
        return
    layout = Layout(to_spec(cfg))
    real = _facts(cfg["name"])
    assert any(b["is_expert"] for b in real[0]["buffers"]) == OWN  # the case shows the rule
    diffs = _diffs(layout, real)
    assert not diffs, "\n".join(diffs[:12])


def test_the_other_version_is_caught() -> None:
    """The version matters and the comparison sees it: the IR of the other known series puts
    the experts in the other buffer, which every rank's buffer facts show."""
    cfg = next(c for c in VERSION_CASES if c["name"] == "v-moe-ep1-etp1-tp2-no-distopt")
    real = _facts(cfg["name"])
    assert not _diffs(Layout(_versioned(cfg, INSTALLED)), real)
    others = [s.tested for s in versions.SERIES.values() if s.etp_own_expert_buffer != OWN]
    assert others
    for other in others:
        layout = Layout(_versioned(cfg, other))
        for r in range(layout.world):
            assert any(d.startswith("buffers") for d in compare_rank(layout, r, real[r]))
