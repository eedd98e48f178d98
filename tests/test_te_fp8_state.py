"""fp8 delayed scaling: the IR's fp8 state is what megatron's TE modules keep, replicated.

Random small dense jobs drawn by the gate's strategies (TP, PP, VPP, uneven stages, layout
strings, distributed optimizer or not; fp8 e4m3/hybrid, amax history 1-4) train two
iterations with fp8 delayed scaling over the stand-in TE (``megatron_support.te_fp8_state``).
Reading each rank's state through the bridge binds every scale and amax history the IR names
to the TE module holding it, with its shape, and refuses a module with delayed-scaling state
the IR lacks: module-by-module parity. The values must then be bit-identical on every rank
that holds the same logical tensor box, as megatron's amax reduction over TP x DP makes them
and as the IR's replicated placement (and so the planner's free choice of a source) assumes;
and training must have moved them off their initial values.
"""

from __future__ import annotations

import pytest
from te_cases import TRAIN_SEQ, random_fp8_delayed_cases

pytest.importorskip("megatron.core")
te_fp8_state = pytest.importorskip("megatron_support.te_fp8_state")


def test_random_fp8_jobs_keep_the_irs_replicated_fp8_state() -> None:
    from megatron_support.live import SEQ

    assert TRAIN_SEQ == SEQ  # the cases are filtered for what the harness trains
    cases = random_fp8_delayed_cases(6)
    assert len(cases) == 6
    results = te_fp8_state.te_fp8_state(cases)
    for cfg, ranks in zip(cases, results):
        held: dict[str, list] = {}
        for rank, res in enumerate(ranks):
            # fp8 ran exactly on the ranks the IR gives fp8 state (a stage may have no layers)
            assert bool(res["modules"]) == bool(res["values"]), (cfg["name"], rank)
            for box, values in res["values"].items():
                held.setdefault(box, []).append((rank, values))
        assert held, cfg["name"]
        for box, copies in held.items():
            first = copies[0][1]
            assert all(v == first for _, v in copies), (cfg["name"], box, copies)
        scales = [v for box, copies in held.items() if ".scale_fwd@" in box
                  for _, v in copies]
        assert any(x != 1.0 for v in scales for x in v), cfg["name"]
