"""The Megatron bridge on Transformer Engine jobs (megatron-core's TE spec over the CPU stand-in).

Each case trains one real step, then on every rank (``megatron_support.te``'s ``te_bridge``
probe): ``extract_state`` equals, region by region and bit for bit, the IR storage filled from
the global tensors megatron's own sharded state dicts give (the oracle of
tests/test_megatron_bridge.py); after perturbing every param, main param and moment,
``install_state`` of the extracted copy restores megatron's view of the state exactly.
"""

from __future__ import annotations

import pytest
from te_cases import BRIDGE, FAST, TRAIN, default_request

te = pytest.importorskip("megatron_support.te")


@pytest.mark.parametrize("i", range(len(BRIDGE)), ids=[c["name"] for c in BRIDGE])
def test_te_bridge_extracts_and_installs_bit_exact(i: int) -> None:
    run = te.te_facts(default_request())[len(FAST) + len(TRAIN) + i]
    assert not isinstance(run, dict), run
    for rank, facts in enumerate(run):
        step, bridge = facts["probes"][1], facts["probes"][2]
        assert step["ok"], rank
        assert bridge["regions"] > 0 and bridge["n_bad"] == 0, (rank, bridge["bad"])
        assert bridge["perturbed"] > 0, rank  # not vacuous: the perturbation was visible
        assert bridge["after"] == [], (rank, bridge["after"])
