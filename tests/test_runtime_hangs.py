"""No hangs and no silent failures: ``run-plan``, the rendezvous and the live example.

Bad ``--timeout``/``--seed`` values are refused with one line before anything forks; a local
process that raises reports its exception; one killed by a signal is named and the others
abort (exit status 4); one that never reports is killed and named; a rendezvous wait names the
devices that did not come; the live example refuses a launch with the wrong number of
processes at once, on every process. Faults are injected by patching ``local.switch`` before
the fork (the forked processes inherit the patch).
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from dynatrain.cli import main
from dynatrain.ir.errors import EXIT_ABORTED, EXIT_BAD_INPUT, DynatrainError
from dynatrain.ir.layout import Layout
from dynatrain.ir.loader import load_spec
from dynatrain.ir.state import transition_views
from dynatrain.planner.pipeline import plan_transition
from dynatrain.runtime import local
from dynatrain.runtime.local import LocalRunAborted, check_run_options, reason, run_local
from dynatrain.runtime.megatron import rendezvous
from dynatrain.runtime.megatron.rendezvous import Rendezvous, RendezvousTimeout
from dynatrain.runtime.megatron.world import _no_votes

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "specs" / "tiny-gpt"
PAIR = [str(TINY / "tp2-dp2.yaml"), str(TINY / "pp2-dp2.yaml")]
EXAMPLE = ROOT / "examples" / "live_switch_gpt.py"


def run_main(argv: list[str], capture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capture.readouterr()
    return code, out, err


def tiny_plan(budget: int = 1 << 20):
    src, dst = Layout(load_spec(PAIR[0])), Layout(load_spec(PAIR[1]))
    sv, dv = transition_views(src, dst)
    return plan_transition(src, dst, budget), sv, dv


def inject(monkeypatch: pytest.MonkeyPatch, victim: str, fault) -> None:
    """Run ``fault(round)`` at the start of every round on ``victim``'s process."""
    real = local.switch

    def switch(plan, sv, dv, device, src, *a, **kw):
        if device == victim:
            kw["on_round"] = fault
        return real(plan, sv, dv, device, src, *a, **kw)

    monkeypatch.setattr(local, "switch", switch)


# ---- options refused before anything forks ---------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e300"])
def test_a_timeout_that_is_no_timeout_is_refused_in_one_line(value: str, capsys) -> None:
    code, out, err = run_main(["run-plan", *PAIR, f"--timeout={value}"], capsys)
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynatrain: error: --timeout: "), err


@pytest.mark.parametrize("value", [str(2**64), "99999999999999999999", "-1"])
def test_a_seed_torch_does_not_take_is_refused_in_one_line(value: str, capsys) -> None:
    code, out, err = run_main(["run-plan", *PAIR, f"--seed={value}"], capsys)
    assert code == EXIT_BAD_INPUT and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynatrain: error: --seed: "), err
    assert value in lines[0]


def test_check_run_options_takes_the_edges_of_the_ranges() -> None:
    check_run_options(0.001, 0)
    check_run_options(1e6, 2**64 - 1)
    for timeout, seed, option in ((math.nan, 0, "--timeout"), (1e-4, 0, "--timeout"),
                                  (True, 0, "--timeout"), (1.0, 2**64, "--seed"),
                                  (1.0, -1, "--seed"), (1.0, 1.5, "--seed")):
        with pytest.raises(DynatrainError, match=f"^{option}: ") as info:
            check_run_options(timeout, seed)
        assert info.value.exit_code == EXIT_BAD_INPUT


# ---- what the parent reports -----------------------------------------------------------------


def test_reason_is_the_type_and_first_line_or_the_type_alone() -> None:
    assert reason(ValueError("cannot convert\nmore")) == "ValueError: cannot convert"
    assert reason(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_a_process_that_raises_reports_why_and_the_run_aborts(monkeypatch, capfd) -> None:
    # Outside the switch (which turns any failure into SwitchAborted): building gpu1's source.
    real = local.fill_from_global

    def fill(view, rank, tensors):
        if rank == 1:
            raise ValueError("injected crash")
        return real(view, rank, tensors)

    monkeypatch.setattr(local, "fill_from_global", fill)
    code, out, err = run_main(["run-plan", *PAIR, "--quiet", "--timeout", "5"], capfd)
    assert code == EXIT_ABORTED, (out, err)
    assert "node0:gpu1 crashed: ValueError: injected crash" in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("dynatrain: error:")]) == 1


def test_a_killed_process_is_named_and_every_survivor_aborts(monkeypatch) -> None:
    plan, sv, dv = tiny_plan()
    assert len(plan.rounds) > 2

    def kill(i: int) -> None:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    inject(monkeypatch, "node0:gpu2", kill)
    with pytest.raises(LocalRunAborted) as info:
        run_local(plan, sv, dv, timeout=5.0)
    err = info.value
    assert err.exit_code == EXIT_ABORTED and err.failed == ("node0:gpu2",)
    assert str(err).startswith("switch aborted: node0:gpu2 died (signal 9); 3 process(es) "
                               "aborted"), err
    by = {r["device"]: r for r in err.results}
    assert by["node0:gpu2"]["died"] == "node0:gpu2 died (signal 9)"
    for d in ("node0:gpu0", "node0:gpu1", "node0:gpu3"):
        assert by[d]["aborted"].startswith("switch aborted in "), by[d]
        assert "report" not in by[d]


def test_run_plan_exits_4_when_a_process_is_killed(monkeypatch, capfd) -> None:
    inject(monkeypatch, "node0:gpu3", lambda i: os.kill(os.getpid(), signal.SIGKILL))
    code, out, err = run_main(["run-plan", *PAIR, "--quiet", "--timeout", "5"], capfd)
    assert code == EXIT_ABORTED, (out, err)
    assert "dynatrain: error: switch aborted: node0:gpu3 died (signal 9)" in err, err


def test_a_process_that_never_reports_is_killed_and_named(monkeypatch) -> None:
    plan, sv, dv = tiny_plan()
    monkeypatch.setattr(local, "GRACE_SECONDS", 1.0)
    inject(monkeypatch, "node0:gpu1", lambda i: time.sleep(3600))
    with pytest.raises(LocalRunAborted) as info:
        run_local(plan, sv, dv, timeout=1.0)
    by = {r["device"]: r for r in info.value.results}
    assert by["node0:gpu1"]["missing"].startswith("node0:gpu1 did not report within 3 s after ")
    assert by["node0:gpu1"]["missing"].endswith("; killed")
    assert info.value.failed == ("node0:gpu1",)
    assert all("aborted" in r for d, r in by.items() if d != "node0:gpu1")


# ---- the rendezvous --------------------------------------------------------------------------


def rdzv(timeout: float = 0.3) -> Rendezvous:
    return Rendezvous(dist.HashStore(), "gloo", prefix="t", timeout=timeout)


def test_forming_a_group_names_who_did_not_come(monkeypatch, caplog) -> None:
    monkeypatch.setattr(rendezvous, "LOG_EVERY", 0.05)
    r = rdzv(0.4)
    r.store.set("arrived/g/node0:gpu1", "1")  # gpu1 came, gpu2 and gpu3 never do
    devices = ["node0:gpu0", "node0:gpu1", "node0:gpu2", "node0:gpu3"]
    with caplog.at_level(logging.INFO, logger="dynatrain.runtime"):
        with pytest.raises(RendezvousTimeout) as info:
            r.form("g", devices, "node0:gpu0")
    assert info.value.missing == ("node0:gpu2", "node0:gpu3")
    assert str(info.value) == ("forming group 'g': 2 of 4 device(s) did not come within 0.4 s: "
                               "node0:gpu2, node0:gpu3")
    assert info.value.exit_code == EXIT_ABORTED
    assert not dist.is_initialized()
    assert "still waiting for node0:gpu2, node0:gpu3" in caplog.text


def test_a_vote_names_who_did_not_vote(caplog) -> None:
    r = rdzv()
    r.post("v/node0:gpu1", {"outcome": "ok"})
    with caplog.at_level(logging.WARNING, logger="dynatrain.runtime"):
        votes = r.vote("v", ["node0:gpu0", "node0:gpu1", "node0:gpu2"], "node0:gpu0", "ok")
    assert votes == {"node0:gpu0": "ok", "node0:gpu1": "ok", "node0:gpu2": None}
    assert "vote 'v': 1 of 3 device(s) did not come within 0.3 s: node0:gpu2" in caplog.text
    with pytest.raises(RendezvousTimeout, match="no commit vote within 0.3 s from node0:gpu2$"):
        _no_votes(votes, "commit", 0.3)


def test_a_wait_names_who_was_to_post() -> None:
    with pytest.raises(RendezvousTimeout) as info:
        rdzv().wait("go/1", 0.1, who=["node0:gpu0"])
    assert "(to be posted by node0:gpu0)" in str(info.value)
    assert info.value.missing == ("node0:gpu0",)


# ---- the live example ------------------------------------------------------------------------


def _example(env: dict[str, str]) -> subprocess.CompletedProcess:
    keep = {k: v for k, v in os.environ.items() if k not in (
        "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    # The timeout only keeps a regression from hanging the suite.
    return subprocess.run([sys.executable, str(EXAMPLE)], env={**keep, **env}, text=True,
                          capture_output=True, timeout=120)


def test_the_example_refuses_the_wrong_number_of_processes_on_every_process() -> None:
    got = [_example({"LOCAL_RANK": str(i), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
           for i in range(2)]
    assert [p.returncode for p in got] == [EXIT_BAD_INPUT, EXIT_BAD_INPUT]
    assert got[0].stdout == "" and got[1].stdout == "" and got[1].stderr == ""
    assert got[0].stderr.splitlines() == [
        "live_switch_gpt.py needs 8 processes (got 2): torchrun --nproc-per-node 8 "
        "examples/live_switch_gpt.py"]
    alone = _example({})
    assert alone.returncode == EXIT_BAD_INPUT and len(alone.stderr.splitlines()) == 1
    assert "started by torchrun" in alone.stderr


def _example_head() -> dict:
    """The example's definitions above its launch check (they import neither torch nor
    megatron), as a namespace."""
    text = EXAMPLE.read_text(encoding="utf-8")
    head = text.split('\nif __name__ == "__main__":\n    ARGS')[0]
    ns: dict = {"__name__": "live_switch_gpt_head", "__doc__": None}
    exec(compile(head, str(EXAMPLE), "exec"), ns)  # noqa: S102 — our own example's source
    return ns


def test_the_example_hides_only_the_named_library_warnings() -> None:
    ns = _example_head()
    assert ns["launch_problem"]({"LOCAL_RANK": "0", "WORLD_SIZE": "8",
                                 "LOCAL_WORLD_SIZE": "8"}) is None
    assert "got 4 per node" in ns["launch_problem"]({"LOCAL_RANK": "0", "WORLD_SIZE": "8",
                                                     "LOCAL_WORLD_SIZE": "4"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        ns["quiet_library_warnings"]()
        for message, category, module in (
                ("Apex is not installed. Falling back to Torch Norm", UserWarning,
                 "megatron.core.models.backends"),
                ("Transformer Engine and Apex are not installed. Falling back", UserWarning,
                 "megatron.core.optimizer.clip_grads"),
                ("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning,
                 "torch.distributed.c10d_logger"),
                # still shown: another module, another category, another message
                ("Apex is not installed. Falling back to Torch Norm", UserWarning, "mine"),
                ("Apex is not installed.", DeprecationWarning, "megatron.core.x"),
                ("something else", UserWarning, "megatron.core.optimizer")):
            warnings.warn_explicit(message, category, "f.py", 1, module=module)
    assert [(str(w.message), w.category) for w in seen] == [
        ("Apex is not installed. Falling back to Torch Norm", UserWarning),
        ("Apex is not installed.", DeprecationWarning),
        ("something else", UserWarning)]


def test_progress_is_a_rich_bar_when_stderr_is_a_terminal(monkeypatch, capsys) -> None:
    # Not a terminal, process 0 logs one line per round instead (tests/test_cli_run_plan.py).
    plan, _, _ = tiny_plan()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = local._Progress(plan)
    assert bar.on_round is not None
    bar.on_round(3)
    bar.done()
    bar.close()
    n = len(plan.rounds)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().err)  # no colours
    assert f"{n}/{n} rounds" in shown and "switching" in shown
