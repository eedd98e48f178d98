"""The runtime's TE fp8 helpers on plain objects (no TE in this process).

``check_folded`` must refuse a module whose amax-history row 0 holds amaxes recorded since the
last scale update (per rank until reduced, so no replica is a valid source), in either
direction, and accept folded histories; a module never run under fp8 reads as TE's initial
state (scales 1, histories 0).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dynatrain.ir.errors import LayoutError
from dynatrain.runtime.megatron import te_fp8


def _module(row0_fwd: float, row0_bwd: float) -> torch.nn.Module:
    m = torch.nn.Module()
    hist_f, hist_b = torch.zeros(3, 3), torch.zeros(3, 2)
    hist_f[1:] = 0.5  # folded amaxes of earlier steps
    hist_f[0, 1], hist_b[0, 0] = row0_fwd, row0_bwd
    m.fp8_meta = {"scaling_fwd": SimpleNamespace(scale=torch.ones(3), amax_history=hist_f),
                  "scaling_bwd": SimpleNamespace(scale=torch.ones(2), amax_history=hist_b)}
    return m


def test_amaxes_not_yet_reduced_are_refused_in_either_direction() -> None:
    te_fp8.check_folded(_module(0.0, 0.0), "layer")
    for fwd, bwd in ((0.25, 0.0), (0.0, 0.25)):
        with pytest.raises(LayoutError, match="not reduced yet") as err:
            te_fp8.check_folded(_module(fwd, bwd), "decoder.layers.0.mlp.linear_fc1")
        assert "\n" not in str(err.value)


def test_live_and_initial_tensors() -> None:
    m = _module(0.0, 0.0)
    assert te_fp8.has_delayed_state(m)
    assert te_fp8.live_tensor(m, "amax_history_bwd") is m.fp8_meta["scaling_bwd"].amax_history
    fresh = torch.nn.Module()
    fresh.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
    assert not te_fp8.has_delayed_state(fresh) and te_fp8.live_tensor(fresh, "scale_fwd") is None
    assert torch.equal(te_fp8.initial_tensor("scale_bwd", (2,)), torch.ones(2))
    assert torch.equal(te_fp8.initial_tensor("amax_history_fwd", (4, 3)), torch.zeros(4, 3))
