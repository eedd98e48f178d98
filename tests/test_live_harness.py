"""The forked-worker harnesses. ``megatron_support.live.run_workers`` starts its workers once
more only when their own gloo group failed to connect, before the test's function ran; a
failure inside the function is reported, never retried. ``elastic.run_processes`` tells a
process killed on purpose from a failed one by one reading of its exit status."""

from __future__ import annotations

import os
import signal
import time
import types

import pytest
import torch.distributed as dist

from megatron_support import elastic, live


def test_a_group_that_failed_to_connect_is_formed_again(tmp_path, monkeypatch) -> None:
    failed = tmp_path / "failed"
    real = dist.init_process_group

    def flaky(*args, **kwargs):
        # The first worker to get here, in the first start only, fails to connect; which one
        # it is and whether its peer reaches here before being stopped is left to the race.
        try:
            with open(failed, "x"):
                pass
        except FileExistsError:
            return real(*args, **kwargs)
        raise RuntimeError("Gloo connectFullMesh failed (injected)")

    monkeypatch.setattr(dist, "init_process_group", flaky)  # forked workers inherit it
    assert live.run_workers(lambda rank: rank * 10, 2, timeout=60) == [0, 10]
    assert failed.exists()  # the first start did fail, so the answer came from the second


def test_a_failure_in_the_function_is_not_retried(tmp_path) -> None:
    runs = tmp_path / "runs"

    def fn(rank: int) -> None:
        with open(runs, "a") as f:
            f.write("x")
        dist.barrier()  # both have run before either fails (a failure stops its peer)
        raise ValueError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        live.run_workers(fn, 2, timeout=60)
    assert len(runs.read_text()) == 2


def test_a_process_that_may_die_is_not_reported_failed_when_its_end_is_seen_late(
        monkeypatch) -> None:
    # Whether a process has ended can change between two readings of its exit status. Here
    # the first reading after the end still says "running", as one taken just before it would:
    # the harness must decide on one reading, else a process killed on purpose counts as
    # neither killed nor running.
    real = elastic.multiprocessing.get_context("fork")

    class SeenLate(real.Process):
        seen = False

        @property
        def exitcode(self):
            code = super().exitcode
            if code is None or self.seen:
                return code
            self.seen = True
            return None

    monkeypatch.setattr(elastic.multiprocessing, "get_context",
                        lambda method: types.SimpleNamespace(Process=SeenLate))

    def victim(store) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def survivor(store) -> int:
        time.sleep(1.0)  # the harness reads the dead victim's status many times meanwhile
        return 7

    got = elastic.run_processes({"victim": victim, "survivor": survivor}, may_die=("victim",),
                                timeout=60)
    assert got == {"survivor": 7}
