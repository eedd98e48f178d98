"""``LiveSwitcher.notice``: a preemption notice that cannot be met as given is refused in one
line (exit status 2) before anything is prepared; one that can is prepared for the suggested
layout on the devices that stay. (The switch it leads to runs in
``test_live_failures.test_a_preemption_notice_is_met_by_a_switch_before_the_deadline``.)"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
import yaml

from dynatrain.ir.errors import DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec, spec_from_dict
from dynatrain.runtime.megatron import LiveSwitcher, Rendezvous
from dynatrain.verify.check import check

SPEC = "specs/tiny-gpt/tp2-dp2.yaml"


@pytest.fixture
def sw(tmp_path):
    spec = load_spec(SPEC)
    rdzv = Rendezvous(dist.FileStore(str(tmp_path / "store"), -1), "gloo", prefix="n")
    out = LiveSwitcher(spec, Layout(spec).devices[0], lambda s: None, check, rendezvous=rdzv)
    yield out
    out.close()


@pytest.mark.parametrize("leaving, deadline, says", [
    (["node0:gpu3"], 0.0, "the deadline has already passed"),
    (["node0:gpu3"], -5.0, "the deadline has already passed"),
    (["node0:gpu3"], float("nan"), "the deadline has already passed"),
    (["node7:gpu0"], 30.0, "node7:gpu0 is not a device of the job"),
    ([], 30.0, "no device named"),
    ([f"node0:gpu{i}" for i in range(4)], 30.0, "every device of the job leaves"),
    ("node0:gpu3", 30.0, "expected device names, a list (got the string 'node0:gpu3')"),
    ([["node0:gpu3"]], 30.0, "device names are strings like 'node3:gpu5' (got ['node0:gpu3'])"),
    (["node0:gpu3"], "30", "expected the seconds left, a number (got str)"),
    (["node0:gpu3"], True, "expected the seconds left, a number (got bool)"),
    (["node0:gpu3"], None, "expected the seconds left, a number (got NoneType)"),
])
def test_a_notice_that_cannot_be_met_is_refused_in_one_line(sw, leaving, deadline, says):
    with pytest.raises(DynatrainError) as err:
        sw.notice(leaving, deadline)
    assert says in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 2
    assert not sw.ready()  # nothing prepared


def test_a_notice_prepares_the_suggested_layout_and_a_second_one_meanwhile_is_refused(sw):
    hold = threading.Event()
    real = sw._prepare

    def slow(*args):
        hold.wait(30)
        return real(*args)

    sw._prepare = slow
    n = sw.notice(["node0:gpu3", "node0:gpu3"], 30.0)
    assert n.leaving == ("node0:gpu3",) and n.fits() and 0 < n.seconds_left() <= 30
    assert "node0:gpu3" not in Layout(n.dst_spec).devices
    assert len(Layout(n.dst_spec).devices) == 3 and n.predicted_seconds > 0
    with pytest.raises(DynatrainError, match="already being prepared"):
        sw.notice(["node0:gpu2"], 30.0)
    hold.set()
    prepared = sw._pending.result(timeout=60)
    assert prepared.dst_spec == n.dst_spec and prepared.plan is not None


def test_a_notice_for_half_of_a_100k_device_job_is_checked_in_linear_time():
    # Every process of the job checks the notice at a boundary: the devices are looked up in
    # sets (a tuple scan per device took minutes at this size).
    doc = yaml.safe_load(open(SPEC, encoding="utf-8"))
    doc["world"] = {"nodes": 12_500, "gpus_per_node": 8}
    spec = spec_from_dict(doc)
    big = LiveSwitcher(spec, Layout(spec).devices[0], lambda s: None, check)
    try:
        doc["world"] = {"nodes": 6_250, "gpus_per_node": 8, "first_node": 6_250}
        dst = spec_from_dict(doc)
        leaving = [f"node{i}:gpu{j}" for i in range(6_250) for j in range(8)]
        n = big.check_notice(leaving, 30.0, dst_spec=dst)
        assert n.leaving == tuple(leaving) and n.dst_spec is dst
    finally:
        big.close()
