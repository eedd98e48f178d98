"""A live switch is checked against the memory free on its device now: destination state plus
peak staging (the source state is already allocated) must fit, or the switch is refused before
anything moves, with the device, both figures and what was counted.

No GPU here: the CUDA reading is fed fake driver and allocator figures, and the LiveSwitcher
is given a device with a fixed amount free.
"""

from __future__ import annotations

import pytest
import torch

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import DTYPE_BYTES, Layout
from dynatrain.ir.state import OPTIMIZER_KINDS, transition_views
from dynatrain.ir.summary import rank_elements
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime import headroom
from dynatrain.runtime.headroom import (NoHeadroom, SwitchNeed, check_headroom, free_bytes,
                                        switch_need)
from dynatrain.runtime.megatron.live import LiveSwitcher
from dynatrain.verify.check import check
from test_plan_simulate import DENSE, spec

GiB = 1 << 30
SRC, DST = spec(DENSE, 4, pp=2), spec(DENSE, 4, pp=4)  # same TP: same padded vocab


def test_a_switch_that_fits_to_the_byte_passes() -> None:
    need = SwitchNeed("node0:gpu3", 40 * GiB, GiB, 2)
    check_headroom(need, 41 * GiB)  # raises if it does not fit


def test_one_byte_short_is_refused_naming_device_bytes_and_parts() -> None:
    need = SwitchNeed("node0:gpu3", 40 * GiB, GiB + GiB // 10, 2)
    free = need.total_bytes - 1
    with pytest.raises(NoHeadroom) as err:
        check_headroom(need, free)
    assert isinstance(err.value, DynatrainError) and err.value.exit_code == 2
    assert str(err.value) == (
        f"node0:gpu3: the switch needs 41.1 GiB ({need.total_bytes} bytes: destination state "
        f"40.0 GiB + staging 1.1 GiB in round 2; the source state is already allocated) but "
        f"41.1 GiB ({free} bytes) is free on the device — free memory, or switch with a smaller "
        f"budget_bytes or onto more devices")
    assert err.value.need == need and err.value.free_bytes == free


def _state_bytes(layout: Layout, rank: int) -> int:
    """Bytes of a rank's state from its element counts (not the storage the code under test
    reads)."""
    params, opt = rank_elements(layout, rank)
    st = layout.spec.state
    opt_dtypes = [getattr(st, k) for k in OPTIMIZER_KINDS if getattr(st, k) is not None]
    return (params * DTYPE_BYTES[st.param] + sum(opt * DTYPE_BYTES[t] for t in opt_dtypes)
            + (8 if opt_dtypes else 0))  # Adam's step: one int64


def test_need_is_destination_state_and_the_peak_round_of_staging() -> None:
    s, d = Layout(SRC), Layout(DST)
    plan = plan_transition(s, d, 1 << 15)  # a small budget: several rounds
    assert len(plan.rounds) > 1
    _, dv = transition_views(s, d)
    for rank, dev in enumerate(plan.dst_devices):
        per_round = [sum(m.nbytes for m in r.messages
                         if not m.local and dev in (m.src_device, m.dst_device))
                     for r in plan.rounds]
        need = switch_need(plan, dv, dev)
        assert need.dst_state_bytes == _state_bytes(d, rank)
        assert need.staging_bytes == max(per_round) > 0
        assert need.staging_round == per_round.index(max(per_round))
    assert switch_need(plan, dv, "node9:gpu0") == SwitchNeed("node9:gpu0", 0, 0, 0)


def test_cuda_free_counts_whole_free_segments_of_the_cache_not_fragments(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: {
        "reserved_bytes.all.current": 30 * GiB, "allocated_bytes.all.current": 22 * GiB,
        "inactive_split_bytes.all.current": 3 * GiB})
    assert free_bytes(0) == 10 * GiB + (30 - 22 - 3) * GiB
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: {})  # another backend
    assert free_bytes(0) == 10 * GiB
    assert free_bytes(None) is None  # the CPU: unchecked (see the module docstring)


def _prepare(monkeypatch, free: int):
    """A LiveSwitcher on a device with ``free`` bytes free plans and verifies SRC -> DST.

    The whole plan (``slices=False``): a sliced switch cuts its rounds, and so checks its
    headroom, at switch time (``LiveSwitcher._cut_slice``), with the same check."""
    monkeypatch.setattr(headroom, "free_bytes", lambda cuda_device: free)
    sw = LiveSwitcher(SRC, Layout(SRC).devices[0], build=lambda spec: None, verify=check,
                      budget_bytes=1 << 20, slices=False)
    try:
        return sw.prepare(DST).result(timeout=120)
    finally:
        sw.close()


def test_live_prepare_refuses_a_switch_the_free_memory_cannot_hold(monkeypatch) -> None:
    s, d = Layout(SRC), Layout(DST)
    dev = s.devices[0]
    want = switch_need(plan_transition(s, d, 1 << 20), transition_views(s, d)[1], dev)
    with pytest.raises(NoHeadroom, match=f"^{dev}: the switch needs .*destination state"):
        _prepare(monkeypatch, want.total_bytes - 1)
    prepared = _prepare(monkeypatch, want.total_bytes)
    assert prepared.plan.dst_devices == d.devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_free_bytes_and_job_reserve_follow_real_allocations() -> None:
    """On a GPU (``bench/gpu_checks.py``): a block the allocator holds in its cache after a
    ``del`` is free for a switch though the driver counts it used; the job's reserve is the
    allocator's peak above what is allocated."""
    from dynatrain.runtime.megatron.build_ahead import job_reserve

    dev = torch.cuda.current_device()
    slack = 64 << 20  # the allocator's rounding and whatever else the process allocated
    torch.cuda.empty_cache()
    before = free_bytes(dev)
    x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    held = free_bytes(dev)
    assert GiB - slack <= before - held <= GiB + slack, (before, held)
    torch.cuda.reset_peak_memory_stats(dev)
    y = torch.empty(GiB // 4, dtype=torch.uint8, device="cuda")  # an iteration's activations
    del y
    assert GiB // 4 <= job_reserve(dev) <= GiB // 4 + slack
    del x
    after, (driver_free, _) = free_bytes(dev), torch.cuda.mem_get_info(dev)
    assert after - driver_free >= GiB - slack, "a cached free block was not counted as free"
    assert abs(after - before) <= slack, (before, after)
