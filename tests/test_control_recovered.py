"""A request or preemption notice whose switch never ran because a member of the job failed
first (``LiveControl.recovered``): the request is answered as failed (exit status 4) with what
happened instead, the failed devices and how the job recovered (for a notice, how long before
or after its deadline); the pending switch is dropped and rank 0 posts the layout the job runs
now. Without processes: a stand-in switcher on an in-memory store.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.runtime.megatron.control import LiveControl, _Pending
from dynatrain.runtime.megatron.job import Notice, SwitchResult
from dynatrain.runtime.megatron.rendezvous import Rendezvous
from dynatrain.runtime.megatron.requests import wait_answer

SPECS = Path(__file__).resolve().parents[1] / "specs" / "tiny-gpt"


def _control() -> tuple[LiveControl, Rendezvous]:
    spec = load_spec(SPECS / "tp2-dp2.yaml")
    rdzv = Rendezvous(dist.HashStore(), "gloo", prefix="t")
    sw = SimpleNamespace(rendezvous=rdzv, leader=True, active=True, spec=spec,
                         layout=Layout(spec), group=None)
    return LiveControl(sw, requests=True), rdzv


def _recovery(devices: list[str]) -> SwitchResult:
    return SwitchResult(None, {}, {}, "stayed", 3, {
        "failed": ["node1:gpu0", "node1:gpu1"], "mode": "refill", "devices": devices,
        "dst": "tiny tp2", "iteration": 12})


def test_a_notice_whose_devices_failed_first_is_answered_with_the_recovery() -> None:
    control, rdzv = _control()
    dst = load_spec(SPECS / "pp2-dp2.yaml")
    notice = Notice(("node1:gpu0", "node1:gpu1"), dst, time.monotonic() - 2.0, None)
    control._set_pending(_Pending(dst, None, 7, notice))
    control.recovered(_recovery(["node0:gpu0", "node0:gpu1"]))
    got = wait_answer(rdzv.store, 7, timeout=1)
    assert got.outcome == "failed" and got.exit_code == 4
    assert got.line.startswith("failed and rolled back, the job trains on: notice: node1:gpu0, "
                               "node1:gpu1 failed before the switch ran ("), got.line
    assert "s after the notice's deadline)" in got.line
    assert got.line.endswith("; the job recovered by refill on 2 devices (tiny tp2) at "
                             "iteration 12"), got.line
    assert control.pending is None
    assert rdzv.read("current") is not None  # the layout the job runs now, for requests


def test_a_request_whose_switch_never_ran() -> None:
    control, rdzv = _control()
    control._set_pending(_Pending(load_spec(SPECS / "pp2-dp2.yaml"), None, 5))
    control.recovered(None)
    got = wait_answer(rdzv.store, 5, timeout=1)
    assert got.outcome == "failed" and got.line.endswith(
        "a member of the job failed before the switch ran; the job recovered on the devices "
        "left"), got.line
    control.recovered(None)  # nothing pending: nothing more answered
    assert control.pending is None
