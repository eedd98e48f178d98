"""A switch whose destination's world is made ahead with joiners (``groups_ahead.Joinworld``)
is built ahead only once that world is ready: until then ``LiveControl`` does not hold the
job's boundaries waiting for the joiners, the job trains on; after ``timeout`` seconds the
build ahead runs anyway (and waits for them, as it does). Without processes: a stand-in
switcher, every agreement of the job's processes its own flag."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.runtime.megatron.control import LiveControl, _Pending
from dynatrain.runtime.megatron.job import Notice

SPECS = Path(__file__).resolve().parents[1] / "specs" / "tiny-gpt"


def _control(timeout: float = 60.0) -> tuple[LiveControl, SimpleNamespace]:
    spec = load_spec(SPECS / "tp2-dp2.yaml")
    sw = SimpleNamespace(rendezvous=None, leader=True, active=True, spec=spec,
                         layout=Layout(spec), group=None, timeout=timeout, settled=False,
                         builds=[])
    sw.ready = lambda: True
    sw.ahead_settled = lambda: sw.settled
    sw.build_ahead = lambda job: sw.builds.append(job)  # None: built
    control = LiveControl(sw, requests=False)
    control._everyone = lambda flag: flag  # one process: its flag is everyone's
    return control, sw


def test_a_requested_join_trains_on_until_the_joiners_made_the_world() -> None:
    control, sw = _control()
    control._set_pending(_Pending(load_spec(SPECS / "pp2-dp2.yaml"), None, 3))
    job = object()
    assert [control.due(it, job) for it in (1, 2)] == [False, False]
    assert sw.builds == []  # the boundaries did not wait, nothing was built
    sw.settled = True
    assert control.due(3, job) is False and sw.builds == [job]  # built at this boundary
    assert control.due(4, job) is True  # ... and switches at the next


def test_the_build_ahead_runs_anyway_once_the_wait_is_over() -> None:
    control, sw = _control(timeout=0.05)
    control._set_pending(_Pending(load_spec(SPECS / "pp2-dp2.yaml"), None, 3))
    assert control.due(1, None) is False and sw.builds == []
    time.sleep(0.1)
    assert control.due(2, None) is False and sw.builds == [None]
    assert control.due(3, None) is True


def test_a_scheduled_join_is_built_ahead_once_ready_and_switches_when_due() -> None:
    control, sw = _control()
    control._set_pending(_Pending(load_spec(SPECS / "pp2-dp2.yaml"), 7, None))
    job = object()
    assert [control.due(it, job) for it in (3, 4)] == [False, False] and sw.builds == []
    sw.settled = True
    assert control.due(5, job) is False and sw.builds == [job]
    assert control.due(6, job) is False and control.due(7, job) is True and sw.builds == [job]


def test_a_scheduled_join_builds_at_the_last_boundary_before_it_whatever_the_joiners() -> None:
    control, sw = _control()
    control._set_pending(_Pending(load_spec(SPECS / "pp2-dp2.yaml"), 6, None))
    assert [control.due(it, None) for it in (3, 4)] == [False, False] and sw.builds == []
    assert control.due(5, None) is False and sw.builds == [None]  # waits for them there
    assert control.due(6, None) is True


def test_a_notice_is_built_at_once_whatever_the_world_made_ahead() -> None:
    # A notice has a deadline: it does not train on waiting (its build ahead waits instead).
    control, sw = _control()
    control.iteration_seconds = 0.01
    dst = load_spec(SPECS / "pp2-dp2.yaml")
    notice = Notice(("node0:gpu2", "node0:gpu3"), dst, time.monotonic() + 60.0, None)
    control._set_pending(_Pending(dst, None, 4, notice))
    assert control.due(1, None) is False and sw.builds == [None]
    assert control.due(2, None) is True
