"""The stand-in TE's FusedAdam keeps TE's state layout and computes TE's kernel update.

It is what megatron-core runs in every TE test (it picks TE's FusedAdam whenever TE imports), so
its layout facts are checked here directly: per-parameter state is exp_avg/exp_avg_sq only, the
step is one int per param group advanced for every group (empty ones too, TE optimizers/
fused_adam.py:559-583), and a load goes through ``set_scaled_state``. The update is compared
bit for bit with a numpy float32 reference written from the kernel (common/multi_tensor/
adam.cu:123-141, 580-585), for Adam (L2) and AdamW.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

_PATH = Path(__file__).parent / "te_standin/transformer_engine/pytorch/optimizers/fused_adam.py"


def _module():
    # Loaded by path: putting the stand-in on sys.path would make this process "see TE".
    spec = importlib.util.spec_from_file_location("standin_fused_adam", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fused_adam():
    return _module().FusedAdam


def _reference(p, grads, lr, b1, b2, eps, wd, adam_w):
    """The kernel, in numpy float32 (scalars rounded to fp32, bias corrections from double)."""
    f = np.float32
    p, m, v = p.astype(f), np.zeros_like(p, f), np.zeros_like(p, f)
    lr, b1, b2, eps, wd = f(lr), f(b1), f(b2), f(eps), f(wd)
    for step, g in enumerate(grads, start=1):
        g = g.astype(f)
        bc1, bc2 = f(1.0 - math.pow(float(b1), step)), f(1.0 - math.pow(float(b2), step))
        if not adam_w:
            g = g + wd * p
        m = b1 * m + (f(1) - b1) * g
        v = b2 * v + (f(1) - b2) * g * g
        update = (m / bc1) / (np.sqrt(v / bc2) + eps)
        if adam_w:
            update = update + wd * p
        p = p - lr * update
    return p, m, v


@pytest.mark.parametrize("adam_w", [True, False], ids=["adamw", "adam-l2"])
def test_fused_adam_state_layout_and_update(adam_w: bool) -> None:
    FusedAdam = _fused_adam()
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(37).astype(np.float32)
    grads = [rng.standard_normal(37).astype(np.float32) for _ in range(3)]
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = FusedAdam([{"params": [p]}, {"params": []}], adam_w_mode=adam_w, **hyper)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    # The step: one int per group, every group advanced; no per-parameter step.
    assert [g["step"] for g in opt.param_groups] == [3, 3]
    assert all(type(g["step"]) is int for g in opt.param_groups)
    assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}
    want_p, want_m, want_v = _reference(p0, grads, hyper["lr"], *hyper["betas"], hyper["eps"],
                                        hyper["weight_decay"], adam_w)
    assert np.array_equal(p.detach().numpy(), want_p)
    assert np.array_equal(opt.state[p]["exp_avg"].numpy(), want_m)
    assert np.array_equal(opt.state[p]["exp_avg_sq"].numpy(), want_v)
    # A reload restores the group steps and the moments; a per-parameter 'step' is refused
    # (TE's name_to_dtype_map has no such state).
    q = torch.nn.Parameter(torch.from_numpy(want_p.copy()))
    fresh = FusedAdam([{"params": [q]}, {"params": []}], adam_w_mode=adam_w, **hyper)
    fresh.load_state_dict(opt.state_dict())
    assert [g["step"] for g in fresh.param_groups] == [3, 3]
    assert torch.equal(fresh.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    bad = opt.state_dict()
    bad["state"][0]["step"] = torch.tensor(3.0)
    with pytest.raises(KeyError):
        fresh.load_state_dict(bad)


def test_fused_adam_refuses_what_the_stand_in_lacks() -> None:
    FusedAdam = _fused_adam()
    p = torch.nn.Parameter(torch.zeros(2))
    for kwargs in ({"exp_avg_dtype": torch.float16}, {"exp_avg_sq_dtype": torch.uint8},
                   {"master_weights": True, "master_weight_dtype": torch.float16},
                   {"capturable": True}):
        with pytest.raises(NotImplementedError, match="unsupported"):
            FusedAdam([p], **kwargs)


def test_precision_aware_states_and_param_remainders() -> None:
    """With master weights the update runs on the fp32 master; bf16 moments are stored
    rounded; with ``store_param_remainders`` the master exists only as (bf16 param, int16
    remainder), which must reproduce the fp32 master bit for bit."""
    mod = _module()
    FusedAdam = mod.FusedAdam
    rng = np.random.default_rng(5)
    p0 = torch.from_numpy(rng.standard_normal(301).astype(np.float32))
    grads = [torch.from_numpy(rng.standard_normal(301).astype(np.float32)) for _ in range(4)]
    runs = {}
    for rem in (False, True):
        p = torch.nn.Parameter(p0.to(torch.bfloat16))
        opt = FusedAdam([p], lr=1e-2, weight_decay=0.1, master_weights=True,
                        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                        use_decoupled_grad=True, store_param_remainders=rem)
        for g in grads:
            p.decoupled_grad = g.clone()
            opt.step()
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and set(st) == {
            "exp_avg", "exp_avg_sq", "master_param"}
        assert st["master_param"].dtype == (torch.int16 if rem else torch.float32)
        master = opt.get_unscaled_state(p, "master_param")
        if rem:
            master = mod._join(p, st["master_param"])
        runs[rem] = (master.clone(), p.detach().clone(), st["exp_avg"].clone())
    assert torch.equal(runs[True][0].view(torch.int32), runs[False][0].view(torch.int32))
    assert torch.equal(runs[True][2], runs[False][2])
    # The bf16 param: round-to-nearest-even vs. the remainder kernel's rounding differ only
    # on exact ties, which random data does not hit.
    assert torch.equal(runs[True][1], runs[False][1])
